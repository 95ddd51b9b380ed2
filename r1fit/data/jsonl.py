"""JSONL reader in the VLM-R1 layout.

One JSON object per line::

    {"image": "imgs/0001.png", "problem": "How many ...?", "solution": "3"}
    {"image": ["a.png", "b.png"], "problem": "...", "solution": "..."}
    {"problem": "text-only question", "solution": "42"}

Image paths are relative to the JSONL file's folder unless absolute. Extra keys are ignored.
Every row is validated when the file is opened (JSON, fields, image files exist and pass
``Image.verify()``), so the counts of good and bad rows are known before training starts; pixels are
decoded lazily, one sample at a time.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from r1fit.data.errors import BadRowError, DataError
from r1fit.data.images import load_image, verify_image
from r1fit.data.sample import Sample

logger = logging.getLogger("r1fit.data")

# A file with many bad rows would otherwise print one warning per row; after this many the rest
# are summarised in one line (their count is still exact).
MAX_ROW_WARNINGS = 20


@dataclass(frozen=True)
class JsonlRow:
    """One validated row: 1-based line number, resolved image paths, prompt and answer."""

    line: int
    image_paths: tuple[Path, ...]
    problem: str
    solution: str


def _text_field(obj: dict, key: str) -> str:
    """The non-empty string ``obj[key]``, else ``BadRowError`` saying what is wrong with it."""
    if key not in obj:
        raise BadRowError(f"missing '{key}'")
    value = obj[key]
    if not isinstance(value, str):
        raise BadRowError(f"'{key}' must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRowError(f"'{key}' is empty")
    return value


def _image_field(obj: dict, folder: Path, max_images: int) -> tuple[Path, ...]:
    """Resolved image paths of a row; ``()`` when the row has no (or a null) ``image`` key."""
    raw = obj.get("image")
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not all(isinstance(p, str) and p.strip() for p in items):
        raise BadRowError("'image' must be a path or a list of paths (non-empty strings)")
    if len(items) > max_images:
        raise BadRowError(f"has {len(items)} images, more than data.max_images={max_images}")
    # Path("/abs") / ... ignores the folder, so absolute paths pass through unchanged.
    return tuple(folder / Path(p).expanduser() for p in items)


class JsonlSource:
    """Validated rows of one JSONL file; ``sample(i)`` decodes the images of the i-th good row.

    Attributes:
        name: the path as given, used in every message.
        rows: the good rows, in file order.
        total_rows: non-blank lines read (blank lines are ignored, not counted).
        bad_rows: lines skipped as bad.
        first_error: ``"<file>:<line>: <reason>"`` of the first bad row, or ``None``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_images: int,
        max_bad_fraction: float,
        size: int | None = None,
    ) -> None:
        """Read and validate ``path``.

        Args:
            path: the JSONL file.
            max_images: rows with more images than this are bad.
            max_bad_fraction: raise ``DataError`` when ``bad_rows / total_rows`` exceeds it.
            size: stop after this many good rows (the counts then cover only the lines read).
        """
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise DataError(f"max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        if max_images < 0:
            raise DataError(f"max_images must be >= 0, got {max_images}")
        if size is not None and size < 1:
            raise DataError(f"size must be >= 1, got {size}")
        self.name = str(path)
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(f"{self.name}: file not found")
        if not self.path.is_file():
            raise DataError(f"{self.name}: not a file")
        self.rows: list[JsonlRow] = []
        self.total_rows = 0
        self.bad_rows = 0
        self.first_error: str | None = None
        # Many rows often share one image; verify each file once.
        verified: dict[Path, str | None] = {}
        folder = self.path.parent

        with self.path.open("rb") as handle:
            for line_no, raw in enumerate(handle, start=1):
                if size is not None and len(self.rows) >= size:
                    break
                if not raw.strip():
                    continue
                self.total_rows += 1
                try:
                    self.rows.append(self._parse(raw, line_no, folder, max_images, verified))
                except BadRowError as exc:
                    self._skip(line_no, str(exc))

        if self.bad_rows > MAX_ROW_WARNINGS:
            logger.warning(
                "skipped %d more bad rows in %s (only the first %d are listed)",
                self.bad_rows - MAX_ROW_WARNINGS, self.name, MAX_ROW_WARNINGS,
            )
        if self.total_rows == 0:
            raise DataError(f"{self.name}: no rows (empty file)")
        if self.bad_rows / self.total_rows > max_bad_fraction or not self.rows:
            raise DataError(
                f"{self.name}: {self.bad_rows} of {self.total_rows} rows are bad "
                f"(max_bad_fraction={max_bad_fraction}); first: {self.first_error}"
            )

    def _parse(
        self, raw: bytes, line_no: int, folder: Path, max_images: int, verified: dict[Path, str | None]
    ) -> JsonlRow:
        """Validate one line; ``BadRowError`` carries the reason (without file:line)."""
        try:
            # utf-8-sig tolerates a byte-order mark on the first line (Windows editors write one).
            obj = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            raise BadRowError(f"not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
        except json.JSONDecodeError as exc:
            raise BadRowError(f"bad JSON: {exc.msg} at column {exc.colno}") from exc
        if not isinstance(obj, dict):
            raise BadRowError(f"not a JSON object (got {type(obj).__name__})")
        problem = _text_field(obj, "problem")
        solution = _text_field(obj, "solution")
        paths = _image_field(obj, folder, max_images)
        for image_path in paths:
            if image_path not in verified:
                try:
                    verify_image(image_path)
                    verified[image_path] = None
                except BadRowError as exc:
                    verified[image_path] = str(exc)
            if verified[image_path] is not None:
                raise BadRowError(verified[image_path])
        return JsonlRow(line=line_no, image_paths=paths, problem=problem, solution=solution)

    def _skip(self, line_no: int, reason: str) -> None:
        """Count a bad row and warn about it (the first ``MAX_ROW_WARNINGS`` only)."""
        where = f"{self.name}:{line_no}: {reason}"
        self.bad_rows += 1
        if self.first_error is None:
            self.first_error = where
        if self.bad_rows <= MAX_ROW_WARNINGS:
            logger.warning("skipping %s", where)

    def __len__(self) -> int:
        """Number of good rows."""
        return len(self.rows)

    def sample(self, index: int) -> Sample:
        """Decode the images of good row ``index``; ``BadRowError`` names ``file:line`` on failure."""
        row = self.rows[index]
        where = f"{self.name}:{row.line}"
        try:
            images = [load_image(p) for p in row.image_paths]
        except BadRowError as exc:
            raise BadRowError(f"{where}: {exc}") from exc
        return Sample(images=images, problem=row.problem, solution=row.solution, source=where)
