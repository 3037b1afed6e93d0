"""The small JSON that travels with every verl_mega checkpoint: what model, which layout, which names."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    extra: dict[str, Any] = field(default_factory=dict)

    def write(self, ckpt_dir: str | Path) -> None:
        (Path(ckpt_dir) / MANIFEST_NAME).write_text(json.dumps(asdict(self), indent=2, sort_keys=True))

    @classmethod
    def read(cls, ckpt_dir: str | Path) -> "Manifest":
        path = Path(ckpt_dir) / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: {ckpt_dir} is not a verl_mega checkpoint (convert one with "
                "`verl-mega convert hf-to-mcore`)"
            )
        data = json.loads(path.read_text())
        if data.get("format") not in FORMATS:
            raise ValueError(f"{path}: unknown format {data.get('format')!r}; expected one of {FORMATS}")
        try:
            check_role(data.get("role", "actor"))
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        return cls(**data)
