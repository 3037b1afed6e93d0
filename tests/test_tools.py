"""The tool registry and ToolSet without the sandbox: schemas from signatures, arguments checked before the
call, and every kind of failure (unknown name, malformed or huge JSON, wrong types, a tool that raises, hangs
or returns a non-string) an error result of its category, never an exception; the calculator never evals and
refuses huge powers at once."""
import asyncio
import json
import re
import threading
import time

import pytest

from verl_mega.config.schema import ConfigError, ToolsConfig, load_config
from verl_mega.tools import ERROR_CATEGORIES, TOOLS, ToolCall, ToolSet, register_tool, tool_schema
from verl_mega.tools.arguments import ArgumentError, check_arguments
from verl_mega.trainer.preflight import preflight_check

LIMIT_S = 0.5


def add(a: int, b: float = 1.0) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


def tag(words: list[str], mode: str | None = None) -> str:
    """Join words.

    Args:
        words: The words.
        mode: How, or nothing.
    """
    return "-".join(words)


def explode(text: str) -> str:
    """Always raises.

    Args:
        text: Anything.
    """
    raise RuntimeError(f"no {text}")


def hang(text: str) -> str:
    """Never returns in time.

    Args:
        text: Anything.
    """
    time.sleep(5)
    return text


async def hang_async(text: str) -> str:
    """An async tool that never returns in time.

    Args:
        text: Anything.
    """
    await asyncio.sleep(5)
    return text


async def shout(text: str) -> str:
    """An async tool.

    Args:
        text: What to shout.
    """
    await asyncio.sleep(0)
    return text.upper()


def leave(text: str) -> str:
    """Raises SystemExit, as a careless tool might.

    Args:
        text: Anything.
    """
    raise SystemExit(3)


def number(text: str) -> str:
    """Returns a number, not a string.

    Args:
        text: Anything.
    """
    return 42


def wait_together(text: str) -> str:
    """Returns once three calls run at the same time.

    Args:
        text: Returned.
    """
    BARRIER.wait(timeout=2)
    return text


def undocumented(a: int) -> str:
    return str(a)


BARRIER = threading.Barrier(3)
HERE = "tests.test_tools"


def toolset(*names: str, **limits) -> ToolSet:
    return ToolSet([f"{HERE}:{name}" if name not in TOOLS else name for name in names],
                   ToolsConfig(timeout_s=LIMIT_S, **limits))


def test_a_schema_comes_from_the_signature_and_docstring_under_the_tool_s_name():
    schema = toolset("add").schemas[0]
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "add" and function["description"] == "Add two numbers."
    assert function["parameters"]["properties"] == {"a": {"type": "integer", "description": "The first number."},
                                                    "b": {"type": "number", "description": "The second number."}}
    assert function["parameters"]["required"] == ["a"]
    assert tool_schema("plus", add)["function"]["name"] == "plus"


def test_a_registered_tool_is_named_by_its_registered_name():
    register_tool("test_add")(add)
    with toolset("test_add") as tools:
        assert tools.names == ["test_add"]
        assert tools.call(ToolCall("test_add", '{"a": 2, "b": 0.5}')).text == "2.5"
    with pytest.raises(ValueError, match="already registered"):
        register_tool("test_add")(tag)
    with pytest.raises(ValueError, match="must be letters"):
        register_tool("has space")(add)


@pytest.mark.parametrize("names, message", [
    (["no_such_tool"], "unknown tool 'no_such_tool'; registered: .*calculator.*python"),
    (["no.such.module:f"], "cannot import module 'no.such.module'"),
    ([f"{HERE}:missing"], "has no function 'missing'"),
    (["os;rm:f"], "must look like 'package.module:function'"),
    ([f"{HERE}:undocumented"], "tool 'undocumented': no JSON schema .* no docstring"),
    (["calculator", "calculator"], "tool 'calculator' is named twice"),
    ("calculator", "the tool names must be a list, got the string 'calculator'"),
])
def test_a_bad_tool_name_is_a_one_line_config_error_naming_it(names, message):
    with pytest.raises(ConfigError, match=message) as caught:
        ToolSet(names, ToolsConfig())
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("call, category", [
    (ToolCall("nope", "{}"), "unknown_tool"),
    (ToolCall("add", "{'a': 1"), "bad_json"),
    (ToolCall("add", "[" * 100_000 + "]" * 100_000), "arguments_too_long"),
    (ToolCall("add", "[" * 30_000 + "]" * 30_000), "bad_json"),  # nested past the parser's recursion
    (ToolCall("add", "[1, 2]"), "bad_arguments"),
    (ToolCall("add", 7), "bad_arguments"),
    (ToolCall("add", '{"b": 1}'), "bad_arguments"),
    (ToolCall("add", '{"a": 1, "c": 1}'), "bad_arguments"),
    (ToolCall("add", '{"a": "1"}'), "bad_arguments"),
    (ToolCall("add", '{"a": true}'), "bad_arguments"),
    (ToolCall("add", '{"a": 1.5}'), "bad_arguments"),
    (ToolCall("add", {"a": 1, "b": "x"}), "bad_arguments"),
    (ToolCall("add", {"a": 1, "b": "x" * 2_000_000}), "arguments_too_long"),
    (ToolCall("add", {"a": object()}), "bad_arguments"),
    (ToolCall("tag", '{"words": ["a", 2]}'), "bad_arguments"),
])
def test_a_bad_call_is_an_error_result_of_its_category_and_the_tool_is_not_called(call, category):
    with toolset("add", "tag", max_argument_chars=100_000) as tools:
        result = tools.call(call)
    assert (result.ok, result.error) == (False, category)
    assert result.text.startswith("error: ") and result.error in ERROR_CATEGORIES


def test_a_megabyte_of_json_arguments_is_refused_without_parsing_it():
    with toolset("tag") as tools:
        start = time.monotonic()
        result = tools.call(ToolCall("tag", json.dumps({"words": ["x" * 1000] * 1000})))
    assert result.error == "arguments_too_long" and "65536 allowed" in result.text
    assert time.monotonic() - start < 0.5


def test_good_arguments_reach_the_tool():
    with toolset("add", "tag") as tools:
        assert tools.call(ToolCall("add", '{"a": 2}')).text == "3.0"
        assert tools.call(ToolCall("tag", {"words": ["a", "b"], "mode": None})).text == "a-b"
        assert tools.call(ToolCall("add", "")).error == "bad_arguments"  # empty text: no arguments, a is missing


@pytest.mark.parametrize("name, category, text", [
    ("explode", "raised", "error: RuntimeError: no x"),
    ("leave", "raised", "error: SystemExit: 3"),
    ("number", "not_a_string", "returned int, not a string"),
    ("hang", "timeout", "took more than 0.5 s"),
    ("hang_async", "timeout", "took more than 0.5 s"),
])
def test_a_tool_that_fails_gives_an_error_result_in_time(name, category, text):
    with toolset(name) as tools:
        start = time.monotonic()
        result = tools.call(ToolCall(name, {"text": "x"}))
    assert (result.ok, result.error) == (False, category) and text in result.text
    assert time.monotonic() - start < LIMIT_S + 0.5 and result.seconds < LIMIT_S + 0.5


def test_an_async_tool_is_awaited():
    with toolset("shout") as tools:
        assert tools.call(ToolCall("shout", {"text": "hi"})).text == "HI"


def test_a_long_result_is_cut_and_counted_but_stays_a_success():
    with toolset("tag", max_output_chars=5) as tools:
        result = tools.call(ToolCall("tag", {"words": ["abc", "def"]}))
    assert (result.text, result.ok, result.error) == ("abc-d", True, "output_truncated")


def test_call_many_runs_the_calls_at_once_and_keeps_their_order():
    calls = [ToolCall("wait_together", {"text": str(index)}) for index in range(3)]
    with ToolSet([f"{HERE}:wait_together"], ToolsConfig(timeout_s=3, workers=3)) as tools:
        results = tools.call_many(calls)  # would time out at the barrier if they ran one by one
    assert [result.text for result in results] == ["0", "1", "2"]


def test_submit_returns_at_once_and_its_future_gives_the_result():
    with toolset("hang", "add") as tools:
        start = time.monotonic()
        slow, fast = tools.submit(ToolCall("hang", {"text": "x"})), tools.submit(ToolCall("add", {"a": 1}))
        assert time.monotonic() - start < 0.2
        assert fast.result(timeout=2).text == "2.0" and slow.result(timeout=2).error == "timeout"


def test_the_checks_read_nullable_and_enum_schemas():
    check_arguments({"mode": None}, {"properties": {"mode": {"type": "string", "nullable": True}}})
    with pytest.raises(ArgumentError, match="must be one of"):
        check_arguments({"mode": "c"}, {"properties": {"mode": {"type": "string", "enum": ["a", "b"]}}})


@pytest.mark.parametrize("expression, value", [
    ("(3 + 4) * 12 / 7", "12"), ("2 ** 10 - 1", "1023"), ("-7 // 2", "-4"), ("sqrt(16) + abs(-2)", "6"),
    ("round(pi, 2)", "3.14"), ("max(1, 5, 3) % 4", "1"), ("1 / 3", str(1 / 3)),
])
def test_the_calculator_computes_arithmetic(expression, value):
    with toolset("calculator") as tools:
        assert tools.call(ToolCall("calculator", {"expression": expression})).text == value


@pytest.mark.parametrize("expression, message", [
    ("9 ** 9 ** 9", "too large"), ("10 ** 100000", "too large"), ("2.0 ** 99999", "exponent"),
    ("(10 ** 1000) * (10 ** 1000)", "too large"), ("__import__('os').system('true')", "not allowed"),
    ("().__class__", "not allowed"), ("'a' * 3", "not allowed"), ("x + 1", "not allowed"),
    ("(-8) ** 0.5", "not a real number"), ("1 / 0", "ZeroDivisionError"), ("1 +", "not an arithmetic"),
    ("1" * 2000, "longer than"), ("exp(1000)", "OverflowError"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic_at_once(expression, message):
    with toolset("calculator") as tools:
        start = time.monotonic()
        result = tools.call(ToolCall("calculator", {"expression": expression}))
    assert (result.ok, result.error) == (False, "raised") and message in result.text
    assert time.monotonic() - start < 0.2


@pytest.mark.parametrize("limits, message", [
    ({"timeout_s": 0}, "tools.timeout_s must be in (0, 1000000000] (seconds), got 0"),
    ({"workers": 0}, "tools.workers must be >= 1, got 0"),
    ({"max_output_chars": 0}, "tools.max_output_chars must be >= 1, got 0"),
])
def test_a_limit_out_of_range_is_refused_naming_its_key(limits, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ToolSet(["calculator"], ToolsConfig(**limits))


def test_the_preflight_check_lists_every_tools_limit_out_of_range():
    config = load_config(None, ["model.hf_path=x", "tools.python.memory_mb=8", "tools.python.processes=0"])
    with pytest.raises(ConfigError) as caught:
        preflight_check(config, world_size=1, check_files=False)
    assert "tools.python.memory_mb must be >= 64, got 8" in str(caught.value)
    assert "tools.python.processes must be >= 1, got 0" in str(caught.value)
