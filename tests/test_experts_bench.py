"""tools/experts_bench.py on the interpreter (tiny widths): both impls timed per pass from the same run, detkit's
out and gradients validated against transformers' grouped_mm before timing, the path the mode took named, and
``--profile``'s per-impl kernel tables written (empty on the CPU: no GPU kernels)."""

import json

import pytest

pytest.importorskip("transformers")


def test_experts_bench_tiny_mixtral_with_profile(tmp_path):
    from tools.experts_bench import VALIDATE_REL_L2, main

    out = tmp_path / "experts.json"
    assert main(["--device", "cpu", "--family", "mixtral", "--tiny", "--rounds", "1", "--tokens", "8", "--profile",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert sorted((r["pass"], r["impl"]) for r in rows) == [("fwd", "detkit"), ("fwd", "grouped_mm"),
                                                           ("fwd_bwd", "detkit"), ("fwd_bwd", "grouped_mm")]
    for r in rows:
        assert r["max_rel_l2_vs_grouped_mm"] <= VALIDATE_REL_L2
        assert any("moe experts" in p and "detkit.moe_mlp" in p for p in r["path"]), r["path"]
        base = next(x for x in rows if x["pass"] == r["pass"] and x["impl"] == "grouped_mm")
        assert r["speedup"] == pytest.approx(base["median_us"] / r["median_us"])
    assert result["meta"]["interpreter"] is True
    profiles = result["profiles"]["mixtral"]
    assert set(profiles) == {"grouped_mm", "detkit"}
    assert all(p["gpu_us"] == 0 and p["kernels"] == [] for p in profiles.values())  # the CPU runs no GPU kernel
