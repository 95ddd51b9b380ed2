"""Where rows come from: a JSONL file, a JSON list, parquet, a saved ``datasets`` folder, a hub id.

Each opens as a :class:`Table`: numbered raw rows (dicts) and a name for each row in messages
(``file.jsonl:LINE``, ``file.json row N``, ``name[split] row N``). Parquet, dataset folders and hub
ids go through Hugging Face ``datasets`` (memory-mapped Arrow: rows are read when asked for, so a
large dataset is never held in Python objects); its ``Image`` columns are read undecoded, as
``{bytes, path}`` records, and decoded one sample at a time.

``SOURCE@split`` picks a split (EasyR1's syntax); without it a split ``train`` (training) or
``test`` (evaluation) is taken when the dataset has several.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from r1fit.data.errors import BadRowError, DataError
from r1fit.errors import one_line

log = logging.getLogger("r1fit.data")


class Table:
    """Raw rows of one source."""

    name: str
    #: folder that relative image paths of this source start from (None: none; they must be
    #: absolute or data.image_folder set)
    folder: Path | None

    def __len__(self) -> int:
        raise NotImplementedError

    def row(self, index: int) -> Any:
        """Row ``index`` as parsed (``BadRowError`` when it cannot be parsed at all)."""
        raise NotImplementedError

    def where(self, index: int) -> str:
        """Row ``index``'s name in messages."""
        raise NotImplementedError


class JsonlTable(Table):
    """One JSON object per line; blank lines are skipped, the others keep their line numbers."""

    def __init__(self, path: Path, name: str) -> None:
        self.name, self.folder = name, path.parent
        self._lines: list[int] = []
        self._rows: list[Any] = []
        with path.open("rb") as handle:
            for line_no, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                self._lines.append(line_no)
                try:
                    # utf-8-sig tolerates a byte-order mark on the first line (Windows editors)
                    row = json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_marked_keys)
                    self._rows.append(_bad_inside(row) or row)
                except UnicodeDecodeError as exc:
                    self._rows.append(BadRowError(f"not valid UTF-8 ({exc.reason} at byte "
                                                  f"{exc.start})"))
                except json.JSONDecodeError as exc:
                    self._rows.append(BadRowError(f"bad JSON: {exc.msg} at column {exc.colno}"))
                except (ValueError, RecursionError) as exc:  # e.g. a 5,000-digit number
                    self._rows.append(BadRowError(f"bad JSON: {_json_limit(exc)}"))

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> Any:
        value = self._rows[index]
        if isinstance(value, BadRowError):
            raise value
        return value

    def where(self, index: int) -> str:
        return f"{self.name}:{self._lines[index]}"


class ListTable(Table):
    """Rows held by a sequence: a JSON file's list of rows (LLaVA's and MiniCPM-V's fine-tuning
    files) or a ``datasets.Dataset`` (parquet/Arrow files, a ``save_to_disk`` folder, a hub
    dataset), which reads each row from its memory-mapped Arrow table when asked."""

    def __init__(self, rows: Any, name: str, folder: Path | None) -> None:
        self.name, self.folder, self._rows = name, folder, rows

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> Any:
        value = self._rows[index]
        if isinstance(value, BadRowError):  # a JSON list's row that names a key twice
            raise value
        return value

    def where(self, index: int) -> str:
        return f"{self.name} row {index + 1}"


def _marked_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any] | BadRowError:
    """The ``object_pairs_hook`` of JSON rows: an object that names a key twice (Python's json
    keeps the last, unsaid: which of two answers was meant is not for the reader to guess), or
    holds one that does (at any depth), becomes the error itself, so that its row is bad and its
    neighbours are read (in a .json list, one bad row must not stop the whole file)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if (bad := _bad_inside(value)) is not None:
            return bad
        if key in out:
            return BadRowError(f"key {key!r} given twice")
        out[key] = value
    return out


def _bad_inside(value: Any) -> BadRowError | None:
    """The error a parsed JSON value carries: itself, or one inside its lists (an object's
    own errors were raised to it when it was parsed)."""
    if isinstance(value, BadRowError):
        return value
    if isinstance(value, list):
        return next((bad for item in value if (bad := _bad_inside(item)) is not None), None)
    return None


def _json_limit(exc: ValueError | RecursionError) -> str:
    """Why valid-looking JSON could not be read: Python's limits on integer digits and nesting."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return one_line(exc).split(";")[0]  # not Python's advice on raising its digit limit


def _json_list(path: Path, name: str) -> ListTable:
    try:
        rows = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=_marked_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{name}: not a JSON file ({one_line(exc)})") from None
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{name}: not a JSON file ({_json_limit(exc)})") from None
    if isinstance(rows, BadRowError):
        raise DataError(f"{name}: not a JSON file of rows ({rows})")
    if not isinstance(rows, list):
        raise DataError(f"{name}: a .json source must hold a list of rows, got "
                        f"{type(rows).__name__} (one object per line is .jsonl)")
    return ListTable([_bad_inside(row) or row for row in rows], name, path.parent)


def _undecoded_images(dataset: Any) -> Any:
    """``dataset`` with its image columns read as ``{bytes, path}`` records (decoded later, one
    sample at a time, by r1fit's own checked loader)."""
    import datasets

    for column, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(column, datasets.Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), datasets.Image):  # a list of images
            dataset = dataset.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return dataset


def _pick_split(found: Any, name: str, split: str | None, default: str) -> tuple[Any, str]:
    """One split of a ``DatasetDict`` (or the dataset itself)."""
    import datasets

    if not isinstance(found, datasets.DatasetDict):
        return found, split or ""
    names = list(found)
    choice = split or (default if default in names else names[0] if len(names) == 1 else None)
    if choice not in names:
        base = name[:-len(f"@{split}")] if split and name.endswith(f"@{split}") else name
        raise DataError(f"{name}: {'no split ' + repr(split) if split else 'several splits'} "
                        f"(has {names}); name one as {base}@<split>")
    return found[choice], choice


def _load_hf(spec: str, path: Path, split: str | None, default_split: str) -> ListTable:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{spec}: reading parquet, Arrow and hub datasets needs the datasets "
                        "package: pip install datasets") from None
    datasets.disable_progress_bars()
    try:
        suffix = path.suffix.lower()
        if path.is_file() and suffix in (".parquet", ".arrow"):
            kind = "parquet" if suffix == ".parquet" else "arrow"
            found = datasets.load_dataset(kind, data_files=str(path), split="train")
            return ListTable(_undecoded_images(found), spec, path.parent)
        if path.is_dir() and ((path / "dataset_info.json").is_file() or
                              (path / "dataset_dict.json").is_file() or
                              (path / "state.json").is_file()):
            found, chosen = _pick_split(datasets.load_from_disk(str(path)), spec, split,
                                        default_split)
            return ListTable(_undecoded_images(found), f"{spec}[{chosen}]" if chosen else spec,
                             path)
        # a folder of data files, or a hub id (the network is needed for the latter)
        found, chosen = _pick_split(datasets.load_dataset(str(path)),
                                    spec, split, default_split)
        return ListTable(_undecoded_images(found), f"{spec}[{chosen}]",
                         path if path.is_dir() else None)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many types; each means "cannot read"
        cause = exc  # datasets wraps the reason ("An error occurred while generating the dataset")
        while cause.__cause__ is not None:
            cause = cause.__cause__
        why = one_line(exc, 150) + ("" if cause is exc else f": {one_line(cause, 200)}")
        raise DataError(f"{spec}: cannot load it with datasets ({why})") from None


def open_table(spec: str, *, default_split: str) -> Table:
    """The table ``spec`` names: a ``.jsonl``/``.json`` file, a ``.parquet``/``.arrow`` file, a
    ``save_to_disk`` folder, a folder of data files or a hub id; ``SPEC@split`` picks a split."""
    text, _, split = spec.partition("@") if "@" in spec and not Path(spec).exists() else (spec, "", "")
    path = Path(text).expanduser()
    suffix = path.suffix.lower()  # DATA.JSONL is a JSONL file too
    if suffix in (".jsonl", ".json"):
        if not path.exists():
            raise DataError(f"{spec}: file not found")
        if not path.is_file():
            raise DataError(f"{spec}: not a file")
        if split:
            raise DataError(f"{spec}: a {path.suffix} file has no splits")
        return JsonlTable(path, text) if suffix == ".jsonl" else _json_list(path, text)
    if suffix in (".parquet", ".arrow") and not path.exists():
        raise DataError(f"{spec}: file not found")
    if not path.exists() and (text.startswith((".", "/", "~")) or text.count("/") != 1):
        raise DataError(f"{spec}: not found (neither a file or folder here nor a hub id "
                        "'owner/name')")
    if path.is_file() and suffix not in (".parquet", ".arrow"):
        # datasets would take it for a hub id and say it cannot reach the hub
        raise DataError(f"{spec}: a {path.suffix or 'suffix-less'} file; r1fit reads .jsonl, "
                        ".json, .parquet and .arrow files, save_to_disk folders, folders of data "
                        "files and hub ids")
    return _load_hf(spec, path, split or None, default_split)
