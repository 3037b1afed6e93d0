"""Models and data where users keep them: Hub ids (`org/name[@revision]`, `hf://datasets/...`) resolved through
huggingface_hub's cache (refs, resolve, inputs), and a trained model pushed back (push). docs/hub.md."""
from .inputs import resolve_inputs
from .refs import HubRef, dataset_ref, is_repo_id, model_ref
from .resolve import HubError, Resolved, hub_origin, resolve_dataset, resolve_model

__all__ = ["HubError", "HubRef", "Resolved", "dataset_ref", "hub_origin", "is_repo_id", "model_ref",
           "resolve_dataset", "resolve_inputs", "resolve_model"]
