"""The lines a person watching a run sees: each phase's start and end, a validation's batches, and a heartbeat
while a phase runs long before the first step is logged."""
import time

from verl_mega.trainer import progress as progress_module
from verl_mega.trainer.progress import Progress


def test_a_phase_says_when_it_starts_and_ends(capsys):
    shown = Progress(enabled=True)
    with shown.phase("loading the models from ckpt"):
        pass
    with shown.phase("reading a checksum", lines=False):
        pass
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "loading the models from ckpt ..."
    assert lines[1].startswith("loading the models from ckpt: done in ") and lines[1].endswith(" s")
    assert len(lines) == 2


def test_only_the_rank_that_prints_prints(capsys):
    with Progress(enabled=False).phase("validation after step 0"):
        pass
    assert capsys.readouterr().out == ""


def test_the_heartbeat_names_the_phase_still_running_and_stops(capsys):
    shown = Progress(enabled=True, heartbeat_s=0.3)
    shown.start_heartbeat()
    with shown.phase("validation after step 0 (512 prompts)"):
        time.sleep(1.5)
    shown.stop_heartbeat()
    time.sleep(0.5)
    out = capsys.readouterr().out
    assert "validation after step 0 (512 prompts): still running (" in out
    assert out.splitlines()[-1].startswith("validation after step 0 (512 prompts): done in")


def test_a_validation_without_a_terminal_prints_its_batches(capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    shown = Progress(enabled=True, bar=True)  # pytest's stderr is no terminal: lines, not a bar
    batches = shown.batches(3, "validation after step 4")
    for _ in range(3):
        batches.advance()
    batches.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"validation after step 4: {k}/3 batches" for k in (1, 2, 3)]
