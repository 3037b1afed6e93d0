"""The reference log-prob cache file: read back as written, stale for other inputs, refused when altered."""
from pathlib import Path

import pytest
import torch

from verl_mega.config.errors import UserError
from verl_mega.data.supervised import PreferenceExample
from verl_mega.trainer.reference_cache import cache_key, read_cache, write_cache

VALUES = {"train": torch.tensor([-1.5, -2.25, -0.125, -3.0]), "val": torch.tensor([-0.5, -4.0])}
ROWS = {"train": 4, "val": 2}


@pytest.fixture
def inputs(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    ckpt = tmp_path / "ckpt"
    (ckpt / "shard").mkdir(parents=True)
    (ckpt / "shard" / "weights.bin").write_bytes(b"\x00" * 64)
    examples = {"train": [PreferenceExample([1, 2], ([3], [4])), PreferenceExample([5], ([6], [7, 8]))],
                "val": [PreferenceExample([9], ([3], [4]))]}
    return data, ckpt, examples


def key_of(inputs, dtype="fp32"):
    data, ckpt, examples = inputs
    return cache_key([str(data)], examples, ckpt, dtype)


def test_cache_reads_back_bitwise(tmp_path, inputs):
    path = tmp_path / "cache.safetensors"
    write_cache(path, key_of(inputs), VALUES)
    read = read_cache(path, key_of(inputs), ROWS)
    assert all(torch.equal(read[split], VALUES[split]) for split in VALUES)
    assert read_cache(tmp_path / "absent.safetensors", key_of(inputs), ROWS) is None


@pytest.mark.parametrize("change", ["data file", "tokenized examples", "reference weights", "dtype"])
def test_cache_of_other_inputs_is_stale(tmp_path, inputs, change):
    path = tmp_path / "cache.safetensors"
    write_cache(path, key_of(inputs), VALUES)
    data, ckpt, examples = inputs
    dtype = "fp32"
    if change == "data file":
        data.write_text(data.read_text().replace('"c"', '"d"'))
    elif change == "tokenized examples":  # another tokenizer or truncation setting
        examples["train"][1] = PreferenceExample([5], ([6], [7]))
    elif change == "reference weights":
        (ckpt / "shard" / "weights.bin").write_bytes(b"\x00" * 63 + b"\x01")
    else:
        dtype = "bf16"
    assert read_cache(path, cache_key([str(data)], examples, ckpt, dtype), ROWS) is None


def flip_last_value_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01  # inside the last tensor's data (safetensors puts the data after the header)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage,message", [
    (flip_last_value_byte, "its values do not match their checksum"),
    (lambda path: path.write_bytes(path.read_bytes()[:-3]), "unreadable"),
    (lambda path: path.write_bytes(b"not safetensors"), "unreadable"),
])
def test_altered_cache_is_refused_naming_the_file(tmp_path, inputs, damage, message):
    path = tmp_path / "cache.safetensors"
    write_cache(path, key_of(inputs), VALUES)
    damage(path)
    with pytest.raises(UserError, match=message) as err:
        read_cache(path, key_of(inputs), ROWS)
    assert str(path) in str(err.value) and "delete it" in str(err.value)


def test_cache_of_another_row_count_is_refused(tmp_path, inputs):
    path = tmp_path / "cache.safetensors"
    write_cache(path, key_of(inputs), VALUES)
    with pytest.raises(UserError, match=r"train is torch.float32 \(4,\), expected float32 \(6,\)"):
        read_cache(path, key_of(inputs), {"train": 6, "val": 2})


def test_a_datasets_folder_is_keyed_by_its_files(tmp_path, inputs):
    from verl_mega.data.tables import write_dataset_folder

    _, ckpt, examples = inputs
    folder = write_dataset_folder([{"prompt": "a", "chosen": "b", "rejected": "c"}], tmp_path / "pairs")
    before = cache_key([folder], examples, ckpt, "fp32")
    write_dataset_folder([{"prompt": "a", "chosen": "b", "rejected": "d"}], tmp_path / "pairs")
    assert cache_key([folder], examples, ckpt, "fp32") != before
