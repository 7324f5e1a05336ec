"""Result rows and the files they are written to, shared by the harness and the report writers.

An audit row is a ``Row``; a benchmark row is a plain dict with ``name`` and ``passed``. Both go to
``rows.jsonl`` through ``RowWriter`` (one flushed and fsynced line per row, so a killed run keeps
every finished case), and every report file is written with ``atomic_write_text`` (temp file +
rename), so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

INTERPRETER_BANNER = (
    "BACKEND triton_interpreter: CPU emulation of the Triton kernels at tiny shapes. "
    "This is NOT a hardware result and says nothing about speed or Hopper tensor-core bits."
)


@dataclass
class Row:
    """One checked audit case. ``name`` is the case's NVTX range name too."""

    suite: str
    check: str
    name: str
    passed: bool
    backend: str
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def row_dict(row: Row | dict) -> dict:
    """An audit ``Row`` or a benchmark row as the dict ``rows.jsonl`` holds."""
    return row.as_dict() if isinstance(row, Row) else row


_open_writers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # resolved path -> its open RowWriter


class RowWriter:
    """Appends rows (``Row`` or dict) to a JSONL file, one fsynced line each; ``path`` None writes nothing.

    The file is truncated when the writer opens it: a results folder reused by a later run
    (``--out /results`` in compose.yaml) holds that run's rows only, matching its report."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file = None
        self._lock = threading.Lock()  # a rank giving up seals its file from its watch thread (seal_rows)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")
            _open_writers[Path(path).resolve()] = self

    def write(self, row: Row | dict) -> None:
        line = json.dumps(row_dict(row), default=str) + "\n"
        with self._lock:
            if self._file is None:
                return
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def seal_rows(path: Path) -> None:
    """Close the open RowWriter of ``path``, if any, after the line it may be writing: later rows of this process
    are dropped, so a report merged from the file from now on holds every row the file will ever hold."""
    writer = _open_writers.get(Path(path).resolve())
    if writer is not None:
        writer.close()


def write_rows(path: Path, rows: Iterable[Row | dict]) -> None:
    """``rows`` as ``path``'s whole content, through ``RowWriter`` (one fsynced line each)."""
    writer = RowWriter(path)
    try:
        for row in rows:
            writer.write(row)
    finally:
        writer.close()


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def summarize(rows: list[Row]) -> list[dict]:
    """One line per (suite, check) of audit rows: counts of passed and failed rows."""
    table: dict[tuple[str, str], dict] = {}
    for row in rows:
        entry = table.setdefault((row.suite, row.check), {"suite": row.suite, "check": row.check,
                                                           "passed": 0, "failed": 0})
        entry["passed" if row.passed else "failed"] += 1
    return list(table.values())
