"""Checks of a command line before any work: each raises :class:`UsageError` with one line that names
the value and what is supported.

``detkit audit`` and every ``detkit bench`` command run them before the first kernel, rank or file:

- :func:`check_device` -- ``cuda`` needs a GPU that torch can see; ``cpu`` is always available;
- :func:`check_preset` -- the name is one of the command's presets;
- :func:`check_out_dir` -- the results folder exists as a writable folder or can be created;
- :func:`check_count` -- ``--rounds``/``--iters`` and other counts are integers >= a minimum;
- :func:`check_sizes` -- shape values (``--m``, ``--n``, ...) are integers >= 1;
- :func:`check_run` -- device, preset, results folder and rounds in one call (what a bench runner calls).

The CLI's top-level handler (``toolkit.cli``) prints a UsageError as one line and exits with status 2.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

DEVICES = ("cuda", "cpu")


class UsageError(ValueError):
    """A mistake on the command line, found before any work (the CLI exits with status 2)."""


def check_device(device: str) -> str:
    """``device`` is usable here: a known name, and for ``cuda`` a GPU that torch sees."""
    if device not in DEVICES:
        raise UsageError(f"--device {device!r} is not supported; supported: {', '.join(DEVICES)}")
    if device == "cuda":
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise UsageError("--device cuda but TRITON_INTERPRET=1 is set (the Triton interpreter runs on the CPU); "
                             "unset it, or use --device cpu")
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
            raise UsageError(
                f"--device cuda: torch {torch.__version__} sees no CUDA GPU (CUDA_VISIBLE_DEVICES={visible}); "
                "use --device cpu for the Triton-interpreter runs (not a hardware result)")
    return device


def check_preset(preset: str | None, known: Iterable[str], option: str = "--preset") -> str | None:
    """``preset`` is None (the command's default) or one of ``known``."""
    names = sorted(known)
    if preset is not None and preset not in names:
        raise UsageError(f"{option} {preset!r} is not known; known: {', '.join(names)}")
    return preset


def check_out_dir(out: Path | str, option: str = "--out") -> Path:
    """``out`` is a folder this process can write, or one it can create: the nearest existing
    folder on its path takes a probe file (created and removed at once). Nothing else is created."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {str(path)!r} exists and is not a folder")
    probe_dir = path
    while not probe_dir.exists():
        if probe_dir.parent == probe_dir:
            break
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        raise UsageError(f"{option} {str(path)!r} cannot be created: {str(probe_dir)!r} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=probe_dir, prefix=".detkit-write-probe-"):
            pass
    except OSError as exc:
        where = "" if probe_dir == path else f": cannot write in {str(probe_dir)!r}, where it would be created"
        raise UsageError(f"{option} {str(path)!r} is not writable{where} ({exc.strerror or exc})") from None
    return path


def check_count(option: str, value: int | None, minimum: int = 1) -> int | None:
    """An integer count (rounds, iterations, warm-up calls) of at least ``minimum``; None passes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{option} must be an integer >= {minimum}; got {value!r}")
    if value < minimum:
        raise UsageError(f"{option} must be >= {minimum}; got {value}")
    return value


def check_sizes(option: str, values: Iterable[int] | int | None) -> tuple[int, ...]:
    """Shape values (M, N, tokens, ...): integers >= 1. Returns them as a tuple."""
    if values is None:
        return ()
    values = (values,) if isinstance(values, int) else tuple(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise UsageError(f"{option} values must be integers >= 1; got {', '.join(repr(v) for v in bad)}")
    return values


def check_run(*, device: str, preset: str | None = None, presets: Iterable[str] | None = None,
              out_dir: Path | str | None = None, rounds: int | None = None) -> None:
    """The checks every run command shares, in the order a user reads the flags: device, preset
    (against ``presets`` when given), rounds, then the results folder."""
    check_device(device)
    if presets is not None:
        check_preset(preset, presets)
    check_count("--rounds", rounds)
    if out_dir is not None:
        check_out_dir(out_dir)


def click_check(check: Callable, *args, default=None) -> Callable:
    """A click option callback that runs ``check(*args, value)`` as the option is parsed, before any work;
    a missing value is checked as ``default`` (None: not checked). A refusal is a click usage error."""
    import click

    def callback(ctx, param, value):
        if ctx.resilient_parsing:
            return value
        checked = value if value is not None else default
        if checked is not None:
            try:
                check(*args, checked)
            except UsageError as exc:
                raise click.UsageError(str(exc)) from None
        return value
    return callback
