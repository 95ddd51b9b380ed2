"""Policy/reference loading, LoRA placement, and the backbone/head split, on builtin:tiny."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoProcessor, Qwen2_5_VLForConditionalGeneration

from r1fit.models.errors import ModelConfigError
from r1fit.models.load import (
    Reference,
    bad_weights_message,
    check_placeholder_tokens,
    language_model_lora_regex,
    lm_backbone_and_head,
    load_frozen,
    load_policy,
    resolve_model_path,
    special_token_ids,
    stop_token_ids,
    unwrap,
)
from r1fit.rollout.generate import TokenIds

from .conftest import image_prompt

NUM_LAYERS = 2  # builtin:tiny text layers
PROJECTIONS = 7  # q, k, v, o, gate, up, down


def _load(path: str | Path, **overrides: Any):
    kwargs: dict[str, Any] = dict(
        lora_r=0,
        lora_alpha=16,
        lora_dropout=0.0,
        lora_target="all-linear",
        freeze_vision=True,
        dtype="float32",
        device=torch.device("cpu"),
        gradient_checkpointing=False,
    )
    kwargs.update(overrides)
    return load_policy(str(path), **kwargs)


def _batch(processor, image) -> dict[str, torch.Tensor]:
    return dict(processor(text=[image_prompt(processor)], images=[image], return_tensors="pt"))


def _perturb_lora_b(model: PeftModel) -> None:
    """LoRA B starts at zero (adapter = identity); make it non-zero so the adapter matters."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


# ---- resolve_model_path -------------------------------------------------------------------------


def test_resolve_builtin_to_cache_folder(use_tiny_cache: Path, tiny_dir: Path) -> None:
    assert resolve_model_path("builtin:tiny") == str(tiny_dir)


def test_resolve_unknown_builtin_lists_names(use_tiny_cache: Path) -> None:
    with pytest.raises(ModelConfigError, match="available: builtin:bench-1024, builtin:bench-3b-cut, "
                       "builtin:small, builtin:small-realvocab, "
                       "builtin:tiny, "):
        resolve_model_path("builtin:huge")


def test_resolve_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"has no config\.json") as info:
        resolve_model_path(str(tmp_path))
    assert "\n" not in str(info.value)


def test_a_lora_adapter_folder_names_the_merge_that_makes_it_a_model(tmp_path: Path) -> None:
    # a LoRA run's final/ beside its checkpoints: the newest one is named in the fix
    run = tmp_path / "sft"
    for name in ("checkpoint-10", "checkpoint-200", "checkpoint-warmup-300", "checkpoint-9"):
        (run / name).mkdir(parents=True)
    (run / "final").mkdir()
    (run / "final" / "adapter_config.json").write_text('{"base_model_name_or_path": "/m/base"}')
    with pytest.raises(ModelConfigError) as info:
        resolve_model_path(str(run / "final"))
    assert str(info.value) == (
        f"model folder '{run / 'final'}' is a LoRA adapter (adapter_config.json, of /m/base), not "
        f"a whole model: merge it into its base with `r1fit export {run / 'checkpoint-200'} MERGED "
        "--merge-lora` and pass model.path=MERGED")
    # an adapter alone, its config unreadable: the same advice, in general words
    alone = tmp_path / "adapter"
    alone.mkdir()
    (alone / "adapter_config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"is a LoRA adapter \(adapter_config\.json\), not a "
                       r"whole model: merge it into its base with `r1fit export "
                       r"<its run>/checkpoint-N MERGED --merge-lora`"):
        resolve_model_path(str(alone))


def test_resolve_missing_local_folder_and_hub_id(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    assert resolve_model_path("Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen/Qwen2.5-VL-3B-Instruct"
    with pytest.raises(ModelConfigError, match="non-empty"):
        resolve_model_path("")


def test_a_run_folder_or_checkpoint_is_no_model_path(tmp_path: Path, monkeypatch, caplog) -> None:
    """A run's output folder and a checkpoint hold a config.json (the run's): named as what they
    are, with the way to a model, not as a model folder missing its tokenizer. A mistyped
    relative folder beside a real one is still a hub id, with a warning."""
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "config.json").write_text('{"kind": "grpo"}')
    (run / "metrics.jsonl").write_text("{}\n")
    for name in ("config.json", "trainer_state.json", "manifest.json"):
        (run / "checkpoint-2" / name).write_text("{}")
    with pytest.raises(ModelConfigError, match=r"is an r1fit run's output folder, not a model: "
                                               r"pass the run's final/"):
        resolve_model_path(str(run))
    with pytest.raises(ModelConfigError, match="is an r1fit checkpoint, not a model"):
        resolve_model_path(str(run / "checkpoint-2"))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="r1fit"):
        assert resolve_model_path("run/qwen-vl") == "run/qwen-vl"
    assert "no such folder here (there is a folder run/), so it is looked up as a hub id" in \
        caplog.text


def test_unloadable_hub_id_is_one_line_naming_the_path() -> None:
    # the processor loads first (a folder without its tokenizer fails before the weights load)
    with pytest.raises(ModelConfigError, match=r"^cannot load processor for 'bad id/with spaces': "
                       ) as info:
        _load("bad id/with spaces")
    assert "\n" not in str(info.value)


def truncated_copy(tiny_dir: Path, dest: Path, size: int | None = None) -> Path:
    """A copy of builtin:tiny whose model.safetensors is cut to ``size`` bytes (half by default)."""
    shutil.copytree(tiny_dir, dest)
    weights = dest / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2 if size is None else size)
    return dest


@pytest.mark.parametrize("size", [None, 10], ids=["half", "10-bytes"])
def test_truncated_weights_are_one_line_naming_the_file(tiny_dir: Path, tmp_path: Path,
                                                        size: int | None) -> None:
    folder = truncated_copy(tiny_dir, tmp_path / "model", size)
    with pytest.raises(ModelConfigError, match=r"^cannot load model .* is truncated or corrupt") as info:
        _load(folder)
    message = str(info.value)
    assert f"{folder / 'model.safetensors'} is truncated or corrupt" in message
    assert "download or export it again" in message and "\n" not in message
    with pytest.raises(ModelConfigError, match="truncated or corrupt"):
        load_frozen(str(folder), dtype="float32", device="cpu")


def _edited_copy(tiny_dir: Path, dest: Path, edit: Any) -> Path:
    """A copy of builtin:tiny whose config.json's text config ``edit`` changes."""
    shutil.copytree(tiny_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config.get("text_config", config))
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_weights_that_do_not_fill_the_configs_model_are_one_line(tiny_dir: Path,
                                                                 tmp_path: Path) -> None:
    """A config.json of another model than its weights: one more layer than the weights hold
    (transformers starts those tensors random and prints a table, so the run trained a partly
    random model) or wider layers (transformers raises a RuntimeError): both refused in one
    line; the reference's load too."""
    def more_layers(text: dict) -> None:
        text["num_hidden_layers"] += 1
        text["layer_types"] = [*text["layer_types"], text["layer_types"][-1]]

    def wider(text: dict) -> None:
        text["intermediate_size"] *= 2

    deeper = _edited_copy(tiny_dir, tmp_path / "deeper", more_layers)
    with pytest.raises(ModelConfigError, match=r"its weights lack 12 tensors of the model its "
                       r"config.json describes \(first: model.language_model.layers.2.") as info:
        _load(deeper)
    assert "\n" not in str(info.value)
    with pytest.raises(ModelConfigError, match="its weights lack 12 tensors"):
        load_frozen(str(deeper), dtype="float32", device="cpu")
    with pytest.raises(ModelConfigError, match=r"its weights' shapes differ from those its "
                       r"config.json describes"):
        _load(_edited_copy(tiny_dir, tmp_path / "wider", wider))


def test_truncated_builtin_says_how_to_rebuild(tiny_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    truncated_copy(tiny_dir, cache / "models" / tiny_dir.name)
    monkeypatch.setenv("R1FIT_CACHE", str(cache))
    with pytest.raises(ModelConfigError) as info:
        _load("builtin:tiny")
    folder = cache / "models" / tiny_dir.name
    assert str(info.value).startswith(f"cannot load model 'builtin:tiny': {folder / 'model.safetensors'} "
                                      "is truncated or corrupt")
    assert str(info.value).endswith(f"delete {folder} and r1fit builds it again")


def test_truncated_hub_download_names_its_cache(tiny_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub

    repo = tmp_path / "hub" / "models--acme--tiny"  # the Hugging Face cache's layout
    snapshot = truncated_copy(tiny_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelConfigError) as info:
        _load("acme/tiny")
    assert str(info.value).startswith(f"cannot load model 'acme/tiny': {snapshot / 'model.safetensors'} "
                                      "is truncated or corrupt")
    assert str(info.value).endswith(f"delete {repo} (the Hugging Face cache of acme/tiny) and "
                                    "download it again")


def test_bad_weights_message_names_each_broken_shard(tmp_path: Path) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    for name in ("model-00001-of-00003", "model-00002-of-00003", "model-00003-of-00003"):
        save_file({"w": torch.zeros(64)}, str(tmp_path / f"{name}.safetensors"))
    for name, size in (("model-00001-of-00003", 100), ("model-00003-of-00003", 3)):
        os.truncate(tmp_path / f"{name}.safetensors", size)
    message = bad_weights_message(str(tmp_path), str(tmp_path), SafetensorError("header too small"))
    first, third = (tmp_path / f"model-0000{i}-of-00003.safetensors" for i in (1, 3))
    assert message == (f"cannot load model {str(tmp_path)!r}: {first} is truncated or corrupt "
                       "(Error while deserializing header: incomplete metadata, file not fully "
                       f"covered); {third} is truncated or corrupt (Error while deserializing "
                       "header: header too small); download or export it again")
    # a hub id that is not in the local cache: no file to name
    assert bad_weights_message("acme/absent", "acme/absent", SafetensorError("header too small")) == (
        "cannot load model 'acme/absent': a safetensors weights file is truncated or corrupt "
        "(header too small); download or export it again")


def test_bad_options_are_named(tiny_dir: Path) -> None:
    with pytest.raises(ModelConfigError, match="dtype must be one of"):
        _load(tiny_dir, dtype="float8")
    with pytest.raises(ModelConfigError, match="lora_r"):
        _load(tiny_dir, lora_r=-1)
    with pytest.raises(ModelConfigError, match=r"unknown module name\(s\) \['qkv'\]"):
        _load(tiny_dir, lora_r=4, lora_target=["q_proj", "qkv"])


# ---- full fine-tuning -----------------------------------------------------------------------------


def test_full_finetune_trains_all_but_frozen_vision(tiny_dir: Path) -> None:
    model, _ = _load(tiny_dir, freeze_vision=True)
    assert not isinstance(model, PeftModel) and model.training
    for name, param in model.named_parameters():
        assert param.requires_grad == (not name.startswith("model.visual.")), name
    assert model.config.use_cache is False and model.config.text_config.use_cache is False
    model, _ = _load(tiny_dir, freeze_vision=False)
    assert all(p.requires_grad for p in model.parameters())


def test_dtype_option(tiny_dir: Path) -> None:
    model, _ = _load(tiny_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = _load(tiny_dir, dtype="auto")  # the built-ins are saved in float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_builtin_path_loads(use_tiny_cache: Path) -> None:
    model, processor = _load("builtin:tiny")
    assert type(unwrap(model)).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"


# ---- LoRA -------------------------------------------------------------------------------------------


def test_lora_targets_only_language_model(tiny_dir: Path) -> None:
    model, _ = _load(tiny_dir, lora_r=4, gradient_checkpointing=True)
    assert isinstance(model, PeftModel)
    lora_a = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert len(lora_a) == NUM_LAYERS * PROJECTIONS
    assert all(".language_model.layers." in n for n in lora_a)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # The vision MLP also has gate/up/down_proj: the regex must have kept LoRA off it.
    assert not any("visual" in n for n, _ in model.named_parameters() if "lora_" in n)


def test_lora_target_subset(tiny_dir: Path) -> None:
    model, _ = _load(tiny_dir, lora_r=2, lora_target="q_proj, v_proj")
    adapted = {n.split(".")[-4] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}
    regex = language_model_lora_regex(["down_proj"])
    assert regex == r"(?:.*\.)?language_model\.layers\.\d+\.(?:mlp\.(?:down_proj))"


def test_lora_gradients_reach_adapters_with_checkpointing(tiny_dir: Path, image56) -> None:
    model, processor = _load(tiny_dir, lora_r=4, gradient_checkpointing=True)
    _perturb_lora_b(model)
    model(**_batch(processor, image56)).logits.float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())


def test_checkpointing_every_nth_layer_is_what_the_planner_counts(tiny_dir: Path, image56) -> None:
    """enable_checkpointing(model, 3) switches transformers' every_n_layers: of builtin:tiny's
    layers in module order (2 vision blocks, 2 decoder layers) indices 0 and 3, as
    ModelFacts.checkpointed(3) counts them; gradients are those of no checkpointing."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from r1fit.memory.planner import model_facts
    from r1fit.models.load import enable_checkpointing

    grads = []
    for every in (None, 3):
        model, processor = _load(tiny_dir, freeze_vision=False)
        if every:
            enable_checkpointing(model, every)
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        on = [m.gradient_checkpointing for m in layers]
        if every:
            assert on == [True, False, False, True]
            facts = model_facts(str(tiny_dir))
            assert facts.checkpoint_order == "vvtt" and facts.checkpointed(3) == (1, 1)
        else:
            assert not any(on)
        model(**_batch(processor, image56)).logits.float().pow(2).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


# ---- backbone + head ----------------------------------------------------------------------------


@pytest.mark.parametrize("lora_r", [0, 4])
def test_backbone_times_head_equals_logits(tiny_dir: Path, image56, lora_r: int) -> None:
    model, processor = _load(tiny_dir, lora_r=lora_r, gradient_checkpointing=True)
    if lora_r:
        _perturb_lora_b(model)
    model.eval()
    batch = _batch(processor, image56)
    backbone, head = lm_backbone_and_head(model)
    assert head is unwrap(model).get_output_embeddings()
    with torch.no_grad():
        hidden = backbone(**batch)
        logits = model(**batch).logits
    assert hidden.shape == (1, batch["input_ids"].shape[1], unwrap(model).config.text_config.hidden_size)
    torch.testing.assert_close(hidden @ head.weight.T, logits, atol=1e-5, rtol=0)
    if lora_r:
        with model.disable_adapter(), torch.no_grad():
            hidden_off = backbone(**batch)
            logits_off = model(**batch).logits
        torch.testing.assert_close(hidden_off @ head.weight.T, logits_off, atol=1e-5, rtol=0)
        assert (logits_off - logits).abs().max() > 1e-3  # the adapter really was switched off


def test_backbone_rejects_head_kwargs(tiny_dir: Path) -> None:
    model, _ = _load(tiny_dir)
    backbone, _ = lm_backbone_and_head(model)
    with pytest.raises(ModelConfigError, match="logits_to_keep"):
        backbone(input_ids=torch.tensor([[1, 2]]), logits_to_keep=1)


def test_special_token_ids(tiny_dir: Path) -> None:
    model, processor = _load(tiny_dir, lora_r=2)
    ids = special_token_ids(model, processor)
    tok = processor.tokenizer
    assert ids == {
        "image_pad": tok.convert_tokens_to_ids("<|image_pad|>"),
        "video_pad": tok.convert_tokens_to_ids("<|video_pad|>"),
        "vision_start": tok.convert_tokens_to_ids("<|vision_start|>"),
        "vision_end": tok.convert_tokens_to_ids("<|vision_end|>"),
        "eos": tok.convert_tokens_to_ids("<|im_end|>"),
        "pad": tok.convert_tokens_to_ids("<|endoftext|>"),
        "end_of_turn": tok.convert_tokens_to_ids("<|im_end|>"),  # what the template ends turns with
    }
    assert ids["image_pad"] == unwrap(model).config.image_token_id
    # a completion stops at <|im_end|> or <|endoftext|> (Qwen's generation_config), and only the
    # image and video placeholders are never sampled
    assert stop_token_ids(model, processor) == [ids["eos"], ids["pad"]]
    assert TokenIds.of(model, processor) == TokenIds(pad=ids["pad"], eos=[ids["eos"], ids["pad"]],
                                                     blocked=[ids["image_pad"], ids["video_pad"]])



def _with_config(folder: Path, dest: Path, **values: Any) -> Path:
    """A copy of model ``folder`` whose config.json has ``values`` (a hand-edited config)."""
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(values)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_config_image_token_id_the_processor_does_not_use_is_one_line(tiny_dir: Path,
                                                                         tmp_path: Path) -> None:
    pad = AutoProcessor.from_pretrained(tiny_dir).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    edited = _with_config(tiny_dir, tmp_path / "edited", image_token_id=5)
    with pytest.raises(ModelConfigError) as info:
        _load(edited)
    message = str(info.value)
    assert "\n" not in message
    assert f"config image_token_id=5 but the processor's image token '<|image_pad|>' is id {pad}" in message
    assert f'set "image_token_id": {pad} in the model\'s config.json' in message


def test_a_folder_without_a_chat_template_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """Before, the model loaded and the first prompt raised transformers' ValueError."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    removed = [p for p in bare.iterdir() if p.name.startswith("chat_template")]
    assert removed  # the built model keeps its template beside the processor's files
    for path in removed:
        path.unlink()
    with pytest.raises(ModelConfigError, match=re.escape(
            f"the processor of '{bare}' has no chat template (chat_template.jinja, or "
            "chat_template in processor_config.json)")):
        _load(bare)


def test_a_folder_without_tokenizer_files_is_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    """Without tokenizer.json transformers builds a tokenizer of the 14 added tokens, and the
    error was about the image token's id; now the missing files are named before the weights
    load."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ModelConfigError, match=re.escape(
            f"model '{bare}' has no tokenizer file (tokenizer.json, vocab.json, tokenizer.model, "
            "spiece.model)")):
        _load(bare)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3vl", "tiny-gemma3"])
def test_placeholder_check_compares_the_token_each_processor_writes(builtin_folder, name: str) -> None:
    folder = builtin_folder(name)
    config, processor = AutoConfig.from_pretrained(folder), AutoProcessor.from_pretrained(folder)
    check_placeholder_tokens(config, processor, name)  # a model as built: no complaint
    # Gemma 3 writes <image_soft_token> per patch (its processor's image_token is <start_of_image>)
    token = "<image_soft_token>" if name == "tiny-gemma3" else "<|image_pad|>"
    assert config.image_token_id == processor.tokenizer.convert_tokens_to_ids(token)
    config.image_token_id += 1
    with pytest.raises(ModelConfigError, match=f"config image_token_id={config.image_token_id} but the "
                       f"processor's image token '{token}' is id {config.image_token_id - 1}"):
        check_placeholder_tokens(config, processor, name)


def test_placeholder_check_covers_the_video_token(tiny_dir: Path) -> None:
    config, processor = AutoConfig.from_pretrained(tiny_dir), AutoProcessor.from_pretrained(tiny_dir)
    used = config.video_token_id
    config.video_token_id = 3
    with pytest.raises(ModelConfigError, match=f"config video_token_id=3 but the processor's video "
                       f"token '<\\|video_pad\\|>' is id {used}"):
        check_placeholder_tokens(config, processor, "builtin:tiny")


def test_placeholder_check_names_a_token_missing_from_the_vocabulary(tiny_dir: Path) -> None:
    config, processor = AutoConfig.from_pretrained(tiny_dir), AutoProcessor.from_pretrained(tiny_dir)
    processor.image_token = "<|not_a_token|>"
    with pytest.raises(ModelConfigError, match="image token '<\\|not_a_token\\|>' is not in its "
                       "tokenizer's vocabulary"):
        check_placeholder_tokens(config, processor, "builtin:tiny")

# ---- reference --------------------------------------------------------------------------------


def test_adapter_view_needs_lora(tiny_dir: Path) -> None:
    model, _ = _load(tiny_dir)
    with pytest.raises(ModelConfigError, match="needs a peft model"):
        Reference(model, adapter_view=True)


def test_lora_reference_is_policy_with_adapters_off(tiny_dir: Path, image56) -> None:
    model, processor = _load(tiny_dir, lora_r=4)
    ref = Reference(model, adapter_view=True)
    batch = _batch(processor, image56)
    with torch.no_grad():
        policy_before = model(**batch).logits
    with ref.model() as m:
        assert m is model and not m.training  # no second copy; eval inside the block
        ref_before = m(**batch).logits
    assert model.training  # mode given back
    torch.testing.assert_close(ref_before, policy_before, atol=0, rtol=0)  # lora_B == 0: identical

    _perturb_lora_b(model)
    with torch.no_grad():
        policy_after = model(**batch).logits
    with ref.model() as m:
        ref_after = m(**batch).logits
        assert not ref_after.requires_grad
    torch.testing.assert_close(ref_after, ref_before, atol=0, rtol=0)
    assert (policy_after - ref_after).abs().max() > 1e-3
    # Leaving the block re-enables the adapters and their gradients.
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, policy_after, atol=0, rtol=0)


def test_full_reference_is_separate_frozen_copy(tiny_dir: Path, image56) -> None:
    model, processor = _load(tiny_dir)
    ref = Reference(load_frozen(str(tiny_dir), dtype="float32", device="cpu"), adapter_view=False)
    batch = _batch(processor, image56)
    with ref.model() as m:
        assert isinstance(m, Qwen2_5_VLForConditionalGeneration)
        assert m is not model and not m.training
        assert all(not p.requires_grad for p in m.parameters())
        policy_ptrs = {p.data_ptr() for p in model.parameters()}
        assert not policy_ptrs & {p.data_ptr() for p in m.parameters()}
        ref_before = m(**batch).logits
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    with ref.model() as m:
        torch.testing.assert_close(m(**batch).logits, ref_before, atol=0, rtol=0)


def _saved_bytes_and_lora_grads(model, processor, image) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd saves for backward in one forward (checkpointing's kept inputs included),
    and the adapters' gradients after the backward."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**_batch(processor, image)).logits.float().pow(2).mean()
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora_r", [4, 0])
def test_a_frozen_vision_tower_keeps_nothing_for_backward(tiny_dir: Path, image56,
                                                          lora_r: int) -> None:
    """enable_input_require_grads (transformers' checkpointing switch, peft) hooks the vision
    tower's patch embedding as well as the token embeddings; r1fit drops the hooks, so a frozen
    tower (LoRA; full fine-tuning with freeze_vision) records no graph. Put back, the hooks
    only add saved bytes: the adapters' (or trained weights') gradients are bit-identical."""
    model, processor = _load(tiny_dir, lora_r=lora_r, gradient_checkpointing=True)
    if lora_r:
        _perturb_lora_b(model)
    base = unwrap(model)
    assert not base.model.visual.patch_embed._forward_hooks
    assert not base.get_input_embeddings()._forward_hooks
    lean, grads = _saved_bytes_and_lora_grads(model, processor, image56)
    base.enable_input_require_grads()  # what transformers and peft leave in place
    assert base.model.visual.patch_embed._forward_hooks
    model.zero_grad(set_to_none=True)
    hooked, hooked_grads = _saved_bytes_and_lora_grads(model, processor, image56)
    # at least the tower's checkpointed blocks keep their inputs (16 patches of a 56 px image, each
    # block's width, float32); here the hooks nearly double what a step keeps
    vision = base.config.vision_config
    assert hooked - lean >= 16 * vision.depth * vision.hidden_size * 4
    assert grads.keys() == hooked_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(grad, hooked_grads[name]), name


def test_an_adapters_size_mismatches_are_one_short_line() -> None:
    """A LoRA adapter loaded onto another base listed every adapted weight (6 kB on one line):
    the first mismatch and their count."""
    from r1fit.models.load import first_mismatch

    err = RuntimeError("Error(s) in loading state_dict for PeftModel:\n\tsize mismatch for "
                       "a.lora_A.weight: copying a param with shape torch.Size([4, 8]) from "
                       "checkpoint, the shape in current model is torch.Size([4, 16]).\n"
                       + "".join(f"\tsize mismatch for w{i}: copying ...\n" for i in range(40)))
    assert first_mismatch(err) == (
        "Error(s) in loading state_dict for PeftModel: size mismatch for a.lora_A.weight: copying "
        "a param with shape torch.Size([4, 8]) from checkpoint, the shape in current model is "
        "torch.Size([4, 16]). (and 40 more size mismatches)")
    assert first_mismatch(ValueError("no adapter_config.json\nhere")) == \
        "no adapter_config.json here"
