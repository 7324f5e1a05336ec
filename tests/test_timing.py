"""detkit.toolkit.timing: the summary statistics of a timing, the SM clock polled beside it, and the protocol's
measures against callables of known duration (host time per call, eager back-to-back time), their interleaving,
contexts and refusals."""

import gc
import time

import pytest
import torch

from detkit.toolkit.timing import (
    SmClock, Timing, back_to_back_samples_ms, host_samples_ms, measured_ceiling_tflops, phase_samples_ms,
    time_back_to_back, time_host, time_interleaved,
)

CPU = torch.device("cpu")
# The known-duration call spins until this thread has used BUSY_MS of CPU time, and the measures read the same clock
# (time.thread_time): time the thread spends preempted counts on neither side, so a loaded machine changes nothing.
# Every sample is then at least BUSY_MS and overruns it by the spin's last loop turn and one clock read, microseconds.
# The garbage collector can spend this thread's time mid-sample (a CI run saw +0.33 ms on one sample), so it is off
# while these tests run; SLACK_MS is 100 times the spin's overrun. A wrong protocol is off by far more: a burst's total
# as one call's time (x calls), a call left out or counted twice (+-BUSY_MS / calls per sample, 0.5 ms or more
# here), ms for us (x1000).
BUSY_MS = 2.0
SLACK_MS = 0.2


@pytest.fixture(autouse=True)
def _no_garbage_collection():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def busy(ms: float):
    """A call that spins until this thread has used ``ms`` milliseconds of CPU time."""
    def call():
        end = time.thread_time() + ms / 1e3
        while time.thread_time() < end:
            pass
    return call


def within_busy(t: Timing, ms: float = BUSY_MS) -> bool:
    return ms * 1e3 <= t.p20_us <= t.median_us <= (ms + SLACK_MS) * 1e3


def test_summary_statistics_and_clock_median():
    t = Timing.from_samples_ms([0.003, 0.001, 0.002, 0.010, 0.004], clocks_mhz=[1980.0, 1500.0, 1755.0])
    assert (t.median_us, t.samples, t.sm_clock_mhz) == (pytest.approx(3.0), 5, 1755.0)
    # Inclusive quantiles of the sorted samples 1, 2, 3, 4, 10 us: p20 at rank 0.8 (1 + 0.8 * (2 - 1)) and
    # p80 at rank 3.2 (4 + 0.2 * (10 - 4)).
    assert (t.p20_us, t.p80_us) == (pytest.approx(1.8), pytest.approx(5.2))
    assert Timing.from_samples_ms([0.001]).sm_clock_mhz is None  # no clock polled (CPU, or no NVML)
    with pytest.raises(ValueError, match="no timing samples"):
        Timing.from_samples_ms([])


def test_cpu_timings_carry_no_clock():
    timings = time_interleaved({"sum": lambda: sum(range(100))}, torch.device("cpu"), rounds=2, cpu_reps=3)
    assert timings["sum"].samples == 6 and timings["sum"].sm_clock_mhz is None


@pytest.mark.gpu
def test_sm_clock_is_polled_while_a_gpu_timing_runs():
    device = torch.device("cuda")
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    timings = time_interleaved({"mm": lambda: a @ a}, device, rounds=1, rep_ms=50.0)
    clock = timings["mm"].sm_clock_mhz
    assert clock is not None and 200.0 <= clock <= 3000.0, clock  # an H100/H200 SM clock in MHz
    polled: list[float] = []
    with SmClock(device, period_s=0.001).sampling(polled):
        torch.cuda._sleep(50_000_000)
        torch.cuda.synchronize()
    assert polled and all(200.0 <= c <= 3000.0 for c in polled)


@pytest.mark.gpu
def test_measured_ceiling_is_a_hopper_dense_bf16_rate():
    # H100/H200 dense BF16: 989 TFLOP/s on the datasheet, 650-800 measured by cuBLAS at 8192^3.
    assert 300.0 < measured_ceiling_tflops(torch.device("cuda")) < 1000.0


def test_cpu_graph_stand_in_refuses_a_host_read_and_enters_contexts():
    # On the CPU there are no CUDA graphs: a call that reads a value back (what a capture refuses) is left out with
    # the reason, the others are timed (their first call is the checked one), each inside its context.
    from contextlib import contextmanager

    from detkit.toolkit.timing import time_graphs

    entered = []

    @contextmanager
    def mode():
        entered.append(True)
        yield

    x = torch.arange(6.0)
    errors: dict[str, str] = {}
    timings = time_graphs({"reads": lambda: int(x.sum()), "plain": lambda: x * 2}, torch.device("cpu"),
                          calls_per_fn=1, rounds=3, contexts={"plain": mode}, errors=errors)
    assert list(timings) == ["plain"] and timings["plain"].samples == 3 and len(entered) == 3
    assert list(errors) == ["reads"] and "aten._local_scalar_dense" in errors["reads"]
    plain = time_graphs({"reads": lambda: int(x.sum())}, torch.device("cpu"), calls_per_fn=1, rounds=1)
    assert plain["reads"].samples == 1  # without ``errors``: timed eagerly, nothing checked
    # Under torch.inference_mode (a decode step's) a value is read as aten.item: refused all the same.

    def reads_in_inference():
        with torch.inference_mode():
            return float(x.sum())
    errors = {}
    assert time_graphs({"reads": reads_in_inference}, torch.device("cpu"), calls_per_fn=1, rounds=1,
                       errors=errors) == {}
    assert errors == {"reads": "capture failed (cpu stand-in): reads device data on the host: aten.item.default"}


# --------------------------------------------------------------------------------------------- the protocol's measures
def test_host_time_per_call_is_a_known_calls_duration():
    timed = time_host({"busy": busy(BUSY_MS)}, CPU, rounds=3, calls=4, clock=time.thread_time)["busy"]
    assert timed.samples == 12 and within_busy(timed), timed  # each call timed alone: 4 samples per burst
    mean = time_host({"busy": busy(BUSY_MS)}, CPU, rounds=3, calls=4, per_call=False, clock=time.thread_time)["busy"]
    assert mean.samples == 3 and within_busy(mean), mean  # one sample per burst: its mean per call


def test_host_time_reads_the_clock_it_is_given():
    # time.sleep suspends the thread: wall time (the default clock) counts at least the sleep, this thread's CPU time
    # only the syscall (microseconds).
    nap = lambda: time.sleep(BUSY_MS / 1e3)  # noqa: E731
    wall = time_host({"nap": nap}, CPU, rounds=2, calls=3)["nap"]
    cpu_time = time_host({"nap": nap}, CPU, rounds=2, calls=3, clock=time.thread_time)["nap"]
    assert wall.median_us >= BUSY_MS * 1e3 and cpu_time.median_us < BUSY_MS * 1e3 / 4, (wall, cpu_time)


def test_back_to_back_time_divides_by_every_call_and_interleaves_in_alternate_order():
    entered, barriers = [], []

    def context_of(name):
        class Recorded:
            def __enter__(self):
                entered.append(name)

            def __exit__(self, *exc):
                return False
        return Recorded

    # Each fn makes two calls of BUSY_MS (calls_per_fn=2); a sample is 3 of them back to back (passes=3).
    pair = busy(BUSY_MS)
    fns = {"a": lambda: (pair(), pair()), "b": lambda: (pair(), pair())}
    samples = back_to_back_samples_ms(fns, CPU, rounds=2, calls_per_fn=2, passes=3, samples_per_round=2,
                                      contexts={n: context_of(n) for n in fns}, alternate=True,
                                      before_sample=lambda: barriers.append(True), clock=time.thread_time)
    # Warm-up a, b; then round 0 in order and round 1 reversed, each fn's samples of a round inside its context.
    assert entered == ["a", "b", "a", "b", "b", "a"] and len(barriers) == 8
    for name, ms in samples.items():
        assert len(ms) == 4 and within_busy(Timing.from_samples_ms(ms)), (name, ms)
    timed = time_back_to_back({"a": fns["a"]}, CPU, rounds=1, calls_per_fn=2, samples_per_round=3,
                              clock=time.thread_time)["a"]
    assert timed.samples == 3 and within_busy(timed) and timed.sm_clock_mhz is None  # no clock on the CPU


def test_phase_time_is_each_phase_between_marks_per_call_in_alternate_order():
    order, barriers = [], []

    def step(name, set_up_ms, phase_ms):
        """A call that spends ``set_up_ms`` before its first mark (in no phase), then each of ``phase_ms``."""
        def call(mark):
            order.append(name)
            busy(set_up_ms)()
            mark()
            for ms in phase_ms:
                busy(ms)()
                mark()
        return call

    fns = {"a": step("a", BUSY_MS, (BUSY_MS, 2 * BUSY_MS)), "b": step("b", 0.0, (2 * BUSY_MS, BUSY_MS))}
    samples = phase_samples_ms(fns, CPU, rounds=2, phases=2, passes=3, warmup=1, clock=time.thread_time,
                               before_sample=lambda: barriers.append(True), alternate=True)
    # Warm-up a, b (one call each); round 0 in order, round 1 reversed: 3 calls per sample.
    assert order == ["a", "b"] + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3 and len(barriers) == 4
    wants = {"a": (BUSY_MS, 2 * BUSY_MS), "b": (2 * BUSY_MS, BUSY_MS)}
    for name, per_sample in samples.items():
        assert len(per_sample) == 2, (name, per_sample)
        for phase, want in enumerate(wants[name]):
            assert within_busy(Timing.from_samples_ms([s[phase] for s in per_sample]), want), (name, per_sample)
    with pytest.raises(ValueError, match="'short': 2 marks in 1 calls; each call must mark 3 times"):
        phase_samples_ms({"short": lambda mark: (mark(), mark())}, CPU, rounds=1, phases=2)


def test_a_call_that_raises_is_reported_by_name_or_raised():
    state = {"calls": 0}

    def third_call_fails():  # passes the warm-up (2 calls), fails in the first timed burst
        state["calls"] += 1
        if state["calls"] == 3:
            raise ZeroDivisionError("division by zero\nsecond line")
    errors: dict[str, str] = {}
    samples = host_samples_ms({"ok": busy(0.1), "late": third_call_fails, "now": lambda: 1 / 0}, CPU, rounds=2,
                              calls=2, errors=errors)
    assert list(samples) == ["ok"] and len(samples["ok"]) == 4
    assert errors == {"late": "ZeroDivisionError: division by zero", "now": "ZeroDivisionError: division by zero"}
    with pytest.raises(ZeroDivisionError):
        host_samples_ms({"now": lambda: 1 / 0}, CPU)


@pytest.mark.parametrize("measure, kwargs, message", [
    (host_samples_ms, {"calls": 0}, "calls and rounds must be >= 1 and warmup >= 0; got calls=0, rounds=5, warmup=2"),
    (host_samples_ms, {"warmup": -1}, "got calls=16, rounds=5, warmup=-1"),
    (back_to_back_samples_ms, {"passes": 0}, "calls_per_fn, passes, samples_per_round and rounds must be >= 1 and "
                                             "warmup >= 0; got 1, 0, 1, 5, 1"),
    (phase_samples_ms, {"phases": 0}, "phases, passes and rounds must be >= 1 and warmup >= 0; got 0, 1, 5, 1"),
])
def test_bad_counts_are_refused_before_any_call(measure, kwargs, message):
    calls = []
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        measure({"f": lambda: calls.append(1)}, CPU, **kwargs)
    assert calls == []


@pytest.mark.gpu
def test_host_time_is_queueing_and_back_to_back_time_is_the_gpu_work():
    # A call that queues a GPU sleep of 2e6 cycles: at most 2 GHz, so at least 1 ms on the GPU. Its host time is the
    # launch (microseconds: the burst is queued behind the protocol's own sleep, so nothing waits for the GPU);
    # back to back, each call waits for the one before: per call at least the sleep (10% margin for clock accounting).
    device = torch.device("cuda")
    sleep = lambda: torch.cuda._sleep(2_000_000)  # noqa: E731
    host = time_host({"sleep": sleep}, device, rounds=3, calls=8)["sleep"]
    eager = time_back_to_back({"sleep": sleep}, device, rounds=3, passes=4)["sleep"]
    assert host.median_us < 200.0 and eager.median_us > 900.0, (host, eager)
    assert eager.sm_clock_mhz is None or 200.0 <= eager.sm_clock_mhz <= 3000.0
