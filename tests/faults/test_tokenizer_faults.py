"""A model folder's tokenizer files, hostile: transformers' loader raised TypeErrors and IndexErrors on 50 of a
sweep's cases (a list for `eos_token`, a number for `tokenizer_class`, an empty `auto_map`), which reached users as
tracebacks; `data.tokenizer.load_tokenizer` makes each a ValueError naming the folder, one line in the pre-flight
check."""
import json
import shutil

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.trainer.preflight import preflight_check

from ..test_config import good_overrides, prompt_file  # noqa: F401

KEYS = ("tokenizer_class", "model_max_length", "chat_template", "added_tokens_decoder", "eos_token", "pad_token",
        "bos_token", "unk_token", "padding_side", "truncation_side", "auto_map", "extra_special_tokens", "backend")
HOSTILE = (None, -1, 0, 2 ** 40, "x", "", 1.5, True, [], {}, {"a": 1}, [1, "a"])


def _hostile_copy(source, folder, key, value):
    shutil.copytree(source, folder, dirs_exist_ok=True)
    config = json.loads((source / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, key: value}))
    return folder


def test_the_preflight_check_names_the_model_folder_in_one_line(tiny_models, prompt_file, tmp_path):  # noqa: F811
    model = _hostile_copy(tiny_models["qwen2"], tmp_path / "model", "eos_token", [1, "a"])
    with pytest.raises(ConfigError) as err:
        preflight_check(load_config(None, good_overrides(tiny_models, prompt_file) + [f"model.hf_path={model}"]),
                        world_size=4)
    line = next(line for line in str(err.value).splitlines() if "tokenizer files cannot be loaded" in line)
    assert line.startswith(f"  - model.hf_path: {model}: its tokenizer files cannot be loaded (TypeError: ")


@pytest.mark.parametrize("name, damage", [
    ("tokenizer.json", b"{garbled"),  # transformers' JSONDecodeError named no file: '<folder>: Expecting ...'
    ("tokenizer_config.json", b"\xff\xfe"),  # and its UnicodeDecodeError none either
])
def test_a_tokenizer_file_that_is_not_json_is_named(tiny_models, tmp_path, name, damage):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], folder)
    (folder / name).write_bytes(damage)
    with pytest.raises(ValueError) as err:
        load_tokenizer(folder)
    assert str(err.value).startswith(f"{folder / name}: not valid JSON text ("), err.value
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_every_hostile_value_is_a_value_error_naming_the_folder(tiny_models, tmp_path):
    tracebacks = []
    for key in KEYS:
        for value in HOSTILE:
            folder = _hostile_copy(tiny_models["llama"], tmp_path / "model", key, value)
            try:
                load_tokenizer(folder)
            except ValueError as err:
                assert str(err).startswith(f"{folder}: "), err
            except Exception as err:  # noqa: BLE001 - what is collected here is the failure
                tracebacks.append(f"{key}={value!r}: {type(err).__name__}: {err}")
    assert not tracebacks, f"{len(tracebacks)} tracebacks, e.g. " + "; ".join(tracebacks[:5])


@pytest.mark.parametrize("template, says", [
    ("{% for %}", "Expected an expression"),  # jinja's syntax error
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),  # Gemma's, on a system turn
])
def test_a_chat_template_that_cannot_render_is_one_line_before_the_run(tiny_models, prompt_file, tmp_path,  # noqa: F811
                                                                       template, says):
    model = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], model)
    (model / "chat_template.jinja").write_text(template)
    with pytest.raises(ConfigError) as err:
        preflight_check(load_config(None, good_overrides(tiny_models, prompt_file) + [f"model.hf_path={model}"]),
                        world_size=4)
    line = next(line for line in str(err.value).splitlines() if "chat template" in line)
    assert line.startswith("  - data.train_files: row 0: the tokenizer's chat template failed on these messages: ")
    assert says in line
