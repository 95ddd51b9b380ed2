"""The parts and phases of r1fit/memory/planner/estimate.py one function at a time, on model facts
made up by hand (no model is built): what each adds, and when."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from r1fit.config import Config
from r1fit.memory.planner.estimate import (
    CPU_ENGINE_KV_BYTES,
    EngineMemory,
    FsdpBuffers,
    Sizes,
    StepShape,
    TokenCut,
    backward_end_bytes,
    engine_memory,
    fsdp_buffers,
    generation_bytes,
    head_chunk_bytes,
    layer_backward_bytes,
    lm_activations,
    patch_embed_backward_bytes,
    persistent_states,
    update_bytes,
    vision_activations,
)
from r1fit.memory.planner.facts import ModelFacts, PromptShape, TextDims, VisionDims
from r1fit.memory.planner.formulas import (
    kv_cache_bytes,
    lm_forward_bytes,
    vision_forward_bytes,
)

PROMPT = PromptShape(tokens=10, image_tokens=4, patches=16, how="by hand")


@pytest.fixture
def facts(text: TextDims, vision: VisionDims) -> ModelFacts:
    """Two tensors, [100 x 32] and [32]; one adapted Linear 32 -> 32; FSDP units: a layer of 100
    elements, a vision block of 40, the root's 300 (50 of them the vision tower's)."""
    return ModelFacts(
        name="hand", config_dtype="float32", params=3_232, param_tensors=2, vision_params=0,
        vision_param_tensors=0, tied_head=False, largest_layer_weight=2_048, lora_in_plus_out=64,
        lora_layers=1, lora_targets=("q_proj",), text=text, vision=vision,
        param_shapes=((100, 3_200), (32, 32)), vision_param_shapes=(), lora_linears=((32, 32),),
        layer_params=100, layer_lora_in_plus_out=64, vision_block_params=40, root_params=300,
        root_vision_params=50)


@pytest.fixture
def step(facts: ModelFacts) -> Callable[..., StepShape]:
    """A float32, fully fine-tuned step of 10 + 6 tokens a row; keywords change it."""
    def make(**changes: Any) -> StepShape:
        shape = StepShape(facts=facts, b=4, lora_r=0, prompt=PROMPT, completion=6, eager=False,
                          vision_trains=True)
        return replace(shape, **changes)

    return make


def test_states_whole_and_sharded(facts):
    full = persistent_states(facts, Config(), gpus=1, b=4)  # beta 0.05: a reference copy
    assert full.weights == full.gradients == full.reference == 4 * 3_232
    assert full.optimizer == 2 * 4 * 3_232 + 4 * 2  # exp_avg, exp_avg_sq; a step count a tensor
    # over 3 GPUs each tensor keeps ceil(rows / 3) rows: 34 x 32 + 11 x 1
    assert persistent_states(facts, Config(), gpus=3, b=4).weights == 4 * (34 * 32 + 11)
    lora = Config().with_values({"model.lora.r": 8})
    adapters = persistent_states(facts, lora, gpus=1, b=2)
    assert adapters.gradients == 4 * (8 * 32 + 32 * 8)  # lora_A, lora_B in float32
    assert adapters.weights == 2 * 3_232 + adapters.gradients and adapters.reference == 0
    # lora_A [8 x 32] by rows of 2, lora_B [32 x 8] by rows of 8, over 4 GPUs
    assert persistent_states(facts, lora, gpus=4, b=2).gradients == 4 * (2 * 32 + 8 * 8)


def test_fsdp_buffers_gather_the_root_and_two_units(facts):
    cpu = fsdp_buffers(facts, Config(), "float32", b=4, cuda=False)
    assert cpu.all_gather == 4 * (300 + 2 * 100)
    assert cpu.reduce_scatter == 4 * 300  # the largest unit's gradients: the root's
    assert cpu.head_grad == 4 * 100 * 32 and cpu.gathering == 4 * 300
    # on CUDA a float32 model computes in bfloat16 (b = 2) and reduce-scatters in float32
    cuda = fsdp_buffers(facts, Config(), "float32", b=2, cuda=True)
    assert cuda.all_gather == 2 * (300 + 2 * 100) and cuda.reduce_scatter == 4 * 300
    frozen = fsdp_buffers(facts, Config().with_values({"model.freeze_vision": True}), "float32",
                          b=4, cuda=False)
    assert frozen.root_grad == 4 * (300 - 50)
    lora = fsdp_buffers(facts, Config().with_values({"model.lora.r": 8}), "bfloat16", b=2,
                        cuda=False)
    assert lora.layer_unit == 2 * 100 + 4 * 8 * 64  # the layer + its float32 adapters
    assert lora.reduce_scatter == 4 * 8 * 64 and lora.root_grad == lora.head_grad == 0


def test_end_of_backward_adds_the_embedding_gradient_when_it_accumulates(facts, step):
    one = Sizes(rows=4, gpus=1, micro=4, generation=4, checkpointing=True)
    two = replace(one, micro=2)
    embedding = 100 * 32 * 4
    assert backward_end_bytes(step(), one, FsdpBuffers()) == 0  # a fresh .grad, untied head
    assert backward_end_bytes(step(), two, FsdpBuffers()) == embedding  # added into .grad
    tied = step(facts=replace(facts, tied_head=True))
    assert backward_end_bytes(tied, one, FsdpBuffers()) == embedding
    assert backward_end_bytes(step(lora_r=8), two, FsdpBuffers()) == 0  # frozen under LoRA
    # tied, from the second micro-batch on: the head adds its gradient into .grad in place
    # (nothing held, r1fit/algorithms/embedding.py); an embedding module r1fit cannot replace
    # (Gemma's scaled one) still makes its dense gradient beside the existing .grad
    assert backward_end_bytes(tied, two, FsdpBuffers()) == embedding
    assert backward_end_bytes(replace(tied, lora_r=8), two, FsdpBuffers()) == 0
    # a plain nn.Embedding adds its rows into .grad in place: no dense gradient; tied, the
    # first micro-batch still sums the head's held gradient and the embedding's dense one into
    # the new .grad, with every other .grad made (measured: tiny-qwen3vl -4.6% without it)
    plain = replace(facts, embedding_into_grad=True)
    assert backward_end_bytes(step(facts=plain), two, FsdpBuffers()) == 0
    assert backward_end_bytes(step(facts=replace(plain, tied_head=True)), two,
                              FsdpBuffers()) == embedding
    # one micro-batch: no .grad to add into yet; over FSDP the root's buffers as before
    assert backward_end_bytes(step(facts=replace(plain, tied_head=True)), one,
                              FsdpBuffers()) == embedding


def test_the_patch_embeddings_backward_holds_its_workspace_saved_pixels_and_new_gradient(step):
    """The tower's first op runs its backward last but for the input embedding's: its workspace,
    the pixel values it saved in the compute dtype (float32: the pixel values themselves, already
    counted) and, once .grad exists, its new weight gradient beside it (width 16 x 1,176)."""
    one = Sizes(rows=4, gpus=1, micro=4, generation=4, checkpointing=True)
    two = replace(one, micro=2)
    patches = 2 * 16  # two rows of a micro-batch, each with its prompt's 16 patches
    assert patch_embed_backward_bytes(step(patch_embed_workspace=500), one) == 500
    assert patch_embed_backward_bytes(step(patch_embed_workspace=500), two) \
        == 500 + 16 * 1176 * 4
    bf16 = step(b=2, patch_embed_workspace=500)
    assert patch_embed_backward_bytes(bf16, two) == 500 + patches * 1176 * 2 + 16 * 1176 * 2
    # over FSDP the gradient is the unit's (FsdpBuffers); a frozen tower runs no backward
    assert patch_embed_backward_bytes(bf16, replace(two, gpus=2)) == 500 + patches * 1176 * 2
    assert patch_embed_backward_bytes(step(vision_trains=False), two) == 0


def test_a_tied_heads_gradient_is_held_through_the_layers_backward(facts, step):
    """Autograd sums the head's and the embedding's gradients of the one shared parameter before
    accumulating them, so the head's [vocab x hidden] gradient waits from the head's backward
    to the embedding's, the last: through every layer's backward (one process only; FSDP's
    root keeps it as FsdpBuffers.head_grad)."""
    one = Sizes(rows=2, gpus=1, micro=2, generation=2, checkpointing=True)
    tied = step(facts=replace(facts, tied_head=True))
    assert (layer_backward_bytes(tied, one, FsdpBuffers())
            - layer_backward_bytes(step(), one, FsdpBuffers())) == 100 * 32 * 4
    lora = replace(tied, lora_r=8)
    assert layer_backward_bytes(lora, one, FsdpBuffers()) == layer_backward_bytes(
        step(lora_r=8), one, FsdpBuffers())
    fsdp = replace(one, gpus=2)
    assert layer_backward_bytes(tied, fsdp, FsdpBuffers()) == layer_backward_bytes(
        step(), fsdp, FsdpBuffers())


def test_a_layers_backward_adds_its_weight_gradient_when_it_accumulates(step):
    one = Sizes(rows=2, gpus=1, micro=2, generation=2, checkpointing=True)
    two = replace(one, rows=4)
    assert two.micro_batches == 2 and Sizes(10, 1, 4, 4, True).micro_batches == 3
    extra = layer_backward_bytes(step(), two, FsdpBuffers()) - layer_backward_bytes(
        step(), one, FsdpBuffers())
    assert extra == 2_048 * 4  # the largest Linear's gradient
    assert layer_backward_bytes(step(lora_r=8), two, FsdpBuffers()) == layer_backward_bytes(
        step(lora_r=8), one, FsdpBuffers())


def test_a_frozen_vision_tower_saves_nothing_for_backward(step):
    trained, peak = vision_activations(step(), rows=2, checkpointing=False)
    assert peak == trained > 0
    forward, peak = vision_activations(step(vision_trains=False), rows=2, checkpointing=False)
    assert peak == forward < trained  # its no-grad forward, gone before the language model runs
    on, peak = vision_activations(step(), rows=2, checkpointing=True)
    assert on < trained < peak  # each block's input kept; one block rebuilt in backward


def test_gradients_are_held_from_the_second_micro_batch_on(facts, step):
    states = persistent_states(facts, Config(), gpus=1, b=4)
    one = Sizes(rows=2, gpus=1, micro=2, generation=2, checkpointing=True)
    first = update_bytes(step(), one, states, FsdpBuffers(), chunk=12)
    later = update_bytes(step(), replace(one, rows=4), states, FsdpBuffers(), chunk=12)
    assert later.activations == first.activations
    # the head adds its [100 x 32] weight gradient into .grad in place from the second on
    assert later.logits_chunk == head_chunk_bytes(step(), 2, 12, new_grad=False) \
        < first.logits_chunk == head_chunk_bytes(step(), 2, 12)
    assert head_chunk_bytes(step(), 2, 12) - head_chunk_bytes(step(), 2, 12, new_grad=False) \
        <= 100 * 32 * 4
    # the largest moment is a layer's backward: now beside every .grad, and adding the layer's
    # weight gradient into its existing one
    assert later.peak == first.peak + states.gradients + 2_048 * 4


def test_vllm_engine_adds_its_weight_copy_and_kv_pool(facts):
    hf = engine_memory(facts, Config(), stored=4, cuda=True, budget=80 << 30)
    assert hf == EngineMemory()  # rollout.engine=hf: no engine
    vllm = Config().with_values({"rollout.engine": "vllm"})
    # CUDA, no kv_cache_memory: gpu_memory_utilization 0.3 of the device for weights + KV
    cuda = engine_memory(facts, vllm, stored=2, cuda=True, budget=1000_000, engine="vllm")
    assert (cuda.weights, cuda.kv_cache, cuda.sleeps) == (2 * 3_232, 300_000 - 2 * 3_232, True)
    given = vllm.with_values({"rollout.vllm.kv_cache_memory": 5_000,
                              "rollout.vllm.sleep_level": 0})
    assert engine_memory(facts, given, stored=4, cuda=True, budget=1 << 30, engine="vllm") == \
        EngineMemory(4 * 3_232, 5_000, sleeps=False)
    # CPU: no sleep mode; the default pool
    assert engine_memory(facts, vllm, stored=4, cuda=False, budget=1 << 30, engine="vllm") == \
        EngineMemory(4 * 3_232, CPU_ENGINE_KV_BYTES, sleeps=False)


def test_static_engine_holds_its_cache_its_step_workspace_and_a_lora_backup(facts, monkeypatch):
    """3 rows of a 10-token prompt + 30 new tokens, bfloat16: the cache is 64 columns (40
    rounded up to 64) x 2 layers x K and V x kv_dim 16 x 2 bytes per row; the decode step's
    workspace is [3 x 100] logits in bf16, their float32 copy (worked on in place) and one more
    float32 tensor, with top_p < 1 the filter's 22 bytes an entry more; with LoRA the adapted
    32 x 32 weight's copy."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the default workspace
    cfg = Config().with_values({"rollout.engine": "static", "algo.max_new_tokens": 30,
                                "eval.batch": 2})
    got = engine_memory(facts, cfg, stored=2, cuda=True, budget=1 << 30, engine="static",
                        prompt_tokens=10, rows=3)
    streams = 2 * (32 << 20)  # CUDA graphs: the side stream's and the captures' cuBLAS workspaces
    assert got == EngineMemory(weights=0, kv_cache=3 * 64 * 2 * 2 * 16 * 2,
                               graphs=3 * 100 * (2 + 4 + 4) + streams, static=True)
    nucleus = engine_memory(facts, cfg.with_values({"algo.top_p": 0.9}), stored=2, cuda=True,
                            budget=1 << 30, engine="static", prompt_tokens=10, rows=3)
    assert nucleus.graphs == 3 * 100 * (2 + 4 + 4 + 22) + streams
    eager = engine_memory(facts, cfg.with_values({"rollout.static.cuda_graphs": False}),
                          stored=2, cuda=True, budget=1 << 30, engine="static", prompt_tokens=10,
                          rows=3)
    assert eager.graphs == 3 * 100 * (2 + 4 + 4)
    lora = engine_memory(facts, cfg.with_values({"model.lora.r": 4}), stored=2, cuda=True,
                         budget=1 << 30, engine="static", prompt_tokens=10, rows=3)
    assert lora.weights == 32 * 32 * 2 and lora.kv_cache == got.kv_cache
    # an evaluation batch larger than the generation batch sizes the cache (the engine grows)
    wide = engine_memory(facts, cfg.with_values({"eval.batch": 8, "data.eval": "x.jsonl"}),
                         stored=2, cuda=True, budget=1 << 30, engine="static",
                         prompt_tokens=10, rows=3)
    assert wide.kv_cache == got.kv_cache * 8 // 3


def test_a_shared_prefix_micro_batch_runs_one_packed_row_per_group(step):
    """Rows of 10 prompt + 6 completion tokens; packed, a group's row is its prompt then the
    micro-batch's completions of that group, and a micro-batch that straddles two groups runs
    two rows, padded to the wider."""
    assert step().packed(3) == (3, 16)  # per row
    shared = step(share_prefix=True, group=8, rows_per_gpu=8)
    assert shared.packed(4) == (1, 10 + 4 * 6)
    assert shared.packed(3) == (1, 10 + 3 * 6)  # [0:3] [3:6] [6:8], all in group 0
    two_groups = replace(shared, rows_per_gpu=16)
    assert two_groups.packed(3) == (2, 10 + 3 * 6)  # [6:9] = rows 6, 7 of group 0 and 8 of 1
    assert two_groups.packed(16) == (2, 10 + 8 * 6)
    # two GPUs of 4 rows each: [0:3] [3:4] and [4:7] [7:8], never two groups
    assert replace(shared, rows_per_gpu=4, gpus=2).packed(3) == (1, 10 + 3 * 6)


def test_a_shared_prefix_runs_the_vision_tower_once_per_group(step):
    per_row, _ = vision_activations(step(), rows=4, checkpointing=False)
    shared, _ = vision_activations(step(share_prefix=True, group=4, rows_per_gpu=4), rows=4,
                                   checkpointing=False)
    assert per_row == 4 * shared > 0


def test_with_tools_every_row_runs_its_trajectorys_images(step):
    """A trajectory's images are its own (the tools' results differ row by row): a micro-batch
    runs each row's, 40 patches here, even where the rows share their prompt, and the step keeps
    each row's pixel values."""
    per_row, _ = vision_activations(step(), rows=4, checkpointing=False)  # 16 patches a row
    # 4 rows; 4 rows of one group; packed by 40 tokens, 2 rows of 16 tokens a micro-batch
    for tools, rows in ((step(trajectory_patches=40), 4),
                        (step(trajectory_patches=40, share_prefix=True, group=4, rows_per_gpu=4), 4),
                        (step(trajectory_patches=40, packed_tokens=40, rows_per_gpu=8, group=4), 2)):
        assert tools.training_patches(4) == rows * 40
        saved, _ = vision_activations(tools, rows=4, checkpointing=False)
        assert saved * 4 * 16 == per_row * rows * 40
    assert step().trajectory_pixels(8) == 0
    assert step(trajectory_patches=40).trajectory_pixels(8) == 8 * 40 * 1176 * 4


def test_micro_batches_packed_by_tokens_cut_as_the_loop_cuts_them(step):
    """Rows of 10 prompt + 6 completion tokens (16 a row), 8 rows on the GPU. Per row, 40 tokens
    take 2 rows (32; a third would make 48): 4 micro-batches of 32 tokens, 2 prompts' images."""
    per_row = step(packed_tokens=40, rows_per_gpu=8, group=4)
    assert per_row.token_cut() == TokenCut(rows=2, tokens=32, images=2, count=4)
    assert per_row.packed(2) == (1, 32) and per_row.images(2) == 2
    # shared, groups of 4: a group's prompt once, 10 + 4 x 6 = 34 <= 40; the next group's
    # prompt would make 50: 2 micro-batches of one group each
    shared = replace(per_row, share_prefix=True)
    assert shared.token_cut() == TokenCut(rows=4, tokens=34, images=1, count=2)
    # groups of 2: rows 0-1 are 22 tokens, row 2 opens group 1 (+16 = 38), row 3 would make 44:
    # [0:3] 38 tokens, 2 prompts; [3:6] 16 + 16 + 6 = 38 (row 3 repeats group 1's prompt);
    # [6:8] 22
    assert replace(shared, group=2).token_cut() == TokenCut(rows=3, tokens=38, images=2,
                                                            count=3)
    # a budget below one row: every row alone
    assert step(packed_tokens=5, rows_per_gpu=8, group=4).token_cut() == \
        TokenCut(rows=1, tokens=16, images=1, count=8)


def test_the_rebuilt_layers_first_norm_input_is_its_checkpointed_input_in_float32(step):
    """Checkpointing rebuilds one layer in backward. In float32 its first RMSNorm saves its
    input as it is, the layer's checkpointed input (already kept): the rebuilt layer counts it
    no more (32 hidden x 4 bytes per token). In bfloat16 the norm saves a float32 copy of its
    own, so the rebuilt layer counts it in full."""
    from r1fit.memory.planner.formulas import layer_saved_per_token

    t = step().facts.text
    tokens = 2 * 16  # two rows of 10 + 6 tokens
    for b in (4, 2):
        act = lm_activations(step(b=b), 2)
        layer = layer_saved_per_token(t, b, mask_len=16)
        assert act.recompute == tokens * (layer - (4 * 32 if b == 4 else 0))
        assert act.on - act.recompute == act.off - t.layers * tokens * layer \
            + tokens * t.layers * b * 32  # the layers' checkpointed inputs instead of theirs


def test_a_packed_micro_batch_carries_one_additive_mask_or_none_for_flash(step):
    """Packed rows: one [T x T] mask in the model's dtype (4 bytes here) and no per-layer copy;
    for flash attention's varlen kernels no mask at all; rows of their own: a boolean [T x T]
    mask per row, which SDPA copies to float in every layer."""
    packed = step(packed_tokens=32, rows_per_gpu=2, group=2)  # both rows in one: T = 32
    flash = replace(packed, flash=True)
    assert (step().mask, packed.mask, flash.mask) == ("padding", "additive", "none")
    assert replace(flash, share_prefix=True).mask == "additive"  # siblings need the mask
    per_row = lm_activations(step(), 2).off
    in_one = lm_activations(packed, 2).off
    varlen = lm_activations(flash, 2).off
    # same 32 tokens. Packed: the 32 x 32 x 4-byte mask once, and with a mask SDPA gets the KV
    # heads repeated to the query heads (K and V saved at q_dim, not kv_dim, per layer); the
    # per-row path also has those, its 2 x 16 x 16 boolean bytes and, per layer and token, a
    # float copy of its row of the mask (16 x 4 bytes)
    t = step().facts.text
    repeated = 32 * t.layers * 2 * 4 * (t.q_dim - t.kv_dim)
    assert t.q_dim > t.kv_dim
    assert in_one - varlen == 32 * 32 * 4 + repeated
    assert per_row - varlen == 2 * 16 * 16 + 32 * t.layers * 16 * 4 + repeated


def test_the_fused_head_holds_its_chunk_and_gradients_at_once_in_forward(step):
    # facts: vocab 100, hidden 32, float32; 2 rows of 10 + 6 tokens. A chunk of 12 tokens: its
    # logits 12 x 100 x 4 = 4,800 B and a 12-row temporary of the exponentials (SLICE_TOKENS 32
    # > 12): 4,800 B; the backward's chunk 4,800 B. Backbone output 2 x 16 x 32 x 4 = 4,096 B;
    # hidden[mask] 2 x 6 x 32 x 4 = 1,536 B; the head's weight gradient 100 x 32 x 4 = 12,800 B.
    fused = step(fused_loss=True)
    assert head_chunk_bytes(fused, 2, 12) == 4_096 + 1_536 + 12_800 + 9_600
    assert head_chunk_bytes(fused, 2, 12, new_grad=False) == 4_096 + 1_536 + 9_600
    # recomputing in backward: the larger of the forward's moment and the backward's
    assert head_chunk_bytes(step(), 2, 12) == max(4_096 + 9_600, 12_800 + 1_536 + 4_800)
    # LoRA freezes the head: no weight gradient, and the fused head costs the backbone output
    # and its input beside the chunk, as the recomputing one's forward does, plus hidden[mask]
    assert head_chunk_bytes(step(fused_loss=True, lora_r=8), 2, 12) \
        == head_chunk_bytes(step(lora_r=8), 2, 12) + 1_536


def test_a_shared_prefill_runs_each_prompt_of_a_generation_chunk_once(step):
    """8 rows of one group: the prefill (vision tower, layers) runs 1 prompt instead of 8, and
    its cache is copied to the 8 rows beside its own; the decode is the per-row path's. Rows of
    distinct prompts (group 1) are generated as usual."""
    per_row = step(group=8, rows_per_gpu=8)
    shared = replace(per_row, share_prefill=True)
    t, v, b, P = per_row.facts.text, per_row.facts.vision, per_row.b, PROMPT.tokens
    vision_1 = vision_forward_bytes(v, b, PROMPT.patches) + (P + PROMPT.image_tokens) * t.hidden * b
    prefill_1 = max(kv_cache_bytes(t, b, 1, P) + lm_forward_bytes(t, b, 1, P, False),
                    kv_cache_bytes(t, b, 9, P))
    decode = (kv_cache_bytes(t, b, 8, per_row.length) + 8 * per_row.length * t.kv_dim * b
              + 8 * t.vocab * (b + 1))
    assert generation_bytes(shared, 8, 0) == per_row.pixels(8) + max(vision_1, prefill_1, decode)
    assert generation_bytes(shared, 8, 0) < generation_bytes(per_row, 8, 0)
    # chunks of 3 rows of groups of 2 touch 2 prompts: [0:3] = group 0 and row 2 of group 1
    assert replace(shared, group=2).groups_touched(3) == (2, 2)
    distinct = replace(shared, group=1)
    assert generation_bytes(distinct, 8, 0) == generation_bytes(replace(per_row, group=1), 8, 0)
