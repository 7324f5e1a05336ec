"""Environment and topology capture: everything a maintainer asks for before reading a result.

``capture_env()`` returns a JSON-serialisable dict of sections (detkit, python, packages, cuda,
gpus, topology, nvlink, host, slurm, container, env_knobs). ``format_env_table(env)`` renders it
for a terminal; ``env_summary(env)`` flattens the few fields every report row carries.

Degrade convention: a value that could not be read is the string
``"not available: <reason>"`` (see ``not_available`` / ``is_available``); a capture never
raises because a GPU, NVML, nvidia-smi, NCCL or git is missing. Fields keep their type when
they are available, so a reader tests ``is_available(value)`` before using one.

Importing this module has no side effects and imports neither torch nor NVML. ``capture_env``
imports torch and, with ``probe_cuda=True`` (the default), calls ``torch.cuda`` queries that
initialise the CUDA driver in this process (no context or allocation); pass
``probe_cuda=False`` before forking CUDA workers: GPU facts then come from NVML alone.
"""

from __future__ import annotations

import ctypes
import datetime
import importlib.metadata
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

NOT_AVAILABLE_PREFIX = "not available: "
SCHEMA_VERSION = 1

# Environment variables worth recording: exact names and prefixes.
KNOB_PREFIXES = (
    "NCCL_",
    "CUBLAS",  # CUBLAS_WORKSPACE_CONFIG, CUBLASLT_* ...
    "TRITON_",
    "DETKIT_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",  # CUDA_VISIBLE_DEVICES, CUDA_LAUNCH_BLOCKING, CUDA_DEVICE_MAX_CONNECTIONS ...
    "NVTX_",
    "NSYS_",
)
# Not the whole NVIDIA_* family: images set NVIDIA_REQUIRE_CUDA to kilobytes of driver ranges.
KNOB_NAMES = (
    "NVIDIA_VISIBLE_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "OMP_NUM_THREADS",
    "LD_PRELOAD",
)

PACKAGES = ("torch", "triton", "numpy", "nvtx", "nvidia-ml-py", "click", "tabulate", "psutil")

_REPO_ROOT = Path(__file__).resolve().parents[1]
_SUBPROCESS_TIMEOUT_S = 20
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # nvidia-smi underlines its topo header


def not_available(reason: str) -> str:
    """The value of a field that could not be read."""
    return NOT_AVAILABLE_PREFIX + reason


def is_available(value: Any) -> bool:
    """False for a ``not_available(...)`` value, True for anything else."""
    return not (isinstance(value, str) and value.startswith(NOT_AVAILABLE_PREFIX))


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return f"{type(exc).__name__}: {text}"


def _try(fn: Callable[[], Any], what: str | None = None) -> Any:
    """fn(), or not_available(<why it failed>)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a capture must never crash
        return not_available(f"{what}: {_reason(exc)}" if what else _reason(exc))


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    """stdout of cmd; raises RuntimeError with the reason if it cannot run or fails."""
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"{cmd[0]} not found on PATH")
    proc = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S
    )
    if proc.returncode != 0:
        err = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}: {err[0].strip() if err else ''}"
        )
    return _ANSI_ESCAPE.sub("", proc.stdout)


# ---------------------------------------------------------------------- sections


def _detkit_section() -> dict[str, Any]:
    def version() -> str:
        try:
            return importlib.metadata.version("detkit")
        except importlib.metadata.PackageNotFoundError:
            return not_available("the detkit distribution is not installed (pip install -e .)")

    section: dict[str, Any] = {
        "version": version(),
        "captured_at_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "schema": SCHEMA_VERSION,
    }
    section.update(_git_info())
    return section


def _git_info() -> dict[str, Any]:
    """The commit of the checkout this module runs from, else $DETKIT_GIT_COMMIT."""
    git_reason = ""
    try:
        top = _run(["git", "-C", str(_REPO_ROOT), "rev-parse", "--show-toplevel"]).strip()
        # Only this checkout counts: a venv inside some other repository must not lend its commit.
        if Path(top).resolve() != _REPO_ROOT:
            raise RuntimeError(f"{_REPO_ROOT} is not a git checkout root (toplevel is {top})")
        commit = _run(["git", "-C", str(_REPO_ROOT), "rev-parse", "HEAD"]).strip()
        status = _run(
            ["git", "-C", str(_REPO_ROOT), "status", "--porcelain", "--untracked-files=no"]
        )
        info = {"git_commit": commit, "git_commit_source": "git", "git_dirty": bool(status.strip())}
        declared = os.environ.get("DETKIT_GIT_COMMIT", "").strip()
        if declared and not commit.startswith(declared) and not declared.startswith(commit):
            # A copied tree can carry a stale .git: keep both, the reader decides which files ran.
            info["git_commit_declared"] = declared
            info["git_commit"] = f"{commit} (DETKIT_GIT_COMMIT says {declared})"
        return info
    except Exception as exc:  # noqa: BLE001
        git_reason = _reason(exc)
    env_commit = os.environ.get("DETKIT_GIT_COMMIT", "").strip()
    if env_commit:
        return {
            "git_commit": env_commit,
            "git_commit_source": "DETKIT_GIT_COMMIT",
            "git_dirty": not_available("unknown when the commit comes from DETKIT_GIT_COMMIT"),
        }
    reason = f"git: {git_reason}; DETKIT_GIT_COMMIT is not set"
    return {
        "git_commit": not_available(reason),
        "git_commit_source": not_available(reason),
        "git_dirty": not_available(reason),
    }


def _python_section() -> dict[str, Any]:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def _packages_section() -> dict[str, Any]:
    def version(name: str) -> str:
        if name == "torch":
            # The imported module's own string keeps the local part (2.11.0+cu130) that some
            # installs drop from the distribution metadata.
            try:
                return str(_import_torch().__version__)
            except Exception:  # noqa: BLE001 - fall back to the metadata
                pass
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return not_available(f"{name} is not installed")

    return {name: version(name) for name in PACKAGES}


def _import_torch():
    import torch  # noqa: PLC0415 - deliberately lazy

    return torch


def _nccl_version_string(code: int) -> str:
    # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000 + ... before.
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def _nccl_library_candidates(torch) -> tuple[list[str], str]:
    """Paths of libnccl: the one mapped in this process, else those in torch's lib dirs."""
    mapped: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if "/libnccl" in path and ".so" in path and path not in mapped:
                    mapped.append(path)
    except OSError:
        pass
    if mapped:
        return mapped, "mapped in this process (loaded by torch)"
    found: list[str] = []
    torch_dir = Path(torch.__file__).resolve().parent
    search = [torch_dir / "lib", torch_dir.parent / "nvidia" / "nccl" / "lib"]
    for directory in search:
        if directory.is_dir():
            found += sorted(str(p) for p in directory.glob("libnccl.so*"))
    return found, "found beside torch (not loaded by this process)"


def _nccl_runtime(torch) -> dict[str, Any]:
    paths, source = _nccl_library_candidates(torch)
    if not paths:
        reason = "no libnccl mapped in this process or found beside torch"
        return {"version": not_available(reason), "library": not_available(reason)}
    lib = ctypes.CDLL(paths[0])
    code = ctypes.c_int(0)
    rc = lib.ncclGetVersion(ctypes.byref(code))
    if rc != 0:
        reason = f"ncclGetVersion returned {rc}"
        return {"version": not_available(reason), "library": paths[0]}
    return {"version": _nccl_version_string(code.value), "library": paths[0], "source": source}


def _cuda_section(nvml: _Nvml) -> dict[str, Any]:
    section: dict[str, Any] = {}
    try:
        torch = _import_torch()
    except Exception as exc:  # noqa: BLE001
        reason = f"torch import failed: {_reason(exc)}"
        torch = None
        for key in ("torch_cuda_runtime", "nccl_compiled", "nccl_runtime"):
            section[key] = not_available(reason)
    if torch is not None:
        cuda_rt = torch.version.cuda
        section["torch_cuda_runtime"] = (
            cuda_rt
            if cuda_rt
            else not_available("torch was built without CUDA (torch.version.cuda is None)")
        )

        def nccl_compiled() -> str:
            version = torch.cuda.nccl.version()
            return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)

        section["nccl_compiled"] = _try(nccl_compiled, "torch.cuda.nccl.version()")
        section["nccl_runtime"] = _try(lambda: _nccl_runtime(torch), "libnccl ncclGetVersion")
    section["driver_version"] = nvml.call(lambda m: m.nvmlSystemGetDriverVersion())

    def driver_cuda() -> str:
        v = nvml.module.nvmlSystemGetCudaDriverVersion_v2()
        return f"{v // 1000}.{(v % 1000) // 10}"

    section["driver_cuda_version"] = nvml.call(lambda m: driver_cuda())
    return section


def _torch_devices(probe_cuda: bool) -> list[dict[str, Any]] | str:
    if not probe_cuda:
        return not_available("skipped: capture_env(probe_cuda=False)")
    try:
        torch = _import_torch()
    except Exception as exc:  # noqa: BLE001
        return not_available(f"torch import failed: {_reason(exc)}")
    if not torch.version.cuda:
        return not_available("torch was built without CUDA (torch.version.cuda is None)")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return not_available(f"torch.cuda.is_available() is False{hint}")
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        dev: dict[str, Any] = {
            "index": index,
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "total_memory_bytes": int(props.total_memory),
        }
        l2 = getattr(props, "L2_cache_size", None)
        dev["l2_cache_bytes"] = (
            int(l2) if l2 is not None else not_available("not in torch's properties")
        )
        uuid = getattr(props, "uuid", None)
        dev["uuid"] = str(uuid) if uuid is not None else not_available("not in torch's properties")
        bus_id = cuda_pci_bus_id(props)
        dev["pci_bus_id"] = bus_id if bus_id is not None else not_available("not in torch's properties")
        devices.append(dev)
    return devices


def cuda_pci_bus_id(props: Any) -> str | None:
    """The PCI address of a CUDA device (torch's device properties) as NVML spells it, or None when
    torch does not report it. NVML numbers every GPU, CUDA only the visible ones: this joins the two."""
    if not all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return None
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"


class _Nvml:
    """NVML initialised once for a capture; every query degrades to not_available."""

    def __init__(self) -> None:
        self.module = None
        self.reason = ""
        try:
            import pynvml  # noqa: PLC0415 - nvidia-ml-py, lazy

            pynvml.nvmlInit()
            self.module = pynvml
        except Exception as exc:  # noqa: BLE001
            self.reason = f"NVML: {_reason(exc)}"

    def call(self, fn: Callable[[Any], Any]) -> Any:
        if self.module is None:
            return not_available(self.reason)
        try:
            value = fn(self.module)
        except Exception as exc:  # noqa: BLE001
            return not_available(f"NVML: {_reason(exc)}")
        return value.decode() if isinstance(value, bytes) else value

    def close(self) -> None:
        if self.module is not None:
            try:
                self.module.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass


def _nvml_devices(nvml: _Nvml) -> list[dict[str, Any]] | str:
    if nvml.module is None:
        return not_available(nvml.reason)
    count = nvml.call(lambda m: m.nvmlDeviceGetCount())
    if not is_available(count):
        return count
    return [_nvml_device(nvml, index) for index in range(count)]


def _nvml_device(nvml: _Nvml, index: int) -> dict[str, Any]:
    handle = nvml.call(lambda m: m.nvmlDeviceGetHandleByIndex(index))
    if not is_available(handle):
        return {"nvml_index": index, "name": handle, "uuid": handle, "pci_bus_id": handle}
    clocks = {
        "sm_current": nvml.call(lambda m: m.nvmlDeviceGetClockInfo(handle, m.NVML_CLOCK_SM)),
        "sm_max": nvml.call(lambda m: m.nvmlDeviceGetMaxClockInfo(handle, m.NVML_CLOCK_SM)),
        "sm_application": nvml.call(
            lambda m: m.nvmlDeviceGetApplicationsClock(handle, m.NVML_CLOCK_SM)
        ),
        "mem_current": nvml.call(lambda m: m.nvmlDeviceGetClockInfo(handle, m.NVML_CLOCK_MEM)),
        "mem_max": nvml.call(lambda m: m.nvmlDeviceGetMaxClockInfo(handle, m.NVML_CLOCK_MEM)),
    }
    return {
        "nvml_index": index,
        "name": nvml.call(lambda m: m.nvmlDeviceGetName(handle)),
        "uuid": nvml.call(lambda m: m.nvmlDeviceGetUUID(handle)),
        "pci_bus_id": nvml.call(lambda m: m.nvmlDeviceGetPciInfo(handle).busId),
        "memory_total_bytes": nvml.call(lambda m: int(m.nvmlDeviceGetMemoryInfo(handle).total)),
        "clocks_mhz": clocks,
        "power_limit_w": nvml.call(lambda m: m.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0),
        "persistence_mode": nvml.call(
            lambda m: m.nvmlDeviceGetPersistenceMode(handle) == m.NVML_FEATURE_ENABLED
        ),
        "compute_mode": nvml.call(lambda m: int(m.nvmlDeviceGetComputeMode(handle))),
        "ecc_enabled": nvml.call(
            lambda m: m.nvmlDeviceGetEccMode(handle)[0] == m.NVML_FEATURE_ENABLED
        ),
    }


def _norm_uuid(value: Any) -> str:
    return str(value).lower().removeprefix("gpu-") if is_available(value) else ""


def _norm_bus(value: Any) -> str:
    # NVML: "00000000:18:00.0"; keep domain:bus:device.function, case-insensitive.
    return str(value).upper()[-16:] if is_available(value) else ""


def _match_nvml(dev: Mapping[str, Any], nvml_devs: list[dict[str, Any]] | str) -> Any:
    """The NVML record of a torch device, joined on UUID, else PCI bus id."""
    if isinstance(nvml_devs, str):
        return nvml_devs
    uuid, bus = _norm_uuid(dev["uuid"]), _norm_bus(dev["pci_bus_id"])
    for nd in nvml_devs:
        if (uuid and uuid == _norm_uuid(nd["uuid"])) or (
            bus and bus == _norm_bus(nd["pci_bus_id"])
        ):
            return nd
    return not_available("no NVML device with this UUID or PCI bus id")


def _gpus_section(probe_cuda: bool, nvml: _Nvml) -> dict[str, Any]:
    torch_devs = _torch_devices(probe_cuda)
    nvml_devs = _nvml_devices(nvml)
    section: dict[str, Any] = {
        "visible_count": len(torch_devs) if isinstance(torch_devs, list) else torch_devs,
        "nvml_count": len(nvml_devs) if isinstance(nvml_devs, list) else nvml_devs,
    }
    if isinstance(torch_devs, list):
        for dev in torch_devs:
            dev["nvml"] = _match_nvml(dev, nvml_devs)
        section["devices"] = torch_devs
    elif isinstance(nvml_devs, list):
        # torch sees no GPU but NVML does (CPU build of torch, CUDA_VISIBLE_DEVICES=""...).
        section["devices"] = [{"index": torch_devs, "nvml": nd} for nd in nvml_devs]
    else:
        cut = len(NOT_AVAILABLE_PREFIX)
        section["devices"] = not_available(f"torch: {torch_devs[cut:]}; {nvml_devs[cut:]}")
    return section


def _nvlink_section(nvml: _Nvml) -> list[dict[str, Any]] | str:
    if nvml.module is None:
        return not_available(nvml.reason)
    count = nvml.call(lambda m: m.nvmlDeviceGetCount())
    if not is_available(count):
        return count
    return [_nvlink_device(nvml, index) for index in range(count)]


def _nvlink_device(nvml: _Nvml, index: int) -> dict[str, Any]:
    m = nvml.module
    handle = nvml.call(lambda m: m.nvmlDeviceGetHandleByIndex(index))
    if not is_available(handle):
        return {"nvml_index": index, "links": handle}
    links = []
    for link in range(getattr(m, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            state = m.nvmlDeviceGetNvLinkState(handle, link)
        except Exception:  # noqa: BLE001 - NotSupported / InvalidArgument past the last link
            continue
        links.append(_nvlink_link(nvml, handle, link, state == m.NVML_FEATURE_ENABLED))
    return {
        "nvml_index": index,
        "pci_bus_id": nvml.call(lambda m: m.nvmlDeviceGetPciInfo(handle).busId),
        "active_links": sum(1 for lk in links if lk["state"] == "active"),
        "links": links if links else not_available("NVML reports no NVLink on this GPU"),
    }


def _nvlink_link(nvml: _Nvml, handle: Any, link: int, active: bool) -> dict[str, Any]:
    return {
        "link": link,
        "state": "active" if active else "inactive",
        "version": nvml.call(lambda m: m.nvmlDeviceGetNvLinkVersion(handle, link)),
        "remote_pci_bus_id": nvml.call(
            lambda m: m.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId
        ),
    }


def _topology_section() -> dict[str, Any]:
    return {"nvidia_smi_topo_m": _try(lambda: _run(["nvidia-smi", "topo", "-m"]).rstrip())}


def _memlock_limits() -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def fmt(v: int) -> Any:
        return "unlimited" if v == resource.RLIM_INFINITY else int(v)

    return {"soft_bytes": fmt(soft), "hard_bytes": fmt(hard)}


def _cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or not_available("no 'model name' in /proc/cpuinfo")


def _host_section() -> dict[str, Any]:
    section: dict[str, Any] = {
        "hostname": _try(socket.gethostname),
        "platform": _try(platform.platform),
        "kernel": _try(platform.release),
        "cpu_model": _try(_cpu_model),
        "cpus_usable": _try(lambda: len(os.sched_getaffinity(0))),
        "numa_nodes": _try(
            lambda: (
                len([p for p in Path("/sys/devices/system/node").glob("node[0-9]*")])
                or not_available("no /sys/devices/system/node/node*")
            )
        ),
        "dev_shm_bytes": _try(lambda: shutil.disk_usage("/dev/shm").total, "/dev/shm"),
        "memlock_limit": _try(_memlock_limits, "getrlimit(RLIMIT_MEMLOCK)"),
    }
    try:
        import psutil  # noqa: PLC0415

        section["cpu_count_logical"] = _try(lambda: psutil.cpu_count(logical=True))
        section["cpu_count_physical"] = _try(
            lambda: psutil.cpu_count(logical=False) or not_available("psutil could not tell")
        )
        vm = psutil.virtual_memory()
        section["memory_total_bytes"] = int(vm.total)
        section["memory_available_bytes"] = int(vm.available)
    except Exception as exc:  # noqa: BLE001
        reason = not_available(f"psutil: {_reason(exc)}")
        for key in (
            "cpu_count_logical",
            "cpu_count_physical",
            "memory_total_bytes",
            "memory_available_bytes",
        ):
            section[key] = reason
    return section


def _slurm_section(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: environ[k] for k in sorted(environ) if k.startswith("SLURM_")}


def _container_section(environ: Mapping[str, str]) -> dict[str, Any]:
    markers = [p for p in ("/.dockerenv", "/run/.containerenv") if os.path.exists(p)]
    if environ.get("container"):
        markers.append(f"$container={environ['container']}")
    image = environ.get("DETKIT_IMAGE", "").strip()
    section: dict[str, Any] = {
        "image": image or not_available("DETKIT_IMAGE is not set (set by the detkit Dockerfile)"),
        "in_container": bool(markers),
        "container_markers": markers,
    }
    if image:  # what the Dockerfile recorded about its own build
        base = environ.get("DETKIT_BASE_IMAGE", "").strip()
        checks = environ.get("DETKIT_BUILD_CHECKS", "").strip()
        section["base_image"] = base or not_available("DETKIT_BASE_IMAGE is not set")
        section["build_checks"] = checks or not_available("DETKIT_BUILD_CHECKS is not set")
        flags = dict(item.split("=", 1) for item in checks.split() if "=" in item)
        section["relaxed_checks"] = sorted(name for name, value in flags.items() if value == "1")
    return section


def _knobs_section(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        k: environ[k] for k in sorted(environ) if k.startswith(KNOB_PREFIXES) or k in KNOB_NAMES
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


SECTIONS = (
    "detkit",
    "python",
    "packages",
    "cuda",
    "gpus",
    "topology",
    "nvlink",
    "host",
    "slurm",
    "container",
    "env_knobs",
)


def capture_env(*, probe_cuda: bool = True) -> dict[str, Any]:
    """Capture the environment as a JSON-serialisable dict with one key per name in SECTIONS.

    Never raises for missing hardware or tools: such fields hold ``not_available(reason)``.
    ``probe_cuda=False`` skips the torch.cuda device queries (no CUDA driver initialisation).
    """
    environ = dict(os.environ)
    nvml = _Nvml()
    try:
        builders: dict[str, Callable[[], Any]] = {
            "detkit": _detkit_section,
            "python": _python_section,
            "packages": _packages_section,
            "cuda": lambda: _cuda_section(nvml),
            "gpus": lambda: _gpus_section(probe_cuda, nvml),
            "topology": _topology_section,
            "nvlink": lambda: _nvlink_section(nvml),
            "host": _host_section,
            "slurm": lambda: _slurm_section(environ),
            "container": lambda: _container_section(environ),
            "env_knobs": lambda: _knobs_section(environ),
        }
        env = {name: _try(builders[name], f"capturing {name}") for name in SECTIONS}
    finally:
        nvml.close()
    return _jsonable(env)


def env_summary(env: Mapping[str, Any]) -> dict[str, Any]:
    """The flat fields every result row carries (GPU, versions, commit, host, image)."""

    def get(*path: str) -> Any:
        node: Any = env
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                return not_available(f"{'.'.join(path)} missing from the capture")
            node = node[key]
        return node

    devices = get("gpus", "devices")
    if isinstance(devices, list) and devices:
        first = devices[0]
        gpu_name = first.get("name")
        if gpu_name is None and isinstance(first.get("nvml"), Mapping):
            gpu_name = first["nvml"].get("name")
        gpu_name = gpu_name if gpu_name is not None else not_available("device has no name")
    else:
        gpu_name = devices if isinstance(devices, str) else not_available("no GPU devices")
    return {
        "detkit_version": get("detkit", "version"),
        "git_commit": get("detkit", "git_commit"),
        "python": get("python", "version"),
        "torch": get("packages", "torch"),
        "triton": get("packages", "triton"),
        "numpy": get("packages", "numpy"),
        "cuda_runtime": get("cuda", "torch_cuda_runtime"),
        "driver": get("cuda", "driver_version"),
        "nccl_compiled": get("cuda", "nccl_compiled"),
        "nccl_runtime": get("cuda", "nccl_runtime", "version")
        if isinstance(get("cuda", "nccl_runtime"), Mapping)
        else get("cuda", "nccl_runtime"),
        "gpu_name": gpu_name,
        "gpu_count": get("gpus", "visible_count"),
        "hostname": get("host", "hostname"),
        "image": get("container", "image"),
        "captured_at_utc": get("detkit", "captured_at_utc"),
    }


# ------------------------------------------------------------------------- terminal table


def _flatten(value: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, list]]:
    """(scalar fields with dotted keys, lists of dicts by dotted key)."""
    scalars: dict[str, Any] = {}
    tables: dict[str, list] = {}
    for key, v in value.items():
        name = f"{prefix}{key}"
        if isinstance(v, Mapping):
            if not v:
                scalars[name] = "(none)"
            sub_scalars, sub_tables = _flatten(v, name + ".")
            scalars.update(sub_scalars)
            tables.update(sub_tables)
        elif isinstance(v, list) and v and all(isinstance(i, Mapping) for i in v):
            tables[name] = v
        elif isinstance(v, list):
            scalars[name] = ", ".join(str(i) for i in v) if v else "(none)"
        else:
            scalars[name] = v
    return scalars, tables


def _explode(rows: list) -> list[dict[str, Any]]:
    """One output row per innermost list item, parent scalars repeated (e.g. GPU x NVLink)."""
    out = []
    for row in rows:
        scalars, tables = _flatten(row)
        if not tables:
            out.append(scalars)
            continue
        for key, sub_rows in tables.items():
            for sub in _explode(sub_rows):
                out.append({**scalars, **{f"{key}.{k}": v for k, v in sub.items()}})
    return out


def format_env_table(env: Mapping[str, Any]) -> str:
    """Render a capture for a terminal: one key/value table per section, sub-tables for lists
    (GPUs, NVLink links) and verbatim blocks for multi-line text (nvidia-smi topo -m)."""
    from tabulate import tabulate  # noqa: PLC0415

    parts: list[str] = []
    for section, value in env.items():
        parts.append(f"== {section} ==")
        if isinstance(value, Mapping):
            scalars, tables = _flatten(value)
        elif isinstance(value, list) and all(isinstance(i, Mapping) for i in value):
            scalars, tables = ({}, {section: value}) if value else ({section: "(none)"}, {})
        else:
            scalars, tables = {section: value}, {}
        if not scalars and not tables:
            parts.append("(none)")
        blocks = {k: v for k, v in scalars.items() if isinstance(v, str) and "\n" in v}
        rows = [(k, v) for k, v in scalars.items() if k not in blocks]
        if rows:
            parts.append(tabulate(rows, tablefmt="plain", disable_numparse=True))
        for key, rows_list in tables.items():
            exploded = _explode(rows_list)
            headers = list(dict.fromkeys(k for r in exploded for k in r))
            parts.append(f"-- {key} --")
            if len(headers) > 8 and len(exploded) <= 8:
                # Wide and short (per-GPU records): one column per record reads better.
                body = [[h, *(r.get(h, "") for r in exploded)] for h in headers]
                cols = ["field", *(f"[{i}]" for i in range(len(exploded)))]
            else:
                body = [[r.get(h, "") for h in headers] for r in exploded]
                cols = headers
            parts.append(tabulate(body, headers=cols, tablefmt="simple", disable_numparse=True))
        for key, text in blocks.items():
            parts.append(f"-- {key} --")
            parts.append(text)
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"
