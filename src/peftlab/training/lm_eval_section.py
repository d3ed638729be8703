"""result.json's ``lm_eval`` section (its layout: :mod:`peftlab.training.lm_eval_run`): one harness call merged
into what earlier calls recorded, peftlab's own generate-and-extract numbers of the same sets beside the harness's,
a math run's GSM8K generations scored both ways, and the notes every report prints about these numbers."""

from __future__ import annotations

from pathlib import Path

PER_TASK = ("results", "n_samples", "n_shot", "configs", "settings", "generate_and_extract")  # kept per task


def merge_section(old: dict | None, new: dict) -> dict:
    """result.json's ``lm_eval`` after another harness call: its tasks replace the same tasks' entries, other
    tasks' stay; ``version`` and ``settings`` are kept per task (``calls`` lists every call in order)."""
    merged = {key: dict((old or {}).get(key) or {}) for key in PER_TASK}
    for key in PER_TASK:
        merged[key].update(new.get(key) or {})
    call = {key: new.get(key) for key in ("version", "seconds", "items_per_second", "model_seconds",
                                          "model_items_per_second", "samples_file", "tag")}
    call["tasks"] = sorted(new.get("results") or {})
    merged["version"] = new.get("version")
    merged["calls"] = [*((old or {}).get("calls") or []), call]
    agreement = new.get("gsm8k_agreement", (old or {}).get("gsm8k_agreement"))  # the latest math-run check
    if agreement is not None:
        merged["gsm8k_agreement"] = agreement
    return merged


def saved_epoch_metrics(result: dict) -> dict:
    """The metrics of the epoch whose weights adapter/ holds (``saved_epoch``): what the harness scored too."""
    epoch = result.get("saved_epoch")
    for entry in result.get("epochs_log") or []:
        if entry.get("epoch") == epoch:
            return entry.get("metrics") or {}
    return ((result.get("final") or {}).get("metrics")) or {}


def beside(result: dict, names: list[str], max_eval_samples: int | None, eval_seed: int) -> dict:
    """Per multiple-choice task: peftlab's generate-and-extract accuracy of the same set in this run, if it has
    it, and whether the harness scored the same items (the same --max-eval-samples draw)."""
    from peftlab.tasks.commonsense import metric_key
    from peftlab.tasks.lm_eval_tasks import PEFTLAB_SET

    metrics = saved_epoch_metrics(result)
    config = result.get("config") or {}
    same = config.get("max_eval_samples") == max_eval_samples and config.get("eval_seed", 0) == eval_seed
    out = {}
    for name in names:
        key = f"{metric_key(PEFTLAB_SET[name])}_accuracy" if name in PEFTLAB_SET else None
        if key and key in metrics:
            out[name] = {"metric": key, "value": metrics[key], "epoch": result.get("saved_epoch"), "same_items": same}
    return out


def agreement_on_run(out_dir: Path, result: dict, data_dir: str | None) -> dict | None:
    """A math run's GSM8K generations (its latest generations file) scored by peftlab and by the harness."""
    from peftlab.tasks.generation import read_generations
    from peftlab.tasks.lm_eval_tasks import gsm8k_agreement

    name = result.get("generations_file")
    if result.get("task") != "math" or not name or not (out_dir / name).is_file():
        return None
    records = [r for r in read_generations(out_dir / name) if r.get("set") == "gsm8k"]
    if not records:
        return None
    return {"generations_file": name, **gsm8k_agreement(records, data_dir)}


def notes(section: dict) -> list[str]:
    """What every report says about these numbers (result.json ``report_notes``)."""
    tasks = ", ".join(f"{t} ({n} items)" for t, n in sorted(section["n_samples"].items()))
    out = [f"lm_eval: lm-evaluation-harness {section['version']} on {tasks}; multiple-choice sets scored by the "
           "log-likelihood of each choice (acc; acc_norm per byte), GSM8K by the harness's own prompt and filters; "
           "table them with --metric lm_eval/<task>/<metric>"]
    agreement = section.get("gsm8k_agreement")
    if agreement:
        items = agreement["per_item"]
        out.append(f"GSM8K on the run's own generations ({items['items']} items): peftlab strict_match "
                   f"{agreement['peftlab']['strict_match']:.4f} / flexible_extract "
                   f"{agreement['peftlab']['flexible_extract']:.4f}, the harness's gsm8k strict-match "
                   f"{agreement['harness']['gsm8k/strict-match']:.4f} (gsm8k_cot "
                   f"{agreement['harness']['gsm8k_cot/strict-match']:.4f}) / flexible-extract "
                   f"{agreement['harness']['gsm8k/flexible-extract']:.4f}. By design peftlab's strict match also "
                   f"reads gsm8k_cot's 'The answer is N' where a text has no '#### N' ({items['strict_read_as_gsm8k_cot']} "
                   f"items; strict differs from gsm8k's on {items['strict_differs_from_gsm8k']}), and compares "
                   f"numbers where the harness compares strings (18.0 for 18: {items['strict_number_format']} strict, "
                   f"{items['flexible_number_format']} flexible); other differences: {len(agreement['unexplained'])}. "
                   "Compare lm_eval's gsm8k numbers with papers")
    return out


def record(out_dir: Path | None, result: dict, section: dict) -> dict:
    """``result`` with ``section`` merged in (and its report notes), written to ``out_dir/result.json`` (None:
    not written)."""
    from peftlab.training.run_folder import write_json

    updated = dict(result)
    updated["lm_eval"] = merge_section(result.get("lm_eval"), section)
    kept = [n for n in result.get("report_notes") or [] if not n.startswith(("lm_eval:", "GSM8K on the run's"))]
    updated["report_notes"] = kept + notes(updated["lm_eval"])
    if out_dir is not None:
        write_json(out_dir / "result.json", updated)
    return updated
