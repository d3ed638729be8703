"""``peftlab train``: one fine-tuning run, an explicit loop on Accelerate that reads top to bottom:
:func:`peftlab.training.setup.setup` -> :func:`peftlab.training.fit.fit` -> :func:`peftlab.training.finish.finish`."""

from __future__ import annotations

import os
from pathlib import Path

from peftlab.config import TrainConfig, add_dataclass_flags, config_yaml, option_names
from peftlab.resolve import build_run_config, resolve_config
from peftlab.training import run_folder as runfiles
from peftlab.training.finish import finish
from peftlab.training.fit import fit
from peftlab.training.guards import check_same_config
from peftlab.training.setup import setup


def train(cfg: TrainConfig, on_epoch_end=None) -> dict:
    """Run (or resume) one fine-tuning run into ``cfg.output_dir``; returns the result dict.

    ``on_epoch_end(EpochEnd) -> bool | str | None``: optional; a truthy answer stops the run after that epoch
    (``peftlab tune`` prunes poor trials so); result.json then holds status ``pruned`` (unless the run had
    collapsed: that label is kept), ``stopped_early`` (epoch, reason: the answer when it is a string) and
    ``epochs_run``. The run finishes normally (adapter, result.json), so it is never resumed. An unresolved
    ``cfg`` is resolved here, once (:func:`peftlab.resolve.resolve_config`); a resolved one is used as it is."""
    if not cfg.resolved:  # called from Python: this is the run's entry (the CLI, sweep and tune resolved it)
        cfg = resolve_config(cfg)  # the method's and task's defaults, before anything is compared or written
    out = Path(cfg.output_dir)
    # Decide what to do with --output-dir first (cheap), but create nothing until setup has succeeded:
    # bad input found during setup (a data file, a rank) must not leave a half-made run folder behind.
    mode = runfiles.inspect_output_dir(out, overwrite=cfg.overwrite, resume=cfg.resume)
    if mode in ("resume", "finished", "restart"):  # restart: killed before its first checkpoint, same rule
        check_same_config(cfg, out)
    if mode == "finished":
        return runfiles.read_result(out)
    if cfg.lm_eval:  # --lm-eval: the harness installed and every task's data found, before anything trains
        from peftlab.training.lm_eval_run import check_request

        check_request(cfg)
    run = setup(cfg, mode)
    try:
        fit(run, on_epoch_end)
    except Exception as err:  # OOM, full disk, a bug: say so in result.json; the checkpoint stays for --resume
        if run.main:
            runfiles.write_json(out / "result.json", {
                "schema_version": 1, "status": "failed", "status_reason": f"{type(err).__name__}: {err}"[:2000],
                "config": cfg.to_dict(), "epochs_log": run.state.epochs_log,
                "epochs_run": run.state.epochs_run, "curve": run.state.curve,
                "code": runfiles.code_record(), "git_commit": runfiles.git_commit(),
                "train_examples_digest": run.pipeline.train_examples_digest})
        raise
    result = finish(run)
    if cfg.lm_eval:  # lm-evaluation-harness on the saved weights, still in memory (result.json "lm_eval")
        from peftlab.training.lm_eval_run import after_training

        result = after_training(run, result)
    return result


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="fine-tune one model on one task with one method",
                            description="One fine-tuning run. Every flag can also come from --config YAML; "
                                        "flags override it.")
    parser.add_argument("--config", help="YAML file of config keys (flags override it)")
    parser.add_argument("--print-config", "--print_config", action="store_true",
                        help="print the resolved config (the config.yaml this run would write) and exit")
    add_dataclass_flags(parser, TrainConfig)
    parser.set_defaults(func=run_cli)


def config_from_args(args) -> TrainConfig:
    values = {name: getattr(args, name, None) for name in option_names(TrainConfig)}  # flat: kasa_beta
    return build_run_config(yaml_path=args.config, flag_values=values, check_explicit=True)


def run_cli(args) -> int:
    cfg = config_from_args(args)
    if getattr(args, "print_config", False):  # validated like a run, but nothing is created
        print(config_yaml(cfg), end="")
        return 0
    from peftlab import preflight  # data, model, extras, the output folder and its room, the judge: before anything

    preflight.check([preflight.Cell("", cfg)], [preflight.Output(Path(cfg.output_dir), "folder", "--output-dir")])
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # one summary per run under accelerate launch
        return exit_code(result)
    best = result["best"]["metrics"].get(result["primary_metric"])
    final = result["final"]["metrics"].get(result["primary_metric"])
    print(f"status={result['status']} {result['primary_metric']}: best={_fmt(best)} "
          f"(epoch {result['best']['epoch']}) final={_fmt(final)} chance={_fmt(result['majority_baseline'])} "
          f"-> {Path(cfg.output_dir) / 'result.json'}")
    if result.get("above_majority") is False and cfg.epochs > 0:
        print(f"note: the best {result['primary_metric']} {_fmt(best)} is not above the majority class "
              f"{_fmt(result['majority_baseline'])} of the dev set: this run learned nothing measurable")
    if result["status_reason"]:
        print(f"reason: {result['status_reason']}")
    return exit_code(result)


# Statuses of a run that trained as asked and measured what it learned (even if nothing): exit 0. A diverged
# run is an error of the run (exit 1); a failed one raises.
MEASURED = ("ok", "collapsed", "no_learning", "pruned")


def exit_code(result: dict) -> int:
    return 0 if result["status"] in MEASURED else 1


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
