"""lm-evaluation-harness on a decoder run's in-memory model: ``--lm-eval`` of ``peftlab train`` and ``evaluate``.

The adapted model goes into the harness's ``HFLM`` (the run's device, ``--eval-batch-size``, ``--mixed-precision``
as autocast with fp32 log-softmax); the task definitions of :mod:`peftlab.tasks.lm_eval_tasks` run through the
harness's own ``evaluate``, offline, on local data files only. ``--max-eval-samples N`` draws the same items as
peftlab's own evaluation (``--eval-seed``). Results go to result.json's ``lm_eval`` section
(:mod:`peftlab.training.lm_eval_section`; its layout: schemas/result.schema.json), metric names being the harness's
``<metric>,<filter>`` keys with the filter ``none`` dropped; each item's requests, responses and scores to
``<run>/lm_eval_samples_<train|evaluate>.jsonl``."""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from peftlab.errors import PeftlabError
from peftlab.training.lm_eval_section import agreement_on_run, beside, record

SAMPLES_FILE = "lm_eval_samples_{tag}.jsonl"
MATH_GSM8K = "math/gsm8k/test.json"  # the math task's (LLM-Adapters') copy of the GSM8K test set
AFTER_TRAINING = ("ok", "no_learning", "collapsed")  # statuses whose saved weights are worth scoring
_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


@contextmanager
def offline():
    """No network for whatever runs inside: the variables, and the constants the hub and datasets read them into
    at import. (Only these two variables are restored: os.environ is never cleared under other threads.)"""
    import datasets.config
    import huggingface_hub.constants as hub

    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    saved_env = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, "1"))
    try:
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(hub, "HF_HUB_OFFLINE", True))
            for name in names:
                stack.enter_context(mock.patch.object(datasets.config, name, True))
            yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def draw_samples(definitions, n: int | None, seed: int, data_dir: str | None) -> dict[str, list[int]] | None:
    """``--max-eval-samples``: per task, the document indices of peftlab's own draw (module docstring)."""
    if n is None:
        return None
    from datasets import Dataset

    from peftlab.tasks.data_files import subset
    from peftlab.tasks.generative import find_data_file
    from peftlab.tasks.lm_eval_tasks import count_documents

    drawn = {}
    for task in definitions:
        test = task.data_files["test"]
        if task.name.startswith("gsm8k"):
            native = [json.loads(line)["question"].strip() for line in Path(test).read_text().splitlines()
                      if line.strip()]
            position = {question: i for i, question in enumerate(native)}
            try:
                copy = json.loads(find_data_file(data_dir, MATH_GSM8K, "the math task's GSM8K").read_text())
            except PeftlabError:  # no math data: the harness's own order, drawn the same way
                copy = []
            draw = subset(Dataset.from_dict({"q": [r["instruction"].strip() for r in copy]}), n, seed)["q"]
            if copy and all(q in position for q in draw):
                drawn[task.name] = [position[q] for q in draw]
                continue
        indices = Dataset.from_dict({"i": list(range(count_documents(test)))})
        drawn[task.name] = list(subset(indices, n, seed)["i"])
    return drawn


def run_harness(model, tokenizer, names: list[str], *, data_dir: str | None = None, batch_size: int = 16,
                precision: str = "no", max_eval_samples: int | None = None, eval_seed: int = 0,
                num_fewshot: int | None = None, max_new_tokens: int | None = None,
                samples_path: str | Path | None = None) -> dict:
    """The harness's numbers for ``names`` on ``model`` (result.json's ``lm_eval`` section)."""
    from peftlab.tasks.lm_eval_tasks import harness_index, task_configs

    lm_eval, manager = harness_index(names)  # the harness installed, else one line naming the extra
    from lm_eval.models.huggingface import HFLM

    definitions = task_configs(names, data_dir, task_manager=manager)
    samples = draw_samples(definitions, max_eval_samples, eval_seed, data_dir)
    gen_kwargs = {"max_gen_toks": int(max_new_tokens)} if max_new_tokens else None
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    try:
        with offline(), _quiet_harness():
            dtype = _PRECISION_DTYPES.get(precision)  # the model in memory, never loaded by name: nothing to fetch
            lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                      mixed_precision_dtype=dtype, softmax_dtype="float32" if dtype else None)
            model_seconds = time_requests(lm)
            out = evaluate_tasks(lm, [d.config for d in definitions], manager, num_fewshot=num_fewshot,
                                 samples=samples, gen_kwargs=gen_kwargs)
    finally:
        if was_training:
            model.train()
    seconds = time.perf_counter() - start
    items = sum(out["n-samples"][d.name]["effective"] for d in definitions)
    by_type = {}  # the harness's request types: multiple_choice -> loglikelihood, gsm8k -> generate_until
    for d in definitions:
        kind = "loglikelihood" if d.config.get("output_type") == "multiple_choice" else d.config.get("output_type")
        by_type[kind] = by_type.get(kind, 0) + out["n-samples"][d.name]["effective"]
    section = {
        "version": lm_eval.__version__,
        "results": {d.name: harness_metrics(out["results"][d.name]) for d in definitions},
        "n_samples": {d.name: out["n-samples"][d.name]["effective"] for d in definitions},
        "n_shot": {d.name: out.get("n-shot", {}).get(d.name) for d in definitions},
        "configs": {d.name: {"sha256": d.sha256, "harness_yaml": d.harness_yaml, "data_sha256": d.data_sha256,
                             "config": json_safe(out["configs"].get(d.name))} for d in definitions},
        "seconds": seconds,  # everything: data files read, documents built, requests, metrics
        "items_per_second": items / seconds if seconds else None,
        # the model's part alone, per request type: items scored per second of the harness's model calls
        "model_seconds": dict(model_seconds),
        "model_items_per_second": {kind: n / model_seconds[kind] for kind, n in by_type.items()
                                   if model_seconds.get(kind)},
        "settings": {"batch_size": batch_size, "precision": precision, "max_eval_samples": max_eval_samples,
                     "eval_seed": eval_seed, "num_fewshot": num_fewshot, "max_new_tokens": max_new_tokens},
    }
    if samples_path is not None:
        _write_samples(samples_path, out["samples"], definitions)
        section["samples_file"] = Path(samples_path).name
    return section


def evaluate_tasks(lm, configs: list[dict], manager, *, num_fewshot: int | None, samples: dict | None,
                   gen_kwargs: dict | None) -> dict:
    """``lm_eval.simple_evaluate``'s preparation of the tasks (its seeds, generation settings, ``num_fewshot``: a
    task's own when None, 0 if it has none), then ``lm_eval.evaluator.evaluate``. simple_evaluate itself would also
    run ``pip`` and ``git`` and ask the Hub for the model's revision: nothing peftlab records. The global random
    states are restored afterwards."""
    import random

    import numpy as np
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    try:
        loaded = manager.load(configs)
        for task in loaded["tasks"].values():
            if gen_kwargs and task.get_config("output_type") == "generate_until":
                task.set_config(key="generation_kwargs", value=gen_kwargs, update=True)
            if num_fewshot is not None and task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=num_fewshot)
            elif task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
        return evaluate(lm=lm, task_dict=loaded, samples=samples, log_samples=True)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def time_requests(lm) -> dict[str, float]:
    """Seconds the harness spends in ``lm``'s request methods, by type, filled in as it calls them (the
    evaluator calls ``getattr(lm, request_type)(requests)``)."""
    seconds: dict[str, float] = {}
    for kind in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        def timed(requests, *args, _call=getattr(lm, kind), _kind=kind, **kwargs):
            start = time.perf_counter()
            try:
                return _call(requests, *args, **kwargs)
            finally:
                seconds[_kind] = seconds.get(_kind, 0.0) + time.perf_counter() - start
        setattr(lm, kind, timed)
    return seconds


def harness_metrics(values: dict) -> dict[str, float]:
    """The harness's ``{"acc,none": .., "exact_match,strict-match": ..}`` -> ``{"acc": .., "exact_match,strict-match":
    ..}`` (numbers only; a stderr it could not compute, "N/A", is left out)."""
    out = {}
    for key, value in values.items():
        if key in ("alias", "sample_len") or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        metric, _, filter_name = key.partition(",")
        out[metric if filter_name in ("", "none") else key] = float(value)
    return out


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


def _write_samples(path, samples: dict, definitions) -> None:
    from peftlab.io_utils import atomic_write_text

    lines = []
    for task in definitions:
        for row in samples.get(task.name, []):
            lines.append(json.dumps(json_safe({"task": task.name, **{k: row.get(k) for k in (
                "doc_id", "target", "arguments", "resps", "filtered_resps", "filter")},
                **{k: v for k, v in row.items() if k in ("acc", "acc_norm", "exact_match")}}), ensure_ascii=False))
    atomic_write_text(path, "".join(line + "\n" for line in lines))


# The harness warns that a model object, not a name, was passed: that is how peftlab uses it.
EXPECTED_WARNINGS = ("`pretrained` model kwarg is not of type `str`", "Passed an already-initialized model")


def _unexpected(record) -> bool:
    return not str(record.getMessage()).startswith(EXPECTED_WARNINGS)


@contextmanager
def _quiet_harness():
    """The harness logs every request batch at INFO, datasets a progress bar per file read; peftlab prints its own
    summary (the harness's own progress bars over the requests stay)."""
    import logging

    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars_were_on = logger.level, not datasets.utils.are_progress_bars_disabled()
    logger.setLevel(logging.WARNING)
    sources = [logging.getLogger(f"lm_eval.{name}") for name in ("models.huggingface", "evaluator")]
    for source in sources:
        source.addFilter(_unexpected)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        for source in sources:
            source.removeFilter(_unexpected)
        if bars_were_on:
            datasets.enable_progress_bars()


def score_run(model, tokenizer, cfg, result: dict, out_dir: Path, names: list[str], *, precision: str, tag: str,
              max_eval_samples: int | None, num_fewshot: int | None = None, max_new_tokens: int | None = None,
              write: bool = True) -> dict:
    """The harness on a run's model, recorded in its result.json (and its items in
    ``lm_eval_samples_<tag>.jsonl``) unless not ``write``; returns the updated result."""
    from peftlab.tasks.instructions import ensure_pad_token

    ensure_pad_token(cfg, tokenizer)
    section = run_harness(model, tokenizer, names, data_dir=cfg.data_dir, batch_size=cfg.eval_batch_size,
                          precision=precision, max_eval_samples=max_eval_samples, eval_seed=cfg.eval_seed,
                          num_fewshot=num_fewshot, max_new_tokens=max_new_tokens,
                          samples_path=out_dir / SAMPLES_FILE.format(tag=tag) if write else None)
    section["tag"] = tag
    section["settings"] = {name: {**section["settings"], "harness_version": section["version"]} for name in names}
    section["generate_and_extract"] = beside(result, names, max_eval_samples, cfg.eval_seed)
    if any(name.startswith("gsm8k") for name in names):
        agreement = agreement_on_run(out_dir, result, cfg.data_dir)
        if agreement is not None:
            section["gsm8k_agreement"] = agreement
    return record(out_dir if write else None, result, section)


def check_request(cfg) -> None:
    """Before a run trains: the harness is installed and every task's data is found (one line otherwise)."""
    from peftlab.tasks.lm_eval_tasks import task_configs, task_names

    task_configs(task_names(cfg.lm_eval), cfg.data_dir)


def after_training(run, result: dict) -> dict:
    """``peftlab train --lm-eval``: the harness on the trained model in memory (the saved weights: --save best
    put the best epoch's back), recorded in result.json. A run that did not finish measurably is not scored."""
    from peftlab.models.registry import load_tokenizer
    from peftlab.tasks.lm_eval_tasks import task_names

    cfg = run.cfg
    if not run.main or result.get("status") not in AFTER_TRAINING:
        return result
    model = run.accelerator.unwrap_model(run.model)
    return score_run(model, load_tokenizer(cfg.model), cfg, result, Path(run.out), task_names(cfg.lm_eval),
                     precision=run.accelerator.mixed_precision, tag="train", max_eval_samples=cfg.max_eval_samples)


def evaluate_with_harness(run_dir: str | Path, tasks: str, *, adapter=None, merge: bool = False,
                          allow_pickle: bool = False, max_eval_samples: int | None = None,
                          num_fewshot: int | None = None, max_new_tokens: int | None = None) -> dict:
    """``peftlab evaluate RUN --lm-eval TASKS``: the saved run's model through the harness; its numbers are
    added to RUN/result.json (not with ``--adapter``: another adapter's numbers are not this run's)."""
    from peftlab.tasks.lm_eval_tasks import task_configs, task_names
    from peftlab.tasks.table import find_task
    from peftlab.training.devices import make_accelerator
    from peftlab.training.evaluation import load_run
    from peftlab.training.run_folder import FINISHED, read_result

    run_dir = Path(run_dir)
    names = task_names(tasks)
    result = read_result(run_dir)
    if result is None or result.get("status") not in FINISHED:
        raise PeftlabError(f"{run_dir} holds no finished run (result.json with a final status)",
                           fix="evaluate a folder written by a finished peftlab train")
    task = find_task(str(result.get("task")))
    if task is None or task.head != "causal-lm":
        raise PeftlabError(f"--lm-eval scores decoder runs; {run_dir} is a '{result['task']}' run of an encoder head",
                           fix="use it on a run of --task commonsense, math, gsm8k, alpaca, json, e2e or mt-bench")
    task_configs(names, (result.get("config") or {}).get("data_dir"))  # every task's data found, before the model loads
    run = load_run(run_dir, adapter=adapter, merge=merge, allow_pickle=allow_pickle)
    accelerator = make_accelerator(run.precision)
    model = run.model.to(accelerator.device)
    if max_eval_samples is None:
        max_eval_samples = run.cfg.max_eval_samples
    updated = score_run(model, run.tokenizer, run.cfg, result, run_dir, names, precision=run.precision,
                        tag="evaluate", max_eval_samples=max_eval_samples, num_fewshot=num_fewshot,
                        max_new_tokens=max_new_tokens, write=adapter is None)["lm_eval"]
    return {"version": updated["version"], "results": {n: updated["results"][n] for n in names},
            "n_samples": {n: updated["n_samples"][n] for n in names},
            "recorded_in": str(run_dir / "result.json") if adapter is None else None,
            **({"gsm8k_agreement": updated["gsm8k_agreement"]} if "gsm8k_agreement" in updated else {})}
