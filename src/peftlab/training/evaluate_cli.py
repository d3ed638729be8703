"""``peftlab evaluate RUN``: a saved run's adapter on its task's dev set (:func:`peftlab.training.evaluation.evaluate_run`),
or with ``--lm-eval`` through lm-evaluation-harness (:mod:`peftlab.training.lm_eval_run`). The command apart from
the library it calls, so that the harness module, which loads runs through evaluation, is not imported back."""

from __future__ import annotations

import json

from peftlab.argtypes import nonnegative_int, positive_int, text
from peftlab.errors import PeftlabError
from peftlab.training.evaluation import evaluate_run


def add_parser(sub) -> None:
    parser = sub.add_parser("evaluate", help="evaluate a saved run's adapter on its task's dev set")
    parser.add_argument("run_dir", help="a folder written by peftlab train (holds config.yaml and adapter/)")
    parser.add_argument("--adapter", help="adapter folder to use instead of RUN_DIR/adapter")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the weights first")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="allow a pickle (.bin) adapter, which can run arbitrary code when loaded")
    parser.add_argument("--max-eval-samples", type=positive_int, help="evaluate on a deterministic subset")
    parser.add_argument("--lm-eval", type=text, metavar="TASKS",
                        help="instead: score the run with lm-evaluation-harness on these tasks (gsm8k, gsm8k_cot, "
                             "arc_easy, arc_challenge, openbookqa, piqa, social_iqa, winogrande, commonsense), offline "
                             "on the local data, items drawn by --max-eval-samples (default: the run's own, so the "
                             "same items as its evaluation); adds result.json \"lm_eval\" (pip install "
                             "\"peftlab[lm-eval]\")")
    parser.add_argument("--lm-eval-fewshot", type=nonnegative_int, metavar="K",
                        help="with --lm-eval: few-shot examples per prompt (default: each task's own, gsm8k 5)")
    parser.add_argument("--lm-eval-max-new-tokens", type=positive_int, metavar="N",
                        help="with --lm-eval: generation limit of GSM8K (default: the harness's, 256)")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    if getattr(args, "lm_eval", None):  # lm-evaluation-harness: training/lm_eval_run.py
        from peftlab.training.lm_eval_run import evaluate_with_harness

        print(json.dumps(evaluate_with_harness(
            args.run_dir, args.lm_eval, adapter=args.adapter, merge=args.merge, allow_pickle=args.allow_pickle,
            max_eval_samples=args.max_eval_samples, num_fewshot=args.lm_eval_fewshot,
            max_new_tokens=args.lm_eval_max_new_tokens), indent=2))
        return 0
    if getattr(args, "lm_eval_fewshot", None) is not None or getattr(args, "lm_eval_max_new_tokens", None) is not None:
        raise PeftlabError("--lm-eval-fewshot / --lm-eval-max-new-tokens apply only with --lm-eval",
                           fix="add --lm-eval TASKS, or drop them")
    metrics = evaluate_run(args.run_dir, adapter=args.adapter, merge=args.merge, allow_pickle=args.allow_pickle,
                           max_eval_samples=args.max_eval_samples)
    print(json.dumps(metrics, indent=2))
    return 0
