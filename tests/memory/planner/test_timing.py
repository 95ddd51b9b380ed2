"""The time model on hand-computed numbers: a made-up model (decoder matrices of 1,000 entries
over 2 layers, a head of 200, attention width 10) on made-up rates (4 GFLOP/s at its width,
10 GB/s, 2 us a launch, 0.28 ms of fixed cost per layer step, no calibrated element-wise
work: 240 bytes per token and unit of width at 10 GB/s; 1 us per optimizer tensor); then on
builtin:tiny's facts."""

from __future__ import annotations

from dataclasses import replace

import pytest

from r1fit.config import load_config
from r1fit.memory.flops import GroupShape, ModelShape
from r1fit.memory.planner import plan_memory
from r1fit.memory.planner.estimate import fsdp_buffers, fsdp_traffic, process_threads
from r1fit.memory.planner.facts import model_facts, prompt_shape
from r1fit.memory.planner.printing import time_blocks
from r1fit.memory.planner.timing import (
    TimeShape,
    Traffic,
    collective_seconds,
    evaluation_count,
    generation_seconds,
    micro_groups,
    pass_collectives,
    prompts_in_chunk,
    run_shape,
    time_plan,
    whole_gather_seconds,
)
from r1fit.memory.rates import DeviceRates

SHAPE = ModelShape(text_matrix=1000, text_frozen=0, lora_matrix=0, head=200, head_trains=True,
                   attention_width=10, vision_matrix=0, vision_merger=0, merge=1,
                   vision_trains=False, vision_attention_width=0)
RATES = DeviceRates(device="test", key="test",
                    matmul={"float32": [(128, 1e9), (512, 4e9), (2048, 8e9)]},
                    copy_bytes_per_s=1e10, launch_s=2e-6, layer_step_s=[(1, 3e-4), (16, 6e-4)],
                    disk_bytes_per_s=1e8, source="test", sample_s_per_logit=1e-9,
                    head_s_per_logit=2e-9, optimizer_s_per_tensor=1e-6)
STEP = TimeShape(shape=SHAPE, layers=2, vision_blocks=0, hidden=600, kv_bytes_per_token=40,
                 vocab=100,
                 weight_bytes=4800, bytes_per_element=4, dtype="float32",
                 lora_linears_per_layer=0, prompt=10, patches=0, completion=5, group=4, rows=8,
                 generation_batch=8, micro_batch=4, shares_prompts=True, graphs=False,
                 unmerged_lora=False, engine="static", reference_pass=False, iterations=1,
                 checkpointed_fraction=0.0, trainable=1200, checkpoint_every=0,
                 trainable_tensors=10)
FIXED = 2.8e-4  # RATES' fixed seconds per layer step: 3e-4 - 1 x (6e-4 - 3e-4) / 15
SAMPLE = 8 * 100 * 1e-9  # the sampler over 8 rows' 100 logits, per decode step
HEAD = 8 * 5 * 100 * 2e-9  # the head's log-softmax over 8 rows x 5 completion tokens' logits
EW = 240 * 600 / 1e10  # a layer's element-wise seconds per token in a forward (x 3 in training)


def test_prompts_a_chunk_prefills():
    assert prompts_in_chunk(STEP, 0, 8) == 2  # two whole groups of 4
    assert prompts_in_chunk(STEP, 0, 6) == 2  # rows 0-5: groups 0 and 1
    assert prompts_in_chunk(STEP, 3, 6) == 3  # rows 3-8: groups 0, 1 and 2
    assert prompts_in_chunk(STEP, 5, 1) == 1
    assert prompts_in_chunk(replace(STEP, shares_prompts=False), 3, 6) == 6


def test_prefill_counts_the_prompts_each_chunk_touches():
    """128 rows in groups of 8, generated 12 at a time: the chunks from rows 0, 12, ..., 108
    touch two groups each, the last (rows 120-127) one: 21 prompts, where the memory plan's bound
    (facts.prompts_in_rows: one more whenever 12 is not a multiple of 8) counts 3 x 10 + 1 = 31."""
    big = replace(STEP, group=8)
    assert sum(prompts_in_chunk(big, start, min(12, 128 - start))
               for start in range(0, 128, 12)) == 21
    # STEP's 8 rows 6 at a time: rows 0-5 prefill 2 prompts, rows 6-7 one (not 3 and 2)
    prefill, _ = generation_seconds(replace(STEP, generation_batch=6), RATES, 8, 5)
    assert prefill == pytest.approx(45_200 / 4e9 + 2 * FIXED + 2 * 20 * EW
                                    + 22_600 / 4e9 + 2 * FIXED + 2 * 10 * EW)


def test_generation_by_hand():
    prefill, decode = generation_seconds(STEP, RATES, rows=8, completion=5)
    # prefill: 2 prompts x (2 x 1000 x 10 + 2 x 200 x 1 + 4 x 10 x 55) = 45,200 FLOPs at 4e9
    # (above the 4,800 weight bytes at 1e10), plus 2 layers' fixed cost and their element-wise
    # work over the 2 x 10 prompt tokens
    assert prefill == pytest.approx(45_200 / 4e9 + 2 * FIXED + 2 * 20 * EW)
    # 4 decode steps of 8 rows at a mean context of 12.5: 2 x 8 x 1200 + 4 x 10 x 8 x 12.5
    # = 23,200 FLOPs (5.8 us), above 4,800 + 8 x 12.5 x 40 = 8,800 bytes (0.88 us)
    assert decode == pytest.approx(4 * (23_200 / 4e9 + 2 * FIXED + SAMPLE))
    # replayed as CUDA graphs: a launch per layer instead of the fixed cost
    _, graphs = generation_seconds(replace(STEP, graphs=True), RATES, rows=8, completion=5)
    assert graphs == pytest.approx(4 * (23_200 / 4e9 + 2 * 2e-6 + SAMPLE))
    # peft's unmerged adapters: 7 adapted matrices x 4 kernels more per layer
    _, unmerged = generation_seconds(replace(STEP, unmerged_lora=True,
                                             lora_linears_per_layer=7), RATES, 8, 5)
    assert unmerged == pytest.approx(4 * (23_200 / 4e9 + 2 * (FIXED + 28 * 2e-6) + SAMPLE))
    # ... or, calibrated, peft's measured cost per adapted Linear: 2 layers x 7 x 10 us
    _, measured = generation_seconds(replace(STEP, unmerged_lora=True,
                                             lora_linears_per_layer=7),
                                     replace(RATES, lora_s_per_linear=1e-5), 8, 5)
    assert measured == pytest.approx(4 * (23_200 / 4e9 + 2 * FIXED + 14 * 1e-5 + SAMPLE))
    # HF generate: its own loop's seconds per step on top
    _, hf = generation_seconds(replace(STEP, engine="hf"), replace(RATES, generate_step_s=1e-3),
                               8, 5)
    assert hf == pytest.approx(4 * (23_200 / 4e9 + 2 * FIXED + SAMPLE + 1e-3))
    # memory-bound: a slow copy makes the bytes the longer side
    _, slow = generation_seconds(STEP, replace(RATES, copy_bytes_per_s=1e8), 8, 5)
    assert slow == pytest.approx(4 * (8_800 / 1e8 + 2 * FIXED + SAMPLE))
    # two chunks of 4 rows: each its own prefill (one prompt each) and decode
    prefill2, _ = generation_seconds(replace(STEP, generation_batch=4), RATES, 8, 5)
    assert prefill2 == pytest.approx(2 * (22_600 / 4e9 + 2 * FIXED + 2 * 10 * EW))


# STEP as two turns of 5 policy tokens with a 3-token tool turn between them (13 in all)
TURNS = replace(STEP, completion=13, turns=2.0, turn_tokens=5.0, tool_tokens=3.0)
FIRST_PREFILL = 45_200 / 4e9 + 2 * FIXED + 2 * 20 * EW  # as in test_generation_by_hand
FIRST_DECODE = 4 * (23_200 / 4e9 + 2 * FIXED + SAMPLE)
# turn 2 after 18 tokens (10 + 5 + 3): 4 steps of 8 rows at a mean context of 20.5,
# 2 x 8 x 1200 + 4 x 10 x 8 x 20.5 = 25,760 FLOPs
SECOND_DECODE = 4 * (25_760 / 4e9 + 2 * FIXED + SAMPLE)


def test_turns_by_hand():
    # the whole context again (HF generate): 8 rows x (2 x 1000 x 18 + 2 x 200 + 4 x 10 x 171)
    # = 8 x 43,240 FLOPs, 2 layers' fixed cost, element-wise work over 8 x 18 tokens
    refill = FIRST_PREFILL + 345_920 / 4e9 + 2 * FIXED + 2 * 144 * EW
    prefill, decode = generation_seconds(replace(TURNS, refill=True), RATES, 8, 13)
    assert prefill == pytest.approx(refill)
    assert decode == pytest.approx(FIRST_DECODE + SECOND_DECODE)
    # the kept cache: the tool turn and the policy's last token, 4 tokens after 14 cached,
    # 8 x (2 x 1000 x 4 + 2 x 200 + 4 x 10 x (4 x 14 + 10)) = 8 x 11,040 FLOPs
    kept, _ = generation_seconds(TURNS, RATES, 8, 13)
    assert kept == pytest.approx(FIRST_PREFILL + 88_320 / 4e9 + 2 * FIXED + 2 * 32 * EW)
    # 1.5 turns on average: half the rows take the second turn, which runs when one of the 8
    # does (1 - 0.5 ** 8 of the time), then for 4 / that of them (2 x 1200 + 4 x 10 x 20.5 =
    # 3,220 FLOPs a row and step, the sampler over 100 logits a row)
    reach = 1 - 0.5 ** 8
    rows = 4 / reach
    half_prefill, half = generation_seconds(replace(TURNS, turns=1.5, refill=True), RATES, 8, 13)
    assert half_prefill == pytest.approx(FIRST_PREFILL + reach * (
        rows * 43_240 / 4e9 + 2 * FIXED + 2 * rows * 18 * EW))
    assert half == pytest.approx(FIRST_DECODE + reach * 4 * (
        rows * 3_220 / 4e9 + 2 * FIXED + rows * 100 * 1e-9))
    # a turn few rows reach costs about one row's turn each time it runs: its fixed costs are
    # not paid in full for a thousandth of the rows
    _, rare = generation_seconds(replace(TURNS, turns=1.001), RATES, 8, 13)
    assert rare - FIRST_DECODE < 0.01 * (SECOND_DECODE)
    # an evaluation's own completion length is generated as one turn
    assert generation_seconds(TURNS, RATES, 8, 5) == generation_seconds(STEP, RATES, 8, 5)


def test_a_tool_turns_images_go_through_the_tower_again_when_refilled():
    vision = replace(SHAPE, vision_matrix=50, vision_merger=10, merge=4, vision_attention_width=2)
    step = replace(TURNS, shape=vision, patches=16, tool_images=1.0, tool_patches=8)
    # one image of 8 patches: 2 x 50 x 8 + 2 x 10 x 2 + 4 x 2 x 64 = 1,352 FLOPs; the prompt's
    # 16: 2 x 50 x 16 + 2 x 10 x 4 + 4 x 2 x 256 = 3,728
    kept, _ = generation_seconds(step, RATES, 8, 13)
    no_image, _ = generation_seconds(replace(step, tool_images=0.0), RATES, 8, 13)
    assert kept - no_image == pytest.approx(8 * 1_352 / 4e9)
    refill, _ = generation_seconds(replace(step, refill=True), RATES, 8, 13)
    refill_text, _ = generation_seconds(replace(step, refill=True, tool_images=0.0), RATES, 8, 13)
    assert refill - refill_text == pytest.approx(8 * 1_352 / 4e9)
    # ... and the update's sequences hold both images
    assert micro_groups(step)[0].patches == (16, 8)
    assert micro_groups(replace(step, turns=1.4))[0].patches == (16,)  # 0.4 of an image: none


def test_the_turns_of_a_plan_with_tools(use_tiny_cache):
    """configs/zoom-tools.yaml's shape on builtin:tiny: a tool turn is what the processor
    encodes for the zoom's 112 px image (59 tokens, 64 patches), and the budget's turns are as
    many whole turns of 96 tokens, tool turns between, as its 3 x 96 tokens hold."""
    from PIL import Image

    from r1fit.memory.planner.facts import tool_turn_shape
    from r1fit.tools import ToolResult
    from r1fit.tools.conversation import tool_turn_tokens

    cfg = load_config(None, ["tools=[zoom]", "data.max_images=2", "rollout.max_turns=3",
                             "algo.max_new_tokens=96", "data.max_pixels=12544",
                             "data.shapes.image_size=112"])
    facts = model_facts(cfg.model.path, cfg.model.lora.target)
    prompt = prompt_shape(cfg, facts)
    assert prompt.images == 1
    ids, _, inputs, _ = tool_turn_tokens(facts.processor,
                                         [ToolResult("zoom", (Image.new("RGB", (112, 112)),))])
    one = tool_turn_shape(cfg, facts, prompt, turns=2.0)  # one tool turn: the zoom's image
    assert one.images == 1.0 and one.tokens == ids.shape[0] == 59
    assert one.image_patches == int(inputs["image_grid_thw"].prod()) == 64
    planned = tool_turn_shape(cfg, facts, prompt)
    assert planned.turns == pytest.approx((288 + planned.tokens) / (96 + planned.tokens))
    assert 2 < planned.turns < 3 and planned.images == pytest.approx(1 / (planned.turns - 1))
    # a budget of one turn holds one turn; no tools, no turns
    assert tool_turn_shape(cfg.with_values({"rollout.max_trajectory_tokens": 96}), facts,
                           prompt).turns == 1.0
    assert tool_turn_shape(cfg.with_values({"tools": []}), facts, prompt).turns == 1.0
    # the plan: HF generate prefills each later turn's whole context; --turns times fewer
    plan = plan_memory(cfg, device_type="cpu")
    details = plan.time["details"]
    assert details["turns"] == pytest.approx(planned.turns) and details["refill"] == 1.0
    assert details["turn_tokens"] == pytest.approx(96, abs=1)
    fewer = plan_memory(cfg, device_type="cpu", turns=1.5)
    assert fewer.time["phases"]["generate"] < plan.time["phases"]["generate"]
    assert fewer.peak_bytes == plan.peak_bytes  # the memory plan keeps the budget
    # a run that never calls its tool: one turn of algo.max_new_tokens, not of the budget
    one = plan_memory(cfg, device_type="cpu", turns=1.0)
    assert (one.time["details"]["turns"], one.time["details"]["turn_tokens"]) == (1.0, 96)
    assert one.time["phases"]["generate"] < fewer.time["phases"]["generate"]
    # r1fit sft's evaluations run the tools too: timed as the GRPO run's are
    graded = cfg.with_values({"data.eval": "builtin:shapes", "eval.batch": 8})
    sft = plan_memory(graded, device_type="cpu", kind="sft")
    assert sft.time["eval_seconds"] == pytest.approx(
        plan_memory(graded, device_type="cpu").time["eval_seconds"])
    # the static engine appends each tool turn, its image too, to the kept cache: less prefill
    static = plan_memory(cfg.with_values({"rollout.engine": "static"}), device_type="cpu")
    assert static.time["details"]["refill"] == 0.0
    assert static.time["details"]["prefill_seconds"] < details["prefill_seconds"]
    assert facts.places_images


@pytest.mark.parametrize("values, turns, message", [
    ([], 5.0, "--turns: got 5, expected a number from 1 to rollout.max_turns (3)"),
    ([], 0.5, "--turns: got 0.5, expected a number from 1 to rollout.max_turns (3)"),
    (["tools=[]"], 2.0, "--turns: the config has no tools (one turn per row)"),
])
def test_turns_out_of_range_are_refused(use_tiny_cache, values, turns, message):
    from r1fit.config import ConfigError

    cfg = load_config(None, ["tools=[zoom]", "data.max_images=2", "rollout.max_turns=3",
                             *values])
    with pytest.raises(ConfigError) as info:
        plan_memory(cfg, device_type="cpu", turns=turns)
    assert str(info.value) == message


def test_a_step_by_hand():
    cfg = load_config(None, ["train.max_steps=10", "eval.every=4", "data.eval=builtin:shapes"])
    t = time_plan(STEP, RATES, cfg, eval_rows=16)
    prefill, decode = generation_seconds(STEP, RATES, 8, 5)
    assert t.phases["generate"] == pytest.approx(prefill + decode)
    assert t.phases["score"] == pytest.approx(8 * 1e-4)
    assert t.phases["logprobs"] == 0 and t.phases["checkpoint"] == 0
    # update: each row's forward (22,200 + 14,600) and backward (60,000 + 4,000 + 2 x 4,800)
    # = 110,400 FLOPs, x 8 rows at 4e9; 2 micro-batches x 3 forwards' fixed cost; 2 layers'
    # element-wise work over 8 x 15 tokens, forward and backward; AdamW over 1,200 float32
    # elements: 28 bytes each at 1e10, and 10 tensors' fixed cost; the head's log-softmax
    update = (8 * 110_400 / 4e9 + 2 * 3 * 2 * FIXED + 2 * 120 * 3 * EW + HEAD
              + 1200 * 28 / 1e10 + 10 * 1e-6)
    assert t.phases["update"] == pytest.approx(update)
    assert t.step_seconds == pytest.approx(prefill + decode + 8e-4 + update)
    assert t.tokens_per_second == pytest.approx(8 * 5 / t.step_seconds)
    assert t.dominant == "update"
    # evaluations: before training, at steps 4 and 8, and at the last step (10)
    assert t.evaluations == 4
    assert t.run_seconds == pytest.approx(10 * t.step_seconds + 4 * t.eval_seconds)
    assert time_plan(STEP, RATES, load_config(None, ["train.max_steps=10", "eval.every=5"]),
                     eval_rows=16).evaluations == 3
    # the reference's pass, checkpoints every 2 steps: 1,200 x (4 + 8) bytes at 1e8 over 2 steps
    more = time_plan(replace(STEP, reference_pass=True, checkpoint_every=2), RATES, cfg)
    assert more.phases["logprobs"] == pytest.approx(8 * 36_800 / 4e9 + 2 * 2 * FIXED + HEAD / 2
                                                    + 2 * 120 * EW)
    assert more.phases["checkpoint"] == pytest.approx(1200 * 12 / 1e8 / 2)
    # LoRA's adapters in training: each micro-batch's forward and backward (counted as two) pay
    # them, 2 layers x 7 adapted Linears x 10 us; the reference (adapters off) does not
    lora = time_plan(replace(STEP, lora_linears_per_layer=7, reference_pass=True),
                     replace(RATES, lora_s_per_linear=1e-5), cfg)
    assert lora.phases["update"] == pytest.approx(update + 2 * 3 * 14 * 1e-5)
    assert lora.phases["logprobs"] == pytest.approx(more.phases["logprobs"])
    # an SFT step: the update alone
    sft = time_plan(STEP, RATES, cfg, training_only=True)
    assert sft.phases["generate"] == sft.phases["score"] == 0
    assert sft.phases["update"] == pytest.approx(update)


@pytest.mark.parametrize("steps,every,before,count", [
    (10, 4, True, 4),   # before, 4, 8, and the last step (10)
    (10, 5, True, 3),   # before, 5, 10 (the last step is one of them)
    (10, 0, False, 1),  # the last step only
    (0, 4, True, 1),    # no steps: the evaluation before them only
    (0, 0, False, 0),
])
def test_evaluations_as_the_loops_hold_them(steps, every, before, count):
    assert evaluation_count(steps, every, before) == count


def test_an_sft_run_is_its_own_steps_and_evaluations():
    """``r1fit sft``'s run: sft.steps steps and sft.eval_every's evaluations, not the GRPO
    run's train.max_steps and eval.every."""
    cfg = load_config(None, ["train.max_steps=1000", "eval.every=4", "sft.steps=30",
                             "sft.eval_every=10", "data.eval=builtin:shapes"])
    sft = time_plan(STEP, RATES, cfg, eval_rows=16, training_only=True)
    assert (sft.steps, sft.evaluations) == (30, 4)  # before, 10, 20, 30
    assert sft.run_seconds == pytest.approx(30 * sft.step_seconds + 4 * sft.eval_seconds)
    grpo = time_plan(STEP, RATES, cfg.with_values({"sft.format_warmup_steps": 60}),
                     eval_rows=16)
    assert (grpo.steps, grpo.evaluations) == (1000, 251)  # before, every 4th of 1000
    # r1fit train's format warm-up: SFT steps of another shape, said not to be counted
    assert grpo.warmup_steps == 60 and sft.warmup_steps == 0
    assert grpo.run_seconds == pytest.approx(1000 * grpo.step_seconds + 251 * grpo.eval_seconds)
    assert any("the 60-step format warm-up before them not counted" in str(line)
               for line in time_blocks(grpo.to_dict(), cfg))
    # r1fit plan prints the run's own steps
    assert any("run (30 steps + 4 evaluations of" in str(line)
               for line in time_blocks(sft.to_dict(), cfg))


def test_the_run_shape_of_a_plan(use_tiny_cache):
    cfg = load_config(None, ["model.lora.r=8", "algo.num_generations=4",
                             "train.prompts_per_step=2"])
    facts = model_facts(cfg.model.path, cfg.model.lora.target)
    prompt = prompt_shape(cfg, facts)
    cuda = run_shape(facts, cfg, prompt, rows=8, generation_batch=8, micro_batch=4,
                     completion=16, engine="static", device_type="cuda", dtype="bfloat16")
    assert cuda.graphs and cuda.shares_prompts and not cuda.unmerged_lora
    assert cuda.shape.lora_matrix == 8 * facts.lora_in_plus_out
    assert cuda.shape.text_frozen == cuda.shape.text_matrix and not cuda.shape.head_trains
    assert cuda.trainable == 8 * facts.lora_in_plus_out and cuda.bytes_per_element == 2
    cpu = run_shape(facts, cfg, prompt, rows=8, generation_batch=8, micro_batch=4,
                    completion=16, engine="hf", device_type="cpu", dtype="float32")
    assert not cpu.graphs and cpu.unmerged_lora and cpu.lora_linears_per_layer == 7
    # the plan carries the prediction, on the rates this machine has for the device planned
    plan = plan_memory(cfg, device_type="cpu")
    assert set(plan.time["phases"]) == {"generate", "score", "logprobs", "update",
                                        "checkpoint"}
    assert plan.time["step_seconds"] == pytest.approx(sum(plan.time["phases"].values()))


# --- peft's float32 adapters on a 16-bit model (model.lora.compute_dtype=float32)

LORA_RATES = replace(RATES, matmul={"float32": [(512, 4e9)], "bfloat16": [(512, 8e9)]})


@pytest.mark.parametrize("recomputed,shared,seconds", [
    # 120 tokens (8 rows x 15); a forward and a backward: products 2 x 100 x 120 x 3 = 72,000
    # FLOPs at 4e9 instead of 8e9; bytes per token 8 x 300 + 16 x 400 + 10 x 300 + 20 x 400 =
    # 19,800 at 1e10
    (0.0, False, 72_000 * (1 / 4e9 - 1 / 8e9) + 120 * 19_800 / 1e10),
    # every layer recomputed: a second forward, 96,000 FLOPs and 28,600 bytes per token
    (1.0, False, 96_000 * (1 / 4e9 - 1 / 8e9) + 120 * 28_600 / 1e10),
    # memory.share_prefix: 2 sequences of 10 + 4 x 5 tokens, 60 in all: 36,000 FLOPs
    (0.0, True, 36_000 * (1 / 4e9 - 1 / 8e9) + 60 * 19_800 / 1e10),
])
def test_the_float32_adapters_cost_by_hand(recomputed, shared, seconds):
    step = replace(STEP, shape=replace(SHAPE, lora_matrix=100), dtype="bfloat16",
                   bytes_per_element=2, lora_in=300, lora_out=400,
                   checkpointed_fraction=recomputed, share_prefix=shared)
    cfg = load_config(None, [])
    cast = time_plan(replace(step, adapter_cast=True), LORA_RATES, cfg)
    plain = time_plan(step, LORA_RATES, cfg)
    assert cast.phases["update"] - plain.phases["update"] == pytest.approx(seconds)
    assert cast.phases["generate"] == plain.phases["generate"]  # the engine merges LoRA


def count_bytes(fn) -> int:
    """Bytes every aten op that ``fn`` runs reads and writes (its tensor inputs and outputs;
    views and detaches move nothing)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    free = {"view", "t", "detach", "expand", "alias", "_unsafe_view"}

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in free:
                Count.total += sum(t.numel() * t.element_size()
                                   for t in tree_flatten((args, kwargs, out))[0]
                                   if isinstance(t, torch.Tensor))
            return out

    with Count():
        fn()
    return Count.total


def adapter_bytes(autocast: bool, d_in: int, d_out: int, r: int, tokens: int) -> tuple[int, int]:
    """(forward, backward) bytes one peft LoRA Linear on a bfloat16 base adds to it over
    ``tokens`` tokens: peft's float32 path, or the adapters under r1fit's autocast."""
    import torch
    from peft import LoraConfig, get_peft_model

    from r1fit.models.logprobs import adapters_in

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(d_in, d_out, bias=False)

        def forward(self, x):
            return self.lin(x)

    model = get_peft_model(One().to(torch.bfloat16), LoraConfig(r=r, target_modules=["lin"]))
    x = torch.randn(tokens, d_in, dtype=torch.bfloat16, requires_grad=True)
    sums = []
    for adapters in (True, False):
        with (model.disable_adapter() if not adapters else adapters_in(
                model, torch.bfloat16 if autocast else None, forward=False)):
            with adapters_in(model, torch.bfloat16 if autocast and adapters else None):
                y = []
                forward = count_bytes(lambda: y.append(model(x)))
            backward = count_bytes(lambda: y[0].backward(torch.ones_like(y[0])))
        sums.append((forward, backward))
    return sums[0][0] - sums[1][0], sums[0][1] - sums[1][1]


def test_the_cast_bytes_are_peft_s_ops_counted():
    """CAST_FORWARD_BYTES and CAST_BACKWARD_BYTES: what peft's float32 path moves per token beyond
    the autocast path, per input and output element, read off every op both run (a token's
    share: the difference between 64 and 128 tokens, over three shapes for in, out and r)."""
    import numpy as np

    from r1fit.memory.planner.timing import CAST_BACKWARD_BYTES, CAST_FORWARD_BYTES

    shapes = [(64, 128, 4), (128, 64, 4), (64, 64, 8)]
    per_token = []
    for d_in, d_out, r in shapes:
        extra = []
        for tokens in (64, 128):
            cast = adapter_bytes(False, d_in, d_out, r, tokens)
            autocast = adapter_bytes(True, d_in, d_out, r, tokens)
            extra.append(np.subtract(cast, autocast))
        per_token.append((extra[1] - extra[0]) / 64)
    coefficients = np.linalg.solve(np.array(shapes, dtype=float), np.array(per_token))
    # rows: per input element, per output element, per rank element; columns: forward, backward
    assert coefficients[:2, 0] == pytest.approx(CAST_FORWARD_BYTES)
    assert coefficients[:2, 1] == pytest.approx(CAST_BACKWARD_BYTES)


def test_the_run_shape_says_when_peft_casts(use_tiny_cache):
    """A bfloat16 LoRA run with compute_dtype float32 has the cast path and its widths (every
    adapted Linear's in and out); compute_dtype=model, a float32 model, full fine-tuning and
    float32 weights that FSDP computes in bfloat16 have not."""
    def shape(*values, dtype="bfloat16"):
        cfg = load_config(None, ["algo.num_generations=4", "train.prompts_per_step=2", *values])
        facts = model_facts(cfg.model.path, cfg.model.lora.target)
        return run_shape(facts, cfg, prompt_shape(cfg, facts), rows=8, generation_batch=8,
                         micro_batch=4, completion=16, engine="static", device_type="cuda",
                         dtype=dtype), facts

    cast, facts = shape("model.lora.r=8", "model.dtype=bfloat16")
    assert cast.adapter_cast
    assert cast.lora_in + cast.lora_out == facts.lora_in_plus_out
    assert not shape("model.lora.r=8", "model.dtype=bfloat16",
                     "model.lora.compute_dtype=model")[0].adapter_cast
    assert not shape("model.lora.r=8", dtype="float32")[0].adapter_cast
    assert not shape("model.lora.r=8")[0].adapter_cast  # float32 weights gathered in bf16
    assert not shape("model.dtype=bfloat16")[0].adapter_cast


# --- the audit's defects, each on hand-computed numbers


def test_share_prefix_runs_each_group_s_prompt_once_per_micro_batch(use_tiny_cache):
    """memory.share_prefix: micro-batches of 4 rows hold one group of 4 each, so a pass runs 2
    sequences of 10 + 4 x 5 tokens (60 tokens), not 8 of 15 (120)."""
    shared = replace(STEP, share_prefix=True, reference_pass=True)
    assert micro_groups(shared) == [GroupShape(10, (5, 5, 5, 5))] * 2
    # micro-batches of 3 straddle the groups: rows 0-2 of group 0; row 3 of it and 4-5 of
    # group 1; rows 6-7 of group 1
    assert [len(g.completions) for g in micro_groups(replace(shared, micro_batch=3))] == [3, 1, 2, 2]
    t = time_plan(shared, RATES, load_config(None, []))
    # a group's forward: its prompt 2 x 1000 x 10 + 4 x 10 x 55 = 22,200, each completion
    # 2 x 1000 x 5 + 2 x 200 x 5 + 4 x 10 x (5 x 10 + 15) = 14,600: 22,200 + 4 x 14,600 = 80,600
    assert t.phases["logprobs"] == pytest.approx(2 * 80_600 / 4e9 + 2 * 2 * FIXED + HEAD / 2
                                                 + 2 * 60 * EW)
    # its backward over 30 tokens, 20 of them through the head, attention 2,200 + 4 x 2,600:
    # 2 x 1000 x 30 x 2 + 2 x 200 x 20 x 2 + 2 x 12,600 = 161,200; with the forward 241,800
    assert t.phases["update"] == pytest.approx(2 * 241_800 / 4e9 + 2 * 3 * 2 * FIXED
                                               + 2 * 60 * 3 * EW + HEAD + 1200 * 28 / 1e10
                                               + 10 * 1e-6)
    # the run's shape reads memory.share_prefix as set; 'auto' as off unless the planned value
    # is passed in
    cfg = load_config(None, ["algo.num_generations=4", "train.prompts_per_step=2"])
    facts = model_facts(cfg.model.path, cfg.model.lora.target)

    def shape(c):
        return run_shape(facts, c, prompt_shape(c, facts), rows=8, generation_batch=8,
                         micro_batch=4, completion=16, engine="hf", device_type="cpu",
                         dtype="float32")

    assert not shape(cfg).share_prefix  # auto
    assert shape(cfg.with_values({"memory.share_prefix": True})).share_prefix
    assert not shape(cfg.with_values({"memory.share_prefix": False})).share_prefix


def test_vllm_generates_the_process_s_rows_in_one_call():
    """vLLM takes all of a process's rows at once (memory.generation_batch is not its chunk);
    its evaluations still come eval.batch rows at a time."""
    cfg = load_config(None, ["data.eval=builtin:shapes", "eval.batch=8"])
    t = time_plan(replace(STEP, engine="vllm", generation_batch=4), RATES, cfg, eval_rows=16)
    # one chunk of 8 rows: 2 prompts' prefill and 4 decode steps of 8 rows (as in
    # test_generation_by_hand), not two chunks of 4
    step = 23_200 / 4e9 + 2 * FIXED + SAMPLE
    assert t.phases["generate"] == pytest.approx(45_200 / 4e9 + 2 * FIXED + 2 * 20 * EW + 4 * step)
    assert t.details["decode_step_seconds"] == pytest.approx(step)
    # evaluation: 16 rows, 8 at a time, each its own prompt: 8 x 22,600 FLOPs of prefill
    assert t.eval_seconds == pytest.approx(2 * (8 * 22_600 / 4e9 + 2 * FIXED + 2 * 80 * EW
                                                + 4 * step))


def test_kl_in_reward_times_the_policy_s_pass():
    """algo.kl_in_reward: a forward of the policy over every row before the first update, beside
    the reference's; with LoRA it runs the adapters (their products, launches and float32 cast's
    forward part)."""
    cfg = load_config(None, [])
    reference = 8 * 36_800 / 4e9 + 2 * 2 * FIXED + HEAD / 2 + 2 * 120 * EW
    both = time_plan(replace(STEP, reference_pass=True, policy_pass=True), RATES, cfg)
    assert both.phases["logprobs"] == pytest.approx(2 * reference)
    step = replace(STEP, shape=replace(SHAPE, lora_matrix=100), dtype="bfloat16",
                   bytes_per_element=2, lora_in=300, lora_out=400, adapter_cast=True,
                   lora_linears_per_layer=7, reference_pass=True)
    rates = replace(LORA_RATES, lora_s_per_linear=1e-5)
    policy = (time_plan(replace(step, policy_pass=True), rates, cfg).phases["logprobs"]
              - time_plan(step, rates, cfg).phases["logprobs"])
    # a row's forward with the adapters: 22,200 + 14,600 + 2 x 100 x 15 = 39,800 at 8e9; each
    # micro-batch's layers and 14 adapters at 10 us; the cast's forward: 2 x 100 x 120 FLOPs
    # at 4e9 instead of 8e9, and 8 x 300 + 16 x 400 = 8,800 bytes per token
    assert policy == pytest.approx(8 * 39_800 / 8e9 + 2 * (2 * FIXED + 14 * 1e-5) + HEAD / 2
                                   + 2 * 120 * EW + 24_000 * (1 / 4e9 - 1 / 8e9)
                                   + 120 * 8_800 / 1e10)


def test_an_evaluation_generates_its_own_completion_length():
    """r1fit sft's evaluations generate algo.max_new_tokens (here 3), not the training answer's
    sft.max_answer_tokens (STEP's 5)."""
    cfg = load_config(None, ["data.eval=builtin:shapes", "eval.batch=8"])
    t = time_plan(STEP, RATES, cfg, eval_rows=16, training_only=True, eval_completion=3)
    # 2 decode steps of 8 rows at a mean context of 11.5: 2 x 8 x 1200 + 4 x 10 x 8 x 11.5 =
    # 22,880 FLOPs
    assert t.eval_seconds == pytest.approx(2 * (8 * 22_600 / 4e9 + 2 * FIXED + 2 * 80 * EW
                                                + 2 * (22_880 / 4e9 + 2 * FIXED + SAMPLE)))


def test_a_trained_vision_tower_recomputes_its_checkpointed_blocks(use_tiny_cache):
    """Full fine-tuning with the tower trained: its checkpointed blocks' forward runs again in
    backward. A tower of 500 entries per patch, attention width 2, 4 patches a prompt: 2 x 500 x
    4 + 4 x 2 x 16 = 4,128 FLOPs a forward; half its blocks recomputed, for 8 rows (2 groups
    with share_prefix)."""
    step = replace(STEP, shape=replace(SHAPE, vision_matrix=500, vision_attention_width=2,
                                       vision_trains=True), patches=4, vision_blocks=2)
    cfg = load_config(None, [])
    for s, rows in ((step, 8), (replace(step, share_prefix=True), 2)):
        recomputed = time_plan(replace(s, vision_checkpointed_fraction=0.5), RATES, cfg)
        assert recomputed.phases["update"] - time_plan(s, RATES, cfg).phases["update"] == \
            pytest.approx(0.5 * rows * 4_128 / 4e9)

    # builtin:tiny's tower has 2 blocks, both checkpointed (every 2nd layer: 1 of them); none
    # where the tower does not train or nothing is checkpointed
    def fraction(*values):
        c = load_config(None, ["algo.num_generations=4", "train.prompts_per_step=2", *values])
        facts = model_facts(c.model.path, c.model.lora.target)
        return run_shape(facts, c, prompt_shape(c, facts), rows=8, generation_batch=8,
                         micro_batch=4, completion=16, engine="hf", device_type="cpu",
                         dtype="float32").vision_checkpointed_fraction

    assert fraction() == 1.0
    assert fraction("memory.checkpoint_every=2") == 0.5
    assert fraction("model.lora.r=8") == 0.0
    assert fraction("model.freeze_vision=true") == 0.0
    assert fraction("memory.gradient_checkpointing=false") == 0.0


def test_the_lora_reference_runs_no_adapters():
    """With LoRA the reference is the policy under peft's disable_adapter: its base layers only,
    so no adapter products, launches or float32 cast."""
    step = replace(STEP, shape=replace(SHAPE, lora_matrix=100), dtype="bfloat16",
                   bytes_per_element=2, lora_in=300, lora_out=400, adapter_cast=True,
                   lora_linears_per_layer=7, reference_pass=True)
    t = time_plan(step, replace(LORA_RATES, lora_s_per_linear=1e-5), load_config(None, []))
    # 8 rows x 36,800 FLOPs (the base's) at the bfloat16 rate, 2 micro-batches' layers
    assert t.phases["logprobs"] == pytest.approx(8 * 36_800 / 8e9 + 2 * 2 * FIXED + HEAD / 2
                                                 + 2 * 120 * EW)


def test_dynamic_sampling_s_draws_are_said_to_be_left_out():
    """The prediction times one drawn batch per step: the time model's docstring and
    docs/memory.md say dynamic sampling's extra draws are left out."""
    from pathlib import Path

    from r1fit.memory.planner import timing

    assert "algo.dynamic_sampling" in timing.__doc__.split("Left out:")[1]
    docs = (Path(__file__).resolve().parents[3] / "docs" / "memory.md").read_text()
    left_out = docs.split("## How long will it take?")[1].split("## Inside a step")[0]
    assert "algo.dynamic_sampling" in left_out.split("Left out:")[1]


# --- FSDP2's collectives over several processes

#: 4 processes; 3 units (2 layers and the root) of 6,000 bytes gathered, the 2 layers' 4,000
#: bytes gathered again in a backward and their 2,000 bytes of gradients reduce-scattered
TRAFFIC = Traffic(processes=4, units=3, gather_bytes=6000, backward_units=2, backward_bytes=4000,
                  reduce_units=2, reduce_bytes=2000, reference_bytes=0, overlapped=False)
#: a link of 1 MB/s, 1 ms a collective
LINKED = replace(RATES, link_bytes_per_s=1e6, collective_s=1e-3, link_source="test")
# each: its collectives' fixed cost, 3/4 of the bytes over the link, FSDP2's copies at 1e10
# (an all-gather's shard in and unit out: 2 x (1/4 + 1) per byte; a reduce-scatter's 2)
GATHER = 3e-3 + 6000 * 0.75 / 1e6 + 2.5 * 6000 / 1e10
BACKWARD = 2e-3 + 4000 * 0.75 / 1e6 + 2.5 * 4000 / 1e10
SCATTER = 2e-3 + 2000 * 0.75 / 1e6 + 2 * 2000 / 1e10


def test_collectives_by_hand():
    assert collective_seconds(TRAFFIC, LINKED, 6000, 3) == pytest.approx(GATHER)
    assert collective_seconds(TRAFFIC, LINKED, 2000, 2, reduce=True) == pytest.approx(SCATTER)
    assert collective_seconds(TRAFFIC, LINKED, 0, 0) == 0
    # FSDP2's copies go into buffers allocated for them: at the fresh-copy rate where measured
    fresh = replace(LINKED, fresh_copy_bytes_per_s=1e9)
    assert collective_seconds(TRAFFIC, fresh, 6000, 3) == pytest.approx(
        3e-3 + 6000 * 0.75 / 1e6 + 2.5 * 6000 / 1e9)


def test_a_step_over_several_processes_by_hand():
    """The HF engine gathers the policy once before generating; every micro-batch's forward
    gathers every unit, its backward the layers again and reduce-scatters their gradients; the
    gradient norm is one all-reduce. On a CPU in turn with the compute; on CUDA beside it, the
    longer of the two plus the first unit's gather and the last unit's reduce-scatter."""
    cfg = load_config(None, [])
    one = time_plan(replace(STEP, engine="hf"), LINKED, cfg)
    cpu = time_plan(replace(STEP, engine="hf", traffic=TRAFFIC), LINKED, cfg, processes=4)
    assert cpu.phases["generate"] == pytest.approx(one.phases["generate"] + GATHER)
    per_micro_batch = GATHER + BACKWARD + SCATTER
    assert cpu.phases["update"] == pytest.approx(one.phases["update"] + 2 * per_micro_batch
                                                 + 1e-3)
    assert cpu.details["collectives_seconds"] == pytest.approx(GATHER + 2 * per_micro_batch)
    assert cpu.link == "4 processes, 0.00 GB/s: test"
    assert "collectives_seconds" not in one.details and one.link == ""
    # CUDA: the update's compute (all of it but AdamW's 1,200 x 28 bytes and 10 tensors) is
    # shorter than its collectives here, so the collectives set the time
    compute = one.phases["update"] - (1200 * 28 / 1e10 + 10 * 1e-6)
    assert compute < 2 * per_micro_batch
    cuda = time_plan(replace(STEP, engine="hf", traffic=replace(TRAFFIC, overlapped=True)),
                     LINKED, cfg, processes=4)
    exposed = 2 * (GATHER / 3 + SCATTER / 2)
    assert cuda.phases["update"] == pytest.approx(2 * per_micro_batch + exposed
                                                  + 1200 * 28 / 1e10 + 10 * 1e-6 + 1e-3)
    # the reference's pass (its own units under full fine-tuning: 3,000 bytes, its root 1,000):
    # each micro-batch gathers the 2 layers, the root once for the pass (FSDP2 reshards it after
    # a backward only): 5 gathers of 2 x 2,000 + 1,000 bytes, on a CPU after its compute
    ref = time_plan(replace(STEP, engine="hf", reference_pass=True,
                            traffic=replace(TRAFFIC, reference_bytes=3000,
                                            reference_root_bytes=1000)), LINKED, cfg)
    alone = time_plan(replace(STEP, engine="hf", reference_pass=True), LINKED, cfg)
    assert ref.phases["logprobs"] == pytest.approx(
        alone.phases["logprobs"] + 5e-3 + 5000 * 0.75 / 1e6 + 2.5 * 5000 / 1e10)
    # the static engine runs on one process only; vLLM's weight sync is left out
    vllm = time_plan(replace(STEP, engine="vllm", traffic=TRAFFIC), LINKED, cfg)
    assert vllm.phases["generate"] == pytest.approx(
        time_plan(replace(STEP, engine="vllm"), LINKED, cfg).phases["generate"])


@pytest.mark.parametrize("values", [["model.lora.r=8"], ["algo.beta=0.04"],
                                    ["algo.beta=0.04", "model.freeze_vision=true"]])
def test_fsdp_traffic_of_a_plan(use_tiny_cache, values):
    """The collectives' bytes from the units the memory plan gathers (fsdp_buffers): a whole
    gather is the whole policy; a backward re-gathers the decoder layers, and the vision blocks
    where the tower trains; the gradients reduce-scattered (float32 on CUDA) are the trainable
    elements'; the full fine-tuning reference gathers its own units."""
    cfg = load_config(None, values)
    lora, trains = cfg.model.lora.r > 0, cfg.model.lora.r == 0 and not cfg.model.freeze_vision
    facts = model_facts(cfg.model.path, cfg.model.lora.target)
    assert facts.config_dtype == "float32"  # gathered in bfloat16 on CUDA: 2 bytes
    assert fsdp_traffic(facts, cfg, 1, "cuda") is None
    t = fsdp_traffic(facts, cfg, 4, "cuda")
    units = fsdp_buffers(facts, cfg, "float32", 2, True)
    layers, blocks = facts.text.layers, facts.vision.depth
    assert t.processes == 4 and t.overlapped
    assert t.units == layers + blocks + 1
    assert t.gather_bytes == units.unsharded_weights
    # a frozen tower's last block is gathered by FSDP2's backward prefetch
    assert t.backward_units == layers + (blocks if trains else 1)
    assert t.backward_bytes == layers * units.layer_unit + (blocks if trains else 1) * \
        units.block_unit
    assert t.root_bytes == units.root_unit
    if lora:
        assert t.reduce_bytes == 8 * facts.lora_in_plus_out * 4
        assert t.reduce_units == layers and t.reference_bytes == 0
    else:
        assert t.reduce_bytes == 4 * (facts.params - (0 if trains else facts.vision_params))
        assert t.reduce_units == layers + (blocks if trains else 0) + 1
        assert t.reference_bytes == facts.params * 2
        assert t.reference_root_bytes == facts.root_params * 2
    on_cpu = fsdp_traffic(facts, cfg, 4, "cpu")
    assert not on_cpu.overlapped and on_cpu.gather_bytes == 2 * t.gather_bytes  # float32
    plan = plan_memory(cfg, device_type="cpu", gpus=2)
    assert plan.time["details"]["collectives_seconds"] > 0
    assert plan.time["link"].startswith("2 processes, ")
    assert any("FSDP2's collectives" in str(line) for line in time_blocks(plan.time, cfg))
    assert "collectives_seconds" not in plan_memory(cfg, device_type="cpu").time["details"]


@pytest.mark.parametrize("device,gpus,env,threads", [
    ("cpu", 2, None, 1),   # torchrun's default for each worker
    ("cpu", 2, "3", 3),
    ("cpu", 2, "x", 1),
    ("cpu", 1, "3", None),  # one process: this one's threads
    ("cuda", 8, "3", None),
])
def test_a_cpu_plan_for_processes_reads_their_threads(monkeypatch, device, gpus, env, threads):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert process_threads(device, gpus) == threads


#: FSDP2's collectives per step on rank 0, counted call by call (count, bytes) in 2-process gloo
#: runs of builtin:tiny with ``MEASURED_RUN`` (torch.distributed's all-gathers and
#: reduce-scatters wrapped, 2026-11-29): generation's gather, a log-prob pass's gathers, an
#: update's gathers (forward and backward) and reduce-scatters
MEASURED_RUN = ["train.prompts_per_step=2", "algo.num_generations=4", "memory.micro_batch=2",
                "algo.max_new_tokens=8", "data.eval=null"]
MEASURED_TRAFFIC = {
    "full": (["algo.beta=0"], (5, 1_448_192), None, (18, 4_156_928), (10, 2_896_384)),
    "full-kl": (["algo.beta=0.04"], (5, 1_448_192), (9, 2_078_464), (18, 4_156_928),
                (10, 2_896_384)),
    "lora-kl": (["model.lora.r=8", "algo.beta=0.04"], (5, 1_513_728), (9, 2_209_536),
                (16, 4_085_760), (4, 131_072)),
    "full-frozen-tower": (["algo.beta=0", "model.freeze_vision=true"], (5, 1_448_192), None,
                          (16, 3_823_616), (6, 969_216)),
}


@pytest.mark.parametrize("name", sorted(MEASURED_TRAFFIC))
def test_the_collectives_are_the_ones_fsdp2_makes(use_tiny_cache, name):
    """On rates that turn a collective's seconds into its count (1 s each, nothing else) or its
    bytes (each process moves half of them at 0.5 B/s), the model's collectives per phase are the
    counts and bytes a 2-process run made."""
    values, generate, logprobs, gathers, scatters = MEASURED_TRAFFIC[name]
    cfg = load_config(None, [*MEASURED_RUN, *values])
    facts = model_facts(cfg.model.path, cfg.model.lora.target)
    step = replace(run_shape(facts, cfg, prompt_shape(cfg, facts), rows=4, generation_batch=4,
                             micro_batch=2, completion=8, engine="hf", device_type="cpu",
                             dtype="float32"),
                   reference_pass=cfg.algo.beta > 0,
                   traffic=fsdp_traffic(facts, cfg, 2, "cpu"))
    free = replace(RATES, copy_bytes_per_s=1e30, fresh_copy_bytes_per_s=1e30)
    counting = replace(free, collective_s=1.0, link_bytes_per_s=1e30)
    weighing = replace(free, collective_s=0.0, link_bytes_per_s=0.5)
    for measured, forward in ((generate, None), (logprobs, False)):
        if measured is None:
            continue
        got = [whole_gather_seconds(step, r) if forward is None else
               pass_collectives(step, r, backward=False, reference=True)[0]
               for r in (counting, weighing)]
        assert got == pytest.approx(list(measured))
    update = [pass_collectives(step, r, backward=True)[0] for r in (counting, weighing)]
    assert update == pytest.approx([gathers[0] + scatters[0], gathers[1] + scatters[1]])
    t = step.traffic
    assert (2 * t.reduce_units, 2 * t.reduce_bytes) == scatters


def test_which_models_place_a_tool_turns_image_by_their_own_rule(use_tiny_cache):
    """Qwen-VL's M-RoPE rule places an appended image; Gemma 3's image tokens attend both
    ways, so the static engine prefills such a turn whole, and the plan times it so."""
    assert model_facts("builtin:tiny").places_images
    gemma = model_facts("builtin:tiny-gemma3")
    assert not gemma.places_images
    cfg = load_config(None, ["model.path=builtin:tiny-gemma3", "tools=[zoom]",
                             "data.max_images=2", "rollout.engine=static"])
    assert plan_memory(cfg, device_type="cpu").time["details"]["refill"] == 1.0
