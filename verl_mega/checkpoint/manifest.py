"""The small JSON that travels with every verl_mega checkpoint: what model, which layout, which names."""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_origin, get_type_hints

from verl_mega.models import HFModelConfig, family_for
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.layout import LARGEST_WORLD

from .roles import check_role

MANIFEST_NAME = "verl_mega_manifest.json"
HF_ASSETS_DIR = "hf_assets"  # tokenizer and generation files copied from the source HF folder
FORMATS = ("megatron_legacy", "torch_dist")


@dataclass
class Manifest:
    family: str
    hf_config: dict[str, Any]
    format: str
    tp: int
    pp: int
    ep: int
    dtype: str
    tied_embeddings: bool
    padded_vocab_size: int
    iteration: int = 0
    role: str = "actor"  # "critic": a value head instead of the LM head; absent from older manifests
    family_spec: str | None = None  # "package.module:SPEC" of a family declared outside verl_mega
    extra: dict[str, Any] = field(default_factory=dict)
    # HF tensors the model does not read, carried in hf_assets/ (`unread_tensors`); None: converted before they were.
    unread_tensors: list[str] | None = None
    # Virtual pipeline stages of the ranks that wrote a legacy checkpoint: each rank's shard then holds its model
    # chunks' tensors, named as `sharding.rank_slots` names them; absent from older manifests.
    vpp: int = 1

    def write(self, ckpt_dir: str | Path) -> None:
        (Path(ckpt_dir) / MANIFEST_NAME).write_text(json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def read(cls, ckpt_dir: str | Path, family_spec: str | None = None) -> "Manifest":
        """The checkpoint's manifest, checked; `family_spec` replaces the family spec it records (e.g. after
        the spec's module moved), before the family is checked against hf_config."""
        path = Path(ckpt_dir) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {ckpt_dir} is not a verl_mega checkpoint (convert one with "
                "`verl-mega convert hf-to-mcore`)"
            )
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if family_spec is not None and isinstance(data, dict):
            data = {**data, "family_spec": family_spec}
        try:
            return cls(**_checked_fields(data, Path(ckpt_dir), spec_named_by_user=family_spec is not None))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


# Keys that may be null: a "package.module:SPEC" string, the carried tensors' names.
_OPTIONAL = {"family_spec": str, "unread_tensors": list}


def _checked_fields(data, ckpt_dir: Path, spec_named_by_user: bool = False) -> dict[str, Any]:
    """The manifest's fields, each of the type and range the loaders rely on; anything else is refused by name.
    The family spec it records is imported only if the user or an installed plugin names it too, unless
    `spec_named_by_user` (the caller replaced it with one from the command line or config)."""
    if not isinstance(data, dict):
        raise ValueError(f"must hold a JSON object, not a {type(data).__name__}")
    known = {f.name: f for f in fields(Manifest)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown key '{unknown[0]}'")
    for name, spec in known.items():
        if name not in data and spec.default is MISSING and spec.default_factory is MISSING:
            raise ValueError(f"missing key '{name}'")
    hints = get_type_hints(Manifest)
    for name, value in data.items():
        wanted = get_origin(hints[name]) or hints[name]
        if name in _OPTIONAL:  # absent, null, or of the type named
            wanted = _OPTIONAL[name] if value is not None else type(None)
        if type(value) is not wanted:
            raise ValueError(f"key '{name}' must be of type {wanted.__name__}, got {value!r}")
    if not all(isinstance(name, str) for name in data.get("unread_tensors") or []):
        raise ValueError(f"key 'unread_tensors' must list tensor names, got {data['unread_tensors']!r}")
    if data["format"] not in FORMATS:
        raise ValueError(f"unknown format {data['format']!r}; expected one of {FORMATS}")
    if data["dtype"] not in DTYPES:
        raise ValueError(f"key 'dtype' must be one of {', '.join(DTYPES)}, got {data['dtype']!r}")
    check_role(data.get("role", "actor"))
    for name in ("tp", "pp", "ep", "padded_vocab_size", "vpp"):
        if data.get(name, 1) < 1:
            raise ValueError(f"key '{name}' must be >= 1, got {data[name]}")
    if data["tp"] * data["pp"] * data["ep"] > LARGEST_WORLD:  # its shards are looked up rank by rank: 2**40 hung
        raise ValueError(f"keys 'tp' x 'pp' x 'ep' = {data['tp'] * data['pp'] * data['ep']} ranks wrote it; a "
                         f"checkpoint holds the shards of at most {LARGEST_WORLD}")
    if data.get("iteration", 0) < 0:
        raise ValueError(f"key 'iteration' must be >= 0, got {data['iteration']}")
    try:
        hf_config = HFModelConfig.from_dict(data["hf_config"])
        family = family_for(hf_config, data.get("family_spec"), ckpt_dir, recorded=not spec_named_by_user)
    except ValueError as err:
        raise ValueError(f"key 'hf_config': {str(err).removeprefix('config.json: ')}") from None
    vpp = data.get("vpp", 1)
    if vpp > 1 and (data["pp"] == 1 or hf_config.num_layers % (data["pp"] * vpp)):
        raise ValueError(f"key 'vpp' {vpp} needs pp > 1 and pp x vpp dividing the model's {hf_config.num_layers} "
                         f"layers (pp={data['pp']})")
    if data["family"] != family.name:
        raise ValueError(f"key 'family' says {data['family']!r} but hf_config is a {family.name} model")
    if data["padded_vocab_size"] < hf_config.vocab_size or data["padded_vocab_size"] % data["tp"]:
        raise ValueError(f"key 'padded_vocab_size' {data['padded_vocab_size']} must be >= the vocabulary "
                         f"({hf_config.vocab_size}) and a multiple of tp={data['tp']}")
    return data

