"""`code_tests`: a code answer scored by running its test cases, each in the python tool's sandbox (a fresh
confined interpreter: `verl_mega.tools.sandbox`, threat model in docs/tools.md), under `reward.code`'s limits.

The semantics are those of verl's `default_compute_score` for its code sources (codecontests, apps,
codeforces, taco) without a sandbox-fusion URL, i.e. `prime_code.compute_score(..., continuous=True)`, read at
volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29); docs/code-rewards.md lists where they
part:
- the code is the text after the response's last "```python" up to the next "```" (the whole response when it
  has no "```python");
- the ground truth (a dict or its JSON text) holds "inputs" and "outputs", one per test case, plus "fn_name" for
  call-based tests; sandbox fusion's "assert_case" list (a case passes when the answer followed by its assert
  code exits normally) is read too;
- the score is the fraction of the first `max_tests` (verl: 10) cases that pass. verl first runs every case
  and returns 1 when all pass; otherwise the fraction of the first 10, so the later cases never change the
  score and are not run here;
- stdin tests compare the output with verl's chain of tolerances (`stdout_matches`), call-based tests the return
  value as verl does (`return_matches`).

The cases of an answer run at once (`reward.code.workers`, default one per core). Each is its own program: a
crash, a timeout, a fork bomb or a flood of output fails that case only. With `reward.code.sandbox_url` set,
each case's same program runs on that SandboxFusion service instead (`sandbox_fusion.py`), judged the same way.
"""
from __future__ import annotations

import ast
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from verl_mega.config.errors import UserError
from verl_mega.config.schema import ConfigError, PythonSandboxConfig, RewardCodeConfig
from verl_mega.tools.sandbox import PythonSandbox

from .sandbox_fusion import SandboxFusion

HARNESS = Path(__file__).with_name("code_harness.py").read_text()
FENCE, PYTHON_FENCE = "```", "```python"
# np.allclose's defaults, which verl's float comparison uses: |output - expected| <= ATOL + RTOL * |expected|.
RTOL, ATOL = 1e-5, 1e-8
# What fails a case besides a wrong answer, by the sandbox's error category.
FAILURES = {"timeout": "timeout", "output_truncated": "output_limit", "raised": "error", "cpu_limit": "timeout",
            "file_size_limit": "error", "killed": "error"}

_settings = RewardCodeConfig()
_sandboxes: dict[tuple, PythonSandbox | SandboxFusion] = {}


class TestCase(NamedTuple):
    kind: str  # "stdin", "call" or "assert"
    stdin: str  # the program's standard input (call: the arguments, one JSON value per line)
    expected: Any  # stdin: the output text; call: the return value's JSON; assert: None
    detail: str  # call: fn_name; assert: the assert code; stdin: ""


def configure(config: RewardCodeConfig) -> None:
    """The limits of this process's code scoring (the scoring worker's, or the trainer's without one)."""
    global _settings
    _settings = config


def code_tests_score(data_source, solution_str: str, ground_truth, extra_info=None) -> dict:
    """The fraction of the answer's first test cases that pass, with how many passed and each one's outcome."""
    cases = read_tests(ground_truth)[: _settings.max_tests]
    answer = extract_code(solution_str)
    workers = min(_settings.workers or os.cpu_count() or 1, len(cases))
    sandbox = sandbox_for(_settings)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-test") as pool:
        outcomes = list(pool.map(lambda case: run_case(sandbox, answer, case), cases))
    passed = outcomes.count("pass")
    return {"score": passed / len(cases), "tests_passed": passed, "tests_run": len(cases),
            "test_outcomes": outcomes}


def extract_code(response: str) -> str:
    """The text after the last "```python" up to the next "```" (verl's rule: a response without "```python"
    is taken whole, up to its first "```")."""
    return response.split(PYTHON_FENCE)[-1].split(FENCE)[0]


def read_tests(ground_truth) -> list[TestCase]:
    """The test cases of a row's ground truth; ValueError naming what is wrong with it."""
    tests = ground_truth
    if isinstance(tests, (str, bytes)):
        try:
            tests = json.loads(tests)
        except ValueError as error:
            raise ValueError(f"the ground truth of a code row must be a dict of test cases or its JSON text; "
                             f"it is not JSON ({error})") from None
    if not isinstance(tests, dict):
        raise ValueError(f"the ground truth of a code row must be a dict of test cases, got {type(tests).__name__}")
    asserts = tests.get("assert_case")
    if isinstance(asserts, list):
        cases = [TestCase("assert", "", None, str(code)) for code in asserts]
    else:
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("the ground truth of a code row needs lists 'inputs' and 'outputs' of the same length "
                             f"(or 'assert_case'); it has keys {sorted(map(str, tests))[:8]}")
        fn_name = tests.get("fn_name")
        kind = "stdin" if fn_name is None else "call"
        cases = [TestCase(kind, case_input, expected, str(fn_name or "")) for case_input, expected in
                 zip(inputs, outputs)]
    if not cases:
        raise ValueError("the ground truth of a code row has no test cases")
    return cases


def sandbox_for(config: RewardCodeConfig) -> PythonSandbox | SandboxFusion:
    """The sandbox of these limits: the SandboxFusion service at reward.code.sandbox_url, or the local one,
    checked once per process to start here (UserError where it cannot: no network namespace, for one: answers
    are never run with the host's network)."""
    key = (config.test_timeout_s, config.memory_mb, config.max_output_chars, config.sandbox_url,
           config.sandbox_retries, config.sandbox_backoff_s)
    if key in _sandboxes:
        return _sandboxes[key]
    if config.sandbox_url:
        _sandboxes[key] = SandboxFusion(config)
    else:
        limits = PythonSandboxConfig(cpu_seconds=math.ceil(config.test_timeout_s) + 1, memory_mb=config.memory_mb)
        sandbox = PythonSandbox(limits, config.test_timeout_s, config.max_output_chars)
        try:
            sandbox.probe()
        except ConfigError as error:
            raise UserError(f"code rewards run each test in the python sandbox, which {error}".replace(
                "tools.python: ", "")) from None
        _sandboxes[key] = sandbox
    return _sandboxes[key]


def run_case(sandbox: PythonSandbox | SandboxFusion, answer: str, case: TestCase) -> str:
    """"pass", "wrong", or why the case failed: "error", "timeout", "output_limit", "bad_case" (a case verl's
    harness cannot read either: an input that is not text)."""
    stdin = case_stdin(case)
    if stdin is None:
        return "bad_case"
    program = f"{HARNESS}\nmain({case.kind!r}, {answer!r}, {case.detail!r})\n"
    result = sandbox.run(program, stdin=stdin, with_stderr=False)
    if result.error == "sandbox":  # not the answer's doing: the run cannot score code here
        raise RuntimeError(f"the python sandbox failed to start for a code test: {result.text}")
    if result.error is not None:
        return FAILURES[result.error]
    if case.kind == "assert":
        return "pass"
    matches = stdout_matches if case.kind == "stdin" else return_matches
    return "pass" if matches(result.text, case.expected) else "wrong"


def case_stdin(case: TestCase) -> str | None:
    """The program's input: the case's text (a stdin case's list of lines joined), None when it is not text."""
    if case.kind == "stdin" and isinstance(case.stdin, list) and all(isinstance(line, str) for line in case.stdin):
        return "\n".join(case.stdin)
    return case.stdin if isinstance(case.stdin, str) else None


# --- stdin tests ---------------------------------------------------------------------------------------------

def stdout_matches(stdout: str, expected) -> bool:
    """verl's tolerances, in its order: equal once stripped (each line, or the whole); equal line by line to the
    expected lines that are not empty, stripped (the output's empty lines dropped, or not); or, line for line,
    numbers within np.allclose's tolerance unless every pair is two digit strings."""
    if isinstance(expected, list):
        if not all(isinstance(line, str) for line in expected):
            return False
        expected = "\n".join(expected)
    if not isinstance(expected, str):
        return False
    lines = stdout.splitlines()
    if "\n".join(lines).strip() == expected.strip() or "\n".join(l.strip() for l in lines).strip() == expected.strip():
        return True
    wanted = [line.strip() for line in expected.split("\n") if line]
    written = [line for line in lines if line]
    return lines == wanted or written == wanted or numbers_match(written, wanted)


def numbers_match(written: list[str], wanted: list[str]) -> bool:
    if len(written) != len(wanted) or all(a.isdigit() and b.isdigit() for a, b in zip(written, wanted)):
        return False
    try:
        pairs = [(float(a), float(b)) for a, b in zip(written, wanted)]
    except ValueError:
        return False
    return all(close(a, b) for a, b in pairs)


def close(value: float, reference: float) -> bool:
    """np.isclose(value, reference) with its defaults: infinities equal only themselves, NaN nothing."""
    if math.isinf(value) or math.isinf(reference):
        return value == reference
    return abs(value - reference) <= ATOL + RTOL * abs(reference)


# --- call-based tests ----------------------------------------------------------------------------------------

def return_matches(returned: str, expected) -> bool:
    """The return value (its repr, read back as a Python literal) against the expected JSON as verl compares
    them: a tuple as a list; equal to the expected value or to its first element; a list of tuples as a list of
    lists against the first element; a dict with integer-like keys as the one element of a list, int keys."""
    if not isinstance(expected, str):  # verl's harness reads the expected value with json.loads
        return False
    try:
        output, wanted = ast.literal_eval(returned), int_keyed(json.loads(expected))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    if isinstance(output, tuple):
        output = list(output)
    first = wanted[0] if isinstance(wanted, list) and wanted else None
    if output == wanted or (first is not None and output == first):
        return True
    if isinstance(output, list) and output and isinstance(output[0], tuple):
        return [list(item) for item in output] == (wanted[0] if isinstance(wanted, list) and wanted else None)
    return False


def int_keyed(value):
    """verl's harness on an expected value: a dict whose keys all read as ints becomes [that dict with int
    keys]; so does a list whose first element is one."""
    if isinstance(value, dict):
        converted = _int_keys(value)
        return [converted] if converted is not None else value
    if isinstance(value, list) and value and isinstance(value[0], dict):
        converted = _int_keys(value[0])
        return [converted] if converted is not None else value
    return value


def _int_keys(mapping: dict) -> dict | None:
    try:
        return {int(key): item for key, item in mapping.items()}
    except ValueError:
        return None
