"""``--task math``: math word problems (LLM-Adapters' sets), trained on ``math_data.json``, answers generated.

* **Data**: ``<data>/math/math_data.json`` trains (a stand-in for MetaMathQA, not offline: ``report_notes`` say
  so); ``<data>/math/<set>/test.json`` of :data:`peftlab.tasks.table.MATH_TEST_SETS` (or ``--eval-sets``)
  evaluate. ``answer`` is a number (AQuA: a letter A-E).
* **Two extractions**, as lm-evaluation-harness scores GSM8K, so numbers compare with it: ``strict_match``, the
  first match of the harness's gsm8k strict regex, else of gsm8k-cot's (the format math_data.json teaches);
  ``flexible_extract``, the last match of its flexible regex. A match is cleaned like the harness's
  ``regexes_to_ignore`` and correct within 0.001 of the gold (LLM-Adapters' golds are floats, ``576.0``).
  AQuA: the letter after ``####`` / "The answer is", or the last standalone capital A-E.
* **Metrics**: ``<set>_strict_match``, ``<set>_flexible_extract`` and their means over the sets (primary:
  ``strict_match``). Generation never stops at the first answer: the flexible extraction reads the last number.
"""

from __future__ import annotations

import re
from decimal import Decimal


# lm-evaluation-harness lm_eval/tasks/gsm8k/gsm8k.yaml (strict-match) and gsm8k-cot.yaml (strict-match), and the
# flexible-extract filter of both (group_select -1: the last match).
STRICT_PATTERNS = (re.compile(r"#### (\-?[0-9\.\,]+)"), re.compile(r"The answer is (\-?[0-9\.\,]+)."))
FLEXIBLE_PATTERN = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
LETTER_STRICT_PATTERNS = (re.compile(r"#### \(?([A-E])\b"), re.compile(r"The answer is \(?([A-E])\b"))
LETTER_FLEXIBLE_PATTERN = re.compile(r"\b([A-E])\b")
LETTER_SETS = ("AQuA",)
TOLERANCE = Decimal("0.001")
TRAIN_FILE = "math/math_data.json"
DATASET = "llm-adapters-math"
DATASET_NOTE = ("trained on LLM-Adapters' math_data.json ({n} records with a solution), a stand-in for MetaMathQA "
                "(not available offline); gsm8k is LLM-Adapters' copy of the GSM8K test set")


def cleaned(match: str) -> str:
    """A captured answer cleaned as the harness's regexes_to_ignore: ``,``, ``$`` and a trailing ``.`` removed."""
    return re.sub(r"\.$", "", match.replace(",", "").replace("$", "").strip())


def _clean_number(match: str | None) -> Decimal | None:
    if match is None:
        return None
    try:
        value = Decimal(cleaned(match))
    except ArithmeticError:
        return None
    return value if value.is_finite() else None


def strict_answer(text: str | None, *, letters: bool = False) -> str | None:
    """The strict-match answer of ``text`` (the captured string, uncleaned), or None."""
    for pattern in (LETTER_STRICT_PATTERNS if letters else STRICT_PATTERNS):
        found = pattern.findall(text or "")
        if found:
            return found[0]
    return None


def flexible_answer(text: str | None, *, letters: bool = False) -> str | None:
    """The flexible-extract answer of ``text``: the last number (AQuA: the last standalone letter A-E), or None."""
    if letters:
        found = LETTER_FLEXIBLE_PATTERN.findall(text or "")
        return found[-1] if found else None
    found = FLEXIBLE_PATTERN.findall(text or "")
    if not found:
        return None
    return next(group for group in found[-1] if group)  # the alternative that matched


def is_correct(predicted: str | None, gold: str, *, letters: bool = False) -> bool:
    if predicted is None:
        return False
    if letters:
        return predicted.strip().upper() == gold.strip().upper()
    value, target = _clean_number(predicted), _clean_number(gold)
    return value is not None and target is not None and abs(value - target) <= TOLERANCE


def _gold_check(name: str):
    """A math set's gold answers: a letter A-E (AQuA), else a number."""
    if name in LETTER_SETS:
        return lambda gold: None if gold.strip().upper() in tuple("ABCDE") else "a letter A-E"
    return lambda gold: None if _clean_number(gold) is not None else "a number"


def _record(name: str, row: dict, text: str) -> dict:
    letters = name in LETTER_SETS
    strict, flexible = strict_answer(text, letters=letters), flexible_answer(text, letters=letters)
    return {"set": name, "question": row["instruction"], "gold": row["answer"], "generated": text,
            "strict": strict, "flexible": flexible,
            "strict_correct": is_correct(strict, row["answer"], letters=letters),
            "flexible_correct": is_correct(flexible, row["answer"], letters=letters)}


def build_pipeline(cfg, tokenizer, model, task):
    """The ``math`` kind's Pipeline; ``task``'s set names are the default ``--eval-sets``."""
    from peftlab.tasks.generative import family_pipeline

    # 3 of math_data.json's records have an empty output: nothing to learn from, so not trained on.
    return family_pipeline(
        cfg, tokenizer, task, {"train": (TRAIN_FILE, "math training set math_data.json")}, gold_problem=_gold_check,
        record=_record, key=str.lower,
        counts={"strict_match": lambda r: r["strict_correct"], "flexible_extract": lambda r: r["flexible_correct"]},
        extras=lambda n_train, tests: {
            "dataset": DATASET, "report_notes": [DATASET_NOTE.format(n=n_train)],  # lab/report.py prints them
            "answer_extraction": {
                "strict_match": "lm-evaluation-harness gsm8k strict-match '#### (\\-?[0-9\\.\\,]+)', else gsm8k-cot "
                                "strict-match 'The answer is (\\-?[0-9\\.\\,]+).' (first match); AQuA: the letter "
                                "after #### or 'The answer is'",
                "flexible_extract": "lm-evaluation-harness flexible-extract '(-?[$0-9.,]{2,})|(-?[0-9]+)' (last "
                                    "match); AQuA: the last standalone letter A-E",
                "match": "numbers within 0.001 of the gold (LLM-Adapters), after removing ',', '$' and a trailing "
                         "'.'"}})
