"""HF <-> Megatron converters: bit-exact round trips, logit parity with transformers, refusals."""
import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.cli import main as cli
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.converters.mcore_to_hf import convert_mcore_to_hf
from verl_mega.converters.verify import verify_checkpoints
from verl_mega.models import HFModelConfig

from .conftest import FAMILIES

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def hf_tensors(hf_dir) -> dict:
    reader = SafetensorsReader(hf_dir)
    return {name: reader.read(name) for name in reader.names()}


def assert_same_tensors(expected_dir, actual_dir):
    expected, actual = hf_tensors(expected_dir), hf_tensors(actual_dir)
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_round_trip_is_bit_exact(tiny_models, tmp_path, family, tp, pp):
    convert_hf_to_mcore(tiny_models[family], tmp_path / "ckpt", tp=tp, pp=pp)
    convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert_same_tensors(tiny_models[family], tmp_path / "hf")


def test_shards_hold_the_hf_bytes_without_in_kernel_copies(tiny_models, tmp_path, monkeypatch):
    """Where copy_file_range cannot copy (another file system, an older kernel), shards are written through a
    buffer: the same tensors, padded vocabulary rows zero, as the in-kernel copy gives."""
    import errno
    import os

    from verl_mega.checkpoint import megatron_legacy

    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "kernel_copy", tp=2, pp=2)

    def cannot_copy(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cannot_copy)
    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "buffered", tp=2, pp=2)
    vocab = HFModelConfig.from_dict(json.loads((tiny_models["llama"] / "config.json").read_text())).vocab_size
    for tp_rank in range(2):
        for pp_rank in range(2):
            coords = dict(tp_rank=tp_rank, pp_rank=pp_rank, pp=2)
            want = megatron_legacy.read_shard(tmp_path / "kernel_copy", 0, **coords)
            got = megatron_legacy.read_shard(tmp_path / "buffered", 0, **coords)
            assert list(got) == list(want)
            for name in want:
                assert torch.equal(got[name], want[name]), name
            if pp_rank == 0:
                embedding = got["embedding.word_embeddings.weight"]
                padding_rows = max(0, (tp_rank + 1) * embedding.shape[0] - vocab)
                assert padding_rows > 0 or tp_rank == 0
                assert (embedding[embedding.shape[0] - padding_rows:] == 0).all()


def test_round_trip_from_sharded_checkpoint_with_index(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    convert_hf_to_mcore(tmp_path / "sharded", tmp_path / "ckpt", tp=2, pp=2)
    convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf", max_shard_bytes=200_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert_same_tensors(tiny_models["llama"], tmp_path / "hf")


def test_tensors_the_model_does_not_read_round_trip(tiny_models, tmp_path):
    """A tied LM head stored anyway (written back as the embedding: the trained one after training) and the RoPE
    frequencies older transformers saved (as they were, in their own dtype) come back out of the export."""
    from safetensors.torch import save_file

    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny_models["qwen2"], hf_dir)
    tensors = hf_tensors(hf_dir)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8, dtype=torch.float64)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    convert_hf_to_mcore(hf_dir, tmp_path / "ckpt", tp=2)
    assert not (tmp_path / "ckpt" / "hf_assets" / "unread_tensors" / "model.safetensors").read_bytes().count(
        b"lm_head"), "the tied head's bytes are the embedding's: not stored twice"
    convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "out")
    assert_same_tensors(hf_dir, tmp_path / "out")


def test_export_is_loadable_by_transformers_with_tokenizer_and_tie_flag(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    convert_hf_to_mcore(tiny_models["qwen2"], tmp_path / "ckpt", tp=2, pp=2, dtype="bf16")
    convert_mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.tie_word_embeddings is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").decode([5, 6]) != ""


def test_transformers_4x_config_keys_are_read_like_5x(tiny_models, tmp_path):
    raw = json.loads((tiny_models["llama"] / "config.json").read_text())
    legacy = dict(raw)
    rope = legacy.pop("rope_parameters")
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = rope
    new, old = HFModelConfig.from_dict(raw), HFModelConfig.from_dict(legacy)
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling)
    assert new.rope_scaling["rope_type"] == "llama3"


def _legacy_config_copy(src: Path, dst: Path) -> Path:
    """A copy of a 5.x-written model whose config.json carries the 4.x rope keys."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["rope_scaling"] = rope
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


# The dtypes each layout's parity launch checks every family in. A layout's slicing is the same code in every
# dtype, and a 16-bit checkpoint's report includes its weights upcast to fp32 under the fp32 rule (the verdict on
# the slicing), so the layouts that only split one way check bf16 alone; fp16, whose rounding no layout changes,
# is checked unsplit.
PARITY_DTYPES = {(1, 1): ("fp32", "bf16", "fp16"), (2, 1): ("bf16",), (1, 2): ("bf16",), (2, 2): ("fp32", "bf16")}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logit_parity_with_transformers(tiny_models, tmp_path, tp, pp):
    """Every family in PARITY_DTYPES[layout] (transformers in the same dtype), one launch per layout; fp32 also
    keeps the historic 1e-4 absolute bound on these tiny models."""
    sources = dict(tiny_models)
    sources["llama-4.x-config"] = _legacy_config_copy(tiny_models["llama"], tmp_path / "llama4x")
    pairs, names = [], []
    for name, hf_dir in sources.items():
        for dtype in PARITY_DTYPES[tp, pp] if name in tiny_models else PARITY_DTYPES[tp, pp][:1]:
            convert_hf_to_mcore(hf_dir, tmp_path / f"{name}-{dtype}", tp=tp, pp=pp, dtype=dtype)
            pairs.append((hf_dir, tmp_path / f"{name}-{dtype}"))
            names.append(f"{name} {dtype}")
    for name, parity in zip(names, verify_checkpoints(pairs)):
        assert parity.passed, f"{name} at tp={tp} pp={pp}: {parity.describe()}"
        assert parity.dtype != "fp32" or parity.max_abs <= 1e-4, f"{name} at tp={tp} pp={pp}: {parity.describe()}"


@pytest.mark.slow
def test_bf16_verify_fails_a_wrong_conversion(tiny_models, tmp_path, capsys):
    """The bf16 rule is tight enough to catch a conversion bug: one layer's MLP output projection lost."""
    ckpt = tmp_path / "ckpt"
    convert_hf_to_mcore(tiny_models["llama"], ckpt, tp=1, pp=1, dtype="bf16")
    (shard,) = ckpt.glob("iter_*/mp_rank_*/model_optim_rng.pt")
    content = torch.load(shard, weights_only=False)
    content["model"]["decoder.layers.1.mlp.linear_fc2.weight"].zero_()
    torch.save(content, shard)
    assert cli(["convert", "verify", "--hf", str(tiny_models["llama"]), "--ckpt", str(ckpt)]) == 1
    assert "bf16: max |Δ logit|" in capsys.readouterr().out


@pytest.mark.slow
def test_torch_dist_round_trip_and_loads_at_another_layout(tiny_models, tmp_path):
    pairs = []
    for family in ("llama", "qwen2", "mixtral", "deepseek_v3"):  # deepseek_v3: layers keyed apart, local MLA names
        ckpt = tmp_path / f"{family}-dist"
        manifest = convert_hf_to_mcore(tiny_models[family], ckpt, tp=2, pp=1, fmt="torch_dist")
        assert manifest.format == "torch_dist" and (ckpt / "iter_0000000" / "metadata.json").is_file()
        convert_mcore_to_hf(ckpt, tmp_path / f"{family}-hf")
        assert_same_tensors(tiny_models[family], tmp_path / f"{family}-hf")
        pairs.append((tiny_models[family], ckpt))
    # Saved at TP2 x PP1, loaded at TP1 x PP2.
    assert all(parity.max_abs <= 1e-4 and parity.passed for parity in verify_checkpoints(pairs, tp=1, pp=2))


# --- refusals: a clear message, and nothing left behind ---------------------------------------------


def _refused(capsys, argv, out: Path, *expected: str):
    assert cli(argv) == 2
    message = capsys.readouterr().err
    for text in expected:
        assert text in message, message
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


def _hf_with_config(tmp_path, config: dict) -> Path:
    folder = tmp_path / config["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config", [
    {"model_type": "bert", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 99},
    {"model_type": "t5", "d_model": 64, "num_layers": 2, "vocab_size": 99},
    {"model_type": "llava", "text_config": {"model_type": "llama"}, "vision_config": {}},
])
def test_unsupported_model_types_are_refused_up_front(tmp_path, capsys, config):
    hf = _hf_with_config(tmp_path, config)
    out = tmp_path / "out"
    _refused(capsys, ["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out)], out,
             f"model_type '{config['model_type']}' is not supported", "llama", "mixtral")


def test_tp_not_dividing_query_groups_is_refused(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(capsys, ["convert", "hf-to-mcore", "--hf", str(tiny_models["llama"]), "--out", str(out), "--tp", "4"],
             out, "--tp=4 must divide the number of query groups", "num_key_value_heads=2")


def test_pp_not_dividing_layers_is_refused(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(capsys, ["convert", "hf-to-mcore", "--hf", str(tiny_models["llama"]), "--out", str(out), "--pp", "3"],
             out, "--pp=3 must divide num_hidden_layers=4")


def test_missing_shard_file_is_refused(tiny_models, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.unlink()
    out = tmp_path / "out"
    _refused(capsys, ["convert", "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(out)], out,
             f"shard {shard} named in model.safetensors.index.json is missing")


@pytest.mark.parametrize("name, cut, problem", [("model.safetensors", 1000, "is truncated"),
                                                ("tokenizer.json", 200, "is not valid JSON")])
def test_a_cut_file_of_the_hf_folder_is_refused_naming_it(tiny_models, tmp_path, capsys, name, cut, problem):
    """The weights, and a tokenizer file transformers would read (refused before any shard is written)."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_models["llama"], hf)
    cut_file = hf / name
    cut_file.write_bytes(cut_file.read_bytes()[:-cut])
    out = tmp_path / "out"
    _refused(capsys, ["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(out)], out, f"{cut_file} {problem}")


def test_existing_output_needs_overwrite(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert cli(["convert", "hf-to-mcore", "--hf", str(tiny_models["llama"]), "--out", str(out)]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "precious"
    assert cli(["convert", "hf-to-mcore", "--hf", str(tiny_models["llama"]), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists()


def test_missing_megatron_shard_on_export_is_refused(tiny_models, tmp_path, capsys):
    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "ckpt", tp=2, pp=2)
    victim = tmp_path / "ckpt" / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt"
    victim.unlink()
    out = tmp_path / "hf"
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out)], out,
             f"shard file {victim} is missing")


def test_truncated_megatron_shard_on_export_is_refused(tiny_models, tmp_path, capsys):
    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "ckpt")
    victim = tmp_path / "ckpt" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    victim.write_bytes(victim.read_bytes()[:5000])  # torch.load under mmap: a bare OSError 'Invalid argument'
    out = tmp_path / "hf"
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out)], out,
             f"shard file {victim} is unreadable (truncated, corrupt or not weights-only)")


@pytest.mark.slow
def test_layout_mismatch_on_load_is_refused(tiny_models, tmp_path):
    import subprocess
    import sys

    from verl_mega.parallel.spawn import free_port

    convert_hf_to_mcore(tiny_models["llama"], tmp_path / "ckpt", tp=2, pp=1)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()), "-m",
         "verl_mega.converters.verify", "--pair", str(tiny_models["llama"]), str(tmp_path / "ckpt"), "--tp", "1",
         "--pp", "1"],
        capture_output=True, text=True,
    )
    assert run.returncode != 0
    assert "was written for tp=2, pp=1, ep=1 but this job runs tp=1, pp=1, ep=1" in run.stderr


@pytest.mark.parametrize("flags, message", [
    (["--tolerance", "nan"], "argument --tolerance: must be a finite number >= 0, got 'nan'"),  # failed every check
    (["--tolerance", "inf"], "argument --tolerance: must be a finite number >= 0, got 'inf'"),  # passed every one
    (["--seq-len", "99999999999"], "--seq-len 99999999999 exceeds the model's context of 256 (max_position_embeddings"),
    (["--batch", "99999999999"], "a parity check takes at most 8192"),  # the ranks' allocation failed
])
def test_verify_refuses_sizes_and_tolerances_it_cannot_check_with(tiny_models, tmp_path, capsys, flags, message):
    ckpt = tmp_path / "ckpt"
    convert_hf_to_mcore(tiny_models["qwen2"], ckpt)
    with pytest.raises(SystemExit) if flags[0] == "--tolerance" else contextlib.nullcontext():
        assert cli(["convert", "verify", "--hf", str(tiny_models["qwen2"]), "--ckpt", str(ckpt), *flags]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]  # argparse's usage lines come first


def test_a_verify_rank_started_by_srun_names_its_error_file_by_its_slurm_rank(tmp_path, monkeypatch, capsys):
    """The launcher shows the first rank's refusal; a rank of an `srun` step without torchrun (no RANK) is found
    by the world reader, not taken for rank 0."""
    from verl_mega.converters.verify import main as verify_main
    from verl_mega.parallel.world import TORCHRUN_VARIABLES

    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[3-4]")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    result = tmp_path / "parity.json"
    with pytest.raises(SystemExit) as exit_:
        verify_main(["--pair", str(tmp_path / "hf"), str(tmp_path / "missing"), "--tp", "1", "--pp", "1",
                     "--result", str(result)])
    assert exit_.value.code == 2
    assert [path.name for path in tmp_path.glob("parity.json.rank*.error")] == ["parity.json.rank1.error"]
    assert "missing" in (tmp_path / "parity.json.rank1.error").read_text()
