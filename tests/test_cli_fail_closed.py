"""A user's first mistakes on the command line are refused before any work, as one line on stderr with
exit status 2 and no traceback (unless --debug or DETKIT_LOG_LEVEL=DEBUG): a device that is not there, an
unknown preset or suite, an --out that cannot be written, counts below 1, sizes below 1, a bad timeout.
Each case checks the message. The checks themselves (toolkit.preflight) are what every bench runner calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from detkit.toolkit import cli, harness, preflight
from detkit.toolkit.preflight import UsageError

REPO = Path(__file__).resolve().parents[1]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA GPU: --device cuda is valid")


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the audit gets as far as running a plug-in."""
    calls = []
    monkeypatch.setattr(harness, "run_plugins", lambda *a, **k: calls.append(a) or [])
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "DETKIT_DIST_TIMEOUT_S"):
        monkeypatch.delenv(var, raising=False)
    return calls


def _refused(args: list[str], no_work: list, message: str) -> str:
    result = CliRunner().invoke(cli.main, args, catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0], lines[0]
    assert no_work == []
    return lines[0]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID",
                                                               "DETKIT_LOG_LEVEL", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-m", "detkit", *args], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------ device
@NO_GPU
def test_cuda_without_gpu_is_one_line_and_exit_2_before_any_work(tmp_path):
    out = tmp_path / "o"
    proc = _cli("audit", "--device", "cuda", "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"detkit audit: error: --device cuda: torch {torch.__version__} sees no CUDA GPU (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use --device cpu for the Triton-interpreter runs "
        "(not a hardware result) (see 'detkit audit --help')"]
    assert "Traceback" not in proc.stderr and not out.exists()


@NO_GPU
def test_bench_cuda_without_gpu_is_refused_by_the_shared_options(tmp_path):
    proc = _cli("bench", "gemm", "--device", "cuda", "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("detkit bench gemm: error: --device cuda: torch ") and "sees no CUDA GPU" in line


def test_unknown_device_names_the_supported_ones(no_work):
    _refused(["audit", "--device", "tpu"], no_work, "'tpu' is not one of 'cuda', 'cpu'")
    with pytest.raises(UsageError, match="--device 'tpu' is not supported; supported: cuda, cpu"):
        preflight.check_device("tpu")


def test_cuda_under_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UsageError, match="TRITON_INTERPRET=1 is set"):
        preflight.check_device("cuda")


# ------------------------------------------------------------------------------ preset, suite
def test_unknown_preset(no_work, tmp_path):
    _refused(["audit", "--device", "cpu", "--preset", "qwen9", "--out", str(tmp_path / "o")], no_work,
             "detkit audit: error: --preset 'qwen9' is not known; known: qwen3-8b-tp2, tiny")
    assert not (tmp_path / "o").exists()
    with pytest.raises(UsageError, match="--preset 'x' is not known; known: a, b"):
        preflight.check_preset("x", ["b", "a"])
    assert preflight.check_preset(None, ["a"]) is None and preflight.check_preset("a", ["a"]) == "a"


def test_unknown_suite(no_work, tmp_path):
    _refused(["audit", "--device", "cpu", "--suite", "gemmm", "--out", str(tmp_path / "o")], no_work,
             "detkit audit: error: suite(s) ['gemmm'] not known; known: ['auto', 'all', 'attention', 'gemm'")


@pytest.mark.parametrize("args", [("--suite", "nosuch"), ("--device", "cuda", "--suite", "nosuch"),
                                  ("--out", "/proc/x", "--suite", "nosuch")], ids=["default-device", "cuda", "bad-out"])
def test_an_unknown_suite_is_refused_before_the_device_and_the_out_folder(no_work, args, monkeypatch):
    # The suite is what the command is about: a wrong name is the first thing said, whatever else is wrong
    # (on a host without a GPU the default --device cuda would be refused too).
    monkeypatch.delenv("DETKIT_DEVICE", raising=False)
    _refused(["audit", *args], no_work, "detkit audit: error: suite(s) ['nosuch'] not known; known: ['auto', 'all'")


@pytest.mark.parametrize("suites", [["model"], ["gemm", "all"]])
def test_a_suite_whose_dependency_is_missing_is_refused_before_any_work(no_work, tmp_path, monkeypatch, suites):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    args = [a for s in suites for a in ("--suite", s)]
    _refused(["audit", "--device", "cpu", *args, "--out", str(tmp_path / "o")], no_work,
             "detkit audit: error: the model suite needs transformers, which is not installed "
             "(pip install 'detkit[models]')")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ --out
def test_out_under_a_file_is_refused_for_audit_and_bench(no_work, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    message = f"--out '{blocker}/sub' cannot be created: '{blocker}' is not a folder"
    _refused(["audit", "--device", "cpu", "--out", str(blocker / "sub")], no_work, message)
    _refused(["bench", "gemm", "--device", "cpu", "--out", str(blocker / "sub")], no_work, message)
    _refused(["bench", "mlp", "--device", "cpu", "--out", str(blocker)], no_work,
             f"--out '{blocker}' exists and is not a folder")


def test_out_where_nothing_can_be_written_is_refused(no_work):
    # /proc takes no new files, even from root (the CI user): a writable-bit check would pass it.
    line = _refused(["audit", "--device", "cpu", "--out", "/proc/detkit-results"], no_work,
                    "--out '/proc/detkit-results' is not writable: cannot write in '/proc', where it would be created")
    assert line.startswith("detkit audit: error: ")


def test_writable_out_is_accepted_without_creating_it(tmp_path):
    assert preflight.check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ counts and sizes
@pytest.mark.parametrize("value", [0, -3])
def test_rounds_below_one(value):
    with pytest.raises(UsageError, match=f"--rounds must be >= 1; got {value}"):
        preflight.check_count("--rounds", value)
    with pytest.raises(UsageError, match=f"--rounds must be >= 1; got {value}"):
        preflight.check_run(device="cpu", rounds=value)


def test_counts_must_be_integers():
    with pytest.raises(UsageError, match=r"--iters must be an integer >= 1; got 2\.5"):
        preflight.check_count("--iters", 2.5)
    assert preflight.check_count("--warmup", 0, minimum=0) == 0 and preflight.check_count("--rounds", None) is None


@pytest.mark.parametrize(("values", "bad"), [((128, 0), "0"), ((-1,), "-1"), ((4, -2, 0), "-2, 0")])
def test_sizes_below_one(values, bad):
    with pytest.raises(UsageError, match=f"--m values must be integers >= 1; got {bad}$"):
        preflight.check_sizes("--m", values)


def test_sizes_accept_one_value_or_none():
    assert preflight.check_sizes("--n", 64) == (64,) and preflight.check_sizes("--m", None) == ()


def test_check_run_goes_in_the_order_of_the_flags(tmp_path):
    with pytest.raises(UsageError, match="--preset 'big'"):
        preflight.check_run(device="cpu", preset="big", presets=["tiny"], out_dir="/proc/x", rounds=0)
    with pytest.raises(UsageError, match="--rounds must be >= 1"):
        preflight.check_run(device="cpu", preset="tiny", presets=["tiny"], out_dir="/proc/x", rounds=0)
    preflight.check_run(device="cpu", preset="tiny", presets=["tiny"], out_dir=tmp_path, rounds=1)


# ------------------------------------------------------------------------------ timeout knob
def test_bad_timeout_knob_is_refused_before_work(no_work, monkeypatch):
    monkeypatch.setenv("DETKIT_DIST_TIMEOUT_S", "-5")
    _refused(["audit", "--device", "cpu"], no_work,
             "detkit audit: error: DETKIT_DIST_TIMEOUT_S='-5'; supported: a positive number of seconds")


# ------------------------------------------------------------------------------ tracebacks only on request
def test_debug_shows_the_traceback(tmp_path):
    plain = _cli("audit", "--device", "cpu", "--preset", "nope", "--out", str(tmp_path / "o"))
    assert plain.returncode == 2 and "Traceback" not in plain.stderr and len(plain.stderr.splitlines()) == 1
    for args, env in ((("--debug", "audit"), {}), (("audit", "--debug"), {}), (("audit",), {"DETKIT_LOG_LEVEL": "DEBUG"})):
        proc = _cli(*args, "--device", "cpu", "--preset", "nope", "--out", str(tmp_path / "o"), **env)
        assert proc.returncode != 0 and "Traceback" in proc.stderr, (args, env, proc.stderr[-2000:])
        assert "UsageError: --preset 'nope' is not known" in proc.stderr


def test_a_failure_during_the_work_is_one_line_with_exit_1(no_work, monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("the backend probe broke")

    monkeypatch.setattr(harness, "resolve_context", broken)
    result = CliRunner().invoke(cli.main, ["audit", "--device", "cpu", "--out", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "detkit audit: failed: RuntimeError: the backend probe broke (--debug or DETKIT_LOG_LEVEL=DEBUG shows the "
        "traceback)"]


def test_help_and_a_bare_group_still_work():
    assert CliRunner().invoke(cli.main, ["audit", "--help"]).exit_code == 0
    result = CliRunner().invoke(cli.main, ["bench"])
    assert "gemm" in result.output
