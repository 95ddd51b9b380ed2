"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2): train on groups whose
rewards differ.

A group whose completions all got the same reward has zero advantage under every estimator with a
group baseline (all but ``reinforce_pp``, which normalises over the whole step), so it adds no
policy gradient (only the KL term's, with ``algo.beta`` > 0) while its tokens still count in the
loss normaliser, which shrinks the other groups' gradient. With
``algo.dynamic_sampling`` a step drops those groups and draws further batches of
``train.prompts_per_step`` prompts (generate + score) until it has ``prompts_per_step``
informative groups or has drawn ``algo.max_resample_batches`` batches.

What a step keeps (:func:`keep_groups`): the first ``prompts_per_step`` informative groups in the
order they were drawn, the surplus of the last batch dropped (as verl's DAPO recipe does). With
fewer it trains on those it has (under torchrun, as many as split evenly over the processes);
with none it skips its update.

Over several processes each batch is generated in shares as usual; scoring gathers its rewards, and
:meth:`StepDraws.add` gathers its completions, so every process holds every row the step drew. The
kept groups then form a new record whose rows are split evenly over the processes again: a group
may be trained on by another rank than the one that generated it, and every rank runs the same
number of forward and backward passes, as FSDP needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from r1fit.data.batch import Prompt, pad_rows
from r1fit.processes import all_gather_objects, world
from r1fit.rollout.record import Rollout, Trajectory
from r1fit.rollout.score import AdvantageFn


def informative_groups(rewards: torch.Tensor, num_generations: int) -> list[int]:
    """Indices of the groups (``num_generations`` consecutive rewards each) whose rewards are not
    all equal."""
    groups = rewards.view(-1, num_generations)
    return (groups.amax(dim=1) != groups.amin(dim=1)).nonzero().flatten().tolist()


def keep_groups(candidates: Sequence[int], target: int, *, multiple: int = 1) -> list[int]:
    """The groups a step trains on: the first ``target`` of ``candidates`` (in draw order), or, when
    there are fewer, the first ones in the largest multiple of ``multiple`` there are."""
    count = min(len(candidates), target)
    return list(candidates[:count - count % multiple])


def even_groups(num_generations: int, processes: int) -> int:
    """The smallest number of groups whose rows split evenly over ``processes``."""
    return processes // math.gcd(num_generations, processes)


class StepDraws:
    """Every row a step has drawn, whole on every process: prompts, completions (and the engine's
    log-probs), rewards and the logged accuracy, batch after batch in draw order.

    ``only_informative`` (``algo.dynamic_sampling``) makes the groups with all-equal rewards
    unusable; otherwise every group is, and the first batch is the step."""

    def __init__(self, step: int, num_generations: int, *, only_informative: bool) -> None:
        self.step, self.num_generations = step, num_generations
        self.only_informative = only_informative
        self.batches = 0
        self.prompts: list[Prompt] = []
        self.completions: list[torch.Tensor] = []
        self.engine_logp: list[torch.Tensor | None] = []
        self.trajectories: list[Trajectory] | None = None  # with tools, one per row
        self.rewards = torch.zeros(0)
        self.components: dict[str, torch.Tensor] = {}
        self.correct: list[float] = []

    @property
    def rows(self) -> int:
        """Rows drawn so far (every process's)."""
        return len(self.prompts) * self.num_generations

    def add(self, batch: Rollout) -> None:
        """Add a generated and scored batch; its completions and engine log-probs are gathered from
        every process (one collective; a no-op in one process)."""
        assert batch.rewards is not None
        engine = batch.engine_logp
        trajectories = batch.trajectories
        # a trajectory travels without its prompt (the row's encoded image and its source image,
        # which every process holds already: row r of the batch is prompt r // G's)
        mine = [(c, None if engine is None else engine[i, :c.shape[0]],
                 None if trajectories is None else replace(trajectories[i], prompt=None))
                for i, c in enumerate(batch.completions)]
        rows = [row for part in all_gather_objects(mine) for row in part]
        self.prompts += batch.prompts
        self.completions += [completion for completion, _, _ in rows]
        self.engine_logp += [logp for _, logp, _ in rows]
        if trajectories is not None:
            g = self.num_generations
            self.trajectories = (self.trajectories or []) + [
                replace(t, prompt=batch.prompts[r // g]) for r, (_, _, t) in enumerate(rows)]
        self.rewards = torch.cat([self.rewards.to(batch.rewards), batch.rewards])
        for name, values in batch.components.items():
            before = self.components.get(name, values[:0])
            self.components[name] = torch.cat([before, values])
        self.correct += batch.correct
        self.batches += 1

    def usable(self) -> list[int]:
        """The drawn groups the step may train on, in draw order."""
        if self.only_informative:
            return informative_groups(self.rewards, self.num_generations)
        return list(range(len(self.prompts)))

    def done(self, target: int, max_batches: int) -> bool:
        """Whether to stop drawing: ``target`` usable groups, or ``max_batches`` batches drawn."""
        return self.batches >= max_batches or len(self.usable()) >= target

    def kept(self, target: int, estimator: AdvantageFn) -> Rollout | None:
        """The record the step trains on (:func:`keep_groups` of the usable groups), or None when
        no group is left."""
        groups = keep_groups(self.usable(), target,
                             multiple=even_groups(self.num_generations, world().size))
        return self.rollout(groups, estimator) if groups else None

    def drawn(self, kept: Rollout | None, estimator: AdvantageFn) -> Rollout:
        """A record of every row drawn, for the step's rollout figures: ``kept`` itself when it
        kept them all, else a new one that carries ``kept``'s ``engine_logp_diff`` (measured by
        the update)."""
        if kept is not None and kept.total_rows == self.rows:
            return kept
        return replace(self.rollout(range(len(self.prompts)), estimator),
                       engine_logp_diff=None if kept is None else kept.engine_logp_diff)

    def rollout(self, groups: Sequence[int], estimator: AdvantageFn) -> Rollout:
        """A scored record of ``groups`` (indices of the drawn groups, in that order), its rows
        split evenly over the processes; its advantages are ``estimator``'s over these groups
        alone (the rewards are already shaped by scoring)."""
        g = self.num_generations
        rows = [group * g + i for group in groups for i in range(g)]
        share = world().share(len(rows), "kept rows")
        mine = rows[share]
        index = torch.tensor(rows, dtype=torch.long)
        rewards = self.rewards[index]
        engine = [self.engine_logp[r] for r in mine]
        engine_logp = (pad_rows(engine)  # type: ignore[arg-type]  # none is None
                       if engine and all(logp is not None for logp in engine) else None)
        trajectories = self.trajectories
        return Rollout(
            self.step, [self.prompts[group] for group in groups], g, share,
            completions=[self.completions[r] for r in mine],
            total_tokens=sum(int(self.completions[r].shape[0]) for r in rows)
            if trajectories is None else sum(trajectories[r].policy_tokens for r in rows),
            trajectories=None if trajectories is None else [trajectories[r] for r in mine],
            rewards=rewards,
            components={name: values[index] for name, values in self.components.items()},
            correct=[self.correct[r] for r in rows],
            advantages=estimator(rewards, g)[share], engine_logp=engine_logp)
