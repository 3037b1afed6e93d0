"""verl_mega.files: the one sha256 over a file, and row files written through the one write-then-rename protocol."""
import hashlib

import pytest

from verl_mega.data.tables import read_rows, write_rows
from verl_mega.files.digest import _CHUNK_BYTES, file_sha256


@pytest.mark.parametrize("size", [0, 5, _CHUNK_BYTES + 3])
def test_file_sha256_is_the_sha256_of_the_bytes_across_chunks(tmp_path, size):
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()


def test_a_failed_row_write_leaves_the_previous_file_and_no_temp(tmp_path):
    path = write_rows([{"a": 1}], tmp_path / "rows.jsonl")
    with pytest.raises(TypeError):
        write_rows([{"a": object()}], path)  # not JSON-serialisable: fails half-way through the write
    assert read_rows(path) == [{"a": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]
