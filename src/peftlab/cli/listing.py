"""``peftlab models`` and ``peftlab methods``: what can be fine-tuned, and how."""

from __future__ import annotations

import json


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
        hint = MODELS[row["name"]].install_hint
        hint = f"  ({hint})" if hint and not row["installed"] else ""
        print(f"{row['name']:<{width}}  {row['family']:<7}  {mark}  {row['description']}{hint}")
    return 0


def add_methods_parser(sub) -> None:
    parser = sub.add_parser("methods", help="list fine-tuning methods, their default learning rates and limits")
    parser.set_defaults(func=run_methods)


def run_methods(args) -> int:
    from peftlab.methods.registry import METHODS

    print(f"{'method':<10} {'lr':>8} {'head lr':>8}  {'SVD init':<8} {'fused QKV':<9} {'Conv1D':<6} extra loss  summary")
    for m in METHODS.values():
        head = m.default_head_lr  # used whatever --lr is, unless --head-lr is given
        lr = f"{m.default_lr:>8.0e}" if "lr" in m.options else f"{'-':>8}"  # head-only: nothing trains at --lr
        # head-only adapts no projection: neither a fused matrix nor a Conv1D concerns it
        fused, conv1d = (("yes" if m.fused_qkv else "no"), ("yes" if m.conv1d else "no")) if m.adapts_projections \
            else ("-", "-")
        print(f"{m.name:<10} {lr} {head:>8.0e}  {'yes' if m.svd_init else 'no':<8} {fused:<9} {conv1d:<6} "
              f"{'yes' if m.extra_loss else 'no':<10}  {m.summary}")
    print("\nfused QKV: on GPT-2 (c_attn), Phi-3 (qkv_proj), Falcon (query_key_value) and ModernBERT (Wqkv) the fused "
          "matrix is split into q, k, v linear layers when the model is loaded for training, so any subset of q,k,v "
          "trains at its own rate (k frozen unless named); merge and export fuse it back into the original layout.")
    print("Conv1D: GPT-2 keeps c_proj (o) and the MLP's c_fc/c_proj (up, down) as Conv1D layers (weights stored "
          "(in, out)); a method with 'no' refuses them in --targets.")
    return 0
