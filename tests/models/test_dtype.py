"""model.dtype=auto: the checkpoint's dtype, as transformers' from_pretrained(dtype="auto") picks it,
found without the weights by the loader's meta skeleton and the planner alike; and the config.json
files r1fit ships for hub ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from r1fit.config import load_config
from r1fit.memory.planner import model_facts, plan_memory
from r1fit.models.errors import ModelConfigError
from r1fit.models.load import (
    checkpoint_dtype,
    config_folder,
    load_frozen,
    load_policy,
    shipped_config,
)

SHIPPED = ["Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct",
           "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-32B-Instruct"]


@pytest.fixture(scope="module")
def bf16_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny saved in bfloat16: its config.json says "dtype": "bfloat16"."""
    folder = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    load_frozen(str(tiny_dir), dtype="bfloat16", device="cpu").save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def _dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_auto_is_the_checkpoint_dtype_for_loader_skeleton_and_planner(saved, tiny_dir, bf16_dir):
    folder = str(tiny_dir if saved == torch.float32 else bf16_dir)
    assert _dtypes(load_frozen(folder, dtype="auto", device="cpu")) == {saved}
    # the skeleton every rank but 0 builds, to take rank 0's shards: the same dtype
    assert _dtypes(load_frozen(folder, dtype="auto", device="meta")) == {saved}
    name = str(saved).removeprefix("torch.")
    assert model_facts(folder).config_dtype == name
    plan = plan_memory(load_config(None, [f"model.path={folder}"]), device_type="cpu")
    assert (plan.details["dtype"], plan.details["dtype_from"]) == (name, "config.json")
    assert plan.parts["weights"] == saved.itemsize * plan.details["params"]


def test_a_config_naming_no_dtype_is_read_from_the_weights_header(bf16_dir, tmp_path):
    # transformers then takes the first floating-point tensor's dtype; r1fit reads the header only
    folder = tmp_path / "no-dtype"
    shutil.copytree(bf16_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    for part in (config, config["text_config"], config["vision_config"]):
        part.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert _dtypes(load_frozen(str(folder), dtype="auto", device="cpu")) == {torch.bfloat16}
    assert checkpoint_dtype(AutoConfig.from_pretrained(folder), str(folder)) == (
        torch.bfloat16, "the header of model.safetensors (config.json names no dtype)")
    (folder / "model.safetensors").unlink()  # a bare config.json: torch's default
    assert checkpoint_dtype(AutoConfig.from_pretrained(folder), str(folder))[0] == torch.float32


def test_the_demo_defaults_load_builtin_tiny_in_float32(use_tiny_cache):
    m = load_config().model
    assert (m.path, m.dtype) == ("builtin:tiny", "auto")
    model, _ = load_policy(m.path, lora_r=m.lora.r, lora_alpha=m.lora.alpha,
                           lora_dropout=m.lora.dropout, lora_target=m.lora.target,
                           freeze_vision=m.freeze_vision, dtype=m.dtype, device="cpu",
                           gradient_checkpointing=False)
    assert _dtypes(model) == {torch.float32}


# ---- shipped configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("repo_id", SHIPPED)
def test_shipped_configs_are_found_as_package_data(repo_id):
    folder = shipped_config(repo_id)
    assert folder is not None and Path(folder, "config.json").is_file()
    assert shipped_config(repo_id.upper()) == folder  # the hub matches ids regardless of case
    assert config_folder(repo_id) == folder  # no network
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert checkpoint_dtype(config, repo_id) == (torch.bfloat16, "config.json")


def test_a_hub_id_not_shipped_reads_its_config_json_alone(tmp_path, monkeypatch, bf16_dir):
    import huggingface_hub.constants as hub

    assert shipped_config("Qwen/Qwen3-VL-8B-Instruct") is None
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelConfigError) as info:
        config_folder("acme/tiny")
    assert str(info.value) == (
        "cannot get the config.json of 'acme/tiny': offline (HF_HUB_OFFLINE) and it is not in the "
        "Hugging Face cache; only that file is needed (no weights): point model.path at a local "
        "folder holding it")
    # once in the Hugging Face cache (here: config.json alone), offline is fine
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    shutil.copy(bf16_dir / "config.json", snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    assert config_folder("acme/tiny") == str(snapshot)
    facts = model_facts("acme/tiny")
    assert facts.config_dtype == "bfloat16" and facts.hub_config == str(snapshot / "config.json")
