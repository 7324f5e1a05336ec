"""tools/moe_kernels_profile.py and tools/moe_ncu.py without a GPU: the per-kernel summary of a profiled call, ncu's
stall columns picked and ranked, and the refusals before any work. The profiles themselves need an H200
(reports/2026-12-02-h200-s19, calls 1 and 2)."""

import pytest
import torch

import tools.moe_kernels_profile as kp
import tools.moe_ncu as moe_ncu


def test_summary_sums_per_kernel_and_splits_busy_from_wall():
    # Two calls: kernels a (10 µs), b (30 µs) and a again (5 µs) per call, 5 µs idle between the calls.
    events = [("a", 0.0, 10.0), ("b", 10.0, 40.0), ("a", 40.0, 45.0),
              ("a", 50.0, 60.0), ("b", 60.0, 90.0), ("a", 90.0, 95.0)]
    s = kp.summarize(events, calls=2)
    assert [k["kernel"] for k in s["kernels"]] == ["b", "a"]  # largest first
    assert s["kernels"][1] == {"kernel": "a", "launches_per_call": 2.0, "us_per_call": 15.0}
    assert s["busy_us_per_call"] == pytest.approx(45.0) and s["wall_us_per_call"] == pytest.approx(47.5)
    with pytest.raises(ValueError, match="no kernels to summarize"):
        kp.summarize([], calls=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_kernel_profile_refuses_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        kp.main(["--preset", "tiny", "--impl", "bf16", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # nothing written


def test_kernel_profile_refuses_unknown_presets_and_impls(tmp_path, capsys):
    for argv in (["--preset", "nope", "--impl", "bf16"], ["--preset", "tiny", "--impl", "fp16"]):
        with pytest.raises(SystemExit):
            kp.main([*argv, "--out", str(tmp_path)])
        assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # before any work, GPU or not
        kp.main(["--preset", "tiny", "--impl", "bf16", "--calls", "0", "--out", str(tmp_path)])
    assert "--calls must be >= 1 and --warmup >= 0; got 0 and 3" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# The shape of `ncu --csv --page raw` with stall columns (cycles per issued instruction).
P, S = moe_ncu.STALL_PREFIX, moe_ncu.STALL_SUFFIX
NCU_CSV = f'''==PROF== Connected to process 7
"ID","Kernel Name","{P}barrier{S}","{P}long_scoreboard{S}","{P}selected{S}","{P}no_instruction{S}","{P}not_issued_x{S}","other"
"","","","","","","",""
"0","moe_ws_kernel","8.97","5.54","1.00","0.20","99.0","1"
"1","moe_combine_kernel","0.10","24.11","1.00","n/a","99.0","2"
'''


def test_stalls_ranks_each_kernels_reasons():
    st = moe_ncu.stalls(NCU_CSV, top=2)
    assert st == [{"barrier": 8.97, "long_scoreboard": 5.54}, {"long_scoreboard": 24.11, "selected": 1.0}]
    assert moe_ncu.stalls("==PROF== No kernels were profiled.\n") == []


def test_ncu_tool_needs_its_arguments_and_names_its_ranges(capsys):
    with pytest.raises(SystemExit):
        moe_ncu.main(["--preset", "reference"])
    assert "--out, --preset and --impl are required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        moe_ncu.main(["--preset", "nope", "--impl", "fp8", "--out", "x"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert moe_ncu.range_name("reference", "fp8") == "moe ncu fp8 reference"


def test_kernel_profile_shape_option_builds_the_sweep_point_and_refuses_bad_ones(tmp_path, capsys):
    p = kp.parse_shape("8192,3072,1536,128,2")
    assert (p.t, p.h, p.i, p.e, p.k, p.name) == (8192, 3072, 1536, 128, 2, "sweep-H3072-I1536-E128-K2-T8192")
    for bad, why in (("8192,3072,1536,128", "five positive integers"), ("8192,3072,0,8,2", "five positive integers"),
                     ("64,128,128,2,4", "need at least K experts"), ("1048576,8192,8192,8,8", "32-bit offsets")):
        with pytest.raises(SystemExit):
            kp.main(["--shape", bad, "--impl", "bf16", "--out", str(tmp_path)])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):  # neither a preset nor a shape
        kp.main(["--impl", "bf16", "--out", str(tmp_path)])
    assert "name at least one --preset or --shape" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
