"""The config tree: one frozen dataclass per section, one help text per field (``opt``), and the
whole ``Config`` with what a run asks of it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from r1fit.config.values import ConfigError, ReadOnlyDict, changed
from r1fit.units import parse_memory

#: memory.logits_chunk=auto: tokens per LM-head chunk where the head makes its gradient in its
#: forward (no chunk is recomputed, so a small one costs no extra matmul: with Qwen's 151,936-token
#: vocabulary its float32 logits are 148 MiB), and where it recomputes all but the last in backward
FUSED_HEAD_CHUNK = 256
RECOMPUTED_HEAD_CHUNK = 1024


def opt(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None) -> Any:
    """A config field with its help text and optional numeric bounds."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le}
    if isinstance(default, dict):
        return field(default_factory=lambda: ReadOnlyDict(default), metadata=meta)
    if isinstance(default, list):  # lists are stored as tuples: the tree is read-only
        return field(default_factory=lambda: tuple(default), metadata=meta)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question about the image, and the "
    "Assistant solves it. The Assistant first thinks about the reasoning process in the mind and "
    "then provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
    "here </think><answer> answer here </answer>"
)


@dataclass(frozen=True)
class LoraConfig:
    r: int = opt(0, "LoRA rank; 0 means full fine-tuning of the language model.", ge=0)
    alpha: int = opt(32, "LoRA scaling numerator (scale = alpha / r).", gt=0)
    dropout: float = opt(0.0, "Dropout on the LoRA input.", ge=0, le=1)
    target: str = opt("all-linear", "Language-model linear layers to adapt: 'all-linear' or a "
                      "comma-separated list of module names such as 'q_proj,v_proj'.")
    compute_dtype: Literal["float32", "model"] = opt(
        "float32", "What the adapters compute in during training forwards (log-prob passes and "
        "updates). Their weights, gradients and AdamW states stay float32 either way. 'float32' "
        "(peft's own): each adapted Linear casts its input to float32 and adds its product in "
        "float32. 'model': bfloat16 (float16) products under torch.autocast, as mixed-precision "
        "trainers run them; less memory traffic and tensor-core products on a 16-bit model, "
        "not yet measured on a GPU. Changes nothing on a float32 model.")


@dataclass(frozen=True)
class ModelConfig:
    path: str = opt("builtin:tiny", "Model to train: a local Hugging Face folder, a hub id such as "
                    "'Qwen/Qwen2.5-VL-3B-Instruct', or a random-weight model r1fit builds and "
                    "caches, 'builtin:NAME' with NAME one of tiny, tiny-hd32, small, "
                    "small-realvocab, bench-1024, bench-3b-cut, tiny-qwen2vl, tiny-qwen3vl, "
                    "tiny-gemma3 (docs/models.md).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = opt(
        "auto", "Weight dtype. 'auto': the checkpoint's own, as transformers' from_pretrained does "
        "(config.json's dtype or torch_dtype: bfloat16 for Qwen2-VL and Qwen2.5-VL, float32 for "
        "the built-in models); r1fit plan prints the one it planned with. 'float32', 'bfloat16' "
        "or 'float16' convert the weights on load.")
    lora: LoraConfig = opt(LoraConfig(), "LoRA settings.")
    freeze_vision: bool = opt(False, "Keep the vision tower frozen (full fine-tuning only; LoRA never "
                              "adapts it).")
    attn_implementation: str = opt("sdpa", "Attention kernel passed to from_pretrained "
                                   "('sdpa', 'eager', 'flash_attention_2'). With 'sdpa' the "
                                   "vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL attend to "
                                   "all their images' windows in one call a layer, not one a "
                                   "window (r1fit/models/vision_attention.py).")


@dataclass(frozen=True)
class ShapesConfig:
    kinds: tuple[str, ...] = opt(["color"], "Question kinds of builtin:shapes: any of color, count, "
                           "position, box (the [x1,y1,x2,y2] box of a named shape, in pixels of "
                           "the image; its accuracy method is iou), zoom (the stripes of a 32 px "
                           "mark in an image 8 x image_size on a side, unreadable once shrunk to "
                           "data.max_pixels, readable in a crop: a task for tools).")
    image_size: int = opt(112, "Side of the square builtin:shapes images in pixels (112 px = 16 "
                          "image tokens; the tiny demo model learns far faster than at 56 px). "
                          "With box questions its square must lie within data.min_pixels.."
                          "max_pixels, so the image is not resized and the boxes are in the "
                          "frame the model sees (keep it a multiple of 28 for Qwen2/2.5-VL "
                          "processors).", ge=28)
    max_distractors: int = opt(0, "Most extra shapes drawn besides the asked-about one.", ge=0)
    zoom_hint: bool = opt(False, "Zoom questions say where the mark is (its centre in fractions "
                          "of the image): the tool is still needed to read it, finding it is not.")
    zoom_cells: int = opt(0, "0: a zoom mark lies anywhere in the image; n: at the centre of one "
                          "of n x n equal cells (n^2 places: easier to find or to copy from "
                          "zoom_hint).", ge=0)
    train_size: int = opt(5000, "Number of builtin:shapes training questions.", ge=1)


@dataclass(frozen=True)
class DataConfig:
    train: str | tuple[str, ...] = opt(
        "builtin:shapes", "Training data: 'builtin:shapes', or one source or a list of them (their "
        "rows are concatenated). A source is a JSONL file, a JSON file holding a list of rows, a "
        "parquet file, a folder saved by datasets' save_to_disk, or a hub dataset id; 'SOURCE@split' "
        "picks a split (default train). Row formats are detected (see data.format).")
    eval: str | tuple[str, ...] | None = opt(
        "builtin:shapes", "Held-out data, the same kinds of sources as data.train (a hub id's split "
        "defaults to test), or null for no evaluation.")
    format: Literal["auto", "columns", "conversations"] = opt(
        "auto", "Row format: 'columns' (a question, an answer and image columns: r1fit's {image, "
        "problem, solution}, EasyR1's {images, problem, answer}), 'conversations' (VLM-R1, "
        "LLaVA/ShareGPT and MiniCPM-V rows: a list of turns with '<image>' placeholders), or "
        "'auto' (detected from each source's first row; the choice and the keys are logged).")
    image_folder: str | tuple[str, ...] | None = opt(
        None, "Folder that image paths in data.train rows are relative to: one for every source, or "
              "one per data.train source (VLM-R1's --image_folders). null: each file's own folder.")
    eval_image_folder: str | tuple[str, ...] | None = opt(
        None, "data.image_folder for the data.eval sources.")
    problem_key: str | None = opt(None, "Column of the question ('columns' rows; null: 'problem', "
                                  "else 'prompt').")
    answer_key: str | None = opt(None, "Column of the reference answer ('columns' rows; null: "
                                 "'solution', else 'answer').")
    image_key: str | None = opt(None, "Column of the image(s): paths, bytes or {bytes, path} "
                                "records (null: each row's 'image', else its 'images').")
    conversations_key: str | None = opt(None, "Column of the turns ('conversations' rows; null: "
                                        "'conversations', else 'messages').")
    reward_method: str | tuple[str, ...] = opt(
        "default", "Accuracy method of rows that do not name one: one for every source, or one per "
        "data.train source (VLM-R1's --reward_method). Methods: default, mcq, yes_no, numeric, "
        "math, fuzzy, iou (see docs/rewards.md).")
    eval_reward_method: str | tuple[str, ...] | None = opt(
        None, "data.reward_method for the data.eval sources: one for every source, or one per "
        "source. null: an eval source that is also a data.train source takes that source's "
        "method; any other, the method given for all sources, else 'default'.")
    reward_method_key: str = opt("accu_reward_method", "Column a row names its own accuracy "
                                 "method in (VLM-R1's); it wins over data.reward_method.")
    focus_key: str = opt("focus", "Column of a row's focus box [x1, y1, x2, y2] on its first "
                         "image: fractions of its width and height when every number is at most "
                         "1, else pixels of the image at its source resolution, upright. `r1fit sft` "
                         "with the crop or zoom tool learns a row that has one as a tool "
                         "demonstration (a call on the box, the tool's image, the answer); "
                         "training ignores it. A box outside its image is dropped, warned once.")
    eval_size: int = opt(200, "Evaluate on at most this many held-out questions.", ge=1)
    max_pixels: int = opt(4194304, "Images are resized (aspect kept) to at most this many "
                          "pixels (4,194,304 = 2048 x 2048: EasyR1's examples/config.yaml; up to "
                          "5,350 image tokens on Qwen2.5-VL, so lower it to fit a smaller "
                          "card, e.g. 401408 = 512 image tokens). The demo preset: 12544 "
                          "(112 x 112).", ge=28 * 28)
    min_pixels: int = opt(28 * 28, "Images are resized (aspect kept) to at least this many pixels.",
                          ge=28 * 28)
    max_images: int = opt(1, "Most images per row; rows with more are bad rows. With tools, "
                          "also the most images one trajectory may hold, the row's and those "
                          "tools returned together (an image past it is an error result).",
                          ge=0)
    max_prompt_tokens: int | None = opt(
        None, "Longest prompt in tokens (image tokens included); longer rows are bad rows, "
        "skipped and counted, never truncated (truncation would cut image tokens out). null: the "
        "model's context length minus algo.max_new_tokens.", ge=1)
    max_bad_fraction: float = opt(0.05, "Stop with an error when more than this fraction of rows are "
                                  "bad (missing/corrupt image, missing field, bad JSON).", ge=0, le=1)
    system_prompt: str = opt("", "System message put before every prompt ('' = none). The demo "
                             "uses none: on the tiny model a long system prompt dilutes attention "
                             "to the image. For instruct models use an R1 prompt, e.g. "
                             "r1fit.config.R1_SYSTEM_PROMPT (see configs/).")
    shapes: ShapesConfig = opt(ShapesConfig(), "Settings of the builtin:shapes task.")


@dataclass(frozen=True)
class AlgoConfig:
    num_generations: int = opt(8, "Completions sampled per prompt (the GRPO group size, G).", ge=2)
    num_iterations: int = opt(1, "Optimizer updates per rollout batch (mu); > 1 reuses the rollout "
                              "with PPO clipping against the old log-probs.", ge=1)
    beta: float = opt(0.04, "Weight of the KL penalty to the reference model (the model GRPO "
                      "starts from): k3 per token in the loss, or k1 per completion in the reward "
                      "with kl_in_reward; 0 loads no reference at all. 0.04: the GRPO paper's "
                      "(DeepSeekMath); TRL 1.16 defaults to 0, EasyR1's example to 0.01. The demo "
                      "preset: 0.05 (at 0 the demo's answers turn deterministic at 50% accuracy, at "
                      "0.05 it reaches 75%).", ge=0)
    kl_in_reward: bool = opt(False, "Subtract beta x the completion's k1 KL (sum over its tokens of "
                             "log pi - log pi_ref) from its reward before the advantages, instead of "
                             "a KL term in the loss (REINFORCE++, verl's use_kl_in_reward). Needs "
                             "beta > 0; costs one no-grad forward per step when num_iterations is 1.")
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp",
                                 "reinforce_pp_baseline"] = opt(
        "grpo", "How rewards become advantages: grpo (reward minus group mean, over group std), "
        "dr_grpo (no std division), rloo (reward minus the mean of the other G-1 of its group), "
        "reinforce_pp (REINFORCE++: reward normalised by the whole step's mean and std), "
        "reinforce_pp_baseline (group mean subtracted, then normalised by the whole step's std).")
    scale_rewards: bool = opt(True, "Older spelling of the grpo/dr_grpo choice: false with "
                              "advantage_estimator=grpo means dr_grpo; false with rloo or "
                              "reinforce_pp* is an error.")
    epsilon: float = opt(0.2, "PPO clip range below 1 (and above, unless epsilon_high is set), for "
                         "importance_sampling_level=token.", gt=0)
    epsilon_high: float | None = opt(0.28, "PPO clip range above 1 (DAPO clip-higher); null means "
                                     "epsilon.", gt=0)
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = opt(
        "token", "Importance ratio of the clipped loss: token (PPO/GRPO), sequence (GSPO: "
        "exp of the mean token log-ratio of the completion, clipped per completion with "
        "gspo_epsilon/gspo_epsilon_high) or sequence_token (GSPO-token: the sequence ratio's value "
        "with each token's own gradient). Matters only off-policy (num_iterations > 1).")
    gspo_epsilon: float = opt(3e-4, "Clip range below 1 of the sequence-level ratio "
                              "(importance_sampling_level=sequence or sequence_token; GSPO paper's "
                              "3e-4). epsilon/epsilon_high are not used there.", gt=0)
    gspo_epsilon_high: float | None = opt(4e-4, "Clip range above 1 of the sequence-level ratio "
                                          "(GSPO paper's 4e-4); null means gspo_epsilon.", gt=0)
    max_new_tokens: int = opt(512, "Longest completion in tokens (512: TRL 1.16's "
                              "max_completion_length; EasyR1's example uses 2048). The demo "
                              "preset: 24.", ge=1)
    overlong_buffer: int = opt(0, "DAPO's soft overlong punishment: a completion longer than "
                               "max_new_tokens - overlong_buffer tokens gets a penalty growing "
                               "linearly to -overlong_penalty at max_new_tokens, added to its "
                               "reward and logged as reward/overlong (0 = off).", ge=0)
    overlong_penalty: float = opt(1.0, "Penalty of a completion of max_new_tokens tokens under "
                                  "overlong_buffer (DAPO's factor).", ge=0)
    mask_truncated: bool = opt(False, "DAPO's overlong filtering: completions cut at "
                               "max_new_tokens (no end-of-sequence token) are left out of the loss "
                               "and its token/sequence counts (they still count in the group's "
                               "advantages).")
    temperature: float = opt(1.0, "Sampling temperature (log-probs use the same temperature).",
                             gt=0)
    top_p: float = opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    dynamic_sampling: bool = opt(
        False, "DAPO's dynamic sampling: drop the groups whose rewards are all equal (no policy "
        "gradient) and draw further batches of train.prompts_per_step prompts (generate + score) "
        "until the step has prompts_per_step groups whose rewards differ (the first ones drawn are "
        "kept) or max_resample_batches batches were drawn. Then it trains on those it has (under "
        "torchrun as many as split evenly), and skips the update (a warning, no optimizer or "
        "learning-rate step) when there are none. The step's reward, accuracy and "
        "zero_variance_groups figures are over every group drawn.")
    max_resample_batches: int = opt(
        4, "With dynamic_sampling: the most prompt batches one step draws, the first included "
        "(each costs a generation; sample_batches logs how many were drawn).", ge=1)
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = opt(
        "token_mean", "How token losses become one number: token_mean (DAPO), seq_mean_token_mean "
        "(GRPO, and GSPO's own), seq_mean_token_sum_norm (Dr. GRPO).")
    entropy_coef: float = opt(0.0, "Entropy bonus: the loss minus this x the policy's per-token "
                              "entropy, aggregated like the loss (0 = off; the entropy is logged "
                              "either way).", ge=0)
    tis_cap: float | None = opt(2.0, "Truncated importance sampling against the rollout engine's "
                                "log-probs (rollout.engine=vllm): each token's loss is weighted by "
                                "min(pi_trainer / pi_engine, tis_cap) (verl's default cap 2; TRL "
                                "1.16 defaults to a sequence-level mask at 3). No effect with the hf "
                                "engine; 0 or null = off.", ge=0)
    cov_restriction: Literal["none", "clip_cov", "kl_cov"] = opt(
        "none", "Restrict the update of the tokens whose log-prob/advantage covariance is highest "
        "(Cui et al. 2025, verl's clip_cov / kl_cov policy losses; scores over each micro-batch): "
        "clip_cov takes a random clip_cov_ratio share of the valid tokens with covariance in "
        "(clip_cov_lb, clip_cov_ub) out of the policy loss; kl_cov adds kl_cov_coef x |log pi - "
        "log pi_old| to the top kl_cov_ratio share and clips no token (acts only with "
        "num_iterations > 1). Token-level ratios only. Logged as cov_restricted.")
    clip_cov_ratio: float = opt(2e-4, "Clip-Cov: share of the valid tokens restricted (verl's "
                                "default).", gt=0, le=1)
    clip_cov_lb: float = opt(1.0, "Clip-Cov: lower bound of the covariance window (verl's "
                             "default).")
    clip_cov_ub: float = opt(5.0, "Clip-Cov: upper bound of the covariance window (verl's "
                             "default).")
    kl_cov_ratio: float = opt(2e-4, "KL-Cov: share of the valid tokens penalised (verl's default; "
                              "the paper used 2e-3 for its 7B runs).", gt=0, le=1)
    kl_cov_coef: float = opt(1.0, "KL-Cov: weight of |log pi - log pi_old| on the penalised tokens "
                             "(verl's ppo_kl_coef; 1.0 is its in-function fallback, its shipped "
                             "config sets 0.1).", ge=0)

    def clip_range(self) -> tuple[float, float]:
        """(below, above) clip ranges of the importance ratio: gspo_epsilon/gspo_epsilon_high for
        a sequence-level ratio, epsilon/epsilon_high for a token-level one."""
        if self.importance_sampling_level == "token":
            return self.epsilon, self.epsilon_high or self.epsilon
        return self.gspo_epsilon, self.gspo_epsilon_high or self.gspo_epsilon

    def per_token_loss(self) -> bool:
        """Whether the policy loss is a sum of per-token terms, each depending on its own token's
        log-prob and entropy only: token-level ratios, no Clip-Cov/KL-Cov (which choose tokens
        over a micro-batch). GSPO's sequence ratios couple a sequence's tokens."""
        return self.importance_sampling_level == "token" and self.cov_restriction == "none"

    def estimator(self) -> str:
        """The advantage estimator in use (``scale_rewards=false`` turns grpo into dr_grpo)."""
        if self.advantage_estimator == "grpo" and not self.scale_rewards:
            return "dr_grpo"
        return self.advantage_estimator

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line, naming the keys) for settings that contradict each
        other."""
        if not self.scale_rewards and self.advantage_estimator not in ("grpo", "dr_grpo"):
            raise ConfigError(f"algo.scale_rewards=false (Dr. GRPO) contradicts "
                              f"algo.advantage_estimator={self.advantage_estimator}; drop "
                              "scale_rewards or use advantage_estimator=dr_grpo")
        if self.kl_in_reward and self.beta == 0:
            raise ConfigError("algo.kl_in_reward=true subtracts algo.beta x KL from the reward, but "
                              "algo.beta is 0; set algo.beta > 0 (e.g. 0.001)")
        for key in ("epsilon", "gspo_epsilon"):
            if getattr(self, key) >= 1:
                raise ConfigError(f"algo.{key}: got {getattr(self, key)!r}, expected a number < 1 "
                                  "(the ratio is clipped at 1 - epsilon)")
        if self.overlong_buffer > self.max_new_tokens:
            raise ConfigError(f"algo.overlong_buffer ({self.overlong_buffer}) must be <= "
                              f"algo.max_new_tokens ({self.max_new_tokens})")
        if self.cov_restriction != "none" and self.importance_sampling_level != "token":
            raise ConfigError(f"algo.cov_restriction={self.cov_restriction} restricts token-level "
                              f"ratios; algo.importance_sampling_level is "
                              f"{self.importance_sampling_level}")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(f"algo.clip_cov_lb ({self.clip_cov_lb}) must be < algo.clip_cov_ub "
                              f"({self.clip_cov_ub})")
        if self.tis_cap and self.tis_cap < 1:
            raise ConfigError(f"algo.tis_cap: got {self.tis_cap!r}, expected 0, null (off) or a "
                              "number >= 1 (a cap below 1 would shrink every weight)")


@dataclass(frozen=True)
class TrainConfig:
    output_dir: str = opt("runs/demo", "Where metrics.jsonl, checkpoints and the final model go "
                          "(under torchrun: on a filesystem every node sees).")
    max_steps: int = opt(120, "GRPO steps (one rollout batch each, num_iterations updates each).",
                         ge=0)
    seed: int = opt(0, "Seed of data order, sampling and initialisation.")
    prompts_per_step: int = opt(32, "Prompts per step; each gets num_generations completions. "
                                "Under torchrun the step's rows (x num_generations) are split "
                                "evenly over the processes.", ge=1)
    learning_rate: float = opt(1e-6, "Peak learning rate of AdamW for GRPO (1e-6: TRL 1.16's "
                               "GRPOConfig and EasyR1's example, for full fine-tuning; with LoRA "
                               "use ~1e-5). The demo preset: 3e-3 (a random-weight tiny model).",
                               gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = opt(
        "cosine", "Learning-rate shape after warm-up (decays to 10% of the peak).")
    warmup_steps: int = opt(5, "Linear learning-rate warm-up, in optimizer updates.", ge=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    max_grad_norm: float = opt(1.0, "Clip the global gradient norm to this value (0 = no clipping).",
                               ge=0)
    max_skipped_updates: int = opt(
        5, "An update whose gradient norm is not finite (NaN or inf: a loss that overflowed, a "
        "diverging learning rate) is skipped: no optimizer or schedule step, so the weights "
        "stay those of the last finite update; a warning and the step's skipped_updates say "
        "so. After this many in a row the run stops with an error (0: never; a resumed run "
        "counts afresh).", ge=0)
    device: str = opt("auto", "'auto' (CUDA when available, else CPU), 'cpu', 'cuda' or 'cuda:N'. "
                      "Under torchrun each process uses cuda:<local rank> (or the CPU).")
    overwrite: bool = opt(False, "Replace an earlier run found in output_dir instead of stopping: "
                          "what r1fit wrote there is deleted, other files are kept.")
    deterministic: bool = opt(
        False, "Deterministic kernels (torch.use_deterministic_algorithms with warn_only, so an op "
        "without one warns by name instead of stopping; cuDNN deterministic, no autotuning; "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8). On a GPU, atomics-based kernels otherwise make two "
        "runs of the same config differ in the last bits, so a resumed run is not bit-identical "
        "to an uninterrupted one; costs speed (measured by benchmarks/gpu_check.py). CPU runs "
        "are deterministic either way.")
    early_stop_patience: int = opt(0, "Stop after this many evaluations without a new best eval "
                                   "accuracy (0 = never). final/ holds the last step's weights; "
                                   "checkpoint.keep_best_by=eval/accuracy keeps the best "
                                   "evaluation's checkpoint where that step saved one.", ge=0)


@dataclass(frozen=True)
class SFTConfig:
    steps: int = opt(100, "Steps of `r1fit sft` (learning each row's solution).", ge=0)
    format_warmup_steps: int = opt(
        0, "Steps of the format warm-up that `r1fit train` runs before GRPO: SFT on the "
        "<think>/<answer> format with the answer of a random row, teaching the format but not the "
        "task, so that GRPO's first rewards are not all zero. 0 (none): an instruct model "
        "already follows the format from its system prompt, as TRL and EasyR1 assume. The demo "
        "preset: 60 (random weights know no format).", ge=0)
    batch_size: int = opt(16, "Rows per supervised step (under torchrun: split evenly over the "
                          "processes).", ge=1)
    learning_rate: float = opt(2e-5, "Peak learning rate of the supervised steps (`r1fit sft` "
                               "and the format warm-up). 2e-5: TRL 1.16's SFTConfig, for full "
                               "fine-tuning; with LoRA use ~1e-4. The demo preset: 1e-2.", gt=0)
    max_answer_tokens: int = opt(
        1024, "Tokens of a row's answer (a multi-turn row: its conversation after the prompt, the "
        "assistant turns scored) beyond which SFT cuts it; each cut answer is counted "
        "(truncated_answers in the step's row) and the first one warned about. `r1fit plan --sft` "
        "and the auto sizes of `r1fit sft` plan every answer this long.", ge=1)
    think: str | None = opt(
        None, "null: `r1fit sft` learns each answer exactly as the data writes it, and the format "
        "warm-up's targets have an empty <think></think>. A text: put inside <think> </think> "
        "of the warm-up's targets, and `r1fit sft` rewrites every answer that lacks the "
        "<think>/<answer> tags into <think>TEXT</think><answer>ANSWER</answer> (one that opens "
        "with its own <think> block keeps it: <think>its thinking</think><answer>the rest"
        "</answer>). The demo preset: 'I look at the image.'.")
    balance_turns: bool = opt(
        False, "Weigh each assistant turn of a multi-turn row the same in the row's loss (its "
        "tokens share the turn's weight; the row's total weight is unchanged). A tool "
        "demonstration's call is ~80 tokens and its answer ~10: under the token mean (false, as "
        "TRL's SFTTrainer) the call drowns the answer, and builtin:tiny learned the calls but "
        "answered at chance; with true it read every zoom (docs/tools.md). Rows of one turn are "
        "unchanged.")
    eval_every: int = opt(
        0, "`r1fit sft` evaluates every N steps besides before (eval.before_train) and after the "
        "last step (0 = only then): the held-out accuracy as a curve over the steps, in "
        "metrics.jsonl and the run report. Each evaluation generates greedily on the eval set, "
        "tool turns included.", ge=0)


@dataclass(frozen=True)
class MemoryConfig:
    micro_batch: int | Literal["auto"] = opt(
        16, "Sequences per forward/backward; peak memory is set by this, not by num_generations "
        "or prompts_per_step. 'auto': from the largest that `r1fit plan` fits in the device "
        "(CUDA: its free memory at start-up; CPU: memory.budget), the fewest micro-batches of "
        "the step's rows, evenly filled, in whole groups of algo.num_generations rows where "
        "they fit (128 rows with 105 fitting: 64, two micro-batches at a lower peak than 105 "
        "and 23).", ge=1)
    micro_batch_tokens: int | Literal["auto"] | None = opt(
        None, "Packed micro-batches for GRPO's log-prob passes and updates and for SFT steps: as "
        "many consecutive rows as fit in this many tokens (each row's prompt and completion or "
        "answer as the model runs them; with share_prefix a group's prompt once per "
        "micro-batch) go through the model as "
        "one row with no padding, each sequence seeing only itself (transformers' padding-free "
        "layout: a block-diagonal mask with sdpa/eager, varlen kernels with flash_attention_2; "
        "with share_prefix an explicit mask). Replaces micro_batch there; a row longer than it "
        "runs alone. Checked equal to the per-row path on the first rows, refused for a model "
        "where it is not. 'auto': the largest the planner fits (in the device, as for "
        "micro_batch). null: "
        "micro-batches of micro_batch rows.", ge=1)
    generation_batch: int | Literal["auto"] = opt(
        64, "Sequences generated together (KV cache on). 'auto': as for micro_batch (the "
        "fewest generation chunks that fit, evenly filled).", ge=1)
    gradient_checkpointing: bool | Literal["auto"] = opt(
        True, "Recompute layer activations in the backward pass (less memory, about a third more "
        "update compute). 'auto': the planner decides at start-up for the device (CUDA: its free "
        "memory; CPU: memory.budget, else on): off when the step fits without it (with "
        "micro_batch=auto: whichever of off and on, each at its largest micro-batch, the time "
        "model predicts the faster step for); with a fixed micro_batch that does not fit "
        "without it, only every n-th layer (memory.checkpoint_every) for the largest n that "
        "fits; logged once.")
    checkpoint_every: int = opt(
        1, "With gradient checkpointing on, recompute only every n-th layer (transformers' "
        "every_n_layers: vision blocks and decoder layers counted together in module order, the "
        "first one included); the others keep their activations, which costs memory and saves "
        "their recompute. 1: every layer. gradient_checkpointing=auto sets it.", ge=1)
    share_prefix: bool | Literal["auto"] = opt(
        "auto", "Score a group's completions with its prompt (image tokens and vision tower "
        "included) run once per micro-batch, the completions attending to it, instead of once "
        "per completion (r1fit/models/prefix.py). 'auto': on when the first micro-batch's "
        "log-probs equal the per-row path's (within 1e-4; 0.05 in a 16-bit model; or 4x the "
        "per-row path's own rounding between batch shapes where that is larger, as in a bigger "
        "16-bit model; true for Qwen2-VL, Qwen2.5-VL and Qwen3-VL; not for a model with "
        "bidirectional image attention such as Gemma 3), else off, logged once with both "
        "numbers; "
        "`r1fit plan` plans 'auto' as the larger of the two paths.")
    logits_chunk: int | Literal["auto"] = opt(
        "auto", "Tokens per chunk of the LM head, whose float32 [chunk x vocab] logits are what "
        "it holds at a time (the full [tokens x vocab] logits never exist). 'auto': 256 where "
        "the head makes its gradient in its forward (memory.fused_loss), where a smaller chunk "
        "costs no extra matmul; 1024 where it recomputes in backward every chunk of a "
        "micro-batch but the last, where larger chunks save time.", ge=1)
    fused_loss: bool | Literal["auto"] = opt(
        "auto", "Compute the LM head's gradient in the forward pass of a GRPO update or SFT "
        "step, chunk by chunk, from the loss's per-token gradient (r1fit/algorithms/logprobs.py "
        "fused_head_loss): no chunk of logits is recomputed or kept for the backward, so a small "
        "memory.logits_chunk costs no extra matmul. GRPO needs a loss of per-token terms "
        "(algo.importance_sampling_level=token, algo.cov_restriction=none). 'auto': on where it "
        "applies (always for SFT), else the chunks are recomputed in backward; false: always "
        "recomputed.")
    budget: str = opt("", "Memory the run may use, e.g. '20GiB' (a number alone is bytes, at "
                      "least 1 MiB of them), enforced through the OOM guard "
                      "(which halves micro_batch/generation_batch and redoes the step) and taken by "
                      "the 'auto' sizes. CUDA: the caching allocator is capped at the budget less "
                      "768 MiB for the CUDA context (torch.cuda.set_per_process_memory_fraction). "
                      "CPU: a cap on the process's peak RSS over its RSS before the model loaded. "
                      "Empty: no cap (CUDA: the allocator raises when the device is full).")
    release_freed: bool | Literal["auto"] = opt(
        "auto", "Hand freed host memory blocks of 1 MiB and more back to the system at once "
        "(Linux with glibc: M_MMAP_THRESHOLD fixed at 1 MiB), so a CPU run's RSS follows its live "
        "tensors instead of keeping glibc's freed heap for reuse. Costs page faults (CPU steps "
        "about 20% slower here). 'auto': on for a CPU run with memory.budget (which caps RSS), "
        "else off. The environment variable MALLOC_MMAP_THRESHOLD_, when set, wins.")
    cpu_peak: Literal["rss", "tensors"] = opt(
        "rss", "What peak_memory_bytes measures on CPU: 'rss' (the process's peak resident "
        "memory; cheap) or 'tensors' (the peak bytes of live tensors through the torch profiler, "
        "the CPU counterpart of CUDA's max allocated and what `r1fit plan` predicts; slower).")
    fragmentation_warning_gib: float = opt(2.0, "Warn when the CUDA allocator holds more than this "
                                           "many GiB reserved but unallocated (0 = never).", ge=0)


@dataclass(frozen=True)
class VllmConfig:
    kv_cache_memory: int | None = opt(
        None, "Bytes of KV cache each engine keeps (vLLM's kv_cache_memory_bytes). null: "
        "gpu_memory_utilization on CUDA, 256 MiB on CPU. It must hold at least one sequence of "
        "data.max_prompt_tokens + algo.max_new_tokens tokens.", ge=1)
    gpu_memory_utilization: float = opt(
        0.3, "CUDA only, when kv_cache_memory is null: the fraction of the GPU the engine may use "
        "(its weights, activations and KV cache; the trainer has the rest).", gt=0, le=1)
    sleep_level: int = opt(
        1, "CUDA only: while the policy trains, the engine sleeps; 1 frees its KV cache and moves "
        "its weights to host RAM, 2 frees both (they are synced again before the next rollout "
        "anyway); 0 keeps both on the GPU. vLLM has no sleep mode on CPU, so there the engine "
        "keeps its memory.", ge=0, le=2)
    enforce_eager: bool | None = opt(
        None, "Run the engine without CUDA graphs / torch.compile. null: on CPU yes (compiling "
        "costs more than it saves on small runs), on CUDA no.")


@dataclass(frozen=True)
class StaticConfig:
    cuda_graphs: bool | None = opt(
        None, "Capture the decode step as CUDA graphs, one per batch-size bucket, replayed once "
        "per token. null: on CUDA yes; on CPU the step runs eagerly (no graphs there).")
    compile: bool | None = opt(
        None, "Run the decode step's forward through torch.compile before capturing it (fused "
        "kernels: fewer launches per layer): the first batch-size bucket compiles with static "
        "shapes, the next with a dynamic batch that the later buckets share (one more for a "
        "call of a single row, and one when the cache grows). Costs compile time at the "
        "first rollouts (62 s for Qwen2.5-VL-3B on an H200, which then decoded 1.6x as fast). "
        "null: on CUDA yes, on CPU no. Where the compile fails, generation goes on without it "
        "(logged).")
    sync_every: int = opt(
        16, "Decode steps between the host's looks at which rows have finished (the only host "
        "synchronisation of decoding): there generation stops when every row has, and the rows "
        "still running move into a smaller batch-size bucket.", ge=1)
    keep_cache: bool = opt(
        True, "With tools: keep each trajectory's KV cache across its turns and prefill only "
        "what a turn adds (the policy's last token and the tool turn), instead of prefilling the "
        "whole conversation every turn; a tool turn's images go through the vision tower with it, "
        "placed by the model's own position rule (Qwen-VL), or on Gemma 3, whose image tokens "
        "attend both ways, the turn is prefilled whole. Same tokens either way "
        "(tests/rollout/test_turns.py).")
    share_prompt: bool = opt(
        False, "Hold each prompt's KV cache once for its algo.num_generations rows instead of "
        "once per row, and attend to it and each row's own completion in two parts merged "
        "exactly (r1fit/rollout/shared_prompts.py): a smaller cache, and a decode step reads a "
        "group's prompt once. Single-turn rollouts and evaluation (a multi-turn call keeps each "
        "row's own cache), models without sliding-window layers (not Gemma 3; logged). Greedy "
        "tokens equal the plain layout's on the built-in Qwen models; sampled tokens can "
        "differ by rounding. Off until its decode speed is measured on a GPU (benchmarks/"
        "gpu_check.py's speed stage times it against the plain layout).")


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["auto", "hf", "static", "vllm"] = opt(
        "auto", "What generates the rollouts: 'hf' (Hugging Face generate on the policy itself; "
        "no extra install, any device), 'static' (r1fit's engine on the policy itself: a static "
        "KV cache, the decode step replayed as CUDA graphs on CUDA, LoRA merged for generation; "
        "one process; with tools each trajectory's cache is kept across its turns "
        "(rollout.static.keep_cache); "
        "r1fit/rollout/static_engine.py), 'vllm' (one in-process "
        "vLLM engine per training process, its weights synced from the policy before each "
        "rollout; pip install -e '.[vllm]'; Qwen2-VL, Qwen2.5-VL and Qwen3-VL models: Gemma 3 is "
        "refused, its weight sync fails), or 'auto': vllm where it is installed, the device is "
        "CUDA and the model is one of those, else static on CUDA (hf under torchrun or with "
        "flash attention), else hf; the run log says which and why. `r1fit sft` evaluates on "
        "static or hf, never vllm: auto and vllm take static where it runs (CUDA, one process), "
        "else hf.")
    share_prefill: bool | Literal["auto"] = opt(
        "auto", "rollout.engine=hf: prefill each distinct prompt of a generation batch once (its "
        "image tokens and vision tower included) and copy its KV cache to the rows that share "
        "it, instead of prefilling every row (r1fit/rollout/prefill.py). 'auto': on when a "
        "2-token greedy check on the run's first batch gives the per-row path's logits and "
        "cached keys (true for the built-in Qwen2.5-VL, Qwen2-VL, Qwen3-VL and Gemma 3 "
        "models), else off, logged once. vLLM shares prompts through its own prefix cache.")
    min_new_tokens: int = opt(
        0, "No rollout completion may end (its end-of-sequence tokens blocked) before this many "
        "tokens; evaluation is not affected. For benchmarks that need every completion to run to "
        "algo.max_new_tokens (random weights stop at random lengths). It changes what the policy "
        "samples, so leave it 0 for training (transformers' min_new_tokens, vLLM's min_tokens).",
        ge=0)
    max_turns: int = opt(
        4, "With tools: the most policy turns in one trajectory (each one generation of up to "
        "algo.max_new_tokens tokens; the last one's tool calls are not run).", ge=1)
    max_tool_calls: int = opt(
        3, "With tools: the most tool calls one trajectory may make, all its turns together; a "
        "call past it gets an error result.", ge=0)
    max_trajectory_tokens: int | None = opt(
        None, "With tools: the most tokens after the prompt in one trajectory, policy turns and "
        "tool results (image tokens included) together; a trajectory that reaches it ends. "
        "null: rollout.max_turns x algo.max_new_tokens.",
        ge=1)
    tool_timeout: float = opt(
        10.0, "With tools: seconds one tool call may run before its result is an error (the "
        "call's thread is abandoned, not killed: see docs/tools.md).", gt=0)
    tool_workers: int = opt(
        8, "With tools: the rows whose tool calls run at once after each turn, on threads (each "
        "row's calls in order). A turn's calls wait for the slowest; with one worker they run one "
        "after another. For tools that wait (a server, a sandbox); set 1 for a tool that is not "
        "safe to call from several threads, or that computes in Python (several share its GIL, "
        "and one near rollout.tool_timeout may pass it). The step's wall seconds of tool calls "
        "are logged as tools/seconds.", ge=1)
    vllm: VllmConfig = opt(VllmConfig(), "Settings of rollout.engine=vllm.")
    static: StaticConfig = opt(StaticConfig(), "Settings of rollout.engine=static.")


@dataclass(frozen=True)
class EvalConfig:
    every: int = opt(20, "Evaluate every N GRPO steps (0 = only before and after training).", ge=0)
    before_train: bool = opt(True, "Evaluate once before GRPO starts (after the SFT warm-up).")
    batch: int = opt(64, "Questions generated together during evaluation (greedy).", ge=1)
    samples: int = opt(1, "r1fit eval: answers per question. 1: the greedy answer (as the run's "
                       "own evaluations); k > 1: k answers sampled at algo.temperature and "
                       "algo.top_p, each with its own seed, scored as pass@k and mean@k.", ge=1)


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = opt(20, "Save a checkpoint every N steps and at the last step (0 = none; the "
                     "final model is saved either way).", ge=0)
    keep: int = opt(2, "Keep the newest N complete checkpoints (0 = all).", ge=0)
    keep_best_by: str = opt("", "Also keep the checkpoint with the best value of this metric "
                            "(e.g. 'eval/accuracy'; it must be in the saved step's metrics row).")
    keep_best_mode: Literal["max", "min"] = opt("max", "Whether keep_best_by is best when highest "
                                                "or lowest.")
    weights_only: bool = opt(False, "Save only the model (and the data position): smaller, but "
                             "resuming needs resume_weights_only=true and restarts the optimizer.")
    resume: str = opt("auto", "'auto': continue from the newest complete checkpoint in "
                      "output_dir; 'never': start fresh; or a checkpoint folder to continue from.")
    resume_weights_only: bool = opt(False, "Allow resuming from a weights-only checkpoint: "
                                    "continue from its step with a fresh optimizer and RNG.")
    allow_config_change: bool = opt(False, "Allow resuming with settings that change the "
                                    "trajectory (learning rate, algorithm, data...).")


@dataclass(frozen=True)
class ReportConfig:
    to: tuple[Literal["tensorboard", "wandb", "trackio", "mlflow"], ...] = opt(
        [], "Metric trackers that receive every metrics row besides metrics.jsonl (rank 0 only; "
        "each needs its extra: pip install -e '.[tensorboard]' and so on). Offline works: W&B "
        "with WANDB_MODE=offline, mlflow with a local SQLite store, trackio and TensorBoard "
        "locally.")
    project: str = opt("r1fit", "Project (W&B, trackio) or experiment (mlflow) name.")
    run_name: str | None = opt(None, "Run name in the trackers (null: the output folder's name; "
                               "trackio's adds 6 hex digits, one run per output folder).")
    samples_every: int = opt(0, "Every N GRPO steps, send a table of the step's completions (with "
                             "their images, rewards and advantages) to the trackers (0 = never).",
                             ge=0)
    rollouts_every: int = opt(10, "Every N GRPO steps, rank 0 saves its completions of the step "
                              "(prompt, completion, rewards, advantage, the prompt's images as "
                              "small PNGs) to <output_dir>/rollouts/ for the run report's "
                              "rollout browser (0 = never).", ge=0)
    every: int = opt(0, "Also rewrite <output_dir>/report.html every N steps (GRPO or SFT; 0 = "
                     "only at the end of training; `r1fit report RUN_DIR` writes it at any "
                     "time).", ge=0)
    profile_step: int = opt(
        0, "Profile GRPO step N with torch.profiler (CPU, and CUDA kernels on a GPU) and write "
        "<output_dir>/profile-step-N.txt: the operators and kernels by total time, and the "
        "phases (r1fit/generate, r1fit/score, r1fit/update) as rows of their own. The profiled "
        "step runs slower than the others (0 = off).", ge=0)


@dataclass(frozen=True)
class Config:
    preset: Literal["auto", "demo", "none"] = opt(
        "auto", "Values applied over the defaults and under the config file and overrides: "
        "'demo' (r1fit/presets/demo.yaml: the built-in demo's learning rates, 24-token "
        "completions, 60-step format warm-up, 112 px images), 'none', or 'auto': demo for a "
        "built-in random-weight model (model.path builtin:*), else none. `r1fit config` shows "
        "which values it gave.")
    model: ModelConfig = opt(ModelConfig(), "The policy model.")
    data: DataConfig = opt(DataConfig(), "Prompts and images.")
    algo: AlgoConfig = opt(AlgoConfig(), "GRPO settings.")
    rewards: dict[str, float] = opt({"accuracy": 1.0, "format": 0.5},
                                    "Reward name (accuracy, format, iou, iou_hit, or "
                                    "'module:function') -> weight of the weighted sum.")
    tools: tuple[str, ...] = opt(
        [], "Tools the policy may call in its answer (<tool_call> JSON, see docs/tools.md): "
        "built-in crop, zoom, or 'package.module:function'; empty: no tools, one completion per "
        "prompt. With tools GRPO rolls out multi-turn trajectories (budgets under rollout.) and "
        "trains on the policy's tokens only; crop and zoom need data.max_images >= 2.")
    train: TrainConfig = opt(TrainConfig(), "The optimisation loop.")
    sft: SFTConfig = opt(SFTConfig(), "Supervised fine-tuning (and the warm-up before GRPO).")
    memory: MemoryConfig = opt(MemoryConfig(), "What bounds peak memory.")
    rollout: RolloutConfig = opt(RolloutConfig(), "The engine that generates GRPO's rollouts.")
    eval: EvalConfig = opt(EvalConfig(), "Held-out evaluation.")
    checkpoint: CheckpointConfig = opt(CheckpointConfig(), "Checkpoints and resume.")
    report: ReportConfig = opt(ReportConfig(), "Metric trackers and the run report.")

    def value(self, key: str) -> Any:
        """The value of dotted key ``key``, e.g. ``cfg.value("memory.micro_batch")``."""
        value: Any = self
        for part in key.split("."):
            value = getattr(value, part)
        return value

    def applied_preset(self) -> str | None:
        """The preset this config's values were built on (``preset``, with 'auto' resolved), or
        None."""
        if self.preset == "auto":
            return "demo" if self.model.path.startswith("builtin:") else None
        return None if self.preset == "none" else self.preset

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (tuples as lists), as ``config.json`` records it."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def with_values(self, changes: dict[str, Any]) -> Config:
        """A new, validated config with dotted keys set, e.g. ``{"memory.micro_batch": 1}``
        (the same path as ``key=value`` overrides; this config is left as it is)."""
        cfg = changed(self, [(key.split("."), value) for key, value in changes.items()])
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raise :class:`ConfigError` (one line, naming the keys) for settings that contradict
        each other; :meth:`with_values` and every loaded config run it."""
        self.algo.check()
        if self.rollout.min_new_tokens > self.algo.max_new_tokens:
            raise ConfigError(f"rollout.min_new_tokens ({self.rollout.min_new_tokens}) must be <= "
                              f"algo.max_new_tokens ({self.algo.max_new_tokens})")
        if self.memory.fused_loss is True and not self.algo.per_token_loss():
            raise ConfigError("memory.fused_loss=true needs a loss of per-token terms: "
                              "algo.importance_sampling_level=token and algo.cov_restriction=none "
                              f"(now {self.algo.importance_sampling_level} and "
                              f"{self.algo.cov_restriction}); use memory.fused_loss=auto")
        if self.data.min_pixels > self.data.max_pixels:
            raise ConfigError(f"data.min_pixels ({self.data.min_pixels}) must be <= data.max_pixels "
                              f"({self.data.max_pixels})")
        if not self.rewards:
            raise ConfigError("rewards: at least one reward is needed, e.g. rewards.accuracy=1.0")
        for name, weight in self.rewards.items():
            if not math.isfinite(weight):
                raise ConfigError(f"rewards.{name}: got {weight!r}, expected a finite number")
        if self.memory.budget:
            try:
                parse_memory(self.memory.budget)
            except ValueError as exc:
                raise ConfigError(f"memory.budget: {exc}") from None
        if not self.checkpoint.resume.strip():
            raise ConfigError("checkpoint.resume: got an empty value, expected 'auto', 'never' or a "
                              "checkpoint folder")
        _check_device(self.train.device)
        _check_not_empty(self)
        _check_tools(self)
        doubled = sorted({name for name in self.report.to if self.report.to.count(name) > 1})
        if doubled:  # each would log every point twice (or fail, for W&B's second run)
            raise ConfigError(f"report.to: {doubled} named more than once")
        _check_shapes(self)

    def fuses_loss(self, sft: bool = False) -> bool:
        """Whether GRPO updates (``sft``: SFT steps, whose cross-entropy is always a sum of
        per-token terms) make the LM head's gradient in its forward pass
        (``memory.fused_loss``; 'auto' and true, which validation allows only where it applies,
        are on for a loss of per-token terms)."""
        return self.memory.fused_loss is not False and (sft or self.algo.per_token_loss())

    def head_chunk(self, sft: bool = False) -> int:
        """Tokens per chunk of the LM head (``memory.logits_chunk``, with 'auto' resolved for
        GRPO, or with ``sft`` for SFT)."""
        chunk = self.memory.logits_chunk
        if chunk != "auto":
            return int(chunk)
        return FUSED_HEAD_CHUNK if self.fuses_loss(sft) else RECOMPUTED_HEAD_CHUNK

    def split_batches(self, kind: str) -> list[tuple[int, str]]:
        """The batches a run of ``kind`` ('grpo' or 'sft') splits over its processes, each
        ``(rows, what)``; each must split evenly (every rank runs the same passes)."""
        if kind != "grpo":
            return [(self.sft.batch_size, "sft.batch_size")]
        batches = [(self.train.prompts_per_step * self.algo.num_generations,
                    "train.prompts_per_step x algo.num_generations")]
        if self.sft.format_warmup_steps:
            batches.append((self.sft.batch_size, "sft.batch_size (the format warm-up)"))
        return batches

    def split_problems(self, kind: str, size: int) -> list[str]:
        """Why each of :meth:`split_batches` that does not split evenly over ``size`` processes
        cannot run (the run refuses it at start, ``r1fit plan --gpus`` names it)."""
        return [problem for n, what in self.split_batches(kind)
                if (problem := uneven_split(n, f"rows ({what})", size))]

    def fingerprint(self) -> str:
        """A short hash of the resolved config, for run identity."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def uneven_split(n: int, what: str, size: int) -> str | None:
    """Why ``n`` ``what`` cannot be shared over ``size`` processes, or None when they split
    evenly (every rank must run the same number of forward and backward passes)."""
    if n % size == 0:
        return None
    return f"{n} {what} do not split evenly over {size} processes; make it a multiple of {size}"


def _check_not_empty(cfg: Config) -> None:
    """Values that must name something: an empty one was taken for nothing, unsaid."""
    methods = cfg.data.reward_method
    if not methods or (not isinstance(methods, str) and not all(methods)):
        # every row would be bad, blamed on the rows
        raise ConfigError(f"data.reward_method: got {methods!r}, expected a method name (or one "
                          "per data.train source)")
    train = cfg.data.train
    sources = [train] if isinstance(train, str) else list(train)
    if not sources or not all(str(source).strip() for source in sources):
        # each read as a source named '' (datasets' error about a dataset name), late
        raise ConfigError(f"data.train: got {train!r}, expected a data file, folder, hub dataset "
                          "or builtin:shapes (or a list of them)")
    if not cfg.model.path.strip():  # found only after the data had been read
        raise ConfigError("model.path: got an empty value, expected a model folder, hub id or "
                          "builtin: model")
    methods = cfg.data.eval_reward_method
    if methods is not None and (not methods or (not isinstance(methods, str) and not all(methods))):
        raise ConfigError(f"data.eval_reward_method: got {methods!r}, expected a method name (or "
                          "one per data.eval source), or null")
    if not cfg.train.output_dir.strip():  # "" would write the run into the current folder
        raise ConfigError("train.output_dir: got an empty value, expected a folder")


def _check_device(name: str) -> None:
    """``train.device``: 'auto', 'cpu', 'cuda' or 'cuda:N' (whether this machine has it is the
    run's to say: a plan may be made elsewhere)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ConfigError(f"train.device: got {name!r}, expected 'auto', 'cpu', 'cuda' or "
                          "'cuda:N' (r1fit runs on CPUs and CUDA GPUs)")


def _check_shapes(cfg: Config) -> None:
    """``data.shapes``, the built-in task's settings."""
    shapes = cfg.data.shapes
    bad = [k for k in shapes.kinds if k not in ("color", "count", "position", "box", "zoom")]
    if bad or not shapes.kinds:
        raise ConfigError(f"data.shapes.kinds: got {list(shapes.kinds)!r}, expected a non-empty "
                          "list of color, count, position, box, zoom")
    if "box" in shapes.kinds and not (cfg.data.min_pixels <= shapes.image_size ** 2
                                      <= cfg.data.max_pixels):
        # a resized image would put the shapes elsewhere than the boxes the answers are scored by
        raise ConfigError(f"data.shapes.image_size: {shapes.image_size} px squared is outside "
                          f"data.min_pixels..max_pixels ({cfg.data.min_pixels}..{cfg.data.max_pixels}"
                          "): box answers are pixels of the image as drawn, which must not be "
                          "resized")


def _check_tools(cfg: Config) -> None:
    """``tools`` and the budgets of a multi-turn rollout, and what multi-turn rollouts do not
    run with yet."""
    rollout = cfg.rollout
    if rollout.max_trajectory_tokens is not None and \
            rollout.max_trajectory_tokens < cfg.algo.max_new_tokens:
        raise ConfigError(f"rollout.max_trajectory_tokens ({rollout.max_trajectory_tokens}) must "
                          f"be >= algo.max_new_tokens ({cfg.algo.max_new_tokens}), the first "
                          "turn's own allowance")
    if not cfg.tools:
        return
    bad = [name for name in cfg.tools if not name.strip() or name.strip() != name]
    if bad:
        raise ConfigError(f"tools: got {bad!r}, expected built-in tool names (crop, zoom) or "
                          "'package.module:function' without spaces")
    doubled = sorted({name for name in cfg.tools if cfg.tools.count(name) > 1})
    if doubled:
        raise ConfigError(f"tools: {doubled} named more than once")
    if rollout.max_turns < 2:
        raise ConfigError(f"rollout.max_turns: got {rollout.max_turns}, expected >= 2 with tools "
                          "(a tool's result is read in the turn after the call)")
    if rollout.max_tool_calls < 1:
        raise ConfigError("rollout.max_tool_calls: got 0 with tools set; set it >= 1 or remove "
                          "tools")
    image_tools = sorted({"crop", "zoom"} & set(cfg.tools))
    if image_tools and cfg.data.max_images < 2:
        raise ConfigError(f"data.max_images={cfg.data.max_images}: tools {image_tools} return "
                          "images, and a trajectory's images (the row's and the tools' together) "
                          "must fit in it; set data.max_images >= 2")
    if cfg.algo.overlong_buffer:
        raise ConfigError("algo.overlong_buffer: DAPO's overlong shaping measures one completion "
                          "against algo.max_new_tokens, not a trajectory of several turns; set it "
                          "to 0 with tools")
