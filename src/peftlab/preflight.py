"""Preflight: what a command that trains can find out in its first seconds, before anything is written.

Each check runs once per distinct value among the cells (a label and a resolved config each; a 160-run study asks
once per model, data source and judge): the **output** paths and the disk's **room** for the planned runs, the
**data** and **model** by the runs' own lookups (:mod:`peftlab.preflight_sources`), each **extra** the options
need, each MT-Bench **judge** (one short request) and the caller's **services** (Ray). Every problem is one line
naming the cells it affects, all raised together (exit 2). Torch-free: a sweep's or tune's driver runs it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from peftlab import extras, preflight_sources as sources
from peftlab.errors import PeftlabError, PeftlabErrors, os_error
from peftlab.io_utils import nearest_existing, path_problem

MiB = 1 << 20
# Parameters of the registered models (their model cards); the weights are not read to count them.
REGISTERED_PARAMS = {"minilm-l6": 22.7e6, "mpnet-base": 109.5e6, "smollm2-135m": 134.5e6,
                     "qwen2.5-coder-0.5b": 630e6}
ADAPTER_SHARE = 0.1  # an adapter's parameters as a share of the model's, at most (LoRA r=8 on q,v: ~0.3 %)
RUN_OVERHEAD = 2 * MiB  # result.json, epochs.jsonl, config.yaml, its log, TensorBoard events
PLAN_NEEDS = {"ray": "--backend ray", "tune": "peftlab tune"}  # a plan's own extras: their rows of extras.NEEDS


@dataclass(frozen=True)
class Cell:
    label: str  # how a problem names it: "" for a lone `peftlab train` run, "run 3 {task=sst2}" in a sweep
    cfg: Any  # a resolved TrainConfig


@dataclass(frozen=True)
class Output:
    path: Path
    kind: str  # "folder" (a run folder, the runs' root) or "file" (a store)
    what: str  # how the command names it: --output-dir, the store


@dataclass(frozen=True)
class Service:
    check: str  # the finding's name: "ray"
    subject: str
    probe: Callable[[], str]  # what answered (a note), or a PeftlabError raised


@dataclass
class Finding:
    check: str  # output, room, data, model, extra, judge, or a service's name
    subject: str  # what was checked
    cells: tuple[str, ...]  # the labels of the cells it concerns
    total: int  # how many cells the command has
    note: str = ""  # what was found (--dry-run prints it)
    problem: PeftlabError | None = None

    def error(self) -> PeftlabError:
        named = name_cells(self.cells, self.total)
        assert self.problem is not None
        return PeftlabError(f"preflight {self.check}: {named + ': ' if named else ''}{self.problem.what}",
                            where=self.problem.where, fix=self.problem.fix)


def name_cells(labels: Iterable[str], total: int) -> str:
    """``run 3 {task=sst2}``, three of them and how many more, or ``all 6 runs``; "" for a lone run."""
    labels = [label for label in labels if label]
    if not labels:
        return ""
    if len(labels) == total > 1:
        return f"all {total} runs"
    return ", ".join(labels[:3]) + (f" and {len(labels) - 3} more" if len(labels) > 3 else "")


# --------------------------------------------------------------------------- the whole check


def preflight(cells: list[Cell], outputs: Iterable[Output], *, runs: list[Cell] | None = None, parallel: int = 1,
              needs: Iterable[str] = (), services: Iterable[Service] = ()) -> list[Finding]:
    """Every check's finding. ``runs``: the runs the command plans to train (default ``cells``; sized for room),
    ``parallel`` of them at once; ``needs``: the plan's own extras (:data:`PLAN_NEEDS`)."""
    total, everyone = len(cells), tuple(cell.label for cell in cells)
    findings = []
    outputs = list(outputs)
    refused: list[Path] = []
    for out in outputs:
        if any(out.path == bad or bad in out.path.parents for bad in refused):
            continue  # below an output already refused: the same problem
        findings.append(_attempt("output", f"{out.what} {out.path}", everyone, total, lambda out=out: _output(out)))
        if findings[-1].problem is not None:
            refused.append(out.path)
    if outputs and not any(f.problem for f in findings):
        findings += _room(outputs[0].path, cells if runs is None else runs, parallel, everyone)
    findings += _grouped("data", cells, sources.data_key, sources.data, total,
                         lambda cfg: cfg.task + (f" from --data-dir {cfg.data_dir}" if cfg.data_dir else ""))
    findings += _grouped("model", cells, lambda cfg: cfg.model, sources.model, total, lambda cfg: f"model {cfg.model}")
    findings += _extras(cells, needs)
    from peftlab.tasks.table import task as registered_task

    judged = [cell for cell in cells if registered_task(cell.cfg.task).pipeline == "mt_bench" and cell.cfg.judge_url]
    findings += _grouped("judge", judged, lambda cfg: (cfg.judge_url, cfg.judge_model, cfg.judge_api_key_env), _judge,
                         total, lambda cfg: f"judge {cfg.judge_url}")
    for service in services:
        findings.append(_attempt(service.check, service.subject, everyone, total, service.probe))
    return findings


def check(cells: list[Cell], outputs: Iterable[Output], **options) -> list[Finding]:
    """:func:`preflight`, then every problem raised at once (one line each, exit 2); the findings otherwise."""
    findings = preflight(cells, outputs, **options)
    raise_problems(findings)
    return findings


def raise_problems(findings: list[Finding]) -> None:
    problems = [f.error() for f in findings if f.problem is not None]
    if problems:
        raise PeftlabErrors(problems)


def render(findings: list[Finding]) -> list[str]:
    """For --dry-run: a line per check passed (``preflight data: ok: rte: <folder> (all 6 runs)``), and how many
    problems there are (:func:`raise_problems` then prints each on stderr)."""
    lines = []
    for f in findings:
        if f.problem is None:
            named = name_cells(f.cells, f.total)
            lines.append(f"preflight {f.check}: ok: {f.subject}: {f.note}" + (f" ({named})" if named else ""))
    problems = sum(1 for f in findings if f.problem is not None)
    lines.append(f"preflight: {problems} problem(s), each on stderr: nothing would run" if problems else
                 "preflight: no problem found")
    return lines


def _attempt(check_name: str, subject: str, cells: tuple[str, ...], total: int, probe: Callable[[], str]) -> Finding:
    try:
        return Finding(check_name, subject, cells, total, note=probe())
    except PeftlabError as err:
        return Finding(check_name, subject, cells, total, problem=err)
    except OSError as err:  # a path the OS refused while looking (a name too long, a folder not readable)
        return Finding(check_name, subject, cells, total, problem=os_error(err))


def _grouped(check_name: str, cells: list[Cell], key: Callable, probe: Callable[[Any], str], total: int,
             subject: Callable[[Any], str]) -> list[Finding]:
    """``probe`` once per distinct ``key(cfg)``, naming the cells that share it (of ``total``)."""
    groups: dict[Any, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(key(cell.cfg), []).append(cell)
    return [_attempt(check_name, subject(group[0].cfg), tuple(c.label for c in group), total,
                     lambda group=group: probe(group[0].cfg)) for group in groups.values()]


# --------------------------------------------------------------------------- output paths and room


def _output(out: Output) -> str:
    problem = path_problem(out.path, kind=out.kind)
    if problem is not None:
        raise PeftlabError(f"cannot write {out.what} {out.path}: {problem}",
                           fix=f"choose another path for {out.what} (in a folder you can write in)")
    return "writable"


def model_params(name: str) -> float | None:
    """The model's parameter count as far as it is known without loading it (None: a Hub model not sized)."""
    from peftlab.models.random_models import RANDOM_MODELS

    if name in REGISTERED_PARAMS:
        return REGISTERED_PARAMS[name]
    random = next((m for m in RANDOM_MODELS if m.name == name), None)
    if random is not None:
        c = random.config
        width = c.get("hidden_size") or c.get("n_embd") or 768
        layers = c.get("num_hidden_layers") or c.get("n_layer") or 12
        inner = c.get("intermediate_size") or c.get("n_inner") or c.get("ffn_hidden_size") or 4 * width
        return c.get("vocab_size", 30522) * width + layers * (4 * width * width + 3 * width * inner)
    folder = Path(name).expanduser()
    try:
        weights = [p for p in folder.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt")] \
            if folder.is_dir() else []
    except OSError:
        return None
    return sum(p.stat().st_size for p in weights) / 2 if weights else None  # at least 16-bit weights


def run_bytes(cfg, params: float) -> tuple[float, float]:
    """(kept, peak): what a finished run keeps on disk, and the most it holds while it trains."""
    if int(cfg.epochs or 0) == 0:  # before fine-tuning: nothing is trained, checkpointed or saved
        return RUN_OVERHEAD, RUN_OVERHEAD
    trained = 4 * params * (1.0 if cfg.method == "full" else ADAPTER_SHARE)  # fp32 tensors
    kept = trained + RUN_OVERHEAD
    return kept, kept + 2 * 4 * trained  # + a checkpoint (weights, 2 Adam moments, best) beside the last one


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _room(root: Path, runs: list[Cell], parallel: int, everyone: tuple[str, ...]) -> list[Finding]:
    """Room under ``root`` for each run alone (naming the cells too big), then for all of them (``parallel``
    training at once; naming every cell of the command, ``everyone``)."""
    total = len(everyone)
    free = shutil.disk_usage(nearest_existing(root)).free
    sizes = {cell.cfg.model: model_params(cell.cfg.model) for cell in runs}
    sized = [(cell, *run_bytes(cell.cfg, sizes[cell.cfg.model])) for cell in runs if sizes[cell.cfg.model]]
    unsized = sorted(name for name, n in sizes.items() if n is None)
    subject = f"disk under {root}"
    too_big = [(cell, peak) for cell, _, peak in sized if peak > free]
    fix = "free disk space, or write the runs to a larger disk (--output-dir)"
    if too_big:
        cell, peak = max(too_big, key=lambda pair: pair[1])
        problem = PeftlabError(
            f"not enough disk space under {root}: a run of model '{cell.cfg.model}' (--method {cell.cfg.method}, "
            f"~{sizes[cell.cfg.model] / 1e6:.1f}M parameters) needs about {_size(peak)} (its saved weights and a "
            f"checkpoint with Adam's moments), {_size(free)} free", fix=fix)
        return [Finding("room", subject, tuple(dict.fromkeys(c.label for c, _ in too_big)), total, problem=problem)]
    growth = sorted((peak - kept for _, kept, peak in sized), reverse=True)
    need = sum(kept for _, kept, _ in sized) + sum(growth[:max(1, parallel)])
    if need > free:
        return [Finding("room", subject, everyone, total, problem=PeftlabError(
            f"not enough disk space under {root}: the {len(runs)} planned run(s) need about {_size(need)} (saved "
            f"weights, and checkpoints of {parallel} run(s) at a time), {_size(free)} free", fix=fix))]
    note = f"{_size(free)} free, about {_size(need)} planned for {len(runs)} run(s)"
    return [Finding("room", subject, everyone, total, note=note + (
        f"; not sized: {', '.join(unsized)} (not downloaded yet)" if unsized else ""))]


# --------------------------------------------------------------------------- extras and the judge


def _extras(cells: list[Cell], needs: Iterable[str]) -> list[Finding]:
    """A finding per extra the cells' options use (naming those cells), and per extra of the plan (all cells)."""
    users: dict[extras.Need, list[str]] = {}
    for cell in cells:
        for row in extras.needs_of(cell.cfg):
            users.setdefault(row, []).append(cell.label)
    for name in needs:
        users[extras.need(PLAN_NEEDS[name])] = [cell.label for cell in cells]

    def installed(row: extras.Need) -> str:
        extras.require(row.use)  # the extra's one line
        return "installed"

    return [_attempt("extra", ", ".join(row.modules), tuple(labels), len(cells), lambda row=row: installed(row))
            for row, labels in users.items()]


def _judge(cfg) -> str:
    from peftlab.tasks import judge, mt_bench

    if extras.need(judge.JUDGING).missing():
        return "not asked: its client is missing (the extra's finding)"
    settings = mt_bench.judge_settings(cfg)  # its API key set: else one line
    why = judge.probe(settings)
    if why is not None:
        raise PeftlabError(
            f"the MT-Bench judge at --judge-url {judge.normalise_url(settings.url)} did not answer one short request "
            f"(no retry, at most {min(judge.PROBE_TIMEOUT, settings.timeout):g} s): {why}",
            fix="start the judge (e.g. `peftlab serve-judge --model qwen2.5-coder-0.5b --port 8000`) or correct "
                "--judge-url / --judge-model, then rerun; nothing was trained")
    return f"answered ({settings.model})"
