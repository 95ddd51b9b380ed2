"""FLOP counts on builtin:tiny, against counts done by hand from its config (hidden 64, 2 decoder
layers of 4 heads x 16 dims with 2 KV heads, MLP 128; a vision tower of 2 blocks, width 64,
14 px patches over 2 frames, a 2x2 merger; the tied LM head)."""

from __future__ import annotations

import pytest
import torch

from r1fit.memory.flops import (
    GroupShape,
    ModelShape,
    RowShape,
    attention_flops,
    backward_flops,
    forward_flops,
    generation_flops,
    gpu_peak_flops,
    group_shapes,
    image_patches,
    measured_peak_flops,
    scoring_flops,
    step_flops,
    update_flops,
)
from r1fit.models.load import load_policy

# a decoder layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate, up 64x128 + down 128x64
LAYER = 4096 + 2048 + 2048 + 4096 + 3 * 8192  # 36,864
# a vision block: qkv 64x192 + proj 64x64 + gate, up, down 64x128; patch embedding 3x2x14x14x64
BLOCK, EMBED = 12288 + 4096 + 3 * 8192, 3 * 2 * 14 * 14 * 64  # 40,960 and 75,264
MERGER = 256 * 256 + 256 * 64  # 81,920: two linears over 4 merged patches of 64
WIDTH = 2 * 4 * 16  # heads x head_dim over the 2 layers: 128
V_WIDTH = 2 * 64  # the vision blocks' width over its 2 blocks


def load(tiny_dir, lora_r=0):
    model, processor = load_policy(str(tiny_dir), lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False,
                                   dtype="float32", device=torch.device("cpu"),
                                   gradient_checkpointing=False)
    return model, len(processor.tokenizer)


def test_shape_of_the_tiny_model(tiny_dir):
    model, vocab = load(tiny_dir)
    shape = ModelShape.of(model)
    assert (shape.text_matrix, shape.text_frozen, shape.lora_matrix) == (2 * LAYER, 0, 0)
    assert (shape.vision_matrix, shape.vision_merger, shape.merge) == (2 * BLOCK + EMBED, MERGER, 4)
    assert (shape.head, shape.head_trains, shape.vision_trains) == (vocab * 64, True, True)
    assert (shape.attention_width, shape.vision_attention_width) == (WIDTH, V_WIDTH)


def test_lora_shape_freezes_the_base(tiny_dir):
    model, _ = load(tiny_dir, lora_r=4)
    shape = ModelShape.of(model)
    assert shape.text_frozen == shape.text_matrix == 2 * LAYER
    # r=4 adapters on the 7 linears of each layer: 4 x (in + out) each
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert shape.lora_matrix == 2 * per_layer
    assert not shape.vision_trains and not shape.head_trains


def test_attention_counts_causal_positions():
    # 3 tokens after 2 cached: positions attended 3 + 4 + 5 = 12, x 4 x width
    assert attention_flops(10, 2, 3) == 4 * 10 * 12
    assert attention_flops(10, 0, 1) == 40


def test_forward_and_backward_by_hand(tiny_dir):
    model, vocab = load(tiny_dir)
    shape = ModelShape.of(model)
    # 3 tokens, the head on 2, one image of 16 patches (4 merged tokens)
    fwd = forward_flops(shape, context=0, tokens=3, head_tokens=2, patches=(16,))
    vision = 2 * (2 * BLOCK + EMBED) * 16 + 2 * MERGER * 4 + 4 * V_WIDTH * 16 * 16
    assert fwd == 2 * 2 * LAYER * 3 + 2 * vocab * 64 * 2 + 4 * WIDTH * 6 + vision
    bwd = backward_flops(shape, tokens=3, head_tokens=2, attention=4 * WIDTH * 6,
                         patches=(16,))
    assert bwd == (4 * 2 * LAYER * 3 + 4 * vocab * 64 * 2 + 8 * WIDTH * 6
                   + 2 * vision)
    # a prompt of 2 and a completion of 1: the same 3 tokens, the head on 1 of them
    row = GroupShape(prompt=2, completions=(1,), patches=(16,))
    assert update_flops(shape, row) == fwd - 2 * vocab * 64 + bwd - 4 * vocab * 64


def test_a_shared_prompt_is_counted_once(tiny_dir):
    model, vocab = load(tiny_dir)
    shape = ModelShape.of(model)
    one, other = GroupShape(5, (3,), (16,)), GroupShape(5, (4,), (16,))
    both = GroupShape(5, (3, 4), (16,))
    prompt = forward_flops(shape, context=0, tokens=5, head_tokens=0, patches=(16,))
    # the per-row path runs the prompt (and its image) twice, the shared one once
    assert scoring_flops(shape, one) + scoring_flops(shape, other) - prompt == \
        scoring_flops(shape, both)
    prompt_backward = backward_flops(shape, tokens=5, head_tokens=0, attention=4 * WIDTH * 15,
                                     patches=(16,))
    assert update_flops(shape, one) + update_flops(shape, other) - prompt - prompt_backward == \
        update_flops(shape, both)


def test_generation_is_a_prefill_then_one_token_at_a_time(tiny_dir):
    model, vocab = load(tiny_dir)
    shape = ModelShape.of(model)
    row = RowShape(prompt=5, completion=3)
    prefill = 2 * 2 * LAYER * 5 + 2 * vocab * 64 + 4 * WIDTH * 15  # 1+..+5 = 15 positions
    decode = 2 * (2 * 2 * LAYER + 2 * vocab * 64) + 4 * WIDTH * (6 + 7)
    assert generation_flops(shape, row) == prefill + decode
    group = GroupShape(5, (3,))
    parts = step_flops(shape, [row, row], [group, group], log_prob_passes=1, updates=2)
    assert parts["generate"] == 2 * (prefill + decode)
    assert parts["logprobs"] == 2 * scoring_flops(shape, group)
    assert parts["update"] == 4 * update_flops(shape, group)


def test_image_patches_from_the_grid_or_the_pixels():
    assert image_patches({"image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 6]])}, None) == (16, 12)
    assert image_patches({"pixel_values": torch.zeros(2, 3, 64, 64)}, 16) == (16, 16)
    assert image_patches({}, 16) == ()


def test_peaks():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989e12)
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == pytest.approx(756e12)
    # float32: TF32's tensor-core peak where torch allows it, else the CUDA cores' (its default)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == pytest.approx(156e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=False) == pytest.approx(19.5e12)
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(
        494e12 if torch.backends.cuda.matmul.allow_tf32 else 67e12)
    assert gpu_peak_flops("Some New GPU", torch.bfloat16) is None
    assert measured_peak_flops(torch.device("cpu"), torch.float32, size=256, repeats=2) > 1e8


def test_measuring_the_peak_leaves_the_random_stream_alone():
    """The meter measures the CPU's peak when a run first logs its FLOPs, which after a resume is
    a later step than in the run it continues: its random matrices must not move the stream that
    LoRA's dropout draws from (a resumed LoRA-dropout run differed from step 4 on)."""
    before = torch.get_rng_state()
    measured_peak_flops(torch.device("cpu"), torch.float32, size=64, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)


def two_prompts(tiny_dir, lora_r=0):
    """The tiny model and two encoded 56 px prompts of builtin:shapes."""
    from r1fit.data.batch import encode_prompts
    from r1fit.data.dataset import load_dataset

    model, processor = load_policy(str(tiny_dir), lora_r=lora_r, lora_alpha=16, lora_dropout=0.0,
                                   lora_target="all-linear", freeze_vision=False,
                                   dtype="float32", device=torch.device("cpu"),
                                   gradient_checkpointing=False)
    data = load_dataset("builtin:shapes", split="train", min_pixels=784, max_pixels=3136,
                        max_images=1, max_bad_fraction=0.0, seed=0, size=4)
    return model, encode_prompts(processor, [data[0], data[1]], "")


def test_meter_counts_real_prompts(tiny_dir):
    from r1fit.memory.flops import MfuMeter

    model, prompts = two_prompts(tiny_dir)
    completions = [torch.ones(4, dtype=torch.long), torch.ones(7, dtype=torch.long)]
    meter = MfuMeter(model, torch.device("cpu"), torch.float32)
    assert meter.peak > 0 and meter.peak_from == "measured CPU matmul"
    shape = ModelShape.of(model)
    # 56 px images: a 4x4 grid of 14 px patches each
    rows = [RowShape(prompts[0].length, 4, (16,)), RowShape(prompts[1].length, 7, (16,))]
    groups = [GroupShape(prompts[0].length, (4,), (16,)), GroupShape(prompts[1].length, (7,), (16,))]
    expected = sum(step_flops(shape, rows, groups, log_prob_passes=2, updates=3).values())
    assert meter.generation(prompts, completions) + meter.training(
        prompts, completions, log_prob_passes=2, updates=3, micro_batch=2, shared=True) == expected
    # three rows of one prompt in micro-batches of 2: groups (2 rows) and (1 row) when shared
    rows3 = [prompts[0]] * 3
    comps3 = [torch.ones(n, dtype=torch.long) for n in (2, 3, 4)]
    n = prompts[0].length
    assert group_shapes(rows3, comps3, 14, micro_batch=2, shared=True) == [
        GroupShape(n, (2, 3), (16,)), GroupShape(n, (4,), (16,))]
    assert len(group_shapes(rows3, comps3, 14, micro_batch=2, shared=False)) == 3
    assert meter.mfu(4e9, 2.0, 2) == pytest.approx(4e9 / 2.0 / (2 * meter.peak))


def test_generation_counted_as_the_engine_runs_it(tiny_dir):
    """An engine that prefills each distinct prompt of a chunk once counts one prefill per prompt
    a chunk touches; one that decodes on merged LoRA counts no adapter products."""
    from r1fit.memory.flops import GenerationLayout, MfuMeter, decode_flops, prefill_flops

    model, (a, b) = two_prompts(tiny_dir, lora_r=4)
    rows = [a, a, a, b, b, b]  # two groups of 3 (the same objects, as a rollout's rows are)
    completions = [torch.ones(n, dtype=torch.long) for n in (2, 3, 4, 5, 6, 7)]
    meter = MfuMeter(model, torch.device("cpu"), torch.float32)
    shape = ModelShape.of(model)
    assert shape.lora_matrix > 0
    shapes = [RowShape(p.length, int(c.shape[0]), (16,)) for p, c in zip(rows, completions)]
    decode = sum(decode_flops(shape, r) for r in shapes)
    each = [prefill_flops(shape, r) for r in shapes]
    assert meter.generation(rows, completions) == decode + sum(each)
    # chunks of 4: rows 0-3 touch prompts a and b, rows 4-5 prompt b
    assert meter.generation(rows, completions, layout=GenerationLayout(4)) == \
        decode + each[0] + each[3] + each[4]
    assert meter.generation(rows, completions, layout=GenerationLayout(64)) == \
        decode + each[0] + each[3]
    merged = ModelShape(**{**shape.__dict__, "lora_matrix": 0})
    assert meter.generation(rows, completions, layout=GenerationLayout(64, merged=True)) == \
        sum(decode_flops(merged, r) for r in shapes) + prefill_flops(merged, shapes[0]) \
        + prefill_flops(merged, shapes[3])
    # a decoded token of the merged engine: the adapters' 2 x lora_matrix FLOPs fewer
    one = RowShape(a.length, 2)
    assert decode_flops(shape, one) - decode_flops(merged, one) == 2 * shape.lora_matrix


def test_update_mfu_is_the_training_flops_over_the_update_seconds():
    """mfu over the whole step's seconds, mfu_update the log-prob passes' and updates' FLOPs over
    seconds_update alone (the update phase's utilisation), with the generation's layout."""
    from types import SimpleNamespace

    from r1fit.memory.flops import GenerationLayout, flops_metrics

    class Meter:
        peak = 100.0

        def generation(self, rows, completions, *, layout=None):
            assert layout == GenerationLayout(8, merged=True)
            return 600

        def training(self, rows, completions, **kwargs):
            return 400

        def mfu(self, flops, seconds, devices):
            return flops / seconds / (self.peak * devices)

    run = SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(kl_in_reward=False,
                                                                    num_iterations=1)),
                          sizes=SimpleNamespace(micro_batch=4, micro_batch_tokens=None),
                          layout=SimpleNamespace(on=False), world=SimpleNamespace(size=1))
    kept = SimpleNamespace(rows=[], completions=[])
    times = {"seconds_generate": 6.0, "seconds_score": 2.0, "seconds_update": 2.0}
    out = flops_metrics(Meter(), run, kept, kept, False, times, layout=GenerationLayout(8, True))
    assert out == {"flops": 1000.0, "mfu": pytest.approx(1000 / 10 / 100),
                   "mfu_update": pytest.approx(400 / 2 / 100)}
    # no update (no group with differing rewards): no update MFU
    assert "mfu_update" not in flops_metrics(Meter(), run, kept, None, False, times,
                                             layout=GenerationLayout(8, True))
