"""Dynamic sampling on hand-computed numbers: which groups are informative, which a step keeps,
and the record it trains on, in one process and split over two (simulated) processes."""

from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest
import torch

from r1fit.algorithms.advantages import get_advantage_estimator
from r1fit.data.batch import Prompt
from r1fit.data.sample import Sample
from r1fit.processes import World
from r1fit.rollout import dynamic
from r1fit.rollout.dynamic import StepDraws, even_groups, informative_groups, keep_groups
from r1fit.rollout.record import Rollout

DR_GRPO = get_advantage_estimator("dr_grpo")  # reward minus group mean: easy to work out


def prompt(name: str) -> Prompt:
    return Prompt(torch.tensor([1]), {}, {}, Sample([], name, "a", name))


def names(rollout: Rollout) -> list[str]:
    return [p.sample.problem for p in rollout.prompts]


def test_informative_groups_by_hand_and_against_a_loop():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.2])
    assert informative_groups(rewards, 2) == [1, 3]
    assert informative_groups(rewards, 4) == [0, 1]
    assert informative_groups(torch.zeros(6), 3) == []
    rng = random.Random(0)
    for _ in range(50):  # the obvious loop: a group is informative when it has two rewards
        g = rng.randint(2, 5)
        values = [float(rng.choice([0, 0.5, 1])) for _ in range(g * rng.randint(1, 6))]
        slow = [i for i in range(len(values) // g) if len(set(values[i * g:(i + 1) * g])) > 1]
        assert informative_groups(torch.tensor(values), g) == slow


def test_keep_groups_takes_the_first_and_rounds_down_to_an_even_split():
    assert keep_groups([1, 3, 4, 6, 7], 3) == [1, 3, 4]           # surplus dropped from the end
    assert keep_groups([1, 3, 4, 6, 7], 8) == [1, 3, 4, 6, 7]     # fewer: all of them
    assert keep_groups([1, 3, 4, 6, 7], 8, multiple=2) == [1, 3, 4, 6]
    assert keep_groups([5], 4, multiple=2) == []
    assert keep_groups([], 4) == []
    # G=3 rows per group over 2 processes: groups come in pairs; G=4 over 2: any count splits
    assert [even_groups(g, w) for g, w in [(3, 2), (4, 2), (2, 4), (6, 4), (8, 1), (5, 3)]] == \
        [2, 1, 2, 2, 1, 3]


def scored(step: int, prompts: list[Prompt], rewards: list[float], lengths: list[int], *,
           row_offset: int = 0, share: slice | None = None) -> Rollout:
    """A generated and scored batch (G=2): completion i has ``lengths[i]`` tokens, all equal to
    its row number in the step (so a test can tell the rows apart after the re-split)."""
    rows = len(prompts) * 2
    share = share or slice(0, rows)
    return Rollout(step, prompts, 2, share, row_offset=row_offset,
                   completions=[torch.full((lengths[r],), row_offset + r)
                                for r in range(rows)][share],
                   rewards=torch.tensor(rewards), components={"accuracy": torch.tensor(rewards)},
                   correct=list(rewards), advantages=DR_GRPO(torch.tensor(rewards), 2)[share])


BATCHES = [  # (prompts, rewards, completion lengths) of a step's two batches, G=2
    (["p0", "p1"], [1.0, 1.0, 0.0, 1.0], [3, 4, 5, 6]),  # p0 all correct, p1 informative
    (["p2", "p3"], [0.0, 0.0, 1.0, 0.0], [2, 2, 7, 1]),  # p2 all wrong, p3 informative
]


def draw_all(draws: StepDraws) -> None:
    for names_, rewards, lengths in BATCHES:
        draws.add(scored(1, [prompt(n) for n in names_], rewards, lengths, row_offset=draws.rows))


def test_a_step_keeps_the_informative_groups_of_its_batches():
    draws = StepDraws(1, 2, only_informative=True)
    names_, rewards, lengths = BATCHES[0]
    draws.add(scored(1, [prompt(n) for n in names_], rewards, lengths))
    assert draws.usable() == [1] and not draws.done(2, 4)
    assert draws.done(2, 1)  # max_resample_batches=1: stop with what there is
    names_, rewards, lengths = BATCHES[1]
    draws.add(scored(1, [prompt(n) for n in names_], rewards, lengths, row_offset=draws.rows))
    assert (draws.rows, draws.batches, draws.usable()) == (8, 2, [1, 3])
    assert draws.done(2, 4)

    kept = draws.kept(2, DR_GRPO)
    assert names(kept) == ["p1", "p3"] and kept.share == slice(0, 4)
    assert [c.tolist() for c in kept.completions] == [[2] * 5, [3] * 6, [6] * 7, [7]]
    assert kept.total_tokens == 5 + 6 + 7 + 1 and kept.total_rows == 4
    assert kept.rewards.tolist() == [0.0, 1.0, 1.0, 0.0] == kept.correct
    assert kept.components["accuracy"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert kept.advantages.tolist() == [-0.5, 0.5, 0.5, -0.5]  # group means 0.5
    assert draws.kept(1, DR_GRPO).prompts == kept.prompts[:1]  # a surplus: the first kept

    # the rollout figures: every row drawn, 2 of 4 groups with zero variance
    drawn = draws.drawn(kept, DR_GRPO)
    assert names(drawn) == ["p0", "p1", "p2", "p3"] and len(drawn.completions) == 8
    assert drawn.total_tokens == 30
    assert drawn.rewards.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert drawn.advantages.tolist() == [0.0, 0.0, -0.5, 0.5, 0.0, 0.0, 0.5, -0.5]


def test_nothing_informative_keeps_nothing():
    draws = StepDraws(1, 2, only_informative=True)
    draws.add(scored(1, [prompt("p0"), prompt("p2")], [1.0, 1.0, 0.0, 0.0], [1, 2, 3, 4]))
    assert draws.usable() == [] and draws.kept(2, DR_GRPO) is None
    kept_nothing = draws.drawn(None, DR_GRPO)
    assert names(kept_nothing) == ["p0", "p2"] and kept_nothing.engine_logp_diff is None


def test_without_dynamic_sampling_the_first_batch_is_the_step():
    draws = StepDraws(1, 2, only_informative=False)
    names_, rewards, lengths = BATCHES[1]  # one group has zero variance: kept all the same
    batch = scored(1, [prompt(n) for n in names_], rewards, lengths)
    draws.add(batch)
    assert draws.done(2, 4)
    kept = draws.kept(2, DR_GRPO)
    assert kept.prompts == batch.prompts and kept.share == batch.share
    assert [c.tolist() for c in kept.completions] == [c.tolist() for c in batch.completions]
    assert torch.equal(kept.rewards, batch.rewards)
    assert torch.equal(kept.advantages, batch.advantages)
    assert kept.total_tokens == sum(lengths)
    assert draws.drawn(kept, DR_GRPO) is kept  # it kept every row


def test_engine_logprobs_follow_their_rows():
    draws = StepDraws(1, 2, only_informative=True)
    for names_, rewards, lengths in BATCHES:
        batch = scored(1, [prompt(n) for n in names_], rewards, lengths, row_offset=draws.rows)
        width = max(lengths)
        # engine log-prob of row r, token t: -(r + t / 10), zero-padded to the batch's width
        batch = replace(batch, engine_logp=torch.tensor(
            [[-(batch.row_offset + r + t / 10) if t < n else 0.0 for t in range(width)]
             for r, n in enumerate(lengths)]))
        draws.add(batch)
    kept = draws.kept(2, DR_GRPO)
    assert kept.engine_logp.shape == (4, 7)  # the longest kept completion
    expected = [[-(row + t / 10) for t in range(n)] for row, n in [(2, 5), (3, 6), (6, 7), (7, 1)]]
    for got, want in zip(kept.engine_logp.tolist(), expected):
        assert got[:len(want)] == pytest.approx(want) and not any(got[len(want):])
    kept = replace(kept, engine_logp_diff=0.25)  # as the update's record carries it
    assert draws.drawn(kept, DR_GRPO).engine_logp_diff == 0.25


def test_two_processes_train_an_even_share_of_the_kept_rows(monkeypatch):
    """Each rank generates half of each batch (rank 0 groups p0 and p2, rank 1 p1 and p3), so
    rank 1 generated both kept groups; after the re-split rank 0 trains p1's rows, rank 1 p3's."""
    # rank r's local rows of each batch, gathered by the (simulated) all_gather_objects
    ranks = [World(rank=r, size=2) for r in range(2)]
    local = {r: [scored(1, [prompt(n) for n in ns], rw, ln, row_offset=4 * b,
                        share=ranks[r].share(4))
                 for b, (ns, rw, ln) in enumerate(BATCHES)] for r in range(2)}

    def gather(mine):
        batch = next(b for b in range(2) for r in range(2)
                     if local[r][b].completions[0] is mine[0][0])
        return [[(c, None, None) for c in local[r][batch].completions] for r in range(2)]

    whole = StepDraws(1, 2, only_informative=True)  # one process: the reference
    draw_all(whole)
    single = whole.kept(2, DR_GRPO)
    monkeypatch.setattr(dynamic, "all_gather_objects", gather)
    trained = []
    for r in range(2):
        monkeypatch.setattr(dynamic, "world", lambda r=r: ranks[r])
        draws = StepDraws(1, 2, only_informative=True)
        for batch in local[r]:
            draws.add(batch)
        kept = draws.kept(2, DR_GRPO)
        assert names(kept) == ["p1", "p3"] and kept.share == ranks[r].share(4)
        assert torch.equal(kept.rewards, single.rewards)  # every rank: whole groups
        assert kept.total_tokens == single.total_tokens
        assert torch.equal(kept.advantages, single.advantages[kept.share])
        trained.append([c.tolist() for c in kept.completions])
    # rank 0 trains p1's rows (2, 3: generated by rank 1), rank 1 those of p3 (6, 7: rank 1 too)
    assert trained == [[[2] * 5, [3] * 6], [[6] * 7, [7]]]
    assert trained[0] + trained[1] == [c.tolist() for c in single.completions]


def test_trajectories_travel_without_their_prompts(monkeypatch):
    """With tools, a batch's trajectories are gathered from every process: their prompts (the
    row's encoded and source images, which every process holds) stay behind and are put back
    from the batch's own, row r on prompt r // G."""
    from PIL import Image

    from r1fit.rollout.record import Trajectory

    sent = []

    def gather(mine):  # one process, the payload pickled as all_gather_object does
        sent.append(pickle.dumps(mine))
        return [pickle.loads(sent[-1])]

    monkeypatch.setattr(dynamic, "all_gather_objects", gather)
    source = Image.new("RGB", (896, 896), "white")  # 2.4 MB of pixels
    prompts = [Prompt(torch.tensor([1]), {}, {}, Sample([source], n, "a", n)) for n in ("p0", "p1")]
    rows = [p for p in prompts for _ in range(2)]
    batch = replace(scored(1, prompts, [1.0, 0.0, 0.0, 1.0], [1, 1, 1, 1]),
                    trajectories=[Trajectory(p, token_ids=torch.tensor([r]))
                                  for r, p in enumerate(rows)])
    draws = StepDraws(1, 2, only_informative=True)
    draws.add(batch)
    assert len(sent[0]) < 20_000  # with the prompts: over 2.4 MB
    assert all(t.prompt is p for t, p in zip(draws.trajectories, rows, strict=True))
    assert [t.token_ids.tolist() for t in draws.trajectories] == [[0], [1], [2], [3]]
    assert all(t.prompt is not None for t in batch.trajectories)  # the batch's own are untouched
