"""The vLLM engine's turn of the multi-turn loop (``VllmEngine.generate_turn``) on builtin:tiny-hd32:
a seeded row does not depend on its batch, greedy turns repeat, limits hold, a turn stops right
after the token that completes ``</tool_call>`` (also mid-token; random weights never write it, so
a copy of the model is set to write by a token chain that does), ``run_trajectories`` runs on it
end to end, and a context holding a tool image generates as Hugging Face generate does."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from r1fit.data.batch import encode_prompts
from r1fit.data.dataset import load_dataset
from r1fit.models.load import load_policy
from r1fit.models.weights import full_named_weights
from r1fit.rollout.generate import SamplingSettings, TokenIds, row_seeds
from r1fit.rollout.record import END_REASONS
from r1fit.rollout.turns import TurnBudgets, hf_generate_turn, run_trajectories
from r1fit.rollout.vllm_engine import cut_after_stop
from r1fit.tools import TOOL_CALL_CLOSE, ToolRunner

CPU = torch.device("cpu")
CROP = '<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y1": 0, "x2": 0.5, "y2": 0.5}}\n</tool_call>'
# after "\n" (every context's last token), the chain policy writes "</tool" + "_call" * k + ">b",
# k drawn by a fair coin at each "l": k = 1 writes the tag, completed inside the token ">b"; it then
# writes "xy" and ends (<|im_end|>) unless the turn was stopped
CHAIN = {"\n": ("</",), "</": ("to",), "to": ("o",), "o": ("l",), "l": ("_", ">b"), "_": ("c",),
         "c": ("al",), "al": ("l",), ">b": ("x",), "x": ("y",), "y": ("<|im_end|>",)}
CALL_TOKENS = ["</", "to", "o", "l", "_", "c", "al", "l", ">b"]  # k = 1


def policy(folder):
    return load_policy(str(folder), lora_r=0, lora_alpha=8, lora_dropout=0.0,
                       lora_target="all-linear", freeze_vision=False, dtype="float32",
                       device=CPU, gradient_checkpointing=False)


def chain_policy(model, tokenizer, chain: dict[str, tuple[str, ...]], scale: float = 10.0):
    """A copy of ``model`` whose next token depends on the last one only: after token t it
    samples uniformly among ``chain[t]`` (logits ~57 above every other token). Attention and the
    second MLP write nothing; the chain tokens' embeddings (tied to the output) are orthogonal
    basis vectors times ``scale``, and the first MLP maps each to the sum of its successors'."""
    model = copy.deepcopy(model)
    text = model.model.language_model
    names = sorted({*chain, *(s for successors in chain.values() for s in successors)})
    tokens = {name: tokenizer(name, add_special_tokens=False)["input_ids"] for name in names}
    assert all(len(t) == 1 for t in tokens.values()), tokens
    dim = {name: d for d, name in enumerate(names)}
    basis = torch.eye(text.config.hidden_size)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, :len(names)] = 0.0  # other tokens score 0 against the chain's directions
        for name in names:
            embed[tokens[name][0]] = scale * basis[dim[name]]
        for layer in text.layers:
            layer.self_attn.o_proj.weight.zero_()
            for module in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                module.weight.zero_()
            layer.post_attention_layernorm.weight.fill_(1.0)
        text.norm.weight.fill_(1.0)
        mlp, gate = text.layers[0].mlp, 1.0
        # the MLP's input is the normed embedding: 8 (= sqrt(64)) on the token's own direction
        norm = text.config.hidden_size ** 0.5
        for name, successors in chain.items():
            d = dim[name]
            mlp.gate_proj.weight[d, d], mlp.up_proj.weight[d, d] = gate, 1.0 / norm
            target = scale * sum(basis[dim[s]] for s in successors)
            mlp.down_proj.weight[:, d] = (target - scale * basis[d]) / torch.nn.functional.silu(
                torch.tensor(gate * norm))
    return model


@pytest.fixture(scope="module")
def setup(hd32_dir, start_vllm):
    """(engine, model, processor, ids, prompts): 3 image prompts of builtin:shapes; the engine
    takes 2 images per request (a row's image and one tool image)."""
    model, processor = policy(hd32_dir)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=8)
    prompts = encode_prompts(processor, [data[i] for i in range(3)], "Think, then answer.")
    engine = start_vllm(hd32_dir, model, processor, max_images=2)
    yield engine, model, processor, TokenIds.of(model, processor), prompts
    engine.close()


@pytest.fixture(scope="module")
def noisy(setup):
    """The tiny model moved by noise: its own greedy turns are one token repeated, this one's
    are varied and depend on the images."""
    model = copy.deepcopy(setup[1])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=gen))
    return model


def turn_fn(engine, ids, blocked=None):
    """The engine's turn as ``run_trajectories`` calls it."""
    return functools.partial(engine.generate_turn, temperature=1.0, top_p=1.0, eos=ids.eos,
                             blocked=ids.blocked if blocked is None else blocked)


def lists(turns):
    """The turns' tokens as lists (each turn comes with the engine's log-probs, left out)."""
    return [tokens.tolist() for tokens, _ in turns]


def test_cut_after_stop_keeps_the_token_that_completes_the_tag(hd32_dir):
    tok = AutoTokenizer.from_pretrained(hd32_dir)

    def cut(text):
        """(the pieces kept of ``text``'s tokens, how many tokens it had)"""
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        kept = cut_after_stop(ids, lambda x: tok.decode(x, skip_special_tokens=True),
                              TOOL_CALL_CLOSE)
        return [tok.decode([t]) for t in kept.tolist()], len(ids)

    tag = ["</", "to", "o", "l", "_", "c", "al", "l", ">"]  # how this tokenizer writes it
    # completed inside ">b": that token is kept whole, the rest is cut
    assert cut("a</tool_call>b and more") == (["a", *CALL_TOKENS], 14)
    assert cut("</tool_call></tool_call>") == (tag, 18)  # the first one
    assert cut("</tool_call><|im_end|>") == (tag, 10)
    assert cut("</tool_call>\u00e9") == (tag, 11)  # cut before the two bytes of one character
    # it is the last token: unchanged; so is a text without the tag
    assert cut("x </tool_call>") == (["x", " </", *tag[1:]], 10)
    assert cut("no call</tool") == (["n", "o", " c", "al", "l", "</", "to", "o", "l"], 9)
    # special tokens are skipped, as vLLM's detokenizer and StopAtToolCall skip them
    assert cut("</tool_c<|im_end|>all> more")[0] == [*tag[:6], "<|im_end|>", *tag[6:]]


@pytest.mark.vllm
def test_a_seeded_row_does_not_depend_on_its_batch(setup, noisy):
    engine, _, _, ids, prompts = setup
    engine.load_weights(full_named_weights(noisy))
    turn = turn_fn(engine, ids)
    seeds, limits = row_seeds(3, 1, 0, 3), [6, 12, 9]
    together = lists(turn(prompts, seeds, limits))
    alone = [lists(turn([prompts[i]], [seeds[i]], [limits[i]]))[0] for i in (2, 0, 1)]
    assert [alone[1], alone[2], alone[0]] == together
    assert all(1 <= len(t) <= n for t, n in zip(together, limits))
    other = lists(turn(prompts, row_seeds(4, 1, 0, 3), limits))
    assert other != together  # the seeds matter


@pytest.mark.vllm
def test_greedy_turns_repeat_and_limits_hold(setup, noisy):
    engine, _, _, ids, prompts = setup
    engine.load_weights(full_named_weights(noisy))
    turn = turn_fn(engine, ids)
    first = lists(turn(prompts, None, [12, 12, 12]))
    assert all(len(set(t)) > 2 for t in first)
    assert lists(turn(prompts, None, [12, 12, 12])) == first
    assert lists(turn(prompts[1:], None, [12, 12])) == first[1:]
    # no end token can be sampled: each turn runs to its own limit
    no_end = turn_fn(engine, ids, blocked=[*ids.blocked, *ids.eos])
    assert [len(t) for t in lists(no_end(prompts, row_seeds(0, 0, 0, 3), [1, 4, 9]))] == [1, 4, 9]


@pytest.fixture(scope="module")
def chain(setup):
    """The tiny model set to write by ``CHAIN`` (every prompt ends with its first token)."""
    _, model, processor, _, prompts = setup
    tok = processor.tokenizer
    assert all(int(p.input_ids[-1]) == tok("\n")["input_ids"][0] for p in prompts)
    return chain_policy(model, tok, CHAIN)


@pytest.mark.vllm
def test_a_turn_stops_right_after_the_token_that_completes_the_tag(setup, chain, monkeypatch):
    engine, _, processor, ids, prompts = setup
    tok = processor.tokenizer
    engine.load_weights(full_named_weights(chain))
    rows = [p for p in prompts for _ in range(4)]
    seeds = row_seeds(11, 0, 0, len(rows))
    turns = lists(turn_fn(engine, ids)(rows, seeds, [40] * len(rows)))
    called = [t for t in turns if TOOL_CALL_CLOSE in tok.decode(t, skip_special_tokens=True)]
    others = [t for t in turns if t not in called]
    assert called and others  # both sides of the coin came up
    for t in called:  # "</tool_call>b": stopped after ">b", not on to "xy"
        assert [tok.decode([i]) for i in t] == CALL_TOKENS
    for t in others:  # "</tool>bxy", "</tool_call_call>bxy", ...: they run to their end token
        assert tok.decode(t).endswith(">bxy<|im_end|>")
    # vLLM itself stops there (the engine's own cut changes nothing), and at the limit first
    monkeypatch.setattr("r1fit.rollout.vllm_engine.cut_after_stop", lambda tokens, *_: tokens)
    assert lists(turn_fn(engine, ids)(rows, seeds, [40] * len(rows))) == turns
    assert [len(t) for t in lists(turn_fn(engine, ids)(rows[:2], seeds[:2], [3, 5]))] == [3, 5]


def runner() -> ToolRunner:
    return ToolRunner(("crop", "zoom"), timeout=5.0, min_pixels=28 * 28, max_pixels=56 * 56)


def check_trajectory(t, budgets: TurnBudgets, tok, eos) -> None:
    """``t``'s tokens, mask and turns agree with each other and with the budgets."""
    assert t.ended in END_REASONS and t.length <= budgets.tokens
    assert t.policy_mask.shape == t.token_ids.shape
    assert int(t.policy_mask.sum()) == sum(turn.tokens for turn in t.turns)
    start = 0
    for turn in t.turns:
        tokens = t.token_ids[start:start + turn.tokens]
        assert t.policy_mask[start:start + turn.tokens].eq(1).all()
        assert tok.decode(tokens.tolist(), skip_special_tokens=True) == turn.text
        assert turn.tokens <= budgets.max_new_tokens
        if turn.ended == "tool_call":
            assert [tok.decode([i]) for i in tokens.tolist()] == CALL_TOKENS
        start += turn.tokens
        assert t.policy_mask[start:start + turn.context_tokens].eq(0).all()
        start += turn.context_tokens
    assert start == t.length
    last = t.turns[-1]
    assert (t.ended == "eos") == (int(t.token_ids[-1]) in eos)
    assert t.ended != "max_turns" or (t.num_turns == budgets.max_turns and last.ended == "tool_call")


@pytest.mark.vllm
def test_run_trajectories_runs_on_the_engine(setup, chain):
    engine, _, processor, ids, prompts = setup
    engine.load_weights(full_named_weights(chain))
    budgets = TurnBudgets(max_turns=3, max_tool_calls=3, max_new_tokens=14, max_images=2,
                          max_trajectory_tokens=400)  # a text error turn is ~100 tokens
    rows = [p for p in prompts for _ in range(3)]
    seeds = row_seeds(2, 5, 0, len(rows))

    def trajectories(part):
        return run_trajectories(turn_fn(engine, ids), processor, [rows[i] for i in part],
                                [seeds[i] for i in part], runner(), budgets, eos=ids.eos)

    together = trajectories(range(len(rows)))
    for t in together:
        check_trajectory(t, budgets, processor.tokenizer, ids.eos)
    # the chain's "</tool_call>" has no "<tool_call>": a malformed call, told as a text result,
    # after which the engine writes the next turn from the grown context
    assert max(t.num_turns for t in together) >= 2
    assert {t.ended for t in together} == {"eos", "max_new_tokens", "max_turns"}
    assert all(r.error for t in together for turn in t.turns for r in turn.results)
    for i in (4, 7):  # alone, a trajectory is what it was in the batch
        (alone,) = trajectories([i])
        assert torch.equal(alone.token_ids, together[i].token_ids)
        assert torch.equal(alone.policy_mask, together[i].policy_mask)
    # the engine's log-probs ride along (what TIS and engine_logp_diff read): 0 on the tool
    # turns' tokens; on the policy's, the chain's, log 1/2 after "l", else log 1 (a successor
    # ~57 logits above every other token)
    tok = processor.tokenizer
    for row, t in zip(rows, together):
        context = [*row.input_ids.tolist(), *t.token_ids.tolist()]
        assert t.engine_logp.shape == t.token_ids.shape
        policy = t.policy_mask.bool()
        assert not t.engine_logp[~policy].any()
        chain_logp = [-math.log(len(CHAIN[tok.decode([context[row.length + j - 1]])]))
                      for j in policy.nonzero().flatten().tolist()]
        assert torch.allclose(t.engine_logp[policy], torch.tensor(chain_logp), atol=1e-3)


def tool_image_context(processor, ids, prompt, crops: int):
    """The context the next turn of a trajectory of ``prompt`` that cropped ``crops`` times is
    generated from, as ``Trajectory.context()`` gives it (its sample holds the row's image and
    the crops)."""
    tok = processor.tokenizer
    seen = []

    def scripted(rows, seeds, limits, previous=None):
        (row,) = rows
        turn = tok.decode(row.input_ids.tolist()).count("<tool_response>")
        if turn < crops:
            return [torch.tensor(tok(CROP, add_special_tokens=False)["input_ids"])]
        seen.append(row)
        return [torch.tensor(ids.eos[:1])]

    budgets = TurnBudgets(max_turns=4, max_tool_calls=3, max_new_tokens=200, max_images=4)
    (trajectory,) = run_trajectories(scripted, processor, [prompt], None, runner(), budgets,
                                     eos=ids.eos)
    assert len(trajectory.images) == crops
    return seen[0]


@pytest.mark.vllm
def test_a_context_with_a_tool_image_generates_as_hf_does(setup, noisy):
    from r1fit.rollout.vllm_engine import RolloutEngineError

    engine, _, processor, ids, prompts = setup
    engine.load_weights(full_named_weights(noisy))
    # the grown context's sample carries the tool image after the row's own (Trajectory.context)
    grown = tool_image_context(processor, ids, prompts[0], crops=1)
    assert grown.image_inputs["image_grid_thw"].shape[0] == len(grown.sample.images) == 2
    ((vllm_turn, _),) = turn_fn(engine, ids)([grown], None, [12])
    hf = hf_generate_turn(noisy, processor.tokenizer, SamplingSettings(12, greedy=True), ids, CPU)
    (hf_turn,) = hf([grown], None, [12])
    assert vllm_turn.tolist() == hf_turn.tolist()
    # the engine sees the tool image: another crop, another turn
    black = Image.new("RGB", grown.sample.images[1].size)
    ((other, _),) = turn_fn(engine, ids)([dataclasses.replace(grown, sample=dataclasses.replace(
        grown.sample, images=[grown.sample.images[0], black]))], None, [12])
    assert other.tolist() != vllm_turn.tolist()
    # refused before vLLM: images not carried, more images or tokens than the engine holds
    without = dataclasses.replace(grown, sample=dataclasses.replace(
        grown.sample, images=grown.sample.images[:1]))
    with pytest.raises(RolloutEngineError, match="sample.images 1"):
        turn_fn(engine, ids)([without], None, [12])
    two_crops = tool_image_context(processor, ids, prompts[0], crops=2)
    with pytest.raises(RolloutEngineError, match="max_images=2"):
        turn_fn(engine, ids)([two_crops], None, [12])
    with pytest.raises(RolloutEngineError, match="max_model_len=512"):
        turn_fn(engine, ids)([grown], None, [512 - grown.length + 1])


@pytest.mark.vllm
def test_a_turn_holds_min_new_tokens_as_the_hf_turn(setup, noisy, monkeypatch):
    """rollout.min_new_tokens reaches each turn (no end token before it, at most the turn's
    limit), as the HF turn's minimum does; with every row's minimum at its limit, each turn
    runs to it."""
    from r1fit.rollout import vllm_engine

    engine, _, _, ids, prompts = setup
    engine.load_weights(full_named_weights(noisy))
    asked = []
    real = vllm_engine.sampling_params
    monkeypatch.setattr(vllm_engine, "sampling_params",
                        lambda *a, **k: (asked.append(k.get("min_tokens")), real(*a, **k))[1])
    turn = functools.partial(turn_fn(engine, ids), min_new_tokens=5)
    turns = lists(turn(prompts, row_seeds(0, 0, 0, 3), [1, 4, 9]))
    assert asked == [1, 4, 5]
    assert all(len(t) >= n for t, n in zip(turns, [1, 4, 5]))
