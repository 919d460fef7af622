"""The first row of the training data, read cheaply for checks that need a real row before the run.

A judge's template may use the row's own columns, so validation renders it on
a real row: the first one of ``data.train_files``. Only that row is read (the
first line of a JSON Lines file, the first record batch of a parquet or arrow
file, row 0 of a saved dataset), never the whole table, and no model. A
source that cannot be read this way (a hub dataset, a file that does not
parse) gives None: the data's own checks report a broken file, and the
template is then rendered on the run's first batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


__all__ = ["FirstRow", "first_row"]


@dataclass(frozen=True)
class FirstRow:
    where: str
    """The file (or saved dataset) and the row, as an error names them: ``data/train.jsonl, row 0``."""
    row: dict[str, Any]


def first_row(train_files: str) -> FirstRow | None:
    """The first row of the first source in ``train_files`` (comma-separated, as ``data.train_files``)."""
    entries = [e.strip() for e in train_files.split(",") if e.strip()]
    if not entries:
        return None
    path = Path(entries[0])
    try:
        if path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                return _saved(path)
            # The file types the data loader reads (vlmrl.data.sources.BUILDERS, whose module imports datasets:
            # seconds that every config check would pay).
            files = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in _READERS and not p.name.startswith(".")
            )
            path = files[0] if files else path
        if not path.is_file():
            return None  # a hub dataset, or a path the path checks report
        row = _READERS[path.suffix](path) if path.suffix in _READERS else None
    except (OSError, ValueError, IndexError):
        return None
    return FirstRow(f"{path}, row 0", row) if isinstance(row, dict) else None


def _jsonl(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return json.loads(line)
    return None


def _json(path: Path) -> Any:
    """A .json file: JSON Lines, or one list of records (what the ``datasets`` json builder reads)."""
    with path.open(encoding="utf-8") as f:
        start = f.read(1)
        while start.isspace():
            start = f.read(1)
    if start == "[":
        records = json.loads(path.read_text(encoding="utf-8"))
        return records[0] if records else None
    return _jsonl(path)


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=1):
        return batch.to_pylist()[0]
    return None


def _arrow(path: Path) -> Any:
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(path)  # what datasets writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(path)
        return reader.get_batch(0).slice(0, 1).to_pylist()[0] if reader.num_record_batches else None
    for batch in reader:
        if batch.num_rows:
            return batch.slice(0, 1).to_pylist()[0]
    return None


def _saved(path: Path) -> FirstRow | None:
    import datasets

    loaded = datasets.load_from_disk(str(path))  # memory-mapped: nothing is read but row 0
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            return None
        split = next(iter(loaded))
        return FirstRow(f"{path}@{split}, row 0", loaded[split][0]) if len(loaded[split]) else None
    return FirstRow(f"{path}, row 0", loaded[0]) if len(loaded) else None


_READERS = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet, ".arrow": _arrow}
