"""Step checkpoints mirrored to S3-compatible storage, against a real S3 API server (moto's standalone server,
started here on localhost): markers, verified downloads, hostile markers, pruning, a server that goes away."""
import itertools
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from verl_mega.run import mirror
from verl_mega.run.folder import RunFolder
from verl_mega.config.errors import UserError
from verl_mega.parallel.spawn import free_port

from test_resume import records, setup, train_command  # noqa: F401  (setup is a fixture)

BUCKET_NUMBERS = itertools.count()
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's S3 server as a subprocess on a fixed port, so it can be killed and started again on that port
    (it keeps its objects in memory: a restart comes back empty)."""

    def __init__(self):
        self.port = free_port()
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}
        self.process = None

    def start(self):
        self.process = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert self.process.poll() is None and time.time() < deadline, "moto.server did not start"
                time.sleep(0.05)

    def kill(self):
        self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def server():
    s3 = S3Server()
    s3.start()
    yield s3
    s3.kill()


@pytest.fixture
def client(server, monkeypatch):
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    return mirror.s3_client()


@pytest.fixture
def location(client):
    bucket = f"bucket-{next(BUCKET_NUMBERS)}"  # one per test on the module's server
    client.create_bucket(Bucket=bucket)
    return mirror.parse_mirror_url(f"s3://{bucket}/runs/one")


def fake_checkpoint(run_dir, step, rng_bytes=1000):
    """Files are uploaded in path order: the model shard, then the RNG file, then the trainer state."""
    ckpt = RunFolder(run_dir).step(step)
    for folder in ("actor/model", "rng"):
        (ckpt / folder).mkdir(parents=True)
    (ckpt / "actor" / "model" / "shard.distcp").write_bytes(os.urandom(1000))
    (ckpt / "rng" / "rank_00000.safetensors").write_bytes(os.urandom(rng_bytes))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": step}))
    return ckpt


def object_keys(client, location):
    return sorted(obj["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket)
                  for obj in page.get("Contents", []))


def test_marker_lists_every_object_and_a_fetch_reproduces_the_checkpoint(client, location, tmp_path):
    ckpt = fake_checkpoint(tmp_path / "run", 4)
    mirror.upload_checkpoint(client, location, ckpt)
    assert object_keys(client, location) == [f"runs/one/step_000004/{name}" for name in (
        "actor/model/shard.distcp", mirror.MARKER_NAME, "rng/rank_00000.safetensors", "trainer_state.json")]
    assert mirror.read_marker(client, location, 4) == mirror.file_entries(ckpt)
    (ckpt / "trainer_state.json").write_text("{}")  # the same step saved again (a replayed step) replaces it
    mirror.upload_checkpoint(client, location, ckpt)
    assert mirror.read_marker(client, location, 4) == mirror.file_entries(ckpt)

    fresh = tmp_path / "fresh"
    fetched = mirror.fetch_newer(client, location, fresh, newer_than=-1)
    assert fetched == RunFolder(fresh).step(4)
    assert mirror.file_entries(fetched) == mirror.file_entries(ckpt)
    assert [p.name for p in fetched.parent.iterdir()] == ["step_000004"]  # no temp folder left
    assert mirror.fetch_newer(client, location, fresh, newer_than=4) is None


def test_missing_marker_truncated_or_tampered_objects_are_never_fetched(client, location, tmp_path, capfd):
    run_dir = tmp_path / "run"
    for step in (2, 4, 6, 8):
        mirror.upload_checkpoint(client, location, fake_checkpoint(run_dir, step))
    shard = "actor/model/shard.distcp"
    client.delete_object(Bucket=location.bucket, Key=location.key("step_000008", mirror.MARKER_NAME))
    client.put_object(Bucket=location.bucket, Key=location.key("step_000006", shard), Body=b"short")
    client.put_object(Bucket=location.bucket, Key=location.key("step_000004", shard), Body=os.urandom(1000))

    fresh = tmp_path / "fresh"
    assert mirror.fetch_newer(client, location, fresh, newer_than=-1) == RunFolder(fresh).step(2)
    assert [p.name for p in (fresh / "checkpoints").iterdir()] == ["step_000002"]
    warnings = capfd.readouterr().err
    assert "step_000008 skipped" in warnings and "step_000006 skipped" in warnings
    assert "step_000004 skipped" in warnings and "sha256" in warnings


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "actor/../../escape", "actor//x", "./x", "a\\..\\b",
                                  mirror.MARKER_NAME])
def test_marker_paths_outside_the_checkpoint_folder_are_refused(client, location, tmp_path, path):
    entry = {"path": path, "size": 1, "sha256": "0" * 64}
    client.put_object(Bucket=location.bucket, Key=location.key("step_000001", mirror.MARKER_NAME),
                      Body=json.dumps({"format": mirror.MARKER_FORMAT, "step": 1, "files": [entry]}).encode())
    with pytest.raises(mirror.MirrorError, match="not a valid marker"):
        mirror.read_marker(client, location, 1)
    assert mirror.fetch_newer(client, location, tmp_path / "fresh", newer_than=-1) is None
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("files", [[{"path": "a", "size": -1, "sha256": "0" * 64}],
                                   [{"path": "a", "size": 2**80, "sha256": "0" * 64, "extra": 1}],
                                   [{"path": "a", "size": 1, "sha256": "0" * 64}, {"path": "a/b", "size": 1,
                                                                                    "sha256": "0" * 64}],
                                   []])
def test_malformed_markers_are_refused(client, location, files):
    client.put_object(Bucket=location.bucket, Key=location.key("step_000001", mirror.MARKER_NAME),
                      Body=json.dumps({"format": mirror.MARKER_FORMAT, "step": 1, "files": files}).encode())
    with pytest.raises(mirror.MirrorError, match="not a valid marker"):
        mirror.read_marker(client, location, 1)


def test_pruning_keeps_the_newest_complete_checkpoints(client, location, tmp_path):
    for step in (1, 2, 3):
        mirror.upload_checkpoint(client, location, fake_checkpoint(tmp_path, step))
    client.put_object(Bucket=location.bucket, Key=location.key("step_000000", "leftover"), Body=b"partial upload")
    mirror.prune(client, location, keep_last=2)
    assert mirror.list_steps(client, location) == [2, 3]
    assert {key.split("/")[2] for key in object_keys(client, location)} == {"step_000002", "step_000003"}


@pytest.mark.slow
def test_uploads_survive_the_server_going_away_mid_upload(tmp_path, monkeypatch, capfd):
    s3 = S3Server()
    s3.start()
    try:
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        client = mirror.s3_client()
        client.create_bucket(Bucket="ckpts")
        location = mirror.parse_mirror_url("s3://ckpts/run")
        uploader = mirror.CheckpointMirror(location, tmp_path, keep_last=2)
        ckpt = fake_checkpoint(tmp_path, 3, rng_bytes=48 * 2**20)
        uploader.submit(ckpt)
        deadline = time.time() + 60
        while not (uploaded := object_keys(client, location)):  # the small shard is up, the big RNG file next
            assert time.time() < deadline, "the upload never started"
            time.sleep(0.01)
        assert uploaded == ["run/step_000003/actor/model/shard.distcp"]
        s3.kill()
        deadline = time.time() + 60
        while "retrying" not in (err := capfd.readouterr().err):
            assert time.time() < deadline, "no retry announced"
            time.sleep(0.1)
        s3.start()  # empty again: moto keeps objects in memory
        client.create_bucket(Bucket="ckpts")
        assert uploader.finish(timeout_s=120)
        assert mirror.read_marker(client, location, 3) == mirror.file_entries(ckpt)
        assert not list(uploader.pending_root.iterdir())
    finally:
        s3.kill()


def test_a_killed_runs_pending_uploads_are_taken_up_and_half_made_snapshots_dropped(client, location, tmp_path):
    run_dir = tmp_path / "run"
    pending = RunFolder(run_dir).mirror_pending
    pending.mkdir(parents=True)
    fake_checkpoint(tmp_path / "snapshots", 5).rename(pending / "step_000005")
    (pending / ".step_000006.tmp").mkdir()
    uploader = mirror.CheckpointMirror(location, run_dir, keep_last=2)
    assert uploader.finish(timeout_s=60)
    assert mirror.list_steps(client, location) == [5]
    assert not list(pending.iterdir())


def test_a_run_that_cannot_finish_uploading_warns_and_returns(server, monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    uploader = mirror.CheckpointMirror(mirror.parse_mirror_url("s3://ckpts/run"), tmp_path, keep_last=2)
    uploader.submit(fake_checkpoint(tmp_path, 1))
    assert not uploader.finish(timeout_s=0.5)
    assert "step_000001 not mirrored to s3://ckpts/run" in capfd.readouterr().err
    uploader._thread.join(timeout=5)  # gives up at its next retry instead of retrying until the process exits
    assert not uploader._thread.is_alive()


def test_a_mirror_that_cannot_be_listed_at_start_is_an_error_naming_the_key(client):
    with pytest.raises(UserError, match="trainer.checkpoint_mirror: cannot list s3://no-such-bucket/run"):
        mirror.connect(mirror.parse_mirror_url("s3://no-such-bucket/run"))


def test_bad_mirror_urls_name_the_problem():
    for url, problem in (("gs://b/p", "must start with s3://"), ("s3://B_/p", "not an S3 bucket name"),
                         ("s3://bucket/a/../b", "'..'")):
        with pytest.raises(ValueError, match=problem):
            mirror.parse_mirror_url(url)
    assert mirror.parse_mirror_url("s3://bucket/a/b/") == mirror.MirrorLocation("bucket", "a/b")


def run_env(server):
    return {**os.environ, "OMP_NUM_THREADS": "1", **server.env}


@pytest.mark.slow
def test_a_fresh_run_folder_resumes_from_the_mirror_with_the_same_metrics(setup, server, client, tmp_path):
    client.create_bucket(Bucket="trainer-runs")
    url = "s3://trainer-runs/ppo"
    location = mirror.parse_mirror_url(url)
    one_rank = ["parallel.tp=1", "parallel.pp=1", "trainer.total_steps=2", "trainer.save_every=1",
                f"trainer.checkpoint_mirror={url}", "trainer.progress_bar=false"]
    straight = tmp_path / "straight"
    result = subprocess.run(train_command(setup, straight, 1, *one_rank), capture_output=True, text=True,
                            env=run_env(server))
    assert result.returncode == 0, result.stderr[-3000:]
    assert mirror.list_steps(client, location) == [1, 2]
    for step in (1, 2):
        assert mirror.read_marker(client, location, step) == mirror.file_entries(RunFolder(straight).step(step))

    # Without its marker step 2 is an incomplete upload: the fresh run takes step 1 and trains step 2 again.
    client.delete_object(Bucket=location.bucket, Key=location.key("step_000002", mirror.MARKER_NAME))
    fresh = tmp_path / "fresh"
    result = subprocess.run(train_command(setup, fresh, 1, *one_rank), capture_output=True, text=True,
                            env=run_env(server))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fetched step_000001 from the checkpoint mirror" in result.stdout
    assert f"resumed from {RunFolder(fresh).step(1)} at step 1" in result.stdout
    assert records(fresh) == {2: records(straight)[2]}
    assert mirror.read_marker(client, location, 2) == mirror.file_entries(RunFolder(fresh).step(2))


@pytest.mark.slow
def test_training_goes_on_while_the_server_is_down_and_the_upload_completes_after(setup, tmp_path, monkeypatch):
    s3 = S3Server()
    s3.start()
    try:
        env = run_env(s3)
        for key, value in s3.env.items():
            monkeypatch.setenv(key, value)
        mirror.s3_client().create_bucket(Bucket="ckpts")
        run_dir = tmp_path / "run"
        command = train_command(setup, run_dir, 2, "parallel.tp=2", "parallel.pp=1",  # rank 0 mirrors alone
                                "trainer.total_steps=2", "trainer.save_every=1", "trainer.progress_bar=false",
                                "trainer.checkpoint_mirror=s3://ckpts/run", "trainer.checkpoint_mirror_wait_s=120")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step 1:"):
                s3.kill()  # logged before its checkpoint is saved: the upload meets a dead server
            if "retrying in" in line:
                break
        s3.start()  # empty again: moto keeps objects in memory
        client = mirror.s3_client()
        client.create_bucket(Bucket="ckpts")
        output = "".join(lines) + process.communicate(timeout=300)[0]
        assert process.returncode == 0, output[-3000:]
        assert "not mirrored" not in output
        location = mirror.parse_mirror_url("s3://ckpts/run")
        for step in (1, 2):  # step 1's upload retried, step 2's queued behind it
            assert mirror.read_marker(client, location, step) == mirror.file_entries(RunFolder(run_dir).step(step))
    finally:
        s3.kill()
