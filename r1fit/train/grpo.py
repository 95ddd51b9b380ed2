"""GRPO: one loop, top to bottom, four stages over one rollout record per step.

Each step: fetch ``prompts_per_step`` prompts; (1) generate ``num_generations`` completions of each
(:func:`generate_rollout`); (2) score them and compute group-relative advantages
(:func:`score_rollout`); (3) old-policy and reference log-probs (:func:`add_logprobs`);
(4) ``num_iterations`` clipped policy updates on that rollout (:func:`policy_update`). Then one
metrics row, evaluation when due, a checkpoint when due.

Departures from DeepSeekMath's GRPO, all by config: DAPO's token-mean loss and clip-higher are the
defaults (``algo.loss_aggregation``, ``algo.epsilon_high``); Dr. GRPO is available
(``algo.scale_rewards=false``, ``algo.loss_aggregation=seq_mean_token_sum_norm``); the KL term is
the k3 estimator, added to the loss (``algo.beta``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from r1fit.algorithms.advantages import get_advantage_estimator
from r1fit.algorithms.losses import grpo_loss
from r1fit.checkpoint.state import Counters, OptimizerState, SchedulerState
from r1fit.data.batch import collate
from r1fit.data.build import BadRowCounter
from r1fit.data.dataset import PromptSampler
from r1fit.distributed.context import all_sum
from r1fit.distributed.loading import load_frozen_copy
from r1fit.memory.guard import OOMGuard
from r1fit.memory.telemetry import reset_peak, step_memory, warn_if_fragmented
from r1fit.models.load import Reference
from r1fit.models.logprobs import completion_logprobs
from r1fit.progress import progress_bar
from r1fit.report.html import LiveReport
from r1fit.report.metrics import timed
from r1fit.rewards.registry import RewardScorer
from r1fit.rng import RngState
from r1fit.rollout.generate import SamplingSettings, generate_rollout
from r1fit.rollout.record import Rollout
from r1fit.rollout.score import score_rollout
from r1fit.train.engines import rollout_engine
from r1fit.train.evaluate import evaluate
from r1fit.train.forward import add_logprobs, micro_batches
from r1fit.train.optim import build_optimizer, build_scheduler, clip_and_step
from r1fit.train.run import Run, start_run
from r1fit.train.sft import supervised_steps

log = logging.getLogger("r1fit.grpo")


def train_grpo(cfg: Any) -> dict[str, Any]:
    """Run GRPO as configured; returns the summary (also written to ``summary.json``)."""
    run = start_run(cfg, "grpo")
    algo = cfg.algo
    if cfg.sft.format_warmup_steps and not run.checkpoints.phase_done("warmup"):
        # teach the answer format so GRPO's first rewards are not all 0
        supervised_steps(run, cfg.sft.format_warmup_steps, format_only=True)
    reference = build_reference(run)
    optimizer = build_optimizer(run.model, cfg.train.learning_rate, cfg.train.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, cfg.train.warmup_steps,
                                cfg.train.max_steps * algo.num_iterations)
    sampler = PromptSampler(len(run.train_set), seed=cfg.train.seed)
    bad_rows = BadRowCounter(run.train_set.bad_rows)
    scorer = RewardScorer(cfg.rewards)
    loop = Counters(best=-1.0, since_best=0)
    rng = RngState(cfg.train.seed, run.world.rank)
    # everything a resumed run needs to continue exactly; the models are saved alongside
    state = {"optimizer": OptimizerState(run.model, optimizer),
             "scheduler": SchedulerState(scheduler), "sampler": sampler, "loop": loop,
             "bad_rows": bad_rows, "rewards": scorer, "sizes": run.sizes, "rng": rng}
    start = run.checkpoints.restore("grpo", state)
    guard = run.guard(optimizer)
    settings = SamplingSettings(algo.max_new_tokens, algo.temperature, algo.top_p)
    engine = rollout_engine(run, settings)
    advantage = get_advantage_estimator("grpo" if algo.scale_rewards else "dr_grpo")
    if run.eval_set is not None and cfg.eval.before_train and start == 0:
        row = {"step": 0, **evaluate(run, engine)}
        run.metrics.write(row)
        log.info("eval before GRPO: %s", row)

    report = LiveReport(cfg.report, run.out, main=run.world.main)  # rank 0: rollouts, alarms, page
    step = start
    with progress_bar("GRPO", cfg.train.max_steps, completed=start) as advance:
        for step in range(start + 1, cfg.train.max_steps + 1):
            times: dict[str, float] = {}
            reset_peak(run.device)  # peak_memory_bytes is this step's peak
            prompts = run.fetch(sampler, bad_rows, cfg.train.prompts_per_step)
            # over several processes each rank generates, scores and trains on its share of the
            # rows; rewards are gathered so advantages see whole groups
            share = run.world.share(len(prompts) * algo.num_generations,
                                    "rows per step (prompts_per_step x num_generations)")

            def attempt() -> tuple[Rollout, list[dict[str, float | None]]]:
                """The four stages; the OOM guard redoes them with smaller chunks if memory runs
                out."""
                rollout = Rollout(step, prompts, algo.num_generations, share)
                with engine.ready(times), timed(times, "seconds_generate"), \
                        guard.phase("generation"):
                    generate_rollout(rollout, engine.generate, seed=cfg.train.seed)
                with timed(times, "seconds_score"):
                    score_rollout(rollout, scorer, run.processor, advantage)
                with timed(times, "seconds_update"):
                    with guard.phase("micro_batch"):
                        add_logprobs(rollout, run, reference, old=algo.num_iterations > 1)
                    updates = [policy_update(run, rollout, optimizer, scheduler, guard, first=i == 0)
                               for i in range(algo.num_iterations)]
                    engine.updated()
                return rollout, updates

            rollout, updates = guard.run_step(attempt, restore=[rng, scorer])
            run.trackers.log_samples(rollout, run.processor)  # every report.samples_every steps
            report.save_rollout(rollout, run.processor)  # every report.rollouts_every steps
            row = {"step": step, **step_metrics(rollout, updates, times, run.ids.eos),
                   "learning_rate": scheduler.get_last_lr()[0], **step_memory(run.device),
                   "bad_rows": bad_rows.count, "reward_errors": scorer.total_errors,
                   "oom_retries": guard.retries, "micro_batch": run.sizes.micro_batch,
                   "generation_batch": run.sizes.generation_batch}
            # evaluations go into the step's own line (the last step always evaluates), so every
            # step appears exactly once in metrics.jsonl
            if run.eval_set is not None and (step == cfg.train.max_steps or
                                             (cfg.eval.every and step % cfg.eval.every == 0)):
                row.update(evaluate(run, engine))
                if row["eval/accuracy"] > loop.best:
                    loop.best, loop.since_best = row["eval/accuracy"], 0
                else:
                    loop.since_best += 1
            run.metrics.write(row)
            report.after_step(row)  # alarms (each warned once); the page every report.every steps
            warn_if_fragmented(run.device, cfg.memory.fragmentation_warning_gib, step)
            advance(f"reward {row['reward_mean']:.2f} acc {row['accuracy']:.2f}")
            stop = bool(cfg.train.early_stop_patience and
                        loop.since_best >= cfg.train.early_stop_patience)
            run.save("grpo", step, state, row, last=stop or step == cfg.train.max_steps)
            if stop:
                log.info("early stop at step %d: eval accuracy has not improved on %.3f for %d "
                         "evaluations", step, loop.best, loop.since_best)
                break
    summary = run.finish(steps=step)
    report.finish()
    engine.close()  # last: vLLM's shutdown takes down the process groups it joined
    return summary


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


def step_metrics(rollout: Rollout, updates: list[dict[str, float | None]],
                 times: dict[str, float], eos: Sequence[int]) -> dict[str, Any]:
    """A step's rollout and update figures for its metrics row (the update figures averaged over
    its ``num_iterations`` updates). A completion is clipped when it does not end with one of the
    ``eos`` ids: generation stopped at ``algo.max_new_tokens`` (completions are cut after their
    first end-of-sequence token, which they keep)."""
    assert rollout.rewards is not None
    seconds = sum(times.values())
    clipped = sum(1 for c in rollout.completions if c.numel() == 0 or int(c[-1]) not in eos)
    groups = rollout.rewards.view(-1, rollout.num_generations)  # every row of the step
    return {**{k: None if updates[0][k] is None else sum(u[k] for u in updates) / len(updates)
               for k in updates[0]},
            "reward_mean": rollout.rewards.mean().item(),
            "reward_std": rollout.rewards.std().item(),
            **{f"reward/{k}": v.mean().item() for k, v in rollout.components.items()},
            "accuracy": sum(rollout.correct) / len(rollout.correct),
            "completion_len_mean": rollout.total_tokens / rollout.total_rows,
            "completion_clipped_fraction": all_sum([clipped])[0] / rollout.total_rows,
            "zero_variance_groups":
                (groups.amax(dim=1) == groups.amin(dim=1)).float().mean().item(),
            "engine_logp_diff": rollout.engine_logp_diff,
            **times, "tokens_per_second": rollout.total_tokens / max(seconds, 1e-9)}


def policy_update(run: Run, rollout: Rollout, optimizer: torch.optim.Optimizer, scheduler: Any,
                  guard: OOMGuard, *, first: bool = True) -> dict[str, float | None]:
    """One optimizer update over this process's rows: accumulate (under the OOM guard), clip,
    step. The logged sums are over every process (each one's are its shares of the step). The
    ``first`` update of a rollout, whose policy is the one that generated it, also measures how
    far the engine's log-probs are from the trainer's (``rollout.engine_logp_diff``)."""
    def accumulate() -> dict[str, float | None]:
        optimizer.zero_grad(set_to_none=True)
        return accumulate_policy_gradients(run, rollout, compare_engine=first)

    sums = guard.run_update(accumulate)
    keys = [k for k, v in sums.items() if v is not None]
    sums.update(zip(keys, all_sum([sums[k] for k in keys])))
    engine_diff = sums.pop("engine_logp_abs_diff", None)
    if engine_diff is not None:
        rollout.engine_logp_diff = engine_diff / max(rollout.total_tokens, 1)
    sums["grad_norm"] = clip_and_step(optimizer, scheduler, run.cfg.train.max_grad_norm)
    guard.updates_done += 1
    return sums


def accumulate_policy_gradients(run: Run, rollout: Rollout, *,
                                compare_engine: bool = False) -> dict[str, float | None]:
    """Backward of the GRPO loss over this process's rows, ``memory.micro_batch`` rows at a time.

    The loss of each micro-batch is its share of the whole-batch loss (the token and sequence
    counts of the whole step, every process's rows), so the accumulated gradient, summed over
    processes, equals the gradient of the unsplit batch. With ``compare_engine`` and engine
    log-probs in the rollout, also the sum of ``|trainer - engine|`` log-probs of its tokens.
    """
    algo, device = run.cfg.algo, run.device
    assert rollout.advantages is not None
    totals = dict(total_tokens=rollout.total_tokens, total_seqs=rollout.total_rows,
                  max_new_tokens=algo.max_new_tokens)
    sums: dict[str, float | None] = {"loss": 0.0, "clip_fraction": 0.0,
                                     "kl": 0.0 if rollout.ref_logp is not None else None}
    if compare_engine and rollout.engine_logp is not None:
        sums["engine_logp_abs_diff"] = 0.0
    for piece, prompts, comps in micro_batches(rollout.rows, rollout.completions,
                                               run.sizes.micro_batch):
        batch = collate(prompts, comps, run.ids.pad).to(device)
        logp = completion_logprobs(run.policy, batch, chunk_size=run.cfg.memory.logits_chunk,
                                   temperature=algo.temperature)
        width = logp.shape[1]
        old = rollout.old_logp[piece, :width].to(device) if rollout.old_logp is not None else None
        ref = rollout.ref_logp[piece, :width].to(device) if rollout.ref_logp is not None else None
        loss, stats = grpo_loss(logp, old, ref, rollout.advantages[piece].to(device),
                                batch.completion_mask, epsilon=algo.epsilon,
                                epsilon_high=algo.epsilon_high or algo.epsilon, beta=algo.beta,
                                aggregation=algo.loss_aggregation, **totals)
        loss.backward()
        if sums.get("engine_logp_abs_diff") is not None:
            engine = rollout.engine_logp[piece, :width].to(device)
            sums["engine_logp_abs_diff"] += float(
                ((logp.detach() - engine).abs() * batch.completion_mask).sum())
        sums["loss"] += loss.item()
        sums["clip_fraction"] += float(stats["clip_fraction"])
        if "kl" in stats:  # only with a reference model (beta > 0); else logged as null
            sums["kl"] += float(stats["kl"])
    return sums
