"""The time model: one step's seconds by phase, and the run's, predicted before launch.

It reads what the memory plan reads (the model's shapes, the step's sizes, the engine) and a
device's rates (:mod:`r1fit.memory.rates`: measured by ``r1fit doctor --calibrate``, else data
sheets). Every phase is a sum of two kinds of cost, each read from the rates:

- **work**: the model FLOPs of the phase (:mod:`r1fit.memory.flops`: 2 per multiply-add, the
  backward twice the forward's matrices, causal attention) over the device's matmul rate at the
  size of the model's matrices (its hidden width), or the bytes it must read over the copy
  bandwidth, whichever takes longer (a decode step reads every weight and the live KV cache
  for a handful of rows: memory-bound);
- **overhead**: the fixed seconds of running a decoder layer once (the calibration's
  ``layer_overhead_s``: its kernels' launches and Python), per layer and forward; a backward
  counts as two forwards. An engine that replays the decode step as CUDA graphs (static, vLLM)
  pays one launch per layer and step instead.

Phases, per process and step (``memory.generation_batch`` rows per generation chunk, except on
vLLM, which takes all of the process's rows in one call; ``memory.micro_batch`` per micro-batch;
every completion taken as ``algo.max_new_tokens`` long, as the memory plan takes it; with tools
the trajectory's budget; the process's rows starting on a group boundary, as the first
process's do):

- ``generate``: per chunk, the prefill of its prompts (each distinct prompt the chunk touches
  once where the engine shares them: static, vLLM, ``rollout.share_prefill=true``; the vision
  tower included), then one decode step per token after the first, at the chunk's mean context,
  each with the sampler over every row's vocabulary (the calibrated seconds per logit) and, on
  HF generate, its own loop's cost per step (calibrated); HF generate with LoRA
  runs peft's adapters unmerged (their calibrated cost per adapted Linear); with tools as turns
  (:func:`turn_fields`: as many whole turns as the trajectory's budget holds, or a run's mean),
  each later one for the share of rows that reach it, after a prefill of its tool turn
  (the kept cache) or of the whole context (HF generate), tool images through the tower;
- ``score``: the reward functions, ``SCORE_SECONDS_PER_ROW`` per row (string work);
- ``logprobs``: the reference's forward (``algo.beta`` > 0; under full fine-tuning its own model,
  with LoRA the policy's base layers under peft's ``disable_adapter``: no adapter work) and, with
  ``algo.kl_in_reward``, the policy's forward (its adapters included) before the first update;
- ``update``: ``algo.num_iterations`` forwards and backwards (the recomputed forward of
  checkpointed layers included, and of checkpointed vision blocks where the tower trains, the
  layers' element-wise work, LoRA's unmerged adapters, and the head's work over the vocabulary
  per completion token) and
  as many AdamW steps (reading and writing the trainable weights, gradients and two float32
  moments, and a fixed cost per parameter tensor), with the calibrated fixed cost of a
  micro-batch and of an update beyond the model (``micro_batch_s``, ``update_s``);
- ``checkpoint``: a save's bytes (trainable weights, their AdamW moments) over the disk's write
  rate, once every ``checkpoint.every`` steps (spread over them).

The log-prob passes and updates run one sequence per row, or with ``memory.share_prefix`` one per
group a micro-batch touches (its prompt once, then that micro-batch's completions of it; as
:func:`r1fit.memory.flops.group_shapes` cuts them): their FLOPs, element-wise work and float32
adapter casts are over those sequences' tokens.

Over several processes (torchrun, FSDP2: :class:`Traffic`), each collective costs a fixed time,
the bytes each process sends and receives ((n-1)/n of the whole tensor's) over the link's bus
bandwidth, and FSDP2's copies in and out at the rate of a copy into new memory (the link
measured by :mod:`r1fit.memory.link`, else a data sheet's). ``generate`` gathers the policy once (the HF
engine's ``gathered()``); each micro-batch of a log-prob pass gathers every unit (the root once a
pass), of an update every unit and the units its backward runs through, and reduce-scatters their
gradients; an update all-reduces the gradient norm. On CUDA FSDP2 runs them on streams of their own beside the
compute: a phase takes the longer of the two plus what cannot overlap (a pass's first gather,
its last reduce-scatter); on a CPU they run in turn with the compute.

Left out: tool calls' own time (a run logs it as ``tools/seconds``; the slow-phase alarm takes
it out of generation), the weight sync of vLLM (over several processes too),
evaluation when the eval set's size is not known before loading it, and dynamic sampling's
extra draws (``algo.dynamic_sampling``: up to ``algo.max_resample_batches``
generations and scorings a step; one drawn batch per step is timed).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from r1fit.config import Config
from r1fit.memory.planner.facts import (
    ModelFacts,
    PromptShape,
    group_runs,
    run_dtype,
    shares_prompt_cache,
    tool_turn_shape,
)

if TYPE_CHECKING:  # torch's modules: imported where a plan is timed, not with the planner
    from r1fit.memory.flops import GroupShape, ModelShape
    from r1fit.memory.rates import DeviceRates

#: the reward functions' seconds per row (string parsing; measured ~0.1 ms on the built-in task)
SCORE_SECONDS_PER_ROW = 1e-4
#: bytes AdamW reads and writes per trainable element: the weight (read, write), its gradient
#: (read), two float32 moments (read, write); with the weight in the run's dtype
ADAM_MOMENT_BYTES = 16
#: bytes FSDP2 copies per byte of a whole unit, read and written, around its collectives: an
#: all-gather's (per byte of the shard copied in, and of the gathered unit copied out to its
#: parameters), a reduce-scatter's (the unit's gradients copied into its input)
COPY_IN_OUT = (2, 2)
#: kernels peft adds per adapted Linear in an unmerged forward (dropout, A, B, scaled add)
LORA_KERNELS = 4
#: bytes peft's float32 adapters on a 16-bit model move per token beyond adapters computing in
#: the model's dtype, as (per input, per output element) of an adapted Linear, in a forward and
#: in a backward: the input's float32 copy, the float32 product, scaling and sum, the cast back
#: and their gradients. Counted op by op over peft's Linear (tests/memory/planner/test_timing.py)
CAST_FORWARD_BYTES = (8, 16)
CAST_BACKWARD_BYTES = (10, 20)
#: phases in the order a step runs them
PHASES = ("generate", "score", "logprobs", "update", "checkpoint")


@dataclass(frozen=True)
class TimePlan:
    """Predicted seconds of one step by phase (``PHASES``), the step, the run.

    ``tokens_per_second``: the step's completion tokens (every process's) over its seconds;
    ``run_seconds``: the run's ``steps`` (``train.max_steps``; ``r1fit sft``: ``sft.steps``),
    plus the evaluations when their size is known (``eval_seconds`` each, ``evaluations`` of
    them), not ``warmup_steps`` (``r1fit train``'s format warm-up, SFT steps of another
    shape); ``dominant``: the phase that takes longest; ``source``: where the device's rates
    came from; ``advice``: what would shorten the step."""

    phases: dict[str, float]
    step_seconds: float
    tokens_per_second: float
    run_seconds: float
    steps: int
    evaluations: int
    eval_seconds: float | None
    dominant: str
    source: str
    advice: list[str] = field(default_factory=list)
    details: dict[str, float] = field(default_factory=dict)
    warmup_steps: int = 0
    #: over several processes: their count and the link's rate and source (FSDP2's collectives)
    link: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Traffic:
    """FSDP2's collectives over ``processes`` processes, as r1fit/distributed/parallelize.py sets
    it up: one all-gather per unit (each decoder layer, each vision block, the root) and one
    reduce-scatter per unit with gradients, in bytes of the whole (unsharded) tensors, at the
    dtype they travel in (gathered in bfloat16 on CUDA when stored in float32; gradients reduced
    in float32 on CUDA; as stored on a CPU).

    - a whole gather (``gather_bytes`` over ``units`` collectives): a forward of the policy, and
      generation's, which gathers every unit once before its first token (``gathered()``);
    - the root (``root_bytes``) is not resharded after a forward: a log-prob pass gathers it
      once, an update once per micro-batch (its backward reshards it);
    - a backward re-gathers the units it runs through (``backward_bytes`` over
      ``backward_units``: the decoder layers, the vision blocks where the tower trains, else the
      last vision block, which FSDP2's backward prefetch gathers after the first decoder layer's
      backward though no gradient reaches it; the root stays gathered from its forward) and
      reduce-scatters their gradients (``reduce_bytes`` over ``reduce_units``);
    - the reference of full fine-tuning is a model of its own, sharded alike
      (``reference_bytes``; with LoRA the reference pass gathers the policy's units);
    - ``overlapped``: FSDP2 runs its collectives on streams of their own beside the compute
      (CUDA), the next unit's all-gather during this one's forward or backward; on a CPU they
      run in turn with it."""

    processes: int
    units: int
    gather_bytes: int
    backward_units: int
    backward_bytes: int
    reduce_units: int
    reduce_bytes: int
    reference_bytes: int
    overlapped: bool
    root_bytes: int = 0  # the root's own parameters, of ``gather_bytes``
    reference_root_bytes: int = 0  # the full fine-tuning reference's root, of its bytes


@dataclass(frozen=True)
class TimeShape:
    """What the time model reads of a planned step (one process's share)."""

    shape: ModelShape  # the FLOP count's matrices, adapted to the run (LoRA, trained parts)
    layers: int  # decoder layers
    vision_blocks: int
    hidden: int
    kv_bytes_per_token: int  # keys and values of one token, all layers
    vocab: int
    weight_bytes: int  # the decoder's matrices and LM head, as stored (read per decode step)
    bytes_per_element: int
    dtype: str  # the computing dtype's name (bfloat16, float32)
    lora_linears_per_layer: int
    prompt: int  # tokens of a prompt, images included
    patches: int  # vision patches of a prompt's images
    completion: int  # tokens after the prompt
    group: int  # completions per prompt
    rows: int  # of a step, on this process
    generation_batch: int
    micro_batch: int
    shares_prompts: bool  # a generation chunk prefills each distinct prompt once
    graphs: bool  # the decode step replayed as CUDA graphs
    unmerged_lora: bool  # HF generate runs peft's adapters beside the base weights
    engine: str  # hf, static or vllm
    reference_pass: bool
    iterations: int
    checkpointed_fraction: float  # of the decoder's layers recomputed in backward
    trainable: int  # elements
    checkpoint_every: int
    trainable_tensors: int = 0  # parameter tensors the optimizer steps
    #: the static engine holds a group's prompt once (rollout.static.share_prompt): a decode
    #: step reads each prompt's keys and values once, not once per row
    prompt_cache_shared: bool = False
    #: LoRA's float32 adapters on a 16-bit model as peft runs them (model.lora.compute_dtype
    #: float32): their products in float32, their input cast up; over ``lora_in`` input and
    #: ``lora_out`` output elements per token (every adapted Linear's, all layers)
    adapter_cast: bool = False
    lora_in: int = 0
    lora_out: int = 0
    #: memory.share_prefix on: a log-prob pass or update runs each group's prompt once per
    #: micro-batch, then that micro-batch's completions of it
    share_prefix: bool = False
    #: algo.kl_in_reward: a forward of the policy over every row before the first update
    policy_pass: bool = False
    #: of the vision tower's blocks recomputed in backward (the tower trains, checkpointing on)
    vision_checkpointed_fraction: float = 0.0
    #: FSDP2's collectives over several processes (None: one process)
    traffic: Traffic | None = None
    #: with tools: the trajectory's turns (a mean where measured), each policy turn
    #: ``turn_tokens`` long (0: ``completion``), each tool turn ``tool_tokens`` tokens and
    #: ``tool_images`` images of ``tool_patches`` vision patches each (means over tool turns)
    turns: float = 1.0
    turn_tokens: float = 0.0
    tool_tokens: float = 0.0
    tool_images: float = 0.0
    tool_patches: int = 0
    #: each turn after the first prefills the row's whole context (HF generate; the static
    #: engine without its kept cache, or when a tool turn shows images to a model that does not
    #: place them by its own rule: Gemma 3), else only what the tool turn added
    refill: bool = False


def run_shape(facts: ModelFacts, cfg: Config, prompt: PromptShape, *, rows: int,
              generation_batch: int, micro_batch: int, completion: int, engine: str,
              device_type: str, dtype: str) -> TimeShape:
    """The :class:`TimeShape` of one planned step (the memory plan's sizes and engine; FSDP2's
    collectives, over several processes, are added by the planner: ``traffic``).
    ``memory.share_prefix`` is read as set; 'auto' is timed as off (the per-row path): the
    planner passes ``cfg`` with the value the memory plan planned (``details["share_prefix"]``).
    With tools, a trajectory of ``rollout.max_turns`` policy turns fills the ``completion``
    budget (:func:`turn_fields`)."""
    lora = cfg.model.lora.r > 0
    base = facts.shape
    assert base is not None, "model facts without a FLOP shape"
    vision_trains = facts.vision is not None and not lora and not cfg.model.freeze_vision
    shape = replace(base, lora_matrix=cfg.model.lora.r * facts.lora_in_plus_out if lora else 0,
                    text_frozen=base.text_matrix if lora else 0, head_trains=not lora,
                    vision_trains=vision_trains)
    b = {"bfloat16": 2, "float16": 2}.get(dtype, 4)
    t = facts.text
    trainable = (shape.lora_matrix if lora else
                 facts.params - (0 if vision_trains else facts.vision_params))
    layers_ckpt, blocks_ckpt = facts.checkpointed(cfg.memory.checkpoint_every)
    depth = facts.vision.depth if facts.vision else 0
    return TimeShape(
        **turn_fields(facts, cfg, prompt, completion=completion, engine=engine),
        shape=shape, layers=t.layers, vision_blocks=depth,
        hidden=t.hidden, kv_bytes_per_token=2 * t.kv_dim * t.layers * b, vocab=t.vocab,
        weight_bytes=(base.text_matrix + base.head) * b, bytes_per_element=b, dtype=dtype,
        lora_linears_per_layer=facts.lora_layers // max(t.layers, 1) if lora else 0,
        prompt=prompt.tokens, patches=prompt.patches if facts.vision else 0,
        completion=completion, group=cfg.algo.num_generations, rows=rows,
        generation_batch=generation_batch, micro_batch=micro_batch,
        shares_prompts=engine in ("static", "vllm") or (
            engine == "hf" and not cfg.tools and cfg.rollout.share_prefill is True),
        graphs=device_type == "cuda" and (engine == "vllm" or (
            engine == "static" and cfg.rollout.static.cuda_graphs is not False)),
        unmerged_lora=lora and engine == "hf", engine=engine,
        reference_pass=cfg.algo.beta > 0, iterations=cfg.algo.num_iterations,
        checkpointed_fraction=(layers_ckpt / t.layers if cfg.memory.gradient_checkpointing
                               and t.layers else 0.0),
        # a trained tower's blocks are checkpointed layers too; a frozen one has no backward
        vision_checkpointed_fraction=(blocks_ckpt / depth if cfg.memory.gradient_checkpointing
                                      and vision_trains and depth else 0.0),
        share_prefix=cfg.memory.share_prefix is True, policy_pass=cfg.algo.kl_in_reward,
        trainable=trainable, checkpoint_every=cfg.checkpoint.every,
        prompt_cache_shared=engine == "static" and shares_prompt_cache(facts, cfg),
        # peft's float32 adapters on a 16-bit model (not float32 weights that FSDP gathers in
        # bfloat16, adapters too)
        adapter_cast=(lora and b < 4 and cfg.model.lora.compute_dtype == "float32"
                      and run_dtype(cfg, facts) == dtype),
        lora_in=sum(i for i, _ in facts.lora_linears) if lora else 0,
        lora_out=sum(o for _, o in facts.lora_linears) if lora else 0,
        trainable_tensors=2 * facts.lora_layers if lora else facts.param_tensors - (
            0 if vision_trains else facts.vision_param_tensors))


def turn_fields(facts: ModelFacts, cfg: Config, prompt: PromptShape, *, completion: int,
                engine: str, turns: float | None = None) -> dict[str, Any]:
    """:class:`TimeShape`'s turn fields: with tools, ``turns`` policy turns (default
    ``rollout.max_turns``, the most; a run's mean ``turns_mean`` to time the turns it took)
    filling the ``completion`` budget, each policy turn up to ``algo.max_new_tokens``, the tool
    turns as :func:`~r1fit.memory.planner.facts.tool_turn_shape` takes them; without, one turn
    of ``completion`` tokens."""
    if not cfg.tools:
        return {"turn_tokens": float(completion)}
    tools = tool_turn_shape(cfg, facts, prompt, turns)
    # the policy's tokens of a turn: the budget less the tool turns, shared by the turns
    turn_tokens = min(float(cfg.algo.max_new_tokens),
                      max(completion - (tools.turns - 1) * tools.tokens, tools.turns)
                      / tools.turns)
    return {"turns": tools.turns, "turn_tokens": turn_tokens, "tool_tokens": tools.tokens,
            "tool_images": tools.images, "tool_patches": tools.image_patches,
            "refill": engine == "hf" or (engine == "static" and (
                not cfg.rollout.static.keep_cache
                or (tools.images > 0 and not facts.places_images)))}


def _work(flops: float, nbytes: float, s: TimeShape, rates: DeviceRates,
          rows: int | None = None) -> float:
    """Seconds of ``flops`` of the model's matrices that must read ``nbytes``: the longer of the
    two at the device's rates (``rows``: a decode step's, whose products run at the skinny
    rate)."""
    rate = rates.matmul_rate(s.dtype, s.hidden) if rows is None else \
        rates.skinny_rate(s.dtype, rows, s.hidden)
    return max(flops / rate, nbytes / rates.copy_bytes_per_s)


def _forward_overhead(s: TimeShape, rates: DeviceRates, *, vision: bool = False) -> float:
    """The fixed seconds of one eager forward: every decoder layer once (and vision block)."""
    return (s.layers + (s.vision_blocks if vision else 0)) * rates.layer_overhead_s()


def _adapters(s: TimeShape, rates: DeviceRates) -> float:
    """The fixed seconds peft's unmerged adapters add to one forward of the decoder layers (the
    calibrated cost per adapted Linear, else ``LORA_KERNELS`` launches each)."""
    per_linear = rates.lora_s_per_linear or LORA_KERNELS * rates.launch_s
    return s.layers * s.lora_linears_per_layer * per_linear


def _adapter_cast(s: TimeShape, rates: DeviceRates, tokens: float, forwards: float, *,
                  backward: bool = True) -> float:
    """Seconds peft's float32 adapters on a 16-bit model add to ``forwards`` forwards (a
    recomputed one counts) and, with ``backward``, one backward over ``tokens`` tokens, beyond
    adapters computing in the model's dtype: their products at the float32 rate (on a GPU torch
    runs them without tensor cores unless TF32 is allowed), and the bytes of ``CAST_*_BYTES``."""
    if not s.adapter_cast:
        return 0.0
    per_token = forwards * (CAST_FORWARD_BYTES[0] * s.lora_in + CAST_FORWARD_BYTES[1] * s.lora_out)
    if backward:
        per_token += CAST_BACKWARD_BYTES[0] * s.lora_in + CAST_BACKWARD_BYTES[1] * s.lora_out
    # a forward's products and the backward's two, 2 FLOPs per multiply-add
    flops = 2 * s.shape.lora_matrix * tokens * (forwards + (2 if backward else 0))
    slower = max(1 / rates.matmul_rate("float32", s.hidden) - 1 / rates.matmul_rate(
        s.dtype, s.hidden), 0.0)
    return flops * slower + tokens * per_token / rates.copy_bytes_per_s


def _elementwise(s: TimeShape, rates: DeviceRates, tokens: float, *, train: bool = False
                 ) -> float:
    """Seconds of the decoder layers' element-wise work over ``tokens`` tokens: a forward, or
    with ``train`` a forward and backward (the calibrated rates, :meth:`DeviceRates.elementwise_s`)."""
    forward, both = rates.elementwise_s(s.dtype, s.hidden)
    return s.layers * tokens * (both if train else forward)


def prompts_in_chunk(s: TimeShape, start: int, rows: int) -> int:
    """Prompts a generation chunk of ``rows`` rows from row ``start`` prefills: each distinct one
    it touches once where the engine shares them, else every row. (Not
    :func:`r1fit.memory.planner.facts.prompts_in_rows`, the memory plan's bound for a chunk
    anywhere: it adds one whenever ``rows`` is not a multiple of the group.)"""
    if not s.shares_prompts:
        return rows
    return len(group_runs(start, start + rows, s.group))


def generation_seconds(s: TimeShape, rates: DeviceRates, rows: int, completion: int
                       ) -> tuple[float, float]:
    """(prefill, decode) seconds of ``rows`` rows generated ``s.generation_batch`` at a time
    (chunks from row 0), ``completion`` tokens each; with tools (``s.turns`` > 1, at the step's
    own ``completion``) as turns: the first from the prompt, each later one for the share of
    the chunk's rows that reach it, after a prefill of its tool turn or of the whole context
    (``s.refill``)."""
    from r1fit.memory.flops import forward_flops

    prefill = decode = 0.0
    own = completion == s.completion  # the step's shape (an evaluation may generate others)
    turns = s.turns if own else 1.0
    tokens = (s.turn_tokens or float(completion)) if own else float(completion)  # a turn's
    patches = (s.patches,) if s.patches else ()
    one = forward_flops(s.shape, context=0, tokens=s.prompt, head_tokens=1, patches=patches)
    for start in range(0, rows, s.generation_batch):
        chunk = min(s.generation_batch, rows - start)
        n = prompts_in_chunk(s, start, chunk)
        prefill += _work(n * one, s.weight_bytes, s, rates) + _forward_overhead(
            s, rates, vision=bool(patches)) + _elementwise(s, rates, n * s.prompt)
        decode += decode_seconds(s, rates, chunk, s.prompt, tokens, prompts=n)
        for k in range(1, math.ceil(turns)):
            share = min(turns - k, 1.0)  # of the rows, those whose trajectory reaches turn k + 1
            # the turn runs when one of the chunk's rows reaches it (rows taken as independent):
            # then for share / reach of them, its fixed costs paid once
            reach = 1 - (1 - share) ** chunk
            live = chunk * share / reach
            context = s.prompt + k * (tokens + s.tool_tokens)  # before its policy tokens
            prefill += reach * turn_prefill_seconds(s, rates, live, context, k)
            decode += reach * decode_seconds(s, rates, live, context, tokens)
    return prefill, decode


def decode_seconds(s: TimeShape, rates: DeviceRates, rows: float, context: float,
                   tokens: float, *, prompts: int = 0) -> float:
    """Seconds of ``rows`` rows decoding ``tokens`` tokens each after ``context`` (the first
    token came from the prefill): one step per token after the first at the mean context,
    each with the sampler over every row's vocabulary (the calibrated seconds per logit) and,
    on HF generate, its own loop's cost per step (calibrated); HF generate with LoRA runs
    peft's adapters unmerged. ``prompts``: distinct prompts whose cache the rows share (the
    static engine's shared-prompt layout)."""
    steps = max(tokens - 1, 0)
    if not steps or rows <= 0:
        return 0.0
    mean = context + tokens / 2  # the mean context of the decode steps
    matrices = s.shape.text_matrix + s.shape.head + (s.shape.lora_matrix
                                                     if s.unmerged_lora else 0)
    flops = 2 * rows * matrices + 4 * s.shape.attention_width * rows * mean
    cached = (prompts * context + rows * tokens / 2 if s.prompt_cache_shared
              else rows * mean)  # tokens whose keys and values a step reads
    nbytes = s.weight_bytes + cached * s.kv_bytes_per_token
    if s.graphs:
        fixed = s.layers * rates.launch_s  # one replay: about a launch per layer
    else:
        fixed = s.layers * rates.layer_overhead_s() + (
            _adapters(s, rates) if s.unmerged_lora else 0.0)
    per_logit = rates.sample_s_per_logit  # the sampler over every row's whole vocabulary
    if s.engine == "hf":
        fixed += rates.generate_step_s  # generate's own loop, processors, criteria
        # and its processors and copies over the vocabulary, the sampler among them
        per_logit = max(per_logit, rates.generate_s_per_logit)
    return steps * (_work(flops, nbytes, s, rates, rows=max(round(rows), 1)) + fixed
                    + rows * s.vocab * per_logit)


def turn_prefill_seconds(s: TimeShape, rates: DeviceRates, rows: float, context: float,
                         turn: int) -> float:
    """Seconds of the prefill before policy turn ``turn + 1`` of ``rows`` rows whose context
    then holds ``context`` tokens: with ``s.refill`` the whole context (the prompt's images and
    the ``turn`` tool turns' so far through the vision tower), else the tool turn and the
    policy's last token after the kept cache (the tool turn's images through the tower)."""
    from r1fit.memory.flops import forward_flops

    if rows <= 0:
        return 0.0
    tool_vision = (forward_flops(s.shape, context=0, tokens=0, head_tokens=0,
                                 patches=(s.tool_patches,)) if s.tool_patches else 0)
    if s.refill:
        new, cached = context, 0.0
        images = turn * s.tool_images
        prompt_patches = (s.patches,) if s.patches else ()
    else:
        new, cached = s.tool_tokens + 1, context - s.tool_tokens - 1
        images, prompt_patches = s.tool_images, ()
    per_row = forward_flops(s.shape, context=round(cached), tokens=round(new), head_tokens=1,
                            patches=prompt_patches) + images * tool_vision
    vision = bool(prompt_patches) or images > 0
    return _work(rows * per_row, s.weight_bytes, s, rates) + _forward_overhead(
        s, rates, vision=vision) + _elementwise(s, rates, rows * new)


def collective_seconds(t: Traffic, rates: DeviceRates, nbytes: float, count: int, *,
                       reduce: bool = False) -> float:
    """Seconds of ``count`` of FSDP2's collectives over ``nbytes`` whole bytes together: each
    one's fixed cost, the (n-1)/n of the bytes each process sends and receives over the link's
    bus bandwidth, and FSDP2's own copies, read and written (``COPY_IN_OUT``: an all-gather
    copies the process's shard in and the gathered unit out to its parameters; a reduce-scatter
    copies the unit's gradients in), into buffers allocated for them: at the fresh-copy rate
    (on a CPU each page faulted in; a GPU's copy bandwidth)."""
    if not count or not nbytes:
        return 0.0
    n = t.processes
    copies = COPY_IN_OUT[1] * nbytes if reduce else COPY_IN_OUT[0] * (1 / n + 1) * nbytes
    return (count * rates.collective_s + nbytes * (n - 1) / n / rates.link_bytes_per_s
            + copies / rates.fresh_copy_rate())


def whole_gather_seconds(s: TimeShape, rates: DeviceRates) -> float:
    """Seconds of gathering every unit once (a forward's all-gathers; generation's and an
    evaluation's gather before their first token); 0 on one process."""
    t = s.traffic
    return 0.0 if t is None else collective_seconds(t, rates, t.gather_bytes, t.units)


def with_collectives(s: TimeShape, compute: float, comm: float, exposed: float) -> float:
    """A phase's seconds from its compute and its collectives: on CUDA FSDP2 overlaps them, so
    the longer of the two, plus ``exposed`` (what cannot overlap: a pass's first unit's
    all-gather, its last reduce-scatter); on a CPU the sum."""
    if s.traffic is not None and s.traffic.overlapped:
        return max(compute, comm) + exposed
    return compute + comm


def pass_collectives(s: TimeShape, rates: DeviceRates, *, backward: bool,
                     reference: bool = False) -> tuple[float, float]:
    """(seconds, exposed seconds) of a pass's collectives over the process's micro-batches.
    Every micro-batch's forward gathers every unit but the root, which FSDP2 does not reshard
    after a forward: a log-prob pass (no backward; the full fine-tuning reference's own units
    with ``reference``) gathers it once, an update's backward reshards it, so each micro-batch
    gathers it again; with ``backward``, each micro-batch also re-gathers the units its
    backward runs through and reduce-scatters their gradients. Exposed: each micro-batch's
    first unit's gather and last unit's reduce-scatter (see :func:`with_collectives`)."""
    t = s.traffic
    if t is None:
        return 0.0, 0.0
    micro_batches = math.ceil(s.rows / max(s.micro_batch, 1))
    whole, root = ((t.reference_bytes, t.reference_root_bytes) if reference and t.reference_bytes
                   else (t.gather_bytes, t.root_bytes))
    if backward:
        gathers, count = micro_batches * whole, micro_batches * t.units
    else:
        gathers = micro_batches * (whole - root) + root
        count = micro_batches * (t.units - 1) + 1
    comm = collective_seconds(t, rates, gathers, count)
    exposed = micro_batches * comm / count
    if backward:
        comm += collective_seconds(t, rates, micro_batches * t.backward_bytes,
                                   micro_batches * t.backward_units)
        scatter = collective_seconds(t, rates, micro_batches * t.reduce_bytes,
                                     micro_batches * t.reduce_units, reduce=True)
        comm += scatter
        exposed += scatter / max(t.reduce_units, 1)
    return comm, exposed


def micro_groups(s: TimeShape) -> list[GroupShape]:
    """The sequences a log-prob pass or an update runs over the process's rows: one per row, or
    with ``share_prefix`` one per group each micro-batch touches, its prompt (and images) once
    and that micro-batch's completions of it (:func:`r1fit.memory.flops.group_shapes`)."""
    from r1fit.memory.flops import GroupShape

    patches = ((s.patches,) if s.patches else ()) + (s.tool_patches,) * round(
        (s.turns - 1) * s.tool_images)  # with tools, the tool turns' images too
    if not s.share_prefix:
        return [GroupShape(s.prompt, (s.completion,), patches)] * s.rows
    size = max(s.micro_batch, 1)
    return [GroupShape(s.prompt, (s.completion,) * n, patches)
            for start in range(0, s.rows, size)
            for n in group_runs(start, min(start + size, s.rows), max(s.group, 1))]


def _tokens(groups: list[GroupShape]) -> int:
    """Tokens the model runs for ``groups``: each one's prompt and completions."""
    return sum(g.prompt + sum(g.completions) for g in groups)


def forward_pass_seconds(s: TimeShape, rates: DeviceRates, groups: list[GroupShape]) -> float:
    """Seconds of a log-prob pass of ``s``'s model over ``groups`` (``s.micro_batch`` rows at a
    time): its forward FLOPs, the fixed cost of each micro-batch's forward (a third of the
    calibrated micro-batch cost, which a forward and backward pay), the head's forward over the
    vocabulary (about half of its work in training), the element-wise work, and LoRA's unmerged
    adapters and float32 cast where ``s`` has them."""
    from r1fit.memory.flops import scoring_flops

    micro_batches = math.ceil(s.rows / max(s.micro_batch, 1))
    tokens = _tokens(groups)
    # the head's work over the vocabulary per completion token beyond its matmuls (log-probs)
    head = s.rows * s.completion * s.vocab * rates.head_s_per_logit
    return (_work(sum(scoring_flops(s.shape, g) for g in groups), micro_batches * s.weight_bytes,
                  s, rates)
            + micro_batches * (_forward_overhead(s, rates, vision=bool(s.patches))
                               + _adapters(s, rates) + rates.micro_batch_s / 3)
            + head / 2 + _elementwise(s, rates, tokens)
            + _adapter_cast(s, rates, tokens, 1, backward=False))


def logprob_seconds(s: TimeShape, rates: DeviceRates, groups: list[GroupShape]) -> float:
    """The ``logprobs`` phase: the reference's pass (with LoRA the base layers alone: peft's
    ``disable_adapter`` runs no adapter, so no adapter products, launches or float32 cast) and
    with ``algo.kl_in_reward`` the policy's (r1fit/train/grpo.py, before the first update)."""
    seconds = 0.0
    if s.reference_pass:
        base = replace(s, shape=replace(s.shape, lora_matrix=0), lora_linears_per_layer=0,
                       adapter_cast=False)
        seconds += with_collectives(s, forward_pass_seconds(base, rates, groups),
                                    *pass_collectives(s, rates, backward=False, reference=True))
    if s.policy_pass:
        seconds += with_collectives(s, forward_pass_seconds(s, rates, groups),
                                    *pass_collectives(s, rates, backward=False))
    return seconds


def update_seconds(s: TimeShape, rates: DeviceRates, groups: list[GroupShape]) -> float:
    """The ``update`` phase: ``s.iterations`` forwards and backwards of ``groups`` with the
    recomputed forwards of checkpointed decoder layers and vision blocks, and as many AdamW
    steps (see the module's docstring)."""
    from r1fit.memory.flops import forward_flops, scoring_flops, update_flops

    micro_batches = math.ceil(s.rows / max(s.micro_batch, 1))
    tokens = _tokens(groups)
    # the head's work over the vocabulary per completion token beyond its matmuls (log-probs,
    # entropies, the loss's gradient)
    head = s.rows * s.completion * s.vocab * rates.head_s_per_logit
    decoder = replace(s.shape, head=0)  # the recompute: the layers' forward, not the head's
    recompute = sum(s.checkpointed_fraction * scoring_flops(decoder, replace(g, patches=()))
                    + s.vision_checkpointed_fraction * forward_flops(
                        s.shape, context=0, tokens=0, head_tokens=0, patches=g.patches)
                    for g in groups)
    work = sum(update_flops(s.shape, g) for g in groups) + recompute
    # AdamW's bytes over the bandwidth, and its fixed cost per tensor (clip and zeroing too)
    optimizer = s.trainable * (2 * s.bytes_per_element + s.bytes_per_element
                               + ADAM_MOMENT_BYTES) / rates.copy_bytes_per_s + \
        s.trainable_tensors * rates.optimizer_s_per_tensor
    compute = (_work(work, micro_batches * s.weight_bytes, s, rates)
               + micro_batches * (3 * (_forward_overhead(s, rates, vision=bool(s.patches))
                                       + _adapters(s, rates)) + rates.micro_batch_s)
               + _elementwise(s, rates, tokens, train=True)
               + s.checkpointed_fraction * _elementwise(s, rates, tokens)
               + _adapter_cast(s, rates, tokens, 1 + s.checkpointed_fraction) + head)
    # the gradient norm's all-reduce over the processes (clipping)
    norm = rates.collective_s if s.traffic is not None else 0.0
    return s.iterations * (
        with_collectives(s, compute, *pass_collectives(s, rates, backward=True))
        + rates.update_s + optimizer + norm)


def run_steps(cfg: Config, training_only: bool) -> tuple[int, int]:
    """The run's steps and its evaluation period (0: none between the first and the last):
    ``sft.steps`` and ``sft.eval_every`` for ``r1fit sft`` (``training_only``), else
    ``train.max_steps`` and ``eval.every``."""
    if training_only:
        return cfg.sft.steps, cfg.sft.eval_every
    return cfg.train.max_steps, cfg.eval.every


def evaluation_count(steps: int, every: int, before: bool) -> int:
    """Evaluations of a run of ``steps`` steps, as the loops hold them (r1fit/train/grpo.py,
    r1fit/train/sft.py): one before training (``before``), one at every ``every``-th step, and
    the last step's when ``every`` does not reach it (none without steps)."""
    periodic = steps // every if every else 0
    return int(before) + periodic + (1 if steps and (not every or steps % every) else 0)


def time_plan(s: TimeShape, rates: DeviceRates, cfg: Config, *, processes: int = 1,
              eval_rows: int | None = None, training_only: bool = False,
              eval_completion: int | None = None,
              eval_turns: dict[str, Any] | None = None) -> TimePlan:
    """One step's predicted seconds by phase, and the run's (``eval_rows``: rows of the eval
    set, at most ``data.eval_size``, each evaluation generating them greedily ``eval.batch`` at
    a time, ``eval_completion`` tokens each: the evaluation's own, as
    :func:`r1fit.memory.planner.estimate.evaluation_shape` gives it, default ``s.completion``,
    as ``eval_turns`` (:func:`turn_fields`: with tools the evaluation's turns, where the step
    has none: r1fit sft's); ``training_only``: a step of ``r1fit sft``, an update and no
    rollout)."""
    # vLLM takes all of the process's rows in one call (r1fit/train/engines.py VllmRollouts)
    rollout = replace(s, generation_batch=max(s.rows, 1)) if s.engine == "vllm" else s
    prefill, decode = (0.0, 0.0) if training_only else \
        generation_seconds(rollout, rates, s.rows, s.completion)
    # FSDP: the HF engine gathers the policy whole before generating, and before an evaluation
    # (vLLM's weight sync is left out)
    gather = whole_gather_seconds(s, rates) if s.engine == "hf" else 0.0
    groups = micro_groups(s)
    saved = s.trainable * (s.bytes_per_element + 8)
    checkpoint = saved / rates.disk_bytes_per_s / s.checkpoint_every if s.checkpoint_every else 0
    phases = {"generate": 0.0 if training_only else prefill + decode + gather,
              "score": 0.0 if training_only else s.rows * SCORE_SECONDS_PER_ROW,
              "logprobs": logprob_seconds(s, rates, groups),
              "update": update_seconds(s, rates, groups), "checkpoint": checkpoint}
    step = sum(phases.values())
    steps, every = run_steps(cfg, training_only)
    evaluations, eval_seconds = 0, None
    if eval_rows is not None and cfg.data.eval:
        completion = s.completion if eval_completion is None else eval_completion
        eval_shape = replace(s, generation_batch=cfg.eval.batch, group=1, shares_prompts=False,
                             **({"completion": completion, **eval_turns} if eval_turns else {}))
        eval_seconds = sum(generation_seconds(
            eval_shape, rates, math.ceil(eval_rows / processes), completion)) + gather
        evaluations = evaluation_count(steps, every, cfg.eval.before_train)
    run = steps * step + evaluations * (eval_seconds or 0.0)
    dominant = max(phases, key=phases.__getitem__)
    tokens = s.rows * processes * s.completion
    return TimePlan(phases=phases, step_seconds=step, tokens_per_second=tokens / max(step, 1e-9),
                    run_seconds=run, steps=steps, evaluations=evaluations,
                    eval_seconds=eval_seconds, dominant=dominant, source=rates.source,
                    advice=_advice(s, cfg, phases, dominant),
                    details={"prefill_seconds": prefill, "decode_seconds": decode,
                             **({"turns": s.turns, "turn_tokens": s.turn_tokens,
                                 "tool_turn_tokens": s.tool_tokens, "refill": float(s.refill)}
                                if s.tool_tokens else {}),
                             **({"collectives_seconds": step_collectives(s, rates, gather)}
                                if s.traffic is not None else {}),
                             "decode_step_seconds": decode / max(
                                 math.ceil(s.rows / rollout.generation_batch)
                                 * max(s.turns * (s.turn_tokens - 1) if s.tool_tokens
                                       else s.completion - 1, 1), 1)},
                    warmup_steps=0 if training_only else cfg.sft.format_warmup_steps,
                    link=(f"{s.traffic.processes} processes, "
                          f"{rates.link_bytes_per_s / 1e9:,.2f} GB/s: {rates.link_source}"
                          if s.traffic is not None else ""))


def step_collectives(s: TimeShape, rates: DeviceRates, gather: float) -> float:
    """Seconds of a step's FSDP2 collectives, overlapped or not (``gather``: generation's)."""
    forward = pass_collectives(s, rates, backward=False)[0]
    reference = pass_collectives(s, rates, backward=False, reference=True)[0]
    update = pass_collectives(s, rates, backward=True)[0]
    return gather + reference * s.reference_pass + forward * s.policy_pass \
        + s.iterations * update


def _advice(s: TimeShape, cfg: Config, phases: dict[str, float], dominant: str) -> list[str]:
    """What would shorten the step, for its dominant phase (larger chunk sizes are not among
    them: ``r1fit plan`` lists those that fit, with their predicted step:
    :func:`r1fit.memory.planner.estimate.faster_fits`)."""
    out: list[str] = []
    step = sum(phases.values()) or 1.0
    share = phases[dominant] / step
    if dominant == "generate":
        if not s.graphs:
            out.append("generation is eager: rollout.engine=static (CUDA graphs, one process) or "
                       "vllm replays the decode step without per-layer launches")
        if s.iterations == 1:
            out.append("algo.num_iterations > 1 reuses each rollout for more updates")
    elif dominant == "update":
        if s.checkpointed_fraction:
            out.append("memory.gradient_checkpointing recomputes the forward in backward: "
                       "memory.checkpoint_every > 1 recomputes fewer layers where memory allows")
        if s.group > 1 and not cfg.memory.share_prefix:
            out.append("memory.share_prefix runs each group's prompt once per micro-batch")
    if out:
        out[0] = f"{dominant} is {share:.0%} of the step: {out[0]}"
    return out
