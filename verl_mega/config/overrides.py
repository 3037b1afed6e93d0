"""Dotted `key.sub=value` overrides, typed by the schema, never re-read as YAML.

A value arrives as the exact string given (from the command line, `docker/train.sh`'s environment, the API), so
it is typed by the field it sets, not by YAML's reading of it:
- a `str` field takes the text after the first `=` verbatim: spaces, `#`, quotes, trailing blanks and `${` are
  part of the value (`model.hf_path=/m/model #v2` is that path, not `/m/model` and a comment);
- a number or boolean field takes the text as that type (OmegaConf's conversion: `1e-6`, `true`), and a field that
  may be empty takes `null` as None;
- a list field takes a YAML flow list (`[a, b]`), or any other text as a list of that one value, verbatim for a
  list of strings (`data.train_files=/d/my #1.jsonl`);
- a dict field (and a key inside one) and a key the schema does not know keep OmegaConf's YAML reading; an unknown
  key is then refused by name when the layers merge.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, get_args, get_origin, get_type_hints

from omegaconf import OmegaConf

from .errors import UserError

_UNTYPED = object()  # the schema gives no type to follow: OmegaConf's YAML reading of the value applies


def override_layer(schema_class: type, overrides: list[str]):
    """One OmegaConf layer holding `overrides` in order (a later one wins), each typed by `schema_class`'s field."""
    layer = OmegaConf.create()
    for item in overrides:
        key, _, text = item.partition("=")
        value = typed_value(schema_class, key, text)
        if value is _UNTYPED:
            try:
                parsed = OmegaConf.from_dotlist([item])
            except Exception as err:  # omegaconf's YAML reading of a flow value: any error is the value's
                raise UserError(f"override {item!r}: the value is not valid YAML "
                                f"({str(err).splitlines()[0]})") from None
            layer = OmegaConf.merge(layer, parsed)
        else:
            OmegaConf.update(layer, key, value, force_add=True)
    return layer


def typed_value(schema_class: type, key: str, text: str) -> Any:
    """The value `text` gives the field `key` names, or _UNTYPED where the schema has no type to follow."""
    annotation = field_type(schema_class, key)
    if annotation is None:
        return _UNTYPED
    wanted, optional = _unwrap_optional(annotation)
    if optional and text == "null":
        return None
    if wanted is str:
        return verbatim(text)
    if get_origin(wanted) is list:
        if text.lstrip().startswith("["):
            return _UNTYPED
        (element,) = get_args(wanted) or (Any,)
        return [verbatim(text) if element is str else text]
    if wanted in (int, float, bool):
        return text  # OmegaConf's typed nodes convert and check it, naming the key on failure
    return _UNTYPED


# OmegaConf reads any integer as a boolean (`critic.enable: 2` is true); only these spellings are taken here.
BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "y", "n", "1", "0"})


def loose_booleans(schema_class: type, layer, prefix: str = "") -> list[str]:
    """The dotted keys of the OmegaConf `layer` (a YAML file's, the overrides', the API's values) that set a
    boolean field of `schema_class` to anything but true/false (or yes/no, on/off, 1/0), each with its value."""
    found = []
    for key, value in layer.items_ex(resolve=False) if OmegaConf.is_dict(layer) else ():
        name = f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            found += loose_booleans(schema_class, value, f"{name}.")
        elif _unwrap_optional(field_type(schema_class, name) or object)[0] is bool and value is not None \
                and not isinstance(value, bool) and str(value).strip().lower() not in BOOLEAN_WORDS:
            found.append(f"{name}={value!r}")
    return found


def unknown_keys(schema_class: type, layer, prefix: str = "") -> list[str]:
    """Every dotted key of the OmegaConf `layer` that `schema_class` lacks, each with the closest field of its
    level where one is close ("data.train_batch_size (batch_size?)"): merging would name only the first, and a
    config written for another toolkit (verl's) has many."""
    found = []
    fields = {f.name: f for f in dataclasses.fields(schema_class)}
    hints = get_type_hints(schema_class)
    for key, value in layer.items_ex(resolve=False) if OmegaConf.is_dict(layer) else ():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            found.append(f"{name} ({close[0]}?)" if close else name)
            continue
        nested = _unwrap_optional(hints[key])[0]
        if OmegaConf.is_dict(value) and isinstance(nested, type) and dataclasses.is_dataclass(nested):
            found += unknown_keys(nested, value, f"{name}.")
    return found


def verbatim(text: str) -> str:
    """`text` as a string OmegaConf keeps as it is: `${` would be read as an interpolation."""
    return text.replace("${", "\\${")


def field_type(schema_class: type, key: str):
    """The annotation of the dataclass field a dotted key names; None if some part is unknown or lies inside a
    dict field (free-form)."""
    current: Any = schema_class
    for part in key.split("."):
        if not (isinstance(current, type) and dataclasses.is_dataclass(current)):
            return None
        hints = get_type_hints(current)
        if part not in hints or part not in {f.name for f in dataclasses.fields(current)}:
            return None
        current = hints[part]
    return None if dataclasses.is_dataclass(current) else current


def _unwrap_optional(annotation) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed) for `X | None` / Optional[X]; Any stays untyped."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        others = [arg for arg in get_args(annotation) if arg is not type(None)]
        optional = len(others) < len(get_args(annotation))
        return (others[0] if len(others) == 1 else Any), optional
    return annotation, False
