"""What a checkpoint's weights are for, and how that changes its head.

The actor's weights end in the family's LM head. The critic's end in the value head in its place
(`models.value_head`: the module and its tensors' names on both sides).
"""
from __future__ import annotations

from verl_mega.models.spec import FamilySpec, TensorRule
from verl_mega.models.value_head import VALUE_HEAD_RULES, value_head_architecture

ROLES = ("actor", "critic")


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got '{role}'")
    return role


def has_lm_head(role: str) -> bool:
    return check_role(role) == "actor"


def head_rules(role: str) -> tuple[TensorRule, ...] | None:
    """The rules of `role`'s head in place of the LM head (None: the family's own LM head)."""
    return None if has_lm_head(role) else VALUE_HEAD_RULES


def hf_architecture(family: FamilySpec, role: str) -> str:
    """The transformers class an export of `role` loads as: the critic's is the token-classification one."""
    if has_lm_head(role):
        return family.hf_architecture
    return value_head_architecture(family.hf_architecture)
