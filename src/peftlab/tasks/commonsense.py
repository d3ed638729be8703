"""``--task commonsense``: LLM-Adapters' commonsense-reasoning benchmark, answers generated and extracted.

* **Data**: ``<data>/commonsense/<set>/{train,test}.json`` (LLM-Adapters' instruction format). Training: the union
  of the sets with a train split (or ``--train-sets``); evaluation: the seven test sets (or ``--eval-sets``).
  HellaSwag and the ``commonsense_170k`` mix are not offline: result.json's ``report_notes`` say so.
* **Answer** (:func:`extract_answer`, LLM-Adapters' ``commonsense_evaluate.py``): the first of the set's answer
  words in the generated text, "" when none. Greedy generation (LLM-Adapters: 4 beams, sampled) stops at the
  first answer word, after which the extracted answer cannot change.
* **Metrics**: ``<set>_accuracy`` and ``<set>_answered`` (``arc_easy``...) and their means over the sets,
  ``accuracy`` (primary, the papers' Avg) and ``answered``. Chance: the mean over sets of the majority answer's
  share.
"""

from __future__ import annotations

import re
from collections import Counter
from peftlab.tasks.table import UNAVAILABLE_SETS

_ANSWER_CHOICES = tuple(f"answer{i}" for i in range(1, 6))
ANSWER_WORDS: dict[str, tuple[str, ...]] = {
    "boolq": ("true", "false"),
    "piqa": ("solution1", "solution2"),
    "social_i_qa": _ANSWER_CHOICES,
    "ARC-Challenge": _ANSWER_CHOICES,
    "ARC-Easy": _ANSWER_CHOICES,
    "openbookqa": _ANSWER_CHOICES,
    "winogrande": ("option1", "option2"),
    "hellaswag": ("ending1", "ending2", "ending3", "ending4"),  # LLM-Adapters' rule; its data is not here
}
_PATTERNS = {name: re.compile("|".join(map(re.escape, words))) for name, words in ANSWER_WORDS.items()}
DATASET = "llm-adapters-commonsense"


def extract_answer(set_name: str, text: str | None) -> str:
    """The first answer word of ``set_name`` in ``text`` (LLM-Adapters' ``extract_answer``), "" if none."""
    found = _PATTERNS[set_name].findall((text or "").strip())
    return found[0] if found else ""


def metric_key(set_name: str) -> str:
    """``ARC-Easy`` -> ``arc_easy``: the prefix of a set's metrics."""
    return set_name.lower().replace("-", "_")


def dataset_note(train_sets, eval_sets, n_train: int) -> str:
    return (f"{UNAVAILABLE_SETS['hellaswag']} and neither is the commonsense_170k training mix: trained on the "
            f"union of the {'+'.join(train_sets)} training splits ({n_train} records), evaluated on "
            f"{', '.join(eval_sets)}; the mean is not the papers' 8-set average")


def _gold_check(name: str):
    """A commonsense set's gold answers are its answer words."""
    words = ANSWER_WORDS[name]
    return lambda gold: None if gold in words else "one of " + "/".join(words)


def _record(name: str, row: dict, text: str) -> dict:
    predicted = extract_answer(name, text)
    return {"set": name, "instruction": row["instruction"], "gold": row["answer"], "generated": text,
            "extracted": predicted, "correct": predicted == row["answer"]}


def build_pipeline(cfg, tokenizer, model, task):
    """The ``commonsense`` kind's Pipeline; ``task``'s set names default ``--train-sets`` / ``--eval-sets``."""
    from peftlab.tasks.generative import family_pipeline

    train_sets = tuple(cfg.train_sets.split(",")) if cfg.train_sets else task.train_set_names
    return family_pipeline(
        cfg, tokenizer, task, {f"train/{name}": (f"commonsense/{name}/train.json", f"commonsense training split "
                                                 f"'{name}'") for name in train_sets},
        gold_problem=_gold_check, record=_record, key=metric_key,
        counts={"accuracy": lambda r: r["correct"], "answered": lambda r: r["extracted"] != ""},
        # A row stops at its own set's first answer word (another set's word, e.g. "answer1" in a BoolQ answer, is
        # not an answer and must not stop it).
        stop_rule=lambda name: lambda text: _PATTERNS[name].search(text) is not None,
        chance=lambda tests: sum(max(Counter(ds["answer"]).values()) / len(ds) for ds in tests.values()) / len(tests),
        extras=lambda n_train, tests: {
            "dataset": DATASET,
            "report_notes": [dataset_note(train_sets, tests, n_train)],  # lab/report.py prints them
            "train_sets": list(train_sets),
            "answer_extraction": "LLM-Adapters commonsense_evaluate.py extract_answer: the first answer word of the set"})
