"""The one exception type for mistakes the user can fix (a config key, a data row, a run folder, a reward
function): entry points print its message as one line and exit 2. Anything else is a bug and keeps its
traceback (exit 1). In config, the leaf every layer may import; it imports nothing of the project."""
from __future__ import annotations

import json
import os
import time

USER_ERROR_EXIT_CODE = 2


class UserError(ValueError):
    """A problem in what the user gave; the message names the thing to fix (file, key, row)."""


class NonFiniteError(UserError):
    """A reward, advantage, loss or gradient turned NaN/inf; raised before any optimizer step applies it."""


def first_line(err: BaseException) -> str:
    """An exception's first line, for a one-line message; its type's name where it has no text (a truncated
    pickle raises a bare EOFError())."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def report_to_launcher(message: str) -> None:
    """Leave `message` where torchrun's agent reads a failed rank's error (TORCHELASTIC_ERROR_FILE), so the
    launcher can show it instead of a bare exit code (torch.distributed.elastic's plain-message record)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": message, "timestamp": int(time.time())}
    try:
        with open(path, "w") as handle:
            json.dump(record, handle)
    except OSError:  # the message is on stderr anyway
        pass
