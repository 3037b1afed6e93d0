"""Tensors an HF checkpoint carries that the model does not read, kept beside a converted checkpoint and written back
by every export as they came: same names, dtypes and bytes.

    CKPT/hf_assets/unread_tensors/model.safetensors   (or shards and their index)

They are the layers after the last that the family declares (`FamilySpec.unread_layers`: DeepSeek-V3's
multi-token-prediction layers, which speculative decoding serves) and the RoPE frequencies older transformers
versions saved as a buffer. None of them trains, so what comes back out is what went in. The one exception is a
tied LM head stored anyway: it is the embedding (conversion checks it equals it), so the export writes the exported
embedding under its name, the trained one after training, and nothing where the export has no LM head (a critic).

The manifest records their names (`Manifest.unread_tensors`); a checkpoint converted before they were carried
records nothing, and its export is refused where its config declares such layers, as is one whose carried files
lack a recorded tensor.

They live in hf_assets/ so that they travel wherever the model's config and tokenizer files do (a run's final
weights copy that folder from the checkpoint the role started from).
"""
from __future__ import annotations

from pathlib import Path

from verl_mega.models import HFModelConfig
from verl_mega.models.spec import HF_LM_HEAD, FamilySpec

from .manifest import MANIFEST_NAME, Manifest
from .safetensors_io import SafetensorsReader, SafetensorsWriter

UNREAD_DIR = "unread_tensors"


def is_carried(name: str, hf_config: HFModelConfig, family: FamilySpec) -> bool:
    """Whether HF tensor `name` (not one the model reads) is carried: an unread layer's, RoPE's frequencies, or a
    tied LM head."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    unread_layer = layer.isdigit() and 0 <= int(layer) - hf_config.num_layers < family.unread_layer_count(hf_config)
    tied_head = hf_config.tie_word_embeddings and name == HF_LM_HEAD
    return unread_layer or tied_head or name.endswith(".rotary_emb.inv_freq")


def _stored(name: str) -> bool:
    """Whether a carried tensor's bytes are kept (all but a tied LM head's: the embedding's, written from it)."""
    return name != HF_LM_HEAD


def write_unread_tensors(reader: SafetensorsReader, names: list[str], assets: Path) -> None:
    """Copy the tensors `names` of `reader` that are kept as they are into `assets`' unread-tensor folder (none: no
    folder)."""
    names = list(filter(_stored, names))
    if not names:
        return
    folder = assets / UNREAD_DIR
    folder.mkdir(parents=True)
    writer = SafetensorsWriter(folder)
    for name in names:
        writer.add(name, reader.read(name))
    writer.close()


def open_unread_tensors(assets: Path, manifest: Manifest, hf_config: HFModelConfig,
                        family: FamilySpec) -> SafetensorsReader | None:
    """The carried tensors of the checkpoint whose hf_assets folder is `assets`, exactly the ones its manifest
    records as kept; None where it keeps none. What would lose a tensor is refused in one line naming it and the
    file."""
    if manifest.unread_tensors is None:
        count, first = family.unread_layer_count(hf_config), hf_config.num_layers
        if count:
            raise ValueError(
                f"{assets.parent / MANIFEST_NAME} predates carrying the tensors the model does not read, and its "
                f"config declares {count} layer(s) after the last (model.layers.{first}.*"
                f"{'' if count == 1 else f' to model.layers.{first + count - 1}.*'}) that the export would lose: "
                f"convert its HF folder again (`verl-mega convert hf-to-mcore --overwrite --out {assets.parent}`)")
        return None
    recorded = list(filter(_stored, manifest.unread_tensors))
    if not recorded:
        return None
    folder = assets / UNREAD_DIR
    listed = f"'{recorded[0]}'" + (f" and {len(recorded) - 1} more" if len(recorded) > 1 else "")
    try:
        reader = SafetensorsReader(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"{folder} is missing or unreadable ({err}): it holds tensor {listed} the model does not "
                         "read, which the export must write back; convert the HF folder again") from None
    missing = sorted(set(recorded) - set(reader.names()))
    stray = sorted(set(reader.names()) - set(recorded))
    if missing or stray:
        reader.close()
        what = f"lacks tensor '{missing[0]}'" if missing else f"holds tensor '{stray[0]}'"
        raise ValueError(f"{folder} {what}, unlike the list in {assets.parent / MANIFEST_NAME} "
                         f"({len(recorded)} tensors): the files are not the ones converted; convert the HF folder again")
    return reader
