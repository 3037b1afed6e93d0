"""The shared-memory segments of vLLM's CPU engine: what a killed run leaked is cleared, what a live engine maps
is named in the refusal, and nothing of another shape is touched. Real files and this machine's /proc; a
segment is in use exactly when some process maps it, as this test process does with mmap."""
import mmap
import re

import pytest

from verl_mega.rollout.vllm_cpu_shm import clear_leaked_segments, mapping_processes, segment_names


def test_the_names_are_vllms_under_the_external_launcher():
    # As vLLM 0.32's CPU build left them in /dev/shm after a killed rollout-TP-2 run on ranks 0 and 1.
    assert segment_names([0, 1]) == ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1"]
    assert segment_names(range(2, 4)) == ["-tp:0-[2-3]-cpushm_0", "-tp:0-[2-3]-cpushm_1"]


def test_leaked_segments_are_removed_and_others_kept(tmp_path):
    leaked = [tmp_path / name for name in segment_names([0, 1])]
    others = [tmp_path / "-tp:0-[2-3]-cpushm_0", tmp_path / "my data", tmp_path / "-tp:0-[0-1]-cpushm_0.bak"]
    for path in leaked + others:
        path.write_bytes(b"\0" * 64)
    assert clear_leaked_segments([0, 1], shm_dir=tmp_path) == leaked
    assert not any(path.exists() for path in leaked) and all(path.exists() for path in others)
    assert clear_leaked_segments([0, 1], shm_dir=tmp_path) == []


def test_a_segment_a_live_process_maps_is_refused_naming_it(tmp_path):
    import os

    live = tmp_path / segment_names([0, 1])[1]
    live.write_bytes(b"\0" * 4096)
    with open(live, "r+b") as file, mmap.mmap(file.fileno(), 4096):
        assert os.getpid() in mapping_processes(live)
        with pytest.raises(RuntimeError, match=rf"{re.escape(str(live))} is in use by process \d+: .*one vLLM job at rollout_tp > 1"):
            clear_leaked_segments([0, 1], shm_dir=tmp_path)
    assert live.exists()
    assert os.getpid() not in mapping_processes(live)
    assert clear_leaked_segments([0, 1], shm_dir=tmp_path) == [live]


def test_processes_are_found_by_their_maps_and_unreadable_ones_skipped(tmp_path):
    proc = tmp_path / "proc"
    (proc / "4242" / "maps").mkdir(parents=True)  # a folder: reading it fails as another user's maps would
    (proc / "77").mkdir()
    segment = tmp_path / "-tp:0-[0-1]-cpushm_0"
    (proc / "77" / "maps").write_text(f"7f00-7f40 rw-s 00000000 00:1a 12 {segment} (deleted)\n"
                                      f"7f40-7f80 rw-s 00000000 00:1a 13 {segment}.bak\n")
    assert mapping_processes(segment, proc_dir=proc) == [77]
    assert mapping_processes(tmp_path / "-tp:0-[0-1]-cpushm_1", proc_dir=proc) == []
