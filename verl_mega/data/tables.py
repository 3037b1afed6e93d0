"""Reading and writing row files (jsonl, parquet): one dict per row, nested values kept as dicts/lists.

A folder written by HF datasets' `Dataset.save_to_disk` is read too, with pyarrow alone: its `state.json`
lists the Arrow stream files of the split, each of which must lie inside the folder."""
from __future__ import annotations

import json
import os
import re

from verl_mega.files.atomic import atomic_file

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
DATASET_STATE_FILE = "state.json"  # what `save_to_disk` writes beside the Arrow files of one split
DATASET_DICT_FILE = "dataset_dict.json"  # a DatasetDict: one such folder per split
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's spelling of half a UTF-16 pair


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
    if os.path.isdir(path):
        rows = _read_dataset_folder(path)
        if not rows:
            raise ValueError(f"dataset folder has no rows: {path}")
        return rows
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    extension = _extension(path)
    if extension == ".parquet":
        rows = _import_pyarrow().parquet.read_table(path).to_pylist()
    else:
        try:  # streamed: a data file may be larger than memory allows twice over
            with open(path, encoding="utf-8") as file:
                rows = [_parse_json_line(line, path, number) for number, line in enumerate(file, 1) if line.strip()]
        except UnicodeDecodeError:  # the codec's position is in a buffer: find the line in the bytes
            with open(path, "rb") as file:
                _refuse_undecodable(file.read(), path)
            raise
    if not rows:
        raise ValueError(f"data file has no rows: {path}")
    return rows


def _read_dataset_folder(folder: str) -> list[dict]:
    """The rows of a `save_to_disk` folder, after checking that its state names only Arrow files inside it."""
    state_path = os.path.join(folder, DATASET_STATE_FILE)
    if not os.path.isfile(state_path):
        splits = ""
        if os.path.isfile(os.path.join(folder, DATASET_DICT_FILE)):
            splits = f"; it holds a DatasetDict: point at one split's folder ({', '.join(_splits(folder))})"
        raise ValueError(f"{folder} is a folder without {DATASET_STATE_FILE}: not a dataset written by HF "
                         f"datasets' save_to_disk{splits}")
    try:
        with open(state_path, encoding="utf-8") as file:
            data_files = json.load(file)["_data_files"]
        names = [entry["filename"] for entry in data_files]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{state_path}: not a datasets state file (need _data_files: [{{filename}}]): "
                         f"{error}") from None
    root = os.path.realpath(folder)
    pyarrow = _import_pyarrow()
    import pyarrow.ipc

    rows = []
    for name in names:
        file_path = os.path.realpath(os.path.join(root, name)) if isinstance(name, str) else ""
        if not name or os.path.dirname(file_path) != root or not file_path.endswith(".arrow"):
            raise ValueError(f"{state_path}: data file {name!r} is not an .arrow file inside {folder}")
        if not os.path.isfile(file_path):
            raise FileNotFoundError(f"{state_path}: data file {name} is missing from {folder}")
        try:
            with pyarrow.memory_map(file_path) as source:
                rows.extend(pyarrow.ipc.open_stream(source).read_all().to_pylist())
        except pyarrow.ArrowInvalid as error:
            raise ValueError(f"{file_path}: not an Arrow stream file: {error}") from None
    return rows


def _splits(folder: str) -> list[str]:
    try:
        with open(os.path.join(folder, DATASET_DICT_FILE), encoding="utf-8") as file:
            return [str(split) for split in json.load(file)["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return ["its sub-folders"]


def write_dataset_folder(rows: list[dict], folder: str | os.PathLike) -> str:
    """Rows as `save_to_disk` lays out a one-file split (an Arrow stream and its state.json), for tests and
    tools that hand datasets folders on without the datasets package."""
    pyarrow = _import_pyarrow()
    import pyarrow.ipc

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    table = pyarrow.Table.from_pylist(rows)
    name = "data-00000-of-00001.arrow"
    with pyarrow.OSFile(os.path.join(folder, name), "wb") as sink, pyarrow.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with open(os.path.join(folder, DATASET_STATE_FILE), "w", encoding="utf-8") as file:
        json.dump({"_data_files": [{"filename": name}], "_fingerprint": "written-by-verl-mega", "_format_columns": None,
                   "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}, file)
    return folder


def _refuse_undecodable(data: bytes, path: str) -> None:
    """Raise ValueError naming the line of `data`'s first byte that is not UTF-8 (nothing where all of it is)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_number = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{line_number}: not UTF-8 text (byte {data[error.start]:#04x})") from None


def _parse_json_line(line: str, path: str, line_number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number}: invalid JSON: {error}") from error
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{line_number}: expected a JSON object per line, got {type(row).__name__}")
    # A lone \ud800..\udfff escape is valid JSON but no text: tokenizers and writers fail on it far from here.
    if SURROGATE_ESCAPE.search(line):
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{path}:{line_number}: a string holds half of a UTF-16 surrogate pair (a lone "
                             "\\ud800-\\udfff escape), which is no text") from None
    return row


def write_rows(rows: list[dict], path: str | os.PathLike) -> str:
    """Written whole or not at all (files/atomic.py's protocol), so a reader never sees half a file, even while
    every rank of a job writes the same rows at once."""
    path = os.fspath(path)
    extension = _extension(path)
    with atomic_file(path) as tmp:
        if extension == ".parquet":
            pyarrow = _import_pyarrow()
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), str(tmp))
        else:
            with open(tmp, "w", encoding="utf-8") as file:
                for row in rows:
                    file.write(json.dumps(row) + "\n")
    return path
