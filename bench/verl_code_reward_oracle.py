"""verl's own code scorer as the oracle for `code_tests`, on rows and answers chosen to cover the formats.

    python -m bench.verl_code_reward_oracle --verl /path/to/verl-checkout

Imports `verl/utils/reward_score/prime_code/` from the checkout (read there, never copied into this
repository) as a package, with one stand-in for what it imports: `pyext.RuntimeModule.from_string`, a module
made from source text (pyext does not install on current Pythons). Runs the answers below through verl's
`compute_score(answer, tests, continuous=True)` (what verl's default uses for codecontests / apps / codeforces /
taco without a sandbox-fusion URL) and through ours, and prints the agreement count; the answers where the two
are known to part (docs/code-rewards.md) are counted apart. verl runs the answers unsandboxed: they are benign.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

from verl_mega.rewards.code_tests import code_tests_score

PRIME_CODE = Path("verl/utils/reward_score/prime_code")
PYEXT = ("import types\n\nclass RuntimeModule:\n    @staticmethod\n    def from_string(name, doc, source):\n"
         "        module = types.ModuleType(name, doc)\n        exec(source, module.__dict__)\n        return module\n")

SUM = {"inputs": ["1 2\n", "3 4\n", "10 20\n"], "outputs": ["3\n", "7\n", "30\n"]}
LONG = {"inputs": [f"{i}\n" for i in range(13)], "outputs": [f"{i * i}\n" for i in range(13)]}
FLOATS = {"inputs": ["1 3\n", "2 3\n"], "outputs": ["0.33333333\n", "0.66666667\n"]}
LINES = {"inputs": ["3\n"], "outputs": ["1\n2\n3\n"]}
CALL = {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]", "5\n-5"], "outputs": ["3", "[[1, 2]]", "0"]}
CLASS = {"fn_name": "pair", "inputs": ["1", "4"], "outputs": ["[1, 2]", "[4, 5]"]}
ROWS_AND_ANSWERS = [
    (SUM, "```python\na, b = map(int, input().split())\nprint(a + b)\n```"),
    (SUM, "```python\na, b = map(int, input().split())\nprint(0 if a == 10 else a + b)\n```"),
    (SUM, "a, b = map(int, input().split())\nprint(a + b)"),
    (SUM, "Answer:\n```python\nprint(sum(map(int, input().split())))\n```\nand ```python\nprint(0)\n```"),
    (SUM, "```python\nraise ValueError\n```"),
    (SUM, "```python\nprint(1 +\n```"),
    (SUM, "```python\nimport sys\na, b = map(int, sys.stdin.readline().split())\nprint(a + b)\nsys.exit(2)\n```"),
    (SUM, "```python\ndef main():\n    a, b = map(int, input().split())\n    print(a + b)\n\n"
          "if __name__ == '__main__':\n    main()\n```"),
    (SUM, "```python\na, b = map(int, input().split())\nprint(a + b, end='  \\n\\n')\n```"),
    (SUM, "```python\na, b = map(int, input().split())\nprint(a * b)\n```"),
    (LONG, "```python\nn = int(input())\nprint(n * n)\n```"),
    (LONG, "```python\nn = int(input())\nprint(-1 if n > 9 else n * n)\n```"),
    (LONG, "```python\nn = int(input())\nprint(-1 if n in (0, 3) else n * n)\n```"),
    (FLOATS, "```python\na, b = map(int, input().split())\nprint(a / b)\n```"),
    (FLOATS, "```python\na, b = map(int, input().split())\nprint(round(a / b, 3))\n```"),
    (LINES, "```python\nn = int(input())\nfor i in range(1, n + 1):\n    print(' ', i, ' ')\n```"),
    (LINES, "```python\nn = int(input())\nprint(*range(1, n + 1))\n```"),
    (LINES, "```python\nn = int(input())\nprint(*range(1, n + 1), sep='\\n\\n')\n```"),
    (CALL, "```python\ndef add(a, b):\n    print('noise')\n    return a + b\n```"),
    (CALL, "```python\ndef add(a, b):\n    return a - b\n```"),
    (CALL, "```python\ndef plus(a, b):\n    return a + b\n```"),
    (CLASS, "```python\nclass Solution:\n    def pair(self, n):\n        return (n, n + 1)\n```"),
    (CLASS, "```python\nclass Solution:\n    def pair(self, n):\n        return [n, n + 2]\n```"),
    (CLASS, "```python\ndef pair(n):\n    return [n, sqrt(n * n) + 1]\n```"),  # sqrt from the star imports
]
# Where the two part by design (docs/code-rewards.md): correct programs verl's in-process harness fails.
KNOWN_DIFFERENT = [
    (SUM, "```python\nimport sys\na, b = map(int, sys.stdin.buffer.readline().split())\nprint(a + b)\n```"),
    (SUM, "```python\na, b = map(int, input().split())\nprint(a + b)\nexit()\n```"),
    (SUM, "```python\ntotal = 0\ndef add(x):\n    global total\n    total += x\n"
          "for v in map(int, input().split()):\n    add(v)\nprint(total)\n```"),
]


def import_prime_code(verl_checkout: Path, scratch: Path):
    source = verl_checkout / PRIME_CODE
    if not (source / "__init__.py").is_file():
        raise SystemExit(f"--verl {verl_checkout}: no {PRIME_CODE} there (a checkout of volcengine/verl is needed)")
    (scratch / "pyext.py").write_text(PYEXT)
    (scratch / "prime_code").symlink_to(source.resolve())
    sys.path.insert(0, str(scratch))
    return importlib.import_module("prime_code")


def verl_score(prime_code: types.ModuleType, tests: dict, answer: str) -> float:
    """As verl's default_compute_score reads prime_code's (success, metadata): float of the first."""
    return float(prime_code.compute_score(answer, json.dumps(tests), continuous=True)[0])


def compare(prime_code, pairs) -> list[tuple[float, float, str]]:
    return [(verl_score(prime_code, tests, answer), code_tests_score("codecontests", answer, json.dumps(tests))
             ["score"], answer) for tests, answer in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verl", type=Path, required=True, help="a checkout of volcengine/verl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        prime_code = import_prime_code(args.verl, Path(scratch))
        same = compare(prime_code, ROWS_AND_ANSWERS)
        known = compare(prime_code, KNOWN_DIFFERENT)
    differing = [(theirs, ours, answer) for theirs, ours, answer in same if abs(theirs - ours) > 1e-9]
    print(f"{len(same) - len(differing)} of {len(same)} answers score the same as verl's prime_code")
    for theirs, ours, answer in differing:
        print(f"  DIFFERENT verl {theirs:.4f} ours {ours:.4f}: {answer!r}")
    parted = sum(abs(theirs - ours) > 1e-9 for theirs, ours, _ in known)
    print(f"{parted} of {len(known)} known divergences differ as documented:")
    for theirs, ours, answer in known:
        print(f"  verl {theirs:.4f} ours {ours:.4f}: {answer!r}")


if __name__ == "__main__":
    main()
