"""A multi-turn GRPO step's gradient against one worked out by hand (issue 43): 2-turn
trajectories (the policy's turn, a tool turn, the policy's answer) on the real tiny Qwen2.5-VL in
float64, scored, given their reference log-probs and updated twice by the trainer's own stages
(:func:`score_rollout`, :func:`add_logprobs`, :func:`policy_update` as ``grpo_step`` calls them).

Each update's gradient equals a slow loop over the policy's tokens alone of
``-min(r A, clip(r) A) + beta k3`` over the step's policy-token count, ``A`` the trajectory's
advantage (the same for its answer after the tool turn), the old log-probs the first update's and
the reference the starting model; the loss's gradient per token (read off the log-probs) is
exactly 0 on the tool turn's tokens and ``-A r / N`` (+ the KL's) on both policy turns; the tool
turn's old and reference log-probs, changed, change nothing."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from r1fit.algorithms.losses import LossSettings
from r1fit.config import load_config
from r1fit.data.batch import collate
from r1fit.memory.guard import OOMGuard
from r1fit.memory.sizes import ChunkSizes
from r1fit.models.load import Reference, special_token_ids
from r1fit.models.logprobs import completion_logprobs
from r1fit.rewards.registry import RewardScorer
from r1fit.rollout.record import Rollout, Trajectory, Turn
from r1fit.rollout.score import AdvantageSettings, score_rollout
from r1fit.tools import ToolCall, ToolResult
from r1fit.train import grpo
from r1fit.train.forward import BatchLayout, add_logprobs
from r1fit.train.optim import SkippedUpdates, build_scheduler

CPU = torch.device("cpu")
ZOOM = ToolCall("zoom", {"x": 0.5, "y": 0.5, "factor": 2}, "<tool_call>...</tool_call>")
TOOL_TURN = ("<|im_end|>\n<|im_start|>user\n<tool_response>\nzoomed x2\n</tool_response>"
             "<|im_end|>\n<|im_start|>assistant\n")


def two_turn_trajectories(rows, processor, eos: int) -> list[Trajectory]:
    """Per row: a policy turn of random tokens ending on a call, the tool turn (the chat
    template's text, encoded), the policy's answer (random tokens, then EOS) scored right in
    rows 0, 3, 4, 5, wrong in 1, 2: groups (right, wrong), (wrong, right), (right, right)."""
    tool = torch.tensor(processor.tokenizer.encode(TOOL_TURN, add_special_tokens=False))
    gen = torch.Generator().manual_seed(3)
    out = []
    for i, prompt in enumerate(rows):
        first = torch.randint(10, 700, (3 + i % 3,), generator=gen)
        answer = torch.cat([torch.randint(10, 700, (2 + (i * 2) % 3,), generator=gen),
                            torch.tensor([eos])])
        text = prompt.sample.solution if i in (0, 3, 4, 5) else "wrong"
        turns = [Turn("<tool_call>zoom</tool_call>", len(first), "tool_call", (ZOOM,),
                      (ToolResult("zoom", ("zoomed x2",)),), context_tokens=len(tool)),
                 Turn(f"<think>looked</think><answer>{text}</answer>", len(answer), "eos")]
        ids = torch.cat([first, tool, answer])
        mask = torch.cat([torch.ones(len(first)), torch.zeros(len(tool)), torch.ones(len(answer))])
        out.append(Trajectory(prompt, ids, mask, turns=turns, ended="eos", calls_run=1))
    return out


def hand_loss(logp, old, ref, advantages, trajectories, eps_low, eps_high, beta):
    """The obvious GRPO loss: a loop over each trajectory's tokens, the tool turn's skipped, each
    policy token's ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A) + beta k3`` with its
    trajectory's ``A``, summed and divided by the step's policy tokens (``token_mean``)."""
    total, count = logp.new_zeros(()), 0
    for i, trajectory in enumerate(trajectories):
        a = advantages[i]
        for t in range(trajectory.length):
            if trajectory.policy_mask[t] == 0:  # a tool turn's token: nothing
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            surrogate = torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            d = ref[i, t] - logp[i, t]
            total = total - surrogate + beta * (torch.exp(d) - d - 1)
            count += 1
    return total / count


def scored_step(float64_tiny, overrides: list[str]):
    """The setup of a step on the tiny model: (cfg, run, the trajectories' rollout scored and
    with the starting model's reference log-probs, its trainable parameters)."""
    model, processor, rows, _ = float64_tiny(0)
    ids = special_token_ids(model, processor)
    cfg = load_config(None, ["algo.max_new_tokens=16", "memory.logits_chunk=4",
                             "algo.num_iterations=2", "algo.num_generations=2",
                             "train.max_grad_norm=0", *overrides])
    trajectories = two_turn_trajectories(rows, processor, ids["eos"])
    rollout = Rollout(1, rows[::2], 2, slice(0, 6), completions=[t.token_ids for t in trajectories],
                      total_tokens=sum(t.policy_tokens for t in trajectories),
                      trajectories=trajectories)
    # scoring: one advantage per trajectory, from its answer (the last turn)
    rollout = score_rollout(rollout, RewardScorer(cfg.rewards), processor,
                            AdvantageSettings.of(cfg.algo))
    a = 0.5 / (0.5 ** 0.5 + 1e-4)  # group [1, 0]: (1 - 0.5) / (std + eps)
    torch.testing.assert_close(rollout.advantages.double(),
                               torch.tensor([a, -a, -a, a, 0.0, 0.0], dtype=torch.float64))
    micro, tokens = cfg.memory.micro_batch, cfg.memory.micro_batch_tokens
    run = SimpleNamespace(cfg=cfg, device=CPU, ids=SimpleNamespace(pad=ids["pad"], eos=[ids["eos"]]),
                          policy=model, sizes=ChunkSizes(micro, 64, asked={}, micro_batch_tokens=tokens),
                          layout=BatchLayout(False), world=SimpleNamespace(rank=0))
    start = copy.deepcopy(model)  # the KL reference: the model GRPO starts from
    rollout = add_logprobs(rollout, run, Reference(start, adapter_view=False))
    return cfg, run, rollout, [p for p in model.parameters() if p.requires_grad]


def assert_unchanged_by_tool_logprobs(run, rollout: Rollout, tool: torch.Tensor,
                                      loss: LossSettings, params: list[torch.Tensor]) -> None:
    """A later update's gradient is the same, bit for bit, with the ``tool`` tokens' old and
    reference log-probs moved."""
    grads = []
    for shift in (0.0, 1.5):
        moved = tool[:, :rollout.old_logp.shape[1]] * shift
        changed = replace(rollout, old_logp=rollout.old_logp + moved,
                          ref_logp=rollout.ref_logp - moved)
        run.policy.zero_grad(set_to_none=True)
        grpo.accumulate_policy_gradients(run, changed, loss=loss, iteration=1)
        grads.append([p.grad.clone() for p in params])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def assert_turn_figures(update: dict, trajectories: list[Trajectory], mask: torch.Tensor,
                        **values: torch.Tensor) -> None:
    """The update's ``turn_<name>/<k>`` figures are the means of ``values`` over the policy
    tokens of turn 1 (before the tool turn) and turn 2 (after it)."""
    first = torch.zeros(mask.shape, dtype=torch.bool)
    for i, trajectory in enumerate(trajectories):
        first[i, :trajectory.turns[0].tokens] = True
    for k, tokens in ((1, first & (mask > 0)), (2, ~first & (mask > 0))):
        for name, value in values.items():
            assert update[f"turn_{name}/{k}"] == pytest.approx(float(value[tokens].mean()),
                                                               rel=1e-6, abs=1e-12), (name, k)
    assert not any(key.startswith("turn_") and key.endswith("/3") for key in update)


def token_gradient(grads: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The micro-batches' gradients of the loss by log-prob, put together: [rows, width]."""
    out = torch.zeros(shape, dtype=torch.float64)
    row = 0
    for g in grads:
        out[row:row + g.shape[0], :g.shape[1]] = g
        row += g.shape[0]
    return out


@pytest.mark.parametrize("fused, micro, tokens", [(False, 4, None), (True, 6, 60)])
def test_a_two_turn_steps_gradient_equals_the_hand_computed_one(float64_tiny, monkeypatch, fused,
                                                                micro, tokens):
    eps_low, eps_high, beta = 0.02, 0.03, 0.1  # a narrow clip range: the second update clips
    cfg, run, rollout, params = scored_step(float64_tiny, [
        f"memory.micro_batch={micro}", f"memory.micro_batch_tokens={tokens or 'null'}",
        f"memory.fused_loss={str(fused).lower()}", f"algo.beta={beta}",
        f"algo.epsilon={eps_low}", f"algo.epsilon_high={eps_high}"])
    assert cfg.fuses_loss() == fused
    model, trajectories = run.policy, rollout.trajectories
    policy_tokens = rollout.total_tokens
    optimizer = torch.optim.SGD(params, lr=2.0)
    scheduler = build_scheduler(optimizer, "constant", 0, 2)
    guard = OOMGuard(run.sizes, "", CPU, optimizer, baseline_rss_bytes=0)
    full = collate(rollout.rows, rollout.completions, run.ids.pad)
    with torch.no_grad():  # the starting model's log-probs: the old ones and the reference's
        logp0 = completion_logprobs(model, full, chunk_size=4)
    mask = full.completion_mask.clone()
    for i, t in enumerate(trajectories):
        mask[i, :t.length] = t.policy_mask
    tool = (full.completion_mask > 0) & (mask == 0)  # the tool turns' tokens
    assert int(tool.sum()) == 6 * trajectories[0].turns[0].context_tokens

    seen = {"trained": [], "expected": [], "token_grads": []}

    def checked_step(optimizer, scheduler, max_grad_norm, skipped, where):
        """The trainer's clip_and_step, after recording the update's gradient and the hand one
        at the same weights."""
        seen["trained"].append([p.grad.clone() for p in params])
        logp = completion_logprobs(model, full, chunk_size=4)
        loss = hand_loss(logp, logp0, logp0, rollout.advantages.double(), trajectories,
                         eps_low, eps_high, beta)
        seen["expected"].append(torch.autograd.grad(loss, params))
        seen["logp"] = logp.detach()
        return clip_and_step(optimizer, scheduler, max_grad_norm, skipped, where)

    def spied_logprobs(*args, **kwargs):
        """The trainer's log-probs, each micro-batch's gradient (dloss/dlogp per token) kept."""
        logp, entropy = logprobs_and_entropy(*args, **kwargs)
        grads = seen["token_grads"]
        grads.append(None)
        index = len(grads) - 1
        logp.register_hook(lambda g: grads.__setitem__(index, g.detach().clone()))
        return logp, entropy

    clip_and_step = grpo.clip_and_step
    logprobs_and_entropy = grpo.completion_logprobs_and_entropy
    monkeypatch.setattr(grpo, "clip_and_step", checked_step)
    monkeypatch.setattr(grpo, "completion_logprobs_and_entropy", spied_logprobs)
    loss = LossSettings.of(cfg.algo)
    updates = []
    for i in range(cfg.algo.num_iterations):  # as grpo_step runs them
        rollout, update = grpo.policy_update(run, rollout, optimizer, scheduler, guard, loss,
                                             SkippedUpdates(5), iteration=i)
        updates.append(update)
        logp = seen["logp"]
        ratio = torch.exp(logp - logp0)
        adv = rollout.advantages.double().unsqueeze(1).expand_as(mask)
        unclipped = ~(((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0)))
        d = logp0 - logp
        assert_turn_figures(update, trajectories, mask, advantage=adv, ratio=ratio,
                            clip_fraction=(~unclipped).double(), kl=torch.expm1(d) - d)
        if not fused:  # the loss's gradient per token: 0 on the tool turns, the rest by hand
            token_grad = token_gradient(seen["token_grads"], mask.shape)
            seen["token_grads"].clear()
            assert torch.all(token_grad[tool] == 0)
            assert torch.all(token_grad[mask == 0] == 0)
            expected = (-adv * ratio * unclipped + beta * (1 - torch.exp(d))) / policy_tokens
            on = mask > 0
            torch.testing.assert_close(token_grad[on], expected[on], rtol=1e-8, atol=1e-14)
            if i == 0:  # ratio 1, no KL yet: every policy token, before or after the tool turn,
                # gets -A / N, its trajectory's advantage
                torch.testing.assert_close(token_grad[on], (-adv / policy_tokens)[on],
                                           rtol=1e-8, atol=1e-14)
    # the first update kept the old log-probs (0 on the tool turns: out of its forward), the
    # starting model's on the policy's tokens
    torch.testing.assert_close(rollout.old_logp[mask > 0].double(), logp0[mask > 0],
                               rtol=0, atol=1e-12)
    assert updates[0]["clip_fraction"] == 0.0 and 0 < updates[1]["clip_fraction"] < 1
    assert updates[1]["kl"] > 0
    for trained, expected in zip(seen["trained"], seen["expected"], strict=True):
        assert any(g.abs().sum() > 0 for g in trained)
        for got, want in zip(trained, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-13)

    # the tool turns' old and reference log-probs, whatever they are, change nothing
    assert_unchanged_by_tool_logprobs(run, rollout, tool, loss, params)
