"""The docs' generated references match the code, and every config key carries its doc.

`docs/gen_reference.py` writes docs/reference/config.md from the config dataclasses and docs/reference/cli.md
from the argument parsers; a change to either without `make docs` (or `python docs/gen_reference.py`) fails here.
"""
import argparse
import dataclasses
import re

import pytest

from docs import gen_reference
from verl_mega.config import schema


@pytest.mark.parametrize("page", sorted(gen_reference.PAGES))
def test_committed_reference_is_what_the_code_generates(page):
    committed = (gen_reference.REFERENCE_DIR / page).read_text()
    assert committed == gen_reference.PAGES[page](), (
        f"docs/reference/{page} is out of date: run `python docs/gen_reference.py` and commit the result")


def test_every_config_key_has_a_doc():
    keys = list(gen_reference.config_keys(schema.TrainConfig()))
    assert len(keys) > 100
    assert gen_reference.undocumented(keys) == []


def test_a_field_without_a_doc_is_reported_and_fails_the_generator(monkeypatch):
    @dataclasses.dataclass
    class Group:
        documented: int = 1
        """Has its doc."""
        bare: str = "x"

    @dataclasses.dataclass
    class Top:
        group: Group = dataclasses.field(default_factory=Group)

    keys = list(gen_reference.config_keys(Top()))
    assert [(key.name, key.doc) for key in keys] == [("group.documented", "Has its doc."), ("group.bare", "")]
    assert gen_reference.undocumented(keys) == ["group.bare"]
    monkeypatch.setattr(schema, "TrainConfig", Top)
    with pytest.raises(ValueError, match="group.bare"):
        gen_reference.render_config_reference()


def test_inherited_fields_keep_their_docs_and_nested_defaults():
    keys = {key.name: key for key in gen_reference.config_keys(schema.TrainConfig())}
    assert keys["critic.micro_batch_size"].owner is schema.UpdateSchedule
    assert keys["critic.micro_batch_size"].doc == keys["actor.micro_batch_size"].doc != ""
    assert keys["critic.optim.lr"].default == 1e-5 and keys["actor.optim.lr"].default == 1e-6
    assert keys["actor.loss.policy_loss"].choices == gen_reference.POLICY_LOSSES.names()


def test_every_choice_names_a_config_field():
    for owner, name in gen_reference.CHOICES:
        assert name in {item.name for item in dataclasses.fields(owner)}, f"{owner.__name__}.{name}"


def test_cli_reference_covers_every_command():
    page = (gen_reference.REFERENCE_DIR / gen_reference.CLI_PAGE).read_text()
    for words in gen_reference.command_paths(gen_reference.cli.build_parser()):
        assert f"## `{' '.join(('verl-mega', *words))}`" in page
    assert "usage: verl-mega launch slurm" in page and "--gpus-per-node" in page
    assert "usage: verl-mega train" in page and "overrides" in page


def test_every_config_table_row_has_five_cells():
    """A pipe in a type or doc is escaped, so no row of the committed page splits into extra cells."""
    page = (gen_reference.REFERENCE_DIR / gen_reference.CONFIG_PAGE).read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(list(gen_reference.config_keys(schema.TrainConfig())))
    for row in rows:
        outside_code = re.sub(r"`[^`]*`", "", row).replace("\\|", "")
        assert outside_code.count("|") == 6, row


def test_an_alias_is_listed_once():
    parser = argparse.ArgumentParser(prog="tool")
    commands = parser.add_subparsers()
    commands.add_parser("preference", aliases=["dpo"])
    commands.add_parser("sft")
    assert list(gen_reference.command_paths(parser)) == [(), ("preference",), ("sft",)]
