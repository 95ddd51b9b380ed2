"""Validated rows of one or more tables (``data.train`` / ``data.eval``), as ``Sample`` objects.

Every row is checked when the source opens (its format, its fields, that each image exists and
passes ``Image.verify()``, that its accuracy method is known), so the counts of good and bad rows
are known before training starts; bad rows are skipped, counted and named (``file:line: reason``).
Pixels are decoded later, one sample at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.images import load_image, verify_image
from r1fit.data.rows import (
    FormatOptions,
    Row,
    RowFormat,
    detect_format,
    focus_fractions,
    parse_row,
)
from r1fit.data.sample import Sample
from r1fit.data.tables import Table, open_table
from r1fit.progress import progress_bar

logger = logging.getLogger("r1fit.data")

# A file with many bad rows would otherwise print one warning per row; after this many the rest
# are summarised in one line (their count is still exact).
MAX_ROW_WARNINGS = 20
# tables at least this long show a progress bar while their rows are checked
PROGRESS_ROWS = 5000


@dataclass(frozen=True)
class TableSpec:
    """One table of a source and what applies to its rows."""

    spec: str
    image_folder: str | None = None  # None: the table's own folder
    reward_method: str = "default"


@dataclass(frozen=True)
class GoodRow:
    """A row that passed the checks: its table, its index there and its text."""

    table: int
    index: int
    row: Row  # without its images when they are embedded in the table
    embedded: bool = False


def _once(results: dict[Any, str | None], key: Any, check: Callable[[], None]) -> None:
    """``check()`` once per ``key``; its error (a ``ValueError``) is kept and raised again as a
    ``BadRowError`` for every later row with the same key."""
    if key not in results:
        try:
            check()
            results[key] = None
        except ValueError as exc:  # BadRowError is one too
            results[key] = str(exc)
    if results[key] is not None:
        raise BadRowError(results[key])


class RowSource:
    """The good rows of ``tables`` in order; ``sample(i)`` decodes the images of the i-th.

    Attributes:
        name: the sources as given, used in messages.
        rows: the good rows.
        total_rows: rows read (blank JSONL lines are not rows).
        bad_rows: rows skipped as bad.
        first_error: ``"<where>: <reason>"`` of the first bad row, or ``None``.
        skipped: ``"<where>: <reason>"`` of every bad row, in order.
        formats: the format found for each table.
    """

    def __init__(self, tables: Sequence[TableSpec], *, options: FormatOptions, max_images: int,
                 max_bad_fraction: float, size: int | None = None, default_split: str = "train",
                 check_method: Callable[[str], None] | None = None) -> None:
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise DataError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        if max_images < 0:
            raise DataError(f"max_images must be >= 0, got {max_images}")
        if size is not None and size < 1:
            raise DataError(f"size must be >= 1, got {size}")
        if not tables:
            raise DataError("no data source given")
        self.name = ", ".join(t.spec for t in tables)
        self.tables: list[Table] = []
        self.formats: list[RowFormat] = []
        self.rows: list[GoodRow] = []
        self.total_rows = self.bad_rows = 0
        self.first_error: str | None = None
        self.skipped: list[str] = []
        self.bad_focus: set[str] = set()  # rows whose focus box left their image (warned once)
        self._max_images = max_images
        self._folders: list[Path | None] = []
        self._methods: list[str] = []
        checked_methods: dict[str, str | None] = {}
        for spec in tables:
            table = open_table(spec.spec, default_split=default_split)
            folder = Path(spec.image_folder).expanduser() if spec.image_folder else table.folder
            self.tables.append(table)
            self._folders.append(folder)
            self._methods.append(spec.reward_method)
            fmt, good, pictured = self._read(table, len(self.tables) - 1, options, size,
                                             checked_methods, check_method)
            self.formats.append(fmt)
            logger.info("data: %s: %s; %d good rows, %d with images%s", table.name,
                        fmt.describe(), good, pictured,
                        f" (under {folder})" if folder is not None and pictured else "")
            if size is not None and len(self.rows) >= size:
                break
        if self.bad_rows > MAX_ROW_WARNINGS:
            logger.warning("skipped %d more bad rows in %s (only the first %d are listed)",
                           self.bad_rows - MAX_ROW_WARNINGS, self.name, MAX_ROW_WARNINGS)
        if self.total_rows == 0:
            raise DataError(f"{self.name}: no rows (empty file)")
        if self.bad_rows / self.total_rows > max_bad_fraction or not self.rows:
            raise DataError(f"{self.name}: {self.bad_rows} of {self.total_rows} rows are bad "
                            f"(max_bad_fraction={max_bad_fraction}); first: {self.first_error}")

    def _read(self, table: Table, number: int, options: FormatOptions, size: int | None,
              checked_methods: dict[str, str | None], check_method: Callable[[str], None] | None
              ) -> tuple[RowFormat, int, int]:
        """Check every row of ``table``; the format (from its first parseable row), how many
        good rows it gave and how many of those have images."""
        fmt: RowFormat | None = None
        good = pictured = 0
        verified: dict[Path, str | None] = {}
        long = len(table) >= PROGRESS_ROWS
        bar = progress_bar(f"checking {table.name}", len(table)) if long else nullcontext(None)
        with bar as advance:
            for index in range(len(table)):
                if size is not None and len(self.rows) >= size:
                    break
                self.total_rows += 1
                where = table.where(index)
                try:
                    raw = table.row(index)
                    if not isinstance(raw, Mapping):
                        raise BadRowError(f"not a JSON object (got {type(raw).__name__})")
                    if fmt is None:
                        fmt = detect_format(raw, options)
                    row = parse_row(raw, fmt, folder=self._folders[number],
                                    reward_method=self._methods[number],
                                    max_images=self._max_images)
                    if check_method is not None:  # an unknown accuracy method: a bad row
                        _once(checked_methods, row.reward_method,
                              lambda: check_method(row.reward_method))
                    for image in row.images:
                        if isinstance(image, Path):  # many rows often share one image file
                            _once(verified, image, lambda: verify_image(image))
                        else:
                            verify_image(image)  # embedded bytes: each row's own
                except BadRowError as exc:
                    self._skip(where, str(exc))
                else:
                    # embedded images stay in the table (Arrow keeps them on disk), not here
                    embedded = not all(isinstance(image, Path) for image in row.images)
                    self.rows.append(GoodRow(number, index,
                                             replace(row, images=()) if embedded else row,
                                             embedded))
                    good += 1
                    pictured += bool(row.images)
                if advance is not None:
                    advance()
        if fmt is None:  # no row could even be parsed: the format of an empty table
            fmt = RowFormat("columns", "problem", "solution", None, None,
                            options.reward_method_key)
        return fmt, good, pictured

    def _skip(self, where: str, reason: str) -> None:
        """Count a bad row and warn about it (the first ``MAX_ROW_WARNINGS`` only)."""
        message = f"{where}: {reason}"
        self.bad_rows += 1
        self.skipped.append(message)
        if self.first_error is None:
            self.first_error = message
        if self.bad_rows <= MAX_ROW_WARNINGS:
            logger.warning("skipping %s", message)

    def __len__(self) -> int:
        """Number of good rows."""
        return len(self.rows)

    def sample(self, index: int) -> Sample:
        """Good row ``index`` with its images decoded; ``BadRowError`` names the row on failure."""
        good = self.rows[index]
        table = self.tables[good.table]
        where = table.where(good.index)
        row = good.row
        if good.embedded:
            row = parse_row(table.row(good.index), self.formats[good.table],
                            folder=self._folders[good.table],
                            reward_method=self._methods[good.table], max_images=self._max_images)
        try:
            images = [load_image(image) for image in row.images]
        except BadRowError as exc:
            raise BadRowError(f"{where}: {exc}") from exc
        focus = None
        if row.focus is not None:
            try:
                focus = focus_fractions(row.focus, images[0].size)
            except BadRowError as exc:  # the row still trains; only its focus is unusable
                if where not in self.bad_focus:
                    self.bad_focus.add(where)
                    logger.warning("%s: %s; its focus is ignored", where, exc)
        return Sample(images=images, problem=row.problem, solution=row.solution, source=where,
                      turns=row.turns, reward_method=row.reward_method, focus=focus)
