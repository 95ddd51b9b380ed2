"""The evaluation page (eval.html) of `r1fit eval`."""

from __future__ import annotations

from pathlib import Path


def test_the_eval_page_calls_partial_credit_a_best_score_not_a_pass() -> None:
    """A fuzzy or iou row whose best answer scored 0.5 was labelled 'pass'."""
    from r1fit.report.eval_page import answer_record, build_page

    summary = {"model": "m", "model_kind": "full", "data": "d.jsonl", "samples": 3, "size": 3}

    def row(index: int, best: float) -> dict:
        answers = [answer_record("x", best, 1.0, best, {}, None, Path("."), "a")]
        return {"index": index, "id": str(index), "images": [], "answers": answers,
                "pass": best, "mean": best, "question": "q", "reward_method": "fuzzy",
                "reference": "red"}

    page = build_page(summary, [row(0, 1.0), row(1, 0.5), row(2, 0.0)])
    assert "(0, pass, mean" in page and "(1, best 0.500, mean" in page and "(2, fail, mean" in page
