"""``peftlab probe``'s command line: the run's flags (parsed and refused as ``peftlab train`` does), the probe's
own, the per-block table and ``probe.json``.

Without the ``probe`` extra (curvlinops) the command is one line naming it, exit 2, before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from peftlab.argtypes import nonnegative_int, output_file, positive_int
from peftlab.config import TrainConfig, add_dataclass_flags
from peftlab.io_utils import atomic_write_text

DEFAULT_OUT = "probe.json"


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "probe", help="per-group loss curvature of a run before training: lambda_max, stable and suggested rates",
        description="Builds the run a config describes (as `peftlab train` would: model, method, head, optimizer "
                    "groups, training batches) and measures the top Hessian eigenvalue of its loss per optimizer "
                    "group, at init and optionally after the run's first Adam steps (raw and Adam-preconditioned). "
                    "Needs the 'probe' extra. Every run flag can also come from --config YAML.")
    parser.add_argument("--config", help="YAML file of config keys (flags override it)")
    probe_flags = parser.add_argument_group("Probe")
    probe_flags.add_argument("--probe-batches", type=positive_int, default=3, metavar="N",
                             help="training batches, each its own Hessian; their spread is reported (default: 3)")
    probe_flags.add_argument("--probe-adam-steps", type=nonnegative_int, default=0, metavar="N",
                             help="measure again after the run's first N optimizer steps at its --lr / --lr-ratio: "
                                  "raw and Adam-preconditioned curvature (default: 0, init only)")
    probe_flags.add_argument("--probe-out", type=output_file, default=DEFAULT_OUT, metavar="FILE",
                             help=f"where probe.json goes (default: ./{DEFAULT_OUT})")
    add_dataclass_flags(parser, TrainConfig)
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from peftlab.training.curvature import require_extra
    from peftlab.training.loop import config_from_args

    cfg = config_from_args(args)  # train's parsing and refusals
    require_extra()
    from peftlab import preflight  # train's checks before anything loads: data, model, extras, where probe.json goes
    from peftlab.training.probe import ProbeOptions, probe

    preflight.check([preflight.Cell("", cfg)], [preflight.Output(Path(args.probe_out), "file", "--probe-out")])

    result = probe(cfg, ProbeOptions(batches=args.probe_batches, adam_steps=args.probe_adam_steps))
    atomic_write_text(Path(args.probe_out), json.dumps(result, indent=1) + "\n")
    print(render(result))
    print(f"-> {args.probe_out}")
    return 0


def _num(value, fmt: str = ".3g") -> str:
    return "n/a" if value is None else format(value, fmt)


def render(result: dict) -> str:
    """The per-block tables (one per kind of curvature measured), the suggestions and the wall time."""
    from peftlab.training.probe import KIND_LABELS, VERDICT

    cfg, options = result["config"], result["options"]
    lines = [f"curvature probe: {cfg['method']} {{{cfg['targets']}}} on {cfg['model']}, {cfg['task']}; "
             f"{options['batches']} training batches of {cfg['batch_size']} (seed {cfg['seed']}), fp32, eval mode"]
    for kind, blocks in result["kinds"].items():
        edge = f" {'Adam edge':>10}" if kind == "preconditioned" else ""
        lines += ["", f"{KIND_LABELS[kind]}:",
                  f"  {'block':<12} {'params':>10}  {'lambda_max (mean ± sd over batches; min-max)':<44} "
                  f"{'2/lambda':>9}{edge} {'suggested':>10}"]
        for name, row in blocks.items():
            lam = row["lambda_max"]
            spread = "not converged" if lam is None else (
                f"{lam['mean']:.4g} ± {lam['std']:.2g} ({lam['min']:.4g}-{lam['max']:.4g})")
            numel = next(b["numel"] for b in result["blocks"] if b["name"] == name)
            flag = "" if row["converged"] == row["batches"] else (
                f"  (eigsh converged on {row['converged']}/{row['batches']} batches)")
            edge = f" {_num(row['adam_edge_rate']):>10}" if "adam_edge_rate" in row else ""
            lines.append(f"  {name:<12} {numel:>10,}  {spread:<44} {_num(row['stable_rate']):>9}{edge} "
                         f"{_num(row['suggested_rate']):>10}{flag}")
        lam_v = result["suggested_lambda"][kind]
        if lam_v is not None:
            lines.append(f"  suggested lambda = rate(v) / rate(q) = lambda_max(q) / lambda_max(v) = {lam_v:.3g}")
    rule = result["rule"]
    lines += ["", f"rule: {rule['form']}, c per kind {rule['c']} (fitted on {rule['fitted_on']})",
              f"validation (docs/RESULTS.md): {VERDICT}"]
    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    lines.append(f"probe wall time {result['wall_s']:.1f} s (CPU {result['cpu_s']:.1f} s, {result['threads']} threads; "
                 f"load average {load} on {result['cpu_count']} cores)")
    return "\n".join(lines)

