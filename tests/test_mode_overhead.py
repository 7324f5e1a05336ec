"""tools/mode_overhead.py's measure(): each variant (torch's op outside the mode, the direct detkit calls, the op in
the strict mode) timed by toolkit.timing.time_host on its own calls, against calls of known duration; a call that
raises puts its error in its row."""

import time

import torch

from tools import mode_overhead

# Each call spins until this thread has used its duration of CPU time, and measure() reads the same clock
# (time.thread_time): preemption counts on neither side. A burst's mean per call then overruns the duration by the
# spin's last loop turn and a clock read (microseconds): SLACK_US is ten times that. Mixing the variants' calls up
# (the mode entered around the wrong ones) moves a median by 100 us or more.
TORCH_US, DIRECT_US, MODE_US = 200.0, 300.0, 600.0
SLACK_US = 50.0


def spin(us: float) -> None:
    end = time.thread_time() + us / 1e6
    while time.thread_time() < end:
        pass


def test_each_variant_is_timed_on_its_own_calls_and_a_raising_call_is_reported():
    from detkit.mode import state as mode_state

    def torch_call():  # the op: in the strict mode it takes the routed path (here: longer)
        spin(MODE_US if mode_state.active() else TORCH_US)

    def refused_in_the_mode():
        if mode_state.active():
            raise ZeroDivisionError("not routed")

    cases = [mode_overhead.Case("known", "[1]", torch_call, lambda: spin(DIRECT_US)),
             mode_overhead.Case("refused", "[2]", refused_in_the_mode, lambda: None)]
    rows = mode_overhead.measure(cases, calls=4, rounds=3, device=torch.device("cpu"), clock=time.thread_time,
                                 warmup=1)
    known, refused = rows
    for key, want in (("torch_us", TORCH_US), ("direct_us", DIRECT_US), ("mode_us", MODE_US)):
        assert want <= known[key] <= want + SLACK_US, (key, known)
    assert abs(known["mode_minus_direct_us"] - (MODE_US - DIRECT_US)) <= SLACK_US
    assert refused == {"op": "refused", "shape": "[2]", "error": "mode: ZeroDivisionError: not routed"}
