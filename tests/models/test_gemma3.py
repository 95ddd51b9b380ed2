"""builtin:tiny-gemma3: a real Gemma 3 (SigLIP tower, sliding-window and global layers,
bidirectional attention over image tokens) with a locally trained Gemma tokenizer and Gemma 3's
chat template, which round-trips through from_pretrained; r1fit reads what it needs from its
config, tokenizer and chat template (image token, end of turn, stop tokens), its log-probs are the
model's own (with or without a declared softcap), and generation never samples an image token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    GemmaTokenizer,
)

from r1fit.data.batch import collate, encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.data.sample import Sample
from r1fit.models.builtin import MARKER_FILE, create_model
from r1fit.models.errors import ModelConfigError
from r1fit.models.load import load_policy, special_token_ids, stop_token_ids
from r1fit.models.logprobs import completion_logprobs
from r1fit.models.tokenizer import GEMMA3_SPECIAL_TOKENS, REASONING_TOKENS, build_gemma3_tokenizer
from r1fit.rollout.generate import SamplingSettings, TokenIds, generate_completions, row_seeds

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemma_dir(builtin_folder) -> Path:
    return builtin_folder("tiny-gemma3")


@pytest.fixture(scope="module")
def processor(gemma_dir: Path):
    return AutoProcessor.from_pretrained(gemma_dir)


def load(folder: Path, dtype: str = "float32", lora_r: int = 0):
    return load_policy(str(folder), lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                       lora_target="all-linear", freeze_vision=False, dtype=dtype, device=CPU,
                       gradient_checkpointing=False)


def shapes_rows(processor, n: int = 3):
    """``n`` builtin:shapes prompts (different lengths, so batches are left-padded), two rows each."""
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=16)
    prompts = encode_prompts(processor, [data[i] for i in (0, 2, 1)[:n]], "Think, then answer.")
    assert len({p.length for p in prompts}) > 1
    return [p for p in prompts for _ in range(2)]


# ---- the build


def test_builds_a_real_gemma3_that_reloads_bit_exact(gemma_dir: Path, processor) -> None:
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "processor_config.json", MARKER_FILE):
        assert (gemma_dir / name).is_file(), name
    assert json.loads((gemma_dir / MARKER_FILE).read_text())["family"] == "gemma3"
    loaded = AutoModelForImageTextToText.from_pretrained(gemma_dir)
    assert isinstance(loaded, Gemma3ForConditionalGeneration)
    assert isinstance(processor, Gemma3Processor) and isinstance(processor.tokenizer, GemmaTokenizer)
    built, _ = create_model("tiny-gemma3")
    expected, got = built.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # transformers initialises the image projection to zeros; the built-in draws it, so images
    # reach the language model from the start
    assert loaded.model.multi_modal_projector.mm_input_projection_weight.abs().sum() > 0


def test_config_matches_tokenizer_and_gemma3_layout(gemma_dir: Path, processor) -> None:
    cfg = AutoModelForImageTextToText.from_pretrained(gemma_dir).config
    tok = processor.tokenizer
    text = cfg.text_config
    assert text.vocab_size == len(tok) and 1000 < len(tok) < 2048
    assert cfg.image_token_id == tok.image_token_id == tok.convert_tokens_to_ids("<image_soft_token>")
    assert cfg.boi_token_id == tok.boi_token_id == tok.convert_tokens_to_ids("<start_of_image>")
    assert cfg.eoi_token_id == tok.convert_tokens_to_ids("<end_of_image>")
    assert (text.pad_token_id, text.bos_token_id) == (tok.pad_token_id, tok.bos_token_id) == (0, 2)
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert text.eos_token_id == [tok.eos_token_id, end_of_turn]
    assert text.layer_types == ["sliding_attention", "full_attention"] and text.sliding_window == 32
    assert text.final_logit_softcapping is None
    assert cfg.vision_config.image_size == 64 and cfg.vision_config.patch_size == 16
    assert cfg.mm_tokens_per_image == processor.image_seq_length == 4
    generation = AutoModelForImageTextToText.from_pretrained(gemma_dir).generation_config
    assert generation.eos_token_id == [tok.eos_token_id, end_of_turn]


# ---- the tokenizer and the chat template


def test_tokenizer_specials_and_reasoning_tags(processor) -> None:
    tok = processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIAL_TOKENS] == list(range(10))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == ("<bos>", "<eos>", "<pad>", "<unk>")
    assert (tok.boi_token, tok.eoi_token, tok.image_token) == (
        "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    text = "<think>3 red circles</think><answer>3</answer>"
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False).input_ids)
    assert pieces[0] == "<think>" and pieces[-1] == "</answer>"
    assert all(tag in pieces for tag in REASONING_TOKENS)
    # the tags are not special: they survive skip_special_tokens, the turn tokens do not
    ids = tok("<start_of_turn>model\n" + text + "<end_of_turn>").input_ids
    assert ids[0] == tok.bos_token_id  # Gemma's tokenizer adds <bos>
    assert tok.decode(ids, skip_special_tokens=True) == "model\n" + text
    # byte fallback: text outside the small corpus still round-trips
    assert tok.decode(tok("naïve 😀", add_special_tokens=False).input_ids) == "naïve 😀"
    a, b = build_gemma3_tokenizer(), build_gemma3_tokenizer()
    assert a.get_vocab() == b.get_vocab() == tok.get_vocab()


def chat(processor, messages, generation_prompt: bool = True) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def test_chat_template_renders_gemma3s_format(processor) -> None:
    """Expected strings worked out from gemma-3-*-it's chat template: <bos>, the system text folded
    into the first user turn before a blank line, trimmed text parts, <start_of_image> per image,
    the assistant as ``model``."""
    image_turn = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What colour? "}]}
    system = {"role": "system", "content": [{"type": "text", "text": "Think, then answer."}]}
    assert chat(processor, [system, image_turn]) == (
        "<bos><start_of_turn>user\nThink, then answer.\n\n<start_of_image>What colour?<end_of_turn>\n"
        "<start_of_turn>model\n")
    assert chat(processor, [image_turn]) == (
        "<bos><start_of_turn>user\n<start_of_image>What colour?<end_of_turn>\n<start_of_turn>model\n")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
                    {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Colour?"}, {"type": "image"}]}]
    assert chat(processor, conversation, generation_prompt=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nColour?<start_of_image><end_of_turn>\n")
    with pytest.raises(Exception, match="roles must alternate"):
        chat(processor, [image_turn, image_turn])


def test_processor_expands_images_and_marks_them_for_bidirectional_attention(processor) -> None:
    """One <bos> (the template writes it; encode_prompts does not add another), the image as
    Gemma 3's blank-line-wrapped block of 4 soft tokens, and token_type_ids 1 exactly there."""
    sample = Sample(images=[Image.new("RGB", (56, 40), "red")], problem="What colour?", solution="red",
                    source="test")
    prompt = encode_prompts(processor, [sample], "")[0]
    tok = processor.tokenizer
    pieces = tok.convert_ids_to_tokens(prompt.input_ids)
    assert pieces[:2] == ["<bos>", "<start_of_turn>"] and pieces.count("<bos>") == 1
    start = pieces.index("<start_of_image>")
    assert pieces[start - 2:start] == ["<0x0A>", "<0x0A>"]
    assert pieces[start + 1:start + 6] == ["<image_soft_token>"] * 4 + ["<end_of_image>"]
    assert set(prompt.token_inputs) == {"token_type_ids"}
    assert torch.equal(prompt.token_inputs["token_type_ids"], (prompt.input_ids == tok.image_token_id).long())
    # every image is resized to the tower's 64 px, whatever r1fit's pixel budget made of it
    assert tuple(prompt.image_inputs["pixel_values"].shape) == (1, 3, 64, 64)


def test_collate_extends_token_type_ids_with_zeros(processor) -> None:
    rows = shapes_rows(processor)
    completions = [torch.tensor([11, 12, 13])] * len(rows)
    batch = collate(rows, completions, pad_id=0)
    types = batch.inputs["token_type_ids"]
    for i, row in enumerate(rows):
        start = batch.prompt_len - row.length
        assert not types[i, :start].any()  # left pads
        assert torch.equal(types[i, start:batch.prompt_len], row.token_inputs["token_type_ids"])
        assert not types[i, batch.prompt_len:].any()  # completion tokens are text


# ---- what r1fit reads off the model


def test_special_token_ids_come_from_config_tokenizer_and_template(gemma_dir: Path) -> None:
    model, processor = load(gemma_dir)
    tok = processor.tokenizer
    ids = special_token_ids(model, processor)
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert ids == {"image_pad": tok.convert_tokens_to_ids("<image_soft_token>"),
                   "vision_start": tok.convert_tokens_to_ids("<start_of_image>"),
                   "vision_end": tok.convert_tokens_to_ids("<end_of_image>"),
                   "eos": tok.convert_tokens_to_ids("<eos>"), "pad": tok.convert_tokens_to_ids("<pad>"),
                   "end_of_turn": end_of_turn}
    assert stop_token_ids(model, processor) == [tok.eos_token_id, end_of_turn]
    assert TokenIds.of(model, processor) == TokenIds(pad=0, eos=[tok.eos_token_id, end_of_turn],
                                                     blocked=[ids["image_pad"]])


def test_generation_never_samples_an_image_token(gemma_dir: Path) -> None:
    model, processor = load(gemma_dir)
    ids = TokenIds.of(model, processor)
    image = ids.blocked[0]

    def favour_image(module, inputs, logits):  # make the image token by far the likeliest
        logits[..., image] += 50.0
        return logits

    model.get_output_embeddings().register_forward_hook(favour_image)
    rows = shapes_rows(processor)
    greedy = generate_completions(model, rows, seeds=None, batch_size=4, ids=ids, device=CPU,
                                  settings=SamplingSettings(max_new_tokens=6, greedy=True))
    unblocked = TokenIds(ids.pad, ids.eos, blocked=[])
    hot = SamplingSettings(max_new_tokens=6, temperature=2.0)
    seeds = row_seeds(0, 0, 0, len(rows))
    sampled = generate_completions(model, rows, seeds=seeds, batch_size=4, ids=ids, device=CPU, settings=hot)
    free = generate_completions(model, rows, seeds=seeds, batch_size=4, ids=unblocked, device=CPU, settings=hot)
    assert (torch.cat(free) == image).any()  # without blocking the model would emit it
    for out in (greedy, sampled):
        assert torch.cat(out).numel() > len(rows) and not (torch.cat(out) == image).any()


# ---- log-probs


def float64_batch(folder: Path):
    model, processor = load(folder)
    model = model.double()
    rows = shapes_rows(processor)
    for row in rows:
        row.image_inputs["pixel_values"] = row.image_inputs["pixel_values"].double()
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(10, len(processor.tokenizer) - 10, (3 + (i * 5) % 7,), generator=gen)
                   for i in range(len(rows))]
    return model, collate(rows, completions, special_token_ids(model, processor)["pad"])


def model_logprobs(model, batch) -> torch.Tensor:
    """The model's own logits' log-softmax at the completion tokens (the slow reference)."""
    with torch.no_grad():
        logits = model(**batch.inputs).logits.double()
    start, width = batch.prompt_len - 1, batch.completion_ids.shape[1]
    return torch.log_softmax(logits[:, start:start + width], -1).gather(
        -1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask


def with_softcap(gemma_dir: Path, folder: Path, cap: float) -> Path:
    shutil.copytree(gemma_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = cap
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("softcap", [None, 0.5])
def test_logprobs_equal_the_models_own_logits(gemma_dir: Path, tmp_path: Path, softcap) -> None:
    """Left-padded rows with images, completions of different lengths. With a softcap in the
    config too: Gemma3ForConditionalGeneration's forward does not apply it (transformers 5), so
    neither may r1fit; the load-time check finds that out."""
    folder = gemma_dir if softcap is None else with_softcap(gemma_dir, tmp_path / "capped", softcap)
    model, batch = float64_batch(folder)
    assert model.config.text_config.final_logit_softcapping == softcap
    with torch.no_grad():
        ours = completion_logprobs(model, batch, chunk_size=5)
    reference = model_logprobs(model, batch)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-10)
    # the image tokens' bidirectional attention is in both: without token_type_ids the model's
    # log-probs change
    causal = {k: v for k, v in batch.inputs.items() if k != "token_type_ids"}
    with torch.no_grad():
        logits = model(**causal).logits.double()
    assert not torch.allclose(logits, model(**batch.inputs).logits.double().detach())


def test_a_forward_that_caps_its_logits_is_refused(gemma_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A model class whose forward applies the declared softcap (as PaliGemma's and Gemma 3n's do)
    would sample from capped logits, which r1fit's chunked log-probs do not compute: refused at
    load time, naming the cap."""
    folder = with_softcap(gemma_dir, tmp_path / "capped", 0.5)
    forward = Gemma3ForConditionalGeneration.forward

    def capped(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = 0.5 * torch.tanh(out.logits / 0.5)
        return out

    monkeypatch.setattr(Gemma3ForConditionalGeneration, "forward", capped)
    with pytest.raises(ModelConfigError, match=r"returns 0\.5 \* tanh\(head output / 0\.5\)"):
        load(folder)


def test_greedy_generation_agrees_with_the_training_forward(gemma_dir: Path) -> None:
    """Every greedy token is the argmax of the training forward's logits over the collated batch
    (left pads, token_type_ids extended with zeros, sliding window): generation and training see
    the same model."""
    model, processor = load(gemma_dir)
    model.eval()
    ids = TokenIds.of(model, processor)
    rows = shapes_rows(processor)
    greedy = generate_completions(model, rows, seeds=None, batch_size=len(rows), ids=ids, device=CPU,
                                  settings=SamplingSettings(max_new_tokens=8, greedy=True))
    batch = collate(rows, greedy, ids.pad)
    with torch.no_grad():
        logp = completion_logprobs(model, batch, chunk_size=16)
        logits = model(**batch.inputs).logits
    start, width = batch.prompt_len - 1, batch.completion_ids.shape[1]
    best = logits[:, start:start + width].masked_fill(
        torch.isin(torch.arange(logits.shape[-1]), torch.tensor(ids.blocked)), float("-inf")).argmax(-1)
    mask = batch.completion_mask.bool()
    assert torch.equal(best[mask], batch.completion_ids[mask])
    assert (logp[mask] < 0).all()
