"""Benchmark outputs: JSONL rows, CSV, a markdown table and a PNG plot, each written atomically."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from tabulate import tabulate

from toolkit.harness import INTERPRETER_BANNER, atomic_write_text


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def markdown_report(title: str, meta: dict, table_rows: list[dict]) -> str:
    lines = [f"# {title}", ""]
    if meta.get("backend") == "triton_interpreter":
        lines += [f"> **{INTERPRETER_BANNER}**", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items() if not isinstance(value, (dict, list))]
    lines += ["", tabulate(table_rows, headers="keys", tablefmt="github", floatfmt=".3g"), ""]
    return "\n".join(lines)


def save_figure(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    tmp = path.with_suffix(".png.tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
