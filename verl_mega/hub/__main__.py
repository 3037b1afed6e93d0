"""`python -m verl_mega.hub MODEL`: the local folder of MODEL (a folder, or a Hub id `org/name[@revision]`
resolved through the cache), printed as one line; a failure is one line on stderr and exit 2. docker/train.sh
resolves MODEL_ID with it once per node, before the ranks start."""
from __future__ import annotations

import sys

from verl_mega.config.errors import USER_ERROR_EXIT_CODE

from .refs import model_ref
from .resolve import HubError, resolve_model


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m verl_mega.hub MODEL (a folder or org/name[@revision])", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    ref = model_ref(argv[0])
    try:
        print(resolve_model(ref).path if ref else argv[0])
    except HubError as err:
        print(f"error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
