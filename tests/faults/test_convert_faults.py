"""`verl-mega convert hf-to-mcore` on broken, disagreeing or hostile HF folders and bad layouts: every case exits 2
with one line naming the fault, writes nothing, and leaves its input unchanged."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from .convert_tools import (assert_refused, copy_model, edit_json, edit_tensors, fault_models,  # noqa: F401
                            run, tree_digest)

L0 = "model.layers.0."


def _set(**values):
    return lambda config: config.update(values)


def _drop(key):
    return lambda config: config.pop(key) and None


def _rope(**values):
    return lambda config: config["rope_parameters"].update(values)


# (case id, family, edit of config.json, words the message must hold)
CONFIG_CASES = [
    ("json-list", "llama", lambda config: [config], ("config.json", "JSON object")),
    ("hidden-size-string", "llama", _set(hidden_size="64"), ("hidden_size", "positive integer")),
    ("hidden-size-zero", "llama", _set(hidden_size=0), ("hidden_size",)),
    ("layers-negative", "llama", _set(num_hidden_layers=-1), ("num_hidden_layers",)),
    # A per-layer list was built from it before any tensor was read: MemoryError.
    ("layers-beyond-any-model", "llama", _set(num_hidden_layers=99999999999), ("num_hidden_layers", "at most 65536")),
    # Each of these ended in a TypeError's or an allocator's traceback (a sweep of every key the readers take).
    ("heads-null", "llama", _set(num_attention_heads=None), ("num_attention_heads", "positive integer")),
    ("architectures-not-a-list", "llama", _set(architectures="LlamaForCausalLM"), ("'architectures'", "list")),
    ("model-type-an-object", "llama", _set(model_type={"a": 1}), ("'model_type'", "string")),
    ("partial-rotary-huge", "llama", _set(partial_rotary_factor=99999999999), ("partial_rotary_factor", "(0, 1]")),
    # Read only mid-run, where the stop set is built from it: sorted([1, "a"]) raised there.
    ("eos-a-list-with-a-string", "llama", _set(eos_token_id=[1, "a"]), ("'eos_token_id' must be a token id",)),
    ("vocab-beyond-any-model", "llama", _set(vocab_size=2 ** 40), ("vocab_size", "at most 2147483647")),
    ("vocab-float", "llama", _set(vocab_size=300.5), ("vocab_size",)),
    ("heads-bool", "llama", _set(num_attention_heads=True), ("num_attention_heads",)),
    ("kv-heads-not-dividing", "llama", _set(num_key_value_heads=3), ("num_key_value_heads",)),
    ("hidden-not-multiple-of-heads", "llama", _set(hidden_size=66, head_dim=None), ("hidden_size",)),
    ("rope-yarn", "llama", _rope(rope_type="yarn"), ("rope type 'yarn'", "not supported")),
    ("rope-llama3-no-factor", "llama", lambda c: c["rope_parameters"].pop("factor") and None, ("factor",)),
    ("rope-theta-string", "llama", _rope(rope_theta="abc"), ("rope_theta",)),
    ("rope-theta-negative", "llama", _rope(rope_theta=-1.0), ("rope_theta",)),
    # Both spellings of the RoPE keys at once (4.x's beside 5.x's): read together, refused where they disagree.
    ("rope-scaling-beside-default-parameters", "llama",
     _set(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     ("RoPE scaling is given twice", "rope_parameters", "yarn")),
    ("rope-scaling-type-beside-parameters", "llama",
     _set(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_scaling={"type": "linear", "factor": 2.0}),
     ("RoPE scaling is given twice", "linear")),
    ("rope-theta-twice", "llama", _set(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_theta=1e4),
     ("rope_theta is given twice", "500000.0", "10000.0")),
    ("rope-scaling-not-an-object", "llama", _set(rope_scaling="yarn"), ("rope_scaling", "object")),
    ("partial-rotary-twice", "llama",
     _set(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
          partial_rotary_factor=1.0), ("partial_rotary_factor is given twice",)),
    ("model-type-unsupported", "llama", _set(model_type="bert"), ("bert", "not supported")),
    ("model-type-missing", "llama", _drop("model_type"), ("model_type",)),
    ("intermediate-size-missing", "llama", _drop("intermediate_size"), ("intermediate_size",)),
    ("tie-flag-string", "qwen2", _set(tie_word_embeddings="yes"), ("tie_word_embeddings",)),
    ("experts-per-token-above-experts", "llama", _set(num_local_experts=2, num_experts_per_tok=4),
     ("num_experts_per_tok",)),
    # config.json disagreeing with the tensors
    ("kv-heads-4-while-tensors-hold-2", "llama", _set(num_key_value_heads=4), ("k_proj", "[64, 64]", "[32, 64]")),
    ("intermediate-256-vs-128", "llama", _set(intermediate_size=256), ("gate_proj", "[256, 64]")),
    ("hidden-128-vs-64", "llama", _set(hidden_size=128, head_dim=16), ("embed_tokens", "[300, 128]")),
    ("vocab-400-vs-300", "llama", _set(vocab_size=400), ("embed_tokens", "[400, 64]")),
    ("more-layers-than-tensors", "llama", _set(num_hidden_layers=6), ("model.layers.4.", "missing")),
    ("fewer-layers-than-tensors", "llama", _set(num_hidden_layers=2), ("model.layers.2.", "not part of")),
    ("untied-qwen2-without-lm-head", "qwen2", _set(tie_word_embeddings=False), ("lm_head.weight", "missing")),
    ("tied-llama-with-its-own-lm-head", "llama", _set(tie_word_embeddings=True), ("lm_head.weight", "differs")),
    ("phi3-heads-vs-fused-qkv", "phi3", _set(num_key_value_heads=4), ("qkv_proj",)),
    # Keys that change the math and were read by nobody: megatron ran SiLU (parity: 23-66 % of the logits' RMS off).
    ("hidden-act-gelu", "llama", _set(hidden_act="gelu"), ("hidden_act 'gelu' is not supported for llama",)),
    # transformers biases o_proj too, which megatron cannot take alone; before, the bias tensors were "not part of" it.
    ("attention-bias-on-llama", "llama", _set(attention_bias=True), ("llama 'attention_bias' must be false", "o_proj")),
    # DeepSeek-V3's own checkpoints: float8 weights beside their block scales (`weight_scale_inv`).
    ("fp8-quantized", "llama", _set(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                          "weight_block_size": [128, 128]}),
     ("quantization_config (fp8)", "dequantize")),
    ("phi3-window-string", "phi3", _set(sliding_window="2047"), ("sliding_window", "positive integer or null")),
    ("qwen2-window-zero", "qwen2", _set(use_sliding_window=True, sliding_window=0, layer_types=None),
     ("sliding_window",)),
]


@pytest.mark.parametrize("case,family,edit,words", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_or_disagreeing_config_refused(fault_models, tmp_path, capsys, case, family, edit, words):
    hf = copy_model(fault_models[family], tmp_path / "hf")
    edit_json(hf / "config.json", edit)
    out = tmp_path / "out"
    assert_refused(["convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", "2"], capsys, words, out, (hf,))


def _transpose(name):
    return lambda tensors: tensors.update({name: tensors[name].t()})


def _shorten(name, rows):
    return lambda tensors: tensors.update({name: tensors[name][:rows]})


# (case id, edit of the tensors dict, words)
TENSOR_CASES = [
    ("down-proj-transposed", _transpose(L0 + "mlp.down_proj.weight"), ("down_proj", "[64, 128]", "[128, 64]")),
    ("norm-wrong-length", _shorten("model.layers.2.input_layernorm.weight", 32), ("input_layernorm", "[64]")),
    ("q-proj-wrong-shape", _shorten(L0 + "self_attn.q_proj.weight", 48), ("q_proj", "[64, 64]", "[48, 64]")),
    ("k-proj-extra-rows", lambda t: t.update({L0 + "self_attn.k_proj.weight": torch.zeros(48, 64)}), ("k_proj",)),
    ("o-proj-missing", lambda t: t.pop("model.layers.3.self_attn.o_proj.weight"), ("o_proj", "missing")),
    ("final-norm-missing", lambda t: t.pop("model.norm.weight"), ("model.norm.weight", "missing")),
    ("unexpected-tensor", lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}), ("mlp.extra",)),
    ("vision-tower-tensor", lambda t: t.update({"vision_tower.proj.weight": torch.zeros(2, 2)}), ("vision_tower",)),
    ("integer-tensor", lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}),
     ("model.norm.weight", "floating")),
    ("scalar-for-matrix", lambda t: t.update({L0 + "mlp.up_proj.weight": torch.zeros(())}), ("up_proj", "[]")),
]


@pytest.mark.parametrize("case,edit,words", TENSOR_CASES, ids=[c[0] for c in TENSOR_CASES])
def test_tensors_not_matching_config_refused(fault_models, tmp_path, capsys, case, edit, words):
    hf = copy_model(fault_models["llama"], tmp_path / "hf")
    edit_tensors(hf, edit)
    out = tmp_path / "out"
    assert_refused(["convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", "2", "--pp", "2"], capsys, words,
                   out, (hf,))


LAYOUT_CASES = [
    (["--tp", "-2"], ("--tp", "-2")),
    (["--pp", "-1"], ("--pp", "-1")),
    (["--ep", "0"], ("--ep", "0")),
    (["--tp", "0"], ("--tp", "0")),
    (["--pp", "0"], ("--pp", "0")),
    (["--tp", "3"], ("--tp=3", "num_key_value_heads")),
    (["--pp", "3"], ("--pp=3", "num_hidden_layers")),
    (["--ep", "2"], ("--ep=2", "experts")),
]


@pytest.mark.parametrize("args,words", LAYOUT_CASES, ids=[" ".join(c[0]) for c in LAYOUT_CASES])
def test_bad_layout_numbers_refused(fault_models, tmp_path, capsys, args, words):
    out = tmp_path / "out"
    assert_refused(["convert", "hf-to-mcore", "--hf", fault_models["llama"], "--out", out, *args], capsys, words, out,
                   (fault_models["llama"],))


def _out_same(hf, tmp_path):
    return hf


def _out_inside(hf, tmp_path):
    return hf / "megatron"


def _out_containing(hf, tmp_path):
    return hf.parent


def _out_symlink_to_source(hf, tmp_path):
    (tmp_path / "link").symlink_to(hf)
    return tmp_path / "link"


def _out_inside_via_symlink(hf, tmp_path):
    (tmp_path / "link").symlink_to(hf)
    return tmp_path / "link" / "converted"


@pytest.mark.parametrize("where", [_out_same, _out_inside, _out_containing, _out_symlink_to_source,
                                   _out_inside_via_symlink], ids=lambda f: f.__name__.removeprefix("_out_"))
def test_out_overlapping_the_source_refused_even_with_overwrite(fault_models, tmp_path, capsys, where):
    hf = copy_model(fault_models["llama"], tmp_path / "models" / "hf")
    out = where(hf, tmp_path)
    assert_refused(["convert", "hf-to-mcore", "--hf", hf, "--out", out, "--overwrite"], capsys, ("overlaps",), out,
                   (hf,))
    assert (hf / "model.safetensors").is_file()


def test_existing_output_refused_without_overwrite(fault_models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_refused(["convert", "hf-to-mcore", "--hf", fault_models["llama"], "--out", out], capsys,
                   ("already exists", "--overwrite"), out, (fault_models["llama"], out))


def test_output_that_is_a_file_refused(fault_models, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a folder")
    assert_refused(["convert", "hf-to-mcore", "--hf", fault_models["llama"], "--out", out, "--overwrite"], capsys,
                   ("not a folder",), out, (fault_models["llama"],))
    assert out.read_text() == "not a folder"


def test_output_under_a_file_refused(fault_models, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker / "out"
    code, err = run(["convert", "hf-to-mcore", "--hf", fault_models["llama"], "--out", out], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "blocker" in err, err
    assert blocker.read_text() == "x"


def test_missing_input_folder_refused(tmp_path, capsys):
    out = tmp_path / "out"
    assert_refused(["convert", "hf-to-mcore", "--hf", tmp_path / "nope", "--out", out], capsys,
                   ("config.json", "not found"), out, ())


def test_config_only_folder_refused(fault_models, tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text((fault_models["llama"] / "config.json").read_text())
    out = tmp_path / "out"
    assert_refused(["convert", "hf-to-mcore", "--hf", hf, "--out", out], capsys, ("model.safetensors",), out, (hf,))


def _cli_in_subprocess(*args, preexec_fn=None):
    command = [sys.executable, "-m", "verl_mega.cli", *map(str, args)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=preexec_fn)


def _convert_in_subprocess(hf, out, *args):
    return _cli_in_subprocess("convert", "hf-to-mcore", "--hf", hf, "--out", out, *args)


@pytest.mark.parametrize("command", ["convert", "export"])
def test_disk_full_is_one_line_naming_the_file(fault_models, tmp_path, command):
    """A write that fails (here: the file-size limit, as ENOSPC or a quota would) is exit 2 naming the file."""
    import resource

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    out = tmp_path / "out"
    source = fault_models["llama" if command == "convert" else "llama_tp2pp2"]
    before = tree_digest(source)
    args = (["convert", "hf-to-mcore", "--hf", source] if command == "convert" else ["export", "--ckpt", source])
    process = _cli_in_subprocess(*args, "--out", out, preexec_fn=limit_file_size)
    _, err = process.communicate(timeout=300)
    lines = [line for line in err.strip().splitlines() if "arn" not in line]
    assert process.returncode == 2, err
    written = "model_optim_rng.pt" if command == "convert" else "part-0.tmp"
    assert len(lines) == 1 and written in lines[0] and "too large" in lines[0].lower(), err
    assert sorted(tmp_path.iterdir()) == [], "a partial output or temp folder was left"
    assert tree_digest(source) == before


@pytest.mark.slow
def test_sigkill_during_conversion_keeps_the_previous_output(fault_models, tmp_path):
    """Killed at random points of an --overwrite conversion, `out` is always a whole checkpoint (the previous one
    or the new one, never a mix or nothing); the next run cleans up the killed run's temp folder."""
    from verl_mega.checkpoint.manifest import Manifest
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    hf, out = fault_models["llama"], tmp_path / "out"
    convert_hf_to_mcore(hf, out, tp=1)
    previous = tree_digest(out)
    started = time.monotonic()
    _convert_in_subprocess(hf, tmp_path / "timing", "--tp", "2").communicate(timeout=300)
    duration = time.monotonic() - started
    generator = torch.Generator().manual_seed(int(os.environ.get("FAULT_SEED", "0")))
    outcomes = set()
    for _ in range(3):
        delay = (0.5 + 0.5 * float(torch.rand((), generator=generator))) * duration  # past the imports, mostly
        process = _convert_in_subprocess(hf, out, "--tp", "2", "--overwrite")
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.communicate()
        manifest = Manifest.read(out)
        if manifest.tp == 1:
            assert tree_digest(out) == previous, "the previous output was modified"
            outcomes.add("previous")
        else:
            assert tree_digest(out) == tree_digest(tmp_path / "timing"), "the new output is incomplete"
            outcomes.add("new")
        convert_hf_to_mcore(hf, out, tp=1, overwrite=True)
        assert tree_digest(out) == previous
        assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "timing"], "a temp folder was left"
    assert outcomes


def test_created_folders_honour_the_umask(fault_models, tmp_path):
    old = os.umask(0o022)
    try:
        code = run_quiet(["convert", "hf-to-mcore", "--hf", fault_models["llama"], "--out", tmp_path / "a" / "out"])
    finally:
        os.umask(old)
    assert code == 0
    for folder in (tmp_path / "a", tmp_path / "a" / "out", tmp_path / "a" / "out" / "iter_0000000"):
        assert folder.stat().st_mode & 0o777 == 0o755, folder


def run_quiet(argv) -> int:
    from verl_mega.cli import main

    return main([str(arg) for arg in argv])


def test_remote_code_is_not_carried_unless_asked(fault_models, tmp_path, capsys):
    hf = copy_model(fault_models["llama"], tmp_path / "hf")
    (hf / "modeling_evil.py").write_text("import os\nos.system('touch pwned')\n")
    edit_json(hf / "config.json", _set(auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}))
    edit_json(hf / "tokenizer_config.json", _set(auto_map={"AutoTokenizer": ["modeling_evil.Tok", None]}))
    for keep, name in ((False, "plain"), (True, "kept")):
        flag = ["--keep-remote-code"] if keep else []
        assert run(["convert", "hf-to-mcore", "--hf", hf, "--out", tmp_path / name, *flag], capsys)[0] == 0
        assert run(["convert", "mcore-to-hf", "--ckpt", tmp_path / name, "--out", tmp_path / f"{name}_hf", *flag],
                   capsys)[0] == 0
        manifest = json.loads((tmp_path / name / "verl_mega_manifest.json").read_text())
        for folder in (tmp_path / name / "hf_assets", tmp_path / f"{name}_hf"):
            assert (folder / "modeling_evil.py").exists() == keep, folder
            tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
            assert ("auto_map" in tokenizer_config) == keep, folder
        exported = json.loads((tmp_path / f"{name}_hf" / "config.json").read_text())
        assert ("auto_map" in exported) == keep and ("auto_map" in manifest["hf_config"]) == keep
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "plain_hf")  # loads without trust_remote_code


@pytest.mark.slow
def test_a_conversion_that_fails_its_verify_leaves_no_checkpoint(fault_models, tmp_path, capsys):
    """--verify judged by a bound no conversion meets (exact logits are not expected across the two stacks):
    exit 1, the parity line printed, and the checkpoint written for it removed, so nothing unverified trains."""
    out = tmp_path / "out"
    code, err = run(["convert", "hf-to-mcore", "--hf", fault_models["llama"], "--out", out, "--verify",
                     "--tolerance", "1e-30"], capsys)
    assert code == 1, err
    assert f"removed {out}" in err and not out.exists()
    assert sorted(tmp_path.iterdir()) == []
