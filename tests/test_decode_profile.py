"""tools/decode_profile.py on the interpreter: both modes (and detkit mode with RMSNorm and rotary unfused) profiled on
the bench's filled cache, detkit mode's step on detkit's kernels (no torch SDPA or matmul kernel in its operators),
default mode's on torch's."""

import json

import pytest

pytest.importorskip("transformers")


def test_decode_profile_both_modes(tmp_path):
    from tools.decode_profile import main

    assert main(["--preset", "qwen3-tiny", "--layers", "1", "--batch", "2", "--cache-len", "8", "--steps", "1",
                 "--unfused", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "profile.json").read_text())
    assert set(result["modes"]) == {"default", "detkit", "detkit_unfused"}
    assert result["hardware_result"] is False and result["device"].startswith("cpu")
    ops = {mode: {row["op"] for row in m["top_cpu"]} for mode, m in result["modes"].items()}
    assert any("scaled_dot_product" in op for op in ops["default"])
    assert not any("scaled_dot_product" in op for op in ops["detkit"])
    for m in result["modes"].values():  # one interleaved round per --steps, each mode's median within its spread
        assert m["samples"] == 1 and m["wall_p20_us"] <= m["wall_us"] <= m["wall_p80_us"]
        assert 0 < m["host_p20_us"] <= m["host_us"] <= m["host_p80_us"]
    assert result["wall_ratio"] == pytest.approx(result["modes"]["detkit"]["wall_us"]
                                                 / result["modes"]["default"]["wall_us"])
    assert result["unfused_wall_ratio"] == pytest.approx(result["modes"]["detkit_unfused"]["wall_us"]
                                                               / result["modes"]["default"]["wall_us"])
    text = (tmp_path / "profile.md").read_text()
    assert "wall ratio detkit / default" in text and "RMSNorm and rotary unfused / default" in text


def test_decode_profile_refuses_bad_sizes(capsys):
    from tools.decode_profile import main

    with pytest.raises(SystemExit):
        main(["--cache-len", "0", "--out", "/nonexistent"])
    assert "--cache-len must be >= 1; got 0" in capsys.readouterr().err
