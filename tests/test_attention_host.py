"""tools/attention_host.py on the CPU: the no-op launch stand-in counts each measure's launches by kernel (the route
takes the sm_90 table's grid: one pass at 1k keys, the split grid and its combine pass at 32k), and Triton's launch
and the interpreter's config table are restored afterwards."""

import json

import pytest
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from detkit.kernels.attention.configs import CONFIG_TABLE, EAGER_SPLIT_GRID_MIN_KEYS
from tests.conftest import TEST_DEVICE
from tools import attention_host

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU measure needs the Triton interpreter")

FWD, COMBINE = "attention_fwd_kernel", "attention_fwd_combine_kernel"


def test_counts_each_measures_launches_and_restores_triton_and_the_table(tmp_path):
    launch_before = (JITFunction.__getitem__, InterpretedFunction.__getitem__)
    table_before = dict(CONFIG_TABLE["triton_interpreter"])
    out = tmp_path / "host.json"
    assert attention_host.main(["--calls", "1", "--rounds", "1", "--json", str(out)]) == 0
    assert (JITFunction.__getitem__, InterpretedFunction.__getitem__) == launch_before
    assert CONFIG_TABLE["triton_interpreter"] == table_before
    results = json.loads(out.read_text())
    cases = {(c["batch"], c["keys"]): c["measures"] for c in results["cases"]}
    assert sorted(cases) == [(1, 1024), (1, 32768), (8, 1024), (8, 32768)]
    for (batch, keys), measures in cases.items():
        assert list(measures) == ["sdpa", "one_pass", "split", "hf"]
        assert measures["one_pass"]["launches"] == {FWD: 1}
        assert measures["split"]["launches"] == {FWD: 1, COMBINE: 1}
        routed = {FWD: 1} if keys < EAGER_SPLIT_GRID_MIN_KEYS else {FWD: 1, COMBINE: 1}
        assert measures["sdpa"]["launches"] == routed
        assert measures["hf"]["launches"] == routed  # transformers' route: the same grid as SDPA's
        assert all(m["host_us"] > 0 for m in measures.values())


def test_model_step_is_routed_in_the_mode():
    """--model: a tiny Qwen3's decode step runs every layer's attention through the mode's transformers route."""
    from collections import Counter

    import torch

    from tools.moe_host import noop_launches

    with noop_launches(Counter()):
        row = attention_host.measure_model(torch.device("cpu"), calls=1, rounds=1, layers=2)
    assert row["counters"]["routed"]["attention (transformers) -> detkit.attention"] == 2
    assert row["counters"]["not_routed"] == {}
    assert row["host_us"] > 0
