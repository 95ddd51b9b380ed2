"""One entry point for prompt data (``load_dataset``) and the resumable index stream (``PromptSampler``).

A ``PromptDataset`` wraps a source (data files and datasets, or a built-in task) and applies the pixel budget to
every image it returns, so the rest of the code never sees an image outside ``[min_pixels,
max_pixels]``. ``PromptSampler`` decides which prompts come next and is saved in checkpoints, so a
resumed run sees exactly the prompts an uninterrupted run would have seen.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.images import as_rgb, check_pixel_budget, fit_pixel_budget
from r1fit.data.rows import FormatOptions
from r1fit.data.sample import Sample
from r1fit.data.shapes import SPLITS, ShapesSource, ShapesSpec
from r1fit.data.source import RowSource, TableSpec

BUILTIN_PREFIX = "builtin:"
BUILTINS = ("shapes",)
# Default number of items of a built-in task per split.
DEFAULT_SIZES = {"train": 5000, "eval": 200}


class _Source(Protocol):
    """What a data source provides to ``PromptDataset``."""

    name: str
    total_rows: int
    bad_rows: int
    skipped: list[str]  # "<where>: <reason>" of each row skipped at load time

    def __len__(self) -> int: ...

    def sample(self, index: int) -> Sample: ...


class PromptDataset(Sequence[Sample]):
    """A sequence of ``Sample`` with images fitted to the pixel budget.

    Attributes:
        name: the sources as given, or ``"builtin:shapes/<split>"``.
        total_rows: rows read from the source (for a built-in task: its size).
        bad_rows: rows skipped at load time. Rows whose images fail only when decoded are not counted
            here: ``__getitem__`` raises ``BadRowError`` for them and ``fetch`` reports them.
        skipped: ``"<where>: <reason>"`` of each row skipped at load time.
        keep_source_images: whether each returned sample also carries its images at the source's
            resolution (``Sample.source_images``, for tools); only the samples fetched hold them.
    """

    def __init__(self, source: _Source, *, min_pixels: int, max_pixels: int,
                 keep_source_images: bool = False) -> None:
        """Wrap ``source``; ``min_pixels``/``max_pixels`` bound ``w*h`` of every returned image."""
        check_pixel_budget(min_pixels, max_pixels)
        self.keep_source_images = keep_source_images
        self.source = source
        self.name = source.name
        self.total_rows = source.total_rows
        self.bad_rows = source.bad_rows
        self.skipped = list(source.skipped)
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        """Number of usable samples."""
        return len(self.source)

    def __getitem__(self, index: int) -> Sample:  # type: ignore[override]  # no slices
        """Sample ``index`` with budgeted RGB images (and the source's, when kept); ``BadRowError``
        if an image fails to decode."""
        if not isinstance(index, int | np.integer):
            raise TypeError(f"PromptDataset indices must be integers, got {type(index).__name__}")
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {self.name} ({n} samples)")
        sample = self.source.sample(int(index) % n)
        try:
            source = [as_rgb(img) for img in sample.images]
            sample.images = [fit_pixel_budget(img, self.min_pixels, self.max_pixels) for img in source]
        except BadRowError as exc:
            raise BadRowError(f"{sample.source}: {exc}") from exc
        if self.keep_source_images:  # an image within the budget is one object in both lists
            sample.source_images = tuple(source)
        return sample

    def __iter__(self) -> Iterator[Sample]:
        """Iterate over all samples in order (raises on the first undecodable one)."""
        for i in range(len(self)):
            yield self[i]

    def fetch(self, indices: Sequence[int]) -> tuple[list[Sample], list[str]]:
        """Samples at ``indices`` (in order), skipping undecodable ones.

        Returns ``(samples, errors)``: the good samples and one ``"<file>:<line>: <reason>"`` message
        per skipped index, for the caller to log and count.
        """
        each = self.fetch_each(indices)
        return ([x for x in each if isinstance(x, Sample)],
                [x for x in each if not isinstance(x, Sample)])

    def fetch_each(self, indices: Sequence[int]) -> list[Sample | str]:
        """Per index (in order), its sample or why it was skipped (``fetch``'s message)."""
        out: list[Sample | str] = []
        for index in indices:
            try:
                out.append(self[index])
            except BadRowError as exc:
                out.append(str(exc))
        return out

    def __repr__(self) -> str:
        """Name and counts, e.g. for logs."""
        return f"PromptDataset({self.name!r}, {len(self)} samples, {self.bad_rows} of {self.total_rows} rows bad)"


def load_dataset(
    spec: str | os.PathLike[str] | Sequence[str],
    *,
    split: str,
    min_pixels: int,
    max_pixels: int,
    max_images: int,
    max_bad_fraction: float,
    seed: int,
    size: int | None = None,
    shapes: ShapesSpec | None = None,
    options: FormatOptions | None = None,
    image_folders: Sequence[str] = (),
    reward_methods: Sequence[str] = ("default",),
    check_method: Callable[[str], None] | None = None,
    keep_source_images: bool = False,
) -> PromptDataset:
    """Open data sources or a built-in task as a ``PromptDataset``.

    Args:
        spec: ``"builtin:shapes"``, or one source or a list of them (JSONL, JSON list, parquet,
            a ``save_to_disk`` folder, a hub id; see :mod:`r1fit.data.tables`), concatenated.
        split: ``"train"`` or ``"eval"``. Selects the built-in split, and the split a dataset with
            several takes by default (``train`` / ``test``).
        min_pixels, max_pixels: pixel budget of every returned image.
        max_images: rows with more images are bad rows.
        max_bad_fraction: ``DataError`` when more than this fraction of rows is bad.
        seed: built-in tasks draw their items from it (ignored for files).
        size: number of items; built-in default 5000 (train) / 200 (eval); for files, use only the
            first ``size`` good rows (default: all).
        shapes: parameters of ``builtin:shapes`` (default ``ShapesSpec()``).
        options: the row format (default: detected).
        image_folders: none, one for every source, or one per source.
        reward_methods: one accuracy method for every source, or one per source.
        check_method: raises ``ValueError`` for an accuracy method that cannot score (its rows
            are then bad).
        keep_source_images: each sample also carries its images at the source's resolution
            (``Sample.source_images``): for a run with tools, which cut them.
    """
    if split not in SPLITS:
        raise DataError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if size is not None and (not isinstance(size, int) or size < 1):
        raise DataError(f"dataset size must be a positive integer, got {size!r}")
    check_pixel_budget(min_pixels, max_pixels)

    specs = [os.fspath(spec)] if isinstance(spec, str | os.PathLike) else list(spec)
    source: _Source
    if len(specs) == 1 and specs[0].startswith(BUILTIN_PREFIX):
        text = specs[0]
        task = text[len(BUILTIN_PREFIX):]
        if task not in BUILTINS:
            raise DataError(f"unknown built-in dataset {text!r}; available: {[BUILTIN_PREFIX + b for b in BUILTINS]}")
        if max_images < 1:
            raise DataError(f"{text} has one image per item but max_images={max_images}")
        source = ShapesSource(
            shapes if shapes is not None else ShapesSpec(),
            split=split, size=size if size is not None else DEFAULT_SIZES[split], seed=seed,
        )
    else:
        if any(s.startswith(BUILTIN_PREFIX) for s in specs):
            raise DataError(f"a built-in task cannot be mixed with other sources: {specs}")
        folders = _per_source(list(image_folders), specs, "image folders")
        methods = _per_source(list(reward_methods), specs, "reward methods")
        tables = [TableSpec(s, f, m) for s, f, m in zip(specs, folders, methods, strict=True)]
        source = RowSource(tables, options=options or FormatOptions(), max_images=max_images,
                           max_bad_fraction=max_bad_fraction, size=size,
                           default_split="train" if split == "train" else "test",
                           check_method=check_method)
    return PromptDataset(source, min_pixels=min_pixels, max_pixels=max_pixels,
                         keep_source_images=keep_source_images)


def _per_source(values: list[Any], specs: list[str], what: str) -> list[Any]:
    """``values`` spread over the sources: none (each None), one (for all) or one per source."""
    if not values:
        return [None] * len(specs)
    if len(values) == 1:
        return values * len(specs)
    if len(values) != len(specs):
        raise DataError(f"{len(values)} {what} for {len(specs)} sources: give one, or one per "
                        "source")
    return values


class PromptSampler:
    """Endless, deterministic stream of dataset indices, resumable mid-epoch.

    Each epoch is a permutation of ``range(num_items)`` drawn from ``(seed, epoch)`` alone, so the
    stream is a pure function of the seed and a resumed sampler only needs ``(epoch, position)``.
    Batches run across epoch boundaries: ``next_batch`` never returns short.
    """

    def __init__(self, num_items: int, *, seed: int) -> None:
        """Stream over ``range(num_items)`` seeded by ``seed``."""
        if not isinstance(num_items, int) or num_items < 1:
            raise ValueError(f"PromptSampler needs num_items >= 1, got {num_items!r}")
        self.num_items = num_items
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    def _permutation(self) -> np.ndarray:
        """The current epoch's order (cached; recomputed when the epoch changes)."""
        if self._order is None:
            # SeedSequence mixes both numbers; masking maps negative seeds to valid entropy.
            rng = np.random.default_rng([self.seed & 0xFFFF_FFFF_FFFF_FFFF, self.epoch])
            self._order = rng.permutation(self.num_items)
        return self._order

    def next_batch(self, k: int) -> list[int]:
        """The next ``k`` indices of the stream (continuing into the next epoch when needed)."""
        if k < 0:
            raise ValueError(f"batch size must be >= 0, got {k}")
        out: list[int] = []
        while len(out) < k:
            order = self._permutation()
            take = min(k - len(out), self.num_items - self.position)
            out.extend(int(i) for i in order[self.position:self.position + take])
            self.position += take
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = None
        return out

    def progress(self) -> dict[str, Any]:
        """What ``trainer_state.json`` records of the data position."""
        return {"consumed_prompts": self.epoch * self.num_items + self.position,
                "epoch": self.epoch, "sampler": self.state_dict()}

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "num_items"}``: everything needed to continue the stream."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": self.num_items}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream saved in ``state`` (its seed wins over the constructor's).

        Raises ``ValueError`` if ``state`` was saved for a dataset of a different size, because the
        permutations, and so the remaining prompts, would silently differ.
        """
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing {sorted(missing)}")
        saved_items = state.get("num_items", self.num_items)
        if saved_items != self.num_items:
            raise ValueError(
                f"sampler state was saved for a dataset of {saved_items} items, this one has {self.num_items}"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_items:
            raise ValueError(f"sampler state has invalid epoch={epoch} / position={position}")
        self.seed, self.epoch, self.position = int(state["seed"]), epoch, position
        self._order = None
