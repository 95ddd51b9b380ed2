"""The peak memory per device of one GRPO step, added up phase by phase from the model's facts
and the per-token formulas.

What one step of the configured run holds is added up phase by phase, the way r1fit's code
allocates it:

- for the whole run: weights, AdamW states (after the first update), the KL reference copy;
- generation (r1fit/rollout/generate.py): ``memory.generation_batch`` rows at a time under
  ``no_grad``, KV cache on; the gradients were freed by the previous update. With
  ``rollout.share_prefill=true`` the prefill runs each prompt a chunk touches once
  (r1fit/rollout/prefill.py); ``auto`` is planned as the per-row prefill, never smaller;
- reference log-probs, and with ``algo.kl_in_reward`` the policy's (r1fit/train/forward.py,
  ``no_grad``): a micro-batch at a time; only with ``algo.beta > 0``. A reused rollout's old
  log-probs come from the first update's forwards: no pass of their own;
- the update (r1fit/train/grpo.py): a micro-batch at a time (``memory.micro_batch`` rows, or
  ``memory.micro_batch_tokens`` packed tokens in one row), each holding its saved
  activations, the LM head's chunk of ``memory.logits_chunk`` tokens (r1fit/algorithms/logprobs.py)
  and, from the second micro-batch on, the gradients of every trainable parameter.

With ``--gpus N`` (N > 1) the plan is per GPU of a torchrun job whose model is sharded by FSDP2
(``fully_shard`` on each decoder layer and vision block, then on the root), as torch 2.x does it:

- weights, gradients, AdamW states and the reference copy are per-parameter shards: each tensor is
  cut into N pieces along dim 0, padded to the first (largest) piece, ``ceil(rows / N)`` rows;
  the plan is for that first GPU;
- forward and backward all-gather one unit at a time, and a unit's all-gather output stays alive
  while the unit computes (forward keeps it for the next unit's copy-out; backward prefetches the
  next unit): two units' unsharded bytes. The root's own parameters (embeddings, LM head, final
  norm, the vision patch embedding and merger) are gathered at the start of the forward and, as
  FSDP2 does for the root, not resharded until its post-backward: they stay gathered throughout,
  and so does the LM head's unsharded gradient during backward;
- backward's reduce-scatter copies a unit's unsharded gradients into one flat buffer before
  freeing them: the largest trainable unit's gradients, twice, at that moment;
- generation runs on the policy gathered whole (``r1fit.distributed.parallelize.gathered``): the
  full unsharded weights beside the shards, which FSDP2 keeps;
- on CUDA (r1fit's MixedPrecisionPolicy) float32 weights are gathered, and computed with, in
  bfloat16, and gradients are reduce-scattered in float32;
- each GPU takes 1/N of a step's rows (prompts_per_step x num_generations): the micro-batches per
  update and the old/reference log-probs are per GPU, a generation chunk and a micro-batch are at
  most that share; every GPU encodes all of the step's prompts (their pixel values).
Unsharded sizes leave out dim-0 padding (under N - 1 rows per tensor).

Peak = what lives for the whole step + the largest phase. A phase's figure is its largest moment
(e.g. the start of a micro-batch's backward: all saved activations, the head's gradient buffer and
one chunk of logits), not the sum of everything it ever allocates; :class:`Plan` keeps the named
parts and the phases apart.

With tools (``tools`` set) a row's completion is a multi-turn trajectory (r1fit/rollout/turns.py):
every one is planned as long as its budget (``rollout.max_trajectory_tokens``, else
``rollout.max_turns`` x ``algo.max_new_tokens``: policy and tool-result tokens after the prompt,
so generation's KV cache grows to the prompt plus that), and each row of the log-prob and update
passes runs its own ``data.max_images`` images at ``data.max_pixels`` through the vision tower (the
row's and the tools' together; :func:`trajectory_patches`), their pixel values kept for the step.

Not modelled: CUDA kernel workspaces beyond the constants below, prompts longer than the prompt
estimate, and a tool turn's own prefill in generation (its images' tower pass). Deliberately
pessimistic: every completion is ``max_new_tokens`` long and batches are padded (a padding mask
makes SDPA repeat the KV heads).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

from r1fit.config import Config, ConfigError
from r1fit.config.engines import least_share, resolve_engine, sft_engine, vllm_share_problem
from r1fit.memory.planner.facts import (
    ModelFacts,
    PromptShape,
    group_runs,
    model_facts,
    prompt_shape,
    prompts_in_rows,
    run_dtype,
    shard_elements,
    shares_prompt_cache,
    trajectory_patches,
)
from r1fit.memory.planner.formulas import (
    ADAPTER_BYTES,
    F32,
    chunk_backward_bytes,
    chunk_forward_bytes,
    kv_cache_bytes,
    layer_backward_temp_per_token,
    layer_saved_per_token,
    lm_forward_bytes,
    pixel_bytes,
    sampling_logits_f32,
    vision_block_saved_per_patch,
    vision_forward_bytes,
    vision_other_saved_per_patch,
)
from r1fit.memory.planner.kernels import conv_backward_workspace
from r1fit.memory.planner.timing import Traffic, run_shape, time_plan, turn_fields
from r1fit.units import format_bytes, parse_bytes

#: Headroom kept free of the budget: a plan "fits" when its peak is at most (1 - margin) x budget,
#: and the largest micro_batch / generation_batch are chosen the same way. It absorbs what the plan
#: does not model (allocator rounding, prompts longer than estimated, library workspaces).
SAFETY_MARGIN = 0.10
#: Budget when neither --device-memory nor memory.budget is given: an 80 GB A100/H100.
DEFAULT_DEVICE_MEMORY = "80GiB"
#: Device memory the CUDA context takes outside PyTorch's allocator (driver, kernels loaded
#: lazily, cuBLAS/cuDNN handles). Public reports put it at 0.5-1 GiB on A100/H100 with CUDA 12;
#: not measured here (no GPU on the development machine). 0 on CPU.
CUDA_CONTEXT_BYTES = 768 << 20
#: Reserved-but-unallocated memory the caching allocator holds at the peak, as a fraction of the
#: allocated peak. r1fit turns on expandable segments, which keeps this small; 5% is an estimate,
#: not a measurement. 0 on CPU (the plan there is live tensor bytes, what the probe measures).
CUDA_ALLOCATOR_SLACK = 0.05
#: cuBLAS's workspace per (thread, stream) that runs matmuls, which PyTorch takes from its caching
#: allocator (so ``max_memory_allocated`` counts it) when ``CUBLAS_WORKSPACE_CONFIG`` is unset: 32 MiB
#: on Hopper (``:4096:8``), 8.125 MiB on other GPUs; the plan assumes Hopper's, the larger.
CUBLAS_DEFAULT_WORKSPACE = 32 << 20
#: Threads that run a step's matmuls, each with its own cuBLAS handle and workspace: the training
#: loop's (forward, generation) and autograd's device thread (backward). Measured on an H100
#: (benchmarks/RESULTS.md, "GPU check"): builtin:tiny allocated 70 MiB for 4 MiB of tensors.
CUBLAS_THREADS = 2

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
PARTS = ("weights", "gradients", "optimizer", "reference", "all_gather", "reduce_scatter",
         "activations", "adapter_copies", "logits_chunk", "vision", "unsharded_weights",
         "generation",
         "engine_weights", "engine_kv_cache", "engine_graphs", "inputs", "workspaces", "overhead")
#: Parts that exist only under FSDP (--gpus > 1); 0, and not printed, on one GPU.
FSDP_PARTS = ("all_gather", "reduce_scatter", "unsharded_weights")
#: Parts of an engine other than hf: vLLM's own copy of the weights and its KV pool; the static
#: engine's static KV cache, decode-step workspace (its CUDA graphs' pool) and, with LoRA, the
#: copy of the adapted base weights kept while they hold the merged ones. 0, and not printed,
#: with rollout.engine=hf.
ENGINE_PARTS = ("engine_weights", "engine_kv_cache", "engine_graphs")
#: The vLLM engine's KV pool on CPU when rollout.vllm.kv_cache_memory is null (as the engine)
CPU_ENGINE_KV_BYTES = 256 << 20
#: The LM-head chunk the advice tries when nothing fits (``memory.logits_chunk``; with Qwen's
#: 151,936-token vocabulary a float32 chunk of 256 tokens' logits is 148 MiB, of 1,024: 593 MiB)
SMALL_LOGITS_CHUNK = 256

@dataclass
class Plan:
    """A prediction of one GRPO step's peak memory per device. Sizes are bytes.

    ``parts`` (names in ``PARTS``): weights; gradients (trainable parameters); optimizer (AdamW
    states); reference (the frozen copy for a KL term under full fine-tuning) - the four are one
    GPU's FSDP shards with ``gpus > 1``; all_gather (FSDP: the root's gathered parameters and two
    units'); reduce_scatter (FSDP: one unit's gradients copied for the reduce-scatter);
    unsharded_weights (FSDP: the whole policy, gathered for generation); activations (what
    one training micro-batch keeps for backward, as memory.gradient_checkpointing says, with the
    layer a checkpointed backward rebuilds); logits_chunk (the LM head's temporaries: one chunk
    of float32 logits, the head's gradient buffer); vision (the vision tower's activations for one
    micro-batch's images); generation (KV cache and sampling logits of one generation chunk, or
    its prefill if larger); inputs (pixel values the step holds); overhead (CUDA context and
    allocator slack; 0 on CPU). Parts do not add up to the peak: ``phases`` gives each phase's
    peak (persistent parts + the phase's largest moment + overhead), and the largest is
    ``peak_bytes``. ``fits``: the peak is within the budget less ``SAFETY_MARGIN``; the two
    ``max_*`` sizes are the largest that fit the same way (0: not even 1); :meth:`auto_size`
    says what ``auto`` picks from them (:func:`even_size`).
    """

    parts: dict[str, int]
    peak_bytes: int
    budget_bytes: int
    fits: bool
    max_micro_batch: int
    max_generation_batch: int
    advice: list[str]
    #: with memory.micro_batch_tokens set: the largest that fits (0: not even one row alone)
    max_micro_batch_tokens: int = 0
    phases: dict[str, int] = field(default_factory=dict)  # each phase's peak, whole device
    peak_phase: str = ""
    activations_by_checkpointing: dict[str, int] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: what keeps the run from starting at any size (:func:`engine_problems`); any: no fit
    problems: list[str] = field(default_factory=list)
    #: the time model's prediction (r1fit/memory/planner/timing.py: TimePlan.to_dict())
    time: dict[str, Any] = field(default_factory=dict)
    #: configurations that fit and are predicted faster (:func:`faster_fits`; planned with
    #: ``faster=True`` only)
    faster: list[dict[str, Any]] = field(default_factory=list)

    @property
    def usable_bytes(self) -> int:
        return int(self.budget_bytes * (1 - SAFETY_MARGIN))

    def largest(self, key: str) -> int:
        """The largest ``memory.<key>`` that fits ("micro_batch", "generation_batch",
        "micro_batch_tokens")."""
        return {"micro_batch": self.max_micro_batch, "generation_batch": self.max_generation_batch,
                "micro_batch_tokens": self.max_micro_batch_tokens}[key]

    def auto_size(self, key: str) -> int:
        """What ``memory.<key>=auto`` picks on this plan's device ("micro_batch",
        "generation_batch": :func:`even_size` of the largest that fits over the step's rows on
        one GPU; "micro_batch_tokens": the largest that fits)."""
        largest = self.largest(key)
        if key == "micro_batch_tokens":
            return largest
        return even_size(largest, int(self.details.get("rows_per_gpu", largest)),
                         int(self.details.get("group", 1)))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["usable_bytes"] = self.usable_bytes
        out["safety_margin"] = SAFETY_MARGIN
        return out


@dataclass(frozen=True)
class Sizes:
    """The run's settings the phases depend on, for one GPU."""

    rows: int  # of a step, on this GPU
    gpus: int
    micro: int
    generation: int
    checkpointing: bool
    checkpoint_every: int = 1  # memory.checkpoint_every: only every n-th layer recomputes
    #: memory.micro_batch_tokens: micro-batches packed by tokens (``micro`` is then the most
    #: rows one of them takes, set by :func:`_estimate` from the cut)
    tokens: int | None = None
    #: what an evaluation generates at once (:func:`evaluation_shape`): rows, completion tokens
    evaluation: tuple[int, int] = (0, 0)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per update."""
        return -(-self.rows // self.micro)


#: what a plan is of: a step of ``r1fit train``'s GRPO or one of ``r1fit sft``
KINDS = ("grpo", "sft")


def sft_step(cfg: Config, *, device_type: str = "cuda", gpus: int = 1) -> Config:
    """``cfg`` as the planner reads it for one step of ``r1fit sft`` (r1fit/train/sft.py):
    ``sft.batch_size`` rows, each its own prompt (nothing shared) and an answer of
    ``sft.max_answer_tokens`` tokens, one update with no old-policy or reference log-probs,
    generation (the evaluation's) on the engine r1fit sft evaluates with on ``device_type`` and
    ``gpus`` (:func:`r1fit.config.engines.sft_engine`: the static engine, kept from the first
    evaluation on, sized for the larger of ``sft.batch_size`` and ``eval.batch`` rows, or
    generate on the policy itself; none without ``data.eval``), the LM head's gradient made in
    its forward unless memory.fused_loss is false. Internal: not a config a run accepts (one
    completion per prompt)."""
    engine = sft_engine(cfg.rollout.engine, device_type=device_type, distributed=gpus > 1,
                        attention=cfg.model.attn_implementation)[0] if cfg.data.eval else "hf"
    return replace(
        cfg, train=replace(cfg.train, prompts_per_step=cfg.sft.batch_size),
        # a cross-entropy of per-token terms, fused as memory.fused_loss says
        algo=replace(cfg.algo, num_generations=1, max_new_tokens=cfg.sft.max_answer_tokens,
                     beta=0.0, kl_in_reward=False, num_iterations=1, entropy_coef=0.0,
                     importance_sampling_level="token", cov_restriction="none"),
        memory=replace(cfg.memory, share_prefix=False),
        rollout=replace(cfg.rollout, engine=engine), tools=())  # an answer, not a trajectory


def evaluation_shape(cfg: Config) -> tuple[int, int]:
    """(rows, completion tokens) an evaluation generates at once: ``eval.batch`` greedy rows of
    ``algo.max_new_tokens`` (with tools a trajectory's budget), in ``r1fit sft`` too, whose
    answers are cut at ``sft.max_answer_tokens``; (0, 0) without ``data.eval``."""
    return (cfg.eval.batch, completion_tokens(cfg)) if cfg.data.eval else (0, 0)


def completion_tokens(cfg: Config) -> int:
    """Tokens after the prompt in one row: ``algo.max_new_tokens``, or with tools a trajectory's
    budget, ``rollout.max_trajectory_tokens`` (null: ``rollout.max_turns`` x
    ``algo.max_new_tokens``), tool results included."""
    if not cfg.tools:
        return cfg.algo.max_new_tokens
    budget = cfg.rollout.max_trajectory_tokens
    return budget if budget is not None else cfg.rollout.max_turns * cfg.algo.max_new_tokens


def plan_memory(cfg: Config, *, device_memory_bytes: int | None = None, device_type: str = "cuda",
                gpus: int = 1, kind: str = "grpo", faster: bool = False,
                turns: float | None = None) -> Plan:
    """Predict the peak memory per device of one step of ``cfg``: of GRPO (``kind="grpo"``,
    ``r1fit train``) or of supervised fine-tuning (``"sft"``, ``r1fit sft``: see
    :func:`sft_step`).

    ``device_memory_bytes``: the budget (default ``memory.budget``, else 80 GiB). ``device_type``:
    ``"cpu"`` drops the CUDA context and allocator slack, giving live tensor bytes (what
    r1fit.memory.probe measures). ``gpus``: the GPUs of a torchrun job; with more than one the
    model is sharded by FSDP2 and the plan is for one of them (see the module docstring).
    ``faster``: also plan the configurations :func:`faster_fits` tries (``plan.faster``).
    ``turns``: with tools, time the trajectories at this mean of policy turns (a run's
    ``turns_mean``) instead of ``rollout.max_turns`` (the memory plan keeps the budget).
    """
    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"device type: got {device_type!r}, expected 'cuda' or 'cpu'")
    if kind not in KINDS:
        raise ConfigError(f"plan kind: got {kind!r}, expected one of {', '.join(KINDS)}")
    # how the plan reads a config; the advice changes the one asked (sft_step's view is no
    # config a run accepts)
    view: Callable[[Config], Config] = partial(sft_step, device_type=device_type, gpus=gpus) \
        if kind == "sft" else (lambda c: c)
    asked, cfg = cfg, view(cfg)
    if gpus < 1:
        raise ConfigError(f"--gpus: got {gpus}, expected a number >= 1")
    if turns is not None and (not cfg.tools or not 1 <= turns <= cfg.rollout.max_turns):
        raise ConfigError(
            f"--turns: got {turns:g}, expected a number from 1 to rollout.max_turns "
            f"({cfg.rollout.max_turns})" if cfg.tools else
            "--turns: a step of r1fit sft generates no trajectory" if kind == "sft" else
            "--turns: the config has no tools (one turn per row)")
    if device_memory_bytes is None:
        device_memory_bytes = parse_bytes(cfg.memory.budget or DEFAULT_DEVICE_MEMORY)
    facts = model_facts(cfg.model.path, cfg.model.lora.target)
    prompt = prompt_shape(cfg, facts)
    rows = cfg.train.prompts_per_step * cfg.algo.num_generations
    local = -(-rows // gpus)  # the step's rows are split evenly over the GPUs
    micro, generation = cfg.memory.micro_batch, cfg.memory.generation_batch
    sizes = Sizes(rows=local, gpus=gpus, micro=local if micro == "auto" else min(micro, local),
                   generation=local if generation == "auto" else min(generation, local),
                   checkpointing=cfg.memory.gradient_checkpointing,
                   checkpoint_every=cfg.memory.checkpoint_every,
                   evaluation=evaluation_shape(asked))
    tokens = cfg.memory.micro_batch_tokens
    notes = []
    if kind == "sft":
        evaluation = (f", the evaluation's completions {sizes.evaluation[1]}"
                      if sizes.evaluation[0] else "")
        notes.append(f"an r1fit sft step: every answer sft.max_answer_tokens="
                     f"{cfg.algo.max_new_tokens} tokens long{evaluation}")
    if facts.hub_config:
        notes.append(f"model config: {facts.hub_config} (no weights read)")
    if gpus > 1:
        notes.append(f"per GPU, FSDP2 over {gpus} GPUs: weights, gradients, AdamW states and the "
                     f"reference are 1/{gpus} shards; each GPU takes {local} of the {rows} rows "
                     "of a step; generation gathers the whole policy")
    if device_type == "cpu":
        notes.append("cpu: the plan is live tensor bytes; the process's RSS adds the Python heap "
                     "and libraries, and glibc's freed heap unless memory.release_freed is on "
                     "(memory.budget caps RSS over the pre-load baseline and turns it on)")
    usable = int(device_memory_bytes * (1 - SAFETY_MARGIN))
    # each search moves one size; the phase it looks at does not depend on the other size
    max_micro = _largest(lambda m: _estimate(facts, cfg, prompt, replace(sizes, micro=m),
                                             device_type, device_memory_bytes).update_peak,
                         local, usable)
    max_gen = _largest(lambda g: _estimate(facts, cfg, prompt, replace(sizes, generation=g),
                                           device_type, device_memory_bytes).generation_peak,
                       local, usable)
    max_tokens = 0
    if tokens is not None:
        # the micro-batch phases by packed tokens: from one row alone to all rows of the share
        max_tokens = _largest(lambda n: _estimate(facts, cfg, prompt, replace(sizes, tokens=n),
                                                  device_type, device_memory_bytes).update_peak,
                              local * (prompt.tokens + completion_tokens(cfg)), usable)
        sizes = replace(sizes, tokens=max(1, max_tokens) if tokens == "auto" else tokens)
    group = 1 if kind == "sft" else cfg.algo.num_generations  # rows sharing a prompt
    if micro == "auto":  # plan the run with what 'auto' will pick
        sizes = replace(sizes, micro=max(1, even_size(max_micro, local, group)))
    if generation == "auto":
        sizes = replace(sizes, generation=max(1, even_size(max_gen, local, group)))
    est = _estimate(facts, cfg, prompt, sizes, device_type, device_memory_bytes)
    problems = [*cfg.split_problems(kind, gpus),
                *engine_problems(est.details, device_memory_bytes, gpus)]
    plan = Plan(parts=est.parts, peak_bytes=est.peak, budget_bytes=device_memory_bytes,
                fits=est.peak <= usable and not problems, problems=problems,
                max_micro_batch=max_micro,
                max_generation_batch=max_gen, advice=[], phases=est.phases,
                max_micro_batch_tokens=max_tokens,
                peak_phase=max(est.phases, key=est.phases.__getitem__),
                activations_by_checkpointing=est.activations_by_checkpointing,
                details={**est.details, "kind": kind, "device_type": device_type, "gpus": gpus,
                         "prompt_tokens": prompt.tokens, "image_tokens": prompt.image_tokens,
                         "vision_patches": prompt.patches, "prompt_estimate": prompt.how,
                         "rows_per_step": rows, "rows_per_gpu": local, "group": group,
                         "micro_batch": est.details.get("micro_rows", sizes.micro),
                         "micro_batch_tokens": sizes.tokens,
                         "generation_batch": sizes.generation,
                         "auto": [k for k, x in (("micro_batch", micro),
                                                 ("micro_batch_tokens", tokens),
                                                 ("generation_batch", generation)) if x == "auto"]},
                notes=notes)
    plan.advice = _advice(plan, facts, asked, view, prompt, sizes, device_type, usable)
    plan.time = _time(plan, facts, cfg, prompt, device_type, kind,
                      eval_completion=sizes.evaluation[1] or None, turns=turns,
                      tools=asked if kind == "sft" and asked.tools else None)
    if faster and plan.fits and plan.time:
        plan.faster = faster_fits(plan, asked, device_type=device_type, gpus=gpus, kind=kind,
                                  turns=turns)
    return plan


#: a configuration :func:`faster_fits` lists must be predicted at least this much faster
FASTER_BY = 0.05
#: the most configurations it lists
FASTER_SHOWN = 4


def faster_fits(plan: Plan, asked: Config, *, device_type: str, gpus: int, kind: str,
                turns: float | None = None) -> list[dict[str, Any]]:
    """Configurations of ``asked`` that fit the same device and that the time model predicts
    at least :data:`FASTER_BY` faster than ``plan``, fastest first (at most
    :data:`FASTER_SHOWN`): fewer generation chunks or micro-batches (each at the size ``auto``
    would pick), both, gradient checkpointing off, LoRA's adapters computing in a 16-bit
    model's dtype (alone and with those sizes), the static engine where Hugging Face generate
    runs on one GPU (each timed at ``turns``, as ``plan``). Each: its config ``values``,
    ``step_seconds``, ``speedup`` and ``peak_bytes``."""
    d = plan.details
    rows = int(d["rows_per_gpu"])
    tried: list[dict[str, Any]] = []
    sizes: dict[str, Any] = {}
    for key in ("generation_batch", "micro_batch"):
        if key == "micro_batch" and d.get("micro_batch_tokens"):
            continue  # packed by tokens: its rows are not what is set
        if key == "generation_batch" and d.get("engine") == "vllm":
            continue  # vLLM takes all of a process's rows in one call
        even, now = plan.auto_size(key), int(d[key])
        if even and -(-rows // even) < -(-rows // now):
            sizes[f"memory.{key}"] = even
            tried.append({f"memory.{key}": even})
    if len(sizes) > 1:
        tried.append(dict(sizes))
    if asked.memory.gradient_checkpointing is True:
        tried.append({"memory.gradient_checkpointing": False})
    if (asked.model.lora.r and asked.model.lora.compute_dtype == "float32"
            and d.get("dtype") in ("bfloat16", "float16")):
        # peft's float32 adapters on a 16-bit model: their products in the model's dtype
        tried.append({"model.lora.compute_dtype": "model"})
        if sizes:
            tried.append({**sizes, "model.lora.compute_dtype": "model"})
    static_possible = (device_type == "cuda" and gpus == 1 and kind == "grpo"
                       and asked.model.attn_implementation in ("sdpa", "eager"))
    if d.get("engine") == "hf" and static_possible:
        tried.append({"rollout.engine": "static"})
        if sizes:
            tried.append({**sizes, "rollout.engine": "static"})
    now_seconds = float(plan.time["step_seconds"])
    out = []
    for values in tried:
        try:
            other = plan_memory(asked.with_values(values), device_memory_bytes=plan.budget_bytes,
                                device_type=device_type, gpus=gpus, kind=kind, turns=turns)
        except ConfigError:
            continue  # a combination the config refuses (its own validation says why)
        seconds = float(other.time.get("step_seconds") or 0.0)
        if other.fits and 0 < seconds <= now_seconds * (1 - FASTER_BY):
            out.append({"values": values, "step_seconds": seconds,
                        "speedup": now_seconds / seconds, "peak_bytes": other.peak_bytes})
    out.sort(key=lambda x: x["step_seconds"])
    return out[:FASTER_SHOWN]


def _time(plan: Plan, facts: ModelFacts, cfg: Config, prompt: PromptShape, device_type: str,
          kind: str, eval_completion: int | None = None, turns: float | None = None,
          tools: Config | None = None) -> dict[str, Any]:
    """The time model's prediction for the planned step (its sizes, engine and shared-prefix
    layout: 'auto' as planned), on this machine's calibrated rates for ``device_type``, else
    data sheets; ``eval_completion``: the tokens an evaluation generates (r1fit sft's
    evaluations: algo.max_new_tokens, not its answers' cap); ``turns``: with tools, the
    trajectories' mean policy turns to time (default rollout.max_turns); ``tools``: the config
    whose tools an evaluation runs where the step has none (r1fit sft's)."""
    from r1fit.memory.rates import device_rates  # torch: at plan time, not with the planner

    d = plan.details
    shared = d["share_prefix"] in ("on", "auto (planned on)")
    planned = cfg if cfg.memory.share_prefix is shared else cfg.with_values(
        {"memory.share_prefix": shared})
    shape = replace(run_shape(facts, planned, prompt, rows=d["rows_per_gpu"],
                              generation_batch=d["generation_batch"], micro_batch=d["micro_rows"],
                              completion=d["completion_tokens"], engine=d["engine"],
                              device_type=device_type, dtype=d["compute_dtype"]),
                    traffic=fsdp_traffic(facts, cfg, d["gpus"], device_type))
    if turns is not None:
        shape = replace(shape, **turn_fields(facts, planned, prompt,
                                             completion=d["completion_tokens"],
                                             engine=d["engine"], turns=turns))
    eval_turns = None if tools is None or not eval_completion else turn_fields(
        facts, tools, prompt, completion=eval_completion, engine=d["engine"], turns=turns)
    return time_plan(shape, device_rates(device_type, threads=process_threads(device_type,
                                                                          d["gpus"])),
                     cfg, processes=d["gpus"],
                     eval_rows=cfg.data.eval_size if cfg.data.eval else None,
                     training_only=kind == "sft", eval_completion=eval_completion,
                     eval_turns=eval_turns).to_dict()


def process_threads(device_type: str, gpus: int) -> int | None:
    """A CPU's threads per process of a torchrun job of ``gpus`` processes: ``OMP_NUM_THREADS``,
    which torchrun sets to 1 for each when it is unset; None (this process's) for one process or
    a GPU."""
    if device_type != "cpu" or gpus < 2:
        return None
    try:
        return max(int(os.environ.get("OMP_NUM_THREADS") or 1), 1)
    except ValueError:
        return 1


def even_size(largest: int, rows: int, group: int = 1) -> int:
    """What ``memory.micro_batch=auto`` / ``generation_batch=auto`` pick when at most
    ``largest`` rows fit: the fewest chunks that hold ``rows``, as even as they can be (of 128
    rows with 105 fitting: 2 of 64, not 105 and 23), rounded up to whole groups of ``group``
    rows (a prompt's completions) where that still fits (50 fitting, groups of 8: 48, 48, 32,
    not 43, 43, 42), so that no group's prompt is split over two chunks. As many forwards as
    the largest size runs, at a lower peak, so further from the budget. 0: not even one row
    fits."""
    if largest <= 0 or rows <= 0:
        return max(largest, 0)
    chunks = -(-rows // largest)
    size = -(-rows // chunks)
    whole = -(-size // group) * group if group > 1 else size
    return whole if whole <= largest else size


def _largest(peak_at: Any, rows: int, usable: int) -> int:
    """Largest size in [1, rows] whose peak fits ``usable`` (peaks grow with size); 0 if none."""
    if peak_at(1) > usable:
        return 0
    low, high = 1, rows
    while low < high:
        mid = (low + high + 1) // 2
        if peak_at(mid) <= usable:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class _Estimate:
    parts: dict[str, int]
    phases: dict[str, int]
    peak: int
    update_peak: int  # the peak of the micro-batch phases alone (log-probs, update)
    generation_peak: int
    activations_by_checkpointing: dict[str, int]
    details: dict[str, Any]


def _estimate(f: ModelFacts, cfg: Config, prompt: PromptShape, s: Sizes,
              device_type: str, budget: int) -> _Estimate:
    """One GRPO step of ``cfg`` at the sizes ``s`` on a device of ``budget`` bytes: the parts,
    each phase's peak, the details. ``memory.share_prefix=auto`` decides on the run's first
    micro-batch which path runs, so it is planned as the larger of the two."""
    if cfg.memory.share_prefix == "auto":
        paths = [_estimate(f, cfg.with_values({"memory.share_prefix": on}), prompt, s,
                           device_type, budget) for on in (False, True)]
        chosen = max(paths, key=lambda e: (e.update_peak, e.details["share_prefix"]))
        chosen.details["share_prefix"] = f"auto (planned {chosen.details['share_prefix']})"
        return chosen
    dtype = run_dtype(cfg, f)
    stored = _DTYPE_BYTES.get(dtype, 4)
    fsdp, cuda = s.gpus > 1, device_type == "cuda"
    states = persistent_states(f, cfg, s.gpus, stored)
    b = gathered_bytes(stored, cuda) if fsdp else stored
    buffers = fsdp_buffers(f, cfg, dtype, b, cuda) if fsdp else FsdpBuffers()
    lora = cfg.model.lora.r > 0
    step = StepShape(facts=f, b=b, lora_r=cfg.model.lora.r, prompt=prompt,
                     completion=completion_tokens(cfg),
                     trajectory_patches=trajectory_patches(cfg, f, prompt),
                     eager=cfg.model.attn_implementation == "eager",
                     vision_trains=f.vision is not None and not lora
                     and not cfg.model.freeze_vision,
                     share_prefix=bool(cfg.memory.share_prefix), group=cfg.algo.num_generations,
                     rows_per_gpu=s.rows, gpus=s.gpus, packed_tokens=s.tokens,
                     flash=cfg.model.attn_implementation.startswith("flash"),
                     fused_loss=cfg.fuses_loss(), entropy_grad=cfg.algo.entropy_coef > 0,
                     # a multi-turn trajectory's turns are prefilled as they come (docs/tools.md)
                     share_prefill=(cfg.rollout.engine == "hf" and not cfg.tools
                                    and cfg.rollout.share_prefill is True),
                     adapters_in_dtype=(lora and stored < F32
                                        and cfg.model.lora.compute_dtype == "model"))
    engine_name, engine_why = resolve_engine(cfg.rollout.engine, device_type=device_type,
                                             distributed=s.gpus > 1,
                                             attention=cfg.model.attn_implementation,
                                             model_type=f.model_type or None)
    if s.tokens is not None:  # packed by tokens: the most rows a micro-batch takes, how many
        cut = step.token_cut()
        s = replace(s, micro=cut.rows)
    if step.vision_trains and not cuda and f.vision is not None and f.vision.patch_conv:
        channels, kernel = f.vision.patch_conv
        step = replace(step, patch_embed_workspace=conv_backward_workspace(
            channels, f.vision.hidden, kernel, b))
    # the step keeps every prompt's pixel values (each GPU encodes all of the step's prompts), with
    # tools its rows' trajectories' too, and the old/reference log-probs of its rows [rows x
    # completion]
    step_inputs = (step.pixels(cfg.train.prompts_per_step) + step.trajectory_pixels(s.rows)
                   + 2 * s.rows * step.completion * F32)
    chunk = min(cfg.head_chunk(), s.micro * step.completion)
    generation = generation_bytes(step, s.generation,
                                  sampling_logits_f32(cfg.algo.temperature, cfg.algo.top_p))
    eval_rows, eval_tokens = s.evaluation
    # an evaluation generates eval.batch greedy rows of its own completions, one per prompt
    evaluating = replace(step, completion=eval_tokens, share_prefill=False, group=1)
    if eval_rows:
        generation = max(generation, generation_bytes(evaluating, eval_rows,
                                                       sampling_logits_f32(1.0, 1.0)))
    update = update_bytes(step, s, states, buffers, chunk)

    workspaces = cublas_workspaces() if cuda else 0
    persistent = states.weights + states.optimizer + states.reference + step_inputs + workspaces
    engine = engine_memory(f, cfg, stored, cuda, budget, engine_name, prompt.tokens,
                           s.generation, max(step.completion, eval_tokens))
    if engine.static:
        # the static engine keeps its cache and graphs' pool for the whole run; the merged-weight
        # backup and the prefill's transients exist while it generates
        generation = max(static_prefill_bytes(step, s.generation),
                         static_prefill_bytes(evaluating, eval_rows) if eval_rows else 0)
        phases = {"generation": (persistent + engine.kv_cache + engine.graphs + engine.weights
                                 + generation)}
        training = engine.kv_cache + engine.graphs
    elif engine.weights or engine.kv_cache:
        # the engine generates from its own weights (synced one parameter at a time, so no
        # whole gathered copy of the policy) and its own KV pool; asleep (CUDA) while training
        generation = 0
        buffers = replace(buffers, unsharded_weights=0)
        phases = {"generation": persistent + engine.weights + engine.kv_cache}
        training = 0 if engine.sleeps else engine.weights + engine.kv_cache
    else:
        phases = {"generation": (persistent + buffers.unsharded_weights
                                 + max(generation, buffers.gathering))}
        training = 0
    phases["update"] = persistent + training + update.peak
    # the reference's, and with kl_in_reward the policy's before the first update (a reused
    # rollout's old log-probs come from the first update's own forwards)
    if cfg.algo.beta > 0 or cfg.algo.kl_in_reward:
        phases["log-probs"] = (persistent + training + buffers.all_gather
                               + logprobs_bytes(step, s.micro, chunk)
                               # the policy's pass (kl_in_reward) runs its adapters
                               + (step.adapter_copies if cfg.algo.kl_in_reward else 0))
    allocated = max(phases.values())
    phases = {k: x + cuda_overhead(x, cuda) for k, x in phases.items()}
    parts = {"weights": states.weights, "gradients": states.gradients,
             "optimizer": states.optimizer, "reference": states.reference,
             "all_gather": buffers.all_gather, "reduce_scatter": buffers.reduce_scatter,
             "activations": update.activations.kept(s.checkpointing),
             "adapter_copies": step.adapter_copies,
             "logits_chunk": update.logits_chunk, "vision": update.vision,
             "unsharded_weights": buffers.unsharded_weights, "generation": generation,
             "engine_weights": engine.weights, "engine_kv_cache": engine.kv_cache,
             "engine_graphs": engine.graphs,
             "inputs": step_inputs + step.pixels(max(s.micro, s.generation)),
             "workspaces": workspaces, "overhead": cuda_overhead(allocated, cuda)}
    return _Estimate(
        parts=parts, phases=phases, peak=max(phases.values()),
        update_peak=max(x for k, x in phases.items() if k in ("update", "log-probs")),
        generation_peak=phases["generation"],
        activations_by_checkpointing={"on": update.activations.on,
                                      "off": update.activations.off},
        details={"dtype": dtype, "engine": engine_name, "engine_why": engine_why,
                 "engine_share": engine.share, "engine_needs": engine.needs,
                 "engine_utilization": cfg.rollout.vllm.gpu_memory_utilization,
                 # what the step computes in: FSDP on CUDA gathers float32 weights in bfloat16
                 "compute_dtype": "bfloat16" if b != stored else dtype,
                 "share_prefix": "on" if step.share_prefix else "off",
                 "dtype_from": f.config_dtype_from if cfg.model.dtype == "auto" else "model.dtype",
                 "params": f.params,
                 "trainable_params": states.gradients // (ADAPTER_BYTES if lora else b),
                 "kv_cache": kv_cache_bytes(f.text, b, s.generation, step.length),
                 "logits_chunk_tokens": chunk,
                 "completion_tokens": step.completion,
                 "row_vision_patches": step.row_patches,
                 "micro_batches_per_update": (step.token_cut().count if s.tokens is not None
                                              else s.micro_batches),
                 "micro_rows": s.micro,
                 "persistent": persistent,
                 "fsdp_units": {"decoder_layer": buffers.layer_unit,
                                "vision_block": buffers.block_unit,
                                "root": buffers.root_unit} if fsdp else {}})


@dataclass(frozen=True)
class EngineMemory:
    """What an engine other than hf adds on one device. vLLM: its whole copy of the weights (it
    runs without tensor parallelism) and its KV pool; ``sleeps``: both are freed from the device
    while the policy trains (CUDA with rollout.vllm.sleep_level > 0). The static engine
    (``static``): its static KV cache and decode workspace (``graphs``), kept all run, and with
    LoRA the backup of the adapted base weights (``weights``), while generating."""

    weights: int = 0
    kv_cache: int = 0
    graphs: int = 0
    sleeps: bool = False
    static: bool = False
    #: vLLM on CUDA sized by gpu_memory_utilization: the share it gets and the least it must hold
    #: (its weights and one whole sequence's KV cache); 0: not sized that way
    share: int = 0
    needs: int = 0


def engine_memory(f: ModelFacts, cfg: Config, stored: int, cuda: bool, budget: int,
                  engine: str = "hf", prompt_tokens: int = 0, rows: int = 1,
                  completion: int | None = None) -> EngineMemory:
    """The parts of ``engine`` (all 0 for hf). vLLM's KV pool is rollout.vllm.kv_cache_memory;
    without it, on CUDA vLLM takes gpu_memory_utilization of the device for weights and KV
    together, on CPU r1fit gives it ``CPU_ENGINE_KV_BYTES``. The static engine's take the
    prompt's planned tokens, the generation batch's ``rows`` and the ``completion`` (with tools
    the trajectory's budget; default algo.max_new_tokens)."""
    if engine == "static":
        return static_engine_memory(f, cfg, stored, prompt_tokens, rows,
                                    cfg.algo.max_new_tokens if completion is None else completion,
                                    graphs=cuda and cfg.rollout.static.cuda_graphs is not False)
    if engine != "vllm":
        return EngineMemory()
    v = cfg.rollout.vllm
    weights = f.params * stored
    share = needs = 0
    if v.kv_cache_memory is not None:
        kv = v.kv_cache_memory
    elif cuda:
        share = int(v.gpu_memory_utilization * budget)
        needs = weights + kv_cache_bytes(f.text, stored, 1, prompt_tokens + (
            cfg.algo.max_new_tokens if completion is None else completion))
        kv = max(0, share - weights)
    else:
        kv = CPU_ENGINE_KV_BYTES
    return EngineMemory(weights, kv, sleeps=cuda and v.sleep_level > 0, share=share, needs=needs)


def even_split_advice(cfg: Config, kind: str, gpus: int) -> list[str]:
    """The nearest larger train.prompts_per_step / sft.batch_size that split over ``gpus``."""
    out = []
    if kind == "grpo":
        prompts, group = cfg.train.prompts_per_step, cfg.algo.num_generations
        if prompts * group % gpus:
            fixed = next(n for n in range(prompts, prompts + gpus + 1) if n * group % gpus == 0)
            out.append(f"train.prompts_per_step={fixed} (now {prompts}: {fixed * group} rows "
                       f"split over {gpus} GPUs)")
    if (kind != "grpo" or cfg.sft.format_warmup_steps) and cfg.sft.batch_size % gpus:
        fixed = -(-cfg.sft.batch_size // gpus) * gpus
        out.append(f"sft.batch_size={fixed} (now {cfg.sft.batch_size})")
    return out


def engine_problems(details: dict[str, Any], budget: int, gpus: int) -> list[str]:
    """What stops the planned engine from starting, whatever the sizes: vLLM's share of the GPU
    too small for its weights and one sequence's KV cache (:func:`vllm_share_problem`)."""
    needs = details.get("engine_needs", 0)
    problem = needs and vllm_share_problem(details["engine_utilization"], needs, budget,
                                           distributed=gpus > 1)
    return [problem] if problem else []


#: the static engine's cache length is rounded up to this many columns, in the shared-prompt
#: layout its prompts' width (r1fit/rollout/static_engine.py's LENGTH_STEP, COMPLETION_STEP)
STATIC_LENGTH_STEP = 64
#: the shared-prompt layout's completion columns are rounded up to this many (a completion's
#: budget seldom changes between calls)
STATIC_COMPLETION_STEP = 16


def static_engine_memory(f: ModelFacts, cfg: Config, stored: int, prompt_tokens: int,
                         generation_rows: int, completion: int, *, graphs: bool = False
                         ) -> EngineMemory:
    """rollout.engine=static (r1fit/rollout/static_engine.py): a static KV cache of the most rows
    it generates at once (memory.generation_batch, or eval.batch when larger) x the prompt's
    planned tokens plus the completion (with tools the trajectory: each turn's context grows to
    it) and one scratch column, rounded up to 64 columns; the decode step's
    workspace (:func:`static_step_bytes`: [rows x vocab] tensors, the largest of a step's
    intermediates, which its CUDA graph's pool keeps) and, with ``graphs`` (CUDA graphs on),
    the cuBLAS workspaces of its side stream and its captures (:data:`STATIC_GRAPH_STREAMS`);
    with LoRA a copy of every adapted base weight (the merge is undone by copying it back,
    bit-exact)."""
    t = f.text
    eval_rows = cfg.eval.batch if cfg.data.eval else 0
    rows = max(generation_rows, eval_rows, 1)
    workspaces = STATIC_GRAPH_STREAMS * cublas_workspaces() // CUBLAS_THREADS if graphs else 0
    graphs_bytes = rows * t.vocab * static_step_bytes(stored, cfg.algo.top_p) + workspaces
    backup = sum(i * o for i, o in f.lora_linears) * stored if cfg.model.lora.r > 0 else 0
    if shares_prompt_cache(f, cfg):
        # rollout.static.share_prompt: a prompt slot per group of a chunk (one more where a
        # chunk starts inside a group) or per evaluation row, the rows' own completions apart
        slots = max(prompts_in_rows(generation_rows, cfg.algo.num_generations), eval_rows, 1)
        kv = (kv_cache_bytes(t, stored, slots, _static_columns(prompt_tokens))
              + kv_cache_bytes(t, stored, rows, _static_columns(completion,
                                                                STATIC_COMPLETION_STEP)))
    else:
        # one column more: the scratch column an appended tool turn's padding writes to
        kv = kv_cache_bytes(t, stored, rows, _static_columns(prompt_tokens + completion + 1))
    return EngineMemory(weights=backup, kv_cache=kv, graphs=graphs_bytes, static=True)


#: streams on which the static engine's captured steps run matmuls besides the loop's own, each
#: with a cuBLAS workspace of its own: the side stream its warm-ups run on (one per engine, in
#: PyTorch's allocator) and its captures' (allocated in the graphs' pool at the first capture)
STATIC_GRAPH_STREAMS = 2


def _static_columns(tokens: int, step: int = STATIC_LENGTH_STEP) -> int:
    """The static engine's buffer length for ``tokens`` columns (rounded up to ``step``)."""
    return -(-tokens // step) * step



#: bytes per [row x vocab entry] of top-p filtering in the static engine's sampler (a sort's
#: float32 values and int64 order, the softmax, its cumulative sum, two bool masks, the filled
#: copy): measured 21.8 on CPU (tests/rollout/test_static_engine.py)
STATIC_TOP_P_BYTES = 22


def static_step_bytes(stored: int, top_p: float) -> int:
    """Bytes per [row x vocab entry] that a static-engine decode step holds at its peak: the
    model's logits, their float32 copy (none in a float32 model) and one more float32 tensor;
    the sampler works in place on the copy (temperature, blocked ids, min_new_tokens, its
    weights), top-p adds its filter's tensors. Measured on CPU, float32: 2.0 float32 tensors,
    7.5 with top_p < 1 (tests/rollout/test_static_engine.py)."""
    return stored + (F32 if stored != F32 else 0) + F32 + (STATIC_TOP_P_BYTES if top_p < 1.0
                                                          else 0)


def static_prefill_bytes(step: StepShape, rows: int) -> int:
    """The static engine's prefill of a chunk of ``rows`` rows: each distinct prompt once into a
    dynamic cache (vision tower, then the language model), then one layer's keys or values of the
    rows copied into the static cache at a time."""
    t, v, b = step.facts.text, step.facts.vision, step.b
    P = step.prompt.tokens
    prompts = min(rows, step.groups_touched(rows)[0])
    patches = prompts * step.patches
    vision = (vision_forward_bytes(v, b, patches)
              + prompts * (P + step.prompt.image_tokens) * t.hidden * b)
    text = (kv_cache_bytes(t, b, prompts, P) + lm_forward_bytes(t, b, prompts, P, step.eager)
            + rows * P * t.kv_dim * b)
    return step.pixels(rows) + max(vision, text)


# ---------------------------------------------------------------------------------------------
# the parts and phases of a step, each a function of the model's facts and the run's sizes


@dataclass(frozen=True)
class States:
    """What one GPU holds for the whole run: whole tensors, or its FSDP2 shards over several."""

    weights: int
    gradients: int  # of the trainable parameters, during updates
    optimizer: int  # AdamW's states
    reference: int  # the frozen copy for a KL term


def persistent_states(f: ModelFacts, cfg: Config, gpus: int, b: int) -> States:
    """Weights, gradients, AdamW states and the reference copy, on one of ``gpus`` GPUs."""
    r = cfg.model.lora.r
    lora = r > 0
    frozen_vision = not lora and cfg.model.freeze_vision
    model = shard_elements(f.param_shapes, gpus) * b
    if lora:  # lora_A [r x in], lora_B [out x r], in float32
        adapters = ADAPTER_BYTES * sum(-(-r // gpus) * i + -(-o // gpus) * r
                                       for i, o in f.lora_linears)
        trainable, tensors = adapters, 2 * f.lora_layers
    else:
        adapters = 0
        trainable = model - (shard_elements(f.vision_param_shapes, gpus) * b
                             if frozen_vision else 0)
        tensors = f.param_tensors - (f.vision_param_tensors if frozen_vision else 0)
    return States(
        weights=model + adapters, gradients=trainable,
        # AdamW: exp_avg and exp_avg_sq in the parameter dtype, plus a float32 step count per tensor
        optimizer=2 * trainable + F32 * tensors,
        # full fine-tuning with a KL term keeps a frozen copy; LoRA's reference is the policy with
        # its adapters off; beta = 0 loads none
        reference=model if cfg.algo.beta > 0 and not lora else 0)


@dataclass(frozen=True)
class FsdpBuffers:
    """FSDP2's unsharded copies on one GPU of several (all 0 on one GPU)."""

    layer_unit: int = 0  # a decoder layer gathered, adapters included
    block_unit: int = 0  # a vision block gathered
    root_unit: int = 0  # the root's own parameters gathered
    all_gather: int = 0  # what forward and backward keep gathered at once
    layer_grad: int = 0  # a decoder layer's unsharded gradients
    root_grad: int = 0  # the root's unsharded gradients (full fine-tuning)
    head_grad: int = 0  # the LM head's unsharded gradient, from its backward to the end
    reduce_scatter: int = 0  # the copy of one unit's gradients that is reduce-scattered
    unsharded_weights: int = 0  # the whole policy, gathered for generation
    gathering: int = 0  # the moment of gathering it, beyond the whole policy


def fsdp_buffers(f: ModelFacts, cfg: Config, dtype: str, b: int, cuda: bool) -> FsdpBuffers:
    """The gathered units, unsharded gradients and reduce-scatter copy of FSDP2 on one GPU."""
    r = cfg.model.lora.r
    lora = r > 0
    frozen_vision = not lora and cfg.model.freeze_vision
    # b is the computation's dtype: on CUDA a float32 model is gathered in bfloat16, its float32
    # adapters too; otherwise adapters are gathered in float32. Gradients are reduce-scattered in
    # float32 on CUDA
    adapter = b if cuda and dtype == "float32" else ADAPTER_BYTES
    layer_unit = f.layer_params * b + (r * f.layer_lora_in_plus_out * adapter if lora else 0)
    block_unit, root_unit = f.vision_block_params * b, f.root_params * b
    # elements and bytes of each unit's unsharded gradients
    if lora:
        grads = [(r * f.layer_lora_in_plus_out, adapter)]
    else:
        grads = [(f.layer_params, b),
                 (0 if cfg.model.freeze_vision else f.vision_block_params, b),
                 (f.root_params - (f.root_vision_params if frozen_vision else 0), b)]
    return FsdpBuffers(
        layer_unit=layer_unit, block_unit=block_unit, root_unit=root_unit,
        # the root stays gathered from its pre-forward to its post-backward; a unit and its
        # all-gather output (forward), or a unit and the next one prefetched (backward)
        all_gather=root_unit + 2 * max(layer_unit, block_unit),
        layer_grad=grads[0][0] * grads[0][1],
        root_grad=0 if lora else grads[2][0] * grads[2][1],
        head_grad=0 if lora else f.text.vocab * f.text.hidden * b,
        # reduce-scatter's input: a copy of one unit's unsharded gradients, made while they exist
        reduce_scatter=max(x * (F32 if cuda else bytes_) for x, bytes_ in grads),
        # generation: every unit gathered whole, beside the shards (which FSDP2 keeps)
        unsharded_weights=f.params * b + (r * f.lora_in_plus_out * adapter if lora else 0),
        # gathering the policy before generate: every unit's all-gather at once (the whole policy
        # in flat buffers), then each unit copied out of its buffer, which is freed: one unit more
        gathering=max(layer_unit, block_unit, root_unit))


def gathered_bytes(stored: int, cuda: bool) -> int:
    """Bytes per element FSDP2 gathers and computes a weight stored in ``stored`` bytes in, as
    r1fit/distributed/parallelize.py sets it up: on CUDA float32 weights in bfloat16; on a CPU
    nothing is cast."""
    return 2 if cuda and stored == F32 else stored


def fsdp_traffic(f: ModelFacts, cfg: Config, gpus: int, device_type: str) -> Traffic | None:
    """FSDP2's collectives over ``gpus`` processes, unit by unit as :func:`fsdp_buffers` plans
    them (None on one process): every unit gathered in a forward; the decoder layers (and a
    training vision tower's blocks, else its last one) gathered again in a backward, and their
    gradients reduce-scattered, the root's too under full fine-tuning (float32 on CUDA, as
    stored on a CPU); under full fine-tuning with a KL term, the reference's own units in its
    pass (checked against the collectives a 2-process gloo run makes, counted call by call)."""
    if gpus < 2:
        return None
    dtype = run_dtype(cfg, f)
    stored = _DTYPE_BYTES.get(dtype, 4)
    cuda = device_type == "cuda"
    b = gathered_bytes(stored, cuda)
    u = fsdp_buffers(f, cfg, dtype, b, cuda)
    layers, blocks = f.text.layers, (f.vision.depth if f.vision else 0)
    lora = cfg.model.lora.r > 0
    vision_trains = f.vision is not None and not lora and not cfg.model.freeze_vision
    if lora:  # the adapters' gradients, per decoder layer
        grads = [(layers, cfg.model.lora.r * f.layer_lora_in_plus_out * (F32 if cuda
                                                                         else ADAPTER_BYTES))]
    else:
        reduced = F32 if cuda else stored
        root = f.root_params - (0 if vision_trains else f.root_vision_params)
        grads = [(layers, f.layer_params * reduced),
                 (blocks if vision_trains else 0, f.vision_block_params * reduced),
                 (1, root * reduced)]
    # a backward runs through the decoder layers and a training tower's blocks; FSDP2's backward
    # prefetch gathers a frozen tower's last block too (the unit before the first layer)
    regathered = blocks if vision_trains else min(blocks, 1)
    reference = not lora and cfg.algo.beta > 0
    return Traffic(
        processes=gpus, units=layers + blocks + 1,
        gather_bytes=layers * u.layer_unit + blocks * u.block_unit + u.root_unit,
        backward_units=layers + regathered,
        backward_bytes=layers * u.layer_unit + regathered * u.block_unit,
        reduce_units=sum(n for n, _ in grads), reduce_bytes=sum(n * x for n, x in grads),
        reference_bytes=f.params * b if reference else 0, overlapped=cuda,
        root_bytes=u.root_unit, reference_root_bytes=f.root_params * b if reference else 0)


@dataclass(frozen=True)
class StepShape:
    """What the phases read about the step's rows: the model, the bytes per element it computes
    in, and one row's shape (every completion is taken to be ``max_new_tokens`` long)."""

    facts: ModelFacts
    b: int  # bytes per element of the computation (FSDP on CUDA computes float32 in bfloat16)
    lora_r: int  # 0: full fine-tuning
    prompt: PromptShape
    completion: int  # tokens of a completion
    eager: bool  # eager attention, which keeps its scores
    vision_trains: bool
    #: the patch embedding's backward workspace beyond its gradient (CPU; see planner/kernels.py)
    patch_embed_workspace: int = 0
    #: memory.share_prefix on: a micro-batch reaches the model one packed row per group (its
    #: prompt once, then its completions in it; r1fit/models/prefix.py)
    share_prefix: bool = False
    group: int = 1  # completions per prompt (algo.num_generations)
    rows_per_gpu: int = 1  # a step's rows on one GPU, of `gpus` contiguous shares
    gpus: int = 1
    #: memory.micro_batch_tokens: a micro-batch is one row of as many rows' tokens as fit
    packed_tokens: int | None = None
    flash: bool = False  # model.attn_implementation flash_attention_*: varlen, no 4-D mask
    #: memory.fused_loss on: the LM head's gradients are made in its forward
    #: (r1fit/algorithms/logprobs.py fused_head_loss), nothing of it is kept for backward
    fused_loss: bool = False
    #: algo.entropy_coef > 0: the head's backward holds a chunk's probabilities too
    entropy_grad: bool = False
    #: rollout.share_prefill=true: a generation chunk prefills each prompt it touches once
    #: (r1fit/rollout/prefill.py)
    share_prefill: bool = False
    #: model.lora.compute_dtype=model on a 16-bit model: the adapters compute in ``b`` bytes
    #: under torch.autocast, from its copies of their float32 weights
    adapters_in_dtype: bool = False
    #: with tools: the vision patches of one trajectory's images (:func:`trajectory_patches`),
    #: which every row of a micro-batch runs through the tower on its own; None: a row's images
    #: are its prompt's
    trajectory_patches: int | None = None

    @property
    def mask(self) -> str:
        """The attention mask a training micro-batch carries: 'padding' (boolean, which SDPA
        copies to float in every layer), 'additive' (a packed row's [T x T] in the model's
        dtype, saved as it is) or 'none' (packed for flash attention's varlen kernels)."""
        if self.packed_tokens is not None and self.flash and not self.share_prefix:
            return "none"
        return "additive" if self.share_prefix or self.packed_tokens is not None else "padding"

    @property
    def lora(self) -> bool:
        return self.lora_r > 0

    @property
    def adapter_bytes(self) -> int:
        """Bytes of the element the adapters compute in: float32 as peft has them (their input
        cast up), the model's with ``model.lora.compute_dtype=model``."""
        return self.b if self.adapters_in_dtype else ADAPTER_BYTES

    @property
    def adapter_copies(self) -> int:
        """Bytes of autocast's copies of the adapter weights in the model's dtype, held from an
        adapter's first product in a forward to its end (and, kept for backward, beyond)."""
        return (self.b * self.lora_r * self.facts.lora_in_plus_out
                if self.lora and self.adapters_in_dtype else 0)

    @property
    def length(self) -> int:
        return self.prompt.tokens + self.completion

    @property
    def patches(self) -> int:
        """Vision patches of one prompt's images (0 without a vision tower)."""
        return self.prompt.patches if self.facts.vision is not None else 0

    def pixels(self, rows: int) -> int:
        """Bytes of the pixel values of ``rows`` prompts' images."""
        return pixel_bytes(self.facts.vision, rows * self.patches)

    @property
    def row_patches(self) -> int:
        """Vision patches of the images a training row runs through the tower: its prompt's, or
        with tools its trajectory's."""
        return self.patches if self.trajectory_patches is None else self.trajectory_patches

    def trajectory_pixels(self, rows: int) -> int:
        """With tools: bytes of the pixel values of ``rows`` trajectories' images (0 without)."""
        return pixel_bytes(self.facts.vision, rows * (self.trajectory_patches or 0))

    def training_patches(self, rows: int) -> int:
        """Vision patches a micro-batch of ``rows`` completions runs through the tower."""
        return self.images(rows) * self.row_patches

    def token_cut(self) -> TokenCut:
        """With ``packed_tokens``: every GPU's share cut into micro-batches as the loop cuts
        them (:func:`r1fit.data.batch.token_slices`; every completion ``completion`` long, a
        group's prompt once per micro-batch with ``share_prefix``), the largest of each."""
        from r1fit.data.batch import token_slices

        assert self.packed_tokens is not None
        n = self.rows_per_gpu
        rows = tokens = images = count = 0
        for gpu in range(self.gpus):
            first = gpu * n
            continues = [self.share_prefix and i > first and i // self.group == (i - 1) // self.group
                         for i in range(first, first + n)]
            slices = list(token_slices([self.prompt.tokens] * n, [self.completion] * n, continues,
                                       self.packed_tokens))
            rows = max([rows, *(end - start for start, end, _, _ in slices)])
            tokens = max([tokens, *(used for _, _, used, _ in slices)])
            images = max([images, *(prompts for _, _, _, prompts in slices)])
            count = max(count, len(slices))
        return TokenCut(rows=rows, tokens=tokens, images=images, count=count)

    def images(self, rows: int) -> int:
        """Rows whose images a micro-batch of ``rows`` completions runs through the tower: one
        per sequence, or packed by tokens the most prompts a micro-batch holds; with tools every
        completion, whose trajectory has images of its own."""
        if self.trajectory_patches is not None:
            return self.token_cut().rows if self.packed_tokens is not None else rows
        return self.token_cut().images if self.packed_tokens is not None else self.packed(rows)[0]

    def packed(self, rows: int) -> tuple[int, int]:
        """What the model runs for a micro-batch of ``rows`` completions: (sequences, tokens per
        sequence). One row per completion; with ``share_prefix`` one per group the micro-batch
        touches, its prompt then its completions there, padded to the widest: the largest of
        either over the micro-batches of every GPU's contiguous share of the step's rows (a
        micro-batch straddles two groups when its size and the group's do not divide). Packed
        by tokens (``packed_tokens``): one sequence, the most tokens a micro-batch holds."""
        if self.packed_tokens is not None:
            return 1, self.token_cut().tokens
        if not self.share_prefix:
            return rows, self.length
        groups, completions = self.groups_touched(rows)
        return groups, self.prompt.tokens + completions * self.completion

    def groups_touched(self, rows: int) -> tuple[int, int]:
        """Cutting every GPU's contiguous share of the step's rows into chunks of ``rows``: the
        most groups a chunk touches, and the most completions of one group in a chunk."""
        groups = completions = 1
        for gpu in range(self.gpus):
            first = gpu * self.rows_per_gpu
            for start in range(first, first + self.rows_per_gpu, rows):
                runs = group_runs(start, min(start + rows, first + self.rows_per_gpu), self.group)
                groups = max(groups, len(runs))
                completions = max(completions, *runs)
        return groups, completions


@dataclass(frozen=True)
class TokenCut:
    """Micro-batches packed by tokens, the largest of each over every GPU's share: rows, tokens,
    prompts (whose images run), and micro-batches per update."""

    rows: int
    tokens: int
    images: int
    count: int


def generation_bytes(step: StepShape, rows: int, sampling: int) -> int:
    """A generation chunk of ``rows`` rows under no_grad, KV cache on: its largest moment."""
    t, v, b = step.facts.text, step.facts.vision, step.b
    P, T = step.prompt.tokens, step.length
    # with share_prefill the prefill runs each prompt the chunk touches once, then its cache is
    # copied to the chunk's rows (the copies and the prompts' own cache at once, at most)
    prompts = min(rows, step.groups_touched(rows)[0]) if step.share_prefill else rows
    shared = prompts < rows  # no prompt repeats: generate prefills every row as usual
    patches = prompts * step.patches
    # the vision tower runs after the text embeddings exist, and its output is merged into them
    prefill_vision = (vision_forward_bytes(v, b, patches)
                      + prompts * (P + step.prompt.image_tokens) * t.hidden * b)
    prefill = kv_cache_bytes(t, b, prompts, P) + lm_forward_bytes(t, b, prompts, P, step.eager)
    if shared:
        prefill = max(prefill, kv_cache_bytes(t, b, rows + prompts, P))
    decode = (kv_cache_bytes(t, b, rows, T)
              + rows * T * t.kv_dim * b  # torch.cat grows one layer's K (or V)
              + rows * t.vocab * (b + sampling * F32 + 1))  # + the model's logits and a bool mask
    return step.pixels(rows) + max(prefill_vision, prefill, decode)


def logprobs_bytes(step: StepShape, rows: int, chunk: int) -> int:
    """Old-policy or reference log-probs of ``rows`` rows under no_grad: their largest moment."""
    t, v, b = step.facts.text, step.facts.vision, step.b
    sequences, width = step.packed(rows)
    patches = step.training_patches(rows)
    head = (sequences * width * t.hidden * b  # the backbone's output
            + _head_input(step, rows) + chunk_forward_bytes(t.vocab, b, chunk))
    return pixel_bytes(v, patches) + max(vision_forward_bytes(v, b, patches),
                                         lm_forward_bytes(t, b, sequences, width, step.eager),
                                         head)


def _head_input(step: StepShape, rows: int) -> int:
    """hidden[mask]: the completion tokens' hidden states, the chunked head's saved input."""
    return rows * step.completion * step.facts.text.hidden * step.b


@dataclass(frozen=True)
class Activations:
    """What a training micro-batch keeps for the language model's backward."""

    on: int  # with gradient checkpointing, ``recompute`` included
    off: int  # without
    recompute: int  # the layer a checkpointed backward rebuilds

    def kept(self, checkpointing: bool) -> int:
        return self.on if checkpointing else self.off


def lm_activations(step: StepShape, rows: int, checkpointed: int | None = None) -> Activations:
    """The language model's saved activations for ``rows`` rows, with and without checkpointing;
    with it, ``checkpointed`` of the decoder layers recompute (None: all) and the others keep
    theirs."""
    f, b = step.facts, step.b
    t, H = f.text, f.text.hidden
    sequences, T = step.packed(rows)
    tokens = sequences * T
    # a packed micro-batch's mask is already additive in the model's dtype: SDPA saves it as it
    # is, with no copy of its own per layer (the KV heads are repeated all the same)
    layer = layer_saved_per_token(t, b, lora_targets=f.lora_targets if step.lora else None,
                                  lora_r=step.lora_r, mask_len=0 if step.mask == "none" else T,
                                  eager_len=T if step.eager else 0,
                                  mask_copy=step.mask == "padding",
                                  adapter_bytes=step.adapter_bytes)
    outside = (2 * b * t.head_dim * t.rotary_sets  # rotary cos/sin, alive for every layer
               + F32 * H + F32 + (t.norm_product_bytes(b) * H if not step.lora else 0))  # final norm
    # the mask shared by the layers: boolean padding, or the packing's additive [T x T] per row
    mask = sequences * T * T * {"padding": 1, "additive": b, "none": 0}[step.mask]
    shared = _head_input(step, rows) + mask
    recompute = tokens * layer  # checkpointing: one layer's activations rebuilt in backward
    if b == F32:
        # in a float32 model the rebuilt layer's first norm saves its input as it is: the
        # layer's checkpointed input, counted below, not a float32 copy of its own (traced on
        # builtin:tiny: no allocation of its own at the peak)
        recompute -= tokens * F32 * H
    c = t.layers if checkpointed is None else min(checkpointed, t.layers)
    recompute = recompute if c else 0
    return Activations(on=tokens * (c * b * H + (t.layers - c) * layer + outside) + shared
                       + recompute,
                       off=tokens * (t.layers * layer + outside) + shared, recompute=recompute)


def vision_activations(step: StepShape, rows: int, checkpointing: bool,
                       checkpointed: int | None = None) -> tuple[int, int]:
    """The vision tower over ``rows`` rows' images: what it keeps for backward, and its peak;
    with checkpointing, ``checkpointed`` of its blocks recompute (None: all)."""
    v, b = step.facts.vision, step.b
    n = step.training_patches(rows)  # a group's prompt images once when it is packed
    if not (step.vision_trains and n):
        forward = vision_forward_bytes(v, b, n)  # transient, before the language model runs
        return forward, forward
    block = vision_block_saved_per_patch(v, b)
    c = (v.depth if checkpointed is None else min(checkpointed, v.depth)) if checkpointing else 0
    saved = n * (c * b * v.hidden + (v.depth - c) * block + vision_other_saved_per_patch(v, b))
    return saved, saved + (n * block if c else 0)  # + a block recomputed


def into_grad(step: StepShape, s: Sizes) -> bool:
    """Whether a micro-batch's LM head (and a plain input embedding) adds its [vocab x hidden]
    gradient into the existing ``.grad`` in place (r1fit/algorithms/embedding.py): one process,
    full fine-tuning, from the second micro-batch on, the moments the plan's peak is taken at."""
    return not step.lora and s.gpus == 1 and s.micro_batches > 1


def head_chunk_bytes(step: StepShape, rows: int, chunk: int, new_grad: bool = True) -> int:
    """The LM head's temporaries for ``rows`` rows: a chunk's logits, or its gradient buffers
    (``new_grad``: a [vocab x hidden] weight gradient of its own, not added into ``.grad``).
    With ``step.fused_loss`` both at once, in the forward: the chunk's logits become their
    gradient in place, beside the head's input and the gradients it fills (the gradient of
    hidden[mask] takes the place of the saved input that :func:`lm_activations` counts)."""
    t, b = step.facts.text, step.b
    # zeros_like(head.weight)
    grad_weight = t.vocab * t.hidden * b if not step.lora and new_grad else 0
    sequences, width = step.packed(rows)
    backbone_out = sequences * width * t.hidden * b  # the backbone's output, still held
    if step.fused_loss:
        return (backbone_out + _head_input(step, rows) + grad_weight
                + max(chunk_forward_bytes(t.vocab, b, chunk),
                      chunk_backward_bytes(t.vocab, b, chunk, step.entropy_grad)))
    return max(backbone_out + chunk_forward_bytes(t.vocab, b, chunk),
               grad_weight + _head_input(step, rows)  # + the gradient of hidden[mask]
               + chunk_backward_bytes(t.vocab, b, chunk, step.entropy_grad))


def layer_backward_bytes(step: StepShape, s: Sizes, fsdp: FsdpBuffers) -> int:
    """Gradients alive inside one decoder layer's backward, for a micro-batch."""
    t, b = step.facts.text, step.b
    sequences, width = step.packed(s.micro)
    temp = sequences * width * layer_backward_temp_per_token(t, b)
    if s.gpus > 1:  # the unit's own unsharded gradients, fresh each micro-batch, + reduce-scatter
        return temp + fsdp.layer_grad + fsdp.reduce_scatter + fsdp.head_grad
    accumulating = s.micro_batches > 1  # the weight's gradient is added into an existing .grad
    return (temp + (step.facts.largest_layer_weight * b if accumulating and not step.lora else 0)
            + held_head_grad(step, s))


def held_head_grad(step: StepShape, s: Sizes) -> int:
    """A tied LM head's gradient, held from the head's backward to the end of the backward (one
    process, full fine-tuning): the head and the embedding share one parameter, so autograd
    keeps the head's [vocab x hidden] contribution in the parameter's input buffer until the
    embedding's arrives, the backward's last (under FSDP, ``FsdpBuffers.head_grad``)."""
    t = step.facts.text
    tied = step.facts.tied_head and not step.lora and s.gpus == 1
    # added into .grad in place instead, when it exists: nothing held
    return t.vocab * t.hidden * step.b if tied and not into_grad(step, s) else 0


def backward_end_bytes(step: StepShape, s: Sizes, fsdp: FsdpBuffers) -> int:
    """Gradients alive at the end of a micro-batch's backward, beyond the trainable ones."""
    if s.gpus > 1:
        # the root's post-backward: its gathered weights and gradients (the embedding's dense
        # [vocab x hidden] one included), and their reduce-scatter copy
        return fsdp.root_unit + fsdp.root_grad + fsdp.reduce_scatter
    # the embedding's dense [vocab x hidden] gradient, beside the .grad it is added into (from
    # the second micro-batch on) and, tied, beside the head's held contribution it is summed
    # with first; with one micro-batch an untied one becomes the .grad
    t = step.facts.text
    if step.lora or (s.micro_batches == 1 and not step.facts.tied_head):
        return 0
    dense = t.vocab * t.hidden * step.b
    if into_grad(step, s):
        # from the second micro-batch on the head adds into .grad in place, and a plain
        # embedding too. A tied one's first micro-batch still sums the head's held gradient and
        # the embedding's dense one into the new .grad (one [vocab x hidden] beyond it, with
        # every other .grad made); an embedding r1fit cannot replace (Gemma's scaled one) makes
        # its dense gradient beside .grad every time
        return dense if step.facts.tied_head or not step.facts.embedding_into_grad else 0
    return dense + (held_head_grad(step, s) if s.micro_batches > 1 else 0)


def patch_embed_backward_bytes(step: StepShape, s: Sizes) -> int:
    """What the patch embedding's backward holds beyond the ``.grad`` tensors and the
    micro-batch's pixel values, when the tower trains: its workspace (measured on CPU), the pixel
    values it saved for its weight's gradient in the compute dtype (float32 ones are the pixel
    values themselves), and from the second micro-batch on (one process) its new weight gradient,
    made beside the ``.grad`` it is then added into."""
    v = step.facts.vision
    if v is None or not step.vision_trains:
        return 0
    saved = step.training_patches(s.micro) * v.pixels_per_patch * step.b if step.b != F32 else 0
    new_grad = v.hidden * v.pixels_per_patch * step.b if s.micro_batches > 1 and s.gpus == 1 else 0
    return step.patch_embed_workspace + saved + new_grad


@dataclass(frozen=True)
class Update:
    """One micro-batch of the update: its peak, and the parts the plan reports."""

    peak: int
    activations: Activations
    logits_chunk: int
    vision: int


def update_bytes(step: StepShape, s: Sizes, states: States, fsdp: FsdpBuffers,
                 chunk: int) -> Update:
    """One micro-batch's forward and backward: the largest of its moments."""
    m = s.micro
    # what checkpointing recomputes when on (the plan reports both sides)
    text_layers, vision_blocks = step.facts.checkpointed(s.checkpoint_every)
    activations = lm_activations(step, m, text_layers)
    kept = activations.kept(s.checkpointing)
    rebuilt = activations.recompute if s.checkpointing else 0
    vision, vision_peak = vision_activations(step, m, s.checkpointing, vision_blocks)
    logits_chunk = head_chunk_bytes(step, m, chunk, new_grad=not into_grad(step, s))
    # from the second micro-batch on, every .grad exists
    grads_before = states.gradients if s.micro_batches > 1 else 0
    pixels = pixel_bytes(step.facts.vision, step.training_patches(m))
    # autocast's copies of the adapters (compute_dtype=model): made in the forward, kept for
    # its backward (all of them without checkpointing; with it, until the forward ends)
    before = grads_before + pixels + fsdp.all_gather + step.adapter_copies
    vision_saved = vision if step.vision_trains else 0  # kept for the tower's backward
    peak = max(
        # the vision tower (its backward, or no-grad forward)
        before + vision_peak + (fsdp.reduce_scatter + fsdp.head_grad + held_head_grad(step, s)
                                if step.vision_trains else 0),
        before + vision_saved + kept - rebuilt + logits_chunk,  # head: a chunk, or backward's start
        before + vision_saved + kept + layer_backward_bytes(step, s, fsdp),  # a layer's backward
        # the patch embedding's backward, the tower's first op (the input embedding's, made
        # before the tower in the forward, runs after it: autograd runs later nodes first)
        # (over FSDP with the root's post-backward buffers, as the end of backward counted them
        # with the workspace before the two moments were told apart: not measured apart)
        states.gradients + pixels + patch_embed_backward_bytes(step, s)
        + (backward_end_bytes(step, s, fsdp) if s.gpus > 1 else 0),
        # the end of backward
        states.gradients + pixels + backward_end_bytes(step, s, fsdp))
    return Update(peak=peak, activations=activations, logits_chunk=logits_chunk, vision=vision)


def cublas_workspaces() -> int:
    """The cuBLAS workspaces a step allocates through PyTorch's allocator: ``CUBLAS_THREADS`` of
    the size ``CUBLAS_WORKSPACE_CONFIG`` states (``:SIZE_KIB:COUNT`` pairs, summed as PyTorch
    does), else of ``CUBLAS_DEFAULT_WORKSPACE`` (also what ``train.deterministic`` sets when the
    variable is unset: ``:4096:8``)."""
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    size = sum(int(kib) * 1024 * int(count) for kib, count in pairs) if pairs else (
        CUBLAS_DEFAULT_WORKSPACE)
    return CUBLAS_THREADS * size


def cuda_overhead(peak: int, cuda: bool) -> int:
    """The CUDA context and the allocator's slack at an allocated ``peak`` (0 on CPU)."""
    return (CUDA_CONTEXT_BYTES + int(CUDA_ALLOCATOR_SLACK * peak)) if cuda else 0


def _advice(plan: Plan, facts: ModelFacts, asked: Config, view: Callable[[Config], Config],
            prompt: PromptShape, sizes: Sizes, device_type: str, usable: int) -> list[str]:
    """What to change in ``asked``: smaller chunks when they are the problem, else the switches
    that would make micro_batch = generation_batch = 1 fit (each tried alone). ``view``: how the
    plan reads a config (:func:`sft_step` for an SFT plan)."""
    cfg = view(asked)
    out = []
    if 0 < plan.max_micro_batch < sizes.micro:
        out.append(f"memory.micro_batch={plan.max_micro_batch} (now {sizes.micro})")
    if 0 < plan.max_generation_batch < sizes.generation:
        out.append(f"memory.generation_batch={plan.max_generation_batch} "
                   f"(now {sizes.generation})")
    eval_rows, eval_tokens = sizes.evaluation
    if eval_rows > 1 and plan.peak_bytes > usable:  # fewer evaluation rows at once, if enough
        fewer = (eval_rows >> k for k in range(1, eval_rows.bit_length()))
        fits = next((n for n in fewer if _estimate(
            facts, cfg, prompt, replace(sizes, evaluation=(n, eval_tokens)), device_type,
            plan.budget_bytes).peak <= usable), None)
        if fits:
            out.append(f"eval.batch={fits} (now {eval_rows}: the evaluation's generation sets "
                       "the peak)")
    d = plan.details
    split = asked.split_problems(d["kind"], d["gpus"])
    if split:  # what splits over the GPUs: the nearest larger sizes (no memory switch mends it)
        out.extend(even_split_advice(asked, d["kind"], d["gpus"]))
    if plan.max_micro_batch and plan.max_generation_batch and plan.problems == split:
        return out
    switches: list[dict[str, Any]] = []  # each tried alone: one or two keys set together
    if d["engine_needs"] and d["engine_needs"] <= plan.budget_bytes:  # vLLM's share, enough
        least = least_share(d["engine_needs"], plan.budget_bytes)
        if least > cfg.rollout.vllm.gpu_memory_utilization:
            switches.append({"rollout.vllm.gpu_memory_utilization": least})
    if d["engine"] != "hf":  # generation on the policy itself: no copy, cache or graph pool
        switches.append({"rollout.engine": "hf"})
    if not cfg.memory.gradient_checkpointing:
        switches.append({"memory.gradient_checkpointing": True})
    if cfg.model.lora.r == 0:
        switches.append({"model.lora.r": 16})
        if facts.vision is not None and not cfg.model.freeze_vision:
            switches.append({"model.freeze_vision": True})
        if cfg.algo.beta > 0:  # no reference copy (offloading it is not implemented)
            switches.append({"algo.beta": 0})
    # fewer pixels mean fewer image tokens, except on a fixed-size tower (Gemma 3's SigLIP), which
    # resizes every image to its own size
    fixed = facts.vision is not None and facts.vision.image_size is not None
    if prompt.patches and not fixed and cfg.data.max_pixels >= 4 * 28 * 28:
        pixels = max(28 * 28, cfg.data.max_pixels // 4)
        switches.append({"data.max_pixels": pixels})
        if cfg.data.min_pixels > pixels:  # else the config is invalid (min_pixels > max_pixels)
            switches[-1]["data.min_pixels"] = pixels
    if run_dtype(cfg, facts) == "float32" and device_type == "cuda":
        switches.append({"model.dtype": "bfloat16"})
    # a smaller LM-head chunk, where one row's completion fills more than the smaller chunk (at
    # micro_batch 1 a chunk holds at most one row's tokens): [chunk x vocab] logits and their
    # gradient shrink in proportion, for a recompute of every chunk but the last in backward
    # where the head recomputes (with memory.fused_loss, auto's chunk is that small already);
    # advised only where the head's chunk sets the peak (else the smaller chunk lowers nothing)
    head_switch = {"memory.logits_chunk": SMALL_LOGITS_CHUNK}
    if min(cfg.head_chunk(), completion_tokens(cfg)) > SMALL_LOGITS_CHUNK:
        switches.append(head_switch)

    def smallest_peak(switch: dict[str, Any]) -> int:
        """The plan's peak at micro_batch = generation_batch = 1 with ``switch`` set."""
        changed = view(asked.with_values({**switch, "memory.micro_batch": 1,
                                          "memory.generation_batch": 1}))
        p = prompt_shape(changed, facts) if any(k.startswith("data.") for k in switch) else prompt
        f = model_facts(changed.model.path, changed.model.lora.target)
        return _estimate(f, changed, p, replace(sizes, micro=1, generation=1,
                                                checkpointing=changed.memory.gradient_checkpointing),
                         device_type, plan.budget_bytes).peak

    listed = len(out)
    for switch in switches:
        peak = smallest_peak(switch)
        if switch is head_switch and peak >= smallest_peak({}):
            continue
        verdict = "fits" if peak <= usable else "still does not fit"
        keys = shown_values(switch)
        out.append(f"{keys}: peak {format_bytes(peak)} at micro_batch = "
                   f"generation_batch = 1 ({verdict})")
    if len(out) == listed:
        out.append("nothing left to switch: use a device with more memory or a smaller model")
    return out


def shown_values(values: dict[str, Any]) -> str:
    """Config values as ``key=value`` words, as overrides are written."""
    return " ".join(f"{key}={_shown(value)}" for key, value in values.items())


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
