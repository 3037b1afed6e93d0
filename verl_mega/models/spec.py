"""Model-family knowledge as data: how HF tensors map to megatron-core tensors and how TP splits them.

A `TensorRule` ties one megatron tensor to the HF tensors it is made of. Every rule obeys one law that
the converters, the HybridEngine and the exporter all rely on:

    TP shard r of the megatron tensor == merge(TP shard r of each HF source along `tp_dim`)

(q/k/v interleave per query group and gate|up concatenation both commute with slicing whole query groups
or halves). So a rank reads only its slices of the HF tensors, and a group of consecutive TP shards
splits back into the matching slices of the HF tensors.

Megatron names here are the canonical ones megatron's dist-checkpoint and the transformer-engine layer
spec use; `to_canonical_name` maps the local (non-TE) layer spec's names onto them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from .hf_config import HFModelConfig

LAYER = "{layer}"
EXPERT = "{expert}"
LAYER_CONDITIONS = ("moe_layer", "dense_layer")

LM_HEAD = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
HF_LM_HEAD = "lm_head.weight"
HF_EMBEDDING = "model.embed_tokens.weight"


# transformer-engine fuses the pre-attention and (dense) pre-MLP norms into the following linear layer;
# the local spec keeps them as modules of their own. MoE layers keep `pre_mlp_layernorm` in both.
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


# Multi-latent attention (DeepSeek-V3): transformer-engine keeps the input norm a module of its own and fuses the
# q and kv latent norms into the up-projections that follow them.
_MLA_LOCAL_TO_TE = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


_ROUTER = "mlp.router.weight"
_MLA_MARK = "self_attention.linear_kv_down_proj.weight"


def to_canonical_name(name: str, moe: bool, mla: bool = False) -> str:
    """The dist-checkpoint / transformer-engine name of a parameter named by the local layer spec;
    `moe`: the parameter belongs to an MoE layer; `mla`: to a multi-latent attention layer."""
    for local_suffix, te_suffix in (_MLA_LOCAL_TO_TE if mla else _LOCAL_TO_TE).items():
        if name.endswith("." + local_suffix) and not (moe and local_suffix.startswith("pre_mlp")):
            return name[: -len(local_suffix)] + te_suffix
    return name


def local_spellings(name: str) -> list[str]:
    """The local layer spec's names a canonical name may stand for (megatron's local MLA spec, unlike its q/k/v one,
    keeps them in dist checkpoints)."""
    return [name[: -len(te_suffix)] + local_suffix for table in (_LOCAL_TO_TE, _MLA_LOCAL_TO_TE)
            for local_suffix, te_suffix in table.items() if name.endswith("." + te_suffix)]


def _layer_prefixes(names: Sequence[str], suffix: str) -> tuple[str, ...]:
    return tuple(name.removesuffix(suffix) for name in names if name.endswith("." + suffix))


def canonical_names(names: Iterable[str]) -> dict[str, str]:
    """Local-spec name -> canonical name for every parameter of one model; a layer is MoE when it has a router
    (families may mix dense and MoE layers), multi-latent attention when it has MLA's kv down-projection."""
    names = [name for name in names if not name.endswith("_extra_state")]
    moe_layers, mla_layers = _layer_prefixes(names, _ROUTER), _layer_prefixes(names, _MLA_MARK)
    return {name: to_canonical_name(name, bool(moe_layers) and name.startswith(moe_layers),
                                    bool(mla_layers) and name.startswith(mla_layers))
            for name in names}


# --- row merges: HF tensors <-> one megatron tensor, valid on full tensors and on TP slices alike -----
# A row merge is a list of row blocks: which rows of which source land where in the merged tensor. Merging,
# splitting and the converter's read-in-place all follow the same blocks.


@dataclass(frozen=True)
class Block:
    source: int
    source_row: int
    merged_row: int
    rows: int


def _same_blocks(source_rows: Sequence[int], hf_config: HFModelConfig) -> list[Block]:
    return [Block(0, 0, 0, source_rows[0])]


def _same_source_rows(merged_rows: int, hf_config: HFModelConfig) -> list[int]:
    return [merged_rows]


def _concat_blocks(source_rows: Sequence[int], hf_config: HFModelConfig) -> list[Block]:
    offsets = [sum(source_rows[:i]) for i in range(len(source_rows))]
    return [Block(i, 0, offset, rows) for i, (offset, rows) in enumerate(zip(offsets, source_rows))]


def _halves_source_rows(merged_rows: int, hf_config: HFModelConfig) -> list[int]:
    return [merged_rows // 2, merged_rows // 2]


def _qkv_blocks(source_rows: Sequence[int], hf_config: HFModelConfig) -> list[Block]:
    """q/k/v interleaved per query group: [q heads of group 0, k0, v0, q heads of group 1, ...]."""
    head_dim, q_rows = hf_config.head_dim, hf_config.heads_per_group * hf_config.head_dim
    group_rows = q_rows + 2 * head_dim
    blocks = []
    for group in range(source_rows[1] // head_dim):
        base = group * group_rows
        blocks += [Block(0, group * q_rows, base, q_rows), Block(1, group * head_dim, base + q_rows, head_dim),
                   Block(2, group * head_dim, base + q_rows + head_dim, head_dim)]
    return blocks


def _qkv_source_rows(merged_rows: int, hf_config: HFModelConfig) -> list[int]:
    head_dim = hf_config.head_dim
    groups = merged_rows // ((hf_config.heads_per_group + 2) * head_dim)
    return [groups * hf_config.heads_per_group * head_dim, groups * head_dim, groups * head_dim]


@dataclass(frozen=True)
class RowMerge:
    name: str
    blocks: Callable[[Sequence[int], HFModelConfig], list[Block]]
    source_rows: Callable[[int, HFModelConfig], list[int]]

    def merge(self, sources: Sequence[torch.Tensor], hf_config: HFModelConfig) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0]
        merged = sources[0].new_empty((sum(t.shape[0] for t in sources), *sources[0].shape[1:]))
        for b in self.blocks([t.shape[0] for t in sources], hf_config):
            merged[b.merged_row:b.merged_row + b.rows] = sources[b.source][b.source_row:b.source_row + b.rows]
        return merged

    def split(self, merged: torch.Tensor, hf_config: HFModelConfig) -> list[torch.Tensor]:
        rows = self.source_rows(merged.shape[0], hf_config)
        if len(rows) == 1:
            return [merged]
        sources = [merged.new_empty((n, *merged.shape[1:])) for n in rows]
        for b in self.blocks(rows, hf_config):
            sources[b.source][b.source_row:b.source_row + b.rows] = merged[b.merged_row:b.merged_row + b.rows]
        return sources


SAME = RowMerge("same", _same_blocks, _same_source_rows)
QKV = RowMerge("qkv", _qkv_blocks, _qkv_source_rows)
GATE_UP = RowMerge("gate_up", _concat_blocks, _halves_source_rows)


def _unfuse_qkv(fused: torch.Tensor, hf_config: HFModelConfig) -> list[torch.Tensor]:
    kv_rows = hf_config.num_kv_heads * hf_config.head_dim
    return list(fused.split([hf_config.num_heads * hf_config.head_dim, kv_rows, kv_rows], dim=0))


def _unfuse_halves(fused: torch.Tensor, hf_config: HFModelConfig) -> list[torch.Tensor]:
    return list(fused.chunk(2, dim=0))


@dataclass(frozen=True)
class Fusion:
    """An HF tensor that stores several logical sources fused (Phi-3's qkv_proj, gate_up_proj)."""

    unfuse: Callable[[torch.Tensor, HFModelConfig], list[torch.Tensor]]

    def fuse(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts), dim=0)


FUSED_QKV = Fusion(_unfuse_qkv)
FUSED_HALVES = Fusion(_unfuse_halves)


@dataclass(frozen=True)
class ExpertStack:
    """An HF tensor holding one MoE layer's experts stacked, [experts, rows, columns]: transformers 5's
    in-memory spelling, which `save_pretrained(save_original_format=False)` writes. Expert e's block is its
    `parts` (per-expert names, the spelling the rules use and transformers writes by default) concatenated on
    rows, so each part is a run of whole rows of the stacked tensor seen as a matrix."""

    stacked: str
    parts: tuple[str, ...]

    def part_names(self, layer: int, num_experts: int) -> list[str]:
        """The per-expert tensors of the stacked one of `layer`, top to bottom."""
        return [part.replace(LAYER, str(layer)).replace(EXPERT, str(expert))
                for expert in range(num_experts) for part in self.parts]


@dataclass(frozen=True)
class TensorRule:
    """One megatron tensor and the HF tensors it is made of.

    `hf` lists the logical sources in merge order; with `fusion`, `hf` has one name that holds them all.
    `tp_dim`: the dim each source is split along for TP (None: replicated). `vocab`: padded rows.
    `when`: a condition the tensor exists under: of the config ("qkv_bias", "untied") or of its layer
    ("moe_layer", "dense_layer", for families mixing both). `shape`: the whole (TP-merged) megatron tensor's
    shape for a config, for tensors the shared names of `expected_shapes` do not cover (None: those names').
    `fp32`: stored in fp32 whatever the model's dtype (DeepSeek-V3's expert bias, as megatron and transformers
    keep it: a bf16 bias would round away the small differences that choose the experts).
    """

    mcore: str
    hf: tuple[str, ...]
    row_merge: RowMerge = SAME
    tp_dim: int | None = None
    vocab: bool = False
    fusion: Fusion | None = None
    when: str | None = None
    shape: Callable[[HFModelConfig], tuple[int, ...]] | None = field(default=None, compare=False)
    fp32: bool = False

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype this tensor is stored in within a model or checkpoint of `dtype`."""
        return torch.float32 if self.fp32 else dtype

    @property
    def per_layer(self) -> bool:
        return LAYER in self.mcore

    @property
    def per_expert(self) -> bool:
        return EXPERT in self.mcore


@dataclass(frozen=True)
class FamilySpec:
    name: str
    model_types: tuple[str, ...]
    hf_architecture: str
    rules: tuple[TensorRule, ...]
    qkv_bias: bool = False  # always (Qwen2); `attention_bias` elsewhere also biases o_proj, which is refused
    qk_norm: bool = False
    moe: bool = False
    # Which layers are MoE when the family mixes dense and MoE layers; None: all of them when `moe`.
    moe_layers: Callable[[HFModelConfig], list[bool]] | None = None
    # TransformerConfig fields the family reads from its own HF config keys.
    transformer_overrides: Callable[[HFModelConfig], dict[str, Any]] | None = None
    # Families megatron's GPT layer cannot express bring their own decoder block spec:
    # (HF config, TransformerConfig, use transformer-engine) -> TransformerBlockSubmodules.
    block_spec: Callable[[HFModelConfig, Any, bool], Any] | None = None
    # What the family adds around the layers of a built GPTModel (embedding scale, logit cap): (model, HF config).
    finish_model: Callable[[Any, HFModelConfig], None] | None = None
    # "package.module:NAME" for a spec declared outside verl_mega (recorded in manifests); None: built in.
    origin: str | None = field(default=None, compare=False)
    # Stacked spellings of the experts an HF checkpoint may use instead of the rules' per-expert names.
    expert_stacks: tuple[ExpertStack, ...] = ()
    # Multi-latent attention (megatron's MLATransformerConfig and MLA layer spec) instead of q/k/v attention.
    mla: bool = False
    # Conditions of the family's own config keys that rules name in `when` (e.g. "q_lora"): config -> {name: holds}.
    conditions: Callable[[HFModelConfig], dict[str, bool]] | None = None
    # Refuses, with a one-line ValueError, a config the family's megatron mapping cannot reproduce.
    check_config: Callable[[HFModelConfig], None] | None = None
    # transformers' activation names (`hidden_act`; Gemma's `hidden_activation`) the mapping runs; the first is the
    # one transformers assumes when config.json names none.
    activations: tuple[str, ...] = ("silu",)
    # The sliding window transformers (and vLLM) apply to a config's layers where the megatron model here attends in
    # full: sequences must stay within it. None: the family has no such window (or, like Gemma-2, models it).
    unmodelled_window: Callable[[HFModelConfig], int | None] | None = None
    # How many layers after the last the family's checkpoints carry for something the model does not run
    # (DeepSeek-V3's multi-token-prediction layers): config -> count. None: none. Their tensors are carried beside a
    # converted checkpoint as they are and written back on export (`checkpoint.unread_tensors`).
    unread_layers: Callable[[HFModelConfig], int] | None = None
    # Whether the layers keep megatron's local core attention under transformer-engine too (Gemma-2's soft cap),
    # which takes neither packed rows nor context parallelism.
    local_attention: bool = False

    def unread_layer_count(self, hf_config: HFModelConfig) -> int:
        return self.unread_layers(hf_config) if self.unread_layers is not None else 0

    def moe_layer_pattern(self, hf_config: HFModelConfig) -> list[bool]:
        if self.moe_layers is not None:
            return self.moe_layers(hf_config)
        return [self.moe] * hf_config.num_layers

    def rule_in_layer(self, rule: TensorRule, hf_config: HFModelConfig, layer: int) -> bool:
        if rule.when not in LAYER_CONDITIONS:
            return True
        return self.moe_layer_pattern(hf_config)[layer] == (rule.when == "moe_layer")

    def active_rules(self, hf_config: HFModelConfig,
                     head_rules: Sequence[TensorRule] | None = None) -> list[TensorRule]:
        """The rules of the tensors `hf_config` has; `head_rules` replace the LM head (None: keep it). Rules conditioned
        on a layer's kind are kept (see `rule_in_layer`)."""
        conditions = {"qkv_bias": self.qkv_bias, "untied": not hf_config.tie_word_embeddings,
                      **(self.conditions(hf_config) if self.conditions is not None else {})}
        rules = [r for r in self.rules if r.when is None or r.when in LAYER_CONDITIONS or conditions[r.when]]
        if head_rules is None:
            return rules
        return [r for r in rules if r.mcore != LM_HEAD] + list(head_rules)


# --- rules shared by the families -------------------------------------------------------------------

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."


def _embedding_rules() -> tuple[TensorRule, ...]:
    return (
        TensorRule(EMBEDDING, (HF_EMBEDDING,), tp_dim=0, vocab=True),
        TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        TensorRule(LM_HEAD, (HF_LM_HEAD,), tp_dim=0, vocab=True, when="untied"),
    )


def _attention_rules(fused_qkv: bool = False, qk_norm: bool = False) -> tuple[TensorRule, ...]:
    attn = _H + "self_attn."
    if fused_qkv:
        qkv = (TensorRule(_L + "self_attention.linear_qkv.weight", (attn + "qkv_proj.weight",), QKV, tp_dim=0,
                          fusion=FUSED_QKV),)
    else:
        qkv = tuple(
            TensorRule(_L + f"self_attention.linear_qkv.{kind}", tuple(f"{attn}{p}_proj.{kind}" for p in "qkv"), QKV,
                       tp_dim=0, when="qkv_bias" if kind == "bias" else None)
            for kind in ("weight", "bias")
        )
    norms = (
        TensorRule(_L + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",)),
        TensorRule(_L + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",)),
    ) if qk_norm else ()
    return (
        TensorRule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",)),
        *qkv,
        *norms,
        TensorRule(_L + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp_dim=1),
    )


def _dense_mlp_rules(fused_gate_up: bool = False, when: str | None = None) -> tuple[TensorRule, ...]:
    mlp = _H + "mlp."
    fc1_sources = (mlp + "gate_up_proj.weight",) if fused_gate_up else (mlp + "gate_proj.weight", mlp + "up_proj.weight")
    return (
        TensorRule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",), when=when),
        TensorRule(_L + "mlp.linear_fc1.weight", fc1_sources, GATE_UP, tp_dim=0,
                   fusion=FUSED_HALVES if fused_gate_up else None, when=when),
        TensorRule(_L + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), tp_dim=1, when=when),
    )


def _mixtral_moe_rules() -> tuple[TensorRule, ...]:
    moe = _H + "block_sparse_moe."
    expert = _L + "mlp.experts.local_experts.{expert}."
    hf_expert = moe + "experts.{expert}."
    return (
        TensorRule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",)),
        TensorRule(_L + "mlp.router.weight", (moe + "gate.weight",)),
        TensorRule(expert + "linear_fc1.weight", (hf_expert + "w1.weight", hf_expert + "w3.weight"), GATE_UP, tp_dim=0),
        TensorRule(expert + "linear_fc2.weight", (hf_expert + "w2.weight",), tp_dim=1),
    )


def dense_family(name: str, model_types: tuple[str, ...], hf_architecture: str, *, qkv_bias: bool = False,
                 qk_norm: bool = False, fused: bool = False,
                 window: Callable[[HFModelConfig], int | None] | None = None) -> FamilySpec:
    return FamilySpec(
        name=name,
        model_types=model_types,
        hf_architecture=hf_architecture,
        rules=_embedding_rules() + _attention_rules(fused_qkv=fused, qk_norm=qk_norm) + _dense_mlp_rules(fused),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        unmodelled_window=window,
    )


def moe_family(name: str, model_types: tuple[str, ...], hf_architecture: str,
               window: Callable[[HFModelConfig], int | None] | None = None,
               check_config: Callable[[HFModelConfig], None] | None = None) -> FamilySpec:
    return FamilySpec(
        name=name,
        model_types=model_types,
        hf_architecture=hf_architecture,
        rules=_embedding_rules() + _attention_rules() + _mixtral_moe_rules(),
        moe=True,
        unmodelled_window=window,
        check_config=check_config,
    )


def sliding_window(*, switch: str | None = None, per_layer: bool = False) -> Callable[[HFModelConfig], int | None]:
    """How transformers reads a family's sliding window from config.json: none while `switch` (Qwen's
    `use_sliding_window`) is not true; for `per_layer` families none when `layer_types` names no sliding layer (a
    config without the key, from transformers 4.x, is taken to slide somewhere); else `sliding_window` (where the key
    is left out, transformers' default: Mistral's 4096), none where it is null."""
    def window(hf_config: HFModelConfig) -> int | None:
        raw = hf_config.raw
        if switch is not None and raw.get(switch) is not True:
            return None
        layer_types = raw.get("layer_types")
        if per_layer and isinstance(layer_types, list) and "sliding_attention" not in layer_types:
            return None
        value = raw.get("sliding_window")
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"config.json: 'sliding_window' must be a positive integer or null, got {value!r}")
        return value
    return window


def refuse_renormalised_top1(hf_config: HFModelConfig) -> None:
    """transformers renormalises the top-k weights, so one expert gets weight 1; megatron runs top-1 only from a
    softmax over all experts, which weighs it by its probability."""
    if hf_config.moe_top_k == 1:
        raise ValueError(f"config.json: {hf_config.model_type} num_experts_per_tok=1 with renormalised top-k weights "
                         "is not supported: transformers weighs the one expert by 1, megatron's top-1 router by its "
                         "softmax probability")


def config_size(hf_config: HFModelConfig, key: str) -> int:
    """A positive integer a family reads from config.json beyond the common fields."""
    value = hf_config.raw.get(key)
    if type(value) is not int or value < 1:
        raise ValueError(f"config.json: model_type '{hf_config.model_type}' needs '{key}' as a positive integer, got {value!r}")
    return value


def _fc1_shape(key: str) -> Callable[[HFModelConfig], tuple[int, int]]:
    return lambda hf_config: (2 * config_size(hf_config, key), hf_config.hidden_size)


def _fc2_shape(key: str) -> Callable[[HFModelConfig], tuple[int, int]]:
    return lambda hf_config: (hf_config.hidden_size, config_size(hf_config, key))


_QWEN_HF_EXPERT = _H + "mlp.experts.{expert}."


def _qwen_routed_expert_rules() -> tuple[TensorRule, ...]:
    """An MoE layer's norm, router (no bias) and routed experts, each named like a dense MLP
    (`mlp.experts.{e}.gate_proj`, ...) and `moe_intermediate_size` wide (Qwen2-MoE, Qwen3-MoE)."""
    expert = _L + "mlp.experts.local_experts.{expert}."
    return (
        TensorRule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), when="moe_layer"),
        TensorRule(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), when="moe_layer"),
        TensorRule(expert + "linear_fc1.weight",
                   (_QWEN_HF_EXPERT + "gate_proj.weight", _QWEN_HF_EXPERT + "up_proj.weight"), GATE_UP,
                   tp_dim=0, when="moe_layer", shape=_fc1_shape("moe_intermediate_size")),
        TensorRule(expert + "linear_fc2.weight", (_QWEN_HF_EXPERT + "down_proj.weight",), tp_dim=1, when="moe_layer",
                   shape=_fc2_shape("moe_intermediate_size")),
    )


def qwen_expert_stacks() -> tuple[ExpertStack, ...]:
    """transformers 5's stacked spelling of `_qwen_routed_expert_rules`' experts: gate and up in one tensor."""
    return (
        ExpertStack(_H + "mlp.experts.gate_up_proj",
                    (_QWEN_HF_EXPERT + "gate_proj.weight", _QWEN_HF_EXPERT + "up_proj.weight")),
        ExpertStack(_H + "mlp.experts.down_proj", (_QWEN_HF_EXPERT + "down_proj.weight",)),
    )


def qwen2_moe_rules() -> tuple[TensorRule, ...]:
    """Routed experts named like a dense MLP each, plus a shared expert whose output a sigmoid gate scales;
    the layers that are not MoE have a dense MLP."""
    mlp, shared = _H + "mlp.", _L + "mlp.shared_experts."
    return _embedding_rules() + _attention_rules() + _qwen_routed_expert_rules() + (
        TensorRule(shared + "linear_fc1.weight", (mlp + "shared_expert.gate_proj.weight", mlp + "shared_expert.up_proj.weight"),
                   GATE_UP, tp_dim=0, when="moe_layer", shape=_fc1_shape("shared_expert_intermediate_size")),
        TensorRule(shared + "linear_fc2.weight", (mlp + "shared_expert.down_proj.weight",), tp_dim=1, when="moe_layer",
                   shape=_fc2_shape("shared_expert_intermediate_size")),
        TensorRule(shared + "gate_weight", (mlp + "shared_expert_gate.weight",), when="moe_layer",
                   shape=lambda hf_config: (1, hf_config.hidden_size)),
    ) + _dense_mlp_rules(when="dense_layer")


def qwen3_moe_rules() -> tuple[TensorRule, ...]:
    """Qwen3's attention (per-head q/k norms) with routed experts and no shared expert; the layers that are not
    MoE have a dense MLP `intermediate_size` wide."""
    return (_embedding_rules() + _attention_rules(qk_norm=True) + _qwen_routed_expert_rules()
            + _dense_mlp_rules(when="dense_layer"))


def gemma2_rules() -> tuple[TensorRule, ...]:
    """Sandwich norms: the post-attention and post-feedforward norms sit on the row-parallel linears' outputs,
    the pre-feedforward norm before the MLP."""
    mlp = _H + "mlp."
    return _embedding_rules() + _attention_rules() + (
        TensorRule(_L + "self_attention.linear_proj.post_layernorm.weight", (_H + "post_attention_layernorm.weight",),
                   shape=lambda hf_config: (hf_config.hidden_size,)),
        TensorRule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "pre_feedforward_layernorm.weight",)),
        TensorRule(_L + "mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), GATE_UP, tp_dim=0),
        TensorRule(_L + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), tp_dim=1),
        TensorRule(_L + "mlp.linear_fc2.post_layernorm.weight", (_H + "post_feedforward_layernorm.weight",),
                   shape=lambda hf_config: (hf_config.hidden_size,)),
    )
