"""Final-answer extraction for GSM8K: text -> canonical number, and exact match.

The answer is, in order: the first number after the first ``####`` (GSM8K's convention), the number in the last
``\\boxed{...}``, the first number after the last "answer is" / "answer:", else the last number. Numbers may
carry thousands separators, currency and units, a sentence's period and a (Unicode) minus; a hyphen between
two numbers (``10-3``) is subtraction. Canonical forms have no trailing zeros (``5.0`` -> ``5``), and matching
compares them exactly.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A sign only when it does not follow a word character or a digit ("10-3" is subtraction). The integer part
# is either properly grouped thousands (1,234,567) or plain digits; then an optional decimal part.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-\u2212])?\$?\s?"
    r"(?P<int>\d{1,3}(?:,\d{3})+|\d+)?(?P<frac>\.\d+)?"
)
_ANSWER_PHRASE = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _numbers(text: str) -> list[str]:
    """Canonical forms of every number in ``text``, left to right."""
    out = []
    for match in _NUMBER.finditer(text):
        integer, frac = match.group("int"), match.group("frac")
        if integer is None and frac is None:
            continue
        if integer is None:  # ".5"
            integer = "0"
        raw = ("-" if match.group("sign") else "") + integer.replace(",", "") + (frac or "")
        canonical = normalize_number(raw)
        if canonical is not None:
            out.append(canonical)
    return out


def normalize_number(value: str) -> str | None:
    """``"1,234.50"`` -> ``"1234.5"``, ``"-5.0"`` -> ``"-5"``, ``"$7"`` -> ``"7"``; None if not a number."""
    if value is None:
        return None
    text = str(value).strip().replace(",", "").replace("\u2212", "-").replace("$", "").rstrip(".").strip()
    text = re.sub(r"^(-)\s+", r"\1", text)
    try:
        number = Decimal(text)
    except (InvalidOperation, ValueError):
        return None
    if not number.is_finite():
        return None
    if number == number.to_integral_value():
        return str(int(number))
    return format(number.normalize(), "f")


def extract_answer(text: str | None) -> str | None:
    """The final numeric answer in ``text`` (canonical form), or None when it holds no number."""
    if not text:
        return None
    if "####" in text:
        found = _numbers(text.split("####", 1)[1])
        if found:
            return found[0]
    boxed = _BOXED.findall(text)
    if boxed:
        found = _numbers(boxed[-1])
        if found:
            return found[0]
    phrases = list(_ANSWER_PHRASE.finditer(text))
    if phrases:
        found = _numbers(text[phrases[-1].end():])
        if found:
            return found[0]
    found = _numbers(text)
    return found[-1] if found else None


def answer_is_final(text: str) -> bool:
    """True once no continuation of ``text`` can change :func:`extract_answer`: the line after the first
    ``####`` holds a number and has ended (numbers never span a newline). Generation can stop there."""
    if "####" not in text:
        return False
    rest = text.split("####", 1)[1]
    return "\n" in rest and bool(_numbers(rest.split("\n", 1)[0]))


def answers_match(predicted: str | None, gold: str | None) -> bool:
    """Exact match of two answers after normalisation; a missing answer never matches."""
    if predicted is None or gold is None:
        return False
    a, b = normalize_number(predicted), normalize_number(gold)
    return a is not None and a == b
