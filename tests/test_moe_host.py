"""tools/moe_host.py on the CPU: the no-op launch stand-in counts the layer's launches by kernel and restores
Triton's launch; the report carries both measures."""

import json

from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from tools import moe_host


def test_counts_the_layers_launches_and_restores_triton(tmp_path):
    launch_before = (JITFunction.__getitem__, InterpretedFunction.__getitem__)
    out = tmp_path / "host.json"
    assert moe_host.main(["--calls", "2", "--rounds", "1", "--shape", "64", "128", "64", "4", "2",
                          "--json", str(out)]) == 0
    assert (JITFunction.__getitem__, InterpretedFunction.__getitem__) == launch_before
    results = json.loads(out.read_text())
    fwd, fwd_bwd = results["measures"]["fwd"], results["measures"]["fwd_bwd"]
    # The grouped GEMMs: up and down forward; dgrad and dX more in the backward; the weight gradients apart.
    assert fwd["by_kernel"]["moe_grouped_gemm_kernel"] == 2
    assert fwd_bwd["by_kernel"]["moe_grouped_gemm_kernel"] == 4
    assert fwd_bwd["by_kernel"]["moe_wgrad_kernel"] == 2 and "moe_wgrad_kernel" not in fwd["by_kernel"]
    assert fwd["launches"] == sum(fwd["by_kernel"].values()) < fwd_bwd["launches"]
    assert fwd["host_us_median"] > 0 and fwd_bwd["host_us_median"] > 0


def test_block_mode_times_transformers_block_under_the_mode(tmp_path):
    out = tmp_path / "block.json"
    assert moe_host.main(["--block", "--calls", "2", "--rounds", "1", "--shape", "4", "64", "32", "4", "2",
                          "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    infer = results["measures"]["infer"]
    assert results["layer"] == "block bf16" and list(results["measures"]) == ["infer"]
    # The router's linear (det_gemm) and the layer's forward: routing, up, down, combine.
    assert infer["by_kernel"]["moe_grouped_gemm_kernel"] == 2 and infer["launches"] > 2
    assert infer["host_us_median"] > 0
