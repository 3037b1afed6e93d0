"""`make demo-agent`: a tiny model learns by RL to call the calculator for arithmetic word problems, on CPU.

1. A tiny random Qwen2-style model with the character tokenizer, given tool-call tags and a Hermes-style chat
   template (tools in the system turn, `<tool_call>{json}</tool_call>`, results as `<tool_response>` turns).
2. A short supervised warm-up on formatted episodes (call the calculator with the problem's expression, then
   copy its result as the answer). It stops while the model has the format but mostly not the numbers: its
   calls often carry a wrong operand or operator, and it cannot compute a product itself.
3. GRPO with `rollout.multi_turn` at DP2 (one process per core): each episode may call the calculator; the
   reward gives half for the call's expression and half for the answer, by the characters in place. The reward,
   the share of right answers and the share of episodes calling the tool with the right expression rise; the
   engine's greedy validation measures them on held-out problems before and after.
4. The curve (trainer/plot.py) and one held-out greedy episode before and after RL are printed.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from verl_mega.cli import main as cli
from verl_mega.config import ToolsConfig
from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.data.tables import write_rows
from verl_mega.data.tiny_tokenizer import build_tiny_tokenizer
from verl_mega.data.tokenizer import load_tokenizer
from verl_mega.demo import EXAMPLES, reward_curve, train
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.rollout.agent_loop import AgentLoop, ChatRenderer
from verl_mega.rollout.embedded import EmbeddedEngine
from verl_mega.rollout.engine import SamplingParams
from verl_mega.run.folder import RunFolder
from verl_mega.tools import ToolSet
from verl_mega.trainer.plot import read_metrics

TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# JSON's characters, and the call's fixed text as two tokens (real tokenizers merge such frequent strings): a
# model this small then learns the format in a short warm-up and spends its capacity on the expression.
JSON_TOKENS = ['{', '}', '"', '{"name":"calculator","arguments":{"expression":"', '"}}']
# Hermes' layout on the tiny tokenizer's role tokens: the tool names in a system turn, a tool result as a user
# turn of <tool_response> tags.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>tools:' }}{% for tool in tools %}{{ ' ' + tool.function.name }}{% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}{{ '<|user|><tool_response>' + message.content + '</tool_response>' + eos_token }}"
    "{% else %}{{ '<|' + message.role + '|>' + message.content + eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
# (question, expression) patterns: the numbers are drawn, the words say which operation to use.
PROBLEMS = [
    ("{a} boxes of {b} pens: pens?", "{a}*{b}"),
    ("{a} coins, {b} spent: left?", "{a}-{b}"),
    ("{a} books and {b} more: books?", "{a}+{b}"),
]
WARMUP_STEPS = 220
SEEDS = {"train": 0, "heldout": 1, "warmup": 2}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="verl_mega.demo_agent")
    parser.add_argument("--workdir", help="keep the artifacts here (default: a temp folder)")
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="supervised warm-up steps")
    parser.add_argument("--seed", type=int, default=1, help="the RL run's seed (trainer.seed, rollout.seed)")
    parser.add_argument("overrides", nargs="*", help="config overrides for the RL run (key.sub=value)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run(Path(args.workdir or tmp), args.steps, args.warmup_steps, args.seed, args.overrides)


def problem(rng: random.Random) -> dict:
    """One word problem as a data row: the question, the calculator expression and the answer."""
    question, expression = rng.choice(PROBLEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    a, b = max(a, b), min(a, b)
    expression = expression.format(a=a, b=b)
    answer = str(eval(expression, {"__builtins__": {}}))  # our own digits and one operator, never model output
    return {"prompt": [{"role": "user", "content": question.format(a=a, b=b)}], "data_source": "arith_tool",
            "reward_model": {"ground_truth": answer}, "extra_info": {"expression": expression}}


def problems(count: int, split: str) -> list[dict]:
    rng = random.Random(SEEDS[split])
    return [problem(rng) for _ in range(count)]


def positions_matched(text: str, target: str) -> float:
    """The share of `target`'s characters that `text` has at the same position (the copy task's partial credit)."""
    return sum(a == b for a, b in zip(text, target)) / max(len(text), len(target), 1)


def reward(data_source, solution_str: str, ground_truth: str, extra_info: dict) -> dict:
    """Half for the first calculator call's expression, half for the final answer, each by the characters in
    the right place (partial credit, so that GRPO's groups differ from the first step); `acc`: the answer is
    right; `tool_correct`: the answer came from a calculator call with the right expression."""
    calls = [call for call in extra_info.get("tool_calls", []) if isinstance(call.get("arguments"), dict)]
    expression = str(calls[0]["arguments"].get("expression", "")) if calls else ""
    right = extra_info["expression"]
    answer = solution_str.strip()
    return {"score": 0.5 * positions_matched(expression, right) + 0.5 * positions_matched(answer, ground_truth),
            "acc": float(answer == ground_truth),
            "tool_called": float(bool(extra_info.get("tool_results"))),
            "tool_correct": float(expression == right and any(r["ok"] for r in extra_info["tool_results"]))}


def save_tokenizer(hf_dir: Path):
    """The character tokenizer with JSON's tokens, the tool tags and the tool-rendering template."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(JSON_TOKENS + TOOL_TAGS)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(hf_dir)
    # As the trainer loads it: beside a qwen2 config.json transformers loads it as Qwen2Tokenizer, whose
    # pre-tokenizer drops the spaces, so the warm-up must see the same ids the rollouts will.
    return load_tokenizer(hf_dir)


def tool_call(expression: str) -> str:
    return f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{expression}"}}}}</tool_call>'


def warmup_example(renderer: ChatRenderer, row: dict) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a formatted episode, built as the agent loop builds one: the model's turns (the call,
    the answer) as their tokens and EOS, the template's ids for the tool result between them."""
    tokenizer, answer = renderer.tokenizer, row["reward_model"]["ground_truth"]
    messages = list(row["prompt"])
    ids = renderer.prompt_ids(messages)
    mask = [0] * len(ids)
    turns = [tool_call(row["extra_info"]["expression"]), answer]
    for index, content in enumerate(turns):
        sampled = renderer.ids(content) + [tokenizer.eos_token_id]
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        messages.append({"role": "assistant", "content": content})
        if index + 1 < len(turns):
            result = [{"role": "tool", "name": "calculator", "content": answer}]
            template = renderer.tool_turn_ids(messages, result, tokenizer.eos_token)
            messages.extend(result)
            ids, mask = ids + template, mask + [0] * len(template)
    return ids, mask


def sft_warmup(hf_dir: Path, renderer: ChatRenderer, rows: list[dict], out: Path, steps: int,
               lr: float = 3e-3) -> Path:
    """Supervised warm-up on formatted episodes, the loss on the model's tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():  # a standard init, as `make demo`'s warm-up (the tiny test weights are wild)
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02) if param.dim() > 1 else param.fill_(1.0 if "norm" in name else 0.0)
    examples = [warmup_example(renderer, row) for row in rows]
    pad = renderer.tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, 16)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([row + [pad] * (width - len(row)) for row, _ in batch])
        attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(row, mask)] + [-100] * (width - len(row))
                               for row, mask in batch])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    renderer.tokenizer.save_pretrained(out)
    return out


def greedy_episode(hf_dir: Path, row: dict) -> list[dict]:
    """The held-out row's greedy episode from the HF folder: the embedded engine and the agent loop the
    trainer validates with."""
    tokenizer = load_tokenizer(hf_dir)
    engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(hf_dir).config.to_dict(), device="cpu")
    engine.load_weights(load_file(str(hf_dir / "model.safetensors")).items())
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        loop = AgentLoop(tokenizer, tools, max_turns=3, budget=96, stop_token_ids=[tokenizer.eos_token_id],
                         tool_call_format="hermes")
        (response,) = loop.run(engine, [row["prompt"]], SamplingParams(temperature=0.0, max_new_tokens=96))
    return response.episode.messages


def print_episode(label: str, messages: list[dict]) -> None:
    print(f"[demo] {label}:")
    for message in messages:
        print(f"[demo]   {message['role']:>9}: {message['content']}")


def run(workdir: Path, steps: int, warmup_steps: int, seed: int, overrides: list[str]) -> None:
    start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    train_file = write_rows(problems(512, "train"), workdir / "arith_train.jsonl")
    heldout = problems(32, "heldout")
    heldout_file = write_rows(heldout, workdir / "arith_heldout.jsonl")
    hf = make_tiny_hf_model(workdir / "random", "qwen2", vocab_size=72)
    tokenizer = save_tokenizer(hf)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        renderer = ChatRenderer(tokenizer, tools.schemas)
        warm = sft_warmup(hf, renderer, problems(512, "warmup"), workdir / "warm", warmup_steps)
    print(f"[demo] supervised warm-up: {warmup_steps} steps on formatted calculator episodes "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    before = greedy_episode(warm, heldout[0])
    convert_hf_to_mcore(warm, workdir / "mcore", tp=1, pp=1, overwrite=True)
    run_dir = workdir / "run_agent"
    train(EXAMPLES / "agent_demo.yaml", 2, [
        f"model.hf_path={warm}", f"model.actor_ckpt={workdir / 'mcore'}", f"data.train_files=[{train_file}]",
        f"data.val_files=[{heldout_file}]", f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
        f"trainer.val_every={max(steps // 4, 1)}", f"trainer.seed={seed}", f"rollout.seed={seed}", *overrides])
    records = read_metrics(RunFolder(run_dir).metrics)
    trained = [r for r in records if "reward/mean" in r]
    for name, key in (("reward", "reward/mean"), ("right answers", "reward/acc"),
                      ("tool called", "reward/tool_called"),
                      ("tool called with the right expression", "reward/tool_correct"),
                      ("turns per episode", "multi_turn/turns_mean")):
        print(f"[demo] GRPO multi-turn at dp=2, {steps} steps: {name} {reward_curve([r[key] for r in trained])}")
    validation = [r for r in records if "val/reward_mean" in r]
    print("[demo] held-out greedy episodes (the engine's validation): " + ", ".join(
        f"step {r['step']}: reward {r['val/reward_mean']:.2f}, right answers {r['val/reward/acc']:.2f}, right calls "
        f"{r['val/reward/tool_correct']:.2f}"
        for r in validation))
    if cli(["plot", str(run_dir)]) != 0:
        raise SystemExit("[demo] plot failed")
    if cli(["export", "--ckpt", str(run_dir), "--out", str(workdir / "agent_hf"), "--overwrite"]) != 0:
        raise SystemExit("[demo] export failed")
    print_episode("a held-out episode before RL (greedy)", before)
    print_episode("the same after RL (greedy, from the exported folder)", greedy_episode(workdir / "agent_hf",
                                                                                           heldout[0]))
    print(f"[demo] done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
