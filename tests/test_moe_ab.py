"""bench/moe_ab.py: variant specs refused by name, the pinned table restored after every variant (also on an error),
and an interpreter run whose rows compare each variant's bits and time with the pinned table's (interpreter wall
time: plumbing, not a hardware result)."""

import json

import pytest
import torch

import detkit.bench.moe_ab as ab
from detkit.kernels.det_gemm import GemmConfig
import detkit.kernels.moe as km
from detkit.kernels.moe import MOE_CONFIGS


def test_parse_variant_reads_stages_and_refuses_by_name():
    name, stages = ab.parse_variant("wg=wgrad:128,128,64,1,8,4,ws;up:64,128,64,1,4,3")
    assert name == "wg" and stages == {"wgrad": GemmConfig(128, 128, 64, 1, 8, 4, "ws"),
                                        "up": GemmConfig(64, 128, 64, 1, 4, 3)}
    for spec, match in [("wgrad:1,2", "expected NAME="), ("x=", "expected NAME="),
                        ("pinned=up:64,128,64,1,4,3", "the pinned table's"),
                        ("x=upp:64,128,64,1,4,3", "stage 'upp' is not a MoE stage"),
                        ("x=up:64,128,64,1,4,3;up:64,128,64,1,4,4", "given twice"),
                        ("x=up:64,128", "expected BM,BN,BK,G,warps,stages"),
                        ("x=route:float16", "route dtype 'float16'")]:
        with pytest.raises(ValueError, match=match):
            ab.parse_variant(spec)
    assert ab.parse_variant("r=route:float32;down:64,32,32,1,4,1") == (
        "r", {"route": torch.float32, "down": GemmConfig(64, 32, 32, 1, 4, 1)})


def test_with_table_restores_the_pinned_table_after_an_error():
    backend = "triton_interpreter"
    kept = dict(MOE_CONFIGS[backend])
    seen = {}

    def fails():
        seen["wgrad"], seen["route"] = MOE_CONFIGS[backend]["wgrad"], km.ROUTE_DTYPE
        raise RuntimeError("inside")

    pinned_route = km.ROUTE_DTYPE
    with pytest.raises(RuntimeError, match="inside"):
        ab.with_table(backend, {"wgrad": GemmConfig(16, 32, 16, 1, 4, 1), "route": torch.float32}, fails)()
    assert seen == {"wgrad": GemmConfig(16, 32, 16, 1, 4, 1), "route": torch.float32}
    assert MOE_CONFIGS[backend] == kept and km.ROUTE_DTYPE is pinned_route is torch.bfloat16


def test_interpreter_ab_rows_compare_bits_and_time(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the interpreter run; on the GPU bench.moe_ab runs at the real presets")
    out = tmp_path / "ab"
    assert ab.main(["--device", "cpu", "--preset", "tiny", "--tokens", "48", "--rounds", "1", "--out", str(out),
                    "--variant", "small_wgrad=wgrad:16,32,16,1,4,1;combine:16,32,16,1,4,1",
                    "--variant", "fp32_route=route:float32"]) == 0
    data = json.loads((out / "rows.json").read_text())
    rows = {r["table"]: r for r in data["rows"]}
    assert set(rows) == {"pinned", "small_wgrad", "fp32_route"} and rows["pinned"]["ratio_to_pinned"] == 1.0
    # On the interpreter every tile gives the same bits (sequential accumulation): the check must say so.
    assert all(rows[n]["bits_equal_pinned"] and rows[n]["outputs_differing"] == [] for n in ("pinned", "small_wgrad"))
    # FP32 y and dx_route change out's and dx's rounding only (dscores come from dgrad, dW from dgu and dy).
    assert "out" in rows["fp32_route"]["outputs_differing"]
    assert set(rows["fp32_route"]["outputs_differing"]) <= {"out", "dx"}
    assert rows["fp32_route"]["overrides"] == {"route": "torch.float32"}
    assert rows["small_wgrad"]["overrides"] == {"wgrad": "BM16_BN32_BK16_G1_w4_s1",
                                                "combine": "BM16_BN32_BK16_G1_w4_s1"}
    assert all(r["median_us"] > 0 and r["T"] == 48 and "tflops" not in r for r in rows.values())
    assert data["meta"]["hardware_result"] is False
    assert ab.INTERPRETER_NOTE in (out / "report.md").read_text()


def test_a_variant_the_backend_refuses_fails_the_run_by_name(tmp_path, device):
    if device.type != "cpu":
        pytest.skip("the Gluon kernels run on the GPU; there this variant is a valid one")
    # tiny-fp8's dW1 / dW2 are [3, 128, 256] / [3, 128, 128]: the 128x128 tile divides both, so the pick goes to
    # the Gluon kernel, which the interpreter refuses. (On "tiny", H = 32: no ws tile divides dW and the pick runs
    # the same tile in Triton, as the table's fallback does.)
    kept = dict(MOE_CONFIGS["triton_interpreter"])
    ws = GemmConfig(128, 128, 64, 1, 8, 4, "ws")
    with pytest.raises(ValueError, match="variant 'ws' is a Gluon kernel for sm_90"):
        ab.run_ab(["tiny-fp8"], [16], {"ws": {"wgrad": ws}}, torch.device("cpu"), 1)
    assert MOE_CONFIGS["triton_interpreter"] == kept
    rows = ab.run_ab(["tiny"], [16], {"ws": {"wgrad": ws}}, torch.device("cpu"), 1)
    assert rows and all(r["bits_equal_pinned"] for r in rows)
