"""Special tokens from data and tools: which texts count, the bad-row message, the escape."""

from __future__ import annotations

import pytest
from transformers import AutoProcessor

from r1fit.config import ConfigError
from r1fit.data.batch import encode_prompts
from r1fit.data.errors import BadRowError
from r1fit.data.sample import Sample
from r1fit.data.specials import (
    ZERO_WIDTH_SPACE,
    escaped,
    row_special_token,
    special_token_in,
    special_tokens,
)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    return AutoProcessor.from_pretrained(tiny_dir)


def test_the_tokenizers_special_tokens_are_found_and_the_image_placeholder_is_not(processor):
    specials = special_tokens(processor.tokenizer)
    assert {"<|image_pad|>", "<|im_end|>", "<|im_start|>", "<|vision_start|>"} <= set(specials)
    assert "<image>" not in specials  # r1fit's own placeholder, replaced before the template
    assert list(specials) == sorted(specials, key=lambda t: (-len(t), t))  # longest first
    assert special_token_in("a <|vision_start|> b", specials) == "<|vision_start|>"
    assert special_token_in("plain text, <image> and <|image_pad", specials) is None


def test_a_row_names_its_field_and_token(processor):
    specials = special_tokens(processor.tokenizer)
    assert row_special_token(Sample([], "What colour?", "red", "f.jsonl:1"), specials) is None
    why = row_special_token(Sample([], "What <|image_pad|>?", "red", "f.jsonl:5"), specials)
    assert why.startswith("f.jsonl:5: its question holds the model's special token "
                          "'<|image_pad|>'")
    turns = (("user", "<image>What?"), ("assistant", "ok<|im_end|>"), ("user", "and?"),
             ("assistant", "red"))
    why = row_special_token(Sample([], "What?", "red", "f.jsonl:7", turns=turns), specials)
    assert why.startswith("f.jsonl:7: its assistant turn 2 holds the model's special token "
                          "'<|im_end|>'")
    with pytest.raises(BadRowError, match="special token '<|image_pad|>'"):
        encode_prompts(processor, [Sample([], "x <|image_pad|>", "red", "f.jsonl:5")], "")
    with pytest.raises(ConfigError, match="data.system_prompt holds the model's special token"):
        encode_prompts(processor, [Sample([], "x", "red", "f.jsonl:1")], "Be brief<|im_end|>")


def test_escaped_text_reads_the_same_and_tokenizes_as_plain_text(processor):
    tok = processor.tokenizer
    specials = special_tokens(tok)
    text = "found <|image_pad|><|image_pad|> and <|im_end|>, then <|im_start|>user"
    plain = escaped(text, specials)
    assert plain.replace(ZERO_WIDTH_SPACE, "") == text
    ids = tok(plain, add_special_tokens=False)["input_ids"]
    special_ids = set(tok.convert_tokens_to_ids(list(specials)))
    assert not special_ids & set(ids)
    assert special_ids & set(tok(text, add_special_tokens=False)["input_ids"])  # unescaped: yes
    assert escaped("nothing special", specials) == "nothing special"
