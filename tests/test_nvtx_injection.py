"""NVTX ranges are proven emitted: a fresh process runs with detkit's own NVTX injection library
(native/nvtx_inject), which logs every push/pop; the log is read back and checked for the
expected names in the detkit domain, balance and nesting. No GPU, no nsys.

WORKLOAD_CMD is the real ``detkit bench gemm`` at one tiny case (interpreter): every row it writes
must be a range of the same name in the detkit domain. AUDIT_CMD runs the real ``detkit audit``
contract plug-in at a two-M test preset: ``audit gemm_contract`` must enclose one ``contract ...``
range per row. A stand-in (STANDIN_CMD) covers what the real workloads do not exercise: ranges on
a second thread, a range left by an exception, and that the checks fail when they should.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from detkit.toolkit import nvtx_ranges
from detkit.toolkit.nvtx_ranges import (
    DOMAIN,
    NvtxEvent,
    check_ranges,
    format_range_name,
    nvtx_range,
    parse_injection_log,
    run_with_injection,
    verify_nvtx_log,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

# The real benchmark at one tiny case; "{out}" becomes a temporary results folder.
WORKLOAD_CMD = [sys.executable, "-m", "detkit", "bench", "gemm", "--device", "cpu", "--ops", "fwd", "--m", "1",
                "--layouts", "linear", "--rounds", "1", "--out", "{out}"]
BENCH_ROW = "det_gemm_fwd [M=1, N=56, K=40] bf16 b=linear"  # bench/gemm.py: BenchCase.name
BENCH_RANGES = [BENCH_ROW, f"{BENCH_ROW} | cublas"]  # the case and its baseline, interleaved
BENCH_STAGE = "bench gemm"  # the runner's range around the whole benchmark (toolkit/benches.py)

# The real audit (contract plug-in) at a test preset of two M values (10 rows; the tiny preset's
# M=4095 cases cost ~30 s in the interpreter). The preset is registered before the CLI runs.
_AUDIT = textwrap.dedent(
    """
    import sys
    from detkit.toolkit.presets import GEMM_PRESETS, GemmPreset
    GEMM_PRESETS["nvtx-ci"] = GemmPreset("nvtx-ci", ((40, 56),), (1, 7), chunk=1000, repetitions=2,
                                         determinism_m=(1,))
    from detkit.toolkit.cli import main
    main(["audit", "--device", "cpu", "--suite", "gemm_contract", "--preset", "nvtx-ci", "--out", sys.argv[1]],
         prog_name="detkit")
    """
)
AUDIT_CMD = [sys.executable, "-c", _AUDIT, "{out}"]
AUDIT_STAGE = "audit gemm_contract"

# A stand-in workload: one case range per shape, with stage ranges nested inside, one case on a
# second thread, and an exception raised inside a range.
_STANDIN = textwrap.dedent(
    """
    import threading
    from detkit.toolkit.nvtx_ranges import nvtx_range, nvtx_enabled

    assert nvtx_enabled(), "injection library did not attach"
    for m in (1, 7):
        with nvtx_range(f"det_gemm_fwd [M={m}, N=64, K=32] bf16"):
            with nvtx_range("validate"):
                pass
            with nvtx_range("time"):
                pass

    def worker():
        with nvtx_range("det_gemm_da [M=129, N=64, K=32] bf16"):
            with nvtx_range("validate"):
                pass

    t = threading.Thread(target=worker)
    t.start()
    t.join()

    try:
        with nvtx_range("det_gemm_db [M=7, N=64, K=32] bf16"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    """
)
STANDIN_CMD = [sys.executable, "-c", _STANDIN]
EXPECTED_RANGES = [
    "det_gemm_fwd [M=1, N=64, K=32] bf16",
    "det_gemm_fwd [M=7, N=64, K=32] bf16",
    "det_gemm_da [M=129, N=64, K=32] bf16",
    "det_gemm_db [M=7, N=64, K=32] bf16",
    "validate",
    "time",
]
# (parent, child): every `parent` range encloses at least one `child` range.
NESTING = [
    ("det_gemm_fwd [M=1, N=64, K=32] bf16", "validate"),
    ("det_gemm_fwd [M=1, N=64, K=32] bf16", "time"),
    ("det_gemm_fwd [M=7, N=64, K=32] bf16", "validate"),
    ("det_gemm_fwd [M=7, N=64, K=32] bf16", "time"),
    ("det_gemm_da [M=129, N=64, K=32] bf16", "validate"),
]


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    for var in ("NVTX_INJECTION64_PATH", "DETKIT_NVTX_LOG", "NVTX_DISABLE"):
        env.pop(var, None)
    return env


@pytest.fixture(scope="module")
def inject_lib(tmp_path_factory) -> Path:
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        pytest.skip("gcc not found: cannot build the NVTX injection library")
    return nvtx_ranges.build_injection_library(tmp_path_factory.mktemp("nvtx_build"))


def _run_logged(cmd, inject_lib, tmp_path_factory, name: str) -> tuple[Path, Path]:
    """Run ``cmd`` ("{out}" -> a fresh folder) under the injection library: (log, out folder)."""
    tmp = tmp_path_factory.mktemp(name)
    out = tmp / "out"
    log = tmp / "nvtx.log"
    env = _subprocess_env()
    env["TRITON_INTERPRET"] = "1"
    proc = run_with_injection(
        [a.replace("{out}", str(out)) for a in cmd], log, inject_lib, env=env, cwd=REPO_ROOT, timeout=240
    )
    assert proc.returncode == 0, f"{name} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return log, out


@pytest.fixture(scope="module")
def workload_log(inject_lib, tmp_path_factory) -> tuple[Path, Path]:
    return _run_logged(WORKLOAD_CMD, inject_lib, tmp_path_factory, "bench_gemm")


@pytest.fixture(scope="module")
def audit_log(inject_lib, tmp_path_factory) -> tuple[Path, Path]:
    return _run_logged(AUDIT_CMD, inject_lib, tmp_path_factory, "audit")


@pytest.fixture(scope="module")
def standin_log(inject_lib, tmp_path_factory) -> Path:
    log = tmp_path_factory.mktemp("nvtx_log") / "nvtx.log"
    proc = run_with_injection(
        STANDIN_CMD, log, inject_lib, env=_subprocess_env(), cwd=REPO_ROOT, timeout=120
    )
    assert proc.returncode == 0, f"stand-in failed (rc={proc.returncode}):\n{proc.stderr}"
    return log


def _nvtx3_include_dirs() -> list[Path]:
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates += [Path(p) for p in sorted(glob.glob("/usr/local/cuda*/include"))]
    for entry in sys.path:  # the nvidia-nvtx wheel, or an nvtx wheel that ships headers
        candidates += [
            Path(entry) / "nvidia" / "nvtx" / "include",
            Path(entry) / "nvtx" / "include",
        ]
    return [c for c in candidates if (c / "nvtx3" / "nvToolsExt.h").is_file()]


def test_vendored_abi_matches_nvtx_headers():
    dirs = _nvtx3_include_dirs()
    if not dirs:
        pytest.skip("no nvtx3 headers on this machine (CUDA toolkit or nvidia-nvtx wheel)")
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    src = REPO_ROOT / "native" / "nvtx_inject" / "layout_check.c"
    proc = subprocess.run(
        ["gcc", "-std=c11", "-fsyntax-only", f"-I{dirs[0]}", str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"vendored NVTX ABI differs from {dirs[0]}/nvtx3:\n{proc.stderr}"


def test_library_exports_the_nvtx_entry_point(inject_lib):
    lib = ctypes.CDLL(str(inject_lib))  # loading does not initialise anything
    assert hasattr(lib, "InitializeInjectionNvtx2")


def _jsonl_names(path: Path) -> list[str]:
    return [json.loads(line)["name"] for line in path.read_text().splitlines()]


def test_bench_rows_are_ranges_in_the_detkit_domain(workload_log):
    log, out = workload_log
    rows = _jsonl_names(out / "rows.jsonl")
    assert rows == [BENCH_ROW]  # the row name is the range name (docs/nvtx.md)
    problems = verify_nvtx_log(log, [BENCH_STAGE, *rows, *BENCH_RANGES],
                               nesting=[(BENCH_STAGE, r) for r in BENCH_RANGES])
    assert problems == [], "\n".join(problems)
    pushes = [e for e in parse_injection_log(log) if e.kind == "push" and e.domain == DOMAIN]
    assert [e.depth for e in pushes if e.message == BENCH_STAGE] == [1]
    for name in BENCH_RANGES:
        mine = [e for e in pushes if e.message == name]
        # Timed calls only (warm-up included), each directly inside the runner's range.
        assert mine and all(e.depth == 2 for e in mine), (name, mine)
    assert {e.message for e in pushes} == {BENCH_STAGE, *BENCH_RANGES}


def test_audit_stage_encloses_one_range_per_contract_row(audit_log):
    log, out = audit_log
    rows = _jsonl_names(out / "rows.jsonl")
    assert len(rows) == 10 and all(r.startswith("contract det_gemm_") for r in rows)
    assert "contract det_gemm_fwd [M=1, N=56, K=40] bf16 b=kn" in rows
    problems = verify_nvtx_log(log, [AUDIT_STAGE, *rows], nesting=[(AUDIT_STAGE, r) for r in rows])
    assert problems == [], "\n".join(problems)
    pushes = [e for e in parse_injection_log(log) if e.kind == "push" and e.domain == DOMAIN]
    assert [e.depth for e in pushes if e.message == AUDIT_STAGE] == [1]
    assert sorted(e.message for e in pushes if e.depth == 2) == sorted(rows)  # one range per row


def test_standin_ranges_are_emitted_balanced_and_nested(standin_log):
    workload_log = standin_log
    problems = verify_nvtx_log(workload_log, EXPECTED_RANGES, nesting=NESTING)
    assert problems == [], "\n".join(problems)

    events = parse_injection_log(workload_log)
    pushes = [e for e in events if e.kind == "push"]
    # Every push went through the detkit domain, as the Python nvtx extension's domain API.
    assert {e.domain for e in pushes} == {DOMAIN}
    fwd = [e for e in pushes if e.message.startswith("det_gemm_fwd")]
    assert [e.message for e in fwd] == EXPECTED_RANGES[:2]
    assert all(e.depth == 1 for e in fwd)
    assert all(e.depth == 2 for e in pushes if e.message in ("validate", "time"))
    # The worker thread's ranges carry their own thread id.
    da = next(e for e in pushes if e.message.startswith("det_gemm_da"))
    assert da.tid != fwd[0].tid and da.pid == fwd[0].pid
    # The range around the exception was still popped.
    db_pops = [e for e in events if e.kind == "pop" and e.message.startswith("det_gemm_db")]
    assert len(db_pops) == 1


def test_missing_name_is_reported(standin_log):
    missing = "det_gemm_fwd [M=4096, N=6144, K=4096] bf16"
    problems = verify_nvtx_log(standin_log, [*EXPECTED_RANGES, missing])
    assert problems == [f"range {missing!r} was never pushed"]


def test_wrong_nesting_is_reported(standin_log):
    # The dA case runs no "time" stage, and "validate" never encloses anything.
    problems = verify_nvtx_log(
        standin_log,
        EXPECTED_RANGES,
        nesting=[("det_gemm_da [M=129, N=64, K=32] bf16", "time"), ("validate", "time")],
    )
    assert len(problems) == 4, problems  # dA once, "validate" in each of three cases
    assert (
        sum(
            "range 'det_gemm_da [M=129, N=64, K=32] bf16' encloses no 'time'" in p for p in problems
        )
        == 1
    )
    assert sum("range 'validate' encloses no 'time'" in p for p in problems) == 3


def test_unpopped_range_in_a_real_process_is_reported(inject_lib, tmp_path):
    script = textwrap.dedent(
        """
        import nvtx
        d = nvtx.get_domain("detkit")
        d.push_range(message="outer")
        d.push_range(message="left open")
        d.pop_range()
        d.pop_range()
        d.pop_range()  # one pop too many
        d.push_range(message="never popped")
        nvtx.push_range("det_gemm_fwd [M=1, N=64, K=32] bf16")  # default domain, not detkit
        nvtx.pop_range()
        """
    )
    log = tmp_path / "bad.log"
    proc = run_with_injection(
        [sys.executable, "-c", script], log, inject_lib, env=_subprocess_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    problems = verify_nvtx_log(log, ["outer", "det_gemm_fwd [M=1, N=64, K=32] bf16"])
    assert len(problems) == 3, problems
    assert "with no open range" in problems[0]
    assert "'never popped'" in problems[1] and "was never popped" in problems[1]
    assert problems[2] == (
        "range 'det_gemm_fwd [M=1, N=64, K=32] bf16' was pushed only in domain(s) "
        "['<default>'], not 'detkit'"
    )


def test_without_the_injection_path_nothing_is_logged(tmp_path):
    # DETKIT_NVTX_LOG alone attaches nothing: NVTX only loads a tool named by its own variable.
    log = tmp_path / "none.log"
    log.write_text("")
    env = _subprocess_env()
    env["DETKIT_NVTX_LOG"] = str(log)
    script = (
        "from detkit.toolkit.nvtx_ranges import nvtx_range, nvtx_enabled\n"
        "with nvtx_range('det_gemm_fwd [M=1, N=64, K=32] bf16'):\n"
        "    print(nvtx_enabled())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    problems = verify_nvtx_log(log, EXPECTED_RANGES)
    assert len(problems) == 1 and "is empty" in problems[0]


def test_messages_with_tabs_and_newlines_round_trip(inject_lib, tmp_path):
    name = "odd\tname\nwith\\escapes"
    script = f"from detkit.toolkit.nvtx_ranges import nvtx_range\nwith nvtx_range({name!r}):\n    pass\n"
    log = tmp_path / "odd.log"
    proc = run_with_injection(
        [sys.executable, "-c", script], log, inject_lib, env=_subprocess_env(), cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert verify_nvtx_log(log, [name]) == []


def _ev(kind, message="", depth=0, *, domain=DOMAIN, tid=1, line=0, range_id=0):
    return NvtxEvent(kind, domain, message, 100, tid, depth, range_id, line)


def test_check_ranges_on_synthetic_logs():
    head = [_ev("init"), _ev("domain_create")]
    ok = head + [_ev("push", "a", 1), _ev("push", "b", 2), _ev("pop", "b", 2), _ev("pop", "a", 1)]
    assert check_ranges(ok, ["a", "b"], nesting=[("a", "b")]) == []
    assert check_ranges(ok, ["a", "b"], nesting=[("b", "a")]) == [
        "line 0: range 'b' encloses no 'a' range"
    ]

    # A depth the library logged that the replay disagrees with (corrupt or interleaved log).
    bad_depth = head + [_ev("push", "a", 2, line=3), _ev("pop", "a", 2)]
    assert any(
        "logged at depth 2, replayed depth is 1" in p for p in check_ranges(bad_depth, ["a"])
    )

    # Start/end bookkeeping.
    dangling = head + [_ev("start", "s", range_id=5, line=3), _ev("end", range_id=6, line=4)]
    problems = check_ranges(dangling, [])
    assert "line 4: end of range id 6 that was never started" in problems
    assert "line 3: start/end range 's' was never ended" in problems

    # No tool attached, or the domain never created.
    problems = check_ranges([_ev("push", "a", 1), _ev("pop", "a", 1)], ["a"])
    assert problems[:2] == [
        "the injection library never attached (no 'init' line in the log)",
        "domain 'detkit' was never created",
    ]


def test_nvtx_range_is_a_noop_without_a_tool():
    # This pytest process has no injection library: the ranges must still nest and propagate.
    if os.environ.get("NVTX_INJECTION64_PATH"):
        pytest.skip("an NVTX tool is attached to the test process")
    with nvtx_range("outer"):
        with nvtx_range("inner"):
            pass
    with pytest.raises(KeyError):
        with nvtx_range("raises"):
            raise KeyError("x")
    assert nvtx_ranges.nvtx_enabled() is False


@pytest.mark.parametrize("bad", ["", None, 3])
def test_nvtx_range_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="non-empty str"):
        nvtx_range(bad)


def test_format_range_name():
    name = format_range_name("det_gemm_fwd", {"M": 4096, "N": 6144, "K": 4096}, "bf16")
    assert name == "det_gemm_fwd [M=4096, N=6144, K=4096] bf16"
    assert format_range_name("allreduce", {}) == "allreduce"


def test_build_is_cached_and_rebuilds_into_a_new_dir(inject_lib, tmp_path):
    again = nvtx_ranges.build_injection_library(inject_lib.parent)
    assert again == inject_lib
    fresh = nvtx_ranges.build_injection_library(tmp_path / "other")
    assert fresh.is_file() and fresh.name == "libdetkit_nvtx_inject.so"
