"""The non-weight files of an HF model folder (tokenizer, chat template, generation config), carried from the
source model into a converted checkpoint and from there into an export.

Code never travels unless asked for: `*.py` files and `auto_map` entries (which make transformers import code
from the folder under `trust_remote_code`) are dropped, so a converted or exported folder runs nothing.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from verl_mega.files.digest import update_with_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".msgpack", ".h5")
REMOTE_CODE_KEY = "auto_map"


def model_sha256(hf_dir: str | Path) -> str:
    """The sha256 of an HF model's `config.json` and weight files (names and contents, in name order), read in
    chunks so a model of any size costs its read time and little memory. Tokenizer files are left out: the
    checksum names the weights a run started from."""
    folder = Path(hf_dir)
    files = sorted(path for path in folder.iterdir() if path.is_file()
                   and (path.name == "config.json" or path.name.endswith(WEIGHT_SUFFIXES)))
    if not any(path.name == "config.json" for path in files):
        raise FileNotFoundError(f"{folder}/config.json does not exist; point at an HF model folder")
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        update_with_file(digest, path)
    return digest.hexdigest()


def without_remote_code(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key != REMOTE_CODE_KEY}


def check_json_assets(src: str | Path) -> None:
    """Refuse, naming it, a JSON file of the folder (tokenizer.json, tokenizer_config.json, ...) that does not
    parse: transformers reads them, and carried unread into a conversion the file would fail the first run or
    export that loads the tokenizer. Weight indexes are the weight readers' to check."""
    for path in sorted(Path(src).iterdir()):
        if not path.is_file() or path.suffix != ".json" or path.name.endswith(WEIGHT_SUFFIXES):
            continue
        try:
            json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}): transformers reads the model folder's JSON files "
                             "(the tokenizer's among them); fix or remove it") from None


def copy_hf_assets(src: str | Path, dst: Path, *, keep_remote_code: bool = False, skip: tuple[str, ...] = (),
                   follow_symlinks: bool = True) -> None:
    """Copy every file of `src` but weights and `skip` into `dst` (created). `follow_symlinks=False` leaves
    out links, for folders that came from someone else (a link could pull in any file of the reader's)."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in Path(src).iterdir():
        if not path.is_file() or path.name.endswith(WEIGHT_SUFFIXES) or path.name in skip:
            continue
        if not follow_symlinks and path.is_symlink():
            continue
        if keep_remote_code:
            shutil.copy2(path, dst / path.name)
        elif path.suffix != ".py" and not _strip_remote_code(path, dst / path.name):
            shutil.copy2(path, dst / path.name)


def _strip_remote_code(path: Path, target: Path) -> bool:
    """Write `path` without its `auto_map` into `target` when it is a JSON config that has one."""
    if not path.name.endswith("config.json"):
        return False
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    if not isinstance(data, dict) or REMOTE_CODE_KEY not in data:
        return False
    target.write_text(json.dumps(without_remote_code(data), indent=2) + "\n")
    return True
