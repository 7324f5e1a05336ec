"""tools/gemm_ncu.py without a GPU: the case parser refuses bad input, ncu's raw CSV is parsed into report rows
(units converted, log lines skipped), the profiled process runs a case on the interpreter, and a missing ncu
is a clear error before any profiling. The profile itself needs ncu on a GPU host (tools/run_gpu_suite.sh ncu)."""

import pytest

import tools.gemm_ncu as gemm_ncu

# The shape of `ncu --csv --page raw`: ==PROF== log lines, a header row, a units row, one row per kernel.
NCU_CSV = '''==PROF== Connected to process 123
"ID","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","launch__grid_size","launch__waves_per_multiprocessor"
"","","usecond","%","",""
"0","det_gemm_kernel","52.80","61.25","192","1.45"
"1","nvjet_sm90_tst_128x256","1,024.00","88.10","132","1.00"
==PROF== Disconnected from process 123
'''


def test_raw_csv_becomes_report_rows():
    rows = gemm_ncu.parse_ncu_csv(NCU_CSV)
    assert [r["kernel"] for r in rows] == ["det_gemm_kernel", "nvjet_sm90_tst_128x256"]
    assert rows[0]["duration_us"] == pytest.approx(52.8) and rows[1]["duration_us"] == pytest.approx(1024.0)
    assert rows[0]["sm_throughput_pct"] == pytest.approx(61.25) and rows[0]["waves_per_sm"] == pytest.approx(1.45)
    assert rows[1]["grid"] == 132 and "dram_throughput_pct" not in rows[0]  # absent metrics stay absent
    ns = NCU_CSV.replace('"usecond"', '"nsecond"')
    assert gemm_ncu.parse_ncu_csv(ns)[0]["duration_us"] == pytest.approx(0.0528)
    short = NCU_CSV.replace('"usecond"', '"ns"')  # the spelling of the H200 host's ncu
    assert gemm_ncu.parse_ncu_csv(short)[0]["duration_us"] == pytest.approx(0.0528)
    with pytest.raises(ValueError, match=r"ncu duration unit 'furlong' is not known"):
        gemm_ncu.parse_ncu_csv(NCU_CSV.replace('"usecond"', '"furlong"'))
    assert gemm_ncu.parse_ncu_csv("==PROF== No kernels were profiled.\n") == []
    table = gemm_ncu.markdown([{"name": "det_gemm_fwd [M=512, N=6144, K=4096] bf16 b=linear", "impl": "detkit", **rows[0]}])
    cells = [c.strip() for c in table.splitlines()[2].split("|")]
    assert cells[3:6] == ["det_gemm_kernel", "52.8", "61.25"], cells


@pytest.mark.parametrize("text, message", [
    ("fwd:512:6144:4096", "expected op:M:N:K:layout"),
    ("gemm:512:6144:4096:linear", "op 'gemm' is not supported"),
    ("fwd:512:6144:4096:nk", "layout 'nk' is not supported"),
    ("db:512:6144:4096:linear", "layout 'linear' is not supported"),
    ("fwd:x:6144:4096:linear", "M, N, K must be integers"),
    ("fwd:0:6144:4096:linear", "must be >= 1"),
])
def test_bad_cases_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        gemm_ncu.parse_case(text)


def test_default_cases_parse_and_name_their_rows():
    cases = [gemm_ncu.parse_case(c) for c in gemm_ncu.DEFAULT_CASES]
    assert cases[0].name == "det_gemm_fwd [M=256, N=4096, K=6144] bf16 b=linear"
    assert gemm_ncu.range_name(cases[0], "cublas") == cases[0].name + " | ncu cublas"


@pytest.mark.parametrize("impl", gemm_ncu.IMPLS)
def test_profiled_process_runs_a_case_on_the_interpreter(impl):
    assert gemm_ncu.main(["--run", "da:7:40:56:kn", "--impl", impl, "--device", "cpu"]) == 0


def test_missing_ncu_is_refused_before_profiling(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm_ncu.shutil, "which", lambda name: None)
    monkeypatch.setattr(gemm_ncu.glob, "glob", lambda pattern: [])
    with pytest.raises(FileNotFoundError, match="ncu \\(Nsight Compute\\) not found"):
        gemm_ncu.main(["--out", str(tmp_path / "ncu")])
    assert not (tmp_path / "ncu").exists()


def test_a_config_is_profiled_beside_the_table_pick_and_bad_specs_are_refused(tmp_path):
    # An explicit det_gemm config runs as its own impl in the profiled process; a malformed spec is refused
    # (naming the expected form) before any profiling.
    assert gemm_ncu.main(["--run", "fwd:7:40:56:kn", "--impl", "config=16,32,32,1,4,2,tma", "--device", "cpu"]) == 0
    assert gemm_ncu.parse_config("128,128,64,8,8,6,ws").label() == "BM128_BN128_BK64_G8_w8_s6_ws"
    for spec, message in (("128,128,64", "expected BM,BN,BK,G,warps,stages"), ("128,128,64,8,8,6,fast", "variant")):
        with pytest.raises(ValueError, match=message):
            gemm_ncu.main(["--out", str(tmp_path / "ncu"), "--config", spec])
    with pytest.raises(ValueError, match="impl 'nvjet' is not supported"):
        gemm_ncu.run_once(gemm_ncu.parse_case("fwd:7:40:56:kn"), "nvjet", "cpu")
    assert not (tmp_path / "ncu").exists()
