"""detkit.bench.moe_gaps: the interval arithmetic that turns one profiled MoE call into idle time and gaps
(checked on hand-made timelines), and its refusals. The profile itself needs a GPU."""

import pytest
import torch

from detkit.bench.moe_gaps import Span, idle_gaps, main, split_at, stage_of, union_us


def test_union_counts_overlap_once_and_skips_nested_spans():
    spans = [Span("a", 10, 20), Span("b", 15, 30), Span("c", 16, 18), Span("d", 40, 45)]
    assert union_us(spans) == 20 + 5
    assert union_us([]) == 0


def test_idle_gaps_include_the_host_lead_and_skip_short_ones():
    kernels = [Span("hist", 30, 40), Span("scan", 41, 45), Span("up", 100, 900), Span("down", 850, 1000)]
    gaps = idle_gaps(0, kernels, min_gap_us=5)
    assert gaps == [
        {"gap_us": 30, "at_us": 0, "after": None, "before": "hist"},  # the host lead
        {"gap_us": 55, "at_us": 45, "after": "scan", "before": "up"},
    ]  # 1 us between hist and scan is under the threshold; up and down overlap: no gap
    starts = {k.name: k.start_us for k in kernels}
    assert all(0 + g["at_us"] + g["gap_us"] == starts[g["before"]] for g in gaps)  # where profile_call looks up the stage
    window = 1000 - 0
    assert window - union_us(kernels) == 30 + 1 + 55


def test_stage_of_picks_the_innermost_span():
    stages = [Span("fwd", 0, 100), Span("up", 10, 50)]
    assert stage_of(20, stages) == "up" and stage_of(60, stages) == "fwd" and stage_of(200, stages) is None


def test_cli_refuses_an_unknown_preset_before_anything(tmp_path):
    with pytest.raises(SystemExit, match=r"unknown preset\(s\) \['nope'\]; supported: \["):
        main(["--preset", "nope", "--out", str(tmp_path)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cli_refuses_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing written


def test_split_at_groups_the_kernels_between_markers_in_start_order():
    ks = [Span("a", 5, 6), Span("m", 0, 1), Span("b", 2, 3), Span("m", 4, 4.5), Span("early", -2, -1), Span("c", 7, 8)]
    groups = split_at(ks, lambda k: k.name == "m")
    assert [[k.name for k in g] for g in groups] == [["b"], ["a", "c"]]  # before the first marker: dropped
