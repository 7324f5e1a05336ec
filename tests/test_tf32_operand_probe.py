"""tools/tf32_operand_probe.py on the CPU (the Triton interpreter: plumbing and bits, not a hardware timing): both
forms of the "tf32" dA and dB give the direct kernel's bits and torch.matmul's values within TF32's error, in rows
with a positive time each."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TEST_DEVICE
from tools import tf32_operand_probe


def test_both_forms_have_the_direct_kernels_bits(tmp_path):
    if TEST_DEVICE != "cpu":
        pytest.skip("the GPU run is tools/gpu/s34_call4.sh")
    out = tmp_path / "probe.json"
    assert tf32_operand_probe.main(["--device", "cpu", "--kn", "40,24", "--m", "5", "--rounds", "1",
                                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["impl"]) for r in rows] == [(op, impl) for op in ("da", "db")
                                                    for impl in ("torch", "direct", "swapped")]
    for r in rows:
        assert r["graph_us"] > 0
        if r["impl"] != "torch":
            assert r["bits_as_direct"] is True and r["max_rel_err_vs_torch"] < 2**-8, r
