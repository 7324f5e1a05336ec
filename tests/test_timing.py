"""detkit.toolkit.timing: the summary statistics of a timing and the SM clock polled beside it."""

import pytest
import torch

from detkit.toolkit.timing import SmClock, Timing, measured_ceiling_tflops, time_interleaved


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
