"""The optional extras: :data:`NEEDS` is the one table of which command or option needs which of their modules
(found without importing them). A command checks its row with :func:`require` before any work; the preflight
checks the rows its runs' options name (:func:`needs_of`). A missing one is one line naming the install command.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from peftlab.errors import PeftlabError


@dataclass(frozen=True)
class Need:
    use: str  # the command or option, as the user typed it: "peftlab serve-judge", "--report-to tensorboard"
    modules: tuple[str, ...]  # the import names it needs
    extra: str = ""  # the pyproject extra that brings them ("" for a package peftlab declares no extra for)
    what: str = ""  # how the message names them (default: the extra and its modules)
    install: str = ""  # the fix (default: pip install "peftlab[<extra>]")
    applies: Callable[[Any], bool] | None = None  # for a run's option: whether a resolved TrainConfig uses it
    scores: bool = False  # needed to score the run's task (so by `peftlab evaluate` too, not only by training)

    def missing(self) -> list[str]:
        return [module for module in self.modules if not installed(module)]

    def error(self, missing: list[str]) -> PeftlabError:
        what = self.what or f"the '{self.extra}' extra ({', '.join(missing)})"
        return PeftlabError(f"{self.use} needs {what}, which is not installed",
                            fix=self.install or f'pip install "peftlab[{self.extra}]"')


def _task_field(cfg, field: str) -> str:
    """A field of the run's registered Task ("" for a name no row holds)."""
    from peftlab.tasks.table import find_task

    task = find_task(cfg.task)
    return getattr(task, field) if task is not None else ""


NEEDS: tuple[Need, ...] = (
    Need("peftlab serve-judge", ("fastapi", "uvicorn"), "judge"),
    Need("MT-Bench judging (--judge-url)", ("openai",), "judge", scores=True,
         applies=lambda cfg: _task_field(cfg, "pipeline") == "mt_bench" and bool(cfg.judge_url)),
    Need("peftlab nlg-score", ("sacrebleu", "nltk", "pycocoevalcap"), "nlg"),
    Need("--task e2e (its BLEU, NIST, METEOR, ROUGE-L, CIDEr)", ("sacrebleu", "nltk", "pycocoevalcap"), "nlg",
         scores=True, applies=lambda cfg: _task_field(cfg, "kind") == "e2e"),
    Need("peftlab tune", ("optuna",), "tune"),
    Need("--report-to tensorboard", ("tensorboard",), "track", applies=lambda cfg: cfg.report_to == "tensorboard"),
    Need("--report-to wandb", ("wandb",), what="the 'wandb' package",
         install="pip install wandb, or use --report-to tensorboard", applies=lambda cfg: cfg.report_to == "wandb"),
    Need("--report-to mlflow", ("mlflow",), what="the 'mlflow' package",
         install="pip install mlflow, or use --report-to tensorboard", applies=lambda cfg: cfg.report_to == "mlflow"),
    Need("--lm-eval", ("lm_eval",), "lm-eval", what="lm-evaluation-harness", applies=lambda cfg: bool(cfg.lm_eval)),
    Need("--backend ray", ("ray",), "ray", what="Ray"),
    # --no-deps: curvlinops declares backpack-for-pytorch, which would pull another torch (pyproject.toml)
    Need("peftlab probe", ("curvlinops",), "probe", install="pip install --no-deps 'curvlinops-for-pytorch>=3.0,<4' "
         "'einops>=0.3' 'einconv>=0.1' 'linear_operator>=0.2' 'opt-einsum>=3.4' (the 'probe' extra's packages)"),
)
EXTRAS: dict[str, tuple[str, ...]] = {}  # extra -> every module its rows need (the install check's list)
for _need in NEEDS:
    if _need.extra:
        EXTRAS[_need.extra] = tuple(dict.fromkeys(EXTRAS.get(_need.extra, ()) + _need.modules))


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (found, not imported). A finder that refuses it counts as missing."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # refused by a finder, or a half-imported module without a spec
        return False


def need(use: str) -> Need:
    return next(row for row in NEEDS if row.use == use)


def require(use: str) -> None:
    """One line naming the install command when ``use``'s modules are not all installed (exit 2)."""
    row = need(use)
    missing = row.missing()
    if missing:
        raise row.error(missing)


def needs_of(cfg) -> list[Need]:
    """The rows a resolved run config uses (its options and task)."""
    return [row for row in NEEDS if row.applies is not None and row.applies(cfg)]


def require_scoring(cfg) -> None:
    """What scoring the run's task needs (E2E's scorers, MT-Bench's judge client), checked before a saved run's
    model is loaded (``peftlab evaluate`` has no preflight)."""
    for row in (row for row in needs_of(cfg) if row.scores):
        require(row.use)  # the extra's one line


def tracker(report_to: str) -> str:
    """The tracker a run uses: ``--report-to auto`` (the default) is tensorboard when the 'track' extra is
    installed, else none, so a lean install trains without it and a full one keeps its <run>/tb logs."""
    if report_to != "auto":
        return report_to
    return "tensorboard" if all(map(installed, EXTRAS["track"])) else "none"
