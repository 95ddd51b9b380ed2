"""The run's datasets from the config, and the counted skipping of rows found bad while training."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from r1fit.config import Config
from r1fit.data.batch import Prompt
from r1fit.data.dataset import PromptDataset, PromptSampler, load_dataset
from r1fit.data.errors import DataError
from r1fit.data.rows import FormatOptions
from r1fit.data.sample import Sample
from r1fit.data.shapes import ShapesSpec
from r1fit.rewards.methods import check_method

log = logging.getLogger("r1fit")


def _as_list(value: str | tuple[str, ...] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def build_datasets(cfg: Config) -> tuple[PromptDataset, PromptDataset | None]:
    """``data.train`` and ``data.eval`` (None when unset) as configured."""
    d = cfg.data
    shapes = ShapesSpec(image_size=d.shapes.image_size, kinds=list(d.shapes.kinds),
                        max_distractors=d.shapes.max_distractors)
    options = FormatOptions(kind=d.format, problem_key=d.problem_key, answer_key=d.answer_key,
                            image_key=d.image_key, conversations_key=d.conversations_key,
                            reward_method_key=d.reward_method_key)
    methods = _as_list(d.reward_method)
    for method in methods:  # a misspelt method in the config is the config's error, not a row's
        try:
            check_method(method)
        except ValueError as exc:
            raise DataError(f"data.reward_method: {exc}") from None
    common: dict[str, Any] = dict(min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                                  max_images=d.max_images, max_bad_fraction=d.max_bad_fraction,
                                  seed=cfg.train.seed, shapes=shapes, options=options,
                                  check_method=check_method)
    train_sources = _as_list(d.train)
    # data.shapes.train_size sizes the built-in task only: a file's rows are all used
    builtin = len(train_sources) == 1 and train_sources[0].startswith("builtin:")
    train = load_dataset(train_sources, split="train",
                         size=d.shapes.train_size if builtin else None,
                         image_folders=_as_list(d.image_folder), reward_methods=methods, **common)
    evalset = None
    if d.eval:
        # per-source methods belong to the training sources; eval rows name their own or
        # take the one method given for all
        evalset = load_dataset(_as_list(d.eval), split="eval", size=d.eval_size,
                               image_folders=_as_list(d.eval_image_folder),
                               reward_methods=methods if len(methods) == 1 else ["default"],
                               **common)
    log.info("data: %d training rows (%d bad, skipped), %s", len(train), train.bad_rows,
             f"{len(evalset)} eval rows ({evalset.bad_rows} bad)" if evalset else "no eval set")
    return train, evalset


class BadRowCounter:
    """Counts rows skipped while training (corrupt images found on decode, prompts too long)."""

    def __init__(self, start: int = 0) -> None:
        self.count = start

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = int(state["count"])

    def skip(self, message: str) -> None:
        """Count one bad row; ``message`` names it (``file:line: reason``)."""
        self.count += 1
        log.warning("skipping %s", message)

    def fetch(self, dataset: PromptDataset, sampler: PromptSampler, k: int,
              encode: Callable[[list[Sample]], tuple[list[Prompt], list[str]]]) -> list[Prompt]:
        """``k`` good prompts from the sampler's stream, skipping (and counting) bad rows: rows
        whose image fails to decode, and those ``encode`` refuses (a prompt too long)."""
        good: list[Prompt] = []
        attempts = 0
        while len(good) < k:
            samples, errors = dataset.fetch(sampler.next_batch(k - len(good)))
            prompts, refused = encode(samples)
            good.extend(prompts)
            for message in errors + refused:
                self.skip(message)
            attempts += 1
            if attempts > 100:
                raise DataError(f"{dataset.name}: could not fetch {k} good rows in 100 tries; "
                                "the data is mostly bad")
        return good
