"""Families declared outside the package: a spec module the user names, or an installed plugin.

A reference `package.module:NAME` names a `FamilySpec` object. Installed code and the command line are trusted,
every folder is data: a reference is imported only when the user named it (`--family-spec` on the command line,
`model.family_spec` in a training config or the API) or an installed plugin declares it (an entry point of the
`verl_mega.families` group whose name is the model_type it serves). A checkpoint's manifest records the reference
at conversion, but a recorded reference is only compared with those and never imported on its own say-so: a
downloaded checkpoint must not choose which module runs (a `.py` beside it on `sys.path`, or any installed module).
A module that would come from inside the model or checkpoint folder being read is refused before it is imported.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import replace
from importlib.metadata import entry_points
from pathlib import Path

from .spec import FamilySpec

ENTRY_POINT_GROUP = "verl_mega.families"
HOW_TO_DECLARE = (f"declare it with --family-spec package.module:SPEC (model.family_spec in a training config) "
                  f"or a '{ENTRY_POINT_GROUP}' entry point named after the model_type (docs/adding-a-family.md)")


# References the user named in this process (command line, training config, API): the ones a manifest may record.
_NAMED_BY_USER: set[str] = set()


def import_family_spec(reference, data_dir: str | Path | None = None) -> FamilySpec:
    """The `FamilySpec` a reference the user named (or an installed plugin declares) points at; `data_dir` (the
    folder being read) must not provide the module."""
    module_name, _, attribute = reference.partition(":") if isinstance(reference, str) else ("", "", "")
    if not all(part.isidentifier() for part in module_name.split(".")) or not attribute.isidentifier():
        raise ValueError(f"family spec {reference!r} must be written package.module:NAME")
    top_level = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"family spec '{reference}' cannot be imported: no module named '{top_level}'; install "
                         "its package or put it on PYTHONPATH")
    if data_dir is not None and _lies_within(found, Path(data_dir)):
        raise ValueError(f"family spec '{reference}' would be imported from inside {data_dir}; code is never "
                         "imported from a model or checkpoint folder: install the spec's package elsewhere")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"family spec '{reference}' cannot be imported ({err}); install its package or put it "
                         "on PYTHONPATH") from None
    except (Exception, SystemExit) as err:  # the module itself failed (or exited): its error is what to fix
        raise ValueError(f"family spec '{reference}': importing {module_name} raised "
                         f"{type(err).__name__}: {err}; fix that module") from None
    spec = getattr(module, attribute, None)
    if not isinstance(spec, FamilySpec):
        raise ValueError(f"family spec '{reference}': {module_name}.{attribute} is not a verl_mega FamilySpec")
    _NAMED_BY_USER.add(reference)
    return replace(spec, origin=reference)


def recorded_family_spec(reference, data_dir: str | Path | None = None) -> FamilySpec:
    """The spec a checkpoint's manifest records, imported only if the user named the same reference in this process
    or an installed plugin declares it; otherwise refused before anything is imported."""
    declared = {entry.value for entry in entry_points(group=ENTRY_POINT_GROUP)}
    if reference not in _NAMED_BY_USER and reference not in declared:
        raise ValueError(f"family spec {reference!r} cannot be imported on a checkpoint's say-so: the manifest "
                         "records it, but only a spec named on the command line (--family-spec), in the training "
                         "config (model.family_spec) or by an installed entry point is imported; name it there if "
                         "you trust that module")
    return import_family_spec(reference, data_dir)


def plugin_family(model_type: str, data_dir: str | Path | None = None) -> FamilySpec | None:
    """The spec an installed plugin declares for `model_type`, if any."""
    for entry in entry_points(group=ENTRY_POINT_GROUP, name=model_type):
        return import_family_spec(entry.value, data_dir)
    return None


def _lies_within(found, folder: Path) -> bool:
    locations = [found.origin] if found.origin else []
    locations += list(found.submodule_search_locations or [])
    folder = folder.resolve()
    return any(Path(location).resolve().is_relative_to(folder) for location in locations)
