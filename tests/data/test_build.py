"""BadRowCounter.fetch: bad rows are skipped and counted; when nothing good comes, the one-line
error says why (prompts longer than data.max_prompt_tokens: how long; several causes: how many
of each)."""

from __future__ import annotations

import copy
import itertools
import pickle
from types import SimpleNamespace

import pytest

from r1fit.data.batch import TooLong
from r1fit.data.build import FETCH_TRIES, BadRowCounter
from r1fit.data.errors import DataError


def _fetch(k: int, refuse):
    """Fetch ``k`` rows from an endless stream whose row ``i`` ``refuse(i)`` judges: None (good),
    an int (a prompt of that many tokens, more than the limit of 10) or a str (a row that fails
    to load with that message). Returns (prompts or the DataError, the counter)."""
    stream = itertools.count()
    sampler = SimpleNamespace(next_batch=lambda n: [next(stream) for _ in range(n)])

    def load_each(indices):
        return [f"rows.jsonl:{i + 1}: {refuse(i)}" if isinstance(refuse(i), str) else i
                for i in indices]

    dataset = SimpleNamespace(name="rows.jsonl", fetch_each=load_each)

    def encode(samples):
        return ([s for s in samples if refuse(s) is None],
                [TooLong(f"rows.jsonl:{s + 1}", refuse(s), 10) for s in samples
                 if isinstance(refuse(s), int)])

    counter = BadRowCounter()
    try:
        return counter.fetch(dataset, sampler, k, encode), counter
    except DataError as exc:
        return exc, counter


def test_a_too_long_refusal_is_the_message_it_always_was_and_survives_copies():
    refusal = TooLong("train.jsonl:7", 55, 10)
    assert refusal == "train.jsonl:7: the prompt has 55 tokens, more than data.max_prompt_tokens=10"
    for again in (copy.copy(refusal), pickle.loads(pickle.dumps(refusal))):
        assert (again, again.length, again.limit) == (refusal, 55, 10)


def test_bad_rows_are_skipped_and_counted_until_k_good_ones():
    prompts, counter = _fetch(4, lambda i: 40 + i if i % 3 == 0 else None)
    assert prompts == [1, 2, 4, 5] and counter.count == 2


def test_every_prompt_longer_than_max_prompt_tokens_says_how_long_and_what_to_set():
    error, counter = _fetch(2, lambda i: 50 + i % 7)
    assert isinstance(error, DataError)
    assert counter.count == 2 * FETCH_TRIES
    assert str(error) == (
        f"rows.jsonl: could not fetch 2 good rows in {FETCH_TRIES} tries; all {2 * FETCH_TRIES} "
        "rows drawn have a prompt longer than data.max_prompt_tokens=10 (50 to 56 tokens): raise "
        "data.max_prompt_tokens to at least 56 (within the model's context) or shorten the "
        "prompts (a lower data.max_pixels gives an image fewer tokens)")


def test_mixed_refusals_are_counted_per_cause():
    error, _ = _fetch(2, lambda i: 30 if i % 4 == 0 else "cannot decode image red.png")
    assert isinstance(error, DataError)
    assert str(error) == (
        f"rows.jsonl: could not fetch 2 good rows in {FETCH_TRIES} tries; of the "
        f"{2 * FETCH_TRIES} rows drawn, {FETCH_TRIES // 2} have a prompt longer than "
        "data.max_prompt_tokens=10 (30 tokens: raise it to at least 30 to keep them) and "
        f"{3 * FETCH_TRIES // 2} are bad otherwise (e.g. rows.jsonl:2: cannot decode image red.png)")


def test_rows_bad_for_other_causes_keep_their_message():
    error, _ = _fetch(3, lambda i: "cannot decode image red.png")
    assert str(error) == (f"rows.jsonl: could not fetch 3 good rows in {FETCH_TRIES} tries; the "
                          "data is mostly bad")


@pytest.mark.parametrize("k", [0, 1])
def test_nothing_is_refused_when_all_rows_are_good(k):
    prompts, counter = _fetch(k, lambda i: None)
    assert prompts == list(range(k)) and counter.count == 0


def test_rows_bad_on_one_process_only_are_skipped_by_every_process(monkeypatch):
    """Each process reads the rows itself: a row one node cannot decode (its copy of an image is
    corrupt) left the ranks on different rows, the sampler one row apart, unsaid. Now every rank
    keeps the rows all kept, counts the others' skips too, and draws again alike."""
    import r1fit.data.build as build
    from r1fit.processes import World

    stream = itertools.count()
    sampler = SimpleNamespace(next_batch=lambda n: [next(stream) for _ in range(n)])
    dataset = SimpleNamespace(name="rows.jsonl", fetch_each=lambda indices: [
        SimpleNamespace(index=i, source=f"rows.jsonl:{i + 1}") for i in indices])

    def encode(samples):
        return [SimpleNamespace(sample=s) for s in samples], []

    # rank 0 here; rank 1 could not decode the 2nd row of the first draw
    gathered = []

    def all_gather(kept):
        others = [at for at in kept if not (len(gathered) == 0 and at == 1)]
        gathered.append(kept)
        return [kept, others]

    monkeypatch.setattr(build, "world", lambda: World(rank=0, size=2))
    monkeypatch.setattr(build, "all_gather_objects", all_gather)
    counter = BadRowCounter()
    prompts = counter.fetch(dataset, sampler, 3, encode)
    assert [p.sample.index for p in prompts] == [0, 2, 3] and counter.count == 1
    assert gathered == [[0, 1, 2], [0]]  # the second draw asked one more row, on every rank
