"""The engine that generates a GRPO run's rollouts (``rollout.engine``).

``hf``: Hugging Face ``generate`` on the policy itself (FSDP units gathered for the block).
``static``: r1fit's static-cache engine on the policy itself (:mod:`r1fit.rollout.static_engine`:
CUDA graphs on CUDA, LoRA merged for generation); one process.
``vllm``: one colocated vLLM engine per process; the policy's weights are streamed into it before
the first rollout after each update, and it sleeps (CUDA) from the end of a step's generation
through its updates.
Both sample row i with seed ``row_seeds(...)[i]``, each with its own sampler, so the two engines
give different (equally valid) completions for the same seeds.

With ``tools`` (a :class:`~r1fit.train.tool_rollouts.ToolTurns`) an engine's rollouts are
multi-turn trajectories: :meth:`RolloutEngine.rollout` is the generation stage either way, and the
engine holds the tool counts a checkpoint saves (:meth:`RolloutEngine.state`) and a metrics row
reports (:meth:`RolloutEngine.step_counts`); the GRPO loop never asks which.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, Protocol

import torch

from r1fit.checkpoint.manager import RESOLVED_ENGINE, CheckpointError
from r1fit.config.engines import resolve_engine, sft_engine
from r1fit.data.batch import Prompt
from r1fit.distributed.parallelize import gathered
from r1fit.memory.flops import GenerationLayout
from r1fit.models.load import context_length, resolve_model_path, special_token_ids, unwrap
from r1fit.models.weights import full_named_weights, weight_bytes
from r1fit.report.metrics import timed
from r1fit.rollout.generate import SamplingSettings, generate_completions, generate_rollout
from r1fit.rollout.prefill import PrefillSharing
from r1fit.rollout.record import Rollout, Trajectory
from r1fit.rollout.static_engine import StaticDecoder
from r1fit.rollout.turns import (
    TurnBudgets,
    generate_trajectories,
    hf_generate_turn,
    static_generate_turn,
)
from r1fit.rollout.vllm_engine import EngineSpec, RolloutEngineError, VllmEngine, check_kv_pool
from r1fit.train.run import Run, Session
from r1fit.train.tool_rollouts import ToolTurns

log = logging.getLogger("r1fit.rollout")


class RolloutEngine(Protocol):
    """What the GRPO loop and evaluation call on an engine (hf, static, vllm alike)."""

    tools: ToolTurns | None

    def ready(self, times: dict[str, float]) -> AbstractContextManager[None]:
        """A block in which the engine generates from the policy's current weights."""
        ...

    def rollout(self, batch: Rollout, *, seed: int) -> Rollout:
        """The generation stage (inside ``ready``): ``batch`` with its completions, or with
        ``tools`` its trajectories."""
        ...

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves of the engine and an OOM-redone step restores: the tool
        counts with ``tools``, else nothing."""
        ...

    def step_counts(self) -> dict[str, float]:
        """The metrics row's ``tools/...`` counts after a step (empty without ``tools``)."""
        ...

    def generate(self, rows: Sequence[Prompt], seeds: Sequence[int]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """One sampled completion per row, and the engine's log-probs when it has them."""
        ...

    def greedy(self, prompts: Sequence[Prompt]) -> list[torch.Tensor]:
        """Greedy completions (evaluation)."""
        ...

    def trajectories(self, rows: Sequence[Prompt], seeds: Sequence[int]) -> list[Trajectory]:
        """One sampled multi-turn trajectory per row (with tools)."""
        ...

    def greedy_trajectories(self, prompts: Sequence[Prompt]) -> list[Trajectory]:
        """Greedy trajectories (evaluation with tools)."""
        ...

    def idle(self) -> None:
        """The step's generation is over: free what generating holds while the policy trains."""
        ...

    def updated(self) -> None:
        """The policy's weights changed."""
        ...

    def generation_layout(self) -> GenerationLayout:
        """How its generation runs, for the step's FLOP count (r1fit/memory/flops.py)."""
        ...

    def close(self) -> None:
        """Release what the engine holds."""
        ...


class Rollouts:
    """What every engine does the same way: the generation stage, one completion per row or,
    with ``tools``, a trajectory (its ``generate`` or ``trajectories``), and the tool counts."""

    tools: ToolTurns | None

    def generate(self, rows: Sequence[Prompt], seeds: Sequence[int]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        raise NotImplementedError

    def trajectories(self, rows: Sequence[Prompt], seeds: Sequence[int]) -> list[Trajectory]:
        raise NotImplementedError

    def rollout(self, batch: Rollout, *, seed: int) -> Rollout:
        if self.tools is None:
            return generate_rollout(batch, self.generate, seed=seed)
        return generate_trajectories(batch, self.trajectories, seed=seed)

    def state(self) -> dict[str, Any]:
        return {} if self.tools is None else {"tools": self.tools.totals}

    def step_counts(self) -> dict[str, float]:
        return {} if self.tools is None else self.tools.totals.step()

    def generation_layout(self) -> GenerationLayout:
        return GenerationLayout()

    def idle(self) -> None:
        """Nothing to free: the policy itself generates."""


class HFRollouts(Rollouts):
    """Rollouts with ``generate`` on the policy, ``memory.generation_batch`` rows at a time;
    with ``tools``, multi-turn trajectories (:meth:`trajectories`)."""

    def __init__(self, run: Session, settings: SamplingSettings,
                 tools: ToolTurns | None = None) -> None:
        self.run, self.settings, self.tools = run, settings, tools
        self.sharing = PrefillSharing(run.cfg.rollout.share_prefill)
        if tools is not None and run.cfg.rollout.share_prefill is True:
            log.info("rollout.share_prefill=true does not act on multi-turn trajectories: "
                     "each turn is prefilled as it comes (docs/tools.md)")

    @contextmanager
    def ready(self, times: dict[str, float]) -> Iterator[None]:
        with gathered(self.run.policy):  # whole weights for every token step
            yield

    def generate(self, rows: Sequence[Prompt], seeds: Sequence[int]
                 ) -> tuple[list[torch.Tensor], None]:
        run = self.run
        return generate_completions(run.policy, rows, seeds=seeds,
                                    batch_size=run.sizes.generation_batch,
                                    settings=self.settings, ids=run.ids, device=run.device,
                                    sharing=self.sharing), None

    def greedy(self, prompts: Sequence[Prompt]) -> list[torch.Tensor]:
        """Greedy completions with ``generate`` on the policy, ``eval.batch`` rows at a time
        (inside ``ready``)."""
        run = self.run
        settings = SamplingSettings(max_new_tokens=self.settings.max_new_tokens, greedy=True)
        with torch.inference_mode():
            return generate_completions(run.policy, prompts, seeds=None,
                                        batch_size=run.cfg.eval.batch, settings=settings,
                                        ids=run.ids, device=run.device, sharing=self.sharing)

    def trajectories(self, rows: Sequence[Prompt], seeds: Sequence[int]) -> list[Trajectory]:
        """One sampled trajectory per row (with ``tools``; inside ``ready``)."""
        return self._turns(self.settings, rows, seeds, self.run.sizes.generation_batch)

    def greedy_trajectories(self, prompts: Sequence[Prompt]) -> list[Trajectory]:
        """Greedy trajectories (evaluation with ``tools``, inside ``ready``)."""
        settings = SamplingSettings(max_new_tokens=self.settings.max_new_tokens, greedy=True)
        with torch.inference_mode():
            return self._turns(settings, prompts, None, self.run.cfg.eval.batch)

    def _turns(self, settings: SamplingSettings, rows: Sequence[Prompt],
               seeds: Sequence[int] | None, batch_size: int) -> list[Trajectory]:
        assert self.tools is not None
        run = self.run
        turn = hf_generate_turn(run.policy, run.processor.tokenizer, settings, run.ids,
                                run.device)
        return self.tools.run_rows(turn, rows, seeds, batch_size, evaluation=seeds is None)

    def generation_layout(self) -> GenerationLayout:
        """Each chunk's distinct prompts prefilled once where rollout.share_prefill is on
        (single-turn: a trajectory's turns are prefilled as they come); adapters unmerged."""
        sharing = self.sharing.on is True and self.tools is None
        return GenerationLayout(self.run.sizes.generation_batch if sharing else None)

    def updated(self) -> None:
        """The policy changed (nothing to do: generate reads it directly)."""

    def close(self) -> None:
        """Nothing to release."""


class StaticRollouts(HFRollouts):
    """Rollouts and evaluation on the static-cache engine (one process); with ``tools``, each
    turn of the open rows one engine call, each row's cache kept across its turns
    (``rollout.static.keep_cache``)."""

    def __init__(self, run: Session, settings: SamplingSettings,
                 tools: ToolTurns | None = None) -> None:
        super().__init__(run, settings, tools)
        static = run.cfg.rollout.static
        # null keys: the decoder's defaults (graphs and compile on CUDA only; compiled, an H200
        # decoded 1.6x as fast as with graphs alone, for a compile of about a minute per run)
        self.decoder = StaticDecoder(run.model, run.ids, run.device, graphs=static.cuda_graphs,
                                     sync_every=static.sync_every, compile=static.compile,
                                     share_prompt=static.share_prompt,
                                     prompt_places=run.cfg.algo.num_generations)

    def generate(self, rows: Sequence[Prompt], seeds: Sequence[int]
                 ) -> tuple[list[torch.Tensor], None]:
        return self.decoder.generate(rows, seeds=seeds, batch_size=self.run.sizes.generation_batch,
                                     settings=self.settings), None

    def greedy(self, prompts: Sequence[Prompt]) -> list[torch.Tensor]:
        settings = SamplingSettings(max_new_tokens=self.settings.max_new_tokens, greedy=True)
        return self.decoder.generate(prompts, seeds=None, batch_size=self.run.cfg.eval.batch,
                                     settings=settings)

    def generation_layout(self) -> GenerationLayout:
        """Each chunk's distinct prompts prefilled once (a trajectory's turns: its own), decoded
        on LoRA merged into the weights."""
        return GenerationLayout(self.run.sizes.generation_batch if self.tools is None else None,
                                merged=True)

    def _turns(self, settings: SamplingSettings, rows: Sequence[Prompt],
               seeds: Sequence[int] | None, batch_size: int) -> list[Trajectory]:
        assert self.tools is not None
        turn = static_generate_turn(self.decoder, self.run.processor.tokenizer, settings,
                                    keep_cache=self.run.cfg.rollout.static.keep_cache,
                                    room=self.tools.budgets.tokens)
        return self.tools.run_rows(turn, rows, seeds, batch_size, evaluation=seeds is None)


class VllmRollouts(Rollouts):
    """Rollouts on this process's vLLM engine, synced from the policy when it changed; with
    ``tools``, multi-turn trajectories, each turn of the open rows one engine call."""

    def __init__(self, run: Session, settings: SamplingSettings,
                 tools: ToolTurns | None = None) -> None:
        cfg = run.cfg
        self.run, self.settings, self.tools = run, settings, tools
        self.spec = vllm_spec(run, cfg.algo.max_new_tokens if tools is None
                              else tools.budgets.tokens)
        self.text_config = unwrap(run.model).config.get_text_config()
        self._engine: VllmEngine | None = None
        self.stale = True  # the engine holds the checkpoint's weights, not the policy's
        if (said := nucleus_warning(settings.top_p, cfg.algo.tis_cap)) is not None:
            log.warning(said)

    @property
    def engine(self) -> VllmEngine:
        """This process's vLLM engine, started on first use (the first ``ready``): after the
        run's checkpoint is restored, so the optimizer's moments are on the device before vLLM
        sizes its KV cache from what is free."""
        if self._engine is None:
            self._engine = VllmEngine(self.spec, self.text_config)
        return self._engine

    @contextmanager
    def ready(self, times: dict[str, float]) -> Iterator[None]:
        """The engine holding the policy's weights: synced when stale. Under FSDP the sync
        gathers every parameter (collectives), so every rank enters this, rows or none."""
        engine = self.engine  # started here the first time, outside the sync's seconds
        if self.stale:
            with timed(times, "seconds_weight_sync"), torch.no_grad():
                engine.load_weights(full_named_weights(self.run.model))
            self.stale = False
        else:  # asleep since the last generation (idle) with the policy unchanged
            engine.wake()
        yield

    def generate(self, rows: Sequence[Prompt], seeds: Sequence[int]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        s, ids = self.settings, self.run.ids
        return self.engine.generate(rows, seeds=seeds, max_new_tokens=s.max_new_tokens,
                                    temperature=s.temperature, top_p=s.top_p, eos=ids.eos,
                                    blocked=ids.blocked, min_new_tokens=s.min_new_tokens)

    def greedy(self, prompts: Sequence[Prompt]) -> list[torch.Tensor]:
        """Greedy completions on the engine (evaluation, inside ``ready``)."""
        ids = self.run.ids
        return self.engine.generate(prompts, seeds=None,
                                    max_new_tokens=self.settings.max_new_tokens,
                                    temperature=1.0, top_p=1.0, eos=ids.eos,
                                    blocked=ids.blocked)[0]

    def trajectories(self, rows: Sequence[Prompt], seeds: Sequence[int] | None
                     ) -> list[Trajectory]:
        """One trajectory per row (with ``tools``, inside ``ready``): sampled with ``seeds``,
        greedy without (evaluation)."""
        assert self.tools is not None
        s, ids = self.settings, self.run.ids
        greedy = seeds is None
        turn = partial(self.engine.generate_turn, temperature=1.0 if greedy else s.temperature,
                       top_p=1.0 if greedy else s.top_p, eos=ids.eos, blocked=ids.blocked,
                       min_new_tokens=0 if greedy else s.min_new_tokens)
        return self.tools.run_rows(turn, rows, seeds, max(len(rows), 1), evaluation=greedy)

    def greedy_trajectories(self, prompts: Sequence[Prompt]) -> list[Trajectory]:
        """Greedy trajectories (evaluation with ``tools``, inside ``ready``)."""
        return self.trajectories(prompts, None)

    def generation_layout(self) -> GenerationLayout:
        """One call for all the process's rows, its prefix cache computing a prompt once (a
        trajectory's turns: its own); the weights it was synced with are merged."""
        return GenerationLayout(sys.maxsize if self.tools is None else None, merged=True)

    def idle(self) -> None:
        """Generation is over for the step: the engine sleeps (CUDA, ``rollout.vllm.sleep_level``
        > 0) through the log-prob passes and the updates, as the memory plan counts it. At level
        2 its weights are dropped, so the next ``ready`` syncs them again."""
        if self._engine is not None:
            self._engine.sleep()
            if self._engine.sleeps and self.spec.sleep_level >= 2:
                self.stale = True

    def updated(self) -> None:
        """The policy changed: sync before the next rollout."""
        self.stale = True

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


def nucleus_warning(top_p: float, tis_cap: float | None) -> str | None:
    """What a vLLM run with top-p sampling and truncated importance sampling is told: the
    engine's log-probs are of the renormalised nucleus it sampled from (vLLM's
    processed_logprobs), so TIS also weighs each token by its nucleus mass; None otherwise."""
    if top_p >= 1 or not tis_cap:
        return None
    return (f"rollout.engine=vllm with algo.top_p={top_p} and algo.tis_cap={tis_cap}: the "
            "engine's log-probs are of the nucleus it sampled from, so truncated importance "
            "sampling also weighs each token by its nucleus mass, which the hf engine does not "
            "(docs/vllm.md); algo.tis_cap=0 turns it off")


def vllm_spec(run: Session, after_prompt: int) -> EngineSpec:
    """What this run's vLLM engine is started with; ``after_prompt``: the tokens a row may add
    to its prompt (a trajectory grows its context turn by turn up to its budget)."""
    cfg = run.cfg
    model = unwrap(run.model)
    longest = run.max_prompt_tokens if run.max_prompt_tokens is not None else context_length(model)
    if longest is None:
        raise RolloutEngineError("rollout.engine=vllm needs data.max_prompt_tokens (the model "
                                 "config gives no context length)")
    max_len = longest + after_prompt
    if (context := context_length(model)) is not None:
        max_len = min(max_len, context)
    return EngineSpec(
        folder=resolve_model_path(cfg.model.path), dtype=next(run.model.parameters()).dtype,
        device=run.device, seed=cfg.train.seed, max_model_len=max_len,
        kv_cache_memory=cfg.rollout.vllm.kv_cache_memory,
        gpu_memory_utilization=cfg.rollout.vllm.gpu_memory_utilization,
        sleep_level=cfg.rollout.vllm.sleep_level, enforce_eager=cfg.rollout.vllm.enforce_eager,
        max_images=cfg.data.max_images,
        image_token_id=special_token_ids(run.model, run.processor)["image_pad"],
        distributed=run.world.distributed, weight_bytes=weight_bytes(run.model))


def check_engine_early(run: Run) -> None:
    """What can be known of the rollout engine without starting it, checked before the format
    warm-up trains (minutes or hours on a real model): vLLM's KV pool holds one sequence. The
    engine itself starts after the warm-up and the restore, as it always has."""
    cfg = run.cfg
    name, _ = resolve_engine(cfg.rollout.engine, device_type=run.device.type,
                             distributed=run.world.distributed,
                             attention=cfg.model.attn_implementation,
                             model_type=unwrap(run.model).config.model_type)
    if name != "vllm":
        return
    after = cfg.algo.max_new_tokens if not cfg.tools else \
        TurnBudgets.of(cfg, cfg.algo.max_new_tokens).tokens
    check_kv_pool(vllm_spec(run, after), unwrap(run.model).config.get_text_config())


def rollout_engine(run: Session, settings: SamplingSettings,
                   tools: ToolTurns | None = None) -> RolloutEngine:
    """The engine ``rollout.engine`` names, ready for the run's first rollout; with ``tools``,
    for multi-turn rollouts."""
    name, why = resolve_engine(run.cfg.rollout.engine, device_type=run.device.type,
                               distributed=run.world.distributed,
                               attention=run.cfg.model.attn_implementation,
                               model_type=unwrap(run.model).config.model_type)
    log.info("rollout.engine=%s%s", name, "" if why == "set" else f" (auto: {why})")
    if isinstance(run, Run):  # a training run (r1fit eval's session keeps no checkpoints)
        check_resumed_engine(run, name, why)
    if name == "vllm":
        return VllmRollouts(run, settings, tools)
    if name == "static":
        return StaticRollouts(run, settings, tools)
    return HFRollouts(run, settings, tools)


def check_resumed_engine(run: Run, name: str, why: str) -> None:
    """Record the engine in the run's checkpoints; a resumed run whose checkpoint generated with
    another one (``rollout.engine=auto`` resolved otherwise on this machine, or the key changed
    from or to auto) is refused, or with ``checkpoint.allow_config_change`` warned about: the
    engines sample differently, so its rollouts would not be the ones it would have made."""
    checkpoints = run.checkpoints
    point = checkpoints.resume
    saved = (point.state.get("resolved") or {}).get(RESOLVED_ENGINE) if point else None
    checkpoints.resolved[RESOLVED_ENGINE] = name
    if saved is None or saved == name:
        return
    here = f"here rollout.engine={run.cfg.rollout.engine} " + (
        f"is {name}" if why == "set" else f"resolves to {name} ({why})")
    said = f"{point.path} generated its rollouts with the {saved} engine; {here}"
    if not run.cfg.checkpoint.allow_config_change:
        raise CheckpointError(f"{said}: set rollout.engine={saved} to continue as it ran, or "
                              f"checkpoint.allow_config_change=true to continue on {name}")
    log.warning("%s (the run will not be identical to an uninterrupted one)", said)


def evaluation_engine(run: Run) -> RolloutEngine:
    """``r1fit sft``'s evaluations: greedy answers of ``algo.max_new_tokens`` on the static
    engine where it runs (CUDA, one process; the decode step replayed as CUDA graphs), else on
    Hugging Face generate; never vLLM (:func:`r1fit.config.engines.sft_engine`)."""
    cfg = run.cfg
    name, why = sft_engine(cfg.rollout.engine, device_type=run.device.type,
                           distributed=run.world.distributed,
                           attention=cfg.model.attn_implementation)
    log.info("evaluations on rollout.engine=%s%s", name,
             "" if why == "set" else f" ({cfg.rollout.engine}: {why})")
    settings = SamplingSettings(max_new_tokens=cfg.algo.max_new_tokens)
    tools = ToolTurns.of(run, settings.max_new_tokens)
    return (StaticRollouts if name == "static" else HFRollouts)(run, settings, tools)
