"""Built-in models: offline build, cache behaviour, and real from_pretrained round trips."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLForConditionalGeneration

from r1fit.models.builtin import (
    BUILDER_VERSION,
    MARKER_FILE,
    builtin_dir,
    create_model,
    ensure_builtin,
)
from r1fit.models.errors import ModelConfigError
from r1fit.models.tokenizer import QWEN2VL_SPECIAL_TOKENS, REASONING_TOKENS, build_tokenizer

from .conftest import image_prompt


def test_tiny_folder_has_everything_from_pretrained_needs(tiny_dir: Path) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "processor_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
    marker = json.loads((tiny_dir / MARKER_FILE).read_text())
    assert marker["builder_version"] == BUILDER_VERSION and marker["name"] == "tiny"
    assert tiny_dir.name == f"tiny-v{BUILDER_VERSION}"


def test_tiny_config_matches_tokenizer_and_size(tiny_dir: Path) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir)
    tok = AutoProcessor.from_pretrained(tiny_dir).tokenizer
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    n_params = sum(p.numel() for p in model.parameters())
    assert 100_000 < n_params < 5_000_000
    cfg = model.config
    assert cfg.text_config.vocab_size == len(tok)
    assert 500 < len(tok) < 2048
    assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert cfg.text_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.text_config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg.text_config.bos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.pad_token_id]


def test_reload_gives_the_built_weights(tiny_dir: Path) -> None:
    built, _ = create_model("tiny")  # same seed -> same weights as the saved build
    loaded = AutoModelForImageTextToText.from_pretrained(tiny_dir)
    expected, got = built.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_tokenizer_special_and_reasoning_tokens_are_atomic(tiny_dir: Path) -> None:
    tok = AutoProcessor.from_pretrained(tiny_dir).tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in QWEN2VL_SPECIAL_TOKENS + REASONING_TOKENS]
    assert len(set(ids)) == len(ids) and tok.unk_token_id not in ids
    text = "<think>3 red circles</think><answer>3</answer>"
    pieces = tok.convert_ids_to_tokens(tok(text).input_ids)
    assert pieces[0] == "<think>" and "</think>" in pieces and pieces[-2:] == ["3", "</answer>"]
    assert "<answer>" in pieces
    # Reasoning tags are not special: they survive skip_special_tokens; Qwen specials do not.
    ids = tok("<|im_start|>" + text + "<|im_end|>").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_build_is_deterministic() -> None:
    a, b = build_tokenizer(), build_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert (
        a("What colour is the square on the left?").input_ids == b("What colour is the square on the left?").input_ids
    )


def test_chat_template_renders_qwen2vl_image_turn(tiny_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(tiny_dir)
    text = image_prompt(processor, "What colour?")
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_processor_expands_image_pads_for_56px(tiny_dir: Path, image56) -> None:
    processor = AutoProcessor.from_pretrained(tiny_dir)
    batch = processor(text=[image_prompt(processor)], images=[image56], return_tensors="pt")
    # 56 px = 4x4 patches of 14 px -> grid (t=1, h=4, w=4); 2x2 merge -> 4 image tokens.
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    # One row per patch: 3 channels x temporal 2 x 14 x 14 = 1176 values.
    assert tuple(batch["pixel_values"].shape) == (16, 1176)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == image_id).sum()) == 4
    # The processor itself marks image positions (1) for Qwen2.5-VL's 3-D rope.
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == image_id).long())


def test_generate_with_image_uses_3d_rope(tiny_dir: Path, image56) -> None:
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir).eval()
    processor = AutoProcessor.from_pretrained(tiny_dir)
    batch = processor(text=[image_prompt(processor)], images=[image56], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, min_new_tokens=3, do_sample=False, use_cache=True)
    assert out.shape == (1, batch["input_ids"].shape[1] + 3)
    assert torch.equal(out[:, : batch["input_ids"].shape[1]], batch["input_ids"])
    # A 2x2 merged image spans 2 rope positions instead of 4 tokens, so text after it is shifted
    # by -2: proof that image-aware (M-RoPE) positions were used.
    assert model.model.rope_deltas.tolist() == [[-2]]


def test_unknown_builtin_lists_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    with pytest.raises(ModelConfigError, match=r"^unknown built-in model builtin:nope; available: "
                                               r".*builtin:small-realvocab, builtin:tiny"):
        ensure_builtin("nope")


def test_cache_defaults_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("R1FIT_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert builtin_dir("tiny") == tmp_path / ".cache" / "r1fit" / "models" / f"tiny-v{BUILDER_VERSION}"


def test_concurrent_builds_and_rebuild_without_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_builtin("tiny"))
        except BaseException as err:  # surfaced by the assert below
            errors.append(err)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    models_dir = tmp_path / "models"
    # Only the finished folder (and the lock file) remain: no half-written temp folders.
    assert sorted(p.name for p in models_dir.iterdir() if p.is_dir()) == [results[0].name]

    folder = results[0]
    weights_mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin("tiny") == folder  # cached: no rebuild
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights_mtime
    (folder / MARKER_FILE).unlink()  # e.g. a crash mid-copy by an old version
    assert ensure_builtin("tiny") == folder
    assert (folder / MARKER_FILE).is_file()


def test_small_realvocab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image56) -> None:
    """The one test that builds the ~81M-parameter model (~10-20 s)."""
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    folder = ensure_builtin("small-realvocab")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    cfg = model.config
    assert cfg.text_config.vocab_size == 151_936 and cfg.text_config.hidden_size == 256
    assert cfg.text_config.num_hidden_layers == 4
    assert len(processor.tokenizer) < 2048  # ids past the tokenizer are padding rows, as in Qwen
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight.shape == (151_936, 256) and head.weight.data_ptr() != embed.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 2 * 151_936 * 256 < n_params < 90_000_000
    assert cfg.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = processor(text=[image_prompt(processor)], images=[image56], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], 151_936)


def test_small_builds_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image56) -> None:
    """builtin:small (7.6M params, the zoom task's model: benchmarks/zoom_skills.py): tiny's
    tokenizer and processor, hidden 256 over 4 layers, a 4-block 256-wide vision tower; loads back
    with the weights it was built with and runs an image prompt (~2 s)."""
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path))
    folder = ensure_builtin("small")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (256, 4, len(processor.tokenizer))
    assert (vision.hidden_size, vision.depth, vision.out_hidden_size) == (256, 4, 256)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 7_000_000 < n_params < 8_000_000
    built, _ = create_model("small")
    for key, value in built.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    batch = processor(text=[image_prompt(processor)], images=[image56], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (1, batch["input_ids"].shape[1], len(processor.tokenizer))


def test_a_cache_that_is_a_file_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from r1fit.cli import main
    from r1fit.models.builtin import cache_root

    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    for env in (blocker, blocker / "below"):
        monkeypatch.setenv("R1FIT_CACHE", str(env))
        with pytest.raises(ModelConfigError, match=rf"^R1FIT_CACHE={env}: {blocker} is a file, "
                                                   "not a folder; point R1FIT_CACHE at a folder"):
            cache_root()
    assert main(["plan"]) == 2  # builtin:tiny's config is built into the cache
    assert capsys.readouterr().err.startswith(f"r1fit: error: R1FIT_CACHE={blocker / 'below'}: ")
    monkeypatch.setenv("R1FIT_CACHE", str(tmp_path / "new" / "cache"))
    assert cache_root() == tmp_path / "new" / "cache"  # a folder still to be made is fine


def test_every_builtin_is_named_in_model_paths_help() -> None:
    from dataclasses import fields

    from r1fit.config.schema import ModelConfig
    from r1fit.models.builtin import BUILTINS

    help_text = next(f.metadata["help"] for f in fields(ModelConfig) if f.name == "path")
    listed = help_text.split("NAME one of ", 1)[1].split(" (", 1)[0]
    assert sorted(listed.split(", ")) == sorted(BUILTINS)
