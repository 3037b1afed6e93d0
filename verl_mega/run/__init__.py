"""The run folder, with one owner: its layout (`RunFolder`), step checkpoints and training state, the roles'
final weights, the checkpoint mirror, the provenance record and the run lock."""
from .folder import RunFolder

__all__ = ["RunFolder"]
