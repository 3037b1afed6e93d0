"""`verl-mega export` / `convert mcore-to-hf` / `convert verify` / `plan` on checkpoints whose manifest, tracker
and shard files disagree or are broken, and on bad outputs: exit 2, one line naming the file and key, nothing
written, input unchanged."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from .convert_tools import assert_refused, copy_model, edit_json, fault_models, run  # noqa: F401

MANIFEST = "verl_mega_manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"
SHARD = "iter_0000000/mp_rank_01_001/model_optim_rng.pt"  # tp_rank 1, last stage


def _manifest(**values):
    return lambda ckpt: edit_json(ckpt / MANIFEST, lambda m: m.update(values))


def _manifest_drop(key):
    return lambda ckpt: edit_json(ckpt / MANIFEST, lambda m: m.pop(key) and None)


def _hf_config(**values):
    return lambda ckpt: edit_json(ckpt / MANIFEST, lambda m: m["hf_config"].update(values))


def _write(relative, text):
    return lambda ckpt: (ckpt / relative).write_text(text)


def _remove(relative):
    return lambda ckpt: shutil.rmtree(ckpt / relative) if (ckpt / relative).is_dir() else (ckpt / relative).unlink()


def _edit_shard(edit):
    def apply(ckpt):
        path = ckpt / SHARD
        payload = torch.load(path, weights_only=True)
        edit(payload["model"])
        torch.save(payload, path)
    return apply


def _truncate_shard(ckpt):
    data = (ckpt / SHARD).read_bytes()
    (ckpt / SHARD).write_bytes(data[: len(data) // 2])


def _extra_shard_folder(ckpt):
    shutil.copytree(ckpt / "iter_0000000" / "mp_rank_00_000", ckpt / "iter_0000000" / "mp_rank_02_000")


FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
FC2 = "decoder.layers.0.mlp.linear_fc2.weight"

# (case id, corruption of a copy of the TP2 x PP2 Llama checkpoint, words)
CHECKPOINT_CASES = [
    ("manifest-tp1-on-tp2-shards", _manifest(tp=1), ("mp_rank", "tp=1")),
    ("manifest-pp1-on-pp2-shards", _manifest(pp=1), ("tp=2, pp=1",)),
    ("manifest-ep2-on-ep1-shards", _manifest(ep=2), ("ep=2",)),
    ("manifest-missing-tp", _manifest_drop("tp"), (MANIFEST, "missing key 'tp'")),
    ("manifest-missing-hf-config", _manifest_drop("hf_config"), (MANIFEST, "missing key 'hf_config'")),
    ("manifest-unknown-key", _manifest(tensor_parallel=2), (MANIFEST, "unknown key 'tensor_parallel'")),
    ("manifest-tp-string", _manifest(tp="1"), (MANIFEST, "key 'tp'", "int")),
    ("manifest-tp-zero", _manifest(tp=0), (MANIFEST, "key 'tp'")),
    ("manifest-tp-bool", _manifest(tp=True), (MANIFEST, "key 'tp'")),
    # Its shards were looked up rank by rank: still running after 20 s.
    ("manifest-pp-huge", _manifest(pp=2 ** 40), (MANIFEST, "a checkpoint holds the shards of at most 65536")),
    ("manifest-tied-string", _manifest(tied_embeddings="false"), (MANIFEST, "tied_embeddings")),
    ("manifest-dtype-unknown", _manifest(dtype="fp8"), (MANIFEST, "dtype", "fp8")),
    ("manifest-format-unknown", _manifest(format="zip"), (MANIFEST, "format", "zip")),
    ("manifest-role-unknown", _manifest(role="judge"), (MANIFEST, "role", "judge")),
    ("manifest-family-mismatch", _manifest(family="qwen2"), (MANIFEST, "family", "qwen2")),
    ("manifest-padded-vocab-small", _manifest(padded_vocab_size=10), (MANIFEST, "padded_vocab_size")),
    ("manifest-iteration-negative", _manifest(iteration=-1), (MANIFEST, "iteration")),
    ("manifest-not-json", _write(MANIFEST, "{tp: 1"), (MANIFEST, "not valid JSON")),
    ("manifest-a-list", _write(MANIFEST, "[]"), (MANIFEST, "JSON object")),
    ("manifest-hidden-size-string", _hf_config(hidden_size="64"), (MANIFEST, "hf_config", "hidden_size")),
    ("manifest-model-type-bert", _hf_config(model_type="bert"), (MANIFEST, "hf_config", "bert")),
    ("manifest-rope-yarn", lambda c: edit_json(c / MANIFEST, lambda m: m["hf_config"]["rope_parameters"].update(
        rope_type="yarn")), (MANIFEST, "yarn")),
    ("manifest-config-disagrees-with-shards", _hf_config(intermediate_size=64), ("linear_fc1", "[128, 64]")),
    ("manifest-missing", _remove(MANIFEST), ("not a verl_mega checkpoint",)),
    ("tracker-abc", _write(TRACKER, "abc"), (TRACKER, "'abc'")),
    ("tracker-negative", _write(TRACKER, "-3"), (TRACKER, "'-3'")),
    ("tracker-missing", _remove(TRACKER), (TRACKER, "missing")),
    ("tracker-disagrees-with-manifest", _write(TRACKER, "5"), (TRACKER, "iteration 5", "manifest")),
    ("shard-folder-missing", _remove("iter_0000000/mp_rank_01_001"), ("missing mp_rank_01_001",)),
    ("shard-folder-extra", _extra_shard_folder, ("unexpected mp_rank_02_000",)),
    ("iteration-folder-missing", _remove("iter_0000000"), ("iter_0000000", "missing")),
    ("shard-file-missing", _remove(SHARD), ("model_optim_rng.pt", "missing")),
    ("shard-file-truncated", _truncate_shard, ("mp_rank_01_001", "unreadable")),
    ("shard-file-not-torch", _write(SHARD, "hello"), ("mp_rank_01_001", "unreadable")),
    ("shard-not-a-state-dict", lambda c: torch.save([1, 2], c / SHARD), ("mp_rank_01_001", "state dict")),
    ("shard-tensor-wrong-shape", _edit_shard(lambda m: m.update({FC2: m[FC2][:, :32].clone()})), (FC2, "[64, 64]")),
    ("shard-tensor-transposed", _edit_shard(lambda m: m.update({FC1: m[FC1].t().contiguous()})), (FC1, "[64, 128]")),
    ("shard-tensor-integer", _edit_shard(lambda m: m.update({FC2: m[FC2].int()})), (FC2, "floating")),
    ("shard-tensor-missing", _edit_shard(lambda m: m.pop(FC2) is None), (FC2, "missing")),
    ("shard-tensor-unexpected", _edit_shard(lambda m: m.update({"decoder.extra": torch.zeros(1)})),
     ("decoder.extra",)),
    ("shard-tensor-nan", _edit_shard(lambda m: m[FC2].view(-1).__setitem__(5, float("nan"))), ("NaN/inf", "--step")),
    ("shard-tensor-inf", _edit_shard(lambda m: m[FC1].view(-1).__setitem__(0, float("-inf"))), ("NaN/inf",)),
]


@pytest.fixture
def checkpoint(fault_models, tmp_path):
    return copy_model(fault_models["llama_tp2pp2"], tmp_path / "ckpt")


@pytest.mark.parametrize("case,corrupt,words", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_checkpoint_that_disagrees_with_itself_refused(checkpoint, tmp_path, capsys, case, corrupt, words):
    corrupt(checkpoint)
    out = tmp_path / "out"
    assert_refused(["export", "--ckpt", checkpoint, "--out", out], capsys, words, out, (checkpoint,))


# `convert mcore-to-hf` reads through the same code: a few of the cases above suffice for it.
@pytest.mark.parametrize("case,corrupt,words", [c for c in CHECKPOINT_CASES if c[0] in (
    "manifest-tp1-on-tp2-shards", "manifest-tp-string", "tracker-abc", "shard-tensor-wrong-shape", "shard-tensor-nan")],
    ids=lambda value: value if isinstance(value, str) else "")
def test_mcore_to_hf_refuses_the_same(checkpoint, tmp_path, capsys, case, corrupt, words):
    corrupt(checkpoint)
    out = tmp_path / "out"
    assert_refused(["convert", "mcore-to-hf", "--ckpt", checkpoint, "--out", out], capsys, words, out, (checkpoint,))


def test_export_to_a_dtype_the_weights_overflow_is_refused(checkpoint, tmp_path, capsys):
    _edit_shard(lambda m: m[FC2].view(-1).__setitem__(3, 1e6))(checkpoint)
    out = tmp_path / "out"
    assert_refused(["export", "--ckpt", checkpoint, "--out", out, "--dtype", "fp16"], capsys,
                   ("overflows fp16", "1e+06"), out, (checkpoint,))


@pytest.mark.parametrize("where", ["same", "inside", "containing"])
def test_export_out_overlapping_the_checkpoint_refused(checkpoint, tmp_path, capsys, where):
    out = {"same": checkpoint, "inside": checkpoint / "hf", "containing": tmp_path}[where]
    assert_refused(["export", "--ckpt", checkpoint, "--out", out, "--overwrite"], capsys, ("overlaps",), out,
                   (checkpoint,))


def test_export_of_the_wrong_role_names_the_right_one(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(["export", "--ckpt", checkpoint, "--out", out, "--role", "critic"], capsys,
                   ("actor's weights", "--role actor"), out, (checkpoint,))


def test_export_of_a_plain_folder_says_what_it_expected(tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    out = tmp_path / "out"
    assert_refused(["export", "--ckpt", folder, "--out", out], capsys, ("not a verl_mega checkpoint", "run folder"),
                   out, (folder,))


def test_export_skips_code_and_links_planted_in_hf_assets(checkpoint, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (checkpoint / "hf_assets" / "modeling_evil.py").write_text("raise SystemExit('ran')\n")
    (checkpoint / "hf_assets" / "notes.txt").symlink_to(secret)
    code, err = run(["export", "--ckpt", checkpoint, "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    exported = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert "modeling_evil.py" not in exported and "notes.txt" not in exported
    assert "tokenizer.json" in exported and "config.json" in exported


def test_verify_failure_is_one_line(fault_models, checkpoint, tmp_path, capsys):
    """A mismatched pair is refused before any process is launched, with one line."""
    code, err = run(["convert", "verify", "--hf", fault_models["qwen2"], "--ckpt", checkpoint], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "different models" in err and "model_type" in err


PLAN_CASES = [
    (["--train-tp", "0"], ("--train-tp", "0")),
    (["--train-tp", "-2"], ("--train-tp", "-2")),
    (["--train-pp", "0"], ("--train-pp", "0")),
    (["--dp", "0"], ("--dp", "0")),
    (["--ep", "0"], ("--ep", "0")),
    (["--rollout-tp", "0"], ("--rollout-tp", "0")),
    (["--rollout-tp", "3"], ("--rollout-tp=3", "must divide")),
]


def _plan(hf, *args):
    values = {"--train-tp": "2", "--train-pp": "1", "--dp": "1", "--rollout-tp": "1"}
    values.update(dict(zip(args[::2], args[1::2])))
    return ["plan", "--hf", hf, *[item for pair in values.items() for item in pair]]


@pytest.mark.parametrize("args,words", PLAN_CASES, ids=[" ".join(c[0]) for c in PLAN_CASES])
def test_plan_refuses_bad_layout_numbers(fault_models, capsys, args, words):
    code, err = run(_plan(fault_models["llama"], *args), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(word in err for word in words), err


def test_plan_on_a_missing_folder_is_one_line(tmp_path, capsys):
    code, err = run(_plan(tmp_path / "nope"), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "config.json" in err, err


def test_plan_from_config_json_alone_matches_the_plan_with_weights(fault_models, tmp_path, capsys):
    """No weights downloaded yet: the figures come from config.json and equal those of the full folder."""
    config_only = tmp_path / "hf"
    config_only.mkdir()
    shutil.copy(fault_models["llama"] / "config.json", config_only / "config.json")
    code, err = run(_plan(config_only, "--train-pp", "2", "--dp", "2"), capsys)
    assert code == 0, err
    from verl_mega.rollout.planner import plan

    assert plan(config_only, 2, 2, 2, 1) == plan(fault_models["llama"], 2, 2, 2, 1)
    assert plan(config_only, 2, 2, 2, 1).model_bytes == sum(
        torch.Size(shape).numel() for shape in _header_shapes(fault_models["llama"])) * 4


def _header_shapes(hf):
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader

    reader = SafetensorsReader(hf)
    return [reader.shape(name) for name in reader.names()]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A real one-step PPO run (actor and critic, one process) that saved a step checkpoint."""
    import os
    import subprocess
    import sys

    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.spawn import free_port

    root = tmp_path_factory.mktemp("trained")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    data = write_rows(make_task_rows("copy", 16, seed=0, max_digits=2), root / "copy.jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(free_port()), "-m", "verl_mega.trainer.main", "--config", str(EXAMPLES / "ppo_gae_demo.yaml"),
               f"model.hf_path={hf}", f"data.train_files=[{data}]", f"trainer.run_dir={root / 'run'}",
               "parallel.tp=1", "parallel.pp=1", "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=4",
               "critic.mini_batch_size=4", "actor.micro_batch_size=4", "critic.micro_batch_size=4",
               "actor.ppo_epochs=1", "critic.ppo_epochs=1", "trainer.save_every=1", "trainer.total_steps=1"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "run"


@pytest.mark.slow
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_step_checkpoint_exports_like_the_final_weights(trained_run, tmp_path, capsys, role):
    """The last step's checkpoint holds the same weights as the final ones: both exports are equal, bit for bit,
    whichever way the step is named."""
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader

    step = trained_run / "checkpoints" / "step_000001"
    final = tmp_path / "final"
    assert run(["export", "--ckpt", trained_run, "--out", final, "--role", role], capsys)[0] == 0
    ways = {"run-and-step": ["--ckpt", trained_run, "--step", "1"], "step-folder": ["--ckpt", step],
            "role-folder": ["--ckpt", step / role]}
    for way, args in ways.items():
        code, err = run(["export", *args, "--out", tmp_path / way, "--role", role], capsys)
        assert code == 0, err
        expected, found = SafetensorsReader(final), SafetensorsReader(tmp_path / way)
        assert sorted(expected.names()) == sorted(found.names())
        for name in expected.names():
            assert torch.equal(expected.read(name), found.read(name)), (way, name)
        assert json.loads((tmp_path / way / "config.json").read_text()) == json.loads(
            (final / "config.json").read_text())


@pytest.mark.slow
def test_step_export_refusals_name_the_fix(trained_run, tmp_path, capsys):
    run_copy = copy_model(trained_run, tmp_path / "run")
    shutil.rmtree(run_copy / "final_critic")
    shutil.rmtree(run_copy / "final_actor")
    shutil.rmtree(run_copy / "checkpoints" / "step_000001" / "critic")
    out = tmp_path / "out"
    cases = [
        (["--ckpt", run_copy], ("final_actor", "--step", "complete steps: 1")),
        (["--ckpt", run_copy, "--step", "7"], ("step 7", "complete steps: 1")),
        (["--ckpt", run_copy, "--step", "1", "--role", "critic"], ("holds no critic",)),
        (["--ckpt", run_copy / "checkpoints" / "step_000001" / "actor", "--role", "critic"], ("--role actor",)),
        (["--ckpt", run_copy, "--step", "-1"], ("--step",)),
    ]
    for args, words in cases:
        assert_refused(["export", *args, "--out", out], capsys, words, out, (run_copy,))
