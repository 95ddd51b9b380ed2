"""Validation of a whole config: overrides applied in order, then the settings checked against each
other (each contradiction one line naming the keys)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from r1fit.config.values import ConfigError, apply, nest
from r1fit.units import parse_bytes

if TYPE_CHECKING:
    from r1fit.config.schema import Config


def check_consistency(cfg: Config) -> None:
    cfg.algo.check()
    if cfg.rollout.min_new_tokens > cfg.algo.max_new_tokens:
        raise ConfigError(f"rollout.min_new_tokens ({cfg.rollout.min_new_tokens}) must be <= "
                          f"algo.max_new_tokens ({cfg.algo.max_new_tokens})")
    if cfg.memory.fused_loss is True and not cfg.algo.per_token_loss():
        raise ConfigError("memory.fused_loss=true needs a loss of per-token terms: "
                          "algo.importance_sampling_level=token and algo.cov_restriction=none "
                          f"(now {cfg.algo.importance_sampling_level} and "
                          f"{cfg.algo.cov_restriction}); use memory.fused_loss=auto")
    if cfg.data.min_pixels > cfg.data.max_pixels:
        raise ConfigError(f"data.min_pixels ({cfg.data.min_pixels}) must be <= data.max_pixels "
                          f"({cfg.data.max_pixels})")
    if not cfg.rewards:
        raise ConfigError("rewards: at least one reward is needed, e.g. rewards.accuracy=1.0")
    for name, weight in cfg.rewards.items():
        if not math.isfinite(weight):
            raise ConfigError(f"rewards.{name}: got {weight!r}, expected a finite number")
    if cfg.memory.budget:
        try:
            parse_bytes(cfg.memory.budget)
        except ValueError as exc:
            raise ConfigError(f"memory.budget: {exc}") from None
    if not cfg.checkpoint.resume.strip():
        raise ConfigError("checkpoint.resume: got an empty value, expected 'auto', 'never' or a "
                          "checkpoint folder")
    _check_tools(cfg)
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


def changed(cfg: Config, changes: list[tuple[list[str], Any]]) -> Config:
    """``cfg`` with each (dotted path, value) applied in order (each value checked, the whole
    not)."""
    for keys, value in changes:
        if keys[0] == "rewards" and len(keys) > 1:
            # a reward name may contain dots ('pkg.mod:fn'): everything after 'rewards.' is the name
            cfg = apply(cfg, {"rewards": {**cfg.rewards, ".".join(keys[1:]): value}}, "")
            continue
        cfg = apply(cfg, nest(keys, value), "")
    return cfg


def validated(cfg: Config, changes: list[tuple[list[str], Any]]) -> Config:
    """``cfg`` with each (dotted path, value) applied in order, then checked as a whole."""
    cfg = changed(cfg, changes)
    check_consistency(cfg)
    return cfg
