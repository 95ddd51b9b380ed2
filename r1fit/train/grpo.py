"""GRPO: one loop, top to bottom, four stages over one rollout record per step.

Each step: fetch ``prompts_per_step`` prompts; (1) generate ``num_generations`` completions of each
(:func:`generate_rollout`); (2) score them and compute group-relative advantages
(:func:`score_rollout`); (3) reference log-probs (:func:`add_logprobs`); (4) ``num_iterations``
clipped policy updates on that rollout (:func:`policy_update`), the first of which returns it
with the old-policy log-probs the others need. Each stage returns what it made: a new record, and
the update its statistics. :func:`grpo_step` runs the four stages (under the OOM guard), then
:func:`metrics_row` makes the step's row; evaluation when due, a checkpoint when due. The engine
(:mod:`r1fit.train.engines`) generates one completion per row or, with ``tools``, a multi-turn
trajectory; the loop never asks which.

Departures from DeepSeekMath's GRPO, all by config: DAPO's token-mean loss and clip-higher are the
defaults (``algo.loss_aggregation``, ``algo.epsilon_high``); Dr. GRPO is available
(``algo.scale_rewards=false``, ``algo.loss_aggregation=seq_mean_token_sum_norm``); the KL term is
the k3 estimator, added to the loss (``algo.beta``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from r1fit.algorithms.advantages import get_advantage_estimator
from r1fit.algorithms.covariance import selection_generator
from r1fit.algorithms.losses import (
    BatchTotals,
    LossSettings,
    aggregate,
    aggregation_weights,
    grpo_loss,
    per_token_grpo_terms,
    truncated_importance_weights,
)
from r1fit.checkpoint.state import Counters, OptimizerState, SchedulerState
from r1fit.data.batch import pad_rows
from r1fit.data.build import BadRowCounter
from r1fit.data.dataset import PromptSampler
from r1fit.distributed.loading import load_frozen_copy
from r1fit.memory.flops import flops_metrics
from r1fit.memory.guard import OOMGuard
from r1fit.memory.telemetry import reset_peak, step_memory, tensor_probe_on, warn_if_fragmented
from r1fit.models.load import Reference
from r1fit.models.logprobs import (
    adapter_backward,
    completion_logprobs_and_entropy,
    completion_loss,
)
from r1fit.processes import all_sum
from r1fit.progress import progress_bar
from r1fit.report.html import LiveReport
from r1fit.report.metrics import timed
from r1fit.report.profile import step_profile
from r1fit.report.step import TurnFigures, step_metrics
from r1fit.rewards.registry import RewardScorer
from r1fit.rng import RngState
from r1fit.rollout.dynamic import StepDraws
from r1fit.rollout.generate import SamplingSettings
from r1fit.rollout.record import Rollout
from r1fit.rollout.score import AdvantageSettings, finished_rows, kl_in_reward, loss_counts, score_rollout
from r1fit.rollout.vllm_engine import require_vllm
from r1fit.train.engines import RolloutEngine, check_engine_early, rollout_engine
from r1fit.train.evaluate import evaluate, log_evaluation
from r1fit.train.forward import add_logprobs, longest_row, micro_batches, run_logprobs
from r1fit.train.optim import SkippedUpdates, build_optimizer, build_scheduler, clip_and_step
from r1fit.train.run import Run, start_run
from r1fit.train.sft import supervised_steps
from r1fit.train.tool_rollouts import ToolTurns

log = logging.getLogger("r1fit.grpo")


@dataclass(frozen=True)
class Trainer:
    """What a GRPO step works with, built once by :func:`train_grpo`: the run, the engine that
    generates (its tools, if any, inside it), the KL reference, the optimizer and its schedule,
    the prompt sampler, the bad-row and reward counters, the OOM guard, and the advantage and
    loss settings (``algo``, read once)."""

    run: Run
    engine: RolloutEngine
    reference: Reference | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: PromptSampler
    bad_rows: BadRowCounter
    scorer: RewardScorer
    guard: OOMGuard
    advantage: AdvantageSettings
    loss: LossSettings
    skipped: SkippedUpdates  # updates skipped for gradients that are not finite


def train_grpo(cfg: Any) -> dict[str, Any]:
    """Run GRPO as configured; returns the summary (also written to ``summary.json``)."""
    # the rewards first: a misspelt reward or a broken plugin fails in seconds, not after the
    # model loads and the format warm-up runs
    scorer = RewardScorer(cfg.rewards)
    if cfg.rollout.engine == "vllm":  # and a missing vLLM, not at the first rollout
        require_vllm()
    run = start_run(cfg, "grpo")
    algo = cfg.algo
    if cfg.sft.format_warmup_steps and not run.checkpoints.phase_done("warmup"):
        check_engine_early(run)  # a vLLM pool too small fails now, not after the warm-up
        # teach the answer format so GRPO's first rewards are not all 0
        supervised_steps(run, cfg.sft.format_warmup_steps, format_only=True)
    reference = build_reference(run)
    optimizer = build_optimizer(run.model, cfg.train.learning_rate, cfg.train.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, cfg.train.warmup_steps,
                                cfg.train.max_steps * algo.num_iterations)
    sampler = PromptSampler(len(run.train_set), seed=cfg.train.seed)
    bad_rows = BadRowCounter(run.train_set.bad_rows)
    loop = Counters(best=-1.0, since_best=0)
    rng = RngState(cfg.train.seed, run.world.rank)
    settings = SamplingSettings(algo.max_new_tokens, algo.temperature, algo.top_p,
                                min_new_tokens=cfg.rollout.min_new_tokens)
    # with tools, multi-turn rollouts; vLLM starts on the first rollout, after the restore
    engine = rollout_engine(run, settings, ToolTurns.of(run, algo.max_new_tokens))
    # everything a resumed run needs to continue exactly; the models are saved alongside
    state = {"optimizer": OptimizerState(run.model, optimizer),
             "scheduler": SchedulerState(scheduler), "sampler": sampler, "loop": loop,
             "bad_rows": bad_rows, "rewards": scorer, "sizes": run.sizes, "rng": rng,
             **engine.state()}
    start = run.checkpoints.restore("grpo", state)
    run.note_past_the_end(start, cfg.train.max_steps, "train.max_steps")
    trainer = Trainer(run, engine, reference, optimizer, scheduler, sampler, bad_rows, scorer,
                      run.guard(optimizer), AdvantageSettings.of(algo), LossSettings.of(algo),
                      SkippedUpdates(cfg.train.max_skipped_updates))
    if run.eval_set is not None and cfg.eval.before_train and start == 0:
        row = {"step": 0, **evaluate(run, engine)}
        run.metrics.write(row)
        log_evaluation(0, row)

    report = LiveReport(cfg.report, run.out, main=run.world.main)  # rank 0: rollouts, alarms, page
    profile_step = step_to_profile(cfg)
    step = start
    # a run resumed at the checkpoint where it stopped early (killed before final/ was written,
    # or run again after it finished) has nothing left to train
    last = start if stopped_early(cfg, loop, start) else cfg.train.max_steps
    with progress_bar("GRPO", cfg.train.max_steps, completed=start) as advance:
        for step in range(start + 1, last + 1):
            times: dict[str, float] = {}
            reset_peak(run.device)  # peak_memory_bytes is this step's peak
            with step_profile(profile_step, step, run.out, run.device, main=run.world.main):
                # the OOM guard redoes the step with smaller chunks if memory runs out, from the
                # same prompts: the sampler and the counters are put back too
                draws, rollout, updates = trainer.guard.run_step(
                    partial(grpo_step, trainer, step, times),
                    restore=[rng, scorer, sampler, bad_rows, *engine.state().values()])
            if rollout is None:
                log.warning("step %d: all %d groups of the %d batches drawn have all-equal rewards "
                            "(algo.max_resample_batches); no update this step", step,
                            len(draws.prompts), draws.batches)
            # the rollout figures (rewards, accuracy, zero_variance_groups...) are over every row
            # drawn, the update's over the kept ones
            drawn = draws.drawn(rollout, trainer.advantage.estimator)
            run.settle_prediction()  # share_prefix=auto decided in the step: its path's times
            run.trackers.log_samples(drawn, run.processor)  # every report.samples_every steps
            report.save_rollout(drawn, run.processor)  # every report.rollouts_every steps
            row = metrics_row(trainer, step, draws, drawn, rollout, updates, times)
            # evaluations go into the step's own line (the last step always evaluates), so every
            # step appears exactly once in metrics.jsonl
            if run.eval_set is not None and (step == cfg.train.max_steps or
                                             (cfg.eval.every and step % cfg.eval.every == 0)):
                row.update(evaluate(run, engine))
                log_evaluation(step, row)
                accuracy = row["eval/accuracy"]  # None: no row could be scored
                if accuracy is not None and accuracy > loop.best:
                    loop.best, loop.since_best = accuracy, 0
                elif accuracy is not None:
                    loop.since_best += 1
            run.metrics.write(row)
            report.after_step(row)  # alarms (each warned once); the page every report.every steps
            warn_if_fragmented(run.device, cfg.memory.fragmentation_warning_gib, step)
            advance(f"reward {row['reward_mean']:.2f} acc {row['accuracy']:.2f}")
            stop = bool(cfg.train.early_stop_patience and
                        loop.since_best >= cfg.train.early_stop_patience)
            run.save("grpo", step, state, row, last=stop or step == cfg.train.max_steps)
            # let this step's records go before the next step makes its own: otherwise its
            # rollout (the prompts' pixel values, the rows' tokens and log-probs) would live
            # through the next step beside the new one, which the memory plan does not count
            del draws, rollout, updates, drawn, row
            if stop:
                log.info("early stop at step %d: eval accuracy has not improved on %.3f for %d "
                         "evaluations", step, loop.best, loop.since_best)
                break
    summary = run.finish(steps=step)
    report.finish()
    engine.close()  # last: vLLM's shutdown takes down the process groups it joined
    return summary


def stopped_early(cfg: Any, loop: Counters, start: int) -> bool:
    """True when the run resumed at step ``start`` had stopped early there: its evaluations had
    not improved on the best for ``train.early_stop_patience`` of them (said in the log)."""
    patience = cfg.train.early_stop_patience
    if not (patience and start and loop.since_best >= patience):
        return False
    log.info("early stop at step %d (resumed there): eval accuracy has not improved on %.3f for "
             "%d evaluations; nothing left to train", start, loop.best, loop.since_best)
    return True


def grpo_step(trainer: Trainer, step: int, times: dict[str, float]
              ) -> tuple[StepDraws, Rollout | None, list[dict[str, float | None]]]:
    """One step's four stages: draw batches (fetch, generate, score) until the step has its
    groups (one batch without dynamic sampling), then log-probs and ``algo.num_iterations``
    updates on the kept ones. Returns the draws, the rollout the updates trained on (None when
    no group had differing rewards: no update) and each update's statistics; ``times`` gets the
    stages' seconds. Over several processes each generates and scores its share of a batch's
    rows; rewards are gathered so advantages see whole groups."""
    run, engine, guard, algo = trainer.run, trainer.engine, trainer.guard, trainer.run.cfg.algo
    prompts_per_step = run.cfg.train.prompts_per_step
    share = run.world.share(prompts_per_step * algo.num_generations,
                            "rows per step (prompts_per_step x num_generations)")
    draws = StepDraws(step, algo.num_generations, only_informative=algo.dynamic_sampling)
    while not draws.done(prompts_per_step, algo.max_resample_batches):
        prompts = run.fetch(trainer.sampler, trainer.bad_rows, prompts_per_step)
        batch = Rollout(step, prompts, algo.num_generations, share, row_offset=draws.rows)
        with engine.ready(times), timed(times, "seconds_generate"), guard.phase("generation"):
            batch = engine.rollout(batch, seed=run.cfg.train.seed)
        with timed(times, "seconds_score"):
            batch = score_rollout(batch, trainer.scorer, run.processor, trainer.advantage)
        draws.add(batch)
    engine.idle()  # vLLM sleeps through the log-prob passes and updates (the plan counts so)
    # the kept groups, their rows split evenly over the processes again
    rollout = draws.kept(prompts_per_step, trainer.advantage.estimator)
    if rollout is None:  # no group with differing rewards: nothing to learn from
        return draws, None, []
    with timed(times, "seconds_update"):
        with guard.phase("micro_batch"):
            rollout = add_logprobs(rollout, run, trainer.reference)
        updates = []
        for i in range(algo.num_iterations):  # the first adds what the others read
            rollout, update = policy_update(run, rollout, trainer.optimizer, trainer.scheduler,
                                            guard, trainer.loss, trainer.skipped, iteration=i)
            updates.append(update)
        engine.updated()
    return draws, rollout, updates


def metrics_row(trainer: Trainer, step: int, draws: StepDraws, drawn: Rollout,
                rollout: Rollout | None, updates: list[dict[str, float | None]],
                times: dict[str, float]) -> dict[str, Any]:
    """The step's metrics row (before any evaluation): the rollout figures of every row
    ``drawn``, the updates' of the kept ``rollout``, the counters, memory, chunk sizes and FLOPs."""
    run = trainer.run
    return {"step": step, **step_metrics(drawn, updates, times, run.ids.eos),
            "sample_batches": draws.batches,
            "kept_groups": 0 if rollout is None else len(rollout.prompts),
            "learning_rate": trainer.scheduler.get_last_lr()[0], **step_memory(run.device),
            "bad_rows": trainer.bad_rows.count, "reward_errors": trainer.scorer.total_errors,
            **trainer.engine.step_counts(),
            **(run.predicted.row() if run.predicted else {}),
            # a count, not step_metrics' mean over the updates
            "skipped_updates": int(sum(u.get("skipped_updates") or 0 for u in updates)),
            "oom_retries": trainer.guard.retries, "micro_batch": run.sizes.micro_batch,
            "micro_batch_tokens": run.sizes.micro_batch_tokens,
            "generation_batch": run.sizes.generation_batch,
            **flops_metrics(run.meter, run, drawn, rollout, trainer.reference is not None, times,
                            layout=trainer.engine.generation_layout())}


def step_to_profile(cfg: Any) -> int:
    """report.profile_step, or 0 (with a warning) where the tensor probe holds the profiler."""
    step = cfg.report.profile_step
    if step and tensor_probe_on():
        log.warning("report.profile_step=%d: not profiled, memory.cpu_peak=tensors keeps the "
                    "profiler running already (set memory.cpu_peak=rss to profile)", step)
        return 0
    return step


def build_reference(run: Run) -> Reference | None:
    """The KL reference (None when ``algo.beta`` is 0): the model GRPO starts from. With LoRA the
    policy with adapters off (the base model); for full fine-tuning a frozen copy, of the
    warmed-up policy after a warm-up (saved in checkpoints, since it is no longer on disk), else
    of ``model.path``."""
    cfg = run.cfg
    if cfg.algo.beta == 0:
        return None
    if cfg.model.lora.r > 0:
        return Reference(run.policy, adapter_view=True)
    warmed = bool(cfg.sft.format_warmup_steps)
    frozen, frozen_root = load_frozen_copy(cfg.model, run.device, run.model if warmed else None)
    if warmed:
        if run.checkpoints.has_model("reference"):
            run.checkpoints.load_model("reference", frozen)
        run.checkpoints.add_model("reference", frozen)
    return Reference(frozen_root, adapter_view=False)


def policy_update(run: Run, rollout: Rollout, optimizer: torch.optim.Optimizer, scheduler: Any,
                  guard: OOMGuard, loss: LossSettings, skipped: SkippedUpdates, *,
                  iteration: int = 0) -> tuple[Rollout, dict[str, float | None]]:
    """One optimizer update over this process's rows: accumulate (under the OOM guard) the
    gradient of the ``loss``, clip, step. Returns the rollout the later updates read and this
    update's statistics, whose sums are over every process (each one's are its shares of the
    step). The ``first`` update of a rollout, whose policy is the one that generated it, adds to
    the rollout how far the engine's log-probs are from the trainer's (``engine_logp_diff``), the
    old-policy log-probs the later updates need (``old_logp``, with ``algo.num_iterations`` > 1)
    and, with ``algo.kl_in_reward``, the advantages recomputed from the rewards minus the KL to
    the reference (the step's mean completion KL logged as ``kl_in_reward``): the reference
    log-probs exist only from the log-prob stage on, after scoring. ``iteration``: which of the
    rollout's ``num_iterations`` updates this is (0 = ``first``)."""
    algo = run.cfg.algo
    first = iteration == 0
    kl_reward = None
    if first and algo.kl_in_reward:
        with guard.phase("micro_batch"):
            policy_logp = run_logprobs(run, run.policy, rollout)
        advantages, kl_reward = kl_in_reward(rollout, policy_logp, algo.beta,
                                             get_advantage_estimator(algo.estimator()))
        # the policy before any update: its log-probs are the old ones
        rollout = replace(rollout, advantages=advantages,
                          old_logp=policy_logp if algo.num_iterations > 1 else rollout.old_logp)

    # the first update's forwards run the policy that generated the rollout, before any optimizer
    # step: their log-probs are the old ones the later updates need, so no separate pass
    capture_old = first and rollout.old_logp is None and algo.num_iterations > 1

    def accumulate() -> Accumulated:
        optimizer.zero_grad(set_to_none=True)
        return accumulate_policy_gradients(run, rollout, loss=loss, compare_engine=first,
                                           iteration=iteration, capture_old=capture_old)

    made = guard.run_update(accumulate)
    sums = made.sums
    keys = [k for k, v in sums.items() if v is not None]
    sums.update(zip(keys, all_sum([sums[k] for k in keys])))
    if kl_reward is not None:
        sums["kl_in_reward"] = kl_reward  # already over every process
    engine_diff = sums.pop("engine_logp_abs_diff", None)
    where = f"step {rollout.step}" + (f", update {iteration + 1}" if run.cfg.algo.num_iterations > 1
                                      else "")
    sums["grad_norm"], skip = clip_and_step(optimizer, scheduler, run.cfg.train.max_grad_norm,
                                            skipped, where)
    sums["skipped_updates"] = float(skip)
    guard.updates_done += 1
    if made.old_logp is not None:
        rollout = replace(rollout, old_logp=made.old_logp)
    if engine_diff is not None:
        rollout = replace(rollout, engine_logp_diff=engine_diff / max(rollout.total_tokens, 1))
    return rollout, sums


@dataclass(frozen=True)
class Accumulated:
    """What accumulating the policy gradient makes besides the gradients (left in ``.grad``):
    this process's sums for the metrics row and, with ``capture_old``, the rows' log-probs
    [rows, longest completion], the old ones for the rollout's later updates."""

    sums: dict[str, float | None]
    old_logp: torch.Tensor | None = None


def accumulate_policy_gradients(run: Run, rollout: Rollout, *, loss: LossSettings,
                                compare_engine: bool = False, iteration: int = 0,
                                capture_old: bool = False) -> Accumulated:
    """Backward of the GRPO loss (``loss``: its settings, ``LossSettings.of(cfg.algo)``) over
    this process's rows, a micro-batch at a time (``memory.micro_batch`` rows, or
    ``memory.micro_batch_tokens`` packed tokens).

    The loss of each micro-batch is its share of the whole-batch loss (the token and sequence
    counts of the whole step, every process's rows), so the accumulated gradient, summed over
    processes, equals the gradient of the unsplit batch. With ``algo.mask_truncated`` truncated
    completions are out of the loss and of those counts. With engine log-probs in the rollout
    (vLLM) and ``loss.tis_cap``, each token's policy loss is weighted by TIS; with
    ``compare_engine``, also the sum of ``|trainer - engine|`` log-probs of its tokens. The
    policy's entropy is summed over every completion token (the ``entropy`` metric), and is a
    loss term with ``loss.entropy_coef``. With ``loss.cov`` each micro-batch's
    Clip-Cov/KL-Cov tokens are chosen over that micro-batch, Clip-Cov's at random from a stream
    keyed by the seed, step, ``iteration``, micro-batch and process (the same after a resume).
    With ``capture_old`` (the first of several updates, whose policy generated the rollout), the
    rows' log-probs come back as the old ones for the later updates: the ratio of this update
    is 1, as with old log-probs from a separate pass over the same weights.
    """
    algo, device = run.cfg.algo, run.device
    assert rollout.advantages is not None
    keep = finished_rows(rollout.completions, run.ids.eos) if algo.mask_truncated else None
    tokens, seqs = loss_counts(rollout, keep)
    turns = TurnFigures.of(rollout, keep, loss, run.cfg.rollout.max_turns)  # none without tools
    # max(1, ...): when every completion is masked out the loss is 0, not 0 / 0
    totals = BatchTotals(max(tokens, 1), max(seqs, 1), algo.max_new_tokens)
    all_tokens = BatchTotals(rollout.total_tokens, rollout.total_rows, algo.max_new_tokens)
    tis = loss.tis_cap is not None and rollout.engine_logp is not None
    clip_cov = loss.cov is not None and loss.cov.method == "clip_cov"
    fused = run.cfg.fuses_loss()
    sums: dict[str, float | None] = {"loss": 0.0, "clip_fraction": 0.0,
                                     "kl": 0.0 if rollout.ref_logp is not None else None,
                                     "entropy": 0.0, **({"tis_weight": 0.0} if tis else {}),
                                     "cov_restricted": 0.0 if loss.cov is not None else None}
    if compare_engine and rollout.engine_logp is not None:
        sums["engine_logp_abs_diff"] = 0.0
    sizes, layout = run.sizes, run.layout
    packed = sizes.micro_batch_tokens is not None
    sizes.note_sequence(longest_row(rollout.rows, rollout.completions))
    layout.decide(run.policy, rollout.rows, rollout.completions, pad_id=run.ids.pad,
                  chunk_size=run.cfg.head_chunk(), micro_batch=sizes.micro_batch,
                  tokens=sizes.micro_batch_tokens)
    captured: list[torch.Tensor] = []
    loss_masks = rollout.loss_masks  # a trajectory's policy tokens (None: every token)
    for piece, prompts, comps in micro_batches(rollout.rows, rollout.completions,
                                               sizes.micro_batch, tokens=sizes.micro_batch_tokens,
                                               shared=bool(layout.on)):
        batch = layout.inputs(run.policy, prompts, comps, pad_id=run.ids.pad, device=device,
                              packed=packed,
                              masks=None if loss_masks is None else loss_masks[piece])
        width = batch.completion_mask.shape[1]
        old = rollout.old_logp[piece, :width].to(device) if rollout.old_logp is not None else None
        ref = rollout.ref_logp[piece, :width].to(device) if rollout.ref_logp is not None else None
        engine = (rollout.engine_logp[piece, :width].to(device)
                  if rollout.engine_logp is not None else None)
        advantages = rollout.advantages[piece].to(device)
        mask = batch.completion_mask
        if keep is not None:
            mask = mask * keep[piece].to(device, mask.dtype).unsqueeze(1)
        # into_grad: the head's and embedding's [vocab x hidden] gradients go into their .grad
        # in place from the second micro-batch on (no second dense copy while they are summed)
        options = dict(chunk_size=run.cfg.head_chunk(), temperature=algo.temperature,
                       into_grad=True)
        fused_loss = None
        if fused:  # the head's gradient made in its forward, from the loss's per-token terms
            terms = per_token_grpo_terms(
                batch.completion_mask.bool(), old, ref, advantages,
                aggregation_weights(mask.bool(), loss.aggregation, **totals.kwargs()), loss,
                engine_logp=engine if tis else None)
            fused_loss, logp, entropy = completion_loss(run.policy, batch, terms, **options)
        else:
            logp, entropy = completion_logprobs_and_entropy(run.policy, batch, **options)
        # with the fused loss, the same loss over the detached log-probs gives the statistics
        with torch.set_grad_enabled(fused_loss is None):
            # Clip-Cov's random stream: keyed by the seed, step, update, micro-batch and process
            generator = selection_generator(run.cfg.train.seed, rollout.step, iteration,
                                            piece.start, run.world.rank) if clip_cov else None
            value, stats = grpo_loss(
                logp, old, ref, advantages, mask, loss, totals,
                tis_weights=truncated_importance_weights(logp.detach() if old is None else old,
                                                         engine, loss.tis_cap) if tis else None,
                entropy=entropy if loss.entropy_coef else None, generator=generator)
        if fused_loss is not None:
            value = fused_loss
        with adapter_backward(run.policy):
            value.backward()
        if capture_old:
            captured.extend(logp.detach().cpu())
        if sums.get("engine_logp_abs_diff") is not None:
            sums["engine_logp_abs_diff"] += float(
                ((logp.detach() - engine).abs() * batch.completion_mask).sum())
        sums["loss"] += value.item()
        sums["entropy"] += float(aggregate(entropy.detach(), batch.completion_mask, "token_mean",
                                           **all_tokens.kwargs()))
        for key in ("clip_fraction", "kl", "tis_weight", "cov_restricted"):
            if key in stats:  # kl only with a reference model (beta > 0); else logged as null
                sums[key] += float(stats[key])
        turns.add(piece, logp.detach(), old, ref, advantages, mask)
    sums.update(turns.sums)
    if not capture_old:
        return Accumulated(sums)
    return Accumulated(sums, pad_rows(captured, max(int(c.shape[0]) for c in rollout.completions)))
