"""tools/moe_block_cost.py on the CPU (Triton interpreter): every row and stage it times runs at an interpreter shape,
the split-view stages give the layer's own bits, and its table renders; the timings themselves are GPU-only."""

import torch

from detkit.kernels.moe.layer import deinterleave_gate_up
from tools import moe_block_cost


def test_every_timed_call_runs_and_the_split_stages_match_the_layers_own(device):
    import detkit
    from detkit.bench.moe import bf16_stage_fns

    p, fns, stage_inputs = moe_block_cost.build("tiny", device, seed=0, tokens=16)
    assert p.t == 16
    with detkit.batch_invariant_mode():
        for measure, rows in fns.items():
            assert set(rows) <= set(moe_block_cost.ROWS), measure
            for fn in rows.values():
                fn()
    backend = "triton_interpreter" if device.type == "cpu" else "cuda_sm90"
    split = moe_block_cost.split_stage_fns(p, stage_inputs["split"], backend)
    assert set(split) == {"up_swiglu", "dx_route", "wgrad_w1", "wgrad_w2"}
    own = bf16_stage_fns(p, {**stage_inputs["split"], **_own_layout(stage_inputs)}, backend)
    gu_split, h_split = split["up_swiglu"]()
    gu_own, h_own = own["up_swiglu"][0]()
    assert torch.equal(gu_split, gu_own) and torch.equal(h_split, h_own)
    assert torch.equal(split["wgrad_w2"](), own["wgrad_w2"][0]())


def _own_layout(stage_inputs: dict) -> dict:
    """The split views' weights in the layer's own layout (interleaved w1, contiguous w2)."""
    split = stage_inputs["split"]
    w1 = split["w1"]  # [E, H, 2I] split halves
    interleaved = torch.stack((w1[..., : w1.shape[2] // 2], w1[..., w1.shape[2] // 2:]), dim=3).flatten(2)
    assert torch.equal(deinterleave_gate_up(interleaved), w1)
    return {"w1": interleaved.contiguous(), "w2": split["w2"].contiguous()}


def test_render_names_every_layout_per_stage():
    timing = {"median_us": 10.0, "p20_us": 9.0, "p80_us": 11.0}
    result = {"preset": "x", "shape": {"T": 1}, "rows": {"fwd": {"layer": timing, "block": {**timing, "median_us": 20.0}}},
              "stages": {"layer up_swiglu": timing, "layer_linear up_swiglu": timing,
                         "split up_swiglu": {**timing, "median_us": 15.0}, "layer down": timing}}
    text = moe_block_cost.render(result)
    block_line = next(line for line in text.splitlines() if line.startswith("| block"))
    assert block_line.rstrip(" |").endswith("2")  # 20 µs against the layer's 10
    assert "15 (1.50)" in text
