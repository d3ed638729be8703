"""``peftlab models`` and ``peftlab methods``: what can be fine-tuned, and how."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    add_models_parser(sub)
    add_methods_parser(sub)


def add_models_parser(sub) -> None:
    parser = sub.add_parser("models", help="list registered models and whether each is installed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args) -> int:
    from peftlab.models.registry import MODELS, describe_models

    rows = describe_models()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(name) for name in MODELS)
    for row in rows:
        mark = "installed" if row["installed"] else "missing  "
        hint = "" if row["installed"] else f"  ({MODELS[row['name']].install_hint})" if MODELS[row["name"]].install_hint else ""
        print(f"{row['name']:<{width}}  {row['family']:<7}  {mark}  {row['description']}{hint}")
    return 0


def add_methods_parser(sub) -> None:
    parser = sub.add_parser("methods", help="list fine-tuning methods, their default learning rates and limits")
    parser.set_defaults(func=run_methods)


def run_methods(args) -> int:
    from peftlab.methods.table import METHODS

    print(f"{'method':<10} {'lr':>8} {'head lr':>8}  {'SVD init':<8} {'fused QKV':<9} extra loss  summary")
    for m in METHODS.values():
        head = m.default_head_lr  # used whatever --lr is, unless --head-lr is given
        lr = f"{m.default_lr:>8.0e}" if "lr" in m.options else f"{'-':>8}"  # head-only: nothing trains at --lr
        print(f"{m.name:<10} {lr} {head:>8.0e}  {'yes' if m.svd_init else 'no':<8} "
              f"{'yes' if m.fused_qkv else 'no':<9} {'yes' if m.extra_loss else 'no':<10}  {m.summary}")
    return 0
