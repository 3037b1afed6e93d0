"""Build a megatron-core GPTModel (this rank's TP/PP part) from an HF config and its family spec."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from verl_mega.config import ConfigError
from verl_mega.ops import FusedRMSNorm
from verl_mega.parallel.state import device

from .chunks import StageChunks
from .hf_config import HFModelConfig, rope_inv_freq
from .spec import FamilySpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The config name ("fp32", "bf16", "fp16") of a torch dtype."""
    return next(name for name, value in DTYPES.items() if value == dtype)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: the vocabulary rounded up to a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def architecture(hf_config: HFModelConfig, family: FamilySpec) -> dict:
    """The model's shape in megatron-core `TransformerConfig` terms: the one mapping from an HF config, used to
    build models and recorded (as Megatron-LM arguments) in converted checkpoints."""
    shape = dict(
        num_layers=hf_config.num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.ffn_hidden_size,
        num_attention_heads=hf_config.num_heads,
        num_query_groups=hf_config.num_kv_heads,
        kv_channels=hf_config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
    )
    if family.moe:
        shape.update(num_moe_experts=hf_config.num_experts, moe_router_topk=hf_config.moe_top_k,
                     moe_ffn_hidden_size=hf_config.ffn_hidden_size)
    if _mixes_dense_and_moe_layers(hf_config, family):
        # Only then: a list makes megatron key each layer apart in dist checkpoints instead of stacking them.
        shape.update(moe_layer_freq=[int(is_moe) for is_moe in family.moe_layer_pattern(hf_config)])
    if family.transformer_overrides is not None:
        shape.update(family.transformer_overrides(hf_config))
    return shape


def _mixes_dense_and_moe_layers(hf_config: HFModelConfig, family: FamilySpec) -> bool:
    return family.moe and not all(family.moe_layer_pattern(hf_config))


def transformer_config(hf_config: HFModelConfig, family: FamilySpec, *, tp: int = 1, pp: int = 1, ep: int = 1,
                       dtype: str = "fp32", vpp: int = 1, **overrides):
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    params_dtype = DTYPES[dtype]
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        architecture(hf_config, family),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # The fused kernels below are CUDA (apex / TE) only.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )
    # Micro-batches are trimmed to their longest sequence (roles.batching.trim_padding), so pipeline stages
    # exchange each activation's shape first. Megatron refuses that with the all-gather token dispatcher, even
    # in a dense model that dispatches nothing (hence all-to-all there); the CPU MoE path needs all-gather and
    # keeps full-width micro-batches, and so does the interleaved schedule (virtual pipeline stages): it exchanges
    # both directions' shapes in one batch, which at pp = 2, where the previous and the next rank are one,
    # delivers the gradient's shape as the activation's.
    if pp > 1 and vpp == 1 and (on_gpu or not family.moe):
        kwargs.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if vpp > 1:
        # The interleaved schedule's sends and receives go one by one, as Megatron-LM's default for it
        # (overlap_p2p_comm, which excludes batch_p2p_comm), without the overlap.
        kwargs.update(virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=False)
    if family.moe:
        kwargs.update(
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # The all-to-all dispatcher creates CUDA streams; all-gather works on both.
            moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        )
    kwargs.update(overrides)
    return (MLATransformerConfig if family.mla else TransformerConfig)(**kwargs)


def memory_overrides(role, parallel) -> dict:
    """The `transformer_config` overrides of what a role's forward keeps for its backward: `role.recompute`
    (`actor` / `critic`'s RecomputeConfig: granularity none | selective | full, method, num_layers) as megatron's
    recompute_* arguments, and `parallel.sequence_parallel` (None: on when parallel.tp > 1, except for a role
    with LoRA adapters, which take no sequence-split input). The reference takes the actor's."""
    sequence_parallel = parallel.sequence_parallel
    if sequence_parallel is None:
        sequence_parallel = parallel.tp > 1 and role.lora.rank == 0
    overrides = dict(sequence_parallel=sequence_parallel)
    recompute = role.recompute
    if recompute.granularity == "full":
        overrides.update(recompute_granularity="full", recompute_method=recompute.method,
                         recompute_num_layers=recompute.num_layers)
    elif recompute.granularity == "selective":  # megatron's default selective module: the attention core
        overrides.update(recompute_granularity="selective")
    return overrides


def layer_spec(family: FamilySpec, hf_config: HFModelConfig, config, implementation: str = "auto"):
    """`te` (transformer-engine, what GPU users train with), `local` (pure megatron-core) or `auto`.

    One layer spec for every layer; or this pipeline stage's block of layer specs: the family's own (Gemma-2),
    or megatron's when the family mixes dense and MoE layers (which, from `config.moe_layer_freq`).
    Context parallelism (`config.context_parallel_size` > 1) takes transformer-engine's: megatron's local
    attention asserts a context-parallel size of 1."""
    from megatron.core.models.gpt import gpt_layer_specs

    if implementation == "auto":
        implementation = "te" if transformer_engine_available() else "local"
    if implementation != "te" and config.context_parallel_size > 1:
        raise ConfigError(f"parallel.cp={config.context_parallel_size} needs transformer-engine's layers (its "
                          "context-parallel attention; megatron-core's local attention takes a context-parallel "
                          "size of 1), which need transformer-engine installed and CUDA: set parallel.cp=1")
    if family.block_spec is not None:
        return family.block_spec(hf_config, config, implementation == "te")
    if _mixes_dense_and_moe_layers(hf_config, family):
        return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=implementation == "te",
                                                          normalization="RMSNorm")
    num_experts = 1 if family.moe else None  # only its truthiness selects the MoE layer
    if implementation == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=family.qk_norm
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=family.qk_norm, normalization="RMSNorm"
    )


def _fuse_rms_norm_backward(model) -> None:
    """megatron's local spec norms are torch.nn.RMSNorm, whose CPU backward is autograd's decomposition (at a
    100M model's [1312, 768], forward and backward 3.5 ms against 1.4 ms with verl_mega.ops' kernel, 2 threads).
    Same parameters and state dict; on a GPU the subclass runs torch's own fused norm."""
    for module in model.modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = FusedRMSNorm


def uses_transformer_engine(model) -> bool:
    """Whether the model's layers are transformer-engine's (the GPU layer spec), which alone take THD input."""
    return any(type(module).__module__.startswith("megatron.core.extensions.transformer_engine")
               for module in model.modules())


def takes_packed_rows(model) -> bool:
    """Whether the model's attention takes THD packed rows: transformer-engine's layers with none of megatron's
    local core attention, which refuses them (Gemma-2 keeps its soft-capped local attention beside TE's linears)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return uses_transformer_engine(model) and not any(isinstance(module, DotProductAttention)
                                                      for module in model.modules())


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def build_rank_model(hf_config: HFModelConfig, family: FamilySpec, config, layout, *, padded_vocab: int,
                     implementation: str = "auto"):
    """This pipeline rank's model at `layout`: its GPTModel, or under virtual pipeline stages the GPTModel of each
    of its chunks (`chunks.StageChunks`; `config` built with `vpp=layout.vpp`)."""
    build = functools.partial(build_gpt_model, hf_config, family, config, padded_vocab=padded_vocab,
                              implementation=implementation)
    if layout.vpp == 1:
        return build(pre_process=layout.is_first_stage, post_process=layout.is_last_stage)
    last = layout.vpp - 1
    return StageChunks([build(pre_process=layout.is_first_stage and chunk == 0,
                              post_process=layout.is_last_stage and chunk == last, vp_stage=chunk)
                        for chunk in range(layout.vpp)])


def build_gpt_model(hf_config: HFModelConfig, family: FamilySpec, config, *, padded_vocab: int,
                    pre_process: bool = True, post_process: bool = True, implementation: str = "auto",
                    vp_stage: int | None = None):
    """One GPTModel (a rank's, or its chunk `vp_stage`); RoPE frequencies are HF's, so any supported scaling
    matches exactly (multi-latent attention computes its own, YaRN included, in each layer)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(family, hf_config, config, implementation),
        vocab_size=padded_vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=hf_config.rotary_percent,
        rotary_base=int(hf_config.rope_theta) if float(hf_config.rope_theta).is_integer() else hf_config.rope_theta,
        vp_stage=vp_stage,
    )
    if not family.mla:
        model.rotary_pos_emb.inv_freq = rope_inv_freq(hf_config).to(model.rotary_pos_emb.inv_freq.device)
    if family.finish_model is not None:
        family.finish_model(model, hf_config)
    _fuse_rms_norm_backward(model)
    # megatron-core's local spec builds its norms with torch's default dtype (fp32) whatever params_dtype says,
    # while transformer-engine's spec and megatron's Float16Module put every parameter in the model dtype.
    # We follow the latter, so both specs hold the same tensors: no parameter stays fp32. Precision comes from
    # the optimizer's fp32 main weights and from the norms computing in fp32 (torch's rms_norm upcasts).
    # The RoPE frequencies are a plain attribute, not a buffer, and stay fp32.
    # On the rank's device, as Megatron-LM's get_model puts it: megatron builds its linears there, but the local
    # spec's torch norms and Gemma-2's own norms are built on the default device, the CPU.
    model.to(device=device(), dtype=config.params_dtype)
    _keep_expert_bias_fp32(model)
    return model


def _keep_expert_bias_fp32(model) -> None:
    """megatron keeps the router's expert bias (DeepSeek-V3) in fp32 and would switch it back at the first forward,
    giving it new storage: done here instead, before anything (the HybridEngine) holds on to the tensor."""
    for module in model.modules():
        bias = getattr(module, "expert_bias", None)
        if isinstance(bias, torch.Tensor) and bias.dtype != torch.float32:
            bias.data = bias.data.float()


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Name -> tensor for what a checkpoint of the model holds: its parameters and its saved buffers (the router's
    expert bias, which megatron updates outside the gradient)."""
    saved = model.state_dict(keep_vars=True)
    buffers = {name: buffer for name, buffer in model.named_buffers() if name in saved}
    return {**dict(model.named_parameters()), **buffers}


def unwrap_model(model):
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
