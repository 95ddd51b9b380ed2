"""The memory planner: the peak memory per device of one GRPO step, predicted before launch.

``r1fit plan CONFIG|MODEL [key=value ...]`` builds the model from its ``config.json`` on the meta
device (no weights are read or allocated) and adds up what one step of the configured run holds,
phase by phase, the way r1fit's code allocates it. A hub id's ``config.json`` is r1fit's shipped
copy (r1fit/models/configs/) or that file alone from the hub; ``model.dtype=auto`` is planned in the
dtype ``from_pretrained`` will pick (r1fit.models.load.checkpoint_dtype). Read in this order:

- ``facts``: what the planner reads off the model and the data (shapes, parameter counts, FSDP2
  units and shards, the longest prompt);
- ``formulas``: the bytes each piece of the model saves or holds, per token or per patch;
- ``estimate``: the phases of one step added up from those (the module docstring says what is
  modelled), the largest sizes that fit, and the advice;
- ``printing``: the plan printed (``render``).

The names below are the planner's public ones, importable from here.
"""

from r1fit.memory.planner.estimate import (
    CUDA_ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    DEFAULT_DEVICE_MEMORY,
    FSDP_PARTS,
    PARTS,
    SAFETY_MARGIN,
    Plan,
    cublas_workspaces,
    even_size,
    plan_memory,
)
from r1fit.memory.planner.facts import (
    CHARS_PER_TOKEN,
    CHAT_TEMPLATE_TOKENS,
    QUESTION_TOKENS,
    SHAPES_SAMPLES,
    ModelFacts,
    PromptShape,
    TextDims,
    VisionDims,
    model_facts,
    prompt_shape,
    shard_elements,
    vision_dims,
)
from r1fit.memory.planner.formulas import (
    ADAPTER_BYTES,
    F32,
    GENERATION_LOGITS_F32,
    layer_backward_temp_per_token,
    layer_forward_temp_per_token,
    layer_saved_per_token,
    vision_block_saved_per_patch,
    vision_forward_temp_per_patch,
    vision_other_saved_per_patch,
)
from r1fit.memory.planner.printing import render, render_blocks

__all__ = [
    "ADAPTER_BYTES", "CHARS_PER_TOKEN", "CHAT_TEMPLATE_TOKENS", "CUDA_ALLOCATOR_SLACK",
    "CUDA_CONTEXT_BYTES", "DEFAULT_DEVICE_MEMORY", "F32", "FSDP_PARTS", "GENERATION_LOGITS_F32",
    "PARTS", "QUESTION_TOKENS", "SAFETY_MARGIN", "SHAPES_SAMPLES", "ModelFacts", "Plan",
    "PromptShape", "TextDims", "VisionDims", "cublas_workspaces", "even_size", "layer_backward_temp_per_token",
    "layer_forward_temp_per_token", "layer_saved_per_token", "model_facts", "plan_memory",
    "prompt_shape", "render", "render_blocks", "shard_elements",
    "vision_block_saved_per_patch", "vision_dims", "vision_forward_temp_per_patch",
    "vision_other_saved_per_patch",
]
