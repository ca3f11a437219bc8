"""Rows of a dataset as users keep it: one file, or a directory of shards or a saved HF dataset.

    for where, row in read_rows(Path("data/math/train.parquet")):
        ...   # where = "data/math/train.parquet[12]", row = {"prompt": [...], "reward_model": {...}}

Formats, picked by the path:

- ``.jsonl`` (one JSON object a line) and ``.json`` (a list of objects): read here, line
  by line, so an error names the exact line (``file:line``). The ``datasets`` JSON
  loader would report an Arrow block's row instead and cache a copy of the file.
- ``.parquet`` and ``.arrow``: through the ``datasets`` library (verl, TRL and OpenRLHF
  keep RL sets as parquet); ``where`` is ``file[row]``, counted from 0.
- a directory written by ``Dataset.save_to_disk`` (it holds ``state.json``): through
  ``datasets.load_from_disk``; a saved ``DatasetDict`` must be given one split's folder.
- any other directory: its ``*.parquet``, ``*.arrow``, ``*.jsonl`` and ``*.json`` shards
  (one format per directory, subdirectories included, in name order), each read as above.

Nested columns (parquet structs, lists of chat messages) come back as Python dicts and
lists. Only the problems' own rows are read: nothing is downloaded.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Row = tuple[str, Any]  # (where, row): "file:line" or "file[i]", and the decoded row

FILE_FORMATS = (".jsonl", ".json", ".parquet", ".arrow")


class DataError(ValueError):
    """A dataset problem, naming the file and line (or row) and the problem id."""


def read_rows(path: Path) -> Iterator[Row]:
    """``(where, row)`` for every row of the file or directory ``path`` (see the module doc)."""
    if path.is_dir():
        yield from _read_directory(path)
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".json":
        yield from _read_json(path)
    elif path.suffix in (".parquet", ".arrow"):
        yield from _read_columnar([path])
    else:
        raise DataError(
            f"{path}: unknown dataset format (use .jsonl, .json, .parquet, .arrow or a dataset directory)"
        )


def _read_jsonl(path: Path) -> Iterator[Row]:
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None


def _read_json(path: Path) -> Iterator[Row]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must be a list of objects")
    for i, row in enumerate(data):
        yield f"{path}[{i}]", row


def _read_directory(path: Path) -> Iterator[Row]:
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise DataError(
            f"{path}: a saved DatasetDict with the splits {', '.join(splits) or '(none)'}; "
            f"give one split's folder, e.g. {path / (splits[0] if splits else 'train')}"
        )
    if (path / "state.json").exists():
        yield from _read_saved(path)
        return
    shards = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_FORMATS)
    kinds = sorted({p.suffix for p in shards})
    if not shards:
        raise DataError(f"{path}: a directory with no dataset in it (no {', '.join(FILE_FORMATS)} files)")
    if len(kinds) > 1:
        raise DataError(f"{path}: shards of several formats ({', '.join(kinds)}); keep one format per directory")
    if kinds[0] in (".parquet", ".arrow"):
        yield from _read_columnar(shards)
    else:
        for shard in shards:
            yield from read_rows(shard)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:  # a dependency of arbor; only a broken install gets here
        raise DataError("reading parquet, arrow and dataset directories needs `pip install datasets`") from None
    datasets.disable_progress_bars()
    return datasets


def _read_saved(path: Path) -> Iterator[Row]:
    """A ``save_to_disk`` directory: memory-mapped as saved, nothing copied."""
    try:
        dataset = _datasets().load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot load the saved dataset: {e}") from None
    for i, row in enumerate(dataset):
        yield f"{path}[{i}]", row


def _read_columnar(files: list[Path]) -> Iterator[Row]:
    """Parquet or Arrow files through ``datasets``, one file at a time so that ``where``
    names the shard and its row. The Arrow copy ``datasets`` builds goes to a temporary
    cache, removed when the rows are read: a stale cache can never serve old rows."""
    datasets = _datasets()
    builder = "parquet" if files[0].suffix == ".parquet" else "arrow"
    for file in files:
        with tempfile.TemporaryDirectory(prefix="arbor-data-") as cache:
            try:
                dataset = datasets.load_dataset(builder, data_files=str(file), split="train", cache_dir=cache)
            except Exception as e:  # pyarrow and datasets raise many types for a bad file
                raise DataError(f"{file}: cannot read it as {builder}: {type(e).__name__}: {e}") from None
            rows = dataset.to_list()
        for i, row in enumerate(rows):
            yield f"{file}[{i}]", row
