"""lm-evaluation-harness (``lm-eval`` 0.4.x) task definitions on the local data, and its GSM8K scoring of any text.

* **Task definitions** (``lm_eval_yaml/<task>.yaml``, package data): each names the harness's own task
  (``include_task``) and sets only where the documents come from (local data files, and for the commonsense
  sets a ``process_docs`` of :mod:`peftlab.tasks.lm_eval_docs`). :func:`task_configs` lays them over the
  installed harness's config (its prompts, few-shot examples, filters and metrics). BoolQ and HellaSwag are not
  available offline (:data:`UNAVAILABLE`).
* **GSM8K agreement** (:func:`gsm8k_agreement`): the harness's ``gsm8k`` / ``gsm8k_cot`` filters and
  ``process_results`` on the texts ``--task math`` generated, beside :mod:`peftlab.tasks.math_tasks`' scores.
  They differ by design in two ways only: peftlab's strict match reads ``#### N`` and else ``The answer is N.``
  (so it is compared per item with ``gsm8k`` or ``gsm8k_cot``), and peftlab compares numbers within 0.001
  where the harness compares strings (``18.0`` vs ``18``). The harness's numbers are the ones to compare with
  papers; ``--lm-eval gsm8k`` produces them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError

HARNESS_SERIES = "0.4."
INSTALL = 'pip install "peftlab[lm-eval]"  (lm-eval 0.4.x, installed beside the existing torch)'
YAML_DIR = Path(__file__).resolve().parent / "lm_eval_yaml"
SHIPPED = tuple(sorted(p.stem for p in YAML_DIR.glob("*.yaml")))
MULTIPLE_CHOICE = ("arc_easy", "arc_challenge", "openbookqa", "piqa", "social_iqa", "winogrande")
# peftlab's commonsense set names (tasks/commonsense.py) -> the harness's task names
ALIASES = {"ARC-Easy": "arc_easy", "ARC-Challenge": "arc_challenge", "social_i_qa": "social_iqa", "siqa": "social_iqa",
           "gsm8k-cot": "gsm8k_cot"}
GROUPS = {"commonsense": MULTIPLE_CHOICE}
UNAVAILABLE = {
    "boolq": "the local BoolQ (LLM-Adapters' commonsense/boolq/test.json) has the questions without their passages, "
             "and the harness's boolq prompt starts with the passage ('{{passage}}\\nQuestion: {{question}}?'): "
             "no harness BoolQ offline",
    "hellaswag": "HellaSwag's data is not in the shared data folder: no harness HellaSwag offline",
}
# peftlab's set metric beside each multiple-choice task (generate-and-extract, tasks/commonsense.py)
PEFTLAB_SET = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge", "openbookqa": "openbookqa", "piqa": "piqa",
               "social_iqa": "social_i_qa", "winogrande": "winogrande"}


def require_harness():
    """The installed ``lm_eval`` module (0.4.x); else one line naming the pip command."""
    try:
        import lm_eval
    except ImportError:
        raise PeftlabError("--lm-eval needs lm-evaluation-harness, which is not installed", fix=INSTALL) from None
    version = getattr(lm_eval, "__version__", "")
    if not version.startswith(HARNESS_SERIES):
        raise PeftlabError(f"lm-evaluation-harness {version or '(unknown version)'} is installed; peftlab's task "
                           f"definitions are for {HARNESS_SERIES}x", fix=INSTALL)
    return lm_eval


def task_names(text: str | None, *, flag: str = "--lm-eval") -> list[str]:
    """``"gsm8k,ARC-Easy,commonsense"`` -> the harness task names, in order, without duplicates."""
    from peftlab.tasks.table import pick_names

    return pick_names(text, {**{name: (name,) for name in SHIPPED}, **GROUPS}, flag, noun="task", aliases=ALIASES,
                      what=f"{flag} task (peftlab runs the harness offline, on its shipped definitions only)",
                      unavailable=UNAVAILABLE)


@dataclass(frozen=True)
class TaskDefinition:
    """One task as the harness will run it: its config (a dict the harness's TaskManager loads), where it comes
    from, and the digest that identifies it in result.json."""

    name: str
    config: dict  # the harness's config with peftlab's keys over it (data files absolute)
    harness_yaml: str  # the harness's own YAML, relative to lm_eval/tasks
    data_files: dict[str, str]  # split -> the local file (absolute)
    data_sha256: dict[str, str]  # split -> sha256 of the file's bytes
    sha256: str  # of the config (data files as written in peftlab's YAML: machine-independent) and data digests


def harness_root() -> Path:
    """``lm_eval/tasks`` of the installed harness."""
    return Path(require_harness().__file__).resolve().parent / "tasks"


def _peftlab_yaml(name: str) -> dict:
    """A shipped definition as written (``!function`` references unresolved): its include keys."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(YAML_DIR / f"{name}.yaml", resolve_func=False)


def harness_index(names=SHIPPED):
    """(``lm_eval``, a harness ``TaskManager`` indexing only the folders ``names`` include from). The harness's
    full index reads its ~14,000 YAML files (tens of seconds); one folder is read in well under a second."""
    lm_eval = require_harness()
    folders = tuple(sorted({_peftlab_yaml(name)["include_from"] for name in names}))
    return lm_eval, _task_manager(folders)


@functools.lru_cache(maxsize=16)
def _task_manager(folders: tuple[str, ...]):
    from lm_eval.tasks import TaskManager

    paths = [harness_root() / folder for folder in folders]
    missing = [str(path) for path in paths if not path.is_dir()]
    if missing:
        raise PeftlabError(f"the installed lm-evaluation-harness has no task folder {', '.join(missing)}", fix=INSTALL)
    return TaskManager(include_defaults=False, include_path=[str(path) for path in paths])


def task_configs(names: list[str], data_dir: str | None = None, *, task_manager=None) -> list[TaskDefinition]:
    """The harness configs of ``names`` (from :func:`task_names`) on the local data; a missing data file is one
    line naming every path tried."""
    manager = task_manager or harness_index(names)[1]  # before the harness's import: a missing extra is one line
    from lm_eval.tasks._yaml_loader import load_yaml

    from peftlab.models.registry import cache_dir
    from peftlab.tasks.generative import find_data_file

    root = harness_root()
    out = []
    for name in names:
        ours = load_yaml(YAML_DIR / f"{name}.yaml", resolve_func=True)
        base_name, folder = ours.pop("include_task"), ours.pop("include_from")
        entry = manager.task_index.get(base_name)
        if entry is None or entry.yaml_path is None:
            raise PeftlabError(f"the installed lm-evaluation-harness has no task '{base_name}' in lm_eval/tasks/{folder}",
                               fix=INSTALL)
        base = load_yaml(entry.yaml_path, resolve_func=True)
        relative = dict(ours["dataset_kwargs"]["data_files"])
        files = {split: str(find_data_file(data_dir, rel, f"--lm-eval {name}: its {split} data ({rel})"))
                 for split, rel in relative.items()}
        digests = {split: hashlib.sha256(Path(path).read_bytes()).hexdigest() for split, path in files.items()}
        for key in ("tag", "group"):  # a task run on its own: not in the harness's groups (ai2_arc, ...)
            base.pop(key, None)
        config = {**base, **ours}
        config["dataset_kwargs"] = {**ours["dataset_kwargs"], "data_files": files,
                                    "cache_dir": str(cache_dir() / "lm-eval-datasets")}
        identity = {"harness_yaml": str(Path(entry.yaml_path).resolve().relative_to(root)),
                    "config": _jsonable({**config, "dataset_kwargs": {"data_files": relative}}), "data": digests}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
        out.append(TaskDefinition(name, config, identity["harness_yaml"], files, digests, digest))
    return out


def _jsonable(value: Any) -> Any:
    """A config as JSON: functions by their qualified name (the harness's !function references)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def count_documents(path: str | Path) -> int:
    """Records in a JSON list or JSONL file (for drawing the same items as peftlab's --max-eval-samples)."""
    from peftlab.tasks.json_files import read_json_records

    return len(read_json_records(Path(path), fix="use the published data files unchanged"))


# --------------------------------------------------------------------------- GSM8K: the harness's scoring of any text


def harness_gsm8k_scores(texts: list[str], questions: list[str], data_dir: str | None = None,
                         task_manager=None) -> tuple[dict[str, dict[str, list[int]]], list[str]]:
    """(``{task: {filter: [0/1 per text]}}``, each item's gold number as GSM8K writes it): the harness's own
    ``gsm8k`` and ``gsm8k_cot`` tasks (built from :func:`task_configs`, on the local GSM8K) score ``texts`` as if the model had generated them for the GSM8K
    test items with these ``questions``: each task's filter ensembles, then its ``process_results``
    (``exact_match`` with the task's ``regexes_to_ignore`` / ``ignore_case``) against the item's own gold."""
    manager = task_manager or harness_index(["gsm8k", "gsm8k_cot"])[1]  # the extra checked before its import
    from lm_eval.api.instance import Instance

    out: dict[str, dict[str, list[int]]] = {}
    golds: list[str] = []
    for definition in task_configs(["gsm8k", "gsm8k_cot"], data_dir, task_manager=manager):
        task = manager.load([definition.config])["tasks"][definition.name]
        by_question = {doc["question"].strip(): doc for doc in task.test_docs()}
        missing = [q for q in questions if q.strip() not in by_question]
        if missing:
            raise PeftlabError(f"{len(missing)} generated item(s) are not GSM8K test questions, e.g. "
                               f"'{missing[0][:60]}'", fix="compare generations of the math task's gsm8k set")
        docs = [by_question[q.strip()] for q in questions]
        golds = [doc["answer"].split("####")[-1].strip() for doc in docs]
        instances = [Instance("generate_until", doc, ("", {}), 0, resps=[text]) for doc, text in zip(docs, texts)]
        for ensemble in task._filters:
            ensemble.apply(instances)
        out[definition.name] = {
            ensemble.name: [int(task.process_results(doc, [inst.filtered_resps[ensemble.name]])["exact_match"])
                            for doc, inst in zip(docs, instances)]
            for ensemble in task._filters}
    return out, golds



def same_number_otherwise_written(extracted: str | None, gold: str) -> bool:
    """``extracted`` and GSM8K's ``gold`` are numbers within 0.001 (peftlab: equal) written differently as the
    harness compares them (strings, after ',', '$' and one trailing '.' are removed, case ignored)."""
    from peftlab.tasks.math_tasks import cleaned, is_correct

    return extracted is not None and cleaned(extracted).lower() != cleaned(gold).lower() and is_correct(extracted, gold)


def gsm8k_agreement(records: list[dict], data_dir: str | None = None, task_manager=None) -> dict:
    """peftlab's GSM8K strict/flexible against the harness's filters on the same generated texts.

    ``records``: the ``gsm8k`` rows of a math run's ``generations_<tag>.jsonl`` (``question``, ``generated``,
    ``gold``, ``strict_correct``, ``flexible_correct``). Returns the harness's scores of those
    texts (``gsm8k`` and ``gsm8k_cot``, each filter), peftlab's, the per-item comparison of the module
    docstring, and every disagreement the two designed differences do not explain (expected: none)."""
    from peftlab.tasks.math_tasks import STRICT_PATTERNS, flexible_answer, strict_answer

    texts = [r["generated"] or "" for r in records]
    scored, golds = harness_gsm8k_scores(texts, [r["question"] for r in records], data_dir, task_manager)
    counts = {"items": len(records), "strict_equal": 0, "flexible_equal": 0, "strict_number_format": 0,
              "flexible_number_format": 0, "strict_differs_from_gsm8k": 0, "strict_read_as_gsm8k_cot": 0}
    unexplained = []
    for i, record in enumerate(records):
        hashes = bool(STRICT_PATTERNS[0].search(record["generated"] or ""))
        harness_strict = scored["gsm8k" if hashes else "gsm8k_cot"]["strict-match"][i]
        counts["strict_differs_from_gsm8k"] += bool(record["strict_correct"]) != bool(scored["gsm8k"]["strict-match"][i])
        counts["strict_read_as_gsm8k_cot"] += not hashes and bool(STRICT_PATTERNS[1].search(texts[i]))
        harness_flexible = scored["gsm8k"]["flexible-extract"][i]
        for kind, harness, mine, extracted in (
                ("strict", harness_strict, record["strict_correct"], strict_answer(record["generated"])),
                ("flexible", harness_flexible, record["flexible_correct"], flexible_answer(record["generated"]))):
            if bool(harness) == bool(mine):
                counts[f"{kind}_equal"] += 1
            elif mine and not harness and same_number_otherwise_written(extracted, golds[i]):
                counts[f"{kind}_number_format"] += 1
            else:
                unexplained.append({"item": i, "kind": kind, "generated": texts[i], "gold": golds[i],
                                    "peftlab": bool(mine), "harness": bool(harness)})
    n = max(1, len(records))
    return {
        "harness": {f"{task}/{name}": sum(v) / n for task, filters in scored.items() for name, v in filters.items()},
        "peftlab": {"strict_match": sum(bool(r["strict_correct"]) for r in records) / n,
                    "flexible_extract": sum(bool(r["flexible_correct"]) for r in records) / n},
        "per_item": counts,
        "unexplained": unexplained,
        "rule": "peftlab strict_match vs the harness's gsm8k strict-match where the text has '#### N', else "
                "gsm8k_cot's; flexible_extract vs gsm8k's flexible-extract; *_number_format: the same number "
                "written otherwise (peftlab: within 0.001, the harness: equal strings)",
    }
