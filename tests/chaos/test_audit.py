"""tests/chaos/audit.py: the Spark audit's tables read back into the run's report."""

from __future__ import annotations

from pathlib import Path

from tests.chaos.audit import SHOWN, read_tables, run_audit

HEAD = "violation,origin_incarnation,cseq,queue,kind_name,detail\n"


def tables(tmp_path: Path, violations: list[str], not_captured: list[str]) -> Path:
    (tmp_path / "violations.csv").write_text(HEAD + "".join(v + "\n" for v in violations))
    (tmp_path / "not_captured.csv").write_text(HEAD + "".join(n + "\n" for n in not_captured))
    (tmp_path / "per_queue.csv").write_text("queue,forwarded,applied\nq-full,10,9\nq-enq,5,5\n")
    return tmp_path


def test_a_clean_audit_counts_what_it_could_not_judge(tmp_path: Path) -> None:
    result = read_tables(
        tables(
            tmp_path,
            [],
            [
                'not_captured,7,41,q-full,publish,"in the snapshot of the resync D installed, '
                'cut at origin cseq 50"',
                "not_captured,7,60,q-full,publish,no D capture spans it",
                "not_captured,7,61,q-enq,publish,no D capture spans it",
            ],
        ),
        tmp_path / "report.html",
    )
    assert result.problems == []
    assert (result.forwarded, result.applied) == (15, 14)
    assert result.summary() == (
        "Spark audit of the captures: clean; 15 (event, queue) forwarded, 14 applied at D; "
        "not judged: 2 not captured, 1 in a resync snapshot"
    )


def test_each_violation_is_a_problem_naming_queue_and_cseq(tmp_path: Path) -> None:
    rows = [f"missing_at_d,7,{n},q-full,publish,forwarded in mode full" for n in range(SHOWN + 2)]
    result = read_tables(tables(tmp_path, rows, []), tmp_path / "report.html")
    assert result.problems[0] == (
        "audit: missing_at_d q-full origin 7 cseq 0 (publish): forwarded in mode full"
    )
    assert len(result.problems) == SHOWN + 1
    assert result.problems[-1].startswith("audit: 2 more violations in ")


def test_an_audit_that_cannot_run_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "captures").mkdir()  # no segment in it
    result = run_audit(tmp_path / "captures", tmp_path / "out", timeout_s=120)
    assert len(result.problems) == 1
    assert result.problems[0].startswith(
        "the Spark audit failed (exit 2): analysis: no capture segments under"
    )
