"""Held-out evaluation: answers to the eval set, scored for accuracy and format (and mean IoU of
the rows scored by boxes). The run's own evaluations (:func:`evaluate`, greedy) and ``r1fit
eval`` (:mod:`r1fit.train.eval_command`, greedy or k sampled answers per row) read the same
batches of answers (:func:`answered_batches`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from r1fit.data.batch import Prompt, decode_completions
from r1fit.data.sample import Sample
from r1fit.memory.telemetry import reset_peak, step_memory
from r1fit.processes import all_sum
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.format import format_reward
from r1fit.rollout.generate import row_seeds
from r1fit.rollout.record import Trajectory
from r1fit.rollout.turns import answer_text
from r1fit.train.engines import RolloutEngine
from r1fit.train.run import Run, Session

log = logging.getLogger("r1fit")

#: the ``step`` of the seeds of sampled evaluation answers (``row_seeds``): GRPO's steps count
#: from 1, so no evaluation answer shares a seed with a training rollout of the same row number
EVAL_SEED_STEP = 0


@dataclass(frozen=True)
class EvalBatch:
    """One ``eval.batch`` of eval rows: the good rows' dataset indices and prompts, each row's
    answers (``samples`` of them) with their trajectories when the run has tools (else None), and
    one message per bad row (an image that fails to decode, a special token of the model in its
    text, a prompt longer than ``data.max_prompt_tokens``)."""

    indices: list[int]
    prompts: list[Prompt]
    answers: list[list[str]]
    trajectories: list[list[Trajectory]] | None
    bad: list[str]


def answered_batches(session: Session, engine: RolloutEngine, indices: Sequence[int], *,
                     samples: int = 1, seed: int = 0) -> Iterator[EvalBatch]:
    """The eval rows ``indices``, ``eval.batch`` at a time, with their answers, inside the
    engine's ``ready`` block. ``samples`` = 1: the greedy answer; k > 1: k answers sampled with
    the engine's settings, answer j of row i seeded by ``row_seeds(seed, EVAL_SEED_STEP, i * k
    + j, 1)``, so a row's answers do not depend on the batch it is in. Bad rows are reported in
    their batch's ``bad`` and left out of it."""
    dataset, batch = session.eval_set, session.cfg.eval.batch
    assert dataset is not None, "answered_batches() needs data.eval"
    for start in range(0, len(indices), batch):
        fetched, bad = [], []
        for index in indices[start:start + batch]:  # one at a time: each good row's index
            found, errors = dataset.fetch([index])
            fetched += [(index, sample) for sample in found]
            bad += errors
        prompts, refused = session.encode([sample for _, sample in fetched])
        index_of = {id(sample): index for index, sample in fetched}
        rows = [index_of[id(p.sample)] for p in prompts]
        answers, trajectories = _answers(session, engine, prompts, rows, samples, seed)
        yield EvalBatch(rows, prompts, answers, trajectories, bad + refused)


def answer_scores(text: str, sample: Sample) -> tuple[float, float]:
    """``(accuracy, format)`` of an answer to ``sample``: the ``accuracy`` reward by the row's
    method (partial credit in [0, 1] for ``fuzzy`` and ``iou``, else 0 or 1) and the ``format``
    reward, whatever the run's ``rewards`` weigh."""
    return (accuracy(text, sample.solution, problem=sample.problem,
                     reward_method=sample.reward_method),
            format_reward(text, sample.solution, problem=sample.problem))


def pass_at_k(scores: Sequence[Sequence[float]]) -> float:
    """pass@k of rows of k accuracy scores each: the mean over rows of the row's best score. For
    0/1 scores, the fraction of rows with at least one correct answer (Chen et al. 2021's unbiased
    estimator with n = k answers); a partial-credit method (``fuzzy``, ``iou``) counts its best
    answer's credit. 0 without rows."""
    return sum(max(row) for row in scores) / len(scores) if scores else 0.0


def mean_at_k(scores: Sequence[Sequence[float]]) -> float:
    """mean@k of rows of k accuracy scores each: the mean of every score (with k = 1, the
    accuracy; never above :func:`pass_at_k`). 0 without rows."""
    flat = [score for row in scores for score in row]
    return sum(flat) / len(flat) if flat else 0.0


def _answers(session: Session, engine: RolloutEngine, prompts: list[Prompt], rows: list[int],
             samples: int, seed: int) -> tuple[list[list[str]], list[list[Trajectory]] | None]:
    """Each prompt's ``samples`` answer texts, and trajectories with tools: each trajectory's last
    turn is its answer (the same multi-turn loop as training); without tools the completions."""
    if not prompts:
        return [], None if engine.tools is None else []
    if samples == 1:
        if engine.tools is None:
            texts = decode_completions(session.processor, engine.greedy(prompts))
            return [[t] for t in texts], None
        found = engine.greedy_trajectories(prompts)
        return [[answer_text(t)] for t in found], [[t] for t in found]
    repeated = [p for p in prompts for _ in range(samples)]
    seeds = [s for row in rows for s in row_seeds(seed, EVAL_SEED_STEP, row * samples, samples)]
    if engine.tools is None:
        completions = engine.generate(repeated, seeds)[0]
        texts = decode_completions(session.processor, completions)
        return [texts[i:i + samples] for i in range(0, len(texts), samples)], None
    found = engine.trajectories(repeated, seeds)
    grouped = [found[i:i + samples] for i in range(0, len(found), samples)]
    return [[answer_text(t) for t in group] for group in grouped], grouped


@torch.no_grad()
def log_evaluation(step: int, row: dict[str, Any]) -> None:
    """One line per evaluation in the console and log.txt, so that a piped or cluster log shows
    the curve: ``eval at step 20: accuracy 0.250, format 1.000 (40 rows)``."""
    accuracy, size = row.get("eval/accuracy"), row.get("eval/size", 0)
    shown = ("no row could be scored" if accuracy is None
             else f"accuracy {accuracy:.3f}, format {row.get('eval/format') or 0.0:.3f}")
    bad = row.get("eval/bad_rows") or 0
    log.info("eval at step %d: %s (%d rows%s)", step, shown, size,
             f", {bad} skipped" if bad else "")


def evaluate(run: Run, engine: RolloutEngine) -> dict[str, Any]:
    """Greedy decoding on ``run.eval_set``: accuracy and format rate, on ``engine`` (GRPO's
    rollout engine, a vLLM one synced with the policy first; ``r1fit sft``'s
    :func:`r1fit.train.engines.evaluation_engine`). When some rows are scored by the ``iou`` accuracy method (box
    answers, e.g. ``builtin:shapes`` box questions), ``eval/iou`` is their mean IoU (their
    accuracy is their IoU: on an eval set of box rows only, it equals ``eval/accuracy``).

    Rows whose image fails to decode, or whose prompt is longer than ``data.max_prompt_tokens``,
    are skipped with a warning, counted in ``eval/bad_rows`` and left out of the averages
    (``eval/size`` is the number actually scored; with none, the averages are None, warned).
    Over several processes each rank decodes its share of the batches with whole parameters (the
    FSDP root is gathered once) and the counts are summed."""
    dataset, cfg = run.eval_set, run.cfg
    assert dataset is not None, "evaluate() needs data.eval"
    reset_peak(run.device)  # eval/peak_memory_bytes is the evaluation's own peak
    correct = formatted = iou_sum = 0.0
    scored = bad = iou_rows = tool_rows = 0
    # each rank its share of the batches, as eval.batch rows apiece
    mine = [i for start in range(0, len(dataset), cfg.eval.batch)[run.world.rank::run.world.size]
            for i in range(start, min(start + cfg.eval.batch, len(dataset)))]
    # every rank enters ready() (it gathers FSDP weights), also one with no batch of its own;
    # a weight sync here is the evaluation's, not a step's
    with engine.ready({}):
        for answered in answered_batches(run, engine, mine):
            for message in answered.bad:
                log.warning("eval: skipping %s", message)
            bad += len(answered.bad)
            for prompt, (text,) in zip(answered.prompts, answered.answers):
                score, form = answer_scores(text, prompt.sample)
                correct, formatted = correct + score, formatted + form
                if prompt.sample.reward_method == "iou":
                    iou_sum, iou_rows = iou_sum + score, iou_rows + 1
            if answered.trajectories is not None:
                tool_rows += sum(t.tool_calls > 0 for (t,) in answered.trajectories)
            scored += len(answered.prompts)
    correct, formatted, scored, bad, iou_sum, iou_rows, tool_rows = all_sum(
        [correct, formatted, scored, bad, iou_sum, iou_rows, tool_rows])
    if not scored:  # no accuracy to give: 0 would read as a model that got every row wrong
        log.warning("eval: no row of data.eval could be answered and scored (%d bad): "
                    "eval/accuracy and eval/format are null", int(bad))
    n = max(1, scored)

    def mean(total: float) -> float | None:
        return total / n if scored else None

    return {"eval/accuracy": mean(correct), "eval/format": mean(formatted),
            **({"eval/iou": iou_sum / iou_rows} if iou_rows else {}),
            **({"eval/tool_use": mean(tool_rows)} if engine.tools is not None else {}),
            "eval/size": int(scored),
            "eval/bad_rows": int(bad), **step_memory(run.device, "eval/")}
