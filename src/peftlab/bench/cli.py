"""``peftlab bench``: what each method costs, and what peftlab's data path saves.

Five benchmarks, each writing ``<name>.json`` and ``<name>.md`` into ``--out-dir``:

* **micro** (default): for one model, sequence length and batch size, every method in
  :data:`peftlab.methods.table.METHODS` (plus the plain ``base`` model, no adapter, head trained) on every target
  set: adapter init time (``apply_method``: the SVD of PiSSA/MiLoRA/KaSA, CorDA's calibration), the median
  train step (forward + ``extra_loss`` + backward + AdamW over :func:`peftlab.methods.optim_groups.param_groups`), examples/s,
  peak memory, and inference latency unmerged and merged (:func:`peftlab.methods.saving.merged`). All
  configurations are built once and then measured **round-robin** (repeat r visits every configuration, in
  an order rotated by r), so slow drift of a shared machine hits all of them alike; ratios against LoRA
  (same targets) and against the base model are medians of per-round *paired* ratios.
* **e2e** (``--e2e``): ``peftlab.training.loop.train`` run twice per task and seed, with peftlab's default data
  path (dynamic padding, length-grouped batches, cached tokenisation) and with the papers' setup
  (``--pad-to-max``, T = ``--seq-len`` = 128): train seconds per epoch and the final dev metric of each.

* **against trainer** (``--against trainer``): GLUE tasks: the same LoRA run through ``transformers.Trainer`` (Yao
  et al.: pad to T; the KaSA authors: pad to the batch's longest; ``group_by_length``) and through ``peftlab train``
  (``--compile``: also compiled), pairs side by side on one core each, cores swapped: examples/s ratios at each
  side's dev metric (:mod:`~peftlab.bench.against_trainer`). Decoder tasks (``--task math``, ``commonsense``, ``e2e``): the papers' decoder pipeline (LLM-Adapters / KaSA:
  Trainer + ``DataCollatorForSeq2Seq``, padding to the longest, random batches) against ``peftlab train``
  (length-grouped, and ``--packing``), pairs side by side on one core each, cores swapped: training tokens/s,
  losses, model FLOP/s (:mod:`~peftlab.bench.against_trainer_decoder`).
* **sweep overhead** (``--sweep-overhead``): a small ``peftlab sweep`` split into training and fixed costs per
  phase from each run's result.json ``timings`` (:mod:`~peftlab.bench.sweep_overhead`).
* **decode** (``--decode``): GSM8K evaluation's greedy loop against ``model.generate``, fp32 / bf16 autocast,
  with and without batching by prompt length: new tokens/s and identical outputs (:mod:`~peftlab.bench.decode`).

Timing: ``time.perf_counter`` on CPU; on CUDA ``torch.cuda.Event`` pairs around ``--inner`` steps, in bf16
autocast (``--precision auto``). Memory: the configuration's standalone resident size (every parameter and
buffer, counted as if the model were loaded alone, plus AdamW state) plus the transient peak of one train
step above what was allocated before it. The transient peak is ``torch.cuda.max_memory_allocated`` on
CUDA; on CPU it is the peak of the torch CPU allocator's live bytes, read from ``torch.profiler``'s memory
events (``profile_memory=True``; no tracemalloc, which does not see torch's allocations), with the step's
RSS high-water-mark delta (``/proc/self/clear_refs`` + ``VmHWM``, after ``malloc_trim``) reported beside it.

To keep many configurations resident at once, every configuration shares the frozen parameters that no
method touches (embeddings, MLPs, norms) with one base model; only the attention projections that some
target set adapts and the task head are copied per configuration.

Modules: :mod:`~peftlab.bench.micro` and :mod:`~peftlab.bench.e2e` (the two benchmarks),
:mod:`~peftlab.bench.timing` (clock, round-robin, statistics), :mod:`~peftlab.bench.memory`,
:mod:`~peftlab.bench.machine` (device, precision, environment), :mod:`~peftlab.bench.models` (models and inputs),
:mod:`~peftlab.bench.render` (Markdown); this one parses the flags (``peftlab bench``, ``python -m peftlab.bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from peftlab.argtypes import (bounded_int, folder, nonnegative_int, output_folder, positive_float, positive_int, seed,
                                  text)
from peftlab.errors import USER_ERROR_EXIT, PeftlabError




def _threads(text: str) -> int:
    return bounded_int(text, 1, 2**31 - 1, "a positive integer < 2**31 (torch.set_num_threads takes a C int)")


def _seeds(value: str) -> str:
    """A comma list of seeds, kept as text (the benchmarks split it themselves)."""
    pieces = [piece.strip() for piece in value.split(",") if piece.strip()]
    if not pieces:
        raise argparse.ArgumentTypeError(f"expected a comma list of seeds, got '{value}'")
    for piece in pieces:
        seed(piece)
    return value


# The flags that only some benchmarks read, by the benchmarks that read them (micro, the default, reads none):
# given to another benchmark, one would be ignored without a word and the numbers measured with other settings
# than those asked for, so it is refused.
READ_BY = {
    "--task": ("--e2e", "--against", "--sweep-overhead"),
    "--epochs": ("--e2e", "--against", "--sweep-overhead"),
    "--seeds": ("--e2e", "--against"),
    "--max-train-samples": ("--e2e", "--against", "--sweep-overhead"),
    "--max-eval-samples": ("--e2e",),
    "--lr": ("--e2e", "--against"),
    "--data-dir": ("--e2e", "--against", "--sweep-overhead", "--decode"),
    "--mixed-precision": ("--e2e", "--against", "--sweep-overhead"),
    "--pairs": ("--against",),
    "--compile": ("--against",),
    "--lr-ratio": ("--against",),
    "--runs": ("--sweep-overhead",),
    "--workers": ("--sweep-overhead",),
    "--problems": ("--decode",),
    "--max-new-tokens": ("--decode",),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=text, default=None,
                        help="registered model or path (default: roberta-base-random; with --e2e: minilm-l6)")
    parser.add_argument("--methods", type=text, default=None,
                        help="comma list of methods (default: every method in peftlab.methods.table.METHODS; "
                             "with --e2e: lora)")
    parser.add_argument("--targets", action="append", type=text, default=None,
                        help="a target set such as q,v; repeat the flag for several (default: q,v and q,k,v; "
                             "with --e2e only the first is used, default q,v)")
    parser.add_argument("--rank", type=positive_int, default=8, help="adapter rank (default 8)")
    parser.add_argument("--alpha", type=positive_float, default=16.0, help="LoRA alpha (default 16)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per example (default 128; with --e2e the max length T, default 128)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="examples per step (default 8; with --e2e 32; with --decode 16)")
    parser.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed warm-up rounds (default 2)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed rounds per configuration (default 7; with --against trainer: runs per setup "
                             "and task, default 2; with --decode: timed rounds, default 3)")
    parser.add_argument("--infer-repeats", type=positive_int, default=None,
                        help="timed inference rounds (default: --repeats)")
    parser.add_argument("--inner", type=positive_int, default=1,
                        help="back-to-back steps per timed sample (default 1; raise on GPU)")
    parser.add_argument("--init-repeats", type=positive_int, default=3,
                        help="adapter inits per configuration, round-robin (default 3)")
    parser.add_argument("--calibration-samples", type=positive_int, default=8,
                        help="CorDA calibration forwards during init (default 8, from the benchmark batch)")
    parser.add_argument("--threads", type=_threads, default=None,
                        help="torch CPU threads (default: torch's); 1 is far steadier on a shared machine")
    parser.add_argument("--device", type=text, default="auto", help="auto (CUDA if present), cpu or cuda[:i]")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="auto: bf16 autocast on CUDA, fp32 on CPU (with --decode: both fp32 and bf16)")
    parser.add_argument("--compare-kasa-peft", action="store_true",
                        help="add a kasa-peft row: KaSA with peft's per-module regulariser (before peftlab batched it)")
    parser.add_argument("--max-seconds", type=positive_float, default=None,
                        help="time budget: once spent, each timing phase stops after 3 timed rounds (default: none)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random model, inputs and adapter init")
    parser.add_argument("--out-dir", type=output_folder, default="bench_out",
                        help="where the JSON and Markdown go (default bench_out)")
    parser.add_argument("--name", type=text, default=None, help="file name stem (default: derived from the settings)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="only re-render the Markdown beside a bench JSON (no benchmark is run)")
    e2e = parser.add_argument_group("end to end (--e2e)")
    e2e.add_argument("--e2e", action="store_true",
                     help="train on a real task twice: dynamic padding vs --pad-to-max (the papers' setup)")
    e2e.add_argument("--task", "--tasks", type=text, default=None,
                     help="GLUE task(s), comma list (default cola; with --against trainer: rte,mrpc)")
    e2e.add_argument("--epochs", type=positive_int, default=1, help="epochs per run (default 1)")
    e2e.add_argument("--seeds", type=_seeds, default=None,
                     help="comma list of seeds; each runs both setups (default 0; with --against trainer repeat r "
                          "uses the r-th seed, cyclically)")
    e2e.add_argument("--max-train-samples", "--train-examples", type=positive_int, default=None,
                     help="train on a seeded subset of this many examples (CPU sizing; with --against trainer "
                          "default 1000)")
    e2e.add_argument("--max-eval-samples", type=positive_int, default=None, help="evaluate on a seeded subset")
    e2e.add_argument("--lr", type=positive_float, default=None, help="learning rate (default: the method's)")
    e2e.add_argument("--data-dir", type=folder, default=None, help="GLUE data root (default as in peftlab train)")
    e2e.add_argument("--mixed-precision", choices=("no", "bf16"), default=None,
                     help="the same precision on every side (bf16: CPU autocast; Trainer bf16=True, use_cpu=True); "
                          "default: no (with --against trainer and --sweep-overhead), auto on CUDA in plain --e2e")
    e2e.add_argument("--against", choices=("trainer",), default=None,
                     help="the same work through transformers.Trainer beside peftlab's run (implies --e2e). GLUE "
                          "tasks: pad to T; group_by_length + DataCollatorWithPadding; each run its own process, "
                          "round-robin. Decoder tasks (--task math, commonsense, e2e): LLM-Adapters' pipeline "
                          "(DataCollatorForSeq2Seq, padding to the longest, random batches) against peftlab padded "
                          "and packed, in pairs side by side on one core each (default model smollm2-135m, "
                          "--batch-size 4, --seq-len 512, 256 examples, lr 3e-4)")
    e2e.add_argument("--pairs", type=text, default=None,
                     help="with --against trainer: comma list of A:B setup pairs run side by side, one core each. "
                          "GLUE tasks: setups pad128, longest, grouped, peftlab, peftlab-compiled (default "
                          "pad128:peftlab,longest:peftlab); decoder tasks: llm-adapters, peftlab, peftlab-packed "
                          "(default every pair of the three)")
    e2e.add_argument("--compile", action="store_true",
                     help="with --against trainer on GLUE tasks: add peftlab --compile on (setup peftlab-compiled) "
                          "against pad128, longest and eager peftlab (its compile time and break-even too)")
    e2e.add_argument("--lr-ratio", type=positive_float, default=2.0,
                     help="with --against trainer: lambda = eta_V / eta_QK (default 2)")
    lab = parser.add_argument_group("lab overhead (--sweep-overhead) and decoder evaluation (--decode)")
    lab.add_argument("--sweep-overhead", action="store_true",
                     help="run a small MiniLM sweep through `peftlab sweep` and split its wall time into training "
                          "and fixed costs per phase (default 10 runs: RTE 200 examples, 1 epoch, lambda x seed)")
    lab.add_argument("--runs", type=positive_int, default=10,
                     help="with --sweep-overhead: runs in the sweep (default 10: lambda 1,2,4,8,16 x 2 seeds)")
    lab.add_argument("--workers", type=nonnegative_int, default=0,
                     help="with --sweep-overhead: peftlab sweep --workers (default 0: runs in the sweep's process)")
    lab.add_argument("--decode", action="store_true",
                     help="GSM8K evaluation decoding: peftlab's greedy loop vs model.generate, fp32 vs bf16 "
                          "autocast, with and without batching by prompt length: new tokens/s, identical outputs")
    lab.add_argument("--problems", type=positive_int, default=32,
                     help="with --decode: GSM8K test problems (default 32)")
    lab.add_argument("--max-new-tokens", type=positive_int, default=256,
                     help="with --decode: generation limit (default 256, as peftlab's GSM8K evaluation)")


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="benchmark every method's cost, and the data path end to end",
                            description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run_cli)


def rerender(path: str | Path) -> str:
    """Re-render the Markdown of a bench JSON (``--render``); an e2e summary is recomputed from its runs."""
    from peftlab.bench.e2e import e2e_summary
    from peftlab.bench.render import markdown_e2e, markdown_micro
    from peftlab.io_utils import atomic_write_text

    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PeftlabError(f"cannot read bench results {path}: {err}", fix="pass a .json written by peftlab bench") from None
    kind = result.get("kind")
    if kind in ("against_trainer", "against_trainer_decoder", "sweep_overhead", "decode"):
        import importlib

        module = importlib.import_module({"against_trainer": "peftlab.bench.against_trainer",
                                          "against_trainer_decoder": "peftlab.bench.against_trainer_decoder",
                                          "sweep_overhead": "peftlab.bench.sweep_overhead",
                                          "decode": "peftlab.bench.decode"}[kind])
        text = module.rerender(result)
    elif result.get("kind") == "e2e":
        for run in result["runs"]:
            if run.get("wall_seconds_per_epoch") is None and run.get("wall_seconds") is not None:
                run["wall_seconds_per_epoch"] = run["wall_seconds"] / max(1, result["settings"]["epochs"])
        pairs = dict.fromkeys((r["task"], r["method"]) for r in result["runs"])
        result["summary"] = [e2e_summary(result["runs"], task, method) for task, method in pairs]
        text = markdown_e2e(result)
    elif result.get("kind") == "micro":
        text = markdown_micro(result)
    else:
        raise PeftlabError(f"{path} is not a peftlab bench result", fix="pass a .json written by peftlab bench")
    atomic_write_text(path.with_suffix(".md"), text)
    return text


def check_flags_of_mode(args) -> None:
    """One benchmark per run, and no flag (set off its default) that the chosen benchmark would not read."""
    modes = [flag for flag, on in (("--e2e", args.e2e), ("--sweep-overhead", args.sweep_overhead),
                                   ("--decode", args.decode)) if on]
    if args.against and not args.e2e:  # --against trainer compares end-to-end runs: --e2e is implied
        args.e2e = True
        modes.insert(0, "--against")
    if len(modes) > 1:
        raise PeftlabError(f"{' and '.join(modes)} are separate benchmarks", fix="pass one of them per run")
    if (args.pairs or args.compile) and args.against != "trainer":
        flag = "--pairs" if args.pairs else "--compile"
        raise PeftlabError(f"{flag} chooses the setups of --against trainer",
                           fix=f"add --against trainer (or drop {flag})")
    mode = "--against" if args.against else modes[0] if modes else None
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    for flag, readers in READ_BY.items():
        dest = flag[2:].replace("-", "_")
        if mode not in readers and getattr(args, dest) != defaults.get_default(dest):
            mode_text = f"with {mode}" if mode else "in the default micro benchmark"
            raise PeftlabError(f"{flag} only applies to {' / '.join(readers)}; {mode_text} it would be ignored",
                               fix=f"add {readers[0]}, or drop {flag}")


def run_cli(args) -> int:
    import warnings

    if args.render:
        print(rerender(args.render))
        return 0
    check_flags_of_mode(args)  # before torch is imported: a mistake is one line, at once

    import torch

    from peftlab.bench.e2e import run_e2e
    from peftlab.bench.micro import run_micro

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft -> transformers, every build
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.e2e and args.against == "trainer":
            from peftlab.bench.against_trainer import run_against_trainer
            from peftlab.bench.against_trainer_decoder import is_decoder_request, run_against_trainer_decoder

            decoder = is_decoder_request(args.task)
            if args.compile and decoder:
                raise PeftlabError("--compile adds compiled setups to the GLUE comparison; the decoder comparison "
                                   "has none yet", fix="drop --compile, or run GLUE tasks (--task rte,mrpc)")
            result = run_against_trainer_decoder(args) if decoder else run_against_trainer(args)
        elif args.e2e:
            result = run_e2e(args)
        elif args.sweep_overhead:
            from peftlab.bench.sweep_overhead import run_sweep_overhead

            result = run_sweep_overhead(args)
        elif args.decode:
            from peftlab.bench.decode import run_decode

            result = run_decode(args)
        else:
            args.model = args.model or "roberta-base-random"
            args.repeats = args.repeats or 7
            result = run_micro(args)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting
    print(Path(result["files"]["markdown"]).read_text())
    print(f"wrote {result['files']['json']} and {result['files']['markdown']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m peftlab.bench ...``: the same as ``peftlab bench`` without the other subcommands' parsers."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="peftlab bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except PeftlabError as err:
        print(f"peftlab: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
