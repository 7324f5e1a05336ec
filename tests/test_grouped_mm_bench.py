"""tools/grouped_mm_bench.py on the interpreter (CPU): each (op, impl) row is validated before it is timed, carries
both timings of toolkit.timing (eager: time_interleaved; graph: time_graphs, eager on the CPU) as medians with
p20/p80, and its ratios to torch in the same run. Timings on the CPU are plumbing only."""

from __future__ import annotations

import json

import pytest

from tools import grouped_mm_bench


def test_rows_are_validated_and_timed_by_the_protocol(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/grouped_mm.sh")
    out = tmp_path / "grouped.json"
    rc = grouped_mm_bench.main(["--device", "cpu", "--case", "2", "32", "16", "16", "--rounds", "1", "--json",
                                str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["impl"]) for r in rows] == [
        (op, impl) for op in grouped_mm_bench.OPS for impl in ("torch", "detkit", "detkit_mode")]
    for r in rows:
        for timing in ("eager", "graph"):
            assert 0 < r[f"{timing}_p20_us"] <= r[f"{timing}_us"] <= r[f"{timing}_p80_us"], (r["op"], r["impl"])
        assert r["tflops_graph"] > 0 and r["eager_ratio_vs_torch"] > 0 and r["graph_ratio_vs_torch"] > 0
        assert (r["validation"] is not None) == (r["impl"] == "detkit")
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert all(r["eager_ratio_vs_torch"] == 1.0 and r["graph_ratio_vs_torch"] == 1.0 for r in torch_rows)
    assert all(r["validation"]["within_bound"] for r in rows if r["validation"])
