"""tools/paged_decompose.py on the CPU (the Triton interpreter; timings here are wall time of emulated kernels, not
hardware results): every detkit path of the decomposition gives the padded path's bits, the check that says so can
fail, and the rows carry every path. The GPU run is tools/gpu/paged_decode_decompose.sh."""

import argparse

import pytest
import torch

from tests.conftest import TEST_DEVICE
from tools.paged_decompose import DETKIT_PATHS, PATHS, decompose, parse_case, path_calls, same_bits

SMALL_HEADS = (4, 2, 64)  # query heads, KV heads, head dim: GQA at a size the interpreter runs in seconds

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU plumbing; the GPU run is "
                                "tools/gpu/paged_decode_decompose.sh")


@pytest.mark.parametrize("batch,keys", [(1, 40), (2, 24)])
def test_every_path_gives_the_padded_paths_bits_and_flash_is_close(batch, keys):
    calls = path_calls(batch, keys, torch.device("cpu"), 1, SMALL_HEADS)
    assert set(calls) == set(PATHS) and all(len(c) == 1 for c in calls.values())
    assert same_bits(calls, batch, SMALL_HEADS) == {p: True for p in DETKIT_PATHS}
    padded, flash = (calls[p][0]().reshape(batch, 4, 64).float() for p in ("padded", "flash"))
    assert (padded - flash).abs().max() <= 2 ** -6  # two roundings of BF16 outputs apart at most


def test_a_path_with_other_bits_is_reported():
    calls = path_calls(1, 24, torch.device("cpu"), 1, SMALL_HEADS)
    good = calls["paged16"][0]
    calls["paged16"] = [lambda: good() * (1 + 2 ** -7)]
    assert same_bits(calls, 1, SMALL_HEADS)["paged16"] is False


def test_rows_carry_every_path_and_their_ratio_to_the_padded_path():
    [row] = decompose([(1, 24)], torch.device("cpu"), rounds=1, heads=SMALL_HEADS, sets=1)
    assert (row["batch"], row["keys"], row["sets"]) == (1, 24, 1)
    assert all(row["same_bits_as_padded"].values()) and set(row["same_bits_as_padded"]) == set(DETKIT_PATHS)
    for p in PATHS:
        assert row[f"{p}_p20_us"] <= row[f"{p}_us"] <= row[f"{p}_p80_us"]
        assert row[f"{p}_over_padded"] == pytest.approx(row[f"{p}_us"] / row["padded_us"])


def test_cases_parse_or_are_refused_by_name():
    assert parse_case("8x8192") == (8, 8192)
    for bad in ("8", "0x16", "1xk"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"case '{bad}'"):
            parse_case(bad)


def test_the_profiled_process_runs_its_path_inside_the_ncu_range(monkeypatch):
    import detkit.toolkit.nvtx_ranges as ranges
    from tools.paged_decompose import profiled_run

    opened = []
    real = ranges.nvtx_range
    monkeypatch.setattr(ranges, "nvtx_range", lambda name: (opened.append(name), real(name))[1])
    profiled_run("paged16", torch.device("cpu"), cases=((1, 24), (2, 16)), heads=SMALL_HEADS)
    assert opened == ["ncu"]
