"""Which engine generates the rollouts (``rollout.engine``), and why: ``auto`` resolved once per
run from the machine, read by the run (``r1fit.train.engines``) and the planner alike."""

from __future__ import annotations

import importlib.util

from r1fit.config.values import ConfigError
from r1fit.units import format_bytes

ENGINES = ("hf", "static", "vllm")
#: attention implementations the static engine runs (it passes a ready 4-D mask each step)
STATIC_ATTENTION = ("sdpa", "eager")


#: model types whose weights r1fit's sync hands to vLLM under names vLLM loads, checked on CPU
#: (tests/rollout: the engine's log-probs equal the trainer's after a sync); Gemma 3's vision
#: tower is named otherwise by transformers v5 than by vLLM, and its sync fails
VLLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it: that would load torch)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(setting: str, *, device_type: str, distributed: bool,
                   attention: str = "sdpa", vllm: bool = True,
                   model_type: str | None = None) -> tuple[str, str]:
    """``(engine, why)``: ``setting`` itself, or for ``auto`` the fastest engine that runs here:
    vLLM where it is installed, the device is CUDA and the model's type is one r1fit's weight
    sync serves (``VLLM_MODEL_TYPES``; unless ``vllm`` is False: not an engine this caller
    takes), else the static-cache engine on CUDA (in one process, sdpa or eager attention: what
    it runs), else Hugging Face generate. ``attention``: model.attn_implementation;
    ``model_type``: the model's config.model_type (None: not known, not checked)."""
    synced = model_type is None or model_type in VLLM_MODEL_TYPES
    if setting in ENGINES:
        if setting == "static":
            refuse_static(distributed=distributed, attention=attention)
        if setting == "vllm" and not synced:
            raise ConfigError(f"rollout.engine=vllm does not run {model_type} models yet (r1fit's "
                              f"weight sync serves {', '.join(VLLM_MODEL_TYPES)}): set "
                              "rollout.engine=static (CUDA) or hf")
        return setting, "set"
    if setting != "auto":
        raise ConfigError(f"rollout.engine must be auto, {', '.join(ENGINES)}; got {setting!r}")
    if device_type != "cuda":
        return "hf", f"on {device_type} (CUDA graphs{' and vLLM' if vllm else ''} need a CUDA device)"
    if vllm and synced and vllm_installed():
        return "vllm", "vLLM is installed and the device is CUDA"
    no_vllm = ("vLLM not installed" if not vllm_installed() else
               f"vLLM's weight sync does not serve {model_type}")
    without = f"{no_vllm} and " if vllm else ""
    if distributed:
        return "hf", (f"{without}the static engine runs in one process only "
                      "(FSDP's gathered weights move every step)")
    if attention not in STATIC_ATTENTION:
        return "hf", (f"{without}the static engine takes sdpa or eager "
                      f"attention, not {attention}")
    return "static", (f"CUDA, {no_vllm}: " if vllm else "CUDA: ") + \
        "the static-cache engine with CUDA graphs"


def refuse_static(*, distributed: bool, attention: str = "sdpa") -> None:
    """A one-line error for what ``rollout.engine=static`` does not run yet."""
    if attention not in STATIC_ATTENTION:
        raise ConfigError(f"rollout.engine=static needs model.attn_implementation sdpa or eager "
                          f"(it passes a 4-D mask each step), not {attention}: set one of them, "
                          "or rollout.engine=hf")
    if distributed:
        raise ConfigError("rollout.engine=static runs in one process only (FSDP moves the "
                          "gathered weights every step): set rollout.engine=hf (or vllm) under "
                          "torchrun")


def sft_engine(setting: str, *, device_type: str, distributed: bool,
               attention: str = "sdpa") -> tuple[str, str]:
    """``(engine, why)`` for ``r1fit sft``'s evaluations: 'static' or 'hf' as
    :func:`resolve_engine` decides them, never vLLM. An in-process vLLM engine would hold its
    weights and KV pool through every SFT update for the sake of an evaluation or two (and the
    SFT plan does not count them): ``vllm``, like ``auto``, takes the static engine where it
    runs (CUDA, one process, sdpa or eager attention), else Hugging Face generate."""
    if setting == "vllm":
        name, why = resolve_engine("auto", device_type=device_type, distributed=distributed,
                                   attention=attention, vllm=False)
        return name, f"r1fit sft evaluates without vLLM; {why}"
    return resolve_engine(setting, device_type=device_type, distributed=distributed,
                          attention=attention, vllm=False)


def least_share(needs: int, total: int) -> float:
    """The smallest rollout.vllm.gpu_memory_utilization (in hundredths) whose share of a GPU of
    ``total`` bytes holds ``needs`` bytes."""
    return -(-needs * 100 // total) / 100


def vllm_share_problem(utilization: float, needs: int, total: int, *,
                       distributed: bool) -> str | None:
    """Why vLLM cannot start on ``utilization`` of a GPU of ``total`` bytes, or None: its share
    must hold its copy of the weights and one sequence's KV cache (``needs`` bytes), which vLLM
    itself finds out only after loading the weights. Said alike by ``r1fit plan`` and by the
    engine before it loads anything."""
    share = int(utilization * total)
    if share >= needs:
        return None
    least = least_share(needs, total)
    others = "rollout.engine=hf" if distributed else "rollout.engine=static or hf"
    fix = (f"raise it to {least:.2f}, or use {others}" if least <= 1 else
           f"no share of this GPU holds them: use {others}")
    return (f"rollout.vllm.gpu_memory_utilization={utilization} gives vLLM {format_bytes(share)} "
            f"of the GPU's {format_bytes(total)}, less than its copy of the weights and one "
            f"sequence's KV cache ({format_bytes(needs)}): {fix}")
