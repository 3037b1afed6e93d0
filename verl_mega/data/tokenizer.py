"""The one way a model folder's tokenizer is loaded: transformers' own loader, with what it raises on a hostile
`tokenizer_config.json` (a list for `eos_token`, a number for `tokenizer_class`: TypeErrors, IndexErrors) turned
into a ValueError naming the folder, which the pre-flight check and the command line print as one line."""
from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:  # the message names no file: find it
        raise ValueError(f"{_not_json(Path(folder)) or folder}: not valid JSON text ({err}); the tokenizer "
                         "cannot be loaded") from None
    except (ValueError, OSError, ImportError) as err:  # transformers' own refusals already name what is wrong
        raise ValueError(f"{folder}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a file transformers' reader trips over, whatever it raises
        raise ValueError(f"{folder}: its tokenizer files cannot be loaded ({type(err).__name__}: {err})") from None


def _not_json(folder: Path) -> Path | None:
    """The first *.json file of `folder` that does not parse (None: all do, or the folder is unreadable)."""
    try:
        candidates = sorted(path for path in folder.glob("*.json") if path.is_file())
        for path in candidates:
            try:
                json.loads(path.read_bytes())
            except ValueError:  # JSONDecodeError, and UnicodeDecodeError from bytes that are not text
                return path
    except OSError:
        return None
    return None


def vocabulary_difference(tokenizer, other) -> str | None:
    """How `other`'s vocabulary differs from `tokenizer`'s, in a phrase (None: the same token for every id):
    the sizes, and the first id whose token differs."""
    ours, theirs = _tokens_by_id(tokenizer), _tokens_by_id(other)
    if ours == theirs:
        return None
    first = min(token_id for token_id in ours.keys() | theirs.keys() if ours.get(token_id) != theirs.get(token_id))
    return (f"{len(ours)} vs {len(theirs)} tokens, first differing id {first}: {ours.get(first)!r} vs "
            f"{theirs.get(first)!r}")


def _tokens_by_id(tokenizer) -> dict[int, str]:
    return {token_id: token for token, token_id in tokenizer.get_vocab().items()}
