"""Where rows come from: local files, directories, saved datasets and the HF hub, read into one table.

``data.train_files`` is a comma-separated list. Each entry is one of:

- a ``.parquet``, ``.json``, ``.jsonl`` or ``.arrow`` file;
- a directory written by ``datasets.Dataset.save_to_disk``;
- any other directory: every file of those types under it, in sorted path order;
- ``owner/name@split`` (or ``owner/name``, split ``train``): a dataset on the HF hub.

The rows of all entries are concatenated in order. Every row keeps its origin
(the file it was read from and its index there), so that an error can say
where to look.

Media columns (the ``datasets`` ``Image`` and ``Video`` features, and any other
feature that decodes) are read undecoded, as ``{"bytes", "path"}`` dicts: left
to decode themselves, ``datasets`` would fetch a URL named in ``path`` and
decode images outside the dataset's checks. The dataset decodes them instead
(``data/media.py``), which reads local files only and turns an image that
cannot be used into a bad row.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import datasets

from vlmrl.data.errors import DataError
from vlmrl.user_code import resolved_from

# File suffix -> the `datasets` builder that reads it.
BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\-\[\]:%]+)?$")


@dataclass(frozen=True)
class Origin:
    """A run of consecutive rows of the table that came from one file (or saved dataset)."""

    name: str
    start: int
    """Index in the table of the file's first row."""


class Rows:
    """The concatenated table and the origin of each of its rows."""

    def __init__(self, table: datasets.Dataset, origins: list[Origin]):
        self.table = table
        self.origins = origins
        self._starts = [o.start for o in origins]

    def __len__(self) -> int:
        return len(self.table)

    def locate(self, row_id: int) -> tuple[str, int]:
        """(file, row index within that file) of table row ``row_id``."""
        origin = self.origins[bisect.bisect_right(self._starts, row_id) - 1]
        return origin.name, row_id - origin.start


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _files_under(path: Path) -> list[Path]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDERS and not p.name.startswith("."))
    if not files:
        raise DataError(f"{path}: a directory with no {', '.join(BUILDERS)} files in it")
    return files


def _read_file(path: Path) -> datasets.Dataset:
    builder = BUILDERS.get(path.suffix)
    if builder is None:
        raise DataError(
            f"{path}: unsupported data file type {path.suffix.lstrip('.')!r}; use {', '.join(BUILDERS)} files, "
            "a directory of them, a datasets.save_to_disk directory or a hub name@split"
        )
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # any reader failure is the file's fault, named as such
        bad_line = _first_bad_json_line(path) if builder == "json" else None
        raise DataError(bad_line or f"{path}: cannot be read as {builder} ({type(e).__name__}: {e})") from e


def _first_bad_json_line(path: Path, shown: int = 60) -> str | None:
    """Where a JSON file that ``datasets`` cannot read goes wrong: "FILE line N: ...", with the line's start.

    A ``.jsonl`` file, or a ``.json`` file one of whose first non-blank lines is a JSON object on its own, is
    read as JSON lines (one object a line); any other as one JSON document. None when no line is at fault (the
    reader failed for another reason, which its own message then gives).
    """
    def start_of(line: str) -> str:
        line = line.rstrip("\r\n")
        return repr(line[:shown] + ("..." if len(line) > shown else ""))

    with path.open(encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    if not any(line.strip() for line in lines):
        return None
    if not (path.suffix == ".jsonl" or any(_is_object(line) for line in [s for s in lines if s.strip()][:5])):
        try:
            json.loads("".join(lines))
            return None
        except json.JSONDecodeError as e:
            return (
                f"{path} line {e.lineno}: not JSON ({e.msg}, column {e.colno}): {start_of(lines[e.lineno - 1])}; "
                "a .json file holds one JSON document, or one JSON object a line"
            )
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            return (
                f"{path} line {number}: not JSON ({e.msg}, column {e.colno}): {start_of(line)}; "
                "each line must hold one JSON object"
            )
        if not isinstance(value, dict):
            return (
                f"{path} line {number}: a JSON {type(value).__name__}, not an object: {start_of(line)}; "
                "each line must hold one JSON object, {\"column\": value, ...}"
            )
    return None


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _read_saved(path: Path, split: str | None) -> datasets.Dataset:
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            if len(loaded) != 1:
                raise DataError(f"{path}: a saved dataset with splits {sorted(loaded)}; name one as {path}@SPLIT")
            split = next(iter(loaded))
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r} (splits: {sorted(loaded)})")
        return loaded[split]
    return loaded


def _read_hub(entry: str) -> datasets.Dataset:
    name, _, split = entry.partition("@")
    try:
        return datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # network, auth and naming errors all end here
        raise DataError(
            f"{entry}: cannot load hub dataset {name!r}, split {split or 'train'!r} ({type(e).__name__}: {e})"
        ) from e


def _read_entry(entry: str) -> list[tuple[str, datasets.Dataset]]:
    """The (name, table) pieces one comma-separated entry stands for."""
    path, split = Path(entry), None
    if not path.exists() and "@" in entry and Path(entry.rsplit("@", 1)[0]).is_dir():
        path, split = Path(entry.rsplit("@", 1)[0]), entry.rsplit("@", 1)[1]
    if path.is_dir():
        if _is_saved_dataset(path):
            return [(entry, _read_saved(path, split))]
        return [(str(f), _read_file(f)) for f in _files_under(path)]
    if path.is_file():
        return [(entry, _read_file(path))]
    if path.suffix in BUILDERS or not _HUB_NAME.match(entry):
        raise DataError(f"{entry}: no such file or directory{resolved_from(entry)}")
    return [(entry, _read_hub(entry))]


def undecoded(feature):
    """``feature`` (a column's type, or a whole ``Features``) with every decoding feature set to ``decode=False``."""
    if isinstance(feature, dict):  # Features, and struct columns
        return type(feature)({k: undecoded(v) for k, v in feature.items()})
    if isinstance(feature, (list, tuple)):  # [feature]: the older way to write a list column
        return type(feature)(undecoded(f) for f in feature)
    if isinstance(feature, (datasets.List, datasets.LargeList)):
        return dataclasses.replace(feature, feature=undecoded(feature.feature))
    if getattr(feature, "decode", False) is True and dataclasses.is_dataclass(feature):
        return dataclasses.replace(feature, decode=False)
    return feature


def _undecoded_table(table: datasets.Dataset) -> datasets.Dataset:
    features = undecoded(table.features)
    if features == table.features:
        return table
    # Only the decode flags differ, not the arrow types: the same table under new features, with no copy
    # (``Dataset.cast`` would write the whole table again).
    # The readers return tables without an index mapping (save_to_disk flattens it); one with a mapping is cast.
    if getattr(table, "_indices", None) is not None:
        return table.cast(features)
    info = copy.deepcopy(table.info)
    info.features = features
    return datasets.Dataset(table.data, info=info, split=table.split)


def load_rows(files: str) -> Rows:
    """Read a comma-separated list of sources into one table, aligned to the first one's schema."""
    entries = [e.strip() for e in files.split(",") if e.strip()]
    if not entries:
        raise DataError(
            "no data files given; set data.train_files (and data.val_files) to a file, directory or name@split"
        )
    pieces = [(name, _undecoded_table(table)) for entry in entries for name, table in _read_entry(entry)]
    first_name, first = pieces[0]
    origins, tables, start = [], [], 0
    for name, table in pieces:
        if set(table.column_names) != set(first.column_names):
            raise DataError(
                f"{name}: columns {sorted(table.column_names)} differ from {first_name}'s "
                f"{sorted(first.column_names)}; sources listed together must have the same columns"
            )
        # Same columns can still differ in type (a jsonl "string" next to a pandas
        # parquet "large_string"); each piece is cast to the first one's schema.
        if table is not first and table.features != first.features:
            try:
                table = table.cast(first.features)
            except (ValueError, TypeError) as e:
                raise DataError(f"{name}: column types differ from {first_name}'s and cannot be converted ({e})") from e
        origins.append(Origin(name, start))
        tables.append(table)
        start += len(table)
    table = tables[0] if len(tables) == 1 else datasets.concatenate_datasets(tables)
    return Rows(table, origins)
