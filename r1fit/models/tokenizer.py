"""Small, locally trained tokenizers for the built-in models: Qwen2-VL style and Gemma 3 style.

The Hugging Face hub is unreachable here, so the built-in models cannot borrow Qwen's 151k-token or
Gemma's 262k-token tokenizer. Instead we train a BPE on a small built-in English corpus with the
real tokenizer's pipeline, then add the model's special tokens and its chat template:

- Qwen2-VL: byte-level BPE (same pre-tokenizer regex, normaliser and decoder as Qwen2), Qwen2-VL's
  special tokens and real chat template, loaded as `Qwen2Tokenizer`;
- Gemma 3: SentencePiece-style BPE (spaces as "▁", byte fallback to `<0xNN>` tokens, no
  pre-tokenizer) with Gemma 3's special tokens at the front of the vocabulary and its chat
  template, loaded as `GemmaTokenizer`, with the `boi_token` / `eoi_token` / `image_token` names
  `Gemma3Processor` reads.

Each loads back through transformers as the class a real checkpoint uses, so everything downstream
(processor, chat template, image-token expansion) runs the real code paths; only the token ids
differ.
"""

from __future__ import annotations

import itertools
import json

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import GemmaTokenizer, Qwen2Tokenizer

# Qwen2's pre-tokenisation regex (copied from transformers' tokenization_qwen2.py) so our BPE splits
# text exactly where Qwen's does.
_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                      r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

#: Upper bound on the trained BPE part of the vocabulary (bytes + merges); training stops earlier
#: (~700) once the small corpus has no pair left to merge.
BPE_VOCAB_SIZE = 1024

#: Qwen2-VL's special tokens, in the order Qwen assigns them ids (151643..151656 there).
QWEN2VL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: R1-style reasoning/answer tags. Added (atomic) but NOT special, so `skip_special_tokens=True`
#: keeps them in decoded completions, where the format reward needs to see them.
REASONING_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<answer>", "</answer>")

#: Qwen2-VL-7B-Instruct's chat template, verbatim (system prompt default, image/video placeholders,
#: optional "Picture N:" ids, `<|im_start|>assistant\n` generation prompt).
QWEN2VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Qwen3-VL-Instruct's chat template without its tool-calling parts (a row never has tools): no
#: default system prompt, the system text taken from text parts, image/video placeholders in user
#: turns, text parts only in assistant turns. Renders what the real template renders for such rows.
QWEN3VL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}"
    "{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content_item in message.content %}{%- if 'text' in content_item %}"
    "{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: Gemma 3's special tokens, in the order of its vocabulary (pad, eos, bos, unk and mask are ids 0-4
#: there too; the turn and image tokens are 105, 106, 255999, 256000 and 262144 there).
GEMMA3_SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)

#: Gemma 3's chat template (gemma-3-*-it), written out here: `<bos>` first; a system turn is folded
#: into the first user turn (its text, then a blank line), as Gemma has no system role; roles must
#: alternate; the assistant's role is `model`; text parts are trimmed; an image part is
#: `<start_of_image>`, which the processor expands into the image's soft tokens. Gemma 3 has no tool
#: calls, so this renders what the real template renders for every r1fit row.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

_SHAPES = ("circle", "square", "triangle", "rectangle", "star", "diamond", "ellipse", "hexagon", "shape", "object")
_COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "black", "white", "grey", "gray", "pink", "brown")
_POSITIONS = (
    "left",
    "right",
    "top",
    "bottom",
    "middle",
    "center",
    "centre",
    "above",
    "below",
    "next to",
    "upper left",
    "upper right",
    "lower left",
    "lower right",
    "corner",
    "side",
    "between",
    "inside",
)
_COUNT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_QUESTIONS = (
    "What colour is the {s}?",
    "What color is the {s} on the {p}?",
    "How many {s}s are in the image?",
    "How many {c} {s}s are there?",
    "Where is the {c} {s}?",
    "Which shape is {c}?",
    "Is there a {c} {s} in the picture?",
    "Count the {s}s and give the number.",
    "Which object is at the {p}?",
    "Why is the {s} {c}? Who drew it, and when?",
)
_ANSWERS = (
    "<think>I see {n} {c} {s}s at the {p}.</think><answer>{n}</answer>",
    "<think>The {s} on the {p} is {c}.</think><answer>{c}</answer>",
    "<think>Let me count: there are {w} {s}s, so the answer is {n}.</think><answer>{n}</answer>",
    "<think>The {c} {s} is at the {p} of the image.</think><answer>{p}</answer>",
    "Yes, there is a {c} {s}. No, it is not {c2}. The answer is {n}.",
)
_EXTRA = (
    "0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 100 3.14 -1 1/2 2+2=4 (1, 2) [3, 4] {5}",
    "The answer is: yes. The answer is: no. Answer with a single word or number.",
    "First, think about the question; then answer it! Put the reasoning in <think> </think> tags "
    "and the final answer in <answer> </answer> tags, e.g. <think>reasoning</think><answer>3</answer>.",
    "You are a helpful assistant. Describe this image. Look at the picture and answer the question.",
    "what which where when who why how many much is are was were the a an of in on at to and or",
    "\"quoted\" 'single' a-b a_b a/b a\\b a|b a*b a%b a#b a@b a&b a^b a~b a`b a$b a<b a>b ... !? ;:",
)


def training_corpus() -> list[str]:
    """Return the fixed English corpus the built-in BPE is trained on (deterministic order)."""
    lines: list[str] = list(_EXTRA)
    # A deterministic walk over (shape, colour, position, count) so every word appears in many
    # contexts (with and without a leading space) and the merges learn whole words.
    combos = itertools.product(_SHAPES, _COLOURS, _POSITIONS[:8], range(len(_COUNT_WORDS)))
    for i, (s, c, p, n) in enumerate(combos):
        if i % 7:  # thin the product out: ~1.2k lines is plenty and keeps training < 1 s
            continue
        c2 = _COLOURS[(i // 7) % len(_COLOURS)]
        q = _QUESTIONS[i % len(_QUESTIONS)].format(s=s, c=c, p=p)
        a = _ANSWERS[(i // 3) % len(_ANSWERS)].format(s=s, c=c, c2=c2, p=p, n=n, w=_COUNT_WORDS[n])
        lines.append(f"{q} {a}")
    for p in _POSITIONS:
        lines.append(f"The {p} of the image. It is on the {p}. {p.capitalize()}.")
    for w in _COUNT_WORDS:
        lines.append(f"There are {w}. {w.capitalize()} of them.")
    return lines


def _train_bpe(tok: Tokenizer, trainer: trainers.BpeTrainer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train `tok` (a BPE model with its normaliser and pre-tokenizer set) on `training_corpus()`;
    return (vocab, merges)."""
    # The tokenizers BPE trainer is deterministic for a fixed corpus (checked across processes).
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    # The Python API exposes the vocab but not the merges; the serialised model has both.
    merges = [(a, b) for a, b in json.loads(tok.to_str())["model"]["merges"]]
    return tok.get_vocab(), merges


def _qwen_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Qwen2-style byte-level BPE trained on `training_corpus()`: (vocab, merges)."""
    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        # All 256 byte symbols, so any text (any language, emoji) still tokenizes, just into bytes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    return _train_bpe(tok, trainer)


def _gemma_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Gemma-style BPE trained on `training_corpus()`: (vocab, merges). The vocabulary starts with
    `GEMMA3_SPECIAL_TOKENS`, then the 256 byte-fallback tokens `<0x00>`..`<0xFF>`."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")  # as GemmaTokenizer
    # GemmaTokenizer has no pre-tokenizer; training splits before each "▁" so that, as in
    # SentencePiece, no merge crosses a word start: applied to unsplit text the merges then cut
    # exactly where they would on the split text.
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=[*GEMMA3_SPECIAL_TOKENS, *byte_tokens])
    return _train_bpe(tok, trainer)


#: Qwen's id of its first special token, `<|endoftext|>`: Qwen2/2.5/3-VL's BPE fills ids 0..151642
#: and their config.json files name the image, video and vision tokens at 151652..151656
QWEN_FIRST_SPECIAL_ID = 151_643


def _padded_to(vocab: dict[str, int], size: int) -> dict[str, int]:
    """`vocab` grown to `size` ids with filler tokens `<|unused_N|>`. No merge makes them, so text
    never tokenizes to them; a model may still sample them, and they decode to their own text (all
    their characters are printable ASCII, which byte-level BPE maps to itself)."""
    if len(vocab) > size:
        raise ValueError(f"the trained BPE has {len(vocab)} tokens, more than the {size} asked for")
    padded = dict(vocab)
    fillers = (f"<|unused_{n}|>" for n in itertools.count())
    while len(padded) < size:
        token = next(fillers)
        if token not in padded:
            padded[token] = len(padded)
    return padded


def build_tokenizer(bpe_vocab_size: int = BPE_VOCAB_SIZE, *, first_special_id: int | None = None
                    ) -> Qwen2Tokenizer:
    """Build the built-in tokenizer: trained BPE + Qwen2-VL specials + atomic reasoning tags.

    Ids: the BPE vocabulary first (0..n-1), then the 14 Qwen2-VL special tokens in Qwen's order,
    then `<think>`, `</think>`, `<answer>`, `</answer>`. eos is `<|im_end|>`, pad `<|endoftext|>`,
    no bos and no unk (byte-level BPE never needs one), as in Qwen2-VL-Instruct.
    `first_special_id` (e.g. `QWEN_FIRST_SPECIAL_ID`): filler tokens (`_padded_to`) between the BPE
    and the specials, so the specials have a real checkpoint's ids and its config.json holds as it
    is; the trained BPE, and so the ids of text without added tokens, stay the same.
    """
    vocab, merges = _qwen_bpe(bpe_vocab_size)
    if first_special_id is not None:
        vocab = _padded_to(vocab, first_special_id)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        # eos/pad are set after the specials are added, so ids follow Qwen's order rather than
        # the constructor's (which would put eos first).
        eos_token=None,
        pad_token=None,
        chat_template=QWEN2VL_CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in QWEN2VL_SPECIAL_TOKENS], special_tokens=True
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    # Qwen lists every special but <|endoftext|> as `additional_special_tokens`; mirroring that keeps
    # `all_special_ids` (and so skip_special_tokens) the same as with a real checkpoint.
    tokenizer.add_special_tokens({"extra_special_tokens": list(QWEN2VL_SPECIAL_TOKENS[1:])})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def build_gemma3_tokenizer(bpe_vocab_size: int = BPE_VOCAB_SIZE) -> GemmaTokenizer:
    """Build the built-in Gemma 3 tokenizer: Gemma-style BPE + Gemma 3's specials + atomic
    reasoning tags.

    Ids: `GEMMA3_SPECIAL_TOKENS` first (pad 0, eos 1, bos 2, unk 3, mask 4, then the turn and image
    tokens), the 256 byte-fallback tokens, then the trained BPE (up to `bpe_vocab_size` ids in all).
    The reasoning tags are added (atomic, not special) after it, or where the BPE already learnt
    them whole (with no pre-tokenizer, `</think>`, `<answer>` and `</answer>` are merges). eos is
    `<eos>` (a turn ends with `<end_of_turn>`, which the generation config stops at), bos `<bos>`
    (added when tokenizing, and written by the chat template), pad `<pad>`, as in Gemma 3.
    `boi_token`, `eoi_token` and `image_token` name the image tokens for `Gemma3Processor`.
    """
    vocab, merges = _gemma_bpe(bpe_vocab_size)
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        add_bos_token=True,
        boi_token="<start_of_image>",
        eoi_token="<end_of_image>",
        image_token="<image_soft_token>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    # already in the vocabulary: this marks them special and atomic, at their ids
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in GEMMA3_SPECIAL_TOKENS[5:]],
                         special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TOKENS])
    return tokenizer
