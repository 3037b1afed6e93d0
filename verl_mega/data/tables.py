"""Reading and writing row files (jsonl, parquet): one dict per row, nested values kept as dicts/lists."""
from __future__ import annotations

import json
import os

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


def _extension(path: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in SUPPORTED_EXTENSIONS:
        raise ValueError(
            f"unsupported file extension {extension or '(none)'!r} for {path}; "
            f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    return extension


def _import_pyarrow():
    # pyarrow is needed only for parquet, so jsonl users do not have to install it.
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError("reading or writing parquet files needs pyarrow: pip install pyarrow") from error
    return pyarrow


def read_rows(path: str | os.PathLike) -> list[dict]:
    path = os.fspath(path)
    extension = _extension(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    if extension == ".parquet":
        rows = _import_pyarrow().parquet.read_table(path).to_pylist()
    else:
        with open(path, encoding="utf-8") as file:
            rows = [_parse_json_line(line, path, number) for number, line in enumerate(file, 1) if line.strip()]
    if not rows:
        raise ValueError(f"data file has no rows: {path}")
    return rows


def _parse_json_line(line: str, path: str, line_number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number}: invalid JSON: {error}") from error
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line_number}: expected a JSON object per line, got {type(row).__name__}")
    return row


def write_rows(rows: list[dict], path: str | os.PathLike) -> str:
    path = os.fspath(path)
    extension = _extension(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if extension == ".parquet":
        pyarrow = _import_pyarrow()
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    else:
        with open(path, "w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps(row) + "\n")
    return path
