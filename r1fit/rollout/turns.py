"""Multi-turn rollouts with tools, on Hugging Face ``generate``: the policy generates until it
writes ``</tool_call>`` or ends, r1fit runs the calls, appends their results as a tool turn and the
policy goes on, up to the budgets (docs/tools.md). GRPO runs it through
:func:`generate_trajectories` when ``tools`` are configured; the engines give the turn function
(``hf_generate_turn`` and ``static_generate_turn`` here, the vLLM engine's ``generate_turn``).

A :class:`~r1fit.rollout.record.Trajectory` holds the token ids of the whole conversation after the prompt, the ids the
policy sampled kept as sampled (re-tokenizing decoded text need not give them back) and each tool
turn encoded on its own by the processor, its images included; ``policy_mask`` is 1 exactly on the
policy's tokens. The tool turn's text is what the chat template writes after an assistant turn's
text (the ``<|im_end|>`` that closes the policy's turn included: generation stopped at
``</tool_call>`` before the policy wrote it, so it is context), found by rendering the turn after a
marker instead of the policy's text, so a template that trims or rewrites assistant text cannot
shift it.

Each row samples from its own stream per turn (:func:`turn_seed` of the row's seed and the turn
number, the stream :class:`~r1fit.rollout.generate.SeededSampler` draws one uniform from per
position), so a trajectory does not depend on which other trajectories share its batch, nor on
when they finish; a finished trajectory leaves the batch.

After each turn the calls of every row that goes on run together on ``workers`` threads (each
row's calls in their order, each under the runner's timeout); a trajectory does not depend on
the worker count either, for tools that are deterministic given their arguments and the row and
end within their timeout. A timeout is wall time: tools that hold Python's GIL share it when
several run, each taking longer than alone, and one near its timeout may pass it (logged once).

Budgets, as the config documents them: a trajectory ends when a turn ends with an end-of-sequence
token (``eos``), runs to ``max_new_tokens`` without a complete call (``max_new_tokens``), writes a
call in its ``max_turns``-th turn (``max_turns``: that turn's calls are not run) or reaches
``max_trajectory_tokens`` (``max_trajectory_tokens``: the turn that reaches it is cut there; a tool
turn that would leave the policy no token is not appended, its calls were run). A call past
``max_tool_calls`` is not run and gets an error result, and an image result past ``max_images``
(the row's images and the tools' together) becomes an error result; the policy is told and may
still answer.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from r1fit.data.batch import Prompt, collate, cut_after_eos, pad_rows
from r1fit.models.load import unwrap
from r1fit.processes import all_sum
from r1fit.rollout.generate import (
    SamplingSettings,
    SeededSampler,
    TokenIds,
    generation_config,
    row_seeds,
)
from r1fit.rollout.record import Rollout, Trajectory, Turn
from r1fit.rollout.static_engine import StaticDecoder, Stop
from r1fit.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    MalformedCall,
    ToolCall,
    ToolContext,
    ToolResult,
    ToolRunner,
    parse_tool_calls,
)
from r1fit.tools.conversation import tool_turn_tokens

log = logging.getLogger("r1fit.rollout")

#: tokens at the end of a row decoded to look for ``</tool_call>``; more than any tokenizer
#: splits the tag into
STOP_WINDOW = 32


@dataclass(frozen=True)
class TurnBudgets:
    """How far one trajectory may grow (``rollout.max_turns``, ``rollout.max_tool_calls``,
    ``algo.max_new_tokens`` per turn, ``rollout.max_trajectory_tokens``, ``data.max_images``)."""

    max_turns: int
    max_tool_calls: int
    max_new_tokens: int
    max_images: int
    max_trajectory_tokens: int | None = None  # None: max_turns x max_new_tokens

    @classmethod
    def of(cls, cfg: Any, max_new_tokens: int) -> TurnBudgets:
        """The budgets a run's config sets (``max_new_tokens`` per turn)."""
        return cls(cfg.rollout.max_turns, cfg.rollout.max_tool_calls, max_new_tokens,
                   cfg.data.max_images, cfg.rollout.max_trajectory_tokens)

    @property
    def tokens(self) -> int:
        """Tokens after the prompt one trajectory may hold."""
        if self.max_trajectory_tokens is not None:
            return self.max_trajectory_tokens
        return self.max_turns * self.max_new_tokens


def turn_seed(seed: int, turn: int) -> int:
    """The 63-bit seed of a row's ``turn``-th turn, from the row's seed (``row_seeds``)."""
    return int(np.random.SeedSequence([seed, turn]).generate_state(1, dtype=np.uint64)[0] >> 1)


#: a row's turn: its tokens or, from an engine that gives them (vLLM), its tokens and the
#: engine's log-prob of each
TurnTokens = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class GenerateTurn(Protocol):
    """One turn of each row (:data:`TurnTokens`), generated from ``rows`` (contexts), row i up
    to ``limits[i]`` tokens, stopped after ``</tool_call>`` or its end-of-sequence token (kept);
    ``seeds`` None is greedy. ``previous``: row i continues row ``previous[i]`` of the last call (its context
    is that row's grown by its turn and a tool turn), None on a rollout's first turn. An engine
    that keeps a row's KV cache across turns reads it; the others ignore it."""

    def __call__(self, rows: Sequence[Prompt], seeds: Sequence[int] | None,
                 limits: Sequence[int], previous: Sequence[int] | None = None
                 ) -> Sequence[TurnTokens]: ...


class StopAtToolCall(StoppingCriteria):
    """Per row of a batch whose turns start at column ``start``: done once the turn's text holds
    ``</tool_call>`` (the last ``STOP_WINDOW`` tokens decoded) or the turn has ``limits[i]``
    tokens. ``stops[i]``: the turn's length where row i stopped (None while running).

    The tag's text ends with its last character, so only a token whose text holds that character
    can complete it: a step decodes just the rows whose newest token is one of those
    (:func:`closing_tokens`), found on the device with one read, not every row's tail."""

    def __init__(self, tokenizer: Any, start: int, limits: Sequence[int]) -> None:
        self.tokenizer, self.start, self.limits = tokenizer, start, list(limits)
        self.stops: list[int | None] = [None] * len(self.limits)
        self._closing: torch.Tensor | None = None  # on the batch's device, made on first use

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        n = int(input_ids.shape[1]) - self.start
        if self._closing is None:
            self._closing = closing_tokens(self.tokenizer).to(input_ids.device)
        newest = input_ids[:, -1].clamp(0, int(self._closing.shape[0]) - 1)
        maybe = set(torch.nonzero(self._closing[newest]).flatten().tolist()) if n > 0 else set()
        for i, row in enumerate(input_ids):
            if self.stops[i] is not None:
                continue
            if n >= self.limits[i]:
                self.stops[i] = n
            elif i in maybe and TOOL_CALL_CLOSE in self.tokenizer.decode(
                    row[self.start + max(0, n - STOP_WINDOW):].tolist(), skip_special_tokens=True):
                self.stops[i] = n
        return torch.tensor([s is not None for s in self.stops], device=input_ids.device)


#: the vocabulary's tokens that can complete ``</tool_call>``, per tokenizer (by id: one scan of
#: a 151,936-token vocabulary takes a fraction of a second)
_CLOSING: dict[int, tuple[Any, torch.Tensor]] = {}


def closing_tokens(tokenizer: Any) -> torch.Tensor:
    """A boolean tensor over the token ids and one more (False, for any id past the vocabulary):
    True for a token whose text, decoded alone as :class:`StopAtToolCall` decodes, holds the
    last character of ``</tool_call>``."""
    held = _CLOSING.get(id(tokenizer))
    if held is not None and held[0] is tokenizer:
        return held[1]
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
    # one more entry, False, stands for every id past the vocabulary (a model's padded rows)
    mask = torch.tensor([TOOL_CALL_CLOSE[-1] in text for text in texts] + [False],
                        dtype=torch.bool)
    _CLOSING[id(tokenizer)] = (tokenizer, mask)
    return mask


def hf_generate_turn(model: Any, tokenizer: Any, settings: SamplingSettings, ids: TokenIds,
                     device: torch.device) -> GenerateTurn:
    """One turn of all open rows as one ``generate`` call (``settings.max_new_tokens`` is
    replaced by the rows' largest limit); greedy when ``settings.greedy`` (seeds None)."""

    @torch.no_grad()
    def generate(rows: Sequence[Prompt], seeds: Sequence[int] | None,
                 limits: Sequence[int], previous: Sequence[int] | None = None
                 ) -> list[torch.Tensor]:
        gen_config = generation_config(replace(settings, max_new_tokens=max(limits)), ids)
        if not settings.min_new_tokens and \
                getattr(unwrap(model).generation_config, "min_new_tokens", None) is None:
            gen_config.min_new_tokens = None  # as generate_completions: no idle MinLength pass
        batch = collate(rows, None, ids.pad).to(device)
        stop = StopAtToolCall(tokenizer, batch.prompt_len, limits)
        processors = LogitsProcessorList()
        if seeds is not None:
            processors.append(SeededSampler(seeds, settings.temperature, settings.top_p))
        was_training = model.training
        model.eval()
        try:
            out = model.generate(**batch.inputs, generation_config=gen_config,
                                 logits_processor=processors,
                                 stopping_criteria=StoppingCriteriaList([stop]), synced_gpus=False)
        finally:
            model.train(was_training)
        new = out[:, batch.prompt_len:].cpu()
        # a row finished early is padded up to the batch's longest turn: cut where it stopped
        return [cut_after_eos(row[:stop.stops[i] if stop.stops[i] is not None else len(row)],
                              ids.eos) for i, row in enumerate(new)]

    return generate


def static_generate_turn(decoder: StaticDecoder, tokenizer: Any, settings: SamplingSettings,
                         keep_cache: bool = True, room: int | None = None) -> GenerateTurn:
    """One turn of all open rows on the static engine (``settings.max_new_tokens`` replaced by
    the rows' largest limit), each row stopped as :class:`StopAtToolCall` stops it.
    ``keep_cache``: each row's KV cache is kept after its turn and the next turn prefills only
    what the turn added (``StaticDecoder.generate``'s ``keep``/``previous``); else every turn
    prefills its rows' whole contexts. ``room``: the tokens a trajectory may hold after its
    prompt (``TurnBudgets.tokens``), the cache's columns after the prompts on a first turn."""
    stop = Stop(TOOL_CALL_CLOSE, tokenizer, STOP_WINDOW)

    def generate(rows: Sequence[Prompt], seeds: Sequence[int] | None,
                 limits: Sequence[int], previous: Sequence[int] | None = None
                 ) -> list[torch.Tensor]:
        return decoder.generate(rows, seeds=seeds, batch_size=max(len(rows), 1),
                                settings=replace(settings, max_new_tokens=max(limits)),
                                limits=limits, stop=stop, keep=keep_cache,
                                previous=previous if keep_cache else None,
                                room=room if previous is None else None)

    return generate


def _ending(tokens: torch.Tensor, text: str, eos: Sequence[int]) -> str:
    if tokens.numel() and int(tokens[-1]) in eos:
        return "eos"
    return "tool_call" if TOOL_CALL_CLOSE in text else "length"


def _answer(trajectory: Trajectory, calls: Sequence[ToolCall | MalformedCall],
            runner: ToolRunner, context: ToolContext, budgets: TurnBudgets,
            stop: threading.Event | None = None) -> list[ToolResult]:
    """The results of one turn's calls: run while the call budget lasts, an error result past it;
    an image result past the image budget becomes an error result. Once ``stop`` is set (the
    rollout was interrupted) no further call starts: the results are partial, and unused."""
    results = []
    held = len(trajectory.prompt.sample.images) + len(trajectory.images)
    for call in calls:
        if stop is not None and stop.is_set():
            break
        name = call.name if isinstance(call, ToolCall) else ""
        if trajectory.calls_run >= budgets.max_tool_calls:
            results.append(ToolResult.failure(name, f"not run: the trajectory's "
                                                    f"{budgets.max_tool_calls} tool calls "
                                                    "(rollout.max_tool_calls) are spent"))
            continue
        trajectory.calls_run += 1
        result = runner.run(call, context)
        shown = sum(isinstance(part, Image.Image) for part in result.parts)
        if held + shown > budgets.max_images:
            result = ToolResult.failure(name, f"returned {shown} image(s), more than the "
                                              f"trajectory's {budgets.max_images} images "
                                              f"(data.max_images, {held} held) allow")
        else:
            held += shown
        results.append(result)
    return results


def tool_context(prompt: Prompt) -> ToolContext:
    """What the tools see of a row: its images at source resolution when the dataset kept them
    (``Sample.source_images``, kept when ``tools`` are configured), else the prompt's."""
    sample = prompt.sample
    return ToolContext(tuple(sample.source_images or sample.images), sample.source)


def run_trajectories(generate_turn: GenerateTurn, processor: Any, prompts: Sequence[Prompt],
                     seeds: Sequence[int] | None, runner: ToolRunner, budgets: TurnBudgets, *,
                     eos: Sequence[int], contexts: Sequence[ToolContext] | None = None,
                     workers: int = 1) -> list[Trajectory]:
    """One trajectory per prompt, in order. ``seeds``: one per row (``row_seeds``), None for
    greedy; ``eos``: the end-of-sequence ids; ``contexts``: what the tools see of each row
    (default: :func:`tool_context`); ``workers``: rows whose tool calls run at once after each
    turn (each row's calls in order; 1: one call at a time). The calls' wall seconds are added to
    ``runner.stats.seconds``."""
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts, {len(seeds)} seeds")
    if contexts is None:
        contexts = [tool_context(p) for p in prompts]
    trajectories = [Trajectory(prompt) for prompt in prompts]
    open_rows = list(range(len(prompts)))
    previous: list[int] | None = None  # each open row's place among the last turn's rows
    with _RowCalls(workers) as row_calls:
        while open_rows:
            limits = [min(budgets.max_new_tokens, budgets.tokens - trajectories[i].length)
                      for i in open_rows]
            turn_seeds = None if seeds is None else \
                [turn_seed(seeds[i], trajectories[i].num_turns) for i in open_rows]
            turns = generate_turn([trajectories[i].context() for i in open_rows], turn_seeds,
                                  limits, previous)
            calling: list[tuple[int, Turn]] = []  # the rows that go on, with their turn
            for i, turn in zip(open_rows, turns, strict=True):
                tokens, logp = turn if isinstance(turn, tuple) else (turn, None)
                held = _policy_turn(trajectories[i], tokens, logp, processor, budgets, eos)
                if held is not None:
                    calling.append((i, held))
            start, timeouts = time.perf_counter(), _timeouts(runner)
            answers = row_calls.map(lambda row: _answer(
                trajectories[row[0]], row[1].calls, runner, contexts[row[0]], budgets,
                row_calls.stop), calling)
            runner.stats.seconds += time.perf_counter() - start
            if workers > 1 and _timeouts(runner) > timeouts:
                _warn_concurrent_timeouts(runner, workers)
            still_open = [i for (i, turn), results in zip(calling, answers, strict=True)
                          if _tool_turn(trajectories[i], turn, results, processor, budgets)]
            place = {i: k for k, i in enumerate(open_rows)}
            previous = [place[i] for i in still_open]
            open_rows = still_open
    return trajectories


class _RowCalls:
    """A turn's tool calls of its rows, ``workers`` rows at once on threads (each row's calls in
    order; one worker: here, one after another). When the rollout is interrupted (an exception
    here, KeyboardInterrupt included) no further call starts and the calls running are not
    waited for: each ends within its timeout, its result unused."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.stop = threading.Event()
        self.pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> _RowCalls:
        if self.workers > 1:
            self.pool = ThreadPoolExecutor(max_workers=self.workers,
                                           thread_name_prefix="r1fit-tool-rows")
        return self

    def __exit__(self, kind: Any, *rest: Any) -> None:
        if kind is not None:
            self.stop.set()
        if self.pool is not None:
            self.pool.shutdown(wait=kind is None, cancel_futures=kind is not None)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``fn`` of each item, in order (a worker's exception is raised here)."""
        if self.pool is None or len(items) < 2:
            return [fn(item) for item in items]

        def guarded(item: Any) -> Any:
            try:
                return fn(item)
            except BaseException:
                self.stop.set()  # before this thread takes the next row
                raise

        futures = [self.pool.submit(guarded, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            self.stop.set()
            for future in futures:
                future.cancel()
            raise


def _timeouts(runner: ToolRunner) -> int:
    return sum(counts.timeouts for counts in runner.stats.tools.values())


#: runners already warned that their calls time out while several run at once
_WARNED: weakref.WeakSet[ToolRunner] = weakref.WeakSet()


def _warn_concurrent_timeouts(runner: ToolRunner, workers: int) -> None:
    """Once per runner: calls timed out while ``workers`` rows ran theirs at once."""
    if runner in _WARNED:
        return
    _WARNED.add(runner)
    log.warning("tool calls timed out (rollout.tool_timeout %g s) while %d rows ran theirs at "
                "once (rollout.tool_workers): tools that hold Python's GIL share it, each taking "
                "longer than alone; with rollout.tool_workers=1 they run one after another",
                runner.timeout, workers)


def _policy_turn(trajectory: Trajectory, tokens: torch.Tensor, logp: torch.Tensor | None,
                 processor: Any, budgets: TurnBudgets, eos: Sequence[int]) -> Turn | None:
    """Append one policy turn (``logp``: the engine's log-probs of its tokens, if any): its
    :class:`Turn`, calls parsed, when the trajectory goes on to run them; None when it ended
    (``trajectory.ended`` says why)."""
    text = processor.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    ending = _ending(tokens, text, eos)
    trajectory._append(tokens, True, {}, logp)
    turn = Turn(text, int(tokens.shape[0]), ending)
    if ending != "tool_call":
        trajectory.turns.append(turn)
        trajectory.ended = "eos" if ending == "eos" else (
            "max_trajectory_tokens" if trajectory.length >= budgets.tokens else "max_new_tokens")
        return None
    calls = tuple(parse_tool_calls(text)) or (
        MalformedCall(f"{TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}", text),)
    turn = replace(turn, calls=calls)
    if trajectory.num_turns + 1 >= budgets.max_turns or trajectory.length >= budgets.tokens:
        trajectory.turns.append(turn)  # the policy has no turn left to read the results in
        trajectory.ended = "max_turns" if trajectory.num_turns >= budgets.max_turns \
            else "max_trajectory_tokens"
        return None
    return turn


def _tool_turn(trajectory: Trajectory, turn: Turn, results: Sequence[ToolResult],
               processor: Any, budgets: TurnBudgets) -> bool:
    """Append ``turn`` (the policy's, whose calls gave ``results``) and its tool turn; False
    when the tool turn leaves no room for another policy turn (the trajectory ends)."""
    ids, extras, image_inputs, images = tool_turn_tokens(processor, results)
    turn = replace(turn, results=tuple(results))
    if trajectory.length + int(ids.shape[0]) >= budgets.tokens:
        trajectory.turns.append(turn)  # no token left for the policy after the tool turn
        trajectory.ended = "max_trajectory_tokens"
        return False
    trajectory.turns.append(replace(turn, context_tokens=int(ids.shape[0])))
    trajectory._append(ids, False, extras)
    for key, value in image_inputs.items():
        held = trajectory.image_inputs.get(key)
        trajectory.image_inputs[key] = value if held is None else torch.cat([held, value])
    trajectory.images.extend(images)
    return True


#: ``run_turns(rows, seeds or None) -> trajectories``: an engine's multi-turn rollouts of rows
RunTurns = Callable[[Sequence[Prompt], Sequence[int] | None], list[Trajectory]]


def generate_trajectories(rollout: Rollout, run_turns: RunTurns, *, seed: int) -> Rollout:
    """Generation stage with tools: ``rollout`` with a trajectory per row of this process, seeded
    per row as :func:`~r1fit.rollout.generate.generate_rollout` seeds completions (and per turn
    by :func:`turn_seed`); its completions are the trajectories' tokens after the prompt,
    ``engine_logp`` the engine's log-probs of them where it gives them (vLLM; 0 on tool-turn
    tokens, which the loss masks out), and ``total_tokens`` counts the policy's tokens of the
    whole step (the loss normaliser)."""
    seeds = row_seeds(seed, rollout.step, rollout.first_row, len(rollout.rows))
    trajectories = run_turns(rollout.rows, seeds)
    local = sum(t.policy_tokens for t in trajectories)
    engine_logp = [t.engine_logp for t in trajectories]
    return replace(rollout, completions=[t.token_ids for t in trajectories],
                   trajectories=trajectories,
                   engine_logp=pad_rows(engine_logp)  # type: ignore[arg-type]  # none is None
                   if engine_logp and all(logp is not None for logp in engine_logp) else None,
                   total_tokens=int(all_sum([local])[0]))


def answer_text(trajectory: Trajectory) -> str:
    """What rewards and evaluation score: the policy's last turn (decoded, special tokens left
    out), where a trajectory ends with its answer."""
    return trajectory.turns[-1].text if trajectory.turns else ""
