"""Random-weight models of a shipped config.json (benchmarks/gpu_check.py builds Qwen2.5-VL-3B/7B
so on a GPU): the config's token ids hold with the locally built tokenizer, the shapes are the
config's, and the folder loads through r1fit's own path."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from r1fit.models.builtin import build_from_config
from r1fit.models.errors import ModelConfigError
from r1fit.models.tokenizer import QWEN_FIRST_SPECIAL_ID, build_tokenizer

CUT = {"text": {"num_hidden_layers": 1, "hidden_size": 256, "intermediate_size": 512,
                "num_attention_heads": 2, "num_key_value_heads": 1},
       "vision": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                  "out_hidden_size": 256, "fullatt_block_indexes": [0]}}


def test_the_tokenizer_puts_the_specials_at_qwens_ids_and_tokenizes_text_as_before():
    qwen, small = build_tokenizer(first_special_id=QWEN_FIRST_SPECIAL_ID), build_tokenizer()
    ids = {t: qwen.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>",
                                                      "<|vision_start|>", "<|image_pad|>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                   "<|image_pad|>": 151655}
    text = "How many red circles are there? Two, at the left."  # added tokens aside
    assert qwen(text).input_ids == small(text).input_ids
    assert len(qwen) == 151661  # 151,643 + 14 specials + 4 reasoning tags
    # a filler id (which a random-weight model may sample) decodes to its own text
    assert qwen.decode([150000]).startswith("<|unused_")


def test_a_cut_3b_config_builds_with_the_vocabulary_and_loads(tmp_path):
    folder = build_from_config("Qwen/Qwen2.5-VL-3B-Instruct", tmp_path / "m", **CUT)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    config = model.config
    assert model.dtype == torch.bfloat16
    assert (config.text_config.vocab_size, config.image_token_id) == (151936, 151655)
    assert config.text_config.num_hidden_layers == 1 and config.vision_config.depth == 1
    processor = AutoProcessor.from_pretrained(folder)
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    assert processor.image_processor.size["longest_edge"] == 448 * 448


def test_a_model_without_a_shipped_config_or_a_key_is_refused(tmp_path):
    with pytest.raises(ModelConfigError, match="ships no config.json"):
        build_from_config("Qwen/Nothing-1B", tmp_path / "a")
    with pytest.raises(ModelConfigError, match="no 'no_such_key'"):
        build_from_config("Qwen/Qwen2.5-VL-3B-Instruct", tmp_path / "b", text={"no_such_key": 1})
