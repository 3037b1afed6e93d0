"""Write the docs' config and CLI references from the code: `python docs/gen_reference.py` (`make docs` runs it).

- `docs/reference/config.md`: every key of the config dataclasses (`verl_mega/config/schema.py`) by the dotted
  name a user overrides it with, its type, default, allowed values (read from the registries and tables that
  the pre-flight check holds a config against) and its doc: the string literal written right after the field
  (an attribute docstring), so the doc lives with the field. A field without one is an error.
- `docs/reference/cli.md`: the `--help` of every `verl-mega` command, walked from the command line's parser
  and printed by the very parsers that parse it (the delegated commands' own modules included).

`tests/test_docs.py` regenerates both and fails when they differ from the committed pages.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import html
import inspect
import io
import os
import sys
import textwrap
from pathlib import Path
from typing import Iterator

from verl_mega import cli
from verl_mega.algorithms import (
    ADV_ESTIMATORS, BYPASS_LOSS_TYPES, EXHAUSTED_POLICIES, IS_LEVELS, KL_CONTROLLERS, KL_ESTIMATORS,
    LOSS_AGG_MODES, POLICY_LOSSES, PREFERENCE_LOSSES, RS_OPTIONS,
)
from verl_mega.config import schema
from verl_mega.config.ranges import declared_ranges
from verl_mega.data.prompts import TRUNCATION_SIDES
from verl_mega.models.builder import DTYPES
from verl_mega.roles.megatron_step import PACKING_SETTINGS
from verl_mega.roles.routing_replay import REPLAY_SETTINGS
from verl_mega.rewards.registry import REWARD_FUNCTIONS
from verl_mega.roles.trainable import LR_DECAY_STYLES
from verl_mega.rollout.agent_loop import TOOL_CALL_FORMATS
from verl_mega.rollout.factory import ENGINES
from verl_mega.rollout.quantization import FORMATS as QUANTIZATION_FORMATS
from verl_mega.trainer.rl.schedule import PARTIAL_POLICIES, ROLLOUT_MODES

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
CONFIG_PAGE = "config.md"
CLI_PAGE = "cli.md"
# argparse wraps help to the terminal's width; a fixed one keeps the page the same on every machine.
HELP_COLUMNS = "100"

# (dataclass, field) -> the values the pre-flight check accepts, from their owners (never retyped here).
CHOICES = {
    (schema.TrainConfig, "job"): schema.JOBS,
    (schema.ModelConfig, "dtype"): list(DTYPES),
    (schema.DataConfig, "truncation"): TRUNCATION_SIDES,
    (schema.RolloutConfig, "engine"): ENGINES,
    (schema.RolloutConfig, "dtype"): ["auto", *DTYPES],
    (schema.RolloutConfig, "quantization"): QUANTIZATION_FORMATS,
    (schema.RolloutConfig, "mode"): ROLLOUT_MODES,
    (schema.RolloutConfig, "partial"): PARTIAL_POLICIES,
    (schema.MultiTurnConfig, "tool_call_format"): TOOL_CALL_FORMATS,
    (schema.UpdateSchedule, "use_packed_sequences"): PACKING_SETTINGS,
    (schema.ActorConfig, "router_replay"): REPLAY_SETTINGS,
    (schema.LoraConfig, "targets"): schema.LORA_TARGETS,
    (schema.LoraConfig, "init"): schema.LORA_INITS,
    (schema.OptimConfig, "lr_decay_style"): LR_DECAY_STYLES,
    (schema.PolicyLossConfig, "policy_loss"): POLICY_LOSSES.names(),
    (schema.PolicyLossConfig, "loss_agg_mode"): LOSS_AGG_MODES.names(),
    (schema.PolicyLossConfig, "kl_loss_type"): KL_ESTIMATORS.names(),
    (schema.PolicyLossConfig, "bypass_loss_type"): BYPASS_LOSS_TYPES,
    (schema.ValueLossConfig, "loss_agg_mode"): LOSS_AGG_MODES.names(),
    (schema.KLControlConfig, "type"): KL_CONTROLLERS,
    (schema.AlgorithmConfig, "adv_estimator"): ADV_ESTIMATORS.names(),
    (schema.AlgorithmConfig, "kl_penalty"): KL_ESTIMATORS.names(),
    (schema.AlgorithmConfig, "loss"): PREFERENCE_LOSSES.names(),
    (schema.RolloutCorrectionConfig, "rollout_is"): IS_LEVELS,
    (schema.RolloutCorrectionConfig, "rollout_rs"): RS_OPTIONS,
    (schema.RewardConfig, "function"): [*sorted(REWARD_FUNCTIONS), "module:function"],
    (schema.FilterGroupsConfig, "on_exhausted"): EXHAUSTED_POLICIES,
    (schema.TrainerConfig, "nonfinite"): schema.NONFINITE_POLICIES,
    (schema.RemoteRewardConfig, "kind"): schema.REMOTE_KINDS,
    (schema.TrainerConfig, "log_format"): schema.LOG_FORMATS,
}


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One overridable leaf of the config."""

    name: str  # dotted, as overridden: actor.optim.lr
    owner: type  # the dataclass that declares the field
    field: str
    type: str
    default: object
    doc: str

    @property
    def choices(self):
        return CHOICES.get((self.owner, self.field))


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (whitespace collapsed) for `cls` and its dataclass bases."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for statement, following in zip(body, body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _declaring_class(cls: type, name: str) -> type:
    """The dataclass in `cls`'s MRO whose own body declares field `name`."""
    return next(k for k in cls.__mro__ if name in k.__dict__.get("__annotations__", {}))


def config_keys(config: object, prefix: str = "") -> Iterator[ConfigKey]:
    """Every leaf of the dataclass instance `config` (its defaults), nested dataclasses walked in order."""
    docs = field_docs(type(config))
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        name = f"{prefix}{item.name}"
        if dataclasses.is_dataclass(value):
            yield from config_keys(value, f"{name}.")
        else:
            yield ConfigKey(name, _declaring_class(type(config), item.name), item.name, str(item.type), value,
                            docs.get(item.name, ""))


def undocumented(keys: list[ConfigKey]) -> list[str]:
    return [key.name for key in keys if not key.doc]


def _code(text: str) -> str:
    """A table cell's code; a pipe (`int | None`) is written as an entity, which no Markdown reads as a cell's
    end (an escaped pipe inside backticks shows its backslash in MkDocs, a bare one ends the cell on GitHub)."""
    if "|" in text:
        return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"
    return f"`{text}`"


def _default(value: object) -> str:
    if value == "???":
        return "required"
    return _code(repr(value))


def _key_row(key: ConfigKey) -> str:
    bound = declared_ranges(key.owner).get(key.field)
    choices = ", ".join(_code(str(c)) for c in key.choices) if key.choices else bound.describe() if bound else ""
    doc = key.doc.replace("|", "\\|")  # |A| in prose: an escaped pipe is text, a bare one ends the cell
    return f"| {_code(key.name)} | {_code(key.type)} | {_default(key.default)} | {choices} | {doc} |"


def render_config_reference() -> str:
    keys = list(config_keys(schema.TrainConfig()))
    missing = undocumented(keys)
    if missing:
        raise ValueError("config fields without a doc (write a string literal right after each field in "
                         f"verl_mega/config/schema.py): {', '.join(missing)}")
    lines = ["# Config reference", "",
             "<!-- Generated by docs/gen_reference.py from verl_mega/config/schema.py; do not edit. -->", "",
             "Every key of a run's config, by the dotted name a YAML file nests or an override names "
             "(`verl-mega train --config FILE.yaml actor.optim.lr=1e-6`, or `config={\"actor.optim.lr\": 1e-6}` "
             "in the [Python API](../python-api.md)). *Allowed* lists the values the pre-flight check accepts, "
             "read from the registries that hold them, or the range of a number (its class's `RANGES`).", ""]
    groups: dict[str, list[ConfigKey]] = {}
    for key in keys:
        groups.setdefault(key.name.split(".")[0] if "." in key.name else "", []).append(key)
    top = schema.TrainConfig()
    for group, members in groups.items():
        owner = type(getattr(top, group)) if group else schema.TrainConfig
        lines += [f"## {group or 'Top level'}", "", inspect.getdoc(owner), ""]
        lines += ["| Key | Type | Default | Allowed | Doc |", "| --- | --- | --- | --- | --- |"]
        lines += [_key_row(key) for key in members]
        lines.append("")
    return "\n".join(lines)


def command_paths(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command of the parser tree, parents before their subcommands; an alias (argparse lists it as
    another name of the same parser) is shown once, under the command's first name."""
    yield words
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from command_paths(sub, (*words, name))


def command_help(words: tuple[str, ...]) -> str:
    """What `verl-mega WORDS --help` prints, through the command line's own dispatch."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([*words, "--help"])
        except SystemExit:
            pass
    return out.getvalue().rstrip()


@contextlib.contextmanager
def fixed_help_width() -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def render_cli_reference() -> str:
    lines = ["# CLI reference", "",
             "<!-- Generated by docs/gen_reference.py from the argument parsers; do not edit. -->", "",
             "The `--help` of every `verl-mega` command. `train`, `sft`, `preference` and `launch` take dotted config "
             "overrides after their own options (see the [config reference](config.md)); the "
             "[CLI guide](../cli.md) says what each command is for.", ""]
    with fixed_help_width():
        for words in command_paths(cli.build_parser()):
            lines += [f"## `{' '.join(('verl-mega', *words))}`", "", "```text", command_help(words), "```", ""]
    return "\n".join(lines)


PAGES = {CONFIG_PAGE: render_config_reference, CLI_PAGE: render_cli_reference}


def main() -> int:
    REFERENCE_DIR.mkdir(exist_ok=True)
    for name, render in PAGES.items():
        (REFERENCE_DIR / name).write_text(render())
        print(f"wrote {REFERENCE_DIR / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
