"""Environment capture: every section present, JSON-serialisable, degrading to
"not available: <reason>" (never raising) without GPU/NVML/nvidia-smi, and the GPU-shaped paths
exercised with a fake NVML, a fake CUDA torch and a fake libnccl built with gcc."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from detkit.toolkit import env as envmod
from detkit.toolkit.env import (
    NOT_AVAILABLE_PREFIX,
    SECTIONS,
    capture_env,
    env_summary,
    format_env_table,
    is_available,
    not_available,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _machine_has_gpu() -> bool:
    try:
        import torch

        if torch.version.cuda and torch.cuda.is_available():
            return True
    except Exception:  # noqa: BLE001
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def real_env() -> dict:
    return capture_env()


def _assert_reason(value):
    assert isinstance(value, str) and value.startswith(NOT_AVAILABLE_PREFIX), value
    assert len(value) > len(NOT_AVAILABLE_PREFIX) + 5, f"no reason given: {value!r}"


def test_every_section_is_present_and_json_round_trips(real_env):
    assert list(real_env) == list(SECTIONS)
    assert json.loads(json.dumps(real_env)) == real_env
    assert real_env["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert real_env["packages"]["torch"] == __import__("torch").__version__
    assert real_env["host"]["cpu_count_logical"] == os.cpu_count()
    assert isinstance(real_env["host"]["memory_total_bytes"], int)


def test_gpu_fields_degrade_with_reasons_on_a_machine_without_gpus(real_env):
    if _machine_has_gpu():
        pytest.skip("this machine has a GPU: covered by the fake-GPU tests and the device run")
    _assert_reason(real_env["gpus"]["devices"])
    _assert_reason(real_env["gpus"]["visible_count"])
    _assert_reason(real_env["cuda"]["driver_version"])
    _assert_reason(real_env["nvlink"])
    if shutil.which("nvidia-smi") is None:
        assert real_env["topology"]["nvidia_smi_topo_m"] == not_available(
            "RuntimeError: nvidia-smi not found on PATH"
        )
    summary = env_summary(real_env)
    _assert_reason(summary["gpu_name"])
    _assert_reason(summary["driver"])


def test_table_renders_every_section(real_env):
    text = format_env_table(real_env)
    for section in SECTIONS:
        assert f"== {section} ==" in text
    assert real_env["python"]["version"] in text
    if not _machine_has_gpu():
        assert "not available: " in text


def test_import_has_no_side_effects():
    code = (
        "import sys, toolkit.env\n"
        "print(sorted(m for m in ('torch', 'pynvml', 'psutil', 'tabulate') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert proc.stdout.strip() == "[]"


def test_nothing_raises_when_every_source_is_broken(monkeypatch, tmp_path):
    def broken_torch():
        raise ImportError("no torch here")

    monkeypatch.setattr(envmod, "_import_torch", broken_torch)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setitem(sys.modules, "psutil", None)
    monkeypatch.setattr(envmod, "_REPO_ROOT", tmp_path)  # not a git checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git, no nvidia-smi
    monkeypatch.delenv("DETKIT_GIT_COMMIT", raising=False)
    env = capture_env()
    assert list(env) == list(SECTIONS)
    json.dumps(env)
    _assert_reason(env["cuda"]["torch_cuda_runtime"])
    assert "no torch here" in env["cuda"]["torch_cuda_runtime"]
    _assert_reason(env["gpus"]["devices"])
    _assert_reason(env["host"]["memory_total_bytes"])
    _assert_reason(env["detkit"]["git_commit"])
    assert "DETKIT_GIT_COMMIT is not set" in env["detkit"]["git_commit"]
    assert "== gpus ==" in format_env_table(env)


def test_git_commit_falls_back_to_the_build_arg(monkeypatch, tmp_path):
    monkeypatch.setattr(envmod, "_REPO_ROOT", tmp_path)
    monkeypatch.setenv("DETKIT_GIT_COMMIT", "abc123")
    info = envmod._git_info()
    assert info["git_commit"] == "abc123"
    assert info["git_commit_source"] == "DETKIT_GIT_COMMIT"
    _assert_reason(info["git_dirty"])


def test_git_commit_of_this_checkout():
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    proc = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip("the checkout has no commit yet")
    info = envmod._git_info()
    assert info["git_commit"] == proc.stdout.strip()
    assert info["git_commit_source"] == "git"
    assert isinstance(info["git_dirty"], bool)


def test_container_records_how_the_image_was_built(monkeypatch):
    monkeypatch.setenv("DETKIT_IMAGE", "detkit:ci")
    monkeypatch.setenv("DETKIT_BASE_IMAGE", "detkit-standin:0123")
    monkeypatch.setenv("DETKIT_BUILD_CHECKS", "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=0")
    env = capture_env(probe_cuda=False)
    container = env["container"]
    assert container["base_image"] == "detkit-standin:0123"
    assert container["build_checks"] == "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=0"
    assert container["relaxed_checks"] == ["ALLOW_UNPINNED_BASE"]
    table = format_env_table(env)
    assert "ALLOW_UNPINNED_BASE=1 ALLOW_CPU_BASE=0" in table and "detkit-standin:0123" in table
    monkeypatch.delenv("DETKIT_IMAGE")
    assert "base_image" not in capture_env(probe_cuda=False)["container"]  # outside the image: nothing to say


def test_slurm_container_and_knobs_are_recorded(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("DETKIT_IMAGE", "detkit:0.1.0@sha256:feed")
    monkeypatch.setenv("NCCL_ALGO", "allreduce:tree")
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("SOME_TOKEN", "secret")
    env = capture_env(probe_cuda=False)
    assert env["slurm"] == {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4"}
    assert env["container"]["image"] == "detkit:0.1.0@sha256:feed"
    knobs = env["env_knobs"]
    for key in (
        "NCCL_ALGO",
        "CUBLASLT_WORKSPACE_SIZE",
        "TRITON_INTERPRET",
        "CUDA_VISIBLE_DEVICES",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "DETKIT_IMAGE",
    ):
        assert knobs[key] == os.environ[key]
    assert "SOME_TOKEN" not in knobs and "SLURM_JOB_ID" not in knobs
    assert env["gpus"]["visible_count"] == not_available("skipped: capture_env(probe_cuda=False)")


def test_nvidia_variables_recorded_selectively(monkeypatch):
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("NVIDIA_REQUIRE_CUDA", "cuda>=13.0 brand=tesla,driver>=535,driver<536")
    knobs = capture_env(probe_cuda=False)["env_knobs"]
    assert knobs["NVIDIA_VISIBLE_DEVICES"] == "0,1"
    assert "NVIDIA_REQUIRE_CUDA" not in knobs


def _fake_tool(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def test_topology_from_nvidia_smi(monkeypatch, tmp_path):
    # nvidia-smi underlines the header of `topo -m` with ANSI escapes; the capture strips them.
    _fake_tool(
        tmp_path, "nvidia-smi", 'printf "\\t\\033[4mGPU0\\tGPU1\\033[0m\\nGPU0\\t X \\tNV18\\n"\n'
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    topo = envmod._topology_section()["nvidia_smi_topo_m"]
    assert topo == "\tGPU0\tGPU1\nGPU0\t X \tNV18"


def test_failing_nvidia_smi_gives_its_first_error_line(monkeypatch, tmp_path):
    _fake_tool(
        tmp_path, "nvidia-smi", 'echo "NVIDIA-SMI has failed" >&2; echo "second line" >&2; exit 9\n'
    )
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    topo = envmod._topology_section()["nvidia_smi_topo_m"]
    assert topo == not_available("RuntimeError: nvidia-smi topo -m exited 9: NVIDIA-SMI has failed")


def test_memlock_and_shm_are_read():
    import resource

    host = capture_env(probe_cuda=False)["host"]
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    expected = "unlimited" if soft == resource.RLIM_INFINITY else soft
    assert host["memlock_limit"]["soft_bytes"] == expected
    if os.path.isdir("/dev/shm"):
        assert host["dev_shm_bytes"] == shutil.disk_usage("/dev/shm").total


@pytest.mark.parametrize(("code", "text"), [(22809, "2.28.9"), (21803, "2.18.3"), (2708, "2.7.8")])
def test_nccl_version_code_decoding(code, text):
    assert envmod._nccl_version_string(code) == text


# ------------------------------------------------------------------ a fake GPU machine


class _NvmlError(Exception):
    pass


def _fake_pynvml() -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVML_FEATURE_ENABLED, m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_NVLINK_MAX_LINKS = 1, 1, 2, 36
    bus = ["00000000:18:00.0", "00000000:2A:00.0"]

    def not_supported(*_):
        raise _NvmlError("Not Supported")

    def nvlink_state(h, link):
        if link >= 18:
            raise _NvmlError("Invalid Argument")
        return 1 if link < 17 else 0  # one link down

    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: b"580.159.04"
    m.nvmlSystemGetCudaDriverVersion_v2 = lambda: 13000
    m.nvmlDeviceGetCount = lambda: 2
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    m.nvmlDeviceGetUUID = lambda h: f"GPU-0000000{h}-aaaa-bbbb-cccc-dddddddddddd"
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=bus[h].encode())
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=150754820096)
    m.nvmlDeviceGetClockInfo = lambda h, t: 1980 if t == 1 else 3201
    m.nvmlDeviceGetMaxClockInfo = lambda h, t: 1980 if t == 1 else 3201
    m.nvmlDeviceGetApplicationsClock = not_supported
    m.nvmlDeviceGetPowerManagementLimit = lambda h: 700000
    m.nvmlDeviceGetPersistenceMode = lambda h: 1
    m.nvmlDeviceGetComputeMode = lambda h: 0
    m.nvmlDeviceGetEccMode = lambda h: (1, 1)
    m.nvmlDeviceGetNvLinkState = nvlink_state
    m.nvmlDeviceGetNvLinkVersion = lambda h, link: 5
    m.nvmlDeviceGetNvLinkRemotePciInfo = lambda h, link: types.SimpleNamespace(
        busId=bus[1 - h].encode()
    )
    return m


def _fake_cuda_torch(torch_dir: Path) -> types.SimpleNamespace:
    def props(i):
        # torch device 0 is NVML device 1 (CUDA_VISIBLE_DEVICES=1,0): the join must use UUIDs.
        nvml_i = 1 - i
        return types.SimpleNamespace(
            name="NVIDIA H200",
            major=9,
            minor=0,
            multi_processor_count=132,
            total_memory=150754820096,
            L2_cache_size=62914560,
            uuid=f"0000000{nvml_i}-aaaa-bbbb-cccc-dddddddddddd",
            pci_domain_id=0,
            pci_bus_id=[0x18, 0x2A][nvml_i],
            pci_device_id=0,
        )

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        get_device_properties=props,
        nccl=types.SimpleNamespace(version=lambda: (2, 28, 9)),
    )
    return types.SimpleNamespace(
        __file__=str(torch_dir / "__init__.py"),
        __version__="2.11.0+cu130",
        version=types.SimpleNamespace(cuda="13.0"),
        cuda=cuda,
    )


@pytest.fixture
def fake_gpu_machine(monkeypatch, tmp_path):
    torch_dir = tmp_path / "site" / "torch"
    (torch_dir / "lib").mkdir(parents=True)
    if shutil.which("gcc") is not None:
        src = tmp_path / "nccl.c"
        src.write_text("int ncclGetVersion(int *v) { *v = 22809; return 0; }\n")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-o", str(torch_dir / "lib" / "libnccl.so.2"), str(src)],
            check=True,
        )
    monkeypatch.setattr(envmod, "_import_torch", lambda: _fake_cuda_torch(torch_dir))
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    return torch_dir


def test_gpu_shaped_capture(fake_gpu_machine):
    # A libnccl already mapped in this process (CUDA torch) would be found first.
    nccl_mapped = "/libnccl" in Path("/proc/self/maps").read_text()
    env = capture_env()
    json.dumps(env)
    cuda = env["cuda"]
    assert cuda["torch_cuda_runtime"] == "13.0"
    assert cuda["driver_version"] == "580.159.04"
    assert cuda["driver_cuda_version"] == "13.0"
    assert cuda["nccl_compiled"] == "2.28.9"
    if (fake_gpu_machine / "lib" / "libnccl.so.2").exists() and not nccl_mapped:
        assert cuda["nccl_runtime"]["version"] == "2.28.9"
        assert cuda["nccl_runtime"]["library"].endswith("torch/lib/libnccl.so.2")

    gpus = env["gpus"]
    assert gpus["visible_count"] == 2 and gpus["nvml_count"] == 2
    d0 = gpus["devices"][0]
    assert (d0["name"], d0["sm_count"], d0["compute_capability"]) == ("NVIDIA H200", 132, "9.0")
    assert d0["pci_bus_id"] == "00000000:2A:00.0"
    assert d0["nvml"]["nvml_index"] == 1 and d0["nvml"]["pci_bus_id"] == "00000000:2A:00.0"
    assert d0["nvml"]["clocks_mhz"]["sm_max"] == 1980
    assert d0["nvml"]["clocks_mhz"]["sm_application"].startswith(NOT_AVAILABLE_PREFIX)
    assert d0["nvml"]["power_limit_w"] == 700.0

    nvlink = env["nvlink"]
    assert [g["active_links"] for g in nvlink] == [17, 17]
    assert len(nvlink[0]["links"]) == 18
    assert nvlink[0]["links"][0]["remote_pci_bus_id"] == "00000000:2A:00.0"
    assert nvlink[0]["links"][17]["state"] == "inactive"

    summary = env_summary(env)
    assert summary["gpu_name"] == "NVIDIA H200" and summary["gpu_count"] == 2
    assert summary["driver"] == "580.159.04"

    text = format_env_table(env)
    assert "-- devices --" in text and "-- nvlink --" in text
    # One table row per (GPU, link): 2 x 18.
    nvlink_table = text.split("-- nvlink --")[1].split("==")[0]
    states = [line.split()[4] for line in nvlink_table.splitlines() if len(line.split()) == 7]
    assert states.count("active") == 34 and states.count("inactive") == 2
    # Per-GPU records are shown one column per GPU.
    devices_table = text.split("-- devices --")[1].split("==")[0]
    assert "nvml.clocks_mhz.sm_max" in devices_table and "[1]" in devices_table


def test_torch_cpu_build_on_a_gpu_host_still_lists_nvml_gpus(monkeypatch):
    cpu_torch = types.SimpleNamespace(
        __file__="/nonexistent/torch/__init__.py",
        version=types.SimpleNamespace(cuda=None),
        cuda=types.SimpleNamespace(
            nccl=types.SimpleNamespace(
                version=lambda: (_ for _ in ()).throw(AttributeError("no nccl"))
            )
        ),
    )
    monkeypatch.setattr(envmod, "_import_torch", lambda: cpu_torch)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    env = capture_env()
    devices = env["gpus"]["devices"]
    assert len(devices) == 2
    _assert_reason(devices[0]["index"])
    assert devices[0]["nvml"]["name"] == "NVIDIA H200"
    assert env_summary(env)["gpu_name"] == "NVIDIA H200"


def test_is_available():
    assert is_available(0) and is_available("H200") and is_available(None)
    assert not is_available(not_available("x"))


def test_a_declared_commit_that_disagrees_with_the_checkout_is_shown_beside_it(monkeypatch):
    head = envmod._git_info()
    if head["git_commit_source"] != "git":
        pytest.skip(f"not a git checkout here: {head['git_commit']}")
    commit = head["git_commit"]
    monkeypatch.setenv("DETKIT_GIT_COMMIT", "0123456789abcdef")
    info = envmod._git_info()
    assert info["git_commit"] == f"{commit} (DETKIT_GIT_COMMIT says 0123456789abcdef)"
    assert info["git_commit_declared"] == "0123456789abcdef" and info["git_commit_source"] == "git"
    monkeypatch.setenv("DETKIT_GIT_COMMIT", commit[:7])  # the same commit, abbreviated: nothing to add
    assert envmod._git_info() == head
