"""`number`: the final number a response states, compared exactly with the ground truth; and the final-form
test that `reward.math.final_form` applies before math-verify.

Both exist because an evaluating grader pays for not computing: math-verify reads `"so she has 26 - 10 ="` as the
expression 26 - 10 and finds it equal to 16. Here an answer counts only as a number written out:
- the final number is the last numeral of the response, or of its last marked answer (a `\\boxed{}` or a GSM8K
  `#### ` line, whichever comes last);
- it is no answer when it is an operand: `26-10`, `16/2`, `2^{4}`, `\\frac{32}{2}`, `\\sqrt{16}`, or when an
  operator follows it with nothing but symbols after (`26 - 10 =`);
- a leading minus is its sign (`-3`); thousands commas (`1,600`), a currency sign (`$16`), a sentence's full stop
  (`16.`), trailing zeros (`16.0`) and a unit (`16 apples`) are read as people write them.
Numbers are compared as decimals (`16.0` equals `16`); words (`sixteen`) and fractions (`1/2`) are not numbers
here. Every function is linear in the response's length (no nested repetition to backtrack over), so the scorer
runs in the trainer's process, without the scoring worker.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A numeral: thousands groups (1,600 but not 1,6000), or plain digits with a decimal part, or a bare ".5".
NUMERAL = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|(?<!\d)\.\d+")
ARITHMETIC = r"(?:[-+*/×÷^−·]|\\times|\\cdot|\\div)"
OPERATOR = r"(?:=|" + ARITHMETIC + ")"  # an "=" before the last numeral states it; after it, asks for it
SIGNS = ("-", "−", "+")
# What may stand between an operator and the numeral after it: spaces, a currency sign, an opening bracket.
NOISE_BEFORE = re.compile(r"(?:\s|\$|\\\$|€|£|\()*\Z")
OPERATOR_BEFORE = re.compile(ARITHMETIC + r"\Z|√\Z|\\sqrt\Z")
OPERAND_END = re.compile(r"[\d)\]}]\Z")
# After the last numeral: an operator and nothing that could be its operand's words ("26 - 10 =", "16 +").
UNFINISHED_AFTER = re.compile(r"\s*" + OPERATOR + r"[^A-Za-z\d]*\Z")
# The braces a numeral may sit in and still be the answer; any other command's argument is an operand.
PLAIN_BRACES = re.compile(r"\\(?:boxed|fbox|text|textbf|mathrm|mathbf)\s*\{\Z")
BOXED, GSM8K_MARK = "\\boxed{", "####"
CONTEXT_CHARS = 40  # how far before the last numeral its operator and brackets are looked for

# An operation on two written numbers (math's final form): neither numeral part of a term with a symbol (x^2+7x
# holds none) and division apart, since a fraction is a final form unless it is a whole number.
OPERATION = re.compile(r"(?<![\w^_\\}.])\d+(?:\.\d+)?\s*(?!/)" + ARITHMETIC + r"\s*[{(]?\s*[-−]?\s*"
                       r"\d+(?:\.\d+)?(?![\w.\\(])")
FRACTION = re.compile(r"(?<![\w^_\\}.])(\d+)\s*/\s*(\d+)(?![\w.\\(])|\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}")


def last_marked(text: str) -> str:
    """The response's last marked answer (the content of its last `\\boxed{}`, or the rest of the line after its
    last `####`, whichever starts later); the whole text without one."""
    boxed, marked = text.rfind(BOXED), text.rfind(GSM8K_MARK)
    if boxed > marked:
        start, depth = boxed + len(BOXED), 1
        for end in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                return text[start:end]
        return text[start:]
    if marked >= 0:
        return text[marked + len(GSM8K_MARK):].split("\n", 1)[0]
    return text


def final_number(text: str) -> Decimal | None:
    """The final number `text` states (see the module's rules), None when it states none or ends on an
    expression."""
    text = last_marked(text)
    last = None
    for last in NUMERAL.finditer(text):
        pass
    if last is None or UNFINISHED_AFTER.match(text, last.end()):
        return None
    before = text[max(0, last.start() - CONTEXT_CHARS):last.start()]  # bounded: the searches below stay linear
    before = before[:NOISE_BEFORE.search(before).start()]
    sign = ""
    operator = OPERATOR_BEFORE.search(before)
    if operator is not None:
        left = before[:operator.start()]
        left = left[:NOISE_BEFORE.search(left).start()]
        if operator.group() not in SIGNS or OPERAND_END.search(left):
            return None  # an operand: "26-10", "16/2", "\sqrt{16}"
        sign = "-" if operator.group() != "+" else ""
    elif before.endswith("{") and not PLAIN_BRACES.search(before):
        return None  # a command's argument: "\frac{1}{2}", "2^{4}"
    return Decimal(sign + last.group().replace(",", ""))


def ends_unfinished(text: str) -> bool:
    """Whether `text` ends on an operator after its last numeral ("so she has 26 - 10 =")."""
    last = None
    for last in NUMERAL.finditer(text):
        pass
    return last is not None and UNFINISHED_AFTER.match(text, last.end()) is not None


def holds_operation(answer: str) -> bool:
    """Whether an extracted answer still holds an operation on written numbers that could be carried out
    (`26 - 10`, `2^{10}`, `3 \\times 4`, `16/2`, `\\frac{16}{2}`); `x^2+7x+10`, `2+\\sqrt{3}`, `-3` and
    `\\frac{1}{2}` hold none."""
    if OPERATION.search(answer):
        return True
    for match in FRACTION.finditer(answer):
        numerator, denominator = (int(group) for group in match.groups() if group is not None)
        if denominator == 0 or numerator % denominator == 0:
            return True
    return False


def ground_truth_number(ground_truth) -> Decimal:
    """The ground truth as a number (a number, its text, or a full GSM8K solution by its `####` line);
    ValueError when it is none, naming it."""
    if isinstance(ground_truth, (int, float)) and not isinstance(ground_truth, bool):
        return Decimal(repr(ground_truth))
    truth = str(ground_truth).strip()
    try:
        number = Decimal(truth.replace(",", "").lstrip("$"))
    except InvalidOperation:
        number = final_number(truth)
    if number is None or not number.is_finite():
        raise ValueError(f"the number reward needs a number as the ground truth, got {truth[:80]!r} (reward.function "
                         "math compares expressions)")
    return number


def number_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1 when the final number the response states equals the ground truth, else 0."""
    stated = final_number(solution_str)
    return float(stated is not None and stated == ground_truth_number(ground_truth))
