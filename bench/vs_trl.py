"""verl_mega against TRL's GRPOTrainer, side by side, one after the other, on the same model, data and reward.

    python -m bench.vs_trl [--scale tiny|llama100m|both] [--steps 5] [--threads 2] [--rounds 3] [--trl-micro-batch 32]
                           [--trl-venv DIR]

TRL runs in a venv of its own (`--trl-venv`, built on first use: TRL's release of the `[bench]` extra with this
venv's torch, transformers and accelerate, pinned; pip takes them from the machine's wheels or PyPI), without
vLLM: TRL imports its vLLM client whenever vLLM is installed, which this project's test venv holds, and that
import was half of TRL's start-up. Where TRL's venv holds vLLM anyway, the header says so with what importing it
costs.

Both run GRPO in fp32 on the CPU with equal settings: 8 prompts x 4 samples per step, the same maximum of new
tokens, learning rate, clip ratio, temperature and chat template, no KL term, one optimizer step per trainer
step (one epoch over one mini-batch of all 32 samples, in one forward/backward pass; `--trl-micro-batch 8`
gives TRL four passes of 8, its best setting on a real 135M model). The task is the synthetic
copy task with its partial-credit rule reward. Each side runs in its own fresh process with the same thread count:
TRL in `python -c` (`trl_process`), verl_mega as a user starts it: `verl-mega launch local --nproc 1`.

Models are built here, nothing comes from a hub: `tiny` is the tests' tiny Qwen2 (character tokenizer);
`llama100m` is a ~110M-parameter Llama-shaped random model with a byte-level BPE tokenizer trained here with
`tokenizers` on generated text. Random weights generate until the length limit, so both systems decode the
same number of tokens per step.

Printed: per system the median step time (wall, and the process's CPU time, which a busy shared machine
disturbs much less) over the steps after the first (warm-up), completion tokens/s, the per-stage breakdown,
and the whole run (the command to the process's exit, same work on both sides: imports, loading the model,
the steps, the checkpoint both write after the last step) split into start-up (the command to the first
step) and exit (the end of the last step to the exit); then the ratios, steps/s and whole run. With
`--rounds` > 1 the pair runs again, each round printing the load average as it starts, and the medians of the
rounds' ratios close the report (the speed of a shared machine drifts between runs by more than the two systems
differ). The header prints what each side's imports cost in CPU seconds in a fresh interpreter.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
TRL_RELEASE = "1.16.0"  # setup.py's [bench] extra
# TRL's venv takes these releases from this one, so that both sides run the same torch and model code.
SHARED_PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "tokenizers")
STEP_END = re.compile(r"step \d+: .*\bstep_seconds=")  # verl_mega's line for a step that has ended
STEP_BEGINS, STEP_ENDS = "vs_trl: a TRL step begins", "vs_trl: a TRL step ends"
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 8, 4
SEQUENCES_PER_STEP = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
SCALES = {
    # max new tokens, learning rate, max prompt tokens
    "tiny": dict(max_new_tokens=16, lr=1e-4, max_prompt_length=32),
    "llama100m": dict(max_new_tokens=32, lr=1e-6, max_prompt_length=64),
}
LLAMA_100M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=16384, max_position_embeddings=512, tie_word_embeddings=False)


# --- models -----------------------------------------------------------------------------------------------

def build_tiny(out: Path) -> Path:
    from verl_mega.models.tiny import make_tiny_hf_model

    return make_tiny_hf_model(out, "qwen2", vocab_size=64)


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained here on generated text, with the tiny tokenizer's special tokens,
    BOS handling and chat template, so that both trainers see a real sub-word vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from verl_mega.data import tiny_tokenizer as tiny

    rng = random.Random(0)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9))) for _ in range(4000)]
    corpus = [" ".join(rng.choice(words) for _ in range(20)) + " copy: " + str(rng.randint(0, 10**6))
              for _ in range(20000)]
    backend = Tokenizer(models.BPE(unk_token=tiny.UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(tiny.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos_id = backend.token_to_id(tiny.BOS_TOKEN)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{tiny.BOS_TOKEN} $A", pair=f"{tiny.BOS_TOKEN} $A $B", special_tokens=[(tiny.BOS_TOKEN, bos_id)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=tiny.PAD_TOKEN, bos_token=tiny.BOS_TOKEN, eos_token=tiny.EOS_TOKEN,
        unk_token=tiny.UNK_TOKEN, additional_special_tokens=list(tiny.ROLE_TOKENS))
    tokenizer.chat_template = tiny.CHAT_TEMPLATE
    return tokenizer


def build_llama100m(out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = bpe_tokenizer(LLAMA_100M["vocab_size"])
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_100M, **special))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


BUILDERS = {"tiny": build_tiny, "llama100m": build_llama100m}


# --- the two trainers -------------------------------------------------------------------------------------

def copy_rows(count: int) -> list[dict]:
    from verl_mega.data.synthetic import make_task_rows

    return make_task_rows("copy", count, seed=0, max_digits=6)


def trl_venv(folder: Path) -> Path:
    """The python of `folder`, a venv holding TRL_RELEASE and this venv's SHARED_PACKAGES, built when it lacks TRL."""
    python = folder / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import trl"], capture_output=True).returncode == 0:
        return python
    print(f"building TRL's venv in {folder}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    pins = [f"{name}=={version(name).split('+')[0]}" for name in SHARED_PACKAGES]
    subprocess.run([python, "-m", "pip", "install", "--quiet", *pins, f"trl=={TRL_RELEASE}"], check=True)
    return python


def trl_imports(python: Path, threads: int) -> str:
    """What TRL's imports cost in a fresh interpreter of its venv, with vLLM's share when that venv holds vLLM."""
    line = (f"TRL's {import_cpu_seconds('import trl, datasets; from trl import GRPOTrainer', threads, python):.1f} "
            f"CPU-s")
    has_vllm = subprocess.run([python, "-c", "import importlib.util, sys; "
                                             "sys.exit(importlib.util.find_spec('vllm') is None)"]).returncode == 0
    if has_vllm:
        line += (f" (its venv holds vLLM, whose client TRL imports: vLLM's own import "
                 f"{import_cpu_seconds('import vllm', threads, python):.1f} CPU-s)")
    return line + ("" if has_vllm else ", its venv without vLLM")


def run_trl(python: Path, hf_dir: Path, rows: list[dict], settings: dict, steps: int, threads: int, out: Path,
            micro_batch: int) -> dict:
    """TRL in a fresh interpreter (`trl_process`), so that its whole run, like verl_mega's, counts from the command
    (imports included) to the process's exit."""
    spec = out / "trl_spec.json"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(dict(hf_dir=str(hf_dir), rows=rows, settings=settings, steps=steps, threads=threads,
                                    out=str(out), micro_batch=micro_batch)))
    command = [str(python), "-c", "import sys; from bench.vs_trl import trl_process; trl_process(sys.argv[1])",
               str(spec)]
    lines, wall = timed_lines(command, {"OMP_NUM_THREADS": str(threads)}, cwd=ROOT)
    result = json.loads((out / "trl_result.json").read_text())
    first_begin = next(at for at, line in lines if STEP_BEGINS in line)
    last_end = [at for at, line in lines if STEP_ENDS in line][-1]
    return {**result, "whole_run": wall, "start_up": first_begin, "exit": wall - last_end}


def trl_process(spec_path: str) -> None:
    """The TRL side of a round, in its own process: prints a marker at each step's start and end, and writes its
    summary next to the spec."""
    spec = json.loads(Path(spec_path).read_text())
    result = train_trl(Path(spec["hf_dir"]), spec["rows"], spec["settings"], spec["steps"], spec["threads"],
                       Path(spec["out"]), spec["micro_batch"])
    (Path(spec["out"]) / "trl_result.json").write_text(json.dumps(result))


def train_trl(hf_dir: Path, rows: list[dict], settings: dict, steps: int, threads: int, out: Path,
              micro_batch: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    copy_score = rules_module().copy_score
    torch.set_num_threads(threads)

    def copy_reward(prompts, completions, ground_truth, **_):
        return [copy_score("copy", completion[-1]["content"], truth)
                for completion, truth in zip(completions, ground_truth)]

    dataset = Dataset.from_list([{"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]}
                                 for row in rows])
    config = GRPOConfig(
        # All 32 sequences generated at once, then `micro_batch` of them per forward/backward: one optimizer step.
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=SEQUENCES_PER_STEP // micro_batch, num_iterations=1,
        num_generations=SAMPLES_PER_PROMPT, max_completion_length=settings["max_new_tokens"],
        learning_rate=settings["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=0.2, temperature=1.0, top_p=1.0, loss_type="dapo",
        use_cpu=True, bf16=False, fp16=False, logging_steps=1, report_to="none", seed=1, dataloader_num_workers=0,
        disable_dropout=True,
        # A checkpoint (model and optimizer) after the last step, as verl_mega writes one.
        save_strategy="steps", save_steps=steps,
    )
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=copy_reward, args=config, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(hf_dir))
    stage_seconds: list[dict[str, float]] = []

    def timed(name, method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                stage_seconds[-1][name] = stage_seconds[-1].get(name, 0.0) + time.perf_counter() - start
        return wrapper

    # Generation, reward, the whole rollout preparation (generation, reward, advantages) and the update's loss
    # forward; the rest of a step is backward and the optimizer.
    for name, attribute in (("generate", "_generate"), ("reward", "_calculate_rewards"),
                            ("rollout_total", "_generate_and_score_completions"), ("loss_forward", "_compute_loss")):
        setattr(trainer, attribute, timed(name, getattr(trainer, attribute)))

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            print(f"\n{STEP_BEGINS}", flush=True)  # on a line of its own, whatever the progress bar wrote
            stage_seconds.append({"_start": time.perf_counter(), "_cpu_start": time.process_time()})

        def on_step_end(self, args, state, control, **kwargs):
            stage_seconds[-1]["step"] = time.perf_counter() - stage_seconds[-1].pop("_start")
            stage_seconds[-1]["step_cpu"] = time.process_time() - stage_seconds[-1].pop("_cpu_start")
            print(f"\n{STEP_ENDS}", flush=True)

    trainer.add_callback(StepTimes())
    trainer.train()
    lengths = [record["completions/mean_length"] for record in trainer.state.log_history
               if "completions/mean_length" in record]
    for seconds in stage_seconds:
        seconds["update_rest"] = seconds["step"] - seconds.get("rollout_total", 0.0) - seconds.get("loss_forward", 0.0)
    return summarise(stage_seconds, lengths)


def rules_module():
    """verl_mega's string rewards (`verl_mega/rewards/rules.py`, standard library only) read from their file: TRL's
    venv holds no verl_mega, and importing the package checks for megatron-core."""
    spec = importlib.util.spec_from_file_location("verl_mega_rules", ROOT / "verl_mega" / "rewards" / "rules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grpo_config(settings: dict, steps: int) -> str:
    """verl_mega's GRPO config of the comparison (see the module docstring), as YAML."""
    return f"""
parallel: {{tp: 1, pp: 1, rollout_tp: 1}}
data: {{max_prompt_length: {settings['max_prompt_length']}, max_response_length: {settings['max_new_tokens']},
        batch_size: {PROMPTS_PER_STEP}, truncation: error}}
rollout: {{n: {SAMPLES_PER_PROMPT}, temperature: 1.0}}
actor:
  optim: {{lr: {settings['lr']}, weight_decay: 0.0, clip_grad: 1.0}}
  loss: {{clip_ratio: 0.2, loss_agg_mode: token-mean}}
  ppo_epochs: 1
  mini_batch_size: {SEQUENCES_PER_STEP}
  micro_batch_size: {SEQUENCES_PER_STEP}
critic: {{enable: false}}
algorithm: {{adv_estimator: grpo}}
reward: {{function: copy}}
trainer: {{total_steps: {steps}, seed: 1, progress_bar: false}}
"""


def run_verl_mega(hf_dir: Path, rows: list[dict], settings: dict, steps: int, threads: int, out: Path,
                  quantization: str = "none") -> dict:
    from verl_mega.data.tables import write_rows
    from verl_mega.run.folder import RunFolder
    from verl_mega.trainer.plot import read_metrics

    data = write_rows(rows, out / "copy.jsonl")
    config = out / "grpo.yaml"
    config.write_text(grpo_config(settings, steps))
    run_dir = out / "run"
    lines, wall = timed_lines([
        sys.executable, "-m", "verl_mega.cli", "launch", "local", "--nproc", "1", str(config),
        f"model.hf_path={hf_dir}", f"data.train_files=[{data}]", f"trainer.run_dir={run_dir}",
        f"rollout.quantization={quantization}",
    ], {"OMP_NUM_THREADS": str(threads)})
    records = read_metrics(RunFolder(run_dir).metrics)
    stage_seconds = [{"step": record["perf/step_seconds"], "step_cpu": record["perf/step_cpu_seconds"],
                      **{key[len("timing/"):]: value for key, value in record.items() if key.startswith("timing/")}}
                     for record in records]
    # Each step's metrics line is printed as it ends (the first began its step_seconds before its line); the
    # progress lines of the first step ("step 1, the first of this run ...") come before it ends and are not it.
    step_lines = [at for at, line in lines if STEP_END.match(line)]
    return {**summarise(stage_seconds, [record["response/length_mean"] for record in records]),
            "whole_run": wall, "start_up": step_lines[0] - records[0]["perf/step_seconds"],
            "exit": wall - step_lines[-1]}


def timed_lines(command: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[list, float]:
    """Runs `command`, echoing its output; (seconds since the command to each output line, the line) and the
    seconds from the command to the process's exit. Raises CalledProcessError on a failure."""
    start = time.perf_counter()
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env}) as process:
        for line in process.stdout:
            lines.append((time.perf_counter() - start, line))
            print(line, end="")
    wall = time.perf_counter() - start
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return lines, wall


def import_cpu_seconds(statement: str, threads: int, python: Path | str = sys.executable) -> float:
    """CPU seconds a fresh interpreter (`python`) spends on `statement` (an import) and all it pulls in."""
    code = (f"import resource; {statement}; usage = resource.getrusage(resource.RUSAGE_SELF); "
            "print(usage.ru_utime + usage.ru_stime)")
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return float(result.stdout.strip().splitlines()[-1])


def summarise(stage_seconds: list[dict[str, float]], mean_lengths: list[float]) -> dict:
    """Medians over the steps after the first; tokens/s from the completion tokens of the same steps."""
    measured = stage_seconds[1:] or stage_seconds
    stages = sorted({name for seconds in measured for name in seconds} - {"step", "step_cpu"})
    step = statistics.median(seconds["step"] for seconds in measured)
    step_cpu = statistics.median(seconds["step_cpu"] for seconds in measured)
    tokens = statistics.median(mean_lengths[1:] or mean_lengths) * SEQUENCES_PER_STEP
    return {"step": step, "step_cpu": step_cpu, "tokens_per_second": tokens / step, "completion_tokens": tokens,
            "stages": {name: statistics.median(seconds.get(name, 0.0) for seconds in measured) for name in stages}}


def report(scale: str, rounds: list[tuple[dict, dict]]) -> None:
    """Each round's figures, then the median over rounds of the per-round ratios (a round runs TRL, then
    verl_mega, so a change in the machine's speed between rounds weighs on both sides of its ratio alike)."""
    for number, (trl, ours) in enumerate(rounds, 1):
        print(f"\n== {scale}, round {number} of {len(rounds)}: median of the steps after the first ==")
        for name, result in (("TRL GRPOTrainer", trl), ("verl_mega", ours)):
            stages = ", ".join(f"{stage} {seconds:.3f}" for stage, seconds in result["stages"].items())
            print(f"{name:<16} step {result['step']:.3f} s (CPU {result['step_cpu']:.3f} s), "
                  f"{result['completion_tokens']:.0f} completion tokens, "
                  f"{result['tokens_per_second']:.0f} tokens/s; whole run {result['whole_run']:.1f} s: start-up "
                  f"{result['start_up']:.1f} s (command to the first step), exit {result['exit']:.1f} s (last step "
                  f"to the exit)")
            print(f"{'':<16} stages (s): {stages}")
        print(f"verl_mega / TRL: {trl['step'] / ours['step']:.2f}x steps/s, "
              f"{ours['tokens_per_second'] / trl['tokens_per_second']:.2f}x completion tokens/s; "
              f"{trl['step_cpu'] / ours['step_cpu']:.2f}x in CPU seconds per step (steadier when the machine is "
              f"shared); {trl['whole_run'] / ours['whole_run']:.2f}x whole run")
    for label, key in (("steps/s", "step"), ("CPU seconds per step", "step_cpu"), ("whole run", "whole_run")):
        ratios = [trl[key] / ours[key] for trl, ours in rounds]
        print(f"{scale}: verl_mega / TRL, {label}, over {len(rounds)} round(s): median "
              f"{statistics.median(ratios):.2f}x (rounds {', '.join(f'{ratio:.2f}' for ratio in ratios)})")
    for name, side in (("TRL", 0), ("verl_mega", 1)):
        print(f"{scale}: {name} start-up median {statistics.median(r[side]['start_up'] for r in rounds):.1f} s, "
              f"exit median {statistics.median(r[side]['exit'] for r in rounds):.1f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=[*SCALES, "both"], default="tiny")
    parser.add_argument("--steps", type=int, default=5, help="trainer steps per system; the first is warm-up")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both systems")
    parser.add_argument("--rounds", type=int, default=3, help="TRL then verl_mega, this many times per scale")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none",
                        help="verl_mega's rollout.quantization (TRL stays on its defaults)")
    parser.add_argument("--trl-micro-batch", type=int, default=SEQUENCES_PER_STEP,
                        help=f"sequences per TRL forward/backward (a divisor of {SEQUENCES_PER_STEP}; 8 was its best "
                             "on a real 135M model)")
    parser.add_argument("--trl-venv", type=Path,
                        default=Path(tempfile.gettempdir()) / f"verl_mega_bench_trl{TRL_RELEASE}",
                        help="TRL's venv, built there when it lacks TRL (see above)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2: the first step is warm-up and not measured")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.trl_micro_batch < 1 or SEQUENCES_PER_STEP % args.trl_micro_batch:
        parser.error(f"--trl-micro-batch must divide {SEQUENCES_PER_STEP}")
    trl_python = trl_venv(args.trl_venv)
    scales = list(SCALES) if args.scale == "both" else [args.scale]
    rows = copy_rows(PROMPTS_PER_STEP * args.steps)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.steps} steps per system, "
          f"{PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples, fp32, load average {os.getloadavg()[0]:.1f}")
    print(f"imports in a fresh interpreter: verl_mega's launcher and trainer "
          f"{import_cpu_seconds('import verl_mega.cli, verl_mega.launch.local, megatron.core', args.threads):.1f} "
          f"CPU-s, {trl_imports(trl_python, args.threads)}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for scale in scales:
            hf_dir = BUILDERS[scale](tmp / scale / "hf")
            params = sum(tensor.numel() for tensor in load_file(hf_dir / "model.safetensors").values())
            print(f"{scale}: {params / 1e6:.2f}M parameters, {SCALES[scale]['max_new_tokens']} max new tokens")
            rounds = []
            for number in range(args.rounds):
                print(f"{scale}, round {number + 1}: load average {os.getloadavg()[0]:.1f}", flush=True)
                rounds.append((run_trl(trl_python, hf_dir, rows, SCALES[scale], args.steps, args.threads,
                                       tmp / scale / f"trl{number}", args.trl_micro_batch),
                               run_verl_mega(hf_dir, rows, SCALES[scale], args.steps, args.threads,
                                             tmp / scale / f"verl_mega{number}", args.quantization)))
            report(scale, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
