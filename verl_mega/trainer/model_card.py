"""The README.md (model card) `verl-mega export --push-to-hub` uploads with an exported model: the base model and
the revision it resolved to, the data, the algorithm and the run's final metrics, read from the run folder the
exported checkpoint belongs to (its provenance.json, config.yaml and metrics.jsonl). A checkpoint outside any run
folder gets a card that says so."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from verl_mega.hub import hub_origin
from verl_mega.run.folder import RunFolder

from .plot import read_metrics


def run_folder_of(ckpt: str | Path) -> RunFolder | None:
    """The run folder `ckpt` is (or lies in): the nearest folder up holding a provenance.json."""
    for folder in [Path(ckpt), *Path(ckpt).resolve().parents]:
        if RunFolder(folder).provenance.is_file():
            return RunFolder(folder)
    return None


def model_card(repo_id: str, ckpt: str | Path, role: str) -> str:
    run = run_folder_of(ckpt)
    if run is None:
        return _front_matter({"library_name": "transformers", "tags": ["verl-mega"]}) + (
            f"# {repo_id}\n\nThe {role} of the verl_mega checkpoint `{Path(ckpt).name}`; it belongs to no run folder, "
            "so its base model, data and metrics are not recorded here.\n")
    provenance = json.loads(run.provenance.read_text())
    config = yaml.safe_load(run.config.read_text()) if run.config.is_file() else {}
    model = provenance.get("model", {})
    hub = model.get("hub")
    base = hub["id"] if hub else Path(model.get("path", "unknown")).name
    datasets = [entry["id"] for entry in provenance.get("data", [])]
    algorithm = _algorithm(config)
    meta = {"library_name": "transformers", "tags": ["verl-mega", algorithm], **({"base_model": base} if hub else {}),
            **({"datasets": datasets} if datasets else {})}
    lines = [f"# {repo_id}", "", f"The {role} of a verl_mega run ({algorithm}), exported from `{Path(ckpt).name}`.",
             "", "## Base model", ""]
    if hub:
        refs = f" ({', '.join(hub['refs'])})" if hub.get("refs") else ""
        lines.append(f"{hub['id']} at revision `{hub['commit']}`{refs}; sha256 of its config and "
                     f"weights `{model.get('sha256')}`.")
    else:
        lines.append(f"A local folder `{base}`; sha256 of its config and weights `{model.get('sha256')}`.")
    lines += ["", "## Data", ""]
    lines += [f"- {entry['id']} at revision `{entry['commit']}`: {', '.join(entry['files'])}"
              for entry in provenance.get("data", [])]
    lines += [f"- `{Path(file).name}` (a local file)" for key in ("train_files", "val_files")
              for file in (config.get("data") or {}).get(key) or [] if hub_origin(file) is None]
    lines += ["", "## Training", "", f"- algorithm: {algorithm}",
              f"- verl_mega {provenance.get('verl_mega', {}).get('version')} "
              f"(commit {provenance.get('verl_mega', {}).get('commit')})"]
    if run.metrics.is_file():
        last = read_metrics(run.metrics)[-1]
        lines += ["", f"## Final metrics (step {last['step']})", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {key} | {value:.6g} |" for key, value in sorted(last.items())
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
    return _front_matter(meta) + "\n".join(lines) + "\n"


def _algorithm(config: dict) -> str:
    job = config.get("job", "rl")
    algorithm = config.get("algorithm") or {}
    if job == "rl":
        return algorithm.get("adv_estimator", "gae")
    return algorithm.get("loss", "dpo") if job == "preference" else job


def _front_matter(meta: dict) -> str:
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"
