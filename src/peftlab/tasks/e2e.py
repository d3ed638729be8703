"""``--task e2e``: E2E NLG (restaurant meaning representation -> description), scored on generated text.

* **Data** (``<data>/e2e/``, the challenge's CSVs ``mr,ref``): the 42k training set is not offline, so
  ``devset.csv`` trains (each pair an example) and ``testset_w_refs.csv`` evaluates, its references grouped by
  MR (``--max-eval-samples`` draws MRs). ``report_notes`` say dev was trained on: not the challenge's setting.
* **Metrics** (:mod:`peftlab.tasks.nlg_metrics`): ``bleu`` (primary), ``nist``, ``meteor``, ``rouge_l``,
  ``cider``, equal to the official script's. Without Java, METEOR is left out and ROUGE-L/CIDEr approximate;
  result.json's ``metrics_unavailable``, ``report_notes`` and ``metric_implementations`` say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError

TRAIN_FILE = "e2e/devset.csv"
TEST_FILE = "e2e/testset_w_refs.csv"
INSTRUCTION = "Write a one-sentence description of the restaurant from its attributes."
DATASET = "e2e-dev-as-train"
E2E_FIX = "use the E2E NLG Challenge CSV files unchanged"
DATASET_NOTE = ("the official E2E training set is not available offline: trained on devset.csv ({n_train} pairs), "
                "evaluated on testset_w_refs.csv ({n_mrs} MRs, all references each)")


def read_e2e_csv(path) -> list[tuple[str, str]]:
    """``(mr, ref)`` rows of an E2E CSV (header ``mr,ref``); one line naming the file and line when malformed."""
    from peftlab.tasks.data_files import csv_rows

    records = list(csv_rows(Path(path), "csv"))
    header = records[0][1] if records else []
    if [h.strip().lower() for h in header] != ["mr", "ref"]:
        raise PeftlabError(f"expected the header 'mr,ref', got {','.join(header)!r}", where=f"{path}:1", fix=E2E_FIX)
    rows = []
    for line, row in records[1:]:
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != 2 or not row[0].strip() or not row[1].strip():
            raise PeftlabError(f"expected two non-empty fields (mr, ref), got {len(row)}", where=f"{path}:{line}",
                               fix=E2E_FIX)
        rows.append((row[0].strip(), row[1].strip()))
    if not rows:
        raise PeftlabError("file holds no rows", where=str(path), fix=E2E_FIX)
    return rows


def group_references(rows: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """``(mr, [ref, ...])`` per distinct MR, in order of first appearance."""
    grouped: dict[str, list[str]] = {}
    for mr, ref in rows:
        grouped.setdefault(mr, []).append(ref)
    return list(grouped.items())


def build_pipeline(cfg, tokenizer, model, task):
    """The ``e2e`` kind's :class:`~peftlab.tasks.prepare.Pipeline` (``task``: its row; E2E reads nothing from it)."""
    from datasets import Dataset

    from peftlab.tasks import generative, instructions
    from peftlab.tasks.data_files import subset
    from peftlab.tasks.generation import generation_evaluator
    from peftlab.tasks.instructions import encode_prompt
    from peftlab.extras import require
    from peftlab.tasks.nlg_metrics import (OFFICIAL, SCORED_BY, corpus_scores, implementations, java_runtime,
                                           meteor_missing, no_java_note)
    from peftlab.tasks.prepare import examples_digest

    require(SCORED_BY)  # the 'nlg' extra, before any generation (peftlab evaluate has no preflight)
    instructions.ensure_pad_token(cfg, tokenizer)
    train_path = generative.find_data_file(cfg.data_dir, TRAIN_FILE, "E2E devset.csv (the training data offline)")
    test_path = generative.find_data_file(cfg.data_dir, TEST_FILE, "E2E testset_w_refs.csv")
    train_rows = read_e2e_csv(train_path)
    train_raw = Dataset.from_list(
        [{"instruction": INSTRUCTION, "input": mr, "output": ref} for mr, ref in train_rows])
    grouped = group_references(read_e2e_csv(test_path))
    test = Dataset.from_list([{"mr": mr, "references": refs} for mr, refs in grouped])
    test = subset(test, cfg.max_eval_samples, cfg.eval_seed)
    mrs, references = list(test["mr"]), [list(r) for r in test["references"]]
    prompts = [encode_prompt(tokenizer, INSTRUCTION, mr) for mr in mrs]

    java = java_runtime()  # once per run: every evaluation scores the same way

    def score(texts: list[str]):
        scores = corpus_scores(texts, references, java)
        records = [{"mr": mr, "references": refs, "generated": text} for mr, refs, text in zip(mrs, references, texts)]
        notes = dict(scores.unavailable)  # why a metric is missing from this evaluation (result.json metric_notes)
        if scores.notes:
            notes["scorer"] = " ".join(scores.notes)
        return records, scores.metrics, notes

    meteor_reason = meteor_missing(java)
    extras: dict[str, Any] = {
        "dataset": DATASET,
        "report_notes": [DATASET_NOTE.format(n_train=len(train_rows), n_mrs=len(mrs))]
        + ([no_java_note(java)] if not java.available else []),  # lab/report.py prints them
        "data_files": {"train": str(train_path), "test": str(test_path)},
        "eval_examples": len(mrs),
        "eval_references": sum(len(r) for r in references),
        "eval_examples_digest": examples_digest({"test": test}),
        "metrics_reproduce": OFFICIAL,
        "java": java.version if java.available else None,
        "metric_implementations": implementations(java),
        # Known before any generation; a metric that one evaluation cannot compute (NIST on degenerate outputs)
        # is absent from that evaluation's metrics, with the reason in metric_notes[tag].
        "metrics_unavailable": {"meteor": meteor_reason} if meteor_reason else {},
    }
    return instructions.training_pipeline(cfg, tokenizer, train_raw, evaluate=generation_evaluator(
        cfg, tokenizer, prompts, score), primary_metric="bleu", chance=0.0, num_eval_examples=len(mrs),
        extras=extras, eval_sets={"test": test})
