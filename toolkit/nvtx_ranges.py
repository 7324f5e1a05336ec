"""NVTX ranges for detkit, and the means to prove they are emitted without Nsight Systems.

Every benchmark case and audit stage runs inside ``nvtx_range(name)`` in the one NVTX domain
``"detkit"``, with ``name`` the exact report-row name (``det_gemm_fwd [M=4096, N=6144, K=4096]
bf16``), so that a profile, a CSV row and a log line join on one string.

Without a profiler attached the ``nvtx`` package hands back a dummy domain and the ranges cost
a Python call each; nothing needs a GPU.

Proof without nsys: ``native/nvtx_inject`` is a small NVTX injection library that logs every
push/pop/start/end/mark to the file named by ``DETKIT_NVTX_LOG``. ``build_injection_library``
builds it with gcc, ``run_with_injection`` runs a command under it, and ``check_ranges`` reads
the log back and lists what is wrong (missing names, wrong domain, unbalanced or misnested
ranges). See docs/nvtx.md.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DOMAIN = "detkit"
INJECTION_PATH_ENV = "NVTX_INJECTION64_PATH"
INJECTION_LOG_ENV = "DETKIT_NVTX_LOG"
INJECTION_LIB_NAME = "libdetkit_nvtx_inject.so"
DEFAULT_DOMAIN_LABEL = "<default>"  # how the injection log names the global (NULL) domain

_REPO_ROOT = Path(__file__).resolve().parents[1]
_INJECT_SRC_DIR = _REPO_ROOT / "native" / "nvtx_inject"
_DEFAULT_BUILD_DIR = _REPO_ROOT / "native" / "build"
# Keep in step with native/nvtx_inject/Makefile.
_GCC_FLAGS = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC")

# The domain is resolved on first use, not at import: creating it is the process's first NVTX
# call, which is when NVTX looks for an injection library (NVTX_INJECTION64_PATH).
_domain = None
_attributes: dict[str, object] = {}


def _get_domain():
    global _domain
    if _domain is None:
        import nvtx

        _domain = nvtx.get_domain(DOMAIN)
    return _domain


def nvtx_enabled() -> bool:
    """True when an NVTX tool (nsys, ncu, the detkit injection library) is attached."""
    import nvtx

    return nvtx.enabled() and isinstance(_get_domain(), nvtx.Domain)


class nvtx_range:
    """Context manager: one NVTX push/pop range named ``name`` in the ``detkit`` domain.

    A no-op (a dummy-domain call) when no profiler is attached. Ranges nest; push and pop
    happen on the calling thread, and the range is popped even if the body raises.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"nvtx_range needs a non-empty str name, got {name!r}")
        self.name = name

    def __enter__(self) -> nvtx_range:
        domain = _get_domain()
        attrs = _attributes.get(self.name)
        if attrs is None:
            # Registered once per name: nsys matches --nvtx-capture against registered strings.
            attrs = domain.get_event_attributes(message=self.name)
            if attrs is not None:  # None from the dummy domain: nothing to cache
                _attributes[self.name] = attrs
        domain.push_range(attrs)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _get_domain().pop_range()
        return False


def format_range_name(op: str, dims: Mapping[str, int], suffix: str | None = None) -> str:
    """The naming rule: ``op [K1=v1, K2=v2, ...] suffix``, dims in the order given.

    >>> format_range_name("det_gemm_fwd", {"M": 4096, "N": 6144, "K": 4096}, "bf16")
    'det_gemm_fwd [M=4096, N=6144, K=4096] bf16'
    """
    name = op
    if dims:
        name += " [" + ", ".join(f"{k}={v}" for k, v in dims.items()) + "]"
    if suffix:
        name += " " + suffix
    return name


# --------------------------------------------------------------------- injection library


def build_injection_library(out_dir: str | os.PathLike | None = None) -> Path:
    """Build ``libdetkit_nvtx_inject.so`` with gcc into ``out_dir`` (default native/build/).

    Rebuilds only when a source is newer than the library. Needs a detkit source checkout
    (native/ is not installed with the package) and gcc (or $CC).
    """
    src = _INJECT_SRC_DIR / "nvtx_inject.c"
    header = _INJECT_SRC_DIR / "nvtx_abi.h"
    if not src.is_file() or not header.is_file():
        raise FileNotFoundError(
            f"NVTX injection sources not found under {_INJECT_SRC_DIR}; "
            "build from a detkit source checkout"
        )
    out = Path(out_dir) if out_dir is not None else _DEFAULT_BUILD_DIR
    out.mkdir(parents=True, exist_ok=True)
    lib = out / INJECTION_LIB_NAME
    newest_src = max(src.stat().st_mtime, header.stat().st_mtime)
    if lib.is_file() and lib.stat().st_mtime >= newest_src:
        return lib
    cc = os.environ.get("CC", "gcc")
    tmp = out / f".{INJECTION_LIB_NAME}.{os.getpid()}.tmp"
    cmd = [cc, *_GCC_FLAGS, "-o", str(tmp), str(src), "-lpthread"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"C compiler {cc!r} not found; install gcc") from exc
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(
            f"building the NVTX injection library failed ({' '.join(cmd)}):\n{proc.stderr}"
        )
    tmp.replace(lib)  # atomic: a concurrent build never loads a half-written library
    return lib


def injection_env(lib_path: str | os.PathLike, log_path: str | os.PathLike) -> dict[str, str]:
    """The two variables that attach the logging injection library to a fresh process."""
    return {INJECTION_PATH_ENV: str(Path(lib_path).resolve()), INJECTION_LOG_ENV: str(log_path)}


def run_with_injection(
    cmd: Sequence[str],
    log_path: str | os.PathLike,
    lib_path: str | os.PathLike | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a fresh process with the injection library attached, logging to ``log_path``.

    ``env`` (default: this process's environment) is extended with the injection variables.
    The log file is truncated first. Returns the completed process (stdout/stderr captured).
    """
    lib = Path(lib_path) if lib_path is not None else build_injection_library()
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    full_env = dict(os.environ if env is None else env)
    full_env.update(injection_env(lib, log))
    return subprocess.run(
        list(cmd), env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@dataclass(frozen=True)
class NvtxEvent:
    """One line of the injection log (format: native/nvtx_inject/nvtx_inject.c)."""

    kind: str  # init | domain_create | domain_destroy | push | pop | start | end | mark
    domain: str
    message: str
    pid: int
    tid: int
    depth: int  # push/pop: 1-based nesting level in (thread, domain); 0 otherwise
    range_id: int  # start/end: the range id; 0 otherwise
    line: int  # 1-based line number in the log, for error messages


_UNESCAPE = {"\\": "\\", "t": "\t", "n": "\n", "r": "\r"}


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        c = field[i]
        if c == "\\" and i + 1 < len(field) and field[i + 1] in _UNESCAPE:
            out.append(_UNESCAPE[field[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def parse_injection_log(path: str | os.PathLike) -> list[NvtxEvent]:
    """Read an injection log. Raises ValueError naming the line on a malformed one."""
    events = []
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw or raw.startswith("#"):
            continue
        fields = raw.split("\t")
        if len(fields) != 7:
            raise ValueError(f"{path}:{lineno}: expected 7 tab-separated fields, got {raw!r}")
        kind, domain, message, pid, tid, depth, range_id = fields
        try:
            events.append(
                NvtxEvent(
                    kind=kind,
                    domain=_unescape(domain),
                    message=_unescape(message),
                    pid=int(pid),
                    tid=int(tid),
                    depth=int(depth),
                    range_id=int(range_id),
                    line=lineno,
                )
            )
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: bad number in {raw!r}") from exc
    return events


def check_ranges(
    events: Sequence[NvtxEvent],
    expected_names: Iterable[str],
    *,
    domain: str = DOMAIN,
    nesting: Iterable[tuple[str, str]] = (),
) -> list[str]:
    """Everything wrong with the ranges in ``events``; an empty list means all is well.

    Checks, for push/pop ranges of every (process, thread, domain):
    - the tool attached (an ``init`` line) and ``domain`` was created;
    - every name in ``expected_names`` was pushed in ``domain`` (a name seen only in another
      domain is reported as such);
    - balance: every pop closes the innermost open range, every push is popped;
    - the depth the library logged equals the depth replayed from the log;
    - each ``(parent, child)`` in ``nesting``: every range named ``parent`` in ``domain``
      encloses at least one range named ``child`` (pushed while it was open, same thread), e.g.
      every case range encloses its ``validate`` and ``time`` stages.
    Start/end ranges: every end matches a start and every start is ended.
    """
    problems: list[str] = []
    if not any(e.kind == "init" for e in events):
        problems.append("the injection library never attached (no 'init' line in the log)")
    if not any(e.kind == "domain_create" and e.domain == domain for e in events):
        problems.append(f"domain {domain!r} was never created")

    # Each open range: its push event and the names of the ranges opened inside it.
    stacks: dict[tuple[int, int, str], list[tuple[NvtxEvent, set[str]]]] = {}
    pushed_in: dict[str, set[str]] = {}
    required: dict[str, list[str]] = {}
    for parent, child in nesting:
        required.setdefault(parent, []).append(child)
    open_starts: dict[tuple[int, int], NvtxEvent] = {}
    for e in events:
        if e.kind == "push":
            stack = stacks.setdefault((e.pid, e.tid, e.domain), [])
            for _, inner in stack:
                inner.add(e.message)
            stack.append((e, set()))
            pushed_in.setdefault(e.message, set()).add(e.domain)
            if e.depth != len(stack):
                problems.append(
                    f"line {e.line}: push of {e.message!r} logged at depth {e.depth}, "
                    f"replayed depth is {len(stack)}"
                )
        elif e.kind == "pop":
            stack = stacks.setdefault((e.pid, e.tid, e.domain), [])
            if not stack:
                problems.append(
                    f"line {e.line}: pop in domain {e.domain!r} (thread {e.tid}) with no open range"
                )
                continue
            top, inner = stack.pop()
            # The library names the range a pop closes from its own stack, so a mismatch here
            # means a corrupt or interleaved log rather than a misnested program.
            if e.message != top.message or e.depth != top.depth:
                problems.append(
                    f"line {e.line}: pop of {e.message!r} at depth {e.depth} does not close "
                    f"the innermost open range {top.message!r} (line {top.line}, depth {top.depth})"
                )
            if top.domain == domain:
                for child in required.get(top.message, ()):
                    if child not in inner:
                        problems.append(
                            f"line {top.line}: range {top.message!r} encloses no {child!r} range"
                        )
        elif e.kind == "start":
            open_starts[(e.pid, e.range_id)] = e
        elif e.kind == "end":
            if open_starts.pop((e.pid, e.range_id), None) is None:
                problems.append(
                    f"line {e.line}: end of range id {e.range_id} that was never started"
                )

    for (pid, tid, dom), stack in sorted(stacks.items()):
        for e, _ in stack:
            problems.append(
                f"line {e.line}: range {e.message!r} in domain {dom!r} (pid {pid}, thread {tid}) "
                "was never popped"
            )
    for e in open_starts.values():
        problems.append(f"line {e.line}: start/end range {e.message!r} was never ended")

    for name in expected_names:
        domains = pushed_in.get(name, set())
        if domain in domains:
            continue
        if domains:
            problems.append(
                f"range {name!r} was pushed only in domain(s) {sorted(domains)}, not {domain!r}"
            )
        else:
            problems.append(f"range {name!r} was never pushed")
    return problems


def verify_nvtx_log(
    log_path: str | os.PathLike,
    expected_names: Iterable[str],
    *,
    domain: str = DOMAIN,
    nesting: Iterable[tuple[str, str]] = (),
) -> list[str]:
    """``check_ranges`` on a log file; a malformed or empty log is reported, not raised."""
    try:
        events = parse_injection_log(log_path)
    except (OSError, ValueError) as exc:
        return [f"cannot read NVTX log {log_path}: {exc}"]
    if not events:
        hint = f"was {INJECTION_PATH_ENV} set before the first NVTX call?"
        return [f"NVTX log {log_path} is empty: {hint}"]
    return check_ranges(events, expected_names, domain=domain, nesting=nesting)
