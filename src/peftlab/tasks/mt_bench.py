"""The ``mt-bench`` task: instruction tuning, then MT-Bench's 80 two-turn questions judged 1-10 by an LLM.

* **Training**: :func:`peftlab.tasks.instructions.training_pipeline` on Alpaca, or ``--train-file``.
* **Answers**: FastChat's ``<root>/mt_bench/question.jsonl``; turn 2 is generated from [question 1, the model's
  answer 1, question 2], as FastChat's ``gen_model_answer``. Greedy for every category (FastChat samples
  writing/roleplay at 0.7), at most ``--max-new-tokens`` (FastChat: 1024).
* **Judging** (``--judge-url``, :mod:`peftlab.tasks.judge`): FastChat's single-answer prompts (``single-v1``,
  ``-multi-turn``; ``single-math-v1`` with GPT-4's reference answers for math, reasoning, coding). Without
  ``--judge-url`` every judgment reads "not judged".
* **Files** (``<tag>``: ``before``, ``epoch<N>``, ``evaluate``): ``mt_bench_answers_<tag>.jsonl`` in FastChat's
  model-answer format (its ``gen_judgment.py`` can grade them) and ``mt_bench_judgments_<tag>.jsonl``.
* **Metrics**: ``mt_bench_score`` (every judged answer, both turns: FastChat's score), ``mt_bench_turn1/2``,
  ``mt_bench_<category>``, ``mt_bench_judged`` / ``_unjudged``; unjudged answers are left out of the means, as
  FastChat drops score -1. result.json's ``judge`` labels a judge that is not a strong API model ``weak``.
* **Several processes**: generation is sharded; the main process alone writes and judges, then broadcasts.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError

NEED_REF_CATS = ("math", "reasoning", "coding")  # FastChat's NEED_REF_CATS (arena-hard-200 aside)
FOLDER = "mt_bench"
QUESTIONS, REFERENCES, JUDGE_PROMPTS = "question.jsonl", "reference_answer_gpt-4.jsonl", "judge_prompts.jsonl"
PROMPT_NAMES = {(False, 1): "single-v1", (False, 2): "single-v1-multi-turn",
                (True, 1): "single-math-v1", (True, 2): "single-math-v1-multi-turn"}  # (needs reference, turn)
NOT_JUDGED = "not judged (no --judge-url)"


# --------------------------------------------------------------------------- the benchmark's files


def locate_folder(data_dir=None) -> Path:
    """``<root>/mt_bench`` holding ``question.jsonl`` (FastChat's fastchat/llm_judge/data/mt_bench/)."""
    from peftlab.tasks.generative import find_data_file

    return find_data_file(data_dir, f"{FOLDER}/{QUESTIONS}", "MT-Bench questions").parent


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise PeftlabError(f"file not found: {path}", fix="use FastChat's mt_bench data folder unchanged")
    from peftlab.tasks.json_files import read_json_records

    return [r.value for r in read_json_records(path, fix="use FastChat's mt_bench data files unchanged")]


def load_questions(folder: Path) -> list[dict]:
    """Questions with ``turn_1``, ``turn_2`` and, for the reference-graded categories, ``reference_1``/``_2``
    (GPT-4's answers; the question's own ``reference`` field where that file lacks one)."""
    references = {}
    if (folder / REFERENCES).is_file():
        for row in read_jsonl(folder / REFERENCES):
            references[row["question_id"]] = list(row["choices"][0]["turns"])
    out = []
    for number, row in enumerate(read_jsonl(folder / QUESTIONS), 1):
        where = f"{folder / QUESTIONS}:{number}"
        turns = row.get("turns")
        if not isinstance(turns, list) or len(turns) != 2 or not all(isinstance(t, str) for t in turns):
            raise PeftlabError("an MT-Bench question needs exactly two text turns", where=where)
        qid, category = row.get("question_id"), str(row.get("category", ""))
        reference = ["", ""]
        if category in NEED_REF_CATS:
            reference = references.get(qid) or row.get("reference")
            if not reference or len(reference) != 2:
                raise PeftlabError(f"question {qid} ({category}) is graded against a reference answer, but none "
                                   f"is in {folder / REFERENCES} or the question", where=where,
                                   fix="use FastChat's mt_bench data folder unchanged")
        out.append({"turn_1": turns[0], "turn_2": turns[1], "question_id": qid, "category": category,
                    "reference_1": reference[0], "reference_2": reference[1]})
    if not out:
        raise PeftlabError("no MT-Bench questions", where=str(folder / QUESTIONS))
    return out


def load_judge_prompts(folder: Path) -> dict[str, dict]:
    prompts = {row.get("name"): row for row in read_jsonl(folder / JUDGE_PROMPTS)}
    missing = [name for name in PROMPT_NAMES.values() if name not in prompts]
    if missing:
        raise PeftlabError(f"judge prompt(s) {', '.join(missing)} missing", where=str(folder / JUDGE_PROMPTS),
                           fix="use FastChat's judge_prompts.jsonl unchanged")
    return prompts


def judge_prompt(prompts: dict, question: dict, answers: list[str], turn: int) -> tuple[str, str, str]:
    """(prompt name, system, user) of FastChat's single-answer grading of ``turn`` (1 or 2)."""
    with_reference = question["category"] in NEED_REF_CATS
    name = PROMPT_NAMES[(with_reference, turn)]
    template = prompts[name]
    if turn == 1:
        fields = {"question": question["turn_1"], "answer": answers[0]}
    else:
        fields = {"question_1": question["turn_1"], "question_2": question["turn_2"],
                  "answer_1": answers[0], "answer_2": answers[1]}
    if with_reference:
        fields["ref_answer_1"] = question["reference_1"]
        if turn == 2:
            fields["ref_answer_2"] = question["reference_2"]
    return name, template["system_prompt"], template["prompt_template"].format(**fields)


# --------------------------------------------------------------------------- judging and scores


def judge_settings(cfg):
    """The judge of ``cfg`` (None without ``--judge-url``); a missing API key fails before any training."""
    from peftlab.extras import require
    from peftlab.tasks.judge import JUDGING, JudgeSettings

    if not getattr(cfg, "judge_url", None):
        return None
    require(JUDGING)  # the 'judge' extra, before any training or generation (peftlab evaluate has no preflight)
    key = os.environ.get(cfg.judge_api_key_env, "")
    if not key:
        raise PeftlabError(f"--judge-url is set, but the environment variable {cfg.judge_api_key_env} (the judge's "
                           "API key) is empty",
                           fix=f"export {cfg.judge_api_key_env}=<key> (any non-empty value, e.g. EMPTY, for a local "
                           "server without keys), or name another variable with --judge-api-key-env")
    return JudgeSettings(url=cfg.judge_url, model=cfg.judge_model, api_key=key, timeout=float(cfg.judge_timeout),
                         retries=int(cfg.judge_retries), parallel=int(cfg.judge_parallel))


def judge_info(settings) -> dict:
    """result.json's ``judge``: who judged, and whether the scores are a weak judge's."""
    from peftlab.tasks.judge import judge_strength, normalise_url

    if settings is None:
        return {"status": "not judged", "url": None, "model": None, "weak": None}
    weak, why = judge_strength(settings.url, settings.model)
    return {"status": "judged", "url": normalise_url(settings.url), "model": settings.model, "weak": weak,
            "weak_reason": why if weak else None, "prompts": "FastChat single-v1 / single-math-v1 (+ -multi-turn)",
            "timeout_s": settings.timeout, "retries": settings.retries}


def judge_answers(settings, prompts: dict, questions: list[dict], answers: list[list[str]]) -> list[dict]:
    """One judgment record per (question, turn), in order; never raises for a failed judgment."""
    from peftlab.tasks.judge import JudgeClient, Verdict

    requests = [(q, turn, *judge_prompt(prompts, q, a, turn)) for q, a in zip(questions, answers) for turn in (1, 2)]
    verdicts = ([Verdict(False, reason=NOT_JUDGED) for _ in requests] if settings is None
                else JudgeClient(settings).judge_all([(system, user) for _, _, _, system, user in requests]))
    model = settings.model if settings is not None else None
    return [{"question_id": q["question_id"], "category": q["category"], "turn": turn, "judge": [model, name],
             "user_prompt": user, "judgment": v.reply, "score": v.score, "judged": v.judged, "reason": v.reason,
             "seconds": round(v.attempts_seconds, 3), "tstamp": time.time()}
            for (q, turn, name, _, user), v in zip(requests, verdicts)]


def summarise(judgments: list[dict]) -> dict[str, float]:
    """MT-Bench metrics from judgment records (unjudged ones counted, never averaged)."""
    scored = [j for j in judgments if j["judged"]]
    metrics: dict[str, float] = {"mt_bench_judged": len(scored), "mt_bench_unjudged": len(judgments) - len(scored)}

    def mean_of(rows, key):
        if rows:
            metrics[key] = statistics.fmean(float(j["score"]) for j in rows)

    mean_of(scored, "mt_bench_score")
    for turn in (1, 2):
        mean_of([j for j in scored if j["turn"] == turn], f"mt_bench_turn{turn}")
    for category in sorted({j["category"] for j in scored}):
        mean_of([j for j in scored if j["category"] == category], f"mt_bench_{category}")
    return metrics


# --------------------------------------------------------------------------- the pipeline


def _training_records(cfg):
    """(records, where they came from): ``--train-file`` if given, else Alpaca."""
    from datasets import Dataset

    from peftlab.tasks import instruction_data as idata
    from peftlab.tasks.table import task

    if getattr(cfg, "train_file", None):
        fields = idata.parse_fields(cfg.instruction_fields)
        return Dataset.from_list(idata.read_records(cfg.train_file, fields)), str(Path(cfg.train_file))
    raw = idata.load_raw(task("alpaca"), "train", cfg.data_dir)
    source, _ = idata.local_file("alpaca", "train", cfg.data_dir)
    return raw, str(source) if source is not None else idata.HUB["alpaca"][0]


def build_pipeline(cfg, tokenizer, model, task):
    """The ``mt-bench`` task's :class:`~peftlab.tasks.prepare.Pipeline` (``task``: its row; nothing read from it)."""
    from datasets import Dataset

    from peftlab.tasks import data_files as data, instructions
    from peftlab.tasks.prepare import examples_digest

    settings = judge_settings(cfg)  # first: a missing key is a one-line error before anything slow
    instructions.ensure_pad_token(cfg, tokenizer)
    folder = locate_folder(cfg.data_dir)
    prompts = load_judge_prompts(folder)
    questions = Dataset.from_list(load_questions(folder))
    questions = data.subset(questions, cfg.max_eval_samples, cfg.eval_seed)  # the same for every training seed
    train_raw, train_source = _training_records(cfg)
    info = judge_info(settings)
    extras: dict[str, Any] = {
        "eval_examples": len(questions), "eval_examples_digest": examples_digest({"mt_bench": questions}),
        "data_files": {"train": train_source, "questions": str(folder / QUESTIONS)},
        "judge": info,
        "mt_bench": {"questions": len(questions), "decoding": "greedy", "max_new_tokens": cfg.max_new_tokens},
        "report_notes": [_report_note(info, cfg.max_new_tokens)],
    }
    return instructions.training_pipeline(
        cfg, tokenizer, train_raw, evaluate=_evaluator(cfg, tokenizer, settings, prompts, questions.to_list()),
        primary_metric="mt_bench_score", chance=0.0, num_eval_examples=len(questions), extras=extras,
        eval_sets={"mt_bench": questions})


def _evaluator(cfg, tokenizer, settings, prompts: dict, rows: list[dict]) -> Callable:
    """MT-Bench's ``evaluate(model, accelerator, tag)``: both turns generated greedily, the answers saved, then judged
    (on the main process; every process returns the same metrics)."""
    from peftlab.tasks.generation import generate_sharded, write_generations
    from peftlab.tasks.instructions import encode_prompt
    from peftlab.tasks.prepare import Evaluation

    def evaluate(model, accelerator, tag: str) -> Evaluation:
        from accelerate.utils import broadcast_object_list

        model.eval()
        first = generate_sharded(cfg, tokenizer, model, accelerator,
                                 [encode_prompt(tokenizer, q["turn_1"]) for q in rows])
        # turn 2 from [question 1, the model's answer 1, question 2], as FastChat's gen_model_answer
        second = generate_sharded(cfg, tokenizer, model, accelerator, [
            encode_prompt(tokenizer, q["turn_2"], history=[(q["turn_1"], a)]) for q, a in zip(rows, first)])
        answers = [[a, b] for a, b in zip(first, second)]
        metrics: list[Any] = [None]
        files = {}
        if accelerator.is_main_process:
            out = Path(cfg.output_dir)
            answer_name, judgment_name = f"mt_bench_answers_{tag}.jsonl", f"mt_bench_judgments_{tag}.jsonl"
            model_id = f"{cfg.model}-{cfg.method}-{tag}"
            # Answers first: if judging is interrupted, the generations are already saved.
            write_generations(out / answer_name, [
                {"question_id": q["question_id"], "model_id": model_id, "category": q["category"],
                 "turns": [q["turn_1"], q["turn_2"]], "choices": [{"index": 0, "turns": a}], "tstamp": time.time()}
                for q, a in zip(rows, answers)])
            judgments = judge_answers(settings, prompts, rows, answers)
            write_generations(out / judgment_name, judgments)
            files = {"mt_bench_answers": {tag: answer_name}, "mt_bench_judgments": {tag: judgment_name}}
            metrics = [summarise(judgments)]
        if accelerator.num_processes > 1:
            broadcast_object_list(metrics)  # the main process judged; every process returns the same metrics
        model.train()
        return Evaluation(metrics[0], files)
    return evaluate


def _report_note(info: dict, max_new_tokens: int) -> str:
    decoding = f"greedy answers of at most {max_new_tokens} new tokens (FastChat: 1024, sampled for writing/roleplay)"
    if info["status"] != "judged":
        return f"not judged (no --judge-url): answers only; {decoding}"
    strength = f"WEAK judge: {info['weak_reason']}" if info["weak"] else "strong API judge"
    return f"judged by {info['model']} at {info['url']} ({strength}); {decoding}"
