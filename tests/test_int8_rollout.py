"""The embedded engine's int8 rollout (rollout.quantization=int8): oneDNN int8 linears fed by the quantized
stream, its log-probs close to the fp32 engine's on the same weights, and reloads in place."""
from __future__ import annotations

import pytest
import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.models import HFModelConfig
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.engine import SamplingParams
from verl_mega.rollout.int8_linear import Int8Linear, QuantizedInput
from verl_mega.rollout.quantization import quantize_int8, quantized_stream

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _weights(hf_dir, scale: float = 1.0):
    reader = SafetensorsReader(hf_dir)
    return [(name, reader.read(name) * scale) for name in reader.names()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_the_dequantized_product(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 80).to(dtype)
    layer = Int8Linear.replacing(linear)
    q, scale = quantize_int8(linear.weight)
    layer.weight.copy_(q)
    layer.weight_scale.copy_(scale)
    x = torch.randn(3, 5, 96).to(dtype)
    # The reference: the dequantized weight times the per-token quantized activations, in fp32, rounded to the
    # engine's dtype once at the end.
    qx, row_scale = quantize_int8(x.reshape(-1, 96))
    want = ((qx.float() * row_scale[:, None]) @ (q.float() * scale[:, None]).T + linear.bias.float()).view(3, 5, 80)
    with torch.no_grad():
        got, full = layer(x), linear(x).float()
    assert got.shape == (3, 5, 80) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # bf16 keeps 8 bits of mantissa
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance)
    # and close to the layer in its own dtype: the quantization error only
    assert (got.float() - full).abs().max() < 0.02 * full.abs().max()


def _int8_twins(*shapes, inputs=None) -> list[Int8Linear]:
    layers = []
    for out_features, in_features in shapes:
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        layer = Int8Linear.replacing(linear, inputs)
        q, scale = quantize_int8(linear.weight)
        layer.weight.copy_(q)
        layer.weight_scale.copy_(scale)
        layers.append(layer)
    return layers


def _quantizations(call) -> int:
    """How many activation quantizations `call` ran (each rounds once)."""
    with torch.profiler.profile() as profile:
        call()
    return sum(event.count for event in profile.key_averages() if event.key == "aten::round")


def test_linears_reading_one_tensor_quantize_it_once():
    torch.manual_seed(0)
    shapes = [(64, 48), (16, 48), (16, 48)]  # q, k and v of one attention
    shared = _int8_twins(*shapes, inputs=QuantizedInput())
    torch.manual_seed(0)
    alone = _int8_twins(*shapes)  # the same weights, each layer quantizing for itself
    x = torch.randn(4, 3, 48)
    with torch.no_grad():
        assert _quantizations(lambda: [layer(x) for layer in shared]) == 1
        for a, b in zip(shared, alone):
            torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
        # A tensor changed in place since, or another tensor, is quantized anew.
        x.mul_(3)
        assert _quantizations(lambda: shared[1](x)) == 1
        torch.testing.assert_close(shared[1](x), alone[1](x), rtol=0, atol=0)
        y = torch.randn(4, 3, 48)
        torch.testing.assert_close(shared[2](y), alone[2](y), rtol=0, atol=0)
        torch.testing.assert_close(shared[0](x), alone[0](x), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2", "mixtral"])
def test_int8_engine_generates_close_to_fp32(tiny_models, family):
    hf_dir = tiny_models[family]
    raw = HFModelConfig.read_raw(hf_dir)
    # The tiny random weights as they are: sharpened 4x, the 4-layer model turns chaotic and the same int8 weights
    # run in fp32 (weight rounding alone) move log-probs by up to 10.
    weights = _weights(hf_dir)
    reference, int8 = EmbeddedEngine(raw, device="cpu"), EmbeddedEngine(raw, device="cpu", quantization="int8")
    reference.load_weights(weights)
    count = int8.load_weights(quantized_stream(weights, "int8"))
    assert count == len(weights) + sum(isinstance(m, Int8Linear) for m in int8.model.modules())
    assert sum(isinstance(m, Int8Linear) for m in int8.model.modules()) >= 4 * 4  # q/k/v/o of each of 4 layers
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3, logprobs=True)
    sampled = int8.generate(PROMPTS, params)
    # The fp32 engine's log-probs of the int8 engine's tokens, by teacher forcing one forward.
    gaps = []
    for response in sampled:
        prompt = PROMPTS[response.prompt_index]
        with torch.no_grad():
            logits = reference.model(torch.tensor([prompt + response.token_ids])).logits[0, len(prompt) - 1:-1]
        train = logits.float().log_softmax(-1).gather(-1, torch.tensor(response.token_ids)[:, None])[:, 0]
        gaps.append((train - torch.tensor(response.logprobs)).abs())
    gap = torch.cat(gaps)
    # Measured: up to 0.03 (qwen2), 0.08 (mixtral: its experts' int8 values run dequantized, and a top-2 choice
    # near a tie may flip); a wrong scale or layout gives gaps of whole nats.
    assert 0 < gap.max().item() < 0.15, gap.max().item()


def test_int8_engine_reloads_in_place(tiny_models):
    hf_dir = tiny_models["qwen2"]
    engine = EmbeddedEngine(HFModelConfig.read_raw(hf_dir), device="cpu", quantization="int8")
    greedy = SamplingParams(temperature=0, max_new_tokens=6, logprobs=True)
    engine.load_weights(quantized_stream(_weights(hf_dir, 4.0), "int8"))
    first = engine.generate(PROMPTS, greedy)
    engine.load_weights(quantized_stream(_weights(hf_dir, -4.0), "int8"))
    second = engine.generate(PROMPTS, greedy)
    engine.load_weights(quantized_stream(_weights(hf_dir, 4.0), "int8"))
    assert engine.generate(PROMPTS, greedy) == first != second


def test_embedded_engine_refuses_fp8(tiny_models):
    with pytest.raises(ValueError, match="none or int8"):
        EmbeddedEngine(HFModelConfig.read_raw(tiny_models["qwen2"]), device="cpu", quantization="fp8")


def _scale_swapped(stream, target: str):
    """The stream with `target`'s per-channel scales reversed: a planted error in one quantized tensor."""
    for name, tensor in stream:
        yield name, tensor.flip(0) if name == target else tensor


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_first_transition_probe_passes_int8_and_names_a_swapped_scale(tiny_models, family):
    from verl_mega.config.errors import UserError
    from verl_mega.rollout.quantization_probe import check_quantized_rollout

    hf_dir = tiny_models[family]
    raw = HFModelConfig.read_raw(hf_dir)
    weights = _weights(hf_dir)
    reference = EmbeddedEngine(raw, device="cpu")
    reference.load_weights(weights)
    engine = EmbeddedEngine(raw, device="cpu", quantization="int8")
    engine.load_weights(quantized_stream(weights, "int8"))
    assert 0 < check_quantized_rollout(engine, reference, raw["vocab_size"]) < 1e-4  # measured 1e-5
    planted = "model.layers.2.mlp.down_proj.weight_scale"
    engine.load_weights(_scale_swapped(quantized_stream(weights, "int8"), planted))
    with pytest.raises(UserError, match="furthest tensor is 'model.layers.2.mlp.down_proj.weight'") as err:
        check_quantized_rollout(engine, reference, raw["vocab_size"])
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_grpo_run_with_int8_rollouts_measures_and_corrects_the_mismatch(tmp_path):
    """The trainer end to end (one process, 3 steps): the first transition's probe passes, token TIS is on by
    default (in the run's saved config), and the mismatch metrics see int8's rounding, small but not fp32's zero."""
    import json

    import yaml

    from verl_mega.data.synthetic import make_task_rows
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train
    from verl_mega.models.tiny import make_tiny_hf_model

    train_file = write_rows(make_task_rows("copy", 64, seed=0, max_digits=2), tmp_path / "copy.jsonl")
    hf = make_tiny_hf_model(tmp_path / "random", "qwen2", vocab_size=64)
    run_dir = tmp_path / "run"
    train(EXAMPLES / "grpo_demo.yaml", 1, [
        f"model.hf_path={hf}", f"data.train_files=[{train_file}]", f"trainer.run_dir={run_dir}",
        "trainer.total_steps=3", "rollout.quantization=int8"])
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["algorithm"]["rollout_correction"]["rollout_is"] == "token"
    assert saved["algorithm"]["rollout_correction"]["rollout_is_threshold"] == 2.0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(1e-9 < r["rollout_corr/kl_k3"] < 1e-2 for r in records), [r["rollout_corr/kl_k3"] for r in records]
