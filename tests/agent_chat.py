"""Tokenizers with tool-rendering chat templates, built offline for the multi-turn tests: a byte-level BPE
tokenizer (trained here on a few sentences, so common words are single merged tokens and the same text also has
other, non-canonical spellings) under a Qwen2.5-style template, and one under a Llama-3.1-style template."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2.5's template, shortened to what the loop meets: tools in the system prompt, Hermes <tool_call> blocks,
# consecutive tool messages grouped in one user turn of <tool_response> blocks.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
    "{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Llama-3.1's template, shortened: tools listed in the user turn, tool results as ipython turns.
LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content"
    " + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if tools and loop.first %}{{- 'Respond with a JSON function call {\"name\": ..., \"parameters\": ...}.\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                 "<|python_tag|>"]

CORPUS = [
    "What is 12 * 34? The answer is 408.", "The answer is the value the calculator returns.",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>',
    '{"name": "calculator", "parameters": {"expression": "7 + 5"}}', "You are a helpful assistant.",
    "<tool_response>\n408\n</tool_response>", "system user assistant tools function arguments expression",
]


def bpe_tokenizer(special: list[str], extra: list[str], template: str, bos: str | None = None,
                  eos: str | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS (every byte is also a token of its own), `special` tokens
    and `extra` added (non-special) ones, with `template` as its chat template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos or special[-1],
                                        pad_token=special[0])
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.add_tokens(extra)
    tokenizer.chat_template = template
    return tokenizer


def qwen_tokenizer() -> PreTrainedTokenizerFast:
    """Qwen2.5-style: <|im_end|> ends a turn (and is EOS), <tool_call> / </tool_call> are added tokens."""
    return bpe_tokenizer(QWEN_SPECIAL, ["<tool_call>", "</tool_call>"], QWEN_TEMPLATE, eos="<|im_end|>")


def llama_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-3.1-style: <|eot_id|> ends a turn, tool results come back as ipython turns."""
    return bpe_tokenizer(LLAMA_SPECIAL, [], LLAMA_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>")


def memorized_tool_model(out, row: dict, steps: int = 40, **sizes):
    """A tiny Qwen2 with `make demo-agent`'s tokenizer that has memorized one episode of `row`: the calculator
    call, then the result copied as the answer. Greedy decoding reproduces it, so a real engine under the agent
    loop must produce exactly `expected` (ids, loss mask): what the trained episode was built from."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_mega.config import ToolsConfig
    from verl_mega.demo_agent import save_tokenizer, warmup_example
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.rollout.agent_loop import ChatRenderer
    from verl_mega.tools import ToolSet

    hf = make_tiny_hf_model(out, "qwen2", **{"vocab_size": 72, "num_hidden_layers": 2, **sizes})
    tokenizer = save_tokenizer(hf)
    with ToolSet(["calculator"], ToolsConfig()) as tools:
        ids, mask = warmup_example(ChatRenderer(tokenizer, tools.schemas), row)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02) if param.dim() > 1 else param.fill_(1.0 if "norm" in name else 0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask)]])
    for _ in range(steps):
        loss = model(input_ids=inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(hf)
    return hf, (ids, mask)


def two_grpo_steps(hf, row: dict, folder, overrides=()) -> list[dict]:
    """Two GRPO steps of `make demo-agent`'s recipe on `row` (4 copies), one process, the embedded engine,
    validated greedily at step 2, with `overrides`: the run's metrics.jsonl records (the run folder is
    folder/run)."""
    import json

    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.data.tables import write_rows
    from verl_mega.demo import EXAMPLES, train

    rows = write_rows([{**row, "data_source": "arith_tool"}] * 4, folder / "rows.jsonl")
    convert_hf_to_mcore(hf, folder / "mcore", tp=1, pp=1)
    run_dir = folder / "run"
    train(EXAMPLES / "agent_demo.yaml", 1, [
        f"model.hf_path={hf}", f"model.actor_ckpt={folder / 'mcore'}", f"data.train_files=[{rows}]",
        f"data.val_files=[{rows}]", f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.val_every=2",
        "data.batch_size=2", "rollout.n=2", "actor.mini_batch_size=4", "actor.micro_batch_size=2",
        "critic.mini_batch_size=4", "trainer.log_samples_every=1", "actor.optim.lr=1e-6", "actor.optim.min_lr=0",
        *overrides])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
