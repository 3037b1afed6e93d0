"""A call's arguments: parsed from the model's JSON text under a size cap, then checked against the tool's
schema (names and JSON types) before the tool runs, so a wrong call costs no call."""
from __future__ import annotations

import json

# The deepest JSON a tool call may nest: far above any real arguments, far below the recursion limit, so that
# neither json.loads nor any later json.dumps of the episode's calls can raise RecursionError.
MAX_JSON_DEPTH = 64
# A schema's JSON type -> the Python values json.loads gives for it (bool is an int in Python: kept apart).
JSON_TYPES = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "boolean": lambda value: isinstance(value, bool),
    "array": lambda value: isinstance(value, list),
    "object": lambda value: isinstance(value, dict),
    "null": lambda value: value is None,
}


def json_depth(text: str) -> int:
    """How deep the brackets of JSON text nest (those in strings not counted), in one pass: the check that
    comes before parsing text a model wrote."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = char == "\\", char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def too_deep(text: str) -> str | None:
    """Why JSON text is refused unparsed for its nesting, else None."""
    depth = json_depth(text)
    if depth <= MAX_JSON_DEPTH:
        return None
    return f"the JSON nests {depth} levels deep, more than the {MAX_JSON_DEPTH} allowed"


class ArgumentError(Exception):
    """Arguments the tool is not called with; `category` is the ToolResult's error."""

    def __init__(self, category: str, message: str):
        super().__init__(message)
        self.category = category


def parse_arguments(raw: str | dict, max_chars: int) -> dict:
    """The arguments as a dict: JSON text parsed (refused unparsed past `max_chars`), a dict as it is (measured
    as the JSON text it came from)."""
    if isinstance(raw, dict):
        measure_dict(raw, max_chars)
        return raw
    if not isinstance(raw, str):
        raise ArgumentError("bad_arguments", f"arguments must be a JSON object, got {type(raw).__name__}")
    if len(raw) > max_chars:
        raise ArgumentError("arguments_too_long", f"the arguments are {len(raw)} characters, more than the "
                                                  f"{max_chars} allowed")
    problem = too_deep(raw)
    if problem:
        raise ArgumentError("bad_json", f"the arguments are not accepted: {problem}")
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except ValueError as error:
        raise ArgumentError("bad_json", f"the arguments are not valid JSON: {str(error)[:200]}") from None
    if not isinstance(parsed, dict):
        raise ArgumentError("bad_arguments", f"arguments must be a JSON object, got {type(parsed).__name__}")
    return parsed


def measure_dict(arguments: dict, max_chars: int) -> None:
    try:
        size = len(json.dumps(arguments))
    except (TypeError, ValueError, RecursionError) as error:
        raise ArgumentError("bad_arguments", f"the arguments are not JSON values: {str(error)[:200]}") from None
    if size > max_chars:
        raise ArgumentError("arguments_too_long", f"the arguments are {size} characters of JSON, more than the "
                                                  f"{max_chars} allowed")


def check_arguments(arguments: dict, parameters: dict) -> None:
    """Refuse arguments that miss a required parameter, name an unknown one or have a value of the wrong type
    (the schema's `parameters`: an object schema as get_json_schema writes it)."""
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in arguments]
    if missing:
        raise ArgumentError("bad_arguments", f"missing required argument(s): {', '.join(missing)}")
    unknown = [str(name)[:40] for name in arguments if name not in properties]
    if unknown:
        raise ArgumentError("bad_arguments", f"unknown argument(s): {', '.join(unknown[:5])}; the tool takes "
                                             f"{', '.join(properties) or 'none'}")
    for name, value in arguments.items():
        problem = type_problem(value, properties[name])
        if problem:
            raise ArgumentError("bad_arguments", f"argument {name!r}: {problem}")


def type_problem(value, schema: dict) -> str | None:
    """Why `value` does not fit `schema` (its type, enum, array items, nullable), or None when it does."""
    if value is None and schema.get("nullable"):
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {schema['enum']}"
    wanted = schema.get("type")
    names = wanted if isinstance(wanted, list) else [wanted] if wanted else []
    known = [name for name in names if name in JSON_TYPES]
    if known and not any(JSON_TYPES[name](value) for name in known):
        return f"must be {' or '.join(known)}, got {json_type_name(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            problem = type_problem(item, schema["items"])
            if problem:
                return f"item {index} {problem}"
    return None


def json_type_name(value) -> str:
    return next((name for name, fits in JSON_TYPES.items() if fits(value)),
                type(value).__name__)
