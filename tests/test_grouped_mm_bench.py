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


def test_model_cases_both_weight_layouts_and_tma_candidates(tmp_path, device, monkeypatch):
    """--model/--tokens name the cases, --weights kn adds the weights' other layout (the weight gradient once per
    case), --variants tma --max-candidates 1 keeps the first TMA candidate, with the pinned config's bits; --impls /
    --timings graph drop the rest (eager columns None)."""
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/grouped_tma.sh")
    monkeypatch.setitem(grouped_mm_bench.MODELS, "tiny", (2, 32, 16, 2))  # E, H, I, K
    out = tmp_path / "grouped.json"
    rc = grouped_mm_bench.main(["--device", "cpu", "--model", "tiny", "--tokens", "8", "--weights", "transposed", "kn",
                                "--ops", "up", "up_dgrad", "up_wgrad", "--configs", "--variants", "tma",
                                "--max-candidates", "1", "--impls", "torch", "detkit", "--timings", "graph",
                                "--rounds", "1", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    keys = [(r["weights"], r["op"], r["layout"], r["impl"]) for r in rows]
    impls = ("torch", "detkit", "config0")  # the first TMA candidate only
    cases = [("transposed", "up", "nt"), ("transposed", "up_dgrad", "nn"), ("transposed", "up_wgrad", "tn"),
             ("kn", "up", "nn"), ("kn", "up_dgrad", "nt")]
    assert keys == [(*case, impl) for case in cases for impl in impls]
    for r in rows:
        assert r["model"] == "tiny" and r["T"] == 8 and r["rows"] == 16
        assert r["eager_us"] is None and r["graph_us"] > 0 and r["graph_ratio_vs_torch"] > 0
        if r["impl"].startswith("config"):
            assert r["config"]["variant"] == "tma" and r["same_bits_as_pinned"] is True and r["error"] is None


def test_a_refused_candidate_is_reported_in_its_row_and_fails_the_run(tmp_path, device, monkeypatch):
    """A candidate whose call raises (here one made to refuse) gets a row saying why and no timing; the others are
    still timed, and the run exits non-zero."""
    if device.type != "cpu":
        pytest.skip("the GPU run is tools/gpu/grouped_tma.sh")
    from detkit.kernels.grouped.configs import GroupedConfig

    good, refused = GroupedConfig(16, 16, 16, 4, 1), GroupedConfig(16, 16, 16, 4, 1, variant="tma")
    call = grouped_mm_bench.detkit_call

    def detkit_call(a, b, offs, config=None):
        if config == refused:
            raise ValueError("variant 'tma' cannot describe a (refused for this test)\nsecond line")
        return call(a, b, offs, config)

    monkeypatch.setattr(grouped_mm_bench, "candidate_configs", lambda op, device, variants: [good, refused])
    monkeypatch.setattr(grouped_mm_bench, "detkit_call", detkit_call)
    out = tmp_path / "grouped.json"
    rc = grouped_mm_bench.main(["--device", "cpu", "--case", "2", "32", "16", "16", "--ops", "up", "--configs",
                                "--impls", "torch", "detkit", "--timings", "graph", "--rounds", "1", "--json",
                                str(out)])
    assert rc == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["torch", "detkit", "config0", "config1"]
    assert rows[2]["graph_us"] > 0 and rows[2]["same_bits_as_pinned"] is True and rows[2]["error"] is None
    assert rows[3]["graph_us"] is None and rows[3]["same_bits_as_pinned"] is None
    assert rows[3]["error"] == "ValueError: variant 'tma' cannot describe a (refused for this test)"
