"""builtin:tiny-qwen3vl, a real Qwen3-VL (interleaved M-RoPE, DeepStack, 16 px patches), and
builtin:tiny-qwen2vl, a real Qwen2-VL (LayerNorm vision blocks, full attention in every block),
round-trip through from_pretrained, and r1fit's padded batches give both the positions they
need: chunked log-probs equal the model's own logits, a row does not depend on its batch, and
greedy generation agrees with the teacher-forced forward that training runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from r1fit.data.batch import collate
from r1fit.models.builtin import MARKER_FILE, create_model, ensure_builtin
from r1fit.models.logprobs import completion_logprobs
from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions

from .conftest import image_prompt

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen3_dir(tiny_cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("R1FIT_CACHE", str(tiny_cache))
        return ensure_builtin("tiny-qwen3vl")


def assert_reloads_bit_exact(name: str, loaded: torch.nn.Module) -> None:
    built, _ = create_model(name)
    expected, got = built.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_builds_a_real_qwen3vl_that_reloads_bit_exact(qwen3_dir: Path) -> None:
    loaded = AutoModelForImageTextToText.from_pretrained(qwen3_dir)
    assert isinstance(loaded, Qwen3VLForConditionalGeneration)
    assert (qwen3_dir / MARKER_FILE).is_file()
    cfg = loaded.config
    assert cfg.text_config.rope_parameters["mrope_interleaved"] is True
    assert list(cfg.vision_config.deepstack_visual_indexes) == [0]
    assert cfg.vision_config.patch_size == 16
    assert_reloads_bit_exact("tiny-qwen3vl", loaded)


def test_builds_a_real_qwen2vl_that_reloads_bit_exact(builtin_folder) -> None:
    folder = builtin_folder("tiny-qwen2vl")
    loaded = AutoModelForImageTextToText.from_pretrained(folder)
    assert isinstance(loaded, Qwen2VLForConditionalGeneration)
    vision = loaded.config.vision_config
    # Qwen2-VL's tower: LayerNorm blocks with a fc1 -> QuickGELU -> fc2 MLP of mlp_ratio x the
    # block width, no attention windows (Qwen2.5-VL's window_size/fullatt_block_indexes)
    assert (vision.embed_dim, vision.mlp_ratio, vision.hidden_act) == (64, 2, "quick_gelu")
    assert not hasattr(vision, "fullatt_block_indexes")
    block = loaded.model.visual.blocks[0]
    assert isinstance(block.norm1, torch.nn.LayerNorm) and hasattr(block.mlp, "fc1")
    assert type(AutoProcessor.from_pretrained(folder)).__name__ == "Qwen2VLProcessor"
    assert_reloads_bit_exact("tiny-qwen2vl", loaded)


def test_chat_template_renders_like_qwen3vl_instruct(qwen3_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(qwen3_dir)
    # no default system prompt (Qwen2-VL's template adds "You are a helpful assistant.")
    assert image_prompt(processor, "What colour?") == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour?<|im_end|>\n"
        "<|im_start|>assistant\n")
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "<answer>red</answer>"}]}]
    assert processor.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<answer>red</answer><|im_end|>\n")


def test_processor_makes_32px_tokens(qwen3_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(qwen3_dir)
    batch = processor(text=[image_prompt(processor)], images=[Image.new("RGB", (64, 64))],
                      return_tensors="pt")
    # 64 px = 4x4 patches of 16 px -> grid (1, 4, 4); a 2x2 merge -> 4 image tokens
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    # one row per patch: 3 channels x temporal 2 x 16 x 16 = 1536 values
    assert tuple(batch["pixel_values"].shape) == (16, 1536)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((batch["input_ids"] == image_id).sum()) == 4
    assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == image_id).long())


@pytest.fixture(params=["tiny-qwen3vl", "tiny-qwen2vl"])
def qwen_vl(request, builtin_folder, float64_model, completions_for):
    """Each model in float64, 3 shapes prompts of different lengths x 2 rows, random
    completions."""
    model, processor, prompts = float64_model(builtin_folder(request.param), checkpointing=False,
                                              max_pixels=4096, indices=(0, 2, 1))
    rows = [p for p in prompts for _ in range(2)]
    completions = completions_for(len(processor.tokenizer),
                                  [3 + (i * 5) % 7 for i in range(len(rows))])
    return model, processor, rows, completions


def test_padded_batch_logprobs_equal_the_model_and_each_row_alone(qwen_vl) -> None:
    model, processor, rows, completions = qwen_vl
    assert len({r.length for r in rows}) > 1  # left padding differs between rows
    pad = TokenIds.of(model, processor).pad
    batch = collate(rows, completions, pad)
    chunked = completion_logprobs(model, batch, chunk_size=5)
    with torch.no_grad():
        logits = model(**batch.inputs).logits.double()
    start, width = batch.prompt_len - 1, batch.completion_ids.shape[1]
    full = torch.log_softmax(logits[:, start:start + width], -1).gather(
        -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-10)
    # Qwen-VL's 3-D positions come from mm_token_type_ids (Qwen3-VL refuses images without
    # them): collate marks exactly the image tokens, none in the pads or completions
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    marks = (batch.inputs["input_ids"] == image_id) & batch.inputs["attention_mask"].bool()
    assert torch.equal(batch.inputs["mm_token_type_ids"], marks.long())
    for i in (0, 4):  # the shortest prompt, padded most in the batch, and a longer one
        alone = completion_logprobs(model, collate(rows[i:i + 1], completions[i:i + 1], pad),
                                    chunk_size=3)
        n = completions[i].shape[0]
        torch.testing.assert_close(alone[0, :n], chunked[i, :n], rtol=0, atol=1e-9)


def test_greedy_generation_matches_the_training_forward(qwen_vl) -> None:
    """Generation (KV cache, M-RoPE deltas) and the teacher-forced training forward must place
    the completion at the same positions: every greedy token is the training forward's argmax."""
    model, processor, rows, _ = qwen_vl
    ids = TokenIds.of(model, processor)
    prompts = rows[::2]
    greedy = SamplingSettings(max_new_tokens=6, greedy=True)
    completions = generate_completions(model, prompts, seeds=None, batch_size=len(prompts),
                                       settings=greedy, ids=ids, device=CPU)
    batch = collate(prompts, completions, ids.pad)
    with torch.no_grad():
        logits = model(**batch.inputs).logits
    for blocked in ids.blocked:
        logits[..., blocked] = float("-inf")
    start = batch.prompt_len - 1
    for i, comp in enumerate(completions):
        n = comp.shape[0]
        assert n > 0
        assert torch.equal(logits[i, start:start + n].argmax(-1), comp), i
