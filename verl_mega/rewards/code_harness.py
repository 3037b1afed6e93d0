"""The program one code test case runs in the python sandbox (its text is this file's, with a call of `main`
appended by `code_tests`): standard library only, and nothing of the package, since it runs inside the sandbox.

It gives the answer the names verl's harness gives it (a star import of the usual contest modules, the
modules themselves, a recursion limit of 600,000), then:
- `stdin` tests: runs the answer as the main program on the case's input (the sandbox's stdin); its stdout is
  the case's output. A `sys.exit()` ends it like reaching the end (verl judges its output); an uncaught
  exception fails the case (exit status 1).
- `call` tests: loads the answer as a module, calls `fn_name` (on a `Solution()` instance when the answer
  defines `class Solution`) with one JSON value per line of the input, and writes the return value's repr to
  the stdout it had on entry; the answer's own prints go to /dev/null.
- `assert` tests: runs the answer followed by the case's assert code; the exit status says it all.
"""
import builtins
import json
import os
import sys

CONTEST_MODULES = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                   "statistics", "itertools", "functools", "operator", "io", "sys", "json")
# The order counts: a later star import shadows an earlier name (builtins restores pow over math's; typing last).
STAR_IMPORTED = (*CONTEST_MODULES, "builtins", "typing")
RECURSION_LIMIT = 600_000


def contest_namespace(module_name: str) -> dict:
    """A module namespace with the names a contest answer may use without importing them."""
    namespace = {"__name__": module_name, "__builtins__": builtins}
    lines = [f"from {module} import *" for module in STAR_IMPORTED] + [f"import {m}" for m in CONTEST_MODULES]
    exec("\n".join(lines), namespace)
    sys.setrecursionlimit(RECURSION_LIMIT)
    return namespace


def run_stdin(answer: str) -> None:
    namespace = contest_namespace("__main__")
    try:
        exec(compile(answer, "answer.py", "exec"), namespace)
    except SystemExit:
        pass
    sys.stdout.flush()


def run_call(answer: str, fn_name: str) -> None:
    arguments_text = sys.stdin.read()
    result_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(1, "w", closefd=False)
    namespace = contest_namespace("answer")
    exec(compile(answer, "answer.py", "exec"), namespace)
    target = namespace["Solution"]() if "class Solution" in answer else None
    method = getattr(target, fn_name) if target is not None else namespace[fn_name]
    result = method(*call_arguments(arguments_text))
    sys.set_int_max_str_digits(0)  # a long int's repr, as verl compares ints of any size
    with open(result_fd, "w", encoding="utf-8", errors="surrogateescape") as channel:
        channel.write(repr(result))


def call_arguments(text: str) -> list:
    """One JSON value per line; a first argument that is a dict with integer-like keys becomes the only
    argument, with int keys (JSON's keys are strings), as verl's harness does."""
    arguments = [json.loads(line) for line in text.split("\n")]
    if isinstance(arguments[0], dict):
        try:
            return [{int(key): value for key, value in arguments[0].items()}]
        except ValueError:
            pass
    return arguments


def run_assert(answer: str, assertion: str) -> None:
    exec(compile(f"{answer}\n\n{assertion}", "answer.py", "exec"), {"__name__": "__main__",
                                                                    "__builtins__": builtins})


def main(kind: str, answer: str, detail: str) -> None:
    """`kind`: "stdin", "call" (detail: fn_name) or "assert" (detail: the assert code)."""
    if kind == "stdin":
        run_stdin(answer)
    elif kind == "call":
        run_call(answer, detail)
    else:
        run_assert(answer, detail)
