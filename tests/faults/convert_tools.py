"""Shared by the conversion / export / read fault cases: tiny models built once, the CLI run in-process, and
the checks every case makes (exit code, one-line message naming the fault, nothing left behind, input unchanged)."""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from verl_mega.cli import main as cli
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore


@pytest.fixture(scope="session")
def fault_models(tmp_path_factory):
    """Pristine inputs, never modified: tiny HF models and a TP2 x PP2 conversion of the Llama one."""
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("fault_models")
    models = {family: make_tiny_hf_model(root / family, family) for family in ("llama", "qwen2", "phi3")}
    convert_hf_to_mcore(models["llama"], root / "llama_tp2pp2", tp=2, pp=2)
    models["llama_tp2pp2"] = root / "llama_tp2pp2"
    return models


def tree_digest(folder: Path) -> str:
    """Names, modes and bytes of everything under `folder` (links as their targets)."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            digest.update(str(path.readlink()).encode())
        elif path.is_file():
            digest.update(oct(path.stat().st_mode).encode() + path.read_bytes())
    return digest.hexdigest()


def run(argv: list[str], capsys) -> tuple[int, str]:
    """The CLI in this process: (exit code, stderr). A bug raises out of here as a traceback."""
    capsys.readouterr()
    try:
        code = cli([str(arg) for arg in argv])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def assert_refused(argv: list[str], capsys, words: tuple[str, ...], out: Path, inputs: tuple[Path, ...]) -> str:
    """Exit 2, one line naming the fault, no output and no temp folder beside it, every input unchanged."""
    before = {path: tree_digest(path) for path in inputs}
    siblings = set(out.parent.iterdir()) if out.parent.is_dir() else set()
    code, err = run(argv, capsys)
    lines = [line for line in err.strip().splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert code == 2, err
    assert len(lines) == 1, err
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])
    after = set(out.parent.iterdir()) if out.parent.is_dir() else set()
    assert after == siblings, f"left behind: {sorted(after - siblings)}, removed: {sorted(siblings - after)}"
    for path, digest in before.items():
        assert tree_digest(path) == digest, f"{path} was modified"
    return lines[0]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, edit) -> None:
    """Replace the JSON in `path` by `edit(data)` (or by data edited in place when `edit` returns None)."""
    data = json.loads(path.read_text())
    result = edit(data)
    path.write_text(json.dumps(data if result is None else result))


def edit_tensors(model_dir: Path, edit) -> None:
    """Rewrite a single-file safetensors model with `edit(tensors)` applied to its name -> tensor dict."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, path, metadata={"format": "pt"})


def read_safetensors_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(path: Path, header, data: bytes, length: int | None = None) -> None:
    """A safetensors file with this header (any JSON, or raw bytes) and data; `length` overrides the prefix."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)


def assert_wrong_shape_refused(hf_dir: Path, out: Path, name: str, wrong: tuple[int, ...], implied: list[int]) -> None:
    """Give `name` the shape `wrong`: conversion refuses it, naming the shape config.json implies, writing nothing."""
    edit_tensors(hf_dir, lambda tensors: tensors.update({name: torch.zeros(wrong)}))
    try:
        convert_hf_to_mcore(hf_dir, out)
    except ValueError as err:
        assert f"does not match its config.json: tensor '{name}' has shape {list(wrong)}, config.json implies " \
               f"{implied}" in str(err), err
    else:
        raise AssertionError(f"a {list(wrong)} {name} was converted")
    assert not out.exists()
