"""The rollout record: this process's rows of a step's prompts x G."""

from __future__ import annotations

import torch

from r1fit.data.batch import Prompt
from r1fit.data.sample import Sample
from r1fit.rollout.record import Rollout


def _prompt(name: str) -> Prompt:
    return Prompt(torch.tensor([1]), {}, {}, Sample([], name, "a", name))


def test_rows_are_group_contiguous_and_cut_to_the_share():
    prompts = [_prompt("p0"), _prompt("p1"), _prompt("p2")]
    whole = Rollout(1, prompts, 2, slice(0, 6))
    assert [p.sample.problem for p in whole.rows] == ["p0", "p0", "p1", "p1", "p2", "p2"]
    second_half = Rollout(1, prompts, 2, slice(3, 6))  # rank 1 of 2
    assert [p.sample.problem for p in second_half.rows] == ["p1", "p2", "p2"]
    assert (second_half.total_rows, second_half.first_row) == (6, 3)


def test_a_later_batch_of_a_step_numbers_its_rows_after_the_earlier_ones():
    prompts = [_prompt("p0"), _prompt("p1")]
    later = Rollout(1, prompts, 2, slice(2, 4), row_offset=8)  # rank 1 of 2, third batch of 4 rows
    assert (later.first_row, [p.sample.problem for p in later.rows]) == (10, ["p1", "p1"])
