"""Timing: one protocol for every benchmark, tool and audit that times a callable.

Each measure takes named callables, runs a warm-up that is not timed (compilation, plans, the allocator's blocks),
then times them in interleaved rounds so drift (clocks, heat, other load) hits all alike, and summarises each
callable's samples as a ``Timing``: median with p20/p80, in microseconds.

- ``time_host``: host time per call, the Python time until a call's work is queued. On CUDA each burst of calls is
  queued behind a GPU sleep, so no call waits for the GPU, and a burst is short enough that the launch queue is
  never full; the queue is drained between bursts.
- ``time_back_to_back``: eager time per call: a burst of back-to-back calls started on an idle GPU, CUDA events
  around it, divided by the calls. What an eager user feels: the larger of host time and GPU time per call.
- ``time_interleaved``: kernel time per call, one call between CUDA events with the L2 flushed before it
  (``triton.testing.do_bench``).
- ``time_graphs``: GPU time per call from CUDA-graph replays, free of host time; callers rotate operand copies
  larger than the L2 through the captured calls where a call's operands would otherwise stay cached.
- ``phase_samples_ms``: back-to-back time of each phase of a call (a step's forward and backward), between marks
  the call makes: the samples, which a caller summarises (after taking the slowest rank's, for instance).

On CUDA the SM clock NVML reports is polled while GPU-timed samples run: under its power cap an H200's SM clock
falls from 1980 MHz to about 1500 MHz, so a time is reported with the clock it ran at. On the CPU every sample is
wall-clock time (or the clock a caller passes, e.g. this thread's CPU time); on the interpreter backend that is CPU
emulation: useful only to prove the plumbing, never a speed result (reports say so). There are no CUDA graphs on the
CPU: ``time_graphs`` times the calls eagerly and can refuse what a capture would refuse.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    sm_clock_mhz: float | None = None  # median SM clock polled during the samples; None: CPU or no NVML

    @classmethod
    def from_samples_ms(cls, samples_ms: list[float], clocks_mhz: list[float] | None = None) -> "Timing":
        if not samples_ms:
            raise ValueError("no timing samples")
        us = sorted(s * 1e3 for s in samples_ms)
        q = statistics.quantiles(us, n=10, method="inclusive") if len(us) > 1 else [us[0]] * 9
        clock = statistics.median(clocks_mhz) if clocks_mhz else None
        return cls(median_us=statistics.median(us), p20_us=q[1], p80_us=q[7], samples=len(us), sm_clock_mhz=clock)


@functools.lru_cache(maxsize=None)
def _nvml_handle(bus_id: str):
    """(pynvml, the device's NVML handle), NVML initialised once per process; None without NVML."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
    except Exception:  # noqa: BLE001 - no NVML: the timings carry no clock (sm_clock_mhz None)
        return None


class SmClock:
    """Polls one CUDA device through NVML on a thread while ``sampling`` is active: its SM clock
    (``read_clock``), or its clock, power draw and clock-event reasons (``read_state``)."""

    def __init__(self, device: torch.device, period_s: float = 0.005):
        from detkit.toolkit.env import cuda_pci_bus_id

        self.period_s = period_s
        bus_id = cuda_pci_bus_id(torch.cuda.get_device_properties(device))
        found = _nvml_handle(bus_id) if bus_id is not None else None
        self.nvml, self.handle = found if found is not None else (None, None)

    def read_clock(self) -> float:
        return float(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))

    def read_state(self) -> tuple[float, float, int]:
        """(SM clock MHz, power draw W, clock-event reasons bitmask: 0x4 is the software power cap)."""
        return (self.read_clock(), self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
                self.nvml.nvmlDeviceGetCurrentClocksEventReasons(self.handle))

    @contextmanager
    def sampling(self, into: list, read: Callable[[], object] | None = None):
        """Append ``read()`` (default: the SM clock in MHz) to ``into`` every ``period_s`` until the block
        exits; nothing without NVML."""
        if self.handle is None:
            yield
            return
        read = read or self.read_clock
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                into.append(read())
                stop.wait(self.period_s)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def _cpu_samples_ms(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def _entered(contexts: dict[str, Callable[[], AbstractContextManager]] | None, name: str) -> AbstractContextManager:
    return contexts[name]() if contexts and name in contexts else nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_range(range_names: dict[str, str | tuple[str, ...]] | None, name: str) -> AbstractContextManager:
    """The NVTX range(s) around a callable's timed samples: ``range_names[name]``, a name or nested names
    (outermost first); none when not given."""
    from contextlib import ExitStack

    from detkit.toolkit.nvtx_ranges import nvtx_range

    labels = (range_names or {}).get(name)
    if labels is None:
        return nullcontext()
    stack = ExitStack()
    for label in (labels,) if isinstance(labels, str) else labels:
        stack.enter_context(nvtx_range(label))
    return stack


def call_refusal(exc: BaseException) -> str:
    """The one-line reason a timed call raised."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def _warm(fns: dict[str, Callable[[], object]], device: torch.device, calls: int,
          contexts: dict[str, Callable[[], AbstractContextManager]] | None,
          errors: dict[str, str] | None) -> dict[str, Callable[[], object]]:
    """``calls`` untimed calls of each fn in its context; the fns left to time (with ``errors``, a fn that raised is
    dropped and ``errors[name]`` says why, else the error is raised)."""
    live = dict(fns)
    for name, fn in fns.items():
        try:
            with _entered(contexts, name):
                for _ in range(calls):
                    fn()
        except Exception as exc:  # noqa: BLE001 - reported by name when the caller asks (errors), else raised
            if errors is None:
                raise
            errors[name] = call_refusal(exc)
            del live[name]
    _sync(device)
    return live


HOST_CALLS = 16  # calls per host-timing burst by default: far below the launch queue's depth
HOST_SLEEP_S = 0.01  # the GPU sleep a host burst is queued behind (longer than a burst's host time)


def host_samples_ms(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5,
                    calls: int = HOST_CALLS, *, per_call: bool = True, warmup: int = 2,
                    clock: Callable[[], float] = time.perf_counter, gpu_sleep_s: float = HOST_SLEEP_S,
                    contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
                    range_names: dict[str, str | tuple[str, ...]] | None = None,
                    errors: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Host time per call, in ms: the samples of ``time_host``.

    Per round and fn, one burst of ``calls`` calls inside ``contexts[name]()`` and the NVTX range
    ``range_names[name]``; on CUDA the burst is queued behind a GPU sleep of ``gpu_sleep_s`` (0: none, the burst
    starts on an idle GPU, for bursts of more launches than the queue holds behind a sleep) and the queue is drained
    after it. ``per_call``: each call timed alone (``calls`` samples per burst), else one sample per burst, its mean
    per call (for calls shorter than ``clock`` resolves). ``errors``: None, a raising call raises; a dict, the fn is
    dropped from the result and ``errors[name]`` says why in one line."""
    if calls < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"calls and rounds must be >= 1 and warmup >= 0; got calls={calls}, rounds={rounds}, "
                         f"warmup={warmup}")
    live = _warm(fns, device, warmup, contexts, errors)
    samples: dict[str, list[float]] = {name: [] for name in live}
    cuda = device.type == "cuda"
    for _ in range(rounds):
        for name, fn in list(live.items()):
            burst: list[float] = []
            try:
                with _entered(contexts, name):
                    if cuda and gpu_sleep_s > 0:
                        torch.cuda._sleep(int(gpu_sleep_s * 2e9))  # cycles at up to ~2 GHz
                    with _timed_range(range_names, name):
                        if per_call:
                            for _ in range(calls):
                                start = clock()
                                fn()
                                burst.append((clock() - start) * 1e3)
                        else:
                            start = clock()
                            for _ in range(calls):
                                fn()
                            burst.append((clock() - start) * 1e3 / calls)
            except Exception as exc:  # noqa: BLE001 - as in the warm-up
                if errors is None:
                    raise
                errors[name] = call_refusal(exc)
                del live[name], samples[name]
            else:
                samples[name] += burst
            _sync(device)
    return samples


def time_host(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5, calls: int = HOST_CALLS,
              **kwargs) -> dict[str, Timing]:
    """Host time per call (``host_samples_ms``, whose keyword arguments it takes): median with p20/p80."""
    return {name: Timing.from_samples_ms(s)
            for name, s in host_samples_ms(fns, device, rounds, calls, **kwargs).items()}


def back_to_back_samples_ms(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5, *,
                            calls_per_fn: int = 1, passes: int = 1, samples_per_round: int = 1, warmup: int = 1,
                            clock: Callable[[], float] = time.perf_counter,
                            contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
                            range_names: dict[str, str | tuple[str, ...]] | None = None,
                            before_sample: Callable[[], None] | None = None, alternate: bool = False,
                            clocks: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Eager time per call of back-to-back calls, in ms: the samples of ``time_back_to_back``.

    A sample: ``before_sample()`` (e.g. a barrier of the ranks), the device drained, then ``passes`` calls of the fn
    back to back between CUDA events (``clock`` on the CPU), divided by ``passes * calls_per_fn`` (a fn may make
    several calls, e.g. one per rotating operand set). Per round and fn, ``samples_per_round`` samples inside
    ``contexts[name]()`` and the NVTX range ``range_names[name]``; ``alternate`` reverses the fns' order every other
    round. ``clocks`` (CUDA): the SM clock polled during each fn's samples lands in ``clocks[name]``."""
    if min(calls_per_fn, passes, samples_per_round, rounds) < 1 or warmup < 0:
        raise ValueError(f"calls_per_fn, passes, samples_per_round and rounds must be >= 1 and warmup >= 0; got "
                         f"{calls_per_fn}, {passes}, {samples_per_round}, {rounds}, {warmup}")
    live = _warm(fns, device, warmup, contexts, None)
    samples: dict[str, list[float]] = {name: [] for name in live}
    cuda = device.type == "cuda"
    sm_clock = SmClock(device) if cuda and clocks is not None else None
    if cuda:
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    names = list(live)
    for r in range(rounds):
        for name in (names[::-1] if alternate and r % 2 else names):
            fn = live[name]
            polled = sm_clock.sampling(clocks.setdefault(name, [])) if sm_clock is not None else nullcontext()
            with _entered(contexts, name), _timed_range(range_names, name), polled:
                for _ in range(samples_per_round):
                    if before_sample is not None:
                        before_sample()
                    if cuda:
                        _sync(device)
                        start_ev.record()
                        for _ in range(passes):
                            fn()
                        end_ev.record()
                        end_ev.synchronize()
                        elapsed_ms = start_ev.elapsed_time(end_ev)
                    else:
                        start = clock()
                        for _ in range(passes):
                            fn()
                        elapsed_ms = (clock() - start) * 1e3
                    samples[name].append(elapsed_ms / (passes * calls_per_fn))
    return samples


def time_back_to_back(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5,
                      **kwargs) -> dict[str, Timing]:
    """Eager time per call of back-to-back calls (``back_to_back_samples_ms``, whose keyword arguments it takes,
    ``clocks`` aside): median with p20/p80, and on CUDA the SM clock polled during the samples."""
    clocks: dict[str, list[float]] = {}
    samples = back_to_back_samples_ms(fns, device, rounds, clocks=clocks, **kwargs)
    return {name: Timing.from_samples_ms(s, clocks.get(name)) for name, s in samples.items()}


def _no_mark() -> None:
    return None


def _marker(cuda: bool, clock: Callable[[], float]) -> tuple[list, Callable[[], None]]:
    """(marks, mark): each ``mark()`` appends a CUDA event recorded on the current stream (``clock()`` on the CPU)."""
    marks: list = []
    if cuda:
        def mark() -> None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
    else:
        def mark() -> None:
            marks.append(clock())
    return marks, mark


def phase_samples_ms(fns: dict[str, Callable[[Callable[[], None]], object]], device: torch.device, rounds: int = 5,
                     *, phases: int, passes: int = 1, warmup: int = 1, clock: Callable[[], float] = time.perf_counter,
                     range_names: dict[str, str | tuple[str, ...]] | None = None,
                     before_sample: Callable[[], None] | None = None,
                     alternate: bool = False) -> dict[str, list[tuple[float, ...]]]:
    """Eager time per call of each phase of back-to-back calls, in ms: ``back_to_back_samples_ms`` for a call whose
    phases are timed apart (a training step's forward and backward).

    Each fn takes ``mark`` and calls it ``phases + 1`` times: before its first phase, between phases, after its last;
    a mark records a CUDA event on the current stream (reads ``clock`` on the CPU). A sample: ``before_sample()``
    (e.g. a barrier of the ranks), the device drained, then ``passes`` calls back to back; phase i's time is the sum
    over the calls of mark i to mark i + 1, divided by ``passes`` (what a call does before its first mark or after
    its last is in no phase). One sample per round and fn, inside the NVTX range ``range_names[name]``;
    ``alternate`` reverses the fns' order every other round; ``warmup`` untimed calls per fn with a mark that
    records nothing. A sample is a tuple of ``phases`` times; a call that marks a different number of times
    raises ValueError."""
    if min(phases, passes, rounds) < 1 or warmup < 0:
        raise ValueError(f"phases, passes and rounds must be >= 1 and warmup >= 0; got {phases}, {passes}, {rounds}, "
                         f"{warmup}")
    _warm({name: functools.partial(fn, _no_mark) for name, fn in fns.items()}, device, warmup, None, None)
    samples: dict[str, list[tuple[float, ...]]] = {name: [] for name in fns}
    cuda = device.type == "cuda"
    names = list(fns)
    for r in range(rounds):
        for name in (names[::-1] if alternate and r % 2 else names):
            marks, mark = _marker(cuda, clock)
            with _timed_range(range_names, name):
                if before_sample is not None:
                    before_sample()
                _sync(device)
                for _ in range(passes):
                    fns[name](mark)
                if cuda and marks:
                    marks[-1].synchronize()
            per_call = phases + 1
            if len(marks) != passes * per_call:
                raise ValueError(f"{name!r}: {len(marks)} marks in {passes} calls; each call must mark {per_call} "
                                 f"times (phases={phases})")
            spans = [0.0] * phases
            for j in range(0, len(marks), per_call):
                for i in range(phases):
                    a, b = marks[j + i], marks[j + i + 1]
                    spans[i] += a.elapsed_time(b) if cuda else (b - a) * 1e3
            samples[name].append(tuple(span / passes for span in spans))
    return samples


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 5,
                     rep_ms: float = 40.0, cpu_reps: int = 1,
                     contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
                     cpu_warmup: bool = True) -> dict[str, Timing]:
    """Time every function in ``rounds`` alternating rounds so drift (clocks, heat) hits all alike.

    ``contexts[name]()`` (optional) is entered around the function's warm-up and around each round's samples, not
    around each call: a state a user enters once (a mode) is not timed. ``cpu_warmup=False`` skips the CPU warm-up
    call (interpreter wall time is plumbing; its calls are slow)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clocks: dict[str, list[float]] = {name: [] for name in fns}
    if device.type == "cuda":
        from triton.testing import do_bench

        _warm(fns, device, 1, contexts, None)  # compilation, autotuning of baselines, allocator
        clock = SmClock(device)
        for _ in range(rounds):
            for name, fn in fns.items():
                with _entered(contexts, name), clock.sampling(clocks[name]):
                    samples[name] += do_bench(fn, warmup=5, rep=rep_ms, return_mode="all")
    else:  # no L2 to flush: each sample is one call alone, as back to back with one call per sample
        samples = back_to_back_samples_ms(fns, device, rounds, samples_per_round=cpu_reps,
                                          warmup=1 if cpu_warmup else 0, contexts=contexts)
    return {name: Timing.from_samples_ms(s, clocks[name]) for name, s in samples.items()}


def capture_refusal(exc: BaseException) -> str:
    """The one-line reason a CUDA-graph capture failed."""
    return f"capture failed: {call_refusal(exc)}"


def time_graphs(fns: dict[str, Callable[[], object]], device: torch.device, calls_per_fn: int,
                rounds: int = 5, replays: int = 10, range_names: dict[str, str] | None = None,
                contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
                errors: dict[str, str] | None = None) -> dict[str, Timing]:
    """Per-call kernel time from CUDA-graph replays, free of Python launch overhead.

    Each ``fn`` issues ``calls_per_fn`` calls over rotating operand sets whose total size exceeds
    the L2, so no call finds its operands cached. One graph per fn is captured after a warm-up, each inside
    ``contexts[name]()`` when given (a mode the calls need; replays need nothing); samples are replay time /
    calls_per_fn, interleaved across fns for ``rounds`` rounds. Each replay runs inside the NVTX range
    ``range_names[name]`` when given.

    ``errors``: None, a failed capture raises; a dict, a fn whose capture fails is left out of the result and
    ``errors[name]`` says why in one line (``capture_refusal``). On the CPU there are no CUDA graphs: the calls
    are timed eagerly (wall time); with ``errors`` each fn's first call runs under ``toolkit.host_reads`` and
    one that reads device data on the host, which a capture refuses, is refused so.
    """
    from detkit.toolkit.nvtx_ranges import nvtx_range

    names = range_names or {}
    if device.type != "cuda":
        return _cpu_graph_stand_in(fns, device, rounds, names, contexts, errors)
    graphs = {}
    stream = torch.cuda.Stream(device)
    for name, fn in fns.items():
        first: list[BaseException] = []  # the call's own error: ending a broken capture raises another one
        try:
            with _entered(contexts, name):
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):  # warm-up off the capture stream, as torch recommends
                    fn()
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    try:
                        fn()
                    except Exception as exc:
                        first.append(exc)
                        raise
        except Exception as exc:  # noqa: BLE001 - reported by name when the caller asks (errors), else raised
            if errors is None:
                raise
            errors[name] = capture_refusal(first[0] if first else exc)
            torch.cuda.synchronize(device)
            continue
        graphs[name] = graph
    torch.cuda.synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    clocks: dict[str, list[float]] = {name: [] for name in graphs}
    clock = SmClock(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()  # untimed replay: the first after another graph pays for its switch
            with nvtx_range(names.get(name, name)), clock.sampling(clocks[name]):
                for _ in range(replays):
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    samples[name].append(start.elapsed_time(end) / calls_per_fn)
    return {name: Timing.from_samples_ms(s, clocks[name]) for name, s in samples.items()}


def _cpu_graph_stand_in(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int,
                        names: dict[str, str], contexts, errors: dict[str, str] | None) -> dict[str, Timing]:
    """time_graphs on the CPU: eager wall time. With ``errors`` the first call of each fn runs under
    ``toolkit.host_reads`` and is its first sample (a refused fn has none); without, time_interleaved's warm-up."""
    from detkit.toolkit.host_reads import host_reads
    from detkit.toolkit.nvtx_ranges import nvtx_range

    def ranged(fn, label):
        def call():
            with nvtx_range(label):
                return fn()
        return call

    calls = {n: ranged(f, names.get(n, n)) for n, f in fns.items()}
    if errors is None:
        return time_interleaved(calls, device, rounds=rounds, contexts=contexts)
    samples: dict[str, list[float]] = {}
    for name, call in calls.items():
        with _entered(contexts, name), host_reads() as reads:
            ms = _cpu_samples_ms(call, 1)
        if reads:
            errors[name] = ("capture failed (cpu stand-in): reads device data on the host: "
                            + ", ".join(dict.fromkeys(reads)))[:240]
        else:
            samples[name] = ms
    for _ in range(rounds - 1):
        for name in samples:
            with _entered(contexts, name):
                samples[name] += _cpu_samples_ms(calls[name], 1)
    return {name: Timing.from_samples_ms(s) for name, s in samples.items()}


CEILING_SHAPE = 8192  # dense BF16 ceiling: one M = N = K = 8192 cuBLAS matmul on random data


def measured_ceiling_tflops(device: torch.device, rounds: int = 3) -> float:
    """The dense BF16 ceiling of this GPU in this run: cuBLAS (torch.matmul) at 8192^3, random data,
    TFLOP/s = 2*8192^3 / median time."""
    from detkit.toolkit.fixtures import bf16_randn

    n = CEILING_SHAPE
    a, b = bf16_randn((n, n), 5, device), bf16_randn((n, n), 6, device)
    t = time_interleaved({"ceiling": lambda: a @ b}, device, rounds=rounds)["ceiling"]
    return 2 * n**3 / (t.median_us * 1e-6) / 1e12
