"""The one way a model folder's tokenizer is loaded: transformers' own loader, with what it raises on a hostile
`tokenizer_config.json` (a list for `eos_token`, a number for `tokenizer_class`: TypeErrors, IndexErrors) turned
into a ValueError naming the folder, which the pre-flight check and the command line print as one line."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (ValueError, OSError, ImportError) as err:  # transformers' own refusals already name what is wrong
        raise ValueError(f"{folder}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a file transformers' reader trips over, whatever it raises
        raise ValueError(f"{folder}: its tokenizer files cannot be loaded ({type(err).__name__}: {err})") from None
