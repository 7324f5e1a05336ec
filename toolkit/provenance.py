"""What ran: the pinned config tables and the source files of a run, recorded in every report's meta.

``config_tables()``: the tables of the kernel modules loaded in this process at report time, each
``{"name", "version", "module"}``. A kernel module that was never imported cannot have run, so the
list holds every table that ran; it may also hold a table whose module was imported without
launching a kernel (every run imports det_gemm to decide the backend). ``CONFIG_TABLES`` names every
table; tests/test_provenance.py checks that it covers each ``*CONFIG_TABLE_VERSION`` in kernels/.

``source_state()``: the package's source files (kernels/, toolkit/, audits/, bench/ and detkit/'s own
modules, in a checkout or installed) checked against git:

- ``digest``: ``sha256:`` of the manifest ``"<sha256 of file>  detkit/<part>/<path>\\n"``, one line per
  ``.py`` file sorted by path (what ``sha256sum`` prints), so a report matches a tree without git;
- in a git checkout: ``git_commit`` (HEAD), ``dirty_files`` (``git status --porcelain`` over the
  package folders, untracked files included) and ``head_digest`` (the same digest over HEAD's
  files). ``status`` is ``clean`` only when nothing is listed and the digests agree: a copied tree
  with a stale ``.git`` shows as ``dirty``, its changed files listed;
- without git (a container): ``git_commit`` is ``$DETKIT_GIT_COMMIT`` and ``status`` is
  ``unverified`` (nothing here can check it; the digest can, against a checkout), or ``unknown``
  when it is not set. A ``$DETKIT_GIT_COMMIT`` beside a checkout is kept as ``declared_commit``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# (table name, the module attribute holding its version), searched in every loaded detkit.kernels module.
CONFIG_TABLES = (
    ("det_gemm", "CONFIG_TABLE_VERSION"),
    ("det_gemm_fp32", "FP32_CONFIG_TABLE_VERSION"),
    ("moe_bf16", "MOE_CONFIG_TABLE_VERSION"),
    ("moe_fp8", "MOE_FP8_CONFIG_TABLE_VERSION"),
    ("invariant", "INVARIANT_CONFIG_TABLE_VERSION"),
    ("attention", "ATTENTION_CONFIG_TABLE_VERSION"),
    ("grouped", "GROUPED_CONFIG_TABLE_VERSION"),
)
KERNELS_PACKAGE = "detkit.kernels"
PARTS = ("kernels", "mode", "toolkit", "audits", "bench")  # folders of a checkout; sub-packages of detkit installed
PACKAGE_DIRS = (*PARTS, "detkit")  # what `git status` checks in a checkout
COMMIT_ENV = "DETKIT_GIT_COMMIT"
GIT_TIMEOUT_S = 20
_SOURCE_ROOT = Path(__file__).resolve().parents[1]  # a checkout's root, or the installed detkit/ folder


def config_tables(modules: Mapping[str, object] | None = None) -> list[dict]:
    """``{"name", "version", "module"}`` per table whose version attribute a loaded kernel module holds.
    A version re-exported by another module is listed once (the first module by name); two loaded
    modules holding different versions of one table are both listed, with ``conflict: True``."""
    modules = sys.modules if modules is None else modules
    loaded = sorted((name, mod) for name, mod in list(modules.items())
                    if mod is not None and (name == KERNELS_PACKAGE or name.startswith(KERNELS_PACKAGE + ".")))
    out = []
    for table, attr in CONFIG_TABLES:
        found: dict[str, str] = {}
        for name, mod in loaded:
            version = getattr(mod, attr, None)
            if isinstance(version, str):
                found.setdefault(version, name)
        for version, module in found.items():
            entry = {"name": table, "version": version, "module": module}
            if len(found) > 1:
                entry["conflict"] = True
            out.append(entry)
    return out


def format_config_tables(tables: list[dict]) -> str:
    """``det_gemm <version>, moe_bf16 <version>, ...`` for report.md."""
    return ", ".join(f"{t['name']} {t['version']}" + (" (CONFLICT)" if t.get("conflict") else "")
                     for t in tables) or "none loaded"


# ---------------------------------------------------------------------------------------------
# Source files
# ---------------------------------------------------------------------------------------------
def package_files(root: Path) -> dict[str, Path]:
    """``detkit/<part>/<path>`` -> file for every ``.py`` file of the package under ``root``: a checkout
    (``root/kernels``, ..., ``root/detkit/*.py``) or an installed ``detkit/`` folder (``root/kernels``, ...,
    ``root/*.py``). The logical paths are the same in both, so their digests compare."""
    files: dict[str, Path] = {}
    for part in PARTS:
        base = root / part
        for path in sorted(base.rglob("*.py")) if base.is_dir() else ():
            if "__pycache__" not in path.parts:
                files[f"detkit/{part}/{path.relative_to(base).as_posix()}"] = path
    top = root / "detkit" if (root / "detkit" / "__init__.py").is_file() else root
    for path in sorted(top.glob("*.py")):
        files[f"detkit/{path.name}"] = path
    return dict(sorted(files.items()))


def digest_of(contents: Mapping[str, bytes]) -> str:
    """``sha256:`` of the sha256sum-style manifest of ``{logical path: bytes}``."""
    manifest = "".join(f"{hashlib.sha256(data).hexdigest()}  {path}\n" for path, data in sorted(contents.items()))
    return "sha256:" + hashlib.sha256(manifest.encode()).hexdigest()


def tree_digest(root: Path) -> tuple[str, int]:
    """(digest, number of files) of the package's source files under ``root``."""
    files = package_files(root)
    return digest_of({p: f.read_bytes() for p, f in files.items()}), len(files)


def _git(root: Path, *args: str, stdin: bytes | None = None) -> bytes:
    proc = subprocess.run(["git", "-C", str(root), *args], input=stdin, capture_output=True, timeout=GIT_TIMEOUT_S,
                          check=False)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"git {' '.join(args)}: {err[-1] if err else f'exit {proc.returncode}'}")
    return proc.stdout


def logical_path(repo_path: str) -> str | None:
    """A checkout path's logical path (``kernels/moe/layer.py`` -> ``detkit/kernels/moe/layer.py``), None when it is not a
    package source file."""
    parts = repo_path.split("/")
    if not repo_path.endswith(".py") or "__pycache__" in parts:
        return None
    if parts[0] in PARTS and len(parts) > 1:
        return "detkit/" + repo_path
    if parts[0] == "detkit" and len(parts) == 2:
        return repo_path
    return None


def head_digest(root: Path, commit: str = "HEAD") -> str:
    """The digest of ``commit``'s package source files in the git checkout at ``root``."""
    listing = _git(root, "ls-tree", "-r", "-z", "--full-tree", commit, "--", *PACKAGE_DIRS).decode()
    blobs = {}
    for entry in filter(None, listing.split("\0")):
        info, path = entry.split("\t", 1)
        mode, kind, sha = info.split()
        logical = logical_path(path)
        if kind == "blob" and logical is not None and mode != "120000":
            blobs[logical] = sha
    batch = _git(root, "cat-file", "--batch", stdin="".join(f"{sha}\n" for sha in blobs.values()).encode())
    contents, pos = {}, 0
    for logical, sha in blobs.items():
        header_end = batch.index(b"\n", pos)
        size = int(batch[pos:header_end].split()[2])
        contents[logical] = batch[header_end + 1:header_end + 1 + size]
        pos = header_end + 1 + size + 1  # the content, then a newline
    return digest_of(contents)


def source_state(root: Path | None = None, environ: Mapping[str, str] | None = None) -> dict:
    """The package sources under ``root`` (default: the ones running) against git; see the module docstring."""
    root = Path(root) if root is not None else _SOURCE_ROOT
    env = os.environ if environ is None else environ
    digest, count = tree_digest(root)
    state: dict = {"digest": digest, "files": count, "root": str(root)}
    declared = env.get(COMMIT_ENV, "").strip()
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").decode().strip()).resolve()
        if top != root.resolve():
            raise RuntimeError(f"{root} is not a git checkout's root (its repository's root is {top})")
        commit = _git(root, "rev-parse", "HEAD").decode().strip()
        status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", *PACKAGE_DIRS).decode()
        dirty = sorted({entry[3:] for entry in status.split("\0") if len(entry) > 3 and entry[2] == " "})
        head = head_digest(root)
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        state.update(git_commit=declared or None, status="unverified" if declared else "unknown",
                     commit_source=COMMIT_ENV if declared else None,
                     reason=f"no git checkout here ({reason}); "
                            + (f"{COMMIT_ENV} is declared, not checked" if declared else f"{COMMIT_ENV} is not set"))
        return state
    clean = not dirty and head == digest
    state.update(git_commit=commit, commit_source="git", status="clean" if clean else "dirty", dirty_files=dirty,
                 head_digest=head)
    if declared:
        state["declared_commit"] = declared
        state["declared_commit_matches_head"] = commit.startswith(declared) and len(declared) >= 7
    return state


def format_source(state: dict) -> str:
    """One line for report.md: ``<commit> (<status>[: files]), <digest>``."""
    commit = state.get("git_commit") or "no commit"
    status = state.get("status", "unknown")
    dirty = state.get("dirty_files") or []
    shown = f": {', '.join(dirty[:5])}" + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "") if dirty else ""
    return f"{commit} ({status}{shown}), sources {state.get('digest')}"
