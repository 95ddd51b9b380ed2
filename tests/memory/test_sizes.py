"""ChunkSizes: the sizes in use, halved by the guard, continued by a resume unless the ask changed."""

from __future__ import annotations

from r1fit.memory.sizes import ChunkSizes


def test_halve_stops_at_one():
    sizes = ChunkSizes(3, 8, asked={"micro_batch": 3, "generation_batch": 8})
    assert sizes.halve("micro_batch") == (3, 1)
    assert sizes.halve("micro_batch") == (1, 1)
    assert sizes.halve("generation_batch") == (8, 4)
    assert (sizes.micro_batch, sizes.generation_batch) == (1, 4)


def test_a_resume_continues_with_the_sizes_in_use():
    asked = {"micro_batch": 8, "generation_batch": "auto"}
    before = ChunkSizes(8, 32, asked)
    before.halve("micro_batch")
    after = ChunkSizes(8, 32, asked)  # what the same config resolves to at start-up
    after.load_state_dict(before.state_dict())
    assert (after.micro_batch, after.generation_batch) == (4, 32)


def test_a_resume_that_asks_for_other_sizes_takes_them():
    before = ChunkSizes(8, 32, {"micro_batch": 8, "generation_batch": 32})
    before.halve("micro_batch")
    after = ChunkSizes(2, 32, {"micro_batch": 2, "generation_batch": 32})
    after.load_state_dict(before.state_dict())
    assert (after.micro_batch, after.generation_batch) == (2, 32)


def test_packed_tokens_are_saved_and_continued():
    asked = {"micro_batch": 8, "generation_batch": 32, "micro_batch_tokens": 4096}
    before = ChunkSizes(8, 32, asked, micro_batch_tokens=4096)
    assert before.training_key == "micro_batch_tokens"
    assert before.halve("micro_batch_tokens") == (4096, 2048)
    after = ChunkSizes(8, 32, asked, micro_batch_tokens=4096)
    after.load_state_dict(before.state_dict())
    assert after.micro_batch_tokens == 2048
    # a checkpoint from before micro_batch_tokens existed has no such entry: rows, as it ran
    rows = ChunkSizes(8, 32, {"micro_batch": 8, "generation_batch": 32})
    state = rows.state_dict()
    del state["micro_batch_tokens"]
    rows.load_state_dict(state)
    assert rows.micro_batch_tokens is None and rows.training_key == "micro_batch"
