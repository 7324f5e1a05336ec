"""tools/serving_speed.py on the CPU interpreter (plumbing, not speed): every mode serves the same steps, detkit mode
reads the step's lengths once for all its layers and the read-every-call mode at each call, and bad sizes are
refused by name before a model is built."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers is the optional extra detkit[models]")
from tools import serving_speed  # noqa: E402


def test_each_mode_serves_the_same_steps_and_detkit_reads_the_lengths_once_a_step(tmp_path, capsys):
    layers = 2
    assert serving_speed.main(["--device", "cpu", "--preset", "qwen3-tiny", "--layers", str(layers), "--requests", "2",
                               "--prompt-len", "4", "--new-tokens", "2", "--page-size", "4", "--max-batch-tokens",
                               "16", "--rounds", "1", "--samples", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serving_speed.json").read_text())
    assert result["hardware_result"] is False and result["prompt_lens"] == [2, 4]
    modes = result["modes"]
    assert set(modes) == set(serving_speed.MODES)
    steps = modes["default"]["steps_per_call"]
    assert steps == 2 and all(m["steps_per_call"] == steps for m in modes.values())  # a prefill and one decode
    assert modes["default"]["host_reads_per_call"] == 0
    assert modes["detkit"]["host_reads_per_call"] == steps
    # the adapter's read and the kernel's check at every layer
    assert modes["detkit_read_every_call"]["host_reads_per_call"] == 2 * layers * steps
    assert all(m["median_ms"] > 0 for m in modes.values())
    assert json.loads(capsys.readouterr().out) == result


def test_bad_sizes_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        serving_speed.main(["--device", "cpu", "--requests", "0"])
    assert "--requests 0 is not supported; supported: >= 1" in capsys.readouterr().err
