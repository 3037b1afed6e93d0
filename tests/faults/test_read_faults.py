"""Hostile files read by the converters: safetensors headers and indexes that lie, and dist-checkpoint metadata
that would run code. Each is refused with one line naming the file, before anything is written, and nothing
read is executed."""
from __future__ import annotations

import gc
import json
import pickle
import shutil

import pytest

from .convert_tools import (assert_refused, copy_model, fault_models, read_safetensors_header,  # noqa: F401
                            write_safetensors)

NORM = "model.norm.weight"


def _first_and_second(header):
    spans = sorted((meta["data_offsets"][0], name) for name, meta in header.items() if name != "__metadata__")
    return spans[0][1], spans[1][1]


def _huge_length(path):
    header, data = read_safetensors_header(path)
    write_safetensors(path, header, data, length=2**62)


def _length_past_file(path):
    header, data = read_safetensors_header(path)
    write_safetensors(path, header, data, length=len(json.dumps(header)) + len(data) + 100)


def _header_not_json(path):
    _, data = read_safetensors_header(path)
    write_safetensors(path, b"{not json" + b" " * 20, data)


def _header_list(path):
    _, data = read_safetensors_header(path)
    write_safetensors(path, [1, 2], data)


def _edit_entry(name_of, **meta):
    def edit(path):
        header, data = read_safetensors_header(path)
        header[name_of(header)].update(meta)
        write_safetensors(path, header, data)
    return edit


def _offsets_past_end(path):
    header, data = read_safetensors_header(path)
    begin, end = header[NORM]["data_offsets"]
    header[NORM]["data_offsets"] = [len(data) + 4, len(data) + 4 + end - begin]
    write_safetensors(path, header, data)


def _overlapping(path):
    header, data = read_safetensors_header(path)
    first, second = _first_and_second(header)
    size = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
    header[second]["data_offsets"] = [header[first]["data_offsets"][0], header[first]["data_offsets"][0] + size]
    write_safetensors(path, header, data)


def _gap(path):
    header, data = read_safetensors_header(path)
    for meta in header.values():
        if isinstance(meta, dict) and "data_offsets" in meta:
            meta["data_offsets"] = [meta["data_offsets"][0] + 8, meta["data_offsets"][1] + 8]
    write_safetensors(path, header, b"\0" * 8 + data)


def _trailing_bytes(path):
    with open(path, "ab") as file:
        file.write(b"\0" * 64)


def _truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[:-100])


def _empty(path):
    path.write_bytes(b"")


def _shape_claims_more(path):
    header, data = read_safetensors_header(path)
    header[NORM]["shape"] = [2**40]
    write_safetensors(path, header, data)


def _metadata_not_dict(path):
    header, data = read_safetensors_header(path)
    header[NORM] = "oops"
    write_safetensors(path, header, data)


HEADER_CASES = [
    ("length-2^62", _huge_length, ("header claims",)),
    ("length-past-file", _length_past_file, ("header claims",)),
    ("header-not-json", _header_not_json, ("corrupt safetensors header",)),
    ("header-a-list", _header_list, ("not a JSON object",)),
    ("offsets-past-end", _offsets_past_end, (NORM,)),
    ("offsets-negative", _edit_entry(lambda h: NORM, data_offsets=[-4, 252]), ("invalid data_offsets",)),
    ("offsets-reversed", _edit_entry(lambda h: NORM, data_offsets=[256, 0]), ("invalid data_offsets",)),
    ("offsets-not-ints", _edit_entry(lambda h: NORM, data_offsets=["0", "256"]), ("invalid data_offsets",)),
    ("overlapping", _overlapping, ("overlaps",)),
    ("gap-between-tensors", _gap, ("gap",)),
    ("trailing-bytes", _trailing_bytes, ("describes",)),
    ("truncated", _truncated, ("truncated",)),
    ("empty-file", _empty, ("truncated or not a safetensors file",)),
    ("shape-times-dtype-not-span", _shape_claims_more, (NORM, "needs")),
    ("shape-negative", _edit_entry(lambda h: NORM, shape=[-64]), ("invalid shape",)),
    ("shape-not-a-list", _edit_entry(lambda h: NORM, shape="64"), ("invalid shape",)),
    ("dtype-unknown", _edit_entry(lambda h: NORM, dtype="F8_E4M3"), ("unsupported dtype",)),
    ("entry-not-an-object", _metadata_not_dict, ("corrupt header entry",)),
]


@pytest.mark.parametrize("case,corrupt,words", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_lying_safetensors_header_refused(fault_models, tmp_path, capsys, case, corrupt, words):
    hf = copy_model(fault_models["llama"], tmp_path / "hf")
    corrupt(hf / "model.safetensors")
    out = tmp_path / "out"
    line = assert_refused(["convert", "hf-to-mcore", "--hf", hf, "--out", out], capsys, words, out, (hf,))
    assert "model.safetensors" in line
    gc.collect()  # a half-built reader's __del__ must stay silent
    assert capsys.readouterr().err == ""


@pytest.fixture(scope="session")
def sharded_llama(fault_models, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("sharded") / "llama"
    AutoModelForCausalLM.from_pretrained(fault_models["llama"]).save_pretrained(folder, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fault_models["llama"] / name, folder / name)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _index_edit(edit):
    def apply(hf, tmp_path):
        index = hf / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        edit(data, hf, tmp_path)
        index.write_text(json.dumps(data))
    return apply


def _point_first_at(target):
    def edit(data, hf, tmp_path):
        first = sorted(data["weight_map"])[0]
        original = hf / data["weight_map"][first]
        shutil.copy(original, tmp_path / "outside.safetensors")
        data["weight_map"] = {name: (target(tmp_path) if file == data["weight_map"][first] else file)
                              for name, file in data["weight_map"].items()}
    return edit


def _move_tensor_to_other_file(data, hf, tmp_path):
    files = sorted(set(data["weight_map"].values()))
    name = next(name for name, file in data["weight_map"].items() if file == files[0])
    data["weight_map"][name] = files[1]


def _omit_tensor(data, hf, tmp_path):
    data["weight_map"].pop(sorted(data["weight_map"])[0])


def _missing_shard(data, hf, tmp_path):
    data["weight_map"][sorted(data["weight_map"])[0]] = "model-99999-of-99999.safetensors"


def _duplicate_tensor(hf, tmp_path):
    """Two shard files holding the same tensor (the index names one of them)."""
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    from safetensors.torch import load_file, save_file

    first, second = load_file(hf / files[0]), load_file(hf / files[1])
    name = sorted(first)[0]
    second[name] = first[name]
    save_file(second, hf / files[1], metadata={"format": "pt"})


INDEX_CASES = [
    ("parent-path", _index_edit(_point_first_at(lambda tmp: "../outside.safetensors")), ("outside the model folder",)),
    ("absolute-path", _index_edit(_point_first_at(lambda tmp: str(tmp / "outside.safetensors"))),
     ("outside the model folder",)),
    ("not-json", lambda hf, tmp: (hf / "model.safetensors.index.json").write_text("{"), ("weight_map",)),
    ("weight-map-a-list", _index_edit(lambda d, hf, tmp: d.update(weight_map=[1])), ("weight_map",)),
    ("weight-map-missing", _index_edit(lambda d, hf, tmp: d.pop("weight_map") and None), ("weight_map",)),
    ("file-not-a-string", _index_edit(lambda d, hf, tmp: d["weight_map"].update({"x": 3})), ("weight_map",)),
    ("missing-shard-file", _index_edit(_missing_shard), ("model-99999-of-99999", "missing")),
    ("tensor-in-wrong-file", _index_edit(_move_tensor_to_other_file), ("does not hold it",)),
    ("tensor-not-listed", _index_edit(_omit_tensor), ("does not list",)),
    ("tensor-stored-twice", _duplicate_tensor, ("stored twice",)),
]


@pytest.mark.parametrize("case,corrupt,words", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_lying_index_refused(sharded_llama, tmp_path, capsys, case, corrupt, words):
    hf = copy_model(sharded_llama, tmp_path / "hf")
    corrupt(hf, tmp_path)
    out = tmp_path / "out"
    assert_refused(["convert", "hf-to-mcore", "--hf", hf, "--out", out], capsys, words, out, (hf,))
    gc.collect()
    assert capsys.readouterr().err == ""


class _RunsCommand:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def _planted_torch_dist_checkpoint(fault_models, tmp_path, marker):
    """A checkpoint whose manifest says torch_dist and whose dist metadata is a pickle that runs a command."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fault_models["llama_tp2pp2"], ckpt)
    manifest = json.loads((ckpt / "verl_mega_manifest.json").read_text())
    manifest.update(format="torch_dist", tp=1, pp=1)
    (ckpt / "verl_mega_manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(ckpt / "iter_0000000")
    (ckpt / "iter_0000000").mkdir()
    (ckpt / "iter_0000000" / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))
    (ckpt / "iter_0000000" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(marker)))
    return ckpt


def test_planted_dist_metadata_is_refused_and_not_run_on_export(fault_models, tmp_path, capsys):
    marker = tmp_path / "pwned"
    ckpt = _planted_torch_dist_checkpoint(fault_models, tmp_path, marker)
    out = tmp_path / "out"
    assert_refused(["export", "--ckpt", ckpt, "--out", out], capsys, (".metadata", "refusing", "system"), out, (ckpt,))
    assert not marker.exists(), "the planted command ran"


@pytest.mark.parametrize("reader", ["torch", "megatron"])
def test_planted_dist_metadata_is_refused_by_every_reader(tmp_path, reader):
    """Whatever reads a dist checkpoint in this process (torch's reader, megatron's loaders) goes through the
    restricted unpickler once the guard is installed."""
    from verl_mega.checkpoint.safe_unpickle import guard_dist_checkpoint_reads

    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCommand(marker)))
    guard_dist_checkpoint_reads()
    with pytest.raises(ValueError, match="refusing to load 'posix.system'|refusing to load 'os.system'"):
        if reader == "torch":
            from torch.distributed.checkpoint import FileSystemReader

            FileSystemReader(str(tmp_path)).read_metadata()
        else:
            from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
                CachedMetadataFileSystemReader)

            CachedMetadataFileSystemReader(str(tmp_path)).read_metadata()
    assert not marker.exists()


def test_planted_pickle_in_a_shard_file_is_refused(fault_models, tmp_path, capsys):
    import torch

    marker = tmp_path / "pwned"
    ckpt = copy_model(fault_models["llama_tp2pp2"], tmp_path / "ckpt")
    torch.save({"model": {}, "payload": _RunsCommand(marker)},
               ckpt / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt")
    out = tmp_path / "out"
    assert_refused(["export", "--ckpt", ckpt, "--out", out], capsys, ("mp_rank_01_001", "weights-only"), out, (ckpt,))
    assert not marker.exists()


@pytest.fixture(scope="module")
def torch_dist_llama(fault_models, tmp_path_factory):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    ckpt = tmp_path_factory.mktemp("torch_dist") / "ckpt"
    convert_hf_to_mcore(fault_models["llama"], ckpt, fmt="torch_dist")
    return ckpt


@pytest.mark.parametrize("command", ["export", "mcore-to-hf"])
@pytest.mark.parametrize("unsafe_default", [False, True], ids=["default", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"])
def test_planted_pickle_in_common_pt_is_refused_without_advice_to_unprotect(torch_dist_llama, tmp_path, capsys,
                                                                            monkeypatch, command, unsafe_default):
    """megatron reads common.pt with torch.load's default, which an environment variable turns unsafe; the read is
    weights-only whatever the environment, and the one line never repeats torch's advice to switch that off."""
    import torch

    if unsafe_default:
        monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    ckpt = copy_model(torch_dist_llama, tmp_path / "ckpt")
    torch.save({"payload": _RunsCommand(marker)}, ckpt / "iter_0000000" / "common.pt")
    out = tmp_path / "out"
    argv = ["export", "--ckpt", ckpt, "--out", out] if command == "export" else \
        ["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", out]
    line = assert_refused(argv, capsys, ("common.pt", "system"), out, (ckpt,))
    assert "weights_only" not in line and "trusted source" not in line, line
    assert not marker.exists(), "the planted command ran"


def _cut(name, keep):
    def cut(folder):
        found = sorted(folder.glob(name))
        if not found:  # common.pt: megatron-core 0.16 writes it, newer releases write no common state file
            pytest.skip(f"this megatron-core release writes no {name}")
        found[0].write_bytes(found[0].read_bytes()[:keep])
    return cut


def _remove_first_distcp(folder):
    sorted(folder.glob("*.distcp"))[0].unlink()


@pytest.mark.parametrize("damage, words", [
    (_cut("*.distcp", 100), ("dist checkpoint", "iter_0000000", "unreadable")),  # torch's reader: a bare EOFError
    (_remove_first_distcp, ("dist checkpoint", "iter_0000000", "No such file")),  # a bare FileNotFoundError
    (_cut("metadata.json", 1), ("dist checkpoint", "iter_0000000", "unreadable")),  # megatron's json.load
    (_cut("common.pt", 0), ("common.pt", "empty or truncated")),  # a bare EOFError(), then an IndexError
], ids=["truncated-distcp", "missing-distcp", "garbled-metadata.json", "empty-common.pt"])
def test_damaged_dist_checkpoint_is_refused_on_export(torch_dist_llama, tmp_path, capsys, damage, words):
    ckpt = copy_model(torch_dist_llama, tmp_path / "ckpt")
    damage(ckpt / "iter_0000000")
    out = tmp_path / "out"
    assert_refused(["convert", "mcore-to-hf", "--ckpt", ckpt, "--out", out], capsys, words, out, (ckpt,))
