"""One process: vLLM's own Llama built with the FP8 engine arguments the rollout passes (`quantization_args`), on
vLLM's CPU build (one-rank gloo TP group), fed the quantized stream at start-up and then twice through the same
layerwise reload the engine runs (`reload_in_place`). Writes what reached vLLM's loader, the FP8 layers' parameters
and their outputs after each load (through the CPU build's block-FP8 kernel), as JSON, for
tests/test_fp8_rollout_seam.py.

argv: the tiny HF model's folder, the JSON output path, a free TCP port.
"""
import json
import os
import sys

import torch

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from verl_mega.checkpoint.safetensors_io import SafetensorsReader  # noqa: E402
from verl_mega.rollout.quantization import quantized_stream  # noqa: E402
from verl_mega.rollout.vllm_engine import quantization_args, reload_in_place  # noqa: E402

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def main(hf_dir: str, out: str, port: str) -> None:
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    engine_args = quantization_args("fp8")
    model_config = ModelConfig(model=hf_dir, dtype=torch.bfloat16, **engine_args)
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"))
    reader = SafetensorsReader(hf_dir)
    base = {name: reader.read(name) for name in reader.names()}
    record = {"block_size": vllm_config.quant_config.weight_block_size,
              "activation_scheme": vllm_config.quant_config.activation_scheme, "loads": []}
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1)
        model = initialize_model(vllm_config=vllm_config)
        for version, factor in enumerate((1.0, -1.0, 2.0)):  # each version's outputs far from the others'
            weights = {name: tensor * factor for name, tensor in base.items()}
            handed = []

            def recorded(stream):
                for name, tensor in stream:
                    handed.append([name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")])
                    yield name, tensor

            stream = recorded(quantized_stream(weights.items(), "fp8", torch.bfloat16))
            if version == 0:  # start-up: vLLM's loader, then its post-load processing
                model.load_weights(stream)
                process_weights_after_loading(model, model_config, torch.device("cpu"))
            else:  # an update in place, as VLLMEngine.load_weights runs it
                reload_in_place(model, model_config, stream)
            held = {}
            for name, module in model.named_modules():
                if isinstance(getattr(module, "quant_method", None), Fp8LinearMethod):
                    held[name] = {"weight": [list(module.weight.shape), str(module.weight.dtype)],
                                  "weight_scale_inv": [list(module.weight_scale_inv.shape),
                                                       str(module.weight_scale_inv.dtype)],
                                  "output_error": _output_errors(module, name, weights, base)}
            record["loads"].append({"handed": handed, "held": held})
    with open(out, "w") as f:
        json.dump(record, f)


def _output_errors(module, name: str, weights: dict, other: dict) -> list[float]:
    """The layer's output on random inputs, through vLLM's FP8 kernel (its CPU build has one, over the layout its
    post-load processing packed), against the product with this version's weights and with another version's:
    relative errors [this, other]."""
    torch.manual_seed(0)
    x = torch.randn(4, module.input_size_per_partition, dtype=torch.bfloat16)
    with torch.no_grad():
        out = module(x)[0].float()
    return [((out - x.float() @ _whole(source, name).T).norm() / out.norm()).item() for source in (weights, other)]


def _whole(weights: dict, module_name: str) -> torch.Tensor:
    """The HF weight vLLM's module `module_name` stacks (q/k/v into qkv_proj, gate/up into gate_up_proj)."""
    prefix, _, leaf = module_name.rpartition(".")
    parts = FUSED.get(leaf, (leaf,))
    return torch.cat([weights[f"{prefix}.{part}.weight"].float() for part in parts])


if __name__ == "__main__":
    main(*sys.argv[1:])
