"""GRPO for vision-language models: one loop, read top to bottom.

Each step: take ``prompts_per_step`` prompts, sample ``num_generations`` completions per prompt
(in chunks of ``memory.generation_batch``), score them, turn rewards into group-normalised
advantages, then make ``num_iterations`` optimizer updates on that rollout, each accumulating
gradients over micro-batches of ``memory.micro_batch`` sequences. Peak memory is set by the two chunk
sizes, never by the group size.

Departures from the GRPO paper, on purpose:
- the loss aggregation is a choice (``algo.loss_aggregation``; DAPO's token mean by default) and
  PPO clipping is asymmetric (``algo.epsilon_high``, DAPO's clip-higher);
- the KL reference is the model GRPO starts from (after the SFT warm-up), not the pre-trained
  one; ``beta=0`` drops it (no reference model loaded), as in DAPO and Dr. GRPO;
- a step counts rollouts, not optimizer updates: with ``num_iterations`` = mu, one step makes mu
  updates.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from r1fit.algorithms.advantages import group_advantages
from r1fit.algorithms.losses import grpo_loss
from r1fit.checkpoint.state import Counters, OptimizerState, RngState
from r1fit.config import Config
from r1fit.data.dataset import PromptSampler
from r1fit.distributed.context import all_gather_rows, all_sum
from r1fit.distributed.parallelize import gathered
from r1fit.memory.guard import OOMGuard
from r1fit.memory.telemetry import reset_peak, step_memory, warn_if_fragmented
from r1fit.models.load import Reference
from r1fit.report.progress import progress_bar
from r1fit.rewards.accuracy import accuracy
from r1fit.rewards.registry import RewardScorer
from r1fit.data.batch import Prompt, collate, encode_prompts
from r1fit.rollout.generate import SamplingSettings, generate_completions, row_seeds
from r1fit.train.common import (BadRowCounter, decode, evaluate, finish_summary,
                                load_frozen_copy, reduce_memory, save_model, start_run, timed)
from r1fit.train.forward import completion_logprobs, logprobs_in_micro_batches, micro_batches
from r1fit.train.optim import build_optimizer, build_scheduler, clip_and_step
from r1fit.train.sft import supervised_steps

log = logging.getLogger("r1fit.grpo")


def train_grpo(cfg: Config) -> dict[str, Any]:
    """Run GRPO as configured; returns the summary (also written to ``summary.json``)."""
    run = start_run(cfg, "grpo")
    model, processor, device, algo = run.model, run.processor, run.device, cfg.algo
    train_set, eval_set, checkpoints = run.train_set, run.eval_set, run.checkpoints
    if cfg.sft.format_warmup_steps and not checkpoints.phase_done("warmup"):
        # teach the answer format so GRPO's first rewards are not all 0
        supervised_steps(run, train_set, cfg.sft.format_warmup_steps, format_only=True,
                         metrics_prefix="warmup/")
    # the KL reference is the model GRPO starts from: with LoRA the policy with adapters off (the
    # base model); for full fine-tuning a frozen copy, of the warmed-up policy after a warm-up
    # (saved in checkpoints, since it is no longer on disk), else of model.path
    reference = None
    if algo.beta > 0 and cfg.model.lora.r > 0:
        reference = Reference(run.policy, adapter_view=True)
    elif algo.beta > 0:
        warmed = bool(cfg.sft.format_warmup_steps)
        frozen, frozen_root = load_frozen_copy(cfg, device, model if warmed else None)
        if warmed:
            if checkpoints.has_model("reference"):
                checkpoints.load_model("reference", frozen)
            checkpoints.models["reference"] = (frozen, None)
        reference = Reference(frozen_root, adapter_view=False)

    optimizer = build_optimizer(model, cfg.train.learning_rate, cfg.train.weight_decay)
    total_updates = cfg.train.max_steps * algo.num_iterations
    scheduler = build_scheduler(optimizer, cfg.train.lr_schedule, cfg.train.warmup_steps,
                                total_updates)
    sampler = PromptSampler(len(train_set), seed=cfg.train.seed)
    bad_rows = BadRowCounter(train_set.bad_rows)
    scorer = RewardScorer(cfg.rewards)
    loop = Counters(best=-1.0, since_best=0)
    # everything a resumed run needs to continue exactly; the models are saved alongside
    state = {"optimizer": OptimizerState(model, optimizer), "scheduler": scheduler,
             "sampler": sampler, "loop": loop, "bad_rows": bad_rows, "rewards": scorer,
             "rng": RngState()}
    start = checkpoints.restore("grpo", state)
    guard = OOMGuard(cfg.memory, device, optimizer, baseline_rss_bytes=run.rss_before_load_bytes)
    settings = SamplingSettings(algo.max_new_tokens, algo.temperature, algo.top_p)
    if eval_set is not None and cfg.eval.before_train and start == 0:
        row = {"step": 0, **evaluate(model, processor, eval_set, cfg, run.ids, device,
                                     run.policy)}
        run.metrics.write(row)
        log.info("eval before GRPO: %s", row)

    step = start
    with progress_bar("GRPO", cfg.train.max_steps, completed=start) as advance:
        for step in range(start + 1, cfg.train.max_steps + 1):
            times: dict[str, float] = {}
            reset_peak(device)  # peak_memory_bytes is this step's peak
            samples = bad_rows.fetch(train_set, sampler, cfg.train.prompts_per_step)
            prompts = encode_prompts(processor, samples, cfg.data.system_prompt)
            rows: list[Prompt] = [p for p in prompts for _ in range(algo.num_generations)]
            # over several processes each rank generates, scores and trains on its share of the
            # rows; rewards are gathered so advantages see whole groups
            share = run.world.share(len(rows), "rows per step (prompts_per_step x "
                                               "num_generations)")
            mine = rows[share]
            row_samples = [p.sample for p in mine]

            def attempt() -> tuple:
                """Steps 1-3; the OOM guard redoes them with smaller chunks if memory runs out."""
                # 1. rollout: G completions per prompt, generated generation_batch rows at a time
                # (sampled from per-row streams: the same rows whatever the chunking or rank)
                with timed(times, "seconds_generate"), guard.phase("generation"), \
                        gathered(run.policy):
                    completions = generate_completions(
                        run.policy, mine,
                        seeds=row_seeds(cfg.train.seed, step, share.start, len(mine)),
                        batch_size=cfg.memory.generation_batch, settings=settings, ids=run.ids,
                        device=device)

                # 2. score: weighted rewards, then advantages normalised within each group
                with timed(times, "seconds_score"):
                    texts = decode(processor, completions)
                    errors_before = scorer.total_errors
                    rewards = scorer.score(texts, [s.solution for s in row_samples],
                                           [{"problem": s.problem} for s in row_samples])
                    # the logged accuracy: the reward component when configured, else scored here
                    correct = (rewards.components["accuracy"]
                               if "accuracy" in rewards.components else
                               torch.tensor([accuracy(t, s.solution, problem=s.problem)
                                             for t, s in zip(texts, row_samples)]))
                    # every rank sees every row's rewards (whole groups), then keeps its share
                    rewards.total = all_gather_rows(rewards.total)
                    rewards.components = {k: all_gather_rows(v)
                                          for k, v in rewards.components.items()}
                    correct = all_gather_rows(correct.float()).tolist()
                    scorer.total_errors = errors_before + int(
                        all_sum([scorer.total_errors - errors_before])[0])
                    advantages = group_advantages(rewards.total, algo.num_generations,
                                                  scale_std=algo.scale_rewards)[share]

                # 3. update: old/reference log-probs once, then mu clipped updates on this rollout
                with timed(times, "seconds_update"):
                    logp_args = dict(chunk_size=cfg.memory.logits_chunk,
                                     temperature=algo.temperature, pad_id=run.ids.pad,
                                     device=device)
                    with guard.phase("micro_batch"):
                        old_logp = (logprobs_in_micro_batches(
                            run.policy, mine, completions, micro_batch=cfg.memory.micro_batch,
                            **logp_args) if algo.num_iterations > 1 else None)
                        ref_logp = None
                        if reference is not None:
                            with reference.model() as ref_model:
                                ref_logp = logprobs_in_micro_batches(
                                    ref_model, mine, completions,
                                    micro_batch=cfg.memory.micro_batch, **logp_args)
                    # the loss normalisers are the whole step's, over every rank's rows
                    totals = dict(total_tokens=int(all_sum([sum(int(c.shape[0])
                                                                for c in completions)])[0]),
                                  total_seqs=len(rows), max_new_tokens=algo.max_new_tokens)
                    updates = [policy_update(run.policy, optimizer, scheduler, mine, completions,
                                             advantages, old_logp, ref_logp, totals, cfg,
                                             run.ids.pad, device, guard)
                               for _ in range(algo.num_iterations)]
                return completions, rewards, correct, updates

            completions, rewards, correct, updates = guard.run_step(
                attempt, restore=[state["rng"], scorer])

            # 4. log one line per step
            n_tokens = int(all_sum([sum(int(c.shape[0]) for c in completions)])[0])
            seconds = sum(times.values())
            row = {"step": step,
                   **{k: None if updates[0][k] is None else sum(u[k] for u in updates) / len(updates)
                      for k in updates[0]},
                   "reward_mean": rewards.total.mean().item(),
                   "reward_std": rewards.total.std().item(),
                   **{f"reward/{k}": v.mean().item() for k, v in rewards.components.items()},
                   "accuracy": sum(correct) / len(correct),
                   "completion_len_mean": n_tokens / len(rows),
                   **times, "tokens_per_second": n_tokens / max(seconds, 1e-9),
                   "learning_rate": scheduler.get_last_lr()[0],
                   **reduce_memory(step_memory(device)),
                   "bad_rows": bad_rows.count, "reward_errors": scorer.total_errors,
                   "oom_retries": guard.retries, "micro_batch": cfg.memory.micro_batch,
                   "generation_batch": cfg.memory.generation_batch}
            # evaluations go into the step's own line (the last step always evaluates), so every
            # step appears exactly once in metrics.jsonl
            if eval_set is not None and (step == cfg.train.max_steps or
                                         (cfg.eval.every and step % cfg.eval.every == 0)):
                row.update(evaluate(model, processor, eval_set, cfg, run.ids, device,
                                    run.policy))
                if row["eval/accuracy"] > loop.best:
                    loop.best, loop.since_best = row["eval/accuracy"], 0
                else:
                    loop.since_best += 1
            run.metrics.write(row)
            warn_if_fragmented(device, cfg.memory.fragmentation_warning_gib, step)
            advance(f"reward {row['reward_mean']:.2f} acc {row['accuracy']:.2f}")
            stop = bool(cfg.train.early_stop_patience and
                        loop.since_best >= cfg.train.early_stop_patience)
            if checkpoints.due(step, last=stop or step == cfg.train.max_steps):
                checkpoints.save("grpo", step, state, metrics=row)
                checkpoints.stop_if_requested(step)
            if stop:
                log.info("early stop at step %d: eval accuracy has not improved on %.3f for %d "
                         "evaluations", step, loop.best, loop.since_best)
                break

    save_model(model, processor, run.out / "final")
    return finish_summary(run, steps=step)


def policy_update(model: Any, optimizer: torch.optim.Optimizer, scheduler: Any,
                  rows: list[Prompt], completions: list[torch.Tensor], advantages: torch.Tensor,
                  old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None,
                  totals: dict[str, int], cfg: Config, pad_id: int, device: torch.device,
                  guard: OOMGuard) -> dict[str, float | None]:
    """One optimizer update over this rank's rows: accumulate (under the OOM guard), clip, step.
    The logged sums are over every rank (each rank's are its shares of the whole step)."""
    def accumulate() -> dict[str, float | None]:
        optimizer.zero_grad(set_to_none=True)
        return accumulate_policy_gradients(model, rows, completions, advantages, old_logp,
                                           ref_logp, totals, cfg, pad_id, device)

    sums = guard.run_update(accumulate)
    keys = [k for k, v in sums.items() if v is not None]
    sums.update(zip(keys, all_sum([sums[k] for k in keys])))
    sums["grad_norm"] = clip_and_step(optimizer, scheduler, cfg.train.max_grad_norm)
    guard.updates_done += 1
    return sums


def accumulate_policy_gradients(model: Any, rows: list[Prompt], completions: list[torch.Tensor],
                                advantages: torch.Tensor, old_logp: torch.Tensor | None,
                                ref_logp: torch.Tensor | None, totals: dict[str, int],
                                cfg: Config, pad_id: int,
                                device: torch.device) -> dict[str, float | None]:
    """Backward of the GRPO loss over ``rows``, ``memory.micro_batch`` rows at a time.

    The loss of each micro-batch is its share of the whole-batch loss (``totals``: the token and
    sequence counts of the whole step, every rank's rows), so the accumulated gradient, summed
    over ranks, equals the gradient of the unsplit batch.
    """
    algo = cfg.algo
    sums: dict[str, float | None] = {"loss": 0.0, "clip_fraction": 0.0,
                                     "kl": 0.0 if ref_logp is not None else None}
    for piece, prompts, comps in micro_batches(rows, completions, cfg.memory.micro_batch):
        batch = collate(prompts, comps, pad_id).to(device)
        logp = completion_logprobs(model, batch, chunk_size=cfg.memory.logits_chunk,
                                   temperature=algo.temperature)
        width = logp.shape[1]
        old = old_logp[piece, :width].to(device) if old_logp is not None else None
        ref = ref_logp[piece, :width].to(device) if ref_logp is not None else None
        loss, stats = grpo_loss(logp, old, ref, advantages[piece].to(device),
                                batch.completion_mask, epsilon=algo.epsilon,
                                epsilon_high=algo.epsilon_high or algo.epsilon, beta=algo.beta,
                                aggregation=algo.loss_aggregation, **totals)
        loss.backward()
        sums["loss"] += loss.item()
        sums["clip_fraction"] += float(stats["clip_fraction"])
        if "kl" in stats:  # only with a reference model (beta > 0); else logged as null
            sums["kl"] += float(stats["kl"])
    return sums
