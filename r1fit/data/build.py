"""The run's datasets from the config, and the counted skipping of rows found bad while training."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from r1fit.config import Config
from r1fit.data.batch import Prompt, TooLong
from r1fit.data.dataset import PromptDataset, PromptSampler, load_dataset
from r1fit.data.errors import DataError
from r1fit.data.rows import FormatOptions
from r1fit.data.sample import Sample
from r1fit.data.shapes import ShapesSpec
from r1fit.processes import all_gather_objects, world
from r1fit.rewards.methods import check_method

log = logging.getLogger("r1fit")


def _as_list(value: str | tuple[str, ...] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def build_datasets(cfg: Config) -> tuple[PromptDataset, PromptDataset | None]:
    """``data.train`` and ``data.eval`` (None when unset) as configured; with tools
    (``tools`` not empty) their samples carry their source-resolution images too."""
    d = cfg.data
    common, methods = _common(cfg)
    train_sources = _as_list(d.train)
    # data.shapes.train_size sizes the built-in task only: a file's rows are all used
    builtin = len(train_sources) == 1 and train_sources[0].startswith("builtin:")
    train = load_dataset(train_sources, split="train",
                         size=d.shapes.train_size if builtin else None,
                         image_folders=_as_list(d.image_folder), reward_methods=methods, **common)
    evalset = _eval_set(cfg, common, methods) if d.eval else None
    log.info("data: %d training rows (%d bad, skipped), %s", len(train), train.bad_rows,
             f"{len(evalset)} eval rows ({evalset.bad_rows} bad)" if evalset else "no eval set")
    return train, evalset


def build_eval_set(cfg: Config) -> PromptDataset:
    """``data.eval`` alone (``r1fit eval``: the training data is not read); it must be set."""
    if not cfg.data.eval:
        raise DataError("data.eval is null: set data.eval to the held-out rows to score")
    evalset = _eval_set(cfg, *_common(cfg))
    log.info("data: %d eval rows (%d bad, skipped)", len(evalset), evalset.bad_rows)
    return evalset


def _common(cfg: Config) -> tuple[dict[str, Any], list[str]]:
    """The keywords of ``load_dataset`` that the training and eval sets share, and the accuracy
    methods ``data.reward_method`` names (checked)."""
    d = cfg.data
    shapes = ShapesSpec(image_size=d.shapes.image_size, kinds=list(d.shapes.kinds),
                        max_distractors=d.shapes.max_distractors, zoom_hint=d.shapes.zoom_hint,
                        zoom_cells=d.shapes.zoom_cells)
    options = FormatOptions(kind=d.format, problem_key=d.problem_key, answer_key=d.answer_key,
                            image_key=d.image_key, conversations_key=d.conversations_key,
                            reward_method_key=d.reward_method_key, focus_key=d.focus_key)
    methods = _as_list(d.reward_method)
    for key, given in (("data.reward_method", methods),
                       ("data.eval_reward_method", _as_list(d.eval_reward_method))):
        for method in given:  # a misspelt method in the config is its error, not a row's
            try:
                check_method(method)
            except ValueError as exc:
                raise DataError(f"{key}: {exc}") from None
    common: dict[str, Any] = dict(min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                                  max_images=d.max_images, max_bad_fraction=d.max_bad_fraction,
                                  seed=cfg.train.seed, shapes=shapes, options=options,
                                  check_method=check_method,
                                  # tools cut the images at their source resolution
                                  keep_source_images=bool(cfg.tools))
    return common, methods


def _eval_set(cfg: Config, common: dict[str, Any], methods: list[str]) -> PromptDataset:
    d = cfg.data
    sources = _as_list(d.eval)
    return load_dataset(sources, split="eval", size=d.eval_size,
                        image_folders=_as_list(d.eval_image_folder),
                        reward_methods=eval_methods(cfg, sources, methods), **common)


def eval_methods(cfg: Config, sources: list[str], methods: list[str]) -> list[str]:
    """The accuracy method of each ``data.eval`` source's rows that name none:
    ``data.eval_reward_method`` where set; else, with one method per training source, an eval
    source that is also a training source takes that source's (VLM-R1's eval files are its
    training files' held-out rows, scored alike), any other 'default' (said); else the one
    method given for all."""
    given = _as_list(cfg.data.eval_reward_method)
    if given:
        return given
    if len(methods) <= 1:
        return methods
    train = _as_list(cfg.data.train)
    by_source = dict(zip(train, methods, strict=False))
    chosen = [by_source.get(source, "default") for source in sources]
    others = [source for source in sources if source not in by_source]
    if others:
        log.info("data.eval: %s %s no data.train source, so %s rows that name no method are "
                 "scored by 'default' (data.eval_reward_method sets a method per eval source)",
                 ", ".join(others), "is" if len(others) == 1 else "are",
                 "its" if len(others) == 1 else "their")
    return chosen


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
        skipped: list[str] = []
        tries = 0
        while len(good) < k:
            if tries == FETCH_TRIES:
                raise DataError(f"{dataset.name}: could not fetch {k} good rows in {FETCH_TRIES} "
                                f"tries; {why_no_good_rows(skipped)}")
            tries += 1
            each = dataset.fetch_each(sampler.next_batch(k - len(good)))
            errors = [x for x in each if isinstance(x, str)]  # why a row was skipped
            places = [i for i, x in enumerate(each) if not isinstance(x, str)]
            samples = [each[i] for i in places]
            prompts, refused = encode(samples)
            for message in errors + refused:
                self.skip(message)
            skipped += errors + refused
            good.extend(self._agreed(prompts, places, samples))
        return good

    def _agreed(self, prompts: list[Prompt], places: list[int], samples: list[Sample]
                ) -> list[Prompt]:
        """Over several processes, the prompts every process kept (each reads the rows itself:
        a row whose image one node cannot decode would otherwise leave the ranks training on
        different rows, the sampler one row apart); the others' skips are counted here too, so
        every rank's count is the same. ``places``: each sample's place in the draw."""
        if not world().distributed:
            return prompts
        place = {id(sample): at for sample, at in zip(samples, places, strict=True)}
        kept = [place[id(prompt.sample)] for prompt in prompts]
        everyone = all_gather_objects(kept)
        common = set(kept).intersection(*everyone)
        for prompt, at in zip(prompts, kept, strict=True):
            if at not in common:
                ranks = [r for r, theirs in enumerate(everyone) if at not in theirs]
                self.skip(f"{prompt.sample.source}: bad on rank {', '.join(map(str, ranks))} "
                          "(its warning says why)")
        return [p for p, at in zip(prompts, kept, strict=True) if at in common]


#: Batches of rows :meth:`BadRowCounter.fetch` draws before it gives up on the data.
FETCH_TRIES = 100


def why_no_good_rows(skipped: list[str]) -> str:
    """Why the rows drawn in vain were refused, for the end of the one-line error: for prompts
    too long (:class:`TooLong`) their lengths and the key to raise; the count of each cause when
    there are several."""
    too_long = [m for m in skipped if isinstance(m, TooLong)]
    other = [m for m in skipped if not isinstance(m, TooLong)]
    if not too_long:
        return "the data is mostly bad"
    shortest, longest = min(m.length for m in too_long), max(m.length for m in too_long)
    limit = too_long[0].limit
    lengths = f"{shortest} tokens" if shortest == longest else f"{shortest} to {longest} tokens"
    if not other:
        return (f"all {len(too_long)} rows drawn have a prompt longer than "
                f"data.max_prompt_tokens={limit} ({lengths}): raise data.max_prompt_tokens to at "
                f"least {longest} (within the model's context) or shorten the prompts (a lower "
                "data.max_pixels gives an image fewer tokens)")
    return (f"of the {len(skipped)} rows drawn, {len(too_long)} have a prompt longer than "
            f"data.max_prompt_tokens={limit} ({lengths}: raise it to at least {longest} to keep "
            f"them) and {len(other)} are bad otherwise (e.g. {other[0]})")
