"""The static engine's CUDA-graph path (``_replay``: a warm-up step whose effects are undone, a
capture per batch-size bucket, a replay per token) on CPU, against a CUDA graph emulated with a
dispatch mode: capturing records the step's aten operations and runs none of them (their writes
are undone), replaying runs the recorded operations again on the recorded tensors, with the
Python values they were captured with. So a step that bakes a host value into its graph (a
prompt width, a seed, a row count) gives stale tokens here as it would on a GPU. The engine with
emulated graphs gives the eager engine's tokens: greedy on every built-in family over calls of
other prompt widths and batch sizes, compaction to smaller buckets, sampling, the shared-prompt
layout and a kept multi-turn cache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from r1fit.rollout.generate import SamplingSettings, TokenIds, row_seeds
from r1fit.rollout.static_engine import StaticDecoder

from .test_static_engine import CPU, FAMILIES, _grown, _same, setup


def _written(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors an aten operation writes (its schema's mutable arguments)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        yield from (t for t in tree_leaves(value) if isinstance(t, torch.Tensor))


class Capture(TorchDispatchMode):
    """Records the aten operations run under it, and undoes their writes at :meth:`undo` (a
    capture launches no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.saved.extend((t, t.clone()) for t in _written(func, args, kwargs))
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def undo(self) -> None:
        for tensor, before in reversed(self.saved):
            tensor.copy_(before)
        self.saved.clear()


class EmulatedGraph:
    """``torch.cuda.CUDAGraph`` on CPU: :meth:`replay` runs the captured operations again on the
    same tensors (a view stays the view it was; an operation that writes its arguments writes
    them again; any other's result is copied into the tensor it returned at capture, which the
    later operations read)."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            if func.is_view:
                continue
            result = func(*args, **kwargs)
            if func._schema.is_mutable:
                continue
            for kept, new in zip(tree_leaves(out), tree_leaves(result), strict=True):
                if isinstance(kept, torch.Tensor):
                    kept.copy_(new)


class _Stream:
    made = 0  # streams the engine made (a test resets it)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _Stream.made += 1

    def wait_stream(self, other: Any) -> None:
        pass


@contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    yield


@contextmanager
def _capture(graph: EmulatedGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
    recorder = Capture()
    with recorder:
        yield
    recorder.undo()
    graph.ops = recorder.ops


@pytest.fixture
def emulated_cuda(monkeypatch):
    """The torch.cuda calls of the engine's ``_replay``, on CPU, with emulated graphs."""
    current = _Stream()
    _Stream.made = 0
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", _on_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", EmulatedGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)


def test_the_emulated_graph_has_a_cuda_graphs_semantics(emulated_cuda):
    """Capturing runs nothing; a replay reads the inputs' new values, the Python values captured,
    and writes again where the capture wrote."""
    x, y, count = torch.ones(3), torch.zeros(3), torch.zeros(1)
    k = 2.0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(x * k + 1)
        count.add_(1)
    assert torch.equal(y, torch.zeros(3)) and count.item() == 0  # nothing ran
    x.fill_(5.0)
    k = 3.0  # a host value: the graph keeps 2.0
    graph.replay()
    graph.replay()
    assert torch.equal(y, torch.full((3,), 11.0)) and count.item() == 2
    assert k == 3.0


def same_state(graphs: StaticDecoder, eager: StaticDecoder) -> bool:
    """The two engines' caches, masks, positions and outputs after a call hold the same values
    (the attention of a replayed step reads every column, the eager step's only the columns
    written: their sums may round apart)."""
    pairs = [*zip(graphs.keys, eager.keys), *zip(graphs.values, eager.values),
             (graphs.out, eager.out), (graphs.mask, eager.mask), (graphs.positions, eager.positions)]
    return all(a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
               for a, b in pairs)


def graphed(model: Any, ids: TokenIds, **kwargs: Any) -> StaticDecoder:
    """The engine on CPU taking its CUDA-graph path (the emulated one)."""
    engine = StaticDecoder(model, ids, CPU, graphs=False, compile=False, **kwargs)
    engine.graphs = True
    return engine


@pytest.mark.parametrize("family", FAMILIES)
def test_replayed_graphs_give_the_eager_tokens(family, emulated_cuda, builtin_folder, tiny_dir):
    """Greedy, two calls (other prompts and widths, another batch size: the graphs of the first
    are replayed where the bucket is the same), and a third where rows end early and the rest
    move to smaller buckets, each captured once."""
    folder = tiny_dir if family == "tiny" else builtin_folder(family)
    model, ids, rows = setup(folder)
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    engine, eager = (graphed(model, ids, sync_every=2),
                     StaticDecoder(model, ids, CPU, sync_every=2))
    for call in (rows, rows[3:7], rows[:4]):
        want = eager.generate(call, seeds=None, batch_size=4, settings=settings)
        got = engine.generate(call, seeds=None, batch_size=4, settings=settings)
        assert _same(got, want), [(a.tolist(), b.tolist()) for a, b in zip(got, want)]
        assert same_state(engine, eager)
    assert engine.captures >= 1 and all(g.replays > 1 for g in engine._graphs.values())
    # rows that end at differing steps (their limits): the rows left move to smaller buckets
    limits = [12, 3, 5, 2, 12, 2, 3, 4]
    want = eager.generate(rows, seeds=None, batch_size=8, settings=settings, limits=limits)
    assert [len(c) for c in want] == limits
    compacting = graphed(model, ids, sync_every=2)
    got = compacting.generate(rows, seeds=None, batch_size=8, settings=settings, limits=limits)
    assert _same(got, want) and same_state(compacting, eager)
    assert sorted(rows for _, rows, _ in compacting._graphs) == [2, 4, 8]
    # one row left running: it decodes in a bucket of 2 (no 1-row bucket for torch.compile to
    # specialise), the same tokens
    alone = [12] + [2] * 7
    want = eager.generate(rows, seeds=None, batch_size=8, settings=settings, limits=alone)
    got = compacting.generate(rows, seeds=None, batch_size=8, settings=settings, limits=alone)
    assert _same(got, want) and [len(c) for c in got] == alone
    assert sorted(rows for _, rows, _ in compacting._graphs) == [2, 4, 8]


def test_greedy_and_sampled_calls_keep_their_own_graphs(emulated_cuda, tiny):
    """An evaluation's greedy calls between a rollout's sampled ones recapture nothing: each
    setting's graphs stay (they share the pool), and every capture warms up on one stream (a
    new stream per capture would leave a cuBLAS workspace behind each). Moving a buffer (as an
    assignment of a rotary table would) drops them."""
    model, ids, rows = tiny
    sampled = SamplingSettings(max_new_tokens=6, temperature=1.0, top_p=1.0)
    greedy = SamplingSettings(max_new_tokens=6, greedy=True)
    engine, eager = graphed(model, ids), StaticDecoder(model, ids, CPU)
    for step, settings in enumerate((sampled, greedy, sampled, greedy)):
        seeds = None if settings.greedy else row_seeds(3, step, 0, len(rows))
        want = eager.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
        got = engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
        assert _same(got, want), step
    assert engine.captures == len(engine._graphs) == 2 and _Stream.made == 1
    name, buffer = next((n, b) for n, b in model.named_buffers())
    owner = model.get_submodule(name.rpartition(".")[0])
    owner.register_buffer(name.rpartition(".")[2], buffer.clone(), persistent=False)
    engine.generate(rows, seeds=None, batch_size=len(rows), settings=greedy)
    assert engine.captures == 3 and len(engine._graphs) == 1


@pytest.mark.parametrize("share_prompt", [False, True], ids=["rows", "shared-prompts"])
def test_replayed_graphs_sample_the_eager_tokens(share_prompt, emulated_cuda, tiny):
    """Sampling (temperature, top-p, min_new_tokens) with other seeds in each call: the seeds
    and the step counter are read on the device, so the replays draw each row's own tokens."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=10, temperature=1.3, top_p=0.9, min_new_tokens=4)
    engine = graphed(model, ids, share_prompt=share_prompt, prompt_places=2)
    eager = StaticDecoder(model, ids, CPU, share_prompt=share_prompt, prompt_places=2)
    for step in (1, 2):
        seeds = row_seeds(11, step, 0, len(rows))
        want = eager.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
        got = engine.generate(rows, seeds=seeds, batch_size=len(rows), settings=settings)
        assert _same(got, want) and same_state(engine, eager), step
    assert engine.share_prompt is share_prompt and engine.captures >= 1


def test_replayed_graphs_continue_a_kept_cache(emulated_cuda, tiny):
    """Multi-turn: a second turn appended to the kept cache (its context ends at another
    column) decodes on the first turn's graphs the eager engine's tokens."""
    model, ids, rows = tiny
    settings = SamplingSettings(max_new_tokens=12, greedy=True)
    runs = []
    engines = graphed(model, ids, sync_every=4), StaticDecoder(model, ids, CPU, sync_every=4)
    for engine in engines:
        first = engine.generate(rows, seeds=None, batch_size=len(rows), settings=settings,
                                keep=True, room=48)
        previous = [0, 3, 5, 6]
        contexts = _grown([rows[i] for i in previous], [first[i] for i in previous], [7, 8, 9])
        second = engine.generate(contexts, seeds=None, batch_size=len(rows), settings=settings,
                                 previous=previous)
        assert engine.appended == 1
        runs.append((first, second))
    assert _same(runs[0][0], runs[1][0]) and _same(runs[0][1], runs[1][1])
    assert same_state(*engines)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return setup(tiny_dir)
