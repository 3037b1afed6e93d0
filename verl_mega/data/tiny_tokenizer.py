"""A tiny character-level tokenizer for tests and demos, built offline.

Every character of the small alphabet below is one token, so digit strings and arithmetic like
"12+34=" tokenize one symbol per token, which keeps copy/add tasks learnable by very small models.
It behaves like a real instruct tokenizer where it matters: the tokenizer adds BOS on plain
encoding and the chat template renders BOS too, so code that encodes a rendered template with
special tokens switched on gets a doubled BOS (the Qwen2/Llama-Instruct pitfall) and tests can see it.
"""
from __future__ import annotations

import os
import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)
CHARACTERS = string.digits + string.ascii_lowercase + " +-*/=:;,.?!()\n"

# Each turn is "<|role|>content<eos>"; the generation prompt opens an assistant turn, so a policy's
# response ends where it emits <eos>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tiny_tokenizer(with_chat_template: bool = True) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # The default decoder joins tokens with spaces; characters must be concatenated as they are.
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
    )
    if with_chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_tokenizer(directory: str | os.PathLike, with_chat_template: bool = True) -> str:
    """Writes the tokenizer so that `AutoTokenizer.from_pretrained(directory)` loads it."""
    directory = os.fspath(directory)
    build_tiny_tokenizer(with_chat_template).save_pretrained(directory)
    return directory
