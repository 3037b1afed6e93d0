"""A Llama-shaped family with InternLM2's tensor names (`--family-spec internlm2_family:SPEC`)."""
from verl_mega.models.spec import GATE_UP, FamilySpec, TensorRule

L, H = "decoder.layers.{layer}.", "model.layers.{layer}."
SPEC = FamilySpec(name="internlm2", model_types=("internlm2",), hf_architecture="InternLM2ForCausalLM", rules=(
    TensorRule("embedding.word_embeddings.weight", ("model.tok_embeddings.weight",), tp_dim=0, vocab=True),
    TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    TensorRule("output_layer.weight", ("output.weight",), tp_dim=0, vocab=True, when="untied"),
    TensorRule(L + "self_attention.linear_qkv.layer_norm_weight", (H + "attention_norm.weight",)),
    # wqkv holds each query group's [q heads, k, v] rows in turn: megatron's own order, split by whole groups.
    TensorRule(L + "self_attention.linear_qkv.weight", (H + "attention.wqkv.weight",), tp_dim=0),
    TensorRule(L + "self_attention.linear_proj.weight", (H + "attention.wo.weight",), tp_dim=1),
    TensorRule(L + "mlp.linear_fc1.layer_norm_weight", (H + "ffn_norm.weight",)),
    TensorRule(L + "mlp.linear_fc1.weight", (H + "feed_forward.w1.weight", H + "feed_forward.w3.weight"), GATE_UP,
               tp_dim=0),
    TensorRule(L + "mlp.linear_fc2.weight", (H + "feed_forward.w2.weight",), tp_dim=1),
))
