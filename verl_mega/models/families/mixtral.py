"""Mixtral: sparse MoE; router `gate`, experts w1 (gate), w3 (up), w2 (down); every layer slides over
`sliding_window` keys where it is set."""
from ..spec import moe_family, refuse_renormalised_top1, sliding_window

SPEC = moe_family("mixtral", ("mixtral",), "MixtralForCausalLM", window=sliding_window(),
                  check_config=refuse_renormalised_top1)  # Mixtral always renormalises its top-k
