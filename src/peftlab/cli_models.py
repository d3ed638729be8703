"""``peftlab models``: the model registry and whether each entry is installed."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    parser = sub.add_parser("models", help="list registered models and whether each is installed")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args) -> int:
    from peftlab.models import MODELS, describe_models

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
