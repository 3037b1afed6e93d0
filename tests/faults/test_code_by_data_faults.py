"""Code chosen by data: a checkpoint's manifest records the family spec it was converted with, but loading it
never imports that name on the manifest's own say-so. Each case runs the real command line in a fresh process
(`python -m verl_mega.cli`, as docker/train.sh runs it) from the folder that holds the downloaded checkpoint and a
`.py` beside it, so the current folder is on `sys.path`; the module must not run, the command exits 2 with one
line naming the spec, and nothing is written."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from .convert_tools import fault_models, tree_digest  # noqa: F401

EVIL_MODULE = """from pathlib import Path
Path(__file__).with_name("ran.txt").write_text("the manifest chose this code")
SPEC = None
"""


def _planted(fault_models, tmp_path, reference: str):
    """A copy of the Llama checkpoint whose manifest names `reference`, with evil.py beside it."""
    folder = tmp_path / "download"
    ckpt = shutil.copytree(fault_models["llama_tp2pp2"], folder / "ckpt")
    manifest = ckpt / "verl_mega_manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "family_spec": reference}))
    (folder / "evil.py").write_text(EVIL_MODULE)
    return folder, ckpt


def _cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "verl_mega.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("command", [
    ["convert", "mcore-to-hf", "--ckpt", "ckpt", "--out", "out"],
    ["export", "--ckpt", "ckpt", "--out", "out"],
    ["convert", "verify", "--hf", "HF", "--ckpt", "ckpt"],
], ids=["mcore-to-hf", "export", "verify"])
@pytest.mark.parametrize("reference", ["evil:SPEC", "this:SPEC"], ids=["module-beside-it", "stdlib-module"])
def test_a_manifest_never_chooses_the_module_that_is_imported(fault_models, tmp_path, command, reference):
    folder, ckpt = _planted(fault_models, tmp_path, reference)
    command = [str(fault_models["llama"]) if word == "HF" else word for word in command]
    before = tree_digest(folder)
    result = _cli(command, folder)
    lines = [line for line in result.stderr.strip().splitlines() if "Warning" not in line and "warn" not in line]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert f"'{reference}'" in lines[0] and "--family-spec" in lines[0], lines[0]
    assert not (folder / "ran.txt").exists(), "the module the manifest named was imported"
    assert "The Zen of Python" not in result.stdout + result.stderr
    assert not (folder / "out").exists()
    assert tree_digest(folder) == before


def test_a_spec_the_user_names_is_imported(fault_models, tmp_path):
    """The other side: the same manifest loads once the command line names a spec (here, back to the built-in
    family is not possible, so naming the planted module on the command line is the user's trust: it runs)."""
    folder, _ = _planted(fault_models, tmp_path, "evil:SPEC")
    result = _cli(["convert", "mcore-to-hf", "--ckpt", "ckpt", "--out", "out", "--family-spec", "evil:SPEC"], folder)
    assert (folder / "ran.txt").exists(), result.stderr
    assert result.returncode == 2 and "is not a verl_mega FamilySpec" in result.stderr


@pytest.mark.parametrize("body, words", [
    ("raise RuntimeError('no GPU here')", ("RuntimeError: no GPU here",)),
    ("import sys\nsys.exit(3)", ("SystemExit",)),
    ("SPEC = 1 / 0", ("ZeroDivisionError",)),
], ids=["raises", "exits", "divides-by-zero"])
def test_a_spec_module_that_fails_to_import_is_one_line(fault_models, tmp_path, body, words):
    (tmp_path / "broken_spec.py").write_text(body + "\n")
    out = tmp_path / "out"
    result = _cli(["convert", "hf-to-mcore", "--hf", str(fault_models["llama"]), "--out", str(out),
                   "--family-spec", "broken_spec:SPEC"], tmp_path)
    lines = [line for line in result.stderr.strip().splitlines() if "Warning" not in line and "warn" not in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "'broken_spec:SPEC'" in lines[0] and all(word in lines[0] for word in words), lines[0]
    assert not out.exists()
