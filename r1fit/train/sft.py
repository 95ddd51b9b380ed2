"""Supervised fine-tuning on the same data, model and memory machinery as GRPO.

The loss is the token-mean cross-entropy of the answer tokens only (the prompt and image tokens are
context), computed with the chunked LM head and accumulated over micro-batches. ``r1fit train`` uses
the same steps as a short warm-up before GRPO; there it learns the
``<think>/<answer>`` format with a random row's answer, so the task itself is left to GRPO.
With ``zoom`` or ``crop`` among ``tools``, ``r1fit sft`` learns each row whose focus is known as a
tool demonstration (:mod:`r1fit.tools.demonstrations`), laid out as GRPO's multi-turn rollouts lay
out the same conversation, so that GRPO with tools starts from a policy that calls them.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from typing import Any

import torch

from r1fit.checkpoint.state import OptimizerState, PythonRandomState, SchedulerState
from r1fit.config import Config
from r1fit.data.batch import Batch, Prompt
from r1fit.data.build import BadRowCounter
from r1fit.data.conversation import conversation_target
from r1fit.data.dataset import PromptSampler
from r1fit.data.errors import BadRowError, DataError
from r1fit.data.sample import Sample
from r1fit.memory.telemetry import reset_peak, step_memory
from r1fit.models.load import special_token_ids
from r1fit.models.logprobs import adapter_backward, completion_logprobs, completion_loss
from r1fit.models.prefix import PackedGroups
from r1fit.processes import all_sum
from r1fit.progress import progress_bar
from r1fit.report.html import LiveReport
from r1fit.rewards.answer import extract_answer, split_thinking
from r1fit.rng import RngState
from r1fit.tools.demonstrations import ToolDemonstrations
from r1fit.train.engines import RolloutEngine, evaluation_engine
from r1fit.train.evaluate import evaluate, log_evaluation
from r1fit.train.forward import BatchLayout, longest_row, micro_batches
from r1fit.train.optim import SkippedUpdates, build_optimizer, build_scheduler, clip_and_step
from r1fit.train.run import Run, start_run
from r1fit.train.tool_rollouts import tool_runner

log = logging.getLogger("r1fit.sft")


def target_text(solution: str, think: str | None) -> str:
    """The assistant turn to learn: the solution as is when it is in the format already or
    ``think`` is None (``sft.think`` unset: a user's answers are never rewritten unless asked),
    else in the ``<think>..</think><answer>..</answer>`` format: a solution that opens with its
    own ``<think>`` block keeps it, and what follows it becomes the answer; any other gets
    ``think`` inside the think block."""
    if think is None or ("<think>" in solution and "<answer>" in solution):
        return solution.strip()
    thinking, rest = split_thinking(solution)
    if thinking is not None and rest.strip():
        return f"<think>{thinking}</think><answer>{rest.strip()}</answer>"
    answer = extract_answer(solution) or solution.strip()
    return f"<think>{think}</think><answer>{answer}</answer>"


def build_targets(samples: list[Sample], think: str | None, rng: random.Random | None) -> list[str]:
    """Targets of one batch. With ``rng`` (the format warm-up) each row gets the answer of a random
    row of the batch in the think/answer format (``think`` or an empty think block): right
    format, answers from the data's own distribution, no link to the image. Without, each row's
    own solution (rewritten into the format only when ``think`` is set)."""
    solutions = [s.solution for s in samples]
    if rng is not None:
        solutions = [rng.choice(solutions) for _ in samples]
        think = think or ""  # the warm-up exists to teach the format
    return [target_text(sol, think) for sol in solutions]


def sft_rows(run: Run, prompts: list[Prompt], answers: list[str], end_of_turn: int
             ) -> tuple[list[Prompt], list[torch.Tensor], list[torch.Tensor | None]]:
    """Prompts, completion tokens and masks (None: every token) of one SFT batch. A row with one
    answer to learn is its prompt and the answer followed by the end-of-turn token; a row with
    several assistant turns (a tool demonstration too) is its conversation up to the first of
    them and the rest, scored on the assistant turns only (:func:`conversation_target`)."""
    tokenizer = run.processor.tokenizer
    out_prompts, targets, masks = [], [], []
    for prompt, answer in zip(prompts, answers):
        try:
            turns = conversation_target(run.processor, prompt.sample, run.cfg.data.system_prompt,
                                        answer, end_of_turn=end_of_turn)
        except BadRowError as exc:  # the template's doing: every multi-turn row would fail
            raise DataError(f"SFT on multi-turn rows: {exc}") from None
        if turns is None:
            out_prompts.append(prompt)
            targets.append(torch.tensor(tokenizer(answer, add_special_tokens=False)["input_ids"]
                                        + [end_of_turn], dtype=torch.long))
            masks.append(None)
            continue
        # the prompt is a prefix of the row's prompt, so never longer than one that was accepted
        row, ids, mask = turns
        out_prompts.append(row)
        targets.append(ids)
        masks.append(mask)
    return out_prompts, targets, masks


def demonstrate(prompts: list[Prompt], demonstrations: ToolDemonstrations | None
                ) -> tuple[list[Prompt], int]:
    """The batch with each row that has a focus written as a tool demonstration (its prompt's
    ids stay: :func:`sft_rows` encodes the conversation), and how many were."""
    if demonstrations is None:
        return prompts, 0
    written = [replace(p, sample=demonstrations.write(p.sample)) if p.sample.focus is not None
               else p for p in prompts]
    return written, sum(p.sample.focus is not None for p in prompts)


def tool_demonstrations(run: Run) -> ToolDemonstrations | None:
    """``r1fit sft`` with ``crop`` or ``zoom`` among ``tools``: rows with a focus become
    demonstrations of that tool (:mod:`r1fit.tools.demonstrations`), run as the rollouts run it."""
    demonstrations = ToolDemonstrations.of(run.cfg.tools, tool_runner(run.cfg)) \
        if run.cfg.tools else None
    if demonstrations is not None:
        log.info("SFT with tools: rows with a known focus (a data.focus_key box, builtin:shapes "
                 "zoom marks) are learned as "
                 "a %s call there, its result, then the answer (the step's demonstrations "
                 "column counts them)", demonstrations.tool)
    return demonstrations


def cut_answers(targets: list[torch.Tensor], masks: list[torch.Tensor | None], limit: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[int]]:
    """``sft.max_answer_tokens``: each row's answer tokens (and mask) cut to ``limit``; returns
    them and the indices of the rows that were cut."""
    cut = [i for i, t in enumerate(targets) if int(t.shape[0]) > limit]
    for i in cut:
        targets[i] = targets[i][:limit]
        if masks[i] is not None:
            masks[i] = masks[i][:limit]
    return targets, masks, cut


def cut_completion_inputs(prompts: list[Prompt], cut: list[int], limit: int) -> list[Prompt]:
    """The cut rows' per-token extras of their completion (a tool demonstration's) cut to
    ``limit`` as well; a cut through a tool image's tokens is refused (its image would stay
    without them)."""
    prompts = list(prompts)
    for i in cut:
        extras = prompts[i].completion_inputs
        if any(bool(value[limit:].any()) for value in extras.values()):
            raise DataError(f"{prompts[i].sample.source}: sft.max_answer_tokens={limit} cuts a "
                            "tool image out of the conversation; raise sft.max_answer_tokens")
        prompts[i] = replace(prompts[i], completion_inputs={k: v[:limit] for k, v in extras.items()})
    return prompts


def balance_turns(mask: torch.Tensor) -> torch.Tensor:
    """``sft.balance_turns``: a row's loss mask [T] (1 on scored tokens) reweighted so that each
    scored turn (a run of scored tokens between tool or user turns) weighs the same: the row's
    total weight ``mask.sum()`` split evenly over its turns, and each turn's share evenly over its
    tokens. A row of one turn comes back unchanged."""
    scored = mask > 0
    starts = scored & ~torch.cat([scored.new_zeros(1), scored[:-1]])
    turn = torch.cumsum(starts.long(), 0) - 1  # the turn index of each scored token
    turns = int(starts.sum())
    if turns < 2:
        return mask
    sizes = torch.bincount(turn[scored], minlength=turns).to(torch.float32)
    weights = torch.zeros_like(mask, dtype=torch.float32)
    weights[scored] = float(mask.sum()) / turns / sizes[turn[scored]]
    return weights


def micro_batch_loss(policy: Any, batch: Batch | PackedGroups, total_tokens: int, *,
                     fused: bool, chunk_size: int) -> torch.Tensor:
    """This micro-batch's share of the batch's token-mean cross-entropy: minus the log-probs of
    its scored tokens (``batch.completion_mask``) summed, over the batch's ``total_tokens``.
    ``fused`` (``memory.fused_loss``): one term per scored token, the LM head's gradient made in
    its forward."""
    options = dict(chunk_size=chunk_size, into_grad=True)
    if fused:  # the scored tokens' weights, flattened as completion_loss flattens its tokens
        mask = batch.completion_mask
        weights = mask[mask.bool()].to(torch.float32)
        loss, _, _ = completion_loss(
            policy, batch, lambda rows, logp, _: -(logp * weights[rows]).sum() / total_tokens,
            entropy=False, **options)
        return loss
    logp = completion_logprobs(policy, batch, **options)
    return -(logp * batch.completion_mask).sum() / total_tokens


def supervised_steps(run: Run, steps: int, *, format_only: bool,
                     report: LiveReport | None = None,
                     engine: RolloutEngine | None = None) -> list[dict[str, Any]]:
    """``steps`` SFT updates on the training set with their own AdamW and schedule; one metrics
    row per step. ``format_only`` learns the answer format with random answers (the warm-up before
    GRPO, logged with a ``warmup/`` prefix); otherwise each row's solution, and the last step's row
    (and every ``sft.eval_every``-th) holds an evaluation. ``report`` (``r1fit sft``'s; the
    warm-up has none, its rows go on GRPO's page) sees each row: the page every ``report.every``
    steps. ``engine``: what the evaluations generate with (None only without an eval set)."""
    cfg, processor = run.cfg, run.processor
    phase, prefix = ("warmup", "warmup/") if format_only else ("sft", "")
    sampler = PromptSampler(len(run.train_set), seed=cfg.train.seed + 1)
    rng = random.Random(cfg.train.seed + 1) if format_only else None
    bad_rows = BadRowCounter(run.train_set.bad_rows)
    optimizer = build_optimizer(run.model, cfg.sft.learning_rate, cfg.train.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, cfg.train.warmup_steps, steps)
    rng_state = RngState(cfg.train.seed, run.world.rank)
    # the format warm-up teaches the answer format, not the task: no demonstrations there
    demonstrations = None if format_only else tool_demonstrations(run)
    state = {"optimizer": OptimizerState(run.model, optimizer),
             "scheduler": SchedulerState(scheduler), "sampler": sampler, "bad_rows": bad_rows,
             "sizes": run.sizes, "rng": rng_state}
    if rng is not None:
        state["targets_rng"] = PythonRandomState(rng)
    start = run.checkpoints.restore(phase, state)
    run.note_past_the_end(start, steps, "sft.format_warmup_steps" if format_only else "sft.steps")
    guard = run.guard(optimizer)
    skipped = SkippedUpdates(cfg.train.max_skipped_updates)
    end_of_turn = special_token_ids(run.model, processor)["end_of_turn"]  # from the chat template
    # memory.micro_batch_tokens packs the rows (checked equal to the per-row path on the first
    # micro-batch); every row is its own prompt, so there is no prefix to share
    layout = BatchLayout(False)
    # the flops/mfu meter measures a CPU's matmul peak when first used: before the first step,
    # so that step's time and peak memory do not include it
    meter = run.meter
    rows_out = []
    warned_cut = False
    run.model.train()
    with progress_bar("SFT warm-up" if format_only else "SFT", steps, completed=start) as advance:
        for step in range(start + 1, steps + 1):
            started = time.perf_counter()
            reset_peak(run.device)
            prompts, demonstrated = demonstrate(run.fetch(sampler, bad_rows, cfg.sft.batch_size),
                                                demonstrations)
            prompts, targets, masks = sft_rows(run, prompts,
                                               build_targets([p.sample for p in prompts],
                                                             cfg.sft.think, rng), end_of_turn)
            targets, masks, cut = cut_answers(targets, masks, cfg.sft.max_answer_tokens)
            prompts = cut_completion_inputs(prompts, cut, cfg.sft.max_answer_tokens)
            if cfg.sft.balance_turns:
                masks = [None if m is None else balance_turns(m) for m in masks]
            if cut and not warned_cut:
                log.warning("%s: answer longer than sft.max_answer_tokens=%d tokens, cut there "
                            "(each step's truncated_answers counts the rows cut; raise the key to "
                            "keep whole answers)", prompts[cut[0]].sample.source,
                            cfg.sft.max_answer_tokens)
                warned_cut = True
            total_tokens = sum(int(t.shape[0]) if m is None else round(float(m.sum()))
                               for t, m in zip(targets, masks))
            if total_tokens == 0:
                raise DataError(f"SFT step {step}: no answer token to learn in the batch "
                                f"(sft.max_answer_tokens={cfg.sft.max_answer_tokens} cuts every "
                                "scored assistant turn); raise sft.max_answer_tokens")
            # over several processes each rank takes its share of the batch's rows
            share = run.world.share(len(prompts), "rows per step (sft.batch_size)")
            prompts, targets, masks = prompts[share], targets[share], masks[share]

            def accumulate() -> float:
                """Gradients of the batch, micro_batch rows (or micro_batch_tokens packed
                tokens) at a time (redone smaller on OOM)."""
                optimizer.zero_grad(set_to_none=True)
                loss_sum = 0.0
                sizes = run.sizes
                sizes.note_sequence(longest_row(prompts, targets))
                layout.decide(run.policy, prompts, targets, pad_id=run.ids.pad,
                              chunk_size=cfg.head_chunk(sft=True), micro_batch=sizes.micro_batch,
                              tokens=sizes.micro_batch_tokens)
                with guard.phase("micro_batch"):
                    for piece, mb_prompts, mb_targets in micro_batches(
                            prompts, targets, sizes.micro_batch, tokens=sizes.micro_batch_tokens):
                        batch = layout.inputs(run.policy, mb_prompts, mb_targets,
                                              pad_id=run.ids.pad, device=run.device,
                                              packed=sizes.micro_batch_tokens is not None,
                                              masks=masks[piece])
                        loss = micro_batch_loss(run.policy, batch, total_tokens,
                                                fused=cfg.fuses_loss(sft=True),
                                                chunk_size=cfg.head_chunk(sft=True))
                        with adapter_backward(run.policy):
                            loss.backward()
                        loss_sum += loss.item()
                return loss_sum

            local_loss = guard.run_step(accumulate, restore=[rng_state])
            # model FLOPs: one forward and backward of this process's rows as they ran (the
            # sizes the OOM guard left); summed over processes with the loss, in one collective
            local_flops = float(meter.training(
                prompts, targets, log_prob_passes=0, updates=1, micro_batch=run.sizes.micro_batch,
                shared=False, tokens=run.sizes.micro_batch_tokens))
            loss_sum, flops = all_sum([local_loss, local_flops])
            grad_norm, skip = clip_and_step(optimizer, scheduler, cfg.train.max_grad_norm,
                                            skipped, f"{prefix}step {step}")
            seconds = time.perf_counter() - started
            row = {f"{prefix}step": step, f"{prefix}loss": loss_sum,
                   f"{prefix}grad_norm": grad_norm, f"{prefix}skipped_updates": int(skip),
                   f"{prefix}tokens_per_second": total_tokens / seconds,
                   f"{prefix}seconds_step": seconds,
                   f"{prefix}flops": flops,
                   f"{prefix}mfu": meter.mfu(flops, seconds, run.world.size),
                   **step_memory(run.device, prefix), f"{prefix}bad_rows": bad_rows.count,
                   f"{prefix}truncated_answers": len(cut),
                   **({f"{prefix}demonstrations": demonstrated} if demonstrations else {}),
                   f"{prefix}oom_retries": guard.retries,
                   # r1fit sft's steps were planned; a GRPO run's warm-up steps were not
                   **(run.predicted.row() if run.predicted and run.kind == "sft" else {})}
            if not format_only and run.eval_set is not None and (
                    step == steps or (cfg.sft.eval_every and step % cfg.sft.eval_every == 0)):
                row.update(evaluate(run, engine))
                log_evaluation(step, row)
            run.metrics.write(row)
            if report is not None:
                report.after_step(row)
            rows_out.append(row)
            advance(f"loss {loss_sum:.3f}")
            run.save(phase, step, state, row, last=step == steps)
    return rows_out


def train_sft(cfg: Config) -> dict[str, Any]:
    """``r1fit sft``: supervised fine-tuning for ``sft.steps`` steps, evaluated before and after."""
    run = start_run(cfg, "sft")
    engine = evaluation_engine(run) if run.eval_set is not None else None
    try:
        if engine is not None and cfg.eval.before_train and run.checkpoints.resume is None:
            before = {"step": 0, **evaluate(run, engine)}
            run.metrics.write(before)
            log_evaluation(0, before)
        report = LiveReport(cfg.report, run.out, main=run.world.main)  # rank 0: the page
        supervised_steps(run, cfg.sft.steps, format_only=False, report=report, engine=engine)
    finally:
        if engine is not None:
            engine.close()
    summary = run.finish(steps=cfg.sft.steps)
    report.finish()  # after the summary, which the page shows
    return summary
