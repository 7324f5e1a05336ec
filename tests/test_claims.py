"""The README's claims table and reports/INDEX.md are what the committed reports give (tools/claims.py)."""

import json
import shutil
from pathlib import Path

import pytest

from tools import claims

REPO = Path(__file__).resolve().parents[1]


def test_committed_readme_and_index_match_the_reports(capsys):
    assert claims.main(["--check"]) == 0, capsys.readouterr().out


def test_every_claim_links_a_committed_report_and_no_report_is_code():
    for rel in claims.SOURCES.values():
        assert (REPO / "reports" / rel).is_file(), rel
    code = [p for p in (REPO / "reports").rglob("*") if p.suffix in (".py", ".sh")]
    assert code == []


@pytest.fixture
def reports_copy(tmp_path):
    """A copy of reports/ and README.md that passes the check before a test edits it."""
    shutil.copytree(REPO / "reports", tmp_path / "reports")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    argv = ["--check", "--reports", str(tmp_path / "reports"), "--readme", str(tmp_path / "README.md")]
    assert claims.main(argv) == 0
    return tmp_path, argv


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def test_a_tampered_ratio_fails_the_check(reports_copy, capsys):
    tmp, argv = reports_copy

    def raise_speedup(doc):
        for v in doc["meta"]["derived"]["verdicts"]:
            if v["target"] == "fp8_reference":
                v["value"], v["verdict"] = 1.45, "PASS"

    for source in ("moe_bench_s23_landed", "moe_bench_s24"):  # every run of the claim
        _edit_json(tmp / "reports" / claims.SOURCES[source], raise_speedup)
    assert claims.main(argv) == 1
    out = capsys.readouterr().out
    assert "+| MoE FP8 fwd+bwd speed-up" in out and "1.450x; met by 4 of 4" in out and "| yes |" in out


def test_a_verdict_that_disagrees_with_its_value_is_refused(reports_copy, capsys):
    tmp, argv = reports_copy
    path = tmp / "reports" / claims.SOURCES["moe_bench_s23_landed"]

    def pass_a_failing_value(doc):
        next(v for v in doc["meta"]["derived"]["verdicts"] if v["target"] == "fp8_reference")["verdict"] = "PASS"

    _edit_json(path, pass_a_failing_value)
    assert claims.main(argv) == 2
    assert "verdict PASS disagrees with value" in capsys.readouterr().err


def test_a_tampered_audit_count_fails_the_check(reports_copy, capsys):
    tmp, argv = reports_copy
    path = tmp / "reports" / claims.SOURCES["moe_audit"]
    passed, _ = claims.audit_suite("moe")(json.loads(path.read_text())).value

    def drop_one_reject(doc):  # a consistent report of one BF16 check fewer: summary and rows agree
        doc["rows"].remove(next(r for r in doc["rows"] if r["suite"] == "moe" and r["check"] == "rejects"))
        next(s for s in doc["summary"] if s["suite"] == "moe" and s["check"] == "rejects")["passed"] -= 1

    _edit_json(path, drop_one_reject)
    assert claims.main(argv) == 1
    out = capsys.readouterr().out
    assert "+| MoE BF16 audit" in out and f"{passed - 1} passed, 0 failed (suite moe)" in out
    assert "+| MoE FP8 audit" not in out  # the other suite of the same report is counted apart


def test_a_decode_log_prob_that_differs_fails_the_mode_claim(reports_copy, capsys):
    tmp, argv = reports_copy
    path = tmp / "reports" / claims.SOURCES["model_audit"]

    def one_mismatch(doc):  # the row still says passed: the claim reads the comparison itself
        row = next(r for r in doc["rows"] if r["check"] == "decode_vs_trainer")
        row["details"]["mismatches"] = 1

    _edit_json(path, one_mismatch)
    assert claims.main(argv) == 1
    added = [line for line in capsys.readouterr().out.splitlines() if line.startswith("+| detkit mode (")]
    assert len(added) == 1 and "1 of 216 log-probs differ" in added[0] and "| **no** |" in added[0]


def test_a_report_whose_summary_disagrees_with_its_rows_is_refused(reports_copy, capsys):
    tmp, argv = reports_copy
    path = tmp / "reports" / claims.SOURCES["gemm_audit"]
    _edit_json(path, lambda doc: doc["summary"][0].update(passed=doc["summary"][0]["passed"] + 1))
    assert claims.main(argv) == 2
    err = capsys.readouterr().err
    assert claims.SOURCES["gemm_audit"] in err and "rows say" in err


def test_a_kept_run_listed_at_another_commit_than_its_report_declares_is_refused(reports_copy, capsys):
    tmp, argv = reports_copy
    readme = tmp / "reports" / "2026-12-01-h200" / "README.md"
    readme.write_text(readme.read_text().replace("- `call3/audit/` at `1332ec8`", "- `call3/audit/` at `81c32b0`"))
    assert claims.main(argv) == 2
    assert "declares 1332ec8" in capsys.readouterr().err


def test_gemm_graph_targets_judge_each_group_by_its_medians_and_worst_row():
    def row(op, n, m, ratio):
        return {"op": op, "K": 4, "N": n, "layout": "linear", "M": m, "ratio_graph": ratio}

    rows = [row("fwd", 8, 1024, 1.04), row("fwd", 8, 4096, 1.06), row("fwd", 8, 16384, 1.05),  # median 1.05: met
            row("fwd", 8, 16, 1.2),
            row("da", 8, 1024, 1.0), row("da", 8, 16, 1.6),  # a row above 1.5: not met
            row("db", 8, 128, 1.3), row("db", 8, 256, 1.3), row("db", 8, 4096, 1.0)]  # small-M median 1.3: not met
    assert claims.gemm_graph_groups(rows) == {("fwd", 4, 8, "linear"): True, ("da", 4, 8, "linear"): False,
                                              ("db", 4, 8, "linear"): False}


def test_a_slower_moe_block_row_turns_the_block_claim_to_no_and_a_forged_ratio_is_refused(reports_copy, capsys):
    tmp, argv = reports_copy
    path = tmp / "reports" / claims.SOURCES["moe_block_bench"]

    def slow_down(doc):
        row = next(r for r in doc["rows"] if r.get("impl") == "hf_detkit" and "speedup_vs_hf" in r)
        row["median_us"] = row["hf_median_us"] * 1.25
        row["speedup_vs_hf"] = row["hf_median_us"] / row["median_us"]

    _edit_json(path, slow_down)
    assert claims.main(argv) == 1
    assert "faster in 7 of 8" in capsys.readouterr().out

    _edit_json(path, lambda doc: next(r for r in doc["rows"] if r.get("impl") == "hf_detkit").update(speedup_vs_hf=3.0))
    assert claims.main(argv) == 2
    assert "speedup_vs_hf disagrees with its medians" in capsys.readouterr().err


def _model_audit_report() -> dict:
    return json.loads((REPO / "reports" / claims.SOURCES["model_audit"]).read_text())


def _as_bench_model_report(audit: dict) -> dict:
    """The speed rows of a model-audit report as `detkit bench model` writes them: flat rows, the same names."""
    rows = [{"name": r["name"], "passed": True, "case": r["name"].split()[1], **r["details"]}
            for r in audit["rows"] if r["check"] == "speed"]
    return {"meta": {"command": "bench model"}, "rows": rows}


def test_the_mode_speed_claim_reads_a_bench_model_report_as_a_model_audit_report():
    audit = _model_audit_report()
    bench = _as_bench_model_report(audit)
    assert len(bench["rows"]) == 4 and claims.model_speeds(bench) == claims.model_speeds(audit)
    # A bench row that failed (its detkit-mode calls ran off detkit's kernels, or a capture failed) is no result.
    bench["rows"][2] = {**bench["rows"][2], "passed": False, "failure": "default: capture failed: RuntimeError: x"}
    with pytest.raises(claims.ClaimError, match=r"the decode_cuda_graph row failed \(default: capture failed"):
        claims.model_speeds(bench)
    # Another report's rows, or a target that is not the claim's, are refused as before.
    bench["rows"][2]["passed"] = True
    bench["rows"][0]["target"] = 1.5
    with pytest.raises(claims.ClaimError, match="the report's prefill target is 1.5, the claim's 1.05"):
        claims.model_speeds(bench)
    with pytest.raises(claims.ClaimError, match="0 speed rows for 'prefill'"):
        claims.model_speeds({"meta": {"command": "bench gemm"}, "rows": []})


def test_a_model_audit_without_speed_rows_counts_only_the_drift_as_informational():
    audit = _model_audit_report()
    speed = [r for r in audit["rows"] if r["check"] == "speed"]
    audit["rows"] = [r for r in audit["rows"] if r["check"] != "speed"]
    audit["summary"] = [s for s in audit["summary"] if s["check"] != "speed"]
    old = claims.model_audit(_model_audit_report()).text
    new = claims.model_audit(audit).text
    assert "(16 informational: default mode's drift, speed)" in old and len(speed) == 4
    assert "(12 informational: default mode's drift)" in new and new.startswith("26 passed, 0 failed")
