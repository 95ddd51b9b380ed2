"""Load the policy (full fine-tuning or LoRA), its KL reference, and expose backbone + LM head.

Everything goes through `AutoModelForImageTextToText.from_pretrained` / `AutoProcessor.from_pretrained`,
for hub ids, local folders and the `builtin:` models alike, so the built-in test models run the
same code paths as a real checkpoint (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3). What an
architecture needs is read from its config, tokenizer, generation config and chat template (image
token, end of turn, stop tokens, vision tower, FSDP units), never from its name.
"""

from __future__ import annotations

import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    GenerationConfig,
    PreTrainedModel,
    ProcessorMixin,
)

from r1fit.errors import one_line
from r1fit.models.builtin import BUILTIN_PREFIX, ensure_builtin, shipped_config
from r1fit.models.errors import ModelConfigError
from r1fit.models.vision_attention import batch_vision_segments

log = logging.getLogger("r1fit.models")

#: Linear layers of a decoder layer that LoRA may adapt (Qwen2/2.5/3-VL and Gemma 3 name them alike).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}
#: a peft adapter folder's config (a LoRA run's final/ holds it instead of config.json)
ADAPTER_CONFIG = "adapter_config.json"
#: safetensors names of the floating-point dtypes ``dtype="auto"`` may pick from a weights header
#: (transformers skips float8/float4 there too)
_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
                       "F16": torch.float16}


def resolve_model_path(path: str) -> str:
    """Turn a user model path into something `from_pretrained` accepts.

    `builtin:<name>` -> its cache folder (built on first use); an existing local folder must hold
    a `config.json`; a string that is clearly a filesystem path but does not exist is an error;
    anything else (a hub id such as `Qwen/Qwen2.5-VL-3B-Instruct`) is returned unchanged.
    """
    if not isinstance(path, str) or not path.strip():
        raise ModelConfigError(f"model path must be a non-empty string, got {path!r}")
    if path.startswith(BUILTIN_PREFIX):
        return str(ensure_builtin(path[len(BUILTIN_PREFIX) :]))
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if run_folder := _run_folder(Path(expanded)):
            raise ModelConfigError(f"model folder {path!r} is {run_folder}, not a model: pass the "
                                   "run's final/ (a LoRA run's: r1fit export --merge-lora makes it "
                                   "a model), or r1fit export a checkpoint into a model folder")
        if os.path.isfile(os.path.join(expanded, "config.json")):
            return expanded
        if os.path.isfile(os.path.join(expanded, ADAPTER_CONFIG)):
            raise ModelConfigError(_adapter_folder(path, Path(expanded)))
        raise ModelConfigError(f"model folder {path!r} has no config.json (not a saved Hugging Face model)")
    if os.path.exists(expanded):
        raise ModelConfigError(f"model path {path!r} is a file; expected a model folder or a hub id")
    # Hub ids are "name" or "org/name"; anything starting like a path, or with deeper nesting,
    # is a local folder the user mistyped, and deserves a clearer error than a hub lookup.
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1:
        raise ModelConfigError(f"model folder {path!r} does not exist")
    owner = path.split("/")[0]
    if "/" in path and os.path.isdir(owner):  # "models/qwen" beside a folder models/: a typo?
        log.warning("model path %r: no such folder here (there is a folder %s/), so it is looked "
                    "up as a hub id", path, owner)
    return path


def check_loading_info(info: dict[str, Any], path: str) -> None:
    """Refuse a model whose weights lack tensors its config.json's model has: transformers
    initialises them at random and only prints a table, so the run would train (or an
    evaluation score) a partly random model. Tensors the weights hold beyond the model are
    logged: they are left out."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelConfigError(
            f"cannot load model {path!r}: its weights lack {len(missing)} tensor"
            f"{'s' * (len(missing) > 1)} of the model its config.json describes (first: "
            f"{missing[0]}), which would start random; config.json and the weights do not match")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        log.warning("model %s: %d tensors of its weights belong to no part of the model its "
                    "config.json describes and are left out (first: %s)", path, len(unexpected),
                    unexpected[0])


def load_failure(what: str, path: str, err: BaseException) -> str:
    """``what`` (e.g. "cannot load model") of ``path`` and why, in one line; a model that is no
    vision-language one is said so, not with transformers' list of every model class it knows
    (2,000 characters)."""
    text = one_line(err)
    if "Unrecognized configuration class" in text:
        match = re.search(r"<class '[\w.]+\.(\w+)'>", text)
        return (f"{what} {path!r}: its config ({match.group(1) if match else 'unknown'}) is no "
                "image-text-to-text model, which r1fit trains through transformers' "
                "AutoModelForImageTextToText (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, ...)")
    return f"{what} {path!r}: {text}"


def first_mismatch(err: BaseException) -> str:
    """torch's load_state_dict error on one line, with only the first of its size mismatches and
    their count (an adapter on another base lists every adapted weight: 6 kB on one line)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    mismatches = [line for line in lines if line.startswith("size mismatch for ")]
    if len(mismatches) < 2:
        return one_line(err)
    head = " ".join(line for line in lines if not line.startswith(("size mismatch for ",)))
    return (f"{head} {mismatches[0]} (and {len(mismatches) - 1} more size mismatches)").strip()


def _run_folder(folder: Path) -> str | None:
    """What r1fit run output ``folder`` is ("an r1fit checkpoint", "an r1fit run's output
    folder"), or None: a checkpoint holds its manifest and trainer state, a run its metrics or
    checkpoints (its config.json is the run's, no model's)."""
    if (folder / "trainer_state.json").is_file() and (folder / "manifest.json").is_file():
        return "an r1fit checkpoint"
    if (folder / "metrics.jsonl").is_file() or any(folder.glob("checkpoint-*")):
        return "an r1fit run's output folder"
    return None


def _adapter_folder(path: str, folder: Path) -> str:
    """Why a LoRA adapter folder (a LoRA run's ``final/``) is no model.path, and what to do: merge
    it into its base, from the newest checkpoint of its run when it lies in one."""
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    steps = sorted(int(match.group(1)) for p in folder.parent.glob("checkpoint-*")
                   if (match := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir())
    source = folder.parent / f"checkpoint-{steps[-1]}" if steps else "<its run>/checkpoint-N"
    return (f"model folder {path!r} is a LoRA adapter (adapter_config.json"
            f"{f', of {base}' if base else ''}), not a whole model: merge it into its base with "
            f"`r1fit export {source} MERGED --merge-lora` and pass model.path=MERGED")


def config_folder(path: str) -> str:
    """A local folder holding the ``config.json`` of model ``path``, reached without its weights
    (what ``r1fit plan`` reads).

    ``builtin:NAME`` and local folders: as :func:`resolve_model_path`. A hub id r1fit ships the
    config of (:func:`shipped_config`): that copy, without the network. Any other hub id: its
    ``config.json`` alone, from the Hugging Face cache or the hub.
    """
    folder = resolve_model_path(path)
    if os.path.isdir(folder):
        return folder
    shipped = shipped_config(folder)
    if shipped is not None:
        return shipped
    from huggingface_hub import constants, errors, hf_hub_download

    try:
        return os.path.dirname(hf_hub_download(folder, "config.json"))
    except (OSError, ValueError) as err:
        if isinstance(err, errors.LocalEntryNotFoundError):  # offline, or the hub is unreachable
            how = "offline (HF_HUB_OFFLINE)" if constants.is_offline_mode() else "the hub is unreachable"
            why = f"{how} and it is not in the Hugging Face cache"
        elif isinstance(err, errors.GatedRepoError):
            why = "the model is gated: accept its licence on the hub and log in (hf auth login)"
        elif isinstance(err, errors.RepositoryNotFoundError):
            why = "no such model on the hub (or it is private: log in)"
        else:
            why = one_line(err)
        raise ModelConfigError(
            f"cannot get the config.json of {path!r}: {why}; only that file is needed (no "
            "weights): point model.path at a local folder holding it") from err


def loaded_dtype(path: str, dtype: str) -> torch.dtype:
    """The dtype model ``path`` is loaded in under ``model.dtype=dtype`` (``auto``: its
    checkpoint's, read from the config and at most a weights header, as the planner does)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    from transformers import AutoConfig

    return checkpoint_dtype(AutoConfig.from_pretrained(config_folder(path)),
                            resolve_model_path(path))[0]


def checkpoint_dtype(config: Any, model: str) -> tuple[torch.dtype, str]:
    """The dtype ``from_pretrained(model, dtype="auto")`` loads the weights in, and where it is
    read, without reading the weights: ``(dtype, source)``.

    transformers 5 (``modeling_utils._get_dtype``) takes the config's ``dtype`` (``config.json``'s
    ``dtype``, or ``torch_dtype`` in older files). Only when the config names none does it look at
    the weights: the index's ``metadata.dtype``, else the first floating-point tensor of the first
    weights file, which is read here from the safetensors header of ``model`` (a folder, or a hub
    id's snapshot in the Hugging Face cache). With neither at hand: float32, torch's default.
    """
    named = getattr(config, "dtype", None)
    if named is not None:
        return (getattr(torch, named) if isinstance(named, str) else named), "config.json"
    local = Path(model) if os.path.isdir(model) else _hub_snapshot(model)
    index = local / "model.safetensors.index.json" if local is not None else None
    first = local / "model.safetensors" if local is not None else None
    if index is not None and index.is_file():
        data = json.loads(index.read_text())
        if (data.get("metadata") or {}).get("dtype"):
            return getattr(torch, data["metadata"]["dtype"]), index.name
        files = sorted(set(data.get("weight_map", {}).values()))
        first = local / files[0] if files else None
    if first is not None and first.is_file():
        with safe_open(str(first), framework="pt") as f:
            for key in f.keys():
                found = _SAFETENSORS_FLOATS.get(f.get_slice(key).get_dtype())
                if found is not None:
                    return found, f"the header of {first.name} (config.json names no dtype)"
    return torch.float32, "torch's default (config.json names no dtype, no safetensors at hand)"


def load_policy(
    path: str,
    *,
    lora_r: int,
    lora_alpha: int,
    lora_dropout: float,
    lora_target: str | Sequence[str],
    freeze_vision: bool,
    dtype: str,
    device: torch.device | str,
    gradient_checkpointing: bool,
    attn_implementation: str = "sdpa",
) -> tuple[nn.Module, ProcessorMixin]:
    """Load the trainable policy and its processor.

    `lora_r == 0`: full fine-tuning; every parameter trains except the vision tower when
    `freeze_vision`. `lora_r > 0`: LoRA adapters on the language model's linear layers named by
    `lora_target` (`"all-linear"`, or names from `LORA_TARGETS` as a list or comma-separated
    string); the vision tower is never adapted and, like every base weight, stays frozen, so
    `freeze_vision` changes nothing under LoRA. The returned model is then a `PeftModel`.
    `model.config.use_cache` is False (training forwards need no KV cache); generation keeps
    using the cache through `generation_config.use_cache` or an explicit `use_cache=True`.
    """
    if not isinstance(lora_r, int) or lora_r < 0:
        raise ModelConfigError(f"lora_r must be an integer >= 0, got {lora_r!r}")
    if lora_r > 0 and lora_alpha <= 0:
        raise ModelConfigError(f"lora_alpha must be > 0 when LoRA is on, got {lora_alpha!r}")
    if not 0.0 <= lora_dropout < 1.0:
        raise ModelConfigError(f"lora_dropout must be in [0, 1), got {lora_dropout!r}")
    target_regex = language_model_lora_regex(lora_target) if lora_r > 0 else None

    folder = resolve_model_path(path)
    # the processor first: a folder without its tokenizer or chat template fails in a second,
    # not after the weights load
    processor = _load_processor(folder, path)
    model = _from_pretrained(folder, path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    check_placeholder_tokens(model.config, processor, path)
    model.train()

    if freeze_vision:
        visual = vision_tower(model)
        if visual is None:
            raise ModelConfigError(f"model {path!r} has no vision tower; cannot freeze_vision")
        visual.requires_grad_(False)
    # The cache is useless (and costs memory) in training forwards, and incompatible with
    # gradient checkpointing; the inner text model reads its own config, so set both.
    model.config.use_cache = False
    if hasattr(model.config, "text_config"):
        model.config.text_config.use_cache = False
    if gradient_checkpointing:
        enable_checkpointing(model)

    if lora_r > 0:
        lora_config = LoraConfig(
            r=lora_r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=target_regex,
            bias="none",
        )
        with warnings.catch_warnings():
            # peft probes the deprecated `is_gradient_checkpointing` property; not our call site.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(model, lora_config)
    drop_input_grad_hooks(model)  # peft adds them again
    return model, processor


def load_adapter(model: nn.Module, folder: str | os.PathLike[str]) -> PeftModel:
    """``model`` with the LoRA adapter saved in ``folder`` (``adapter_config.json`` and its
    weights, as a LoRA run's ``final/`` holds them) loaded onto it: the same peft model that
    training builds, in eval mode."""
    try:
        with warnings.catch_warnings():
            # peft probes the deprecated `is_gradient_checkpointing` property; not our call site.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            adapted = PeftModel.from_pretrained(model, os.fspath(folder))
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:
        raise ModelConfigError(f"cannot load the LoRA adapter {os.fspath(folder)!r} onto its base "
                               f"model: {first_mismatch(err)}") from err
    drop_input_grad_hooks(adapted)  # peft adds them
    return adapted


def enable_checkpointing(model: nn.Module, every: int = 1) -> None:
    """Recompute layer activations in the backward pass (transformers' own switch), on every
    ``every``-th layer (its ``every_n_layers``: vision blocks and decoder layers counted together
    in module order; r1fit.memory.planner.facts.ModelFacts.checkpointed says which).

    Non-reentrant checkpointing back-propagates through segments whose inputs need no grad (frozen
    embeddings under LoRA); peft still adds its ``enable_input_require_grads`` hook. Only active
    in train mode: generation runs under ``model.eval()`` and keeps its KV cache."""
    base = unwrap(model)
    kwargs = {"use_reentrant": False}
    every_n = {"every_n_layers": every} if every != 1 else {}  # a 5.x without it: every layer
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.x name
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, **every_n)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **every_n)
    drop_input_grad_hooks(model)


def drop_input_grad_hooks(model: nn.Module) -> None:
    """Remove the forward hooks that make input embeddings' outputs require grad, which
    transformers' checkpointing switch and peft add (``enable_input_require_grads``), for
    reentrant checkpointing, which r1fit does not use: non-reentrant checkpointing
    back-propagates into segments whose inputs need no grad. The hooks only cost. On a VLM they
    hook the vision tower's patch embedding too (its ``_input_embed_layer``), so a frozen vision
    tower (LoRA, or ``model.freeze_vision``) recorded its graph, kept its blocks' inputs for a
    backward pass whose gradients nothing used, and ran it: on an H100, 3B LoRA, G=8, 448 px,
    620 MiB at the step's peak (benchmarks/gpu_check.py's memtrace stage, 2026-11-26)."""
    base = unwrap(model)
    if hasattr(base, "disable_input_require_grads"):
        base.disable_input_require_grads()


def language_model_lora_regex(lora_target: str | Sequence[str]) -> str:
    """peft `target_modules` regex matching the chosen projections inside the language model only.

    A regex rather than a name list because vision towers reuse the names (Qwen2.5-VL's blocks
    have `gate_proj`, `up_proj` and `down_proj`, Gemma 3's SigLIP layers `q_proj`, `k_proj` and
    `v_proj`); matching on `language_model.layers.N` keeps LoRA off the vision tower.
    """
    if isinstance(lora_target, str):
        names = (
            list(LORA_TARGETS)
            if lora_target in ("all-linear", "all")
            else [n.strip() for n in lora_target.split(",") if n.strip()]
        )
    else:
        names = list(lora_target)
    if not names:
        raise ModelConfigError("model.lora.target is empty; use 'all-linear' or names from " + ", ".join(LORA_TARGETS))
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown:
        raise ModelConfigError(
            f"model.lora.target has unknown module name(s) {unknown}; choose from 'all-linear', "
            + ", ".join(LORA_TARGETS)
        )
    attn = [n for n in LORA_TARGETS if n in names and n in _ATTN]
    mlp = [n for n in LORA_TARGETS if n in names and n not in _ATTN]
    parts = []
    if attn:
        parts.append(r"self_attn\.(?:" + "|".join(attn) + ")")
    if mlp:
        parts.append(r"mlp\.(?:" + "|".join(mlp) + ")")
    return r"(?:.*\.)?language_model\.layers\.\d+\.(?:" + "|".join(parts) + ")"


class Reference:
    """The frozen KL reference policy.

    Either a view of the LoRA policy with its adapters switched off (no second copy of the
    weights), or a separate frozen model for full fine-tuning. Use as
    `with ref.model() as m: out = m(**batch)`: the block runs under `torch.no_grad()` with `m`
    in eval mode.
    """

    def __init__(self, module: nn.Module, *, adapter_view: bool) -> None:
        # the peft model itself, or a wrapper holding it as ``.model`` (the FSDP root)
        self._peft = module if isinstance(module, PeftModel) else module._modules.get("model")
        if adapter_view and not isinstance(self._peft, PeftModel):
            raise ModelConfigError("an adapter-view reference needs a peft model (lora_r > 0)")
        self._module = module
        #: True when the reference is the policy itself with adapters disabled.
        self.adapter_view = adapter_view

    @contextmanager
    def model(self) -> Iterator[nn.Module]:
        """Yield the reference module, ready for a no-grad forward."""
        if not self.adapter_view:
            with torch.no_grad():
                yield self._module
            return
        # The policy is shared: switch it to eval (no dropout) for the reference pass and give it
        # back in the mode the training loop left it in.
        was_training = self._module.training
        self._module.eval()
        try:
            with self._peft.disable_adapter(), torch.no_grad():
                yield self._module
        finally:
            self._module.train(was_training)


def load_frozen(path: str, *, dtype: str, device: torch.device | str,
                attn_implementation: str = "sdpa") -> PreTrainedModel:
    """A model from `path` in eval mode with no gradients (a KL reference)."""
    folder = resolve_model_path(path)
    ref = _from_pretrained(folder, path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    return ref.eval().requires_grad_(False)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a model computes in: its first floating-point parameter's."""
    return next(p for p in model.parameters() if p.is_floating_point()).dtype


def adapter_autocast_dtype(model: nn.Module, compute: str) -> torch.dtype | None:
    """The dtype LoRA's adapters compute in under ``torch.autocast`` (``model.lora.compute_dtype``
    'model' on a bfloat16 or float16 peft model: its own dtype), or None where peft's path stands
    (its float32 adapters cast their input to float32: 'float32', full fine-tuning, a float32
    model)."""
    if compute != "model" or not isinstance(model, PeftModel) or not is_16_bit(model):
        return None
    return compute_dtype(model)


def is_16_bit(model: nn.Module) -> bool:
    """Whether the model computes in bfloat16 or float16, where rounding between batch shapes is
    far larger than in float32 (the exactness checks of shared prompts take wider bounds)."""
    return compute_dtype(model) not in (torch.float32, torch.float64)


def unwrap(model: nn.Module) -> PreTrainedModel:
    """The underlying transformers model, through peft, `torch.compile` and DDP wrappers, and
    r1fit's log-prob wrapper (the FSDP root), which holds the model as its ``model`` submodule."""
    while True:
        if isinstance(model, PeftModel):
            model = model.get_base_model()
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif (not isinstance(model, PreTrainedModel)
              and isinstance(model._modules.get("model"), nn.Module)):
            model = model._modules["model"]
        else:
            break
    if not isinstance(model, PreTrainedModel):
        raise ModelConfigError(f"expected a transformers model, got {type(model).__name__}")
    return model


def lm_backbone_and_head(model: nn.Module) -> tuple[Callable[..., torch.Tensor], nn.Linear]:
    """Split a VLM into (backbone, lm_head) so callers can compute log-probs in chunks.

    `backbone(**inputs)` runs the vision tower + language model WITHOUT the LM head and returns
    the final, already RMS-normed hidden states [B, T, H]; `backbone(...) @ head.weight.T` equals
    the model's own logits. `inputs` are the model's forward kwargs (input_ids, attention_mask,
    pixel_values, image_grid_thw, mm_token_type_ids or token_type_ids, ...). It calls the inner
    model (`Qwen2_5_VLModel`, `Gemma3Model`, ...), whose LoRA layers are injected in place, so it
    follows the wrapper's state: adapters on, or off inside `disable_adapter()`. A model whose
    forward transforms the head's output (a final logit softcap) is refused when it is loaded
    (:func:`check_logits_are_the_head`).
    """
    base = unwrap(model)
    inner = getattr(base, "model", None)
    head = base.get_output_embeddings()
    if inner is None or not isinstance(head, nn.Linear):
        raise ModelConfigError(f"{type(base).__name__} has no inner .model / linear LM head to split")

    def backbone(**inputs: Any) -> torch.Tensor:
        for key in ("labels", "logits_to_keep"):
            if key in inputs:
                raise ModelConfigError(f"backbone() does not take {key!r}; apply the head yourself")
        inputs.setdefault("use_cache", False)
        # ForConditionalGeneration.forward does exactly `lm_head(self.model(...)[0])`; the text
        # model applies its final norm before returning last_hidden_state.
        return inner(**inputs, return_dict=True).last_hidden_state

    return backbone, head


def logit_softcap(config: Any) -> float | None:
    """The final logit softcap a config declares (``final_logit_softcapping``, on the config or its
    text config: Gemma 2, PaliGemma 2, Gemma 3n), or None."""
    for part in (config, getattr(config, "text_config", None)):
        value = getattr(part, "final_logit_softcapping", None) if part is not None else None
        if value is not None:
            return float(value)
    return None


def check_logits_are_the_head(model: PreTrainedModel, path: str) -> None:
    """Raise ``ModelConfigError`` when the model's logits are not its LM head's output.

    r1fit's log-probs are ``log_softmax(hidden @ lm_head.weight.T)`` computed in chunks
    (:func:`lm_backbone_and_head`); a forward that transforms the head's output, as a final logit
    softcap ``c * tanh(logits / c)`` does, would sample from another distribution than the one
    trained. Only a config that declares a softcap is checked, with a two-token forward: whether the
    forward applies it depends on the model class (transformers 5's PaliGemma and Gemma 3n do,
    Gemma 3's ``Gemma3ForConditionalGeneration`` does not), not on the config alone.
    """
    cap = logit_softcap(model.config)
    if cap is None or next(model.parameters()).device.type == "meta":
        return
    placeholders = {getattr(model.config, attr, None) for _, attr in PLACEHOLDER_TOKENS}
    tokens = [i for i in range(len(placeholders) + 2) if i not in placeholders][:2]
    device = next(model.parameters()).device
    input_ids = torch.tensor([tokens], device=device)
    backbone, head = lm_backbone_and_head(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits.float()
            ours = head(backbone(input_ids=input_ids)).float()
    finally:
        model.train(was_training)
    if torch.allclose(logits, ours, rtol=1e-4, atol=1e-5):
        return  # the forward ignores the declared cap, and so do r1fit's log-probs
    capped = torch.allclose(logits, cap * torch.tanh(ours / cap), rtol=1e-4, atol=1e-5)
    how = (f"returns {cap:g} * tanh(head output / {cap:g}) (final_logit_softcapping={cap:g})"
           if capped else "transforms its LM head's output")
    raise ModelConfigError(
        f"the forward of model {path!r} {how}; r1fit's chunked log-probs are the LM head's output "
        "and apply no softcap yet, so they would not be the log-probs the model samples from")


def context_length(model: nn.Module) -> int | None:
    """The longest sequence the language model takes (``max_position_embeddings`` of its text
    config), or None when the config does not say."""
    config = unwrap(model).config
    for part in (getattr(config, "text_config", None), config):
        value = getattr(part, "max_position_embeddings", None) if part is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return None


#: Model-config attributes naming the placeholder tokens a model replaces with vision features,
#: keyed as ``special_token_ids`` returns them. Generation must never sample one: the next forward
#: would find more placeholders than features and fail.
PLACEHOLDER_TOKENS = (("image_pad", "image_token_id"), ("video_pad", "video_token_id"))
#: Model-config attributes naming the tokens around an image: Qwen-VL's vision start/end, Gemma 3's
#: (and PaliGemma's) begin/end of image. The first one a config declares wins.
DELIMITER_TOKENS = (("vision_start", ("vision_start_token_id", "boi_token_id")),
                    ("vision_end", ("vision_end_token_id", "eoi_token_id")))


def check_placeholder_tokens(config: Any, processor: Any, path: str) -> None:
    """Raise ``ModelConfigError`` when a placeholder id of the model config (``PLACEHOLDER_TOKENS``:
    ``image_token_id``, ``video_token_id``) is not the id of the token the processor writes into a
    prompt for each image (video) patch: the forward would find fewer placeholders than vision
    features and stop in transformers ("Image features and image tokens do not match") in the
    middle of the first step, e.g. after a hand-edited config.json or a tokenizer from another
    model. The processor's token is its tokenizer's ``image_token`` (Gemma 3:
    ``<image_soft_token>``), else the processor's own (Qwen-VL: ``<|image_pad|>``); a processor
    that names none is not checked."""
    tokenizer = getattr(processor, "tokenizer", processor)
    for _, attr in PLACEHOLDER_TOKENS:
        declared = getattr(config, attr, None)
        kind = attr.removesuffix("_token_id")  # image, video
        token = getattr(tokenizer, f"{kind}_token", None) or getattr(processor, f"{kind}_token", None)
        if declared is None or not isinstance(token, str):
            continue
        used = tokenizer.convert_tokens_to_ids(token)
        if used is not None and used == tokenizer.unk_token_id and token != tokenizer.unk_token:
            used = None  # not in the vocabulary: the tokenizer maps it to its unknown token
        if used == declared:
            continue
        if used is None:
            raise ModelConfigError(
                f"model {path!r}: config {attr}={declared} but the processor's {kind} token "
                f"{token!r} is not in its tokenizer's vocabulary; use the tokenizer and processor "
                "files the model was saved with")
        raise ModelConfigError(
            f"model {path!r}: config {attr}={declared} but the processor's {kind} token {token!r} "
            f"is id {used}, so the model would not find the {kind} tokens in a prompt; "
            f"set \"{attr}\": {used} in the model's config.json (or use the tokenizer the model "
            "was saved with)")


def special_token_ids(model: nn.Module, processor: ProcessorMixin) -> dict[str, int]:
    """Ids generation, SFT and masking need, each read from where the model itself reads it.

    From the model config: ``image_pad`` (required: the image placeholder token), and when the
    config declares them ``video_pad``, ``vision_start``, ``vision_end`` (``PLACEHOLDER_TOKENS``,
    ``DELIMITER_TOKENS``). From the tokenizer: ``eos`` and ``pad`` (eos when it has none). From the
    chat template: ``end_of_turn``, the token that ends an assistant turn (Qwen: ``<|im_end|>``,
    the tokenizer's eos; Gemma 3: ``<end_of_turn>``, while its eos is ``<eos>``).
    """
    config = unwrap(model).config
    tokenizer = getattr(processor, "tokenizer", processor)
    ids: dict[str, int] = {}
    for key, attr in PLACEHOLDER_TOKENS:
        value = getattr(config, attr, None)
        if value is not None:
            ids[key] = int(value)
    if "image_pad" not in ids:
        raise ModelConfigError(f"model config ({type(config).__name__}) has no image_token_id; "
                               "not a vision-language model r1fit can feed images to")
    for key, attrs in DELIMITER_TOKENS:
        value = next((getattr(config, a) for a in attrs if getattr(config, a, None) is not None), None)
        if value is not None:
            ids[key] = int(value)
    if tokenizer.eos_token_id is None:
        raise ModelConfigError("the tokenizer has no eos token")
    ids["eos"] = int(tokenizer.eos_token_id)
    # Qwen-Instruct tokenizers pad with <|endoftext|>; fall back to eos if a tokenizer has no pad.
    ids["pad"] = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    ids["end_of_turn"] = end_of_turn_id(processor)
    return ids


def end_of_turn_id(processor: Any) -> int:
    """The token the chat template puts right after an assistant turn's text (what SFT appends to
    an answer and generation stops at), found by rendering a two-turn chat; the tokenizer's eos
    when the processor has no chat template."""
    tokenizer = getattr(processor, "tokenizer", processor)
    marker = "r1fit-end-of-turn-probe"
    chat = [{"role": "user", "content": [{"type": "text", "text": "?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": marker}]}]
    try:
        text = processor.apply_chat_template(chat, tokenize=False)
    except (ValueError, TypeError) as err:  # no chat template (or one that rejects this chat)
        if tokenizer.eos_token_id is None:
            raise ModelConfigError(f"no end-of-turn token: {one_line(err)}") from err
        return int(tokenizer.eos_token_id)
    after = text[text.rfind(marker) + len(marker):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids:
        raise ModelConfigError("the chat template ends an assistant turn with nothing; no end-of-turn "
                               "token to learn or stop at")
    return int(ids[0])


def stop_token_ids(model: nn.Module, processor: ProcessorMixin) -> list[int]:
    """Tokens a completion ends at: the tokenizer's eos, the chat template's end of turn, then
    every eos of the model's generation config (Qwen-VL-Instruct: ``<|im_end|>`` and
    ``<|endoftext|>``; Gemma 3: ``<eos>`` and ``<end_of_turn>``), without repeats."""
    ids = special_token_ids(model, processor)
    declared = getattr(unwrap(model).generation_config, "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    return list(dict.fromkeys(int(i) for i in [ids["eos"], ids["end_of_turn"], *declared]))


def _from_pretrained(
    folder: str, path: str, *, dtype: str, device: torch.device | str, attn_implementation: str
) -> PreTrainedModel:
    if dtype not in _DTYPES:
        raise ModelConfigError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    # from_pretrained builds the model on the meta device (no random initialisation) and copies
    # each memory-mapped safetensors tensor straight to `device` at `dtype`: no full copy in host
    # RAM on the way to a GPU
    if str(device) == "meta":  # the skeleton other ranks build; rank 0 broadcasts the weights
        try:
            config = AutoConfig.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as err:
            raise ModelConfigError(f"cannot load model config {path!r}: {one_line(err)}") from err
        # the dtype rank 0's from_pretrained loads in, or the shards would not match its tensors
        meta_dtype = checkpoint_dtype(config, folder)[0] if dtype == "auto" else _DTYPES[dtype]
        try:
            with torch.device("meta"):
                skeleton = AutoModelForImageTextToText.from_config(
                    config, dtype=meta_dtype, attn_implementation=attn_implementation)
        except ValueError as err:
            raise ModelConfigError(load_failure("cannot load model", path, err)) from err
        if skeleton.can_generate():
            # from_config takes its generation config from config.json alone; from_pretrained
            # reads the folder's generation_config.json (Qwen-VL-Instruct's second eos id, its
            # sampling defaults), which every rank must see alike
            try:
                skeleton.generation_config = GenerationConfig.from_pretrained(folder)
            except OSError:  # no generation_config.json: config.json's, as from_pretrained has
                pass
        batch_vision_segments(skeleton)
        return skeleton
    try:
        model, info = AutoModelForImageTextToText.from_pretrained(
            folder, dtype=_DTYPES[dtype], attn_implementation=attn_implementation,
            device_map=str(torch.device(device)), output_loading_info=True,
        )
    except SafetensorError as err:  # a truncated or corrupt weights file; it does not say which
        raise ModelConfigError(bad_weights_message(folder, path, err)) from err
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise ModelConfigError(load_failure("cannot load model", path, err)) from err
    except RuntimeError as err:
        if "mismatched" not in str(err):  # out of memory and the like: not the folder's fault
            raise
        raise ModelConfigError(f"cannot load model {path!r}: its weights' shapes differ from "
                               "those its config.json describes (a config.json of another "
                               "model size?)") from err
    check_loading_info(info, path)
    check_logits_are_the_head(model, path)
    # sdpa vision attention in one call a layer, not one per image or window
    batch_vision_segments(model)
    return model


def safetensors_problem(file: str | os.PathLike[str]) -> str | None:
    """Why safetensors cannot open ``file`` (a truncated or corrupt header, or a file cut short
    of the tensors its header lists), or None when it opens. Reads the header only."""
    try:
        with safe_open(os.fspath(file), framework="pt"):
            return None
    except (SafetensorError, OSError) as err:
        return one_line(err)


def bad_weights_message(folder: str, path: str, err: Exception) -> str:
    """The one-line error for weights safetensors rejects (``err``) when loading model ``path``
    from ``folder`` (what :func:`resolve_model_path` made of it), naming the broken file(s)."""
    local = Path(folder) if os.path.isdir(folder) else _hub_snapshot(folder)
    files = sorted(local.glob("*.safetensors")) if local is not None else []
    broken = [f"{f} is truncated or corrupt ({why})" for f in files if (why := safetensors_problem(f))]
    if path.startswith(BUILTIN_PREFIX):
        fix = f"delete {folder} and r1fit builds it again"
    elif local is not None and not os.path.isdir(folder):  # the snapshot only links the blobs
        fix = f"delete {local.parent.parent} (the Hugging Face cache of {path}) and download it again"
    else:
        fix = "download or export it again"
    if not broken:
        return (f"cannot load model {path!r}: a safetensors weights file is truncated or corrupt "
                f"({one_line(err)}); {fix}")
    return f"cannot load model {path!r}: {'; '.join(broken)}; {fix}"


def _hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a hub model in the Hugging Face cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        config = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return Path(config).parent if isinstance(config, str) else None


#: the files a tokenizer is read from: one of them is enough (fast, BPE, sentencepiece)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model")


def _load_processor(folder: str, path: str) -> ProcessorMixin:
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, name))
                                         for name in TOKENIZER_FILES):
        # transformers would build a tokenizer of the added tokens alone (14 in builtin:tiny),
        # and the first complaint would be about the image token's id
        raise ModelConfigError(f"model {path!r} has no tokenizer file ({', '.join(TOKENIZER_FILES)}"
                               "): copy the base model's tokenizer files into the folder")
    try:
        processor = AutoProcessor.from_pretrained(folder)
    except (OSError, ValueError, KeyError, ImportError) as err:
        raise ModelConfigError(f"cannot load processor for {path!r}: {one_line(err)}") from err
    if not getattr(processor, "chat_template", None):  # every prompt goes through it
        raise ModelConfigError(
            f"the processor of {path!r} has no chat template (chat_template.jinja, or "
            "chat_template in processor_config.json): r1fit writes every prompt with it; copy "
            "the base model's chat_template.jinja into the folder")
    return processor


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a VLM (through peft and r1fit's wrappers), or None for a text-only
    model: the inner model's ``visual`` (Qwen2-VL, Qwen2.5-VL), ``vision_tower`` (LLaVA-style,
    Gemma 3) or ``vision_model`` (Idefics3/SmolVLM)."""
    base = unwrap(model) if isinstance(model, nn.Module) else model
    inner = getattr(base, "model", base)
    for name in ("visual", "vision_tower", "vision_model"):
        if getattr(inner, name, None) is not None:
            return getattr(inner, name)
    return None


