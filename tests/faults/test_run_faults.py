"""Faults at run time: a bad config, data row, reward function, run folder or checkpoint file is refused with
a line naming the thing to fix (exit 2), leaves nothing behind and changes no input; NaN/inf never reaches an
optimizer step, a checkpoint or a final model; a kill during a save leaves the previous checkpoint usable."""
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from verl_mega.config.errors import UserError
from verl_mega.parallel.spawn import free_port
from verl_mega.run import checkpoints as run_checkpoints
from verl_mega.run.folder import RunFolder
from verl_mega.run.lock import RunFolderLock, ownership_problem
from verl_mega.trainer import main as trainer_main

from .processes import survivors_after

REPO = Path(__file__).resolve().parents[2]
REWARDS = "tests.faults.rewards"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES
    from verl_mega.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("run_faults")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = Path(write_rows(make_task_rows("copy", 16, seed=0, max_digits=2), root / "copy.jsonl"))
    config = root / "ppo.yaml"
    config.write_text((EXAMPLES / "ppo_gae_demo.yaml").read_text())
    return {"root": root, "hf": hf, "data": data, "config": config}


def snapshot(*paths) -> dict:
    """Every file under `paths` with its digest: compared before and after to show an input is unchanged."""
    files = {}
    for path in map(Path, paths):
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            files[str(file)] = hashlib.sha256(file.read_bytes()).hexdigest()
    return files


def tiny_run(inputs, run_dir, data=None) -> list[str]:
    """Overrides for a one-process run of the tiny model: 4 prompts x 2 samples, one mini-batch."""
    return [f"model.hf_path={inputs['hf']}", f"data.train_files=[{data or inputs['data']}]",
            f"trainer.run_dir={run_dir}", "parallel.tp=1", "parallel.pp=1", "data.batch_size=4", "rollout.n=2",
            "actor.mini_batch_size=8", "critic.mini_batch_size=8", "actor.micro_batch_size=4",
            "critic.micro_batch_size=4", "actor.ppo_epochs=1", "critic.ppo_epochs=1"]


def refused_in_process(capsys, inputs, tmp_path, overrides, data=None) -> str:
    """Runs `verl-mega train` in this process where the pre-flight check must refuse it; returns stderr."""
    run_dir = tmp_path / "run"
    before = snapshot(inputs["hf"], inputs["config"], data or inputs["data"])
    code = trainer_main.main(["--config", str(inputs["config"]), *tiny_run(inputs, run_dir, data), *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not run_dir.exists()
    assert snapshot(inputs["hf"], inputs["config"], data or inputs["data"]) == before
    return err


@pytest.mark.parametrize("override, words", [
    ("trainer.total_steps=-1", "trainer.total_steps must be >= 1, got -1"),
    ("trainer.total_steps=0", "trainer.total_steps must be >= 1, got 0"),
    ("rollout.n=0", "rollout.n must be >= 1, got 0"),
    ("data.max_response_length=0", "data.max_response_length must be >= 1"),
    ("data.max_prompt_length=-3", "data.max_prompt_length must be >= 1"),
    ("data.batch_size=0", "data.batch_size must be >= 1"),
    ("actor.mini_batch_size=0", "actor.mini_batch_size must be >= 1"),
    ("critic.ppo_epochs=0", "critic.ppo_epochs must be >= 1"),
    ("trainer.save_every=-1", "trainer.save_every must be >= 0"),
    ("trainer.keep_last=-2", "trainer.keep_last must be >= 0"),
    ("trainer.health_port=70000", "trainer.health_port must be in [0, 65535] (0: no endpoint), got 70000"),
    ("trainer.health_port=-1", "trainer.health_port must be in [0, 65535] (0: no endpoint), got -1"),
    ("trainer.health_port=http", "trainer.health_port"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_k=0", "rollout.top_k must be -1 (off) or >= 1"),
    ("rollout.temperature=-1", "rollout.temperature must be >= 0"),
    ("algorithm.gamma=1.5", "algorithm.gamma must be in [0, 1]"),
    ("actor.optim.lr=-0.1", "actor.optim.lr must be >= 0"),
    ("trainer.nonfinite=ignore", "trainer.nonfinite 'ignore' is unknown; known: error, skip"),
    ("actor.optim.lr_decay_style=exp", "actor.optim.lr_decay_style 'exp' is unknown; known: constant, linear, cosine"),
    ("rollout.engine=embedded parallel.rollout_tp=2", "parallel.rollout_tp=2 needs rollout.engine vllm"),
    (f"reward.function={REWARDS}:no_such_function", "reward.function"),
])
def test_bad_config_values_are_refused_naming_the_key(capsys, inputs, tmp_path, override, words):
    err = refused_in_process(capsys, inputs, tmp_path, override.split())
    assert words in err


@pytest.mark.parametrize("rows, words", [
    ([{"prompt": 12345}], ["row 0", "'prompt'", "int", "a prompt is a string or a list"]),
    ([{"prompt": "copy: 1"}, {"prompt": None}], ["row 1", "NoneType"]),
    ([{"prompt": ["copy: 1"]}], ["row 0", "list"]),
    ([{"prompt": [{"role": "user"}]}], ["row 0", "list"]),
    ([{"question": "copy: 1"}], ["prompt column 'prompt' not found", "row 0", "question"]),
    ([{"prompt": "copy: 1"}, {"prompt": "copy: " + "1234567890" * 8}],
     ["1 of 2 prompts are longer than data.max_prompt_length=16", "row 1", "data.truncation"]),
    ("not json\n", ["bad.jsonl:1: invalid JSON"]),
    ("[1, 2]\n", ["bad.jsonl:1: expected a JSON object per line"]),
    ("", ["data file has no rows", "bad.jsonl"]),
])
def test_bad_data_rows_are_refused_up_front_naming_file_and_row(capsys, inputs, tmp_path, rows, words):
    data = tmp_path / "bad.jsonl"
    data.write_text(rows if isinstance(rows, str) else "".join(json.dumps(row) + "\n" for row in rows))
    err = refused_in_process(capsys, inputs, tmp_path, [], data=data)
    assert "data.train_files" in err and str(data) in err
    for word in words:
        assert word in err


@pytest.mark.parametrize("function, words", [
    ("none_reward", "returned NoneType 'None'"),
    ("list_reward", "returned list '[1.0]'"),
    ("str_reward", "returned str '1.0'"),
    ("dict_reward", "returned dict with fields ['acc'] but no 'score'"),
    ("raising_reward", "raised KeyError: 'answer'"),
])
def test_reward_functions_that_misbehave_are_named(inputs, function, words):
    from transformers import AutoTokenizer

    from verl_mega.roles.reward import RuleReward

    reward = RuleReward(AutoTokenizer.from_pretrained(inputs["hf"]), f"{REWARDS}:{function}")
    responses, mask = torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.long)
    with pytest.raises(UserError) as error:
        reward(responses, mask, ["1", "2"], ["copy", "copy"])
    message = str(error.value)
    assert f"reward.function '{REWARDS}:{function}'" in message and words in message
    assert "response 0 (data_source 'copy')" in message and "\n" not in message


@pytest.mark.parametrize("function", ["nan_reward", "inf_reward"])
def test_non_finite_rewards_reach_the_trainer_as_such(inputs, function):
    from transformers import AutoTokenizer

    from verl_mega.roles.reward import RuleReward

    reward = RuleReward(AutoTokenizer.from_pretrained(inputs["hf"]), f"{REWARDS}:{function}")
    scores = reward(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), ["1"]).scores
    reward.close()
    assert not torch.isfinite(scores).any()  # the trainer stops or skips on them (slow tests below)


@pytest.mark.parametrize("raised, code", [(KeyError("bug"), None), (ValueError("a bug's ValueError"), None),
                                          (UserError("data.seed: fix me"), 2)])
def test_only_user_errors_become_exit_2_bugs_keep_their_traceback(capsys, monkeypatch, inputs, tmp_path, raised, code):
    def train(config, reward_fn=None):
        raise raised

    monkeypatch.setattr(trainer_main, "train", train)
    argv = ["--config", str(inputs["config"]), *tiny_run(inputs, tmp_path / "run")]
    if code is None:
        with pytest.raises(type(raised)):
            trainer_main.main(argv)
    else:
        assert trainer_main.main(argv) == code
        assert capsys.readouterr().err == "verl-mega train: error: data.seed: fix me\n"


# --- RNG state: no pickle, tampering refused --------------------------------------------------------------------

class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PLANTED_MARKER']}",))


def test_rng_state_round_trips_without_pickle(tmp_path):
    path = tmp_path / "rank_00000.safetensors"
    random.seed(3), torch.manual_seed(3)
    run_checkpoints.save_rng_state(path)
    expected = (random.random(), torch.rand(3))
    random.seed(4), torch.manual_seed(4)
    run_checkpoints.load_rng_state(path)
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])
    assert b"pickle" not in path.read_bytes() and path.read_bytes()[8:9] == b"{"  # a safetensors JSON header


def _planted_pickle(path, monkeypatch, tmp_path):
    monkeypatch.setenv("PLANTED_MARKER", str(tmp_path / "pwned"))
    torch.save({"python": _Planted()}, path)


def _truncated(path, monkeypatch, tmp_path):
    run_checkpoints.save_rng_state(path)
    path.write_bytes(path.read_bytes()[:100])


def _bad_word(path, monkeypatch, tmp_path):
    from safetensors.torch import load_file, save_file

    run_checkpoints.save_rng_state(path)
    tensors = load_file(str(path))
    tensors["python"][5] = -1
    save_file(tensors, str(path), metadata={"scalars": json.dumps({"python_version": 3})})


def _missing_scalars(path, monkeypatch, tmp_path):
    from safetensors.torch import save_file

    save_file({"python": torch.zeros(625, dtype=torch.int64)}, str(path))


@pytest.mark.parametrize("tamper", [_planted_pickle, _truncated, _bad_word, _missing_scalars,
                                    lambda path, *_: path.write_bytes(b"\xff" * 64)],
                         ids=["planted_pickle", "truncated", "bad_word", "missing_scalars", "garbage"])
def test_tampered_rng_state_is_refused_and_runs_nothing(tmp_path, monkeypatch, tamper):
    path = tmp_path / "step_000002" / "rng" / "rank_00000.safetensors"
    path.parent.mkdir(parents=True)
    tamper(path, monkeypatch, tmp_path)
    state_before = random.getstate()
    with pytest.raises(UserError, match=r"rank_00000.safetensors is not a valid RNG state .*remove its checkpoint "
                                        r".*step_000002 to resume from an earlier one"):
        run_checkpoints.load_rng_state(path)
    assert not (tmp_path / "pwned").exists()
    assert random.getstate() == state_before or tamper is not _bad_word


def test_the_trainer_loads_nothing_with_pickle():
    files = [*(REPO / "verl_mega" / "trainer").glob("*.py"), *(REPO / "verl_mega" / "run").glob("*.py")]
    sources = "\n".join(p.read_text() for p in files)
    assert "weights_only=False" not in sources and "import pickle" not in sources and "torch.load(" not in sources


@pytest.mark.parametrize("tail", ['{"step": 3, "reward/me', "garbage", '{"no_step": 1}', '{"step": "3"}'])
def test_a_metrics_line_cut_short_by_a_kill_does_not_stop_the_resume(tmp_path, tail):
    from verl_mega.trainer.metrics import MetricsLogger

    RunFolder(tmp_path).metrics.write_text('{"step": 1}\n{"step": 2}\n' + tail)
    MetricsLogger.truncate(tmp_path, 2)
    assert RunFolder(tmp_path).metrics.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_skipped_batchs_nan_is_logged_as_json_null(tmp_path, capsys):
    from verl_mega.trainer.metrics import MetricsLogger

    MetricsLogger(tmp_path, enabled=True, tensorboard=False).log(1, {"reward/mean": float("nan"), "actor/kl": 0.5})
    assert json.loads(RunFolder(tmp_path).metrics.read_text()) == {"step": 1, "reward/mean": None, "actor/kl": 0.5}
    assert "mean=nan kl=0.5" in capsys.readouterr().out


# --- run folder: one live run, one model ---------------------------------------------------------------------------

def test_a_locked_run_folder_is_refused_naming_host_and_pid(tmp_path):
    holder = RunFolderLock(tmp_path / "run")
    with pytest.raises(UserError, match=rf"run folder {tmp_path / 'run'} is in use by another run \(host "
                                        rf"{socket.gethostname()}, pid {os.getpid()}, since .*trainer.run_dir"):
        RunFolderLock(tmp_path / "run")
    holder.release()
    RunFolderLock(tmp_path / "run").release()  # free again once released (or once the holder dies)


@pytest.mark.parametrize("blocker", ["run", "parent"])
def test_a_run_folder_that_cannot_be_one_is_named(tmp_path, blocker):
    (tmp_path / blocker).write_text("a file, not a folder")
    with pytest.raises(UserError, match=r"trainer.run_dir .* cannot be used as a run folder \((File exists|Not a "
                                        r"directory)"):
        RunFolderLock(tmp_path / "parent" / "run" if blocker == "parent" else tmp_path / "run")
    assert (tmp_path / blocker).read_text() == "a file, not a folder"


def test_a_forked_helper_outliving_the_run_does_not_keep_its_lock(tmp_path):
    # As megatron's checkpoint writers do: the run forks, then dies while the child lingers.
    code = ("import os, sys, time; from pathlib import Path; from verl_mega.run.lock import RunFolderLock; "
            "lock = RunFolderLock(Path(sys.argv[1])); child = os.fork()\n"
            "if child == 0: os.close(1); os.close(2); time.sleep(60); os._exit(0)\n"
            "print(child)")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True)
    helper = int(result.stdout)
    try:
        RunFolderLock(tmp_path / "run").release()  # the run is gone: the folder is free though its helper lives
    finally:
        os.kill(helper, signal.SIGKILL)


def _checkpoint_of(run_dir: Path, fingerprint, text=None) -> Path:
    step = RunFolder(run_dir).step(2)
    step.mkdir(parents=True)
    (step / run_checkpoints.STATE_FILE).write_text(text or json.dumps({"step": 2, "model_fingerprint": fingerprint}))
    return step


def test_a_flipped_byte_of_the_fingerprint_is_damage_not_another_model(tmp_path):
    from verl_mega.files.digest import file_entry
    from verl_mega.run.checkpoint_digests import DIGESTS_FILE, DIGESTS_KEY

    step = _checkpoint_of(tmp_path, "mine", json.dumps({"step": 2, "model_fingerprint": "mine",
                                                         DIGESTS_KEY: DIGESTS_FILE}))
    state = step / run_checkpoints.STATE_FILE
    (step / DIGESTS_FILE).write_text(json.dumps({"format": 1, "files": [file_entry(step, state)]}))
    assert ownership_problem(tmp_path, "mine") is None
    state.write_text(state.read_text().replace("mine", "mind"))
    assert ownership_problem(tmp_path, "mine") == (
        f"{state} does not match the sha256 recorded when it was written (its bytes changed); remove {step} to "
        "resume from an earlier checkpoint")


@pytest.mark.parametrize("text, words", [
    (None, "was written for another model (checkpoint step_000002 differs)"),
    ("{not json", "trainer_state.json is unreadable; remove"),
])
def test_a_run_folder_of_another_model_is_recognised(tmp_path, text, words):
    _checkpoint_of(tmp_path, "someone-else", text)
    assert words in ownership_problem(tmp_path, "mine")
    assert ownership_problem(tmp_path / "fresh", "mine") is None


def world_of_one(inputs, run_dir, *overrides, env=None):
    command = [sys.executable, "-m", "verl_mega.trainer.main", "--config", str(inputs["config"]),
               *tiny_run(inputs, run_dir), "trainer.total_steps=1", *overrides]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={
        **os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), **(env or {})})


def test_refused_run_leaves_the_other_runs_folder_untouched(inputs, tmp_path):
    run_dir = tmp_path / "run"
    _checkpoint_of(run_dir, "another-model")
    (run_dir / "config.yaml").write_text("the other run's config\n")
    before = snapshot(run_dir)
    result = world_of_one(inputs, run_dir)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "was written for another model" in result.stderr and "point trainer.run_dir elsewhere" in result.stderr
    assert "Traceback" not in result.stderr
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if not k.endswith(".lock")} == before


def test_a_live_run_holding_the_folder_is_named(inputs, tmp_path):
    holder = RunFolderLock(tmp_path / "run")  # this process plays the live run
    try:
        result = world_of_one(inputs, tmp_path / "run")
    finally:
        holder.release()
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"is in use by another run (host {socket.gethostname()}, pid {os.getpid()}" in result.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]


@pytest.mark.slow
def test_a_busy_health_port_is_named(inputs, tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = world_of_one(inputs, tmp_path / "run", f"trainer.health_port={port}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"trainer.health_port={port}: cannot listen there" in result.stderr and "Traceback" not in result.stderr
    assert run_checkpoints.complete_checkpoints(tmp_path / "run") == []


# --- NaN/inf: stopped before any optimizer step, never saved ------------------------------------------------------

def launch_local(inputs, run_dir, nproc, *overrides):
    command = [sys.executable, "-m", "verl_mega.cli", "launch", "local", "--nproc", str(nproc),
               "--env", f"PYTHONPATH={REPO}", str(inputs["config"]), *tiny_run(inputs, run_dir), *overrides]
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.parametrize("function", ["nan_reward", "inf_reward"])
def test_non_finite_reward_stops_two_ranks_before_any_update_or_save(inputs, tmp_path, function):
    run_dir = tmp_path / "run"
    result = launch_local(inputs, run_dir, 2, f"reward.function={REWARDS}:{function}", "trainer.save_every=1",
                          "trainer.total_steps=2")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rank ") and "failed (exit 2): step 1: the reward is NaN/inf (8 of 8 rows" in last
    assert f"reward.function '{REWARDS}:{function}' must return finite numbers" in last
    assert "nothing saved" in last and "Traceback" not in result.stderr
    assert run_checkpoints.complete_checkpoints(run_dir) == []
    assert not (run_dir / "final_actor").exists() and not (run_dir / "final_critic").exists()
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_non_finite_rewards_can_be_skipped_and_counted(inputs, tmp_path):
    run_dir = tmp_path / "run"
    result = world_of_one(inputs, run_dir, f"reward.function={REWARDS}:nan_reward", "trainer.nonfinite=skip",
                          "trainer.total_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer/nonfinite_skipped"] for r in records] == [1, 2]
    assert not any(key.startswith(("actor/pg_loss", "critic/vf_loss")) for r in records for key in r)
    # Nothing was applied: the final actor holds the initial weights.
    from verl_mega.checkpoint import megatron_legacy

    coords = {"tp_rank": 0, "pp_rank": 0, "pp": 1}
    initial = megatron_legacy.read_shard(run_dir / "initial_actor_tp1_pp1_ep1", 0, **coords)
    final = megatron_legacy.read_shard(run_dir / "final_actor", 2, **coords)
    shared = [k for k in initial.keys() & final.keys() if torch.is_tensor(initial[k])]
    assert shared and all(torch.equal(initial[k], final[k]) for k in shared)


@pytest.mark.slow
def test_an_answer_the_worker_dies_on_scores_0_and_is_counted(inputs, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "answers.log"
    result = world_of_one(inputs, run_dir, f"reward.function={REWARDS}:dies_once", "trainer.total_steps=2",
                          env={"DYING_REWARD_LOG": str(log)})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/worker_deaths"] for r in records] == [1, 0]
    assert [r["reward/timeouts"] for r in records] == [0, 0]
    assert [r["reward/mean"] for r in records] == [7 / 8, 1.0]
    assert "the scoring worker died on it (exit code 9)" in result.stdout + result.stderr


@pytest.mark.slow
def test_late_answers_score_0_are_counted_logged_once_and_leave_no_worker(inputs, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "answers.log"
    result = world_of_one(inputs, run_dir, f"reward.function={REWARDS}:late_twice", "reward.timeout_s=1",
                          "trainer.total_steps=2", env={"LATE_REWARD_LOG": str(log)})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/timeouts"] for r in records] == [2, 0]
    assert [r["reward/mean"] for r in records] == [6 / 8, 1.0]  # the two late answers scored 0
    notes = [line for line in result.stdout.splitlines() if "took longer than reward.timeout_s" in line]
    assert notes == [f"step 1: reward.function '{REWARDS}:late_twice' on response 0 (data_source 'copy') took "
                     "longer than reward.timeout_s=1 s: scored 0, its worker replaced; later ones are counted in "
                     "reward/timeouts, not logged"]
    answers = [line.split() for line in log.read_text().splitlines()]
    assert [kind for _, kind in answers] == ["late", "late"] + ["fast"] * 14
    workers = sorted({int(pid) for pid, _ in answers})
    assert len(workers) == 3  # a fresh worker after each late answer, then one for the rest of the run
    assert survivors_after(workers, 5.0) == []


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_finite_gradients_are_never_applied(tmp_path, dtype):
    result = subprocess.run([sys.executable, str(Path(__file__).parent / "nonfinite_worker.py"), str(tmp_path), dtype],
                            capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gradients refused, weights unchanged" in result.stdout


# --- SIGKILL during a checkpoint save -----------------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_during_a_save_keeps_the_previous_checkpoint_and_resumes(inputs, tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), "-m", "verl_mega.trainer.main", "--config", str(inputs["config"]),
               *tiny_run(inputs, run_dir), "trainer.total_steps=4", "trainer.save_every=1", "trainer.keep_last=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=env, cwd=REPO)
    first = RunFolder(run_dir).step(1)
    deadline = time.time() + 300
    while not first.is_dir():  # the first checkpoint is complete; now kill somewhere inside a later save
        assert process.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.02)
    before = snapshot(first)
    tmp = first.with_name(".step_000002.tmp")
    while not tmp.exists():
        assert process.poll() is None and time.time() < deadline, "the run ended before the second save"
        time.sleep(0.01)
    time.sleep(random.uniform(0.0, 1.5))
    os.killpg(process.pid, signal.SIGKILL)  # torchrun's agent; its ranks (own sessions) must die with it
    process.wait()
    holder = json.loads((run_dir / ".lock").read_text())["pid"]  # rank 0
    assert survivors_after([holder], seconds=10) == [], "rank 0 (and the run folder's lock) outlived its agent"
    complete = run_checkpoints.complete_checkpoints(run_dir)
    assert complete and complete[0] == first and snapshot(first) == before
    print(f"killed with checkpoints {[p.name for p in complete]}")

    resumed = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {complete[-1]}" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (run_dir / "final_actor" / "verl_mega_manifest.json").is_file()


# --- step checkpoints' digests: damaged files refused at resume and at export --------------------------------------

@pytest.fixture(scope="module")
def saved_run(inputs, tmp_path_factory):
    """A one-step run that saved its step checkpoint, with the digests of its files."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    result = world_of_one(inputs, run_dir, "trainer.save_every=1")
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


def _weights_file(step: Path) -> Path:
    return max((step / "actor").glob("*.distcp"), key=lambda path: path.stat().st_size)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# damage -> (what it does to a step checkpoint, returning the file to be named; words of the refusal)
DAMAGES = {
    "flipped-byte": (lambda step: (_flip_a_byte(_weights_file(step)), _weights_file(step))[1],
                     "does not match the sha256 recorded"),
    "truncated": (lambda step: (_weights_file(step).write_bytes(_weights_file(step).read_bytes()[:-100]),
                                _weights_file(step))[1], "(truncated or overwritten)"),
    "missing": (lambda step: (path := _weights_file(step), path.unlink())[0], "is missing"),
    "record-deleted": (lambda step: (step / "digests.json", (step / "digests.json").unlink())[0], "is missing"),
}


def _damaged_copy(saved_run: Path, tmp_path: Path, damage: str) -> tuple[Path, Path, str]:
    """A copy of the saved run with its step checkpoint damaged: (run folder, the file to be named, words)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir, ignore=shutil.ignore_patterns(".lock"))
    harm, words = DAMAGES[damage]
    return run_dir, harm(RunFolder(run_dir).step(1)), words


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_step_checkpoint_is_refused_at_export_naming_the_file(saved_run, tmp_path, capsys, damage):
    from .convert_tools import assert_refused

    run_dir, named, words = _damaged_copy(saved_run, tmp_path, damage)
    out = tmp_path / "out"
    line = assert_refused(["export", "--ckpt", run_dir, "--step", "1", "--out", out], capsys, (words, "--step N"), out,
                          (run_dir,))
    assert line.startswith(f"verl-mega export: error: {named} "), line


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped-byte", "truncated", "missing"])
def test_a_damaged_step_checkpoint_is_refused_at_resume_naming_the_file(inputs, saved_run, tmp_path, damage):
    """Without digests a flipped byte resumed silently, and a missing or truncated file ended in a traceback."""
    run_dir, named, words = _damaged_copy(saved_run, tmp_path, damage)
    result = world_of_one(inputs, run_dir, "trainer.total_steps=2")
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{named} " in errors[0] and words in errors[0] and "remove checkpoint" in errors[0], errors[0]
    assert not RunFolder(run_dir).step(2).exists()


@pytest.mark.slow
def test_a_step_checkpoint_written_before_digests_still_resumes(inputs, saved_run, tmp_path):
    """A checkpoint as the code before digests wrote it (no record, none named in its trainer state) resumes; the
    next checkpoint records its digests."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir, ignore=shutil.ignore_patterns(".lock"))
    step = RunFolder(run_dir).step(1)
    (step / "digests.json").unlink()
    state = json.loads((step / run_checkpoints.STATE_FILE).read_text())
    del state["digests"]
    (step / run_checkpoints.STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    result = world_of_one(inputs, run_dir, "trainer.total_steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resumed from" in result.stdout
    assert (RunFolder(run_dir).step(2) / "digests.json").is_file()
