"""Records from local files: JSON lines (`.jsonl`, or `.json` holding lines or one array), parquet, and folders
written by `datasets.Dataset.save_to_disk` (Arrow stream files listed in `state.json`). Each record remembers
where it came from (`file:line` or `file:row`) for error messages. Nothing is fetched from a hub."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A data file problem; the message names the file (and the line or row)."""


@dataclass(frozen=True)
class Record:
    fields: dict[str, Any]
    where: str  # "path:line" (JSON lines) or "path:row N"


def _read_json_lines(path: Path) -> list[Record]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        return [_as_record(r, f"{path}:row {i}") for i, r in enumerate(rows)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
        out.append(_as_record(obj, f"{path}:{n}"))
    return out


def _as_record(obj: Any, where: str) -> Record:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with fields, got {type(obj).__name__}")
    return Record(obj, where)


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable parquet file: {e}") from None
    return [Record(r, f"{path}:row {i}") for i, r in enumerate(rows)]


def _read_saved_dataset(folder: Path) -> list[Record]:
    import pyarrow as pa

    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"{folder}: a DatasetDict folder; name one split's folder instead ({', '.join(splits)})")
    state = json.loads((folder / "state.json").read_text())
    files = [folder / f["filename"] for f in state.get("_data_files", [])]
    rows: list[dict[str, Any]] = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{f}: not a readable Arrow file: {e}") from None
    return [Record(r, f"{folder}:row {i}") for i, r in enumerate(rows)]


def read_records(path: str | Path) -> list[Record]:
    """Every record of one file or saved-dataset folder; an error naming the path when it is missing, of an
    unknown kind, malformed or empty."""
    p = Path(path)
    if p.is_dir():
        if not (p / "state.json").is_file() and not (p / "dataset_dict.json").is_file():
            raise DataError(f"{p}: a folder without state.json: not a `datasets` save_to_disk folder")
        records = _read_saved_dataset(p)
    elif not p.is_file():
        raise DataError(f"{p}: no such file")
    elif p.suffix in (".jsonl", ".json"):
        records = _read_json_lines(p)
    elif p.suffix == ".parquet":
        records = _read_parquet(p)
    else:
        raise DataError(f"{p}: unknown data file kind {p.suffix!r} (expected .jsonl, .json, .parquet or a folder)")
    if not records:
        raise DataError(f"{p}: no records")
    return records
