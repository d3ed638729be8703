"""New tokens/s of GSM8K evaluation: peftlab's greedy loop against ``model.generate``.

    python benchmarks/decode.py --model smollm2-135m --problems 32 --batch-size 16

Three decoding paths over the same GSM8K test prompts (``encode_prompt`` of the first ``--problems`` of the
seeded test subset that ``peftlab train --task gsm8k --max-eval-samples N`` scores), at the same batch size:

* ``peftlab_loop``: :func:`greedy_loop`, the hand-written greedy loop GSM8K evaluation ran
  before ``model.generate`` became the one generation path (kept here to compare against):
  loop with the KV cache that drops finished rows from the batch and stops a row once its answer is final
  (:func:`peftlab.tasks.math_answers.answer_is_final`, checked at each newline);
* ``generate_stop``: :func:`peftlab.tasks.generation.generate_greedy` (``model.generate``, greedy, with the same
  stop rule as a per-row ``StoppingCriteria``), what every generation task (GSM8K included) runs;
* ``generate_plain``: ``model.generate`` as a user calls it: greedy, stopping only at EOS / end of turn or
  ``--max-new-tokens``.

Each in fp32 and in bf16 autocast (``--precision``: both by default), with batches of similar prompt lengths
(``by_length``: the prompts sorted longest first, as peftlab does) or in the given order (``as_given``: one
call per consecutive batch). Configurations are timed round-robin (order rotated per round) after one untimed
round that also records the texts. New tokens: the generated texts re-tokenised (equal for equal texts).
Identical outputs: the share of texts equal to ``peftlab_loop``'s at the same precision and order (the two
paths that share a stop rule), and the share of extracted answers equal to the fp32 ``peftlab_loop``'s.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cli import main, nonnegative_int, parser, positive_int, progress
from benchmarks.machine import environment, loadavg, write_result
from benchmarks.render import markdown_decode, slug
from benchmarks.timing import Clock, first_line, paired_ratio, round_robin, summarize

PATHS = ("peftlab_loop", "generate_stop", "generate_plain")
ORDERS = ("by_length", "as_given")
PATH_TEXT = {
    "peftlab_loop": "benchmarks.decode.greedy_loop (GSM8K evaluation: own greedy loop, finished rows leave the "
                    "batch, stops once the answer is final)",
    "generate_stop": "peftlab.tasks.generation.generate_greedy (model.generate, greedy, the same stop rule as a "
                     "StoppingCriteria)",
    "generate_plain": "model.generate, greedy, stops at EOS / end of turn or --max-new-tokens only",
}


@dataclass
class DecodeConfig:
    path: str
    precision: str  # fp32 | bf16
    order: str  # by_length | as_given
    seconds: list = field(default_factory=list)
    texts: list | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.path}/{self.precision}/{self.order}"


def decode(path: str, model, tokenizer, prompts: list[list[int]], *, max_new_tokens: int, batch_size: int,
           order: str) -> list[str]:
    """The texts of one decoding path over ``prompts`` (``as_given``: one call per consecutive batch)."""
    from peftlab.tasks import generation
    from peftlab.tasks.math_answers import answer_is_final

    chunks = [prompts] if order == "by_length" else [prompts[i:i + batch_size]
                                                     for i in range(0, len(prompts), batch_size)]
    texts: list[str] = []
    for chunk in chunks:
        if path == "peftlab_loop":
            texts += greedy_loop(model, tokenizer, chunk, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                 stop_when=answer_is_final)
        else:
            texts += generation.generate_greedy(model, tokenizer, chunk, max_new_tokens=max_new_tokens,
                                                batch_size=batch_size,
                                                stop_when=answer_is_final if path == "generate_stop" else None)
    return texts


def cache_argument(model) -> str:
    """The forward argument that takes the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_loop(model, tokenizer, prompts: Sequence[list[int]], *, max_new_tokens: int, batch_size: int,
                device=None, stop_when: Callable[[str], bool] | None = None) -> list[str]:
    """Greedy completions of token-id prompts, decoded without special tokens: the hand-written loop GSM8K
    evaluation ran before :func:`peftlab.tasks.generation.generate_greedy`, kept here to time against it.

    Batches of similar prompt lengths, left-padded, with the KV cache. A sequence ends at EOS / end of turn
    (:func:`peftlab.tasks.generation.stop_token_ids`), after ``max_new_tokens`` tokens, or when
    ``stop_when(text so far)`` turns true (checked at each newline). Finished sequences leave the batch (their rows are dropped from the cache), so
    one long generation does not keep the other 63 computing padding: the cost is the sum of the generated
    lengths, not batches x the longest. Token for token this is ``model.generate(do_sample=False)``.
    """
    from transformers import DynamicCache

    from peftlab.tasks import generation

    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = set(generation.stop_token_ids(tokenizer))  # looked up at call time: evaluation's stop tokens
    cache_arg = cache_argument(model)
    ends_line: dict[int, bool] = {}  # token id -> its text holds a newline (decoded once per id, not per step)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths share a batch
    generated: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids, mask = generation.left_padded([prompts[i] for i in chunk], pad)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        alive = list(chunk)  # prompt index of each row still generating
        cache = DynamicCache(config=getattr(model, "config", None))
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_arg: cache},
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        next_position = positions[:, -1] + 1
        for step in range(int(max_new_tokens)):
            tokens = logits.argmax(-1)
            keep = []
            for row, token in enumerate(tokens.tolist()):
                index = alive[row]
                if token in stops:
                    continue
                generated[index].append(token)
                if token not in ends_line:
                    ends_line[token] = "\n" in tokenizer.decode([token])
                if stop_when is not None and ends_line[token] and stop_when(
                        tokenizer.decode(generated[index], skip_special_tokens=True)):
                    continue
                keep.append(row)
            if not keep or step == int(max_new_tokens) - 1:
                break
            if len(keep) < len(alive):
                rows = torch.as_tensor(keep, device=device)
                cache.batch_select_indices(rows)
                mask, tokens, next_position = mask[rows], tokens[rows], next_position[rows]
                alive = [alive[row] for row in keep]
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           **{cache_arg: cache}, use_cache=True).logits[:, -1]
            next_position = next_position + 1
    return [tokenizer.decode(generated[i], skip_special_tokens=True).strip() for i in range(len(prompts))]


def _autocast(precision: str):
    if precision == "bf16":
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def gsm8k_prompts(tokenizer, problems: int, data_dir=None, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """Token-id prompts and gold answers of the first ``problems`` GSM8K test problems after the seeded shuffle
    that ``--max-eval-samples`` draws (``--eval-seed`` 0)."""
    from peftlab.tasks import data_files as data
    from peftlab.tasks.instruction_data import load_raw
    from peftlab.tasks.instructions import encode_prompt
    from peftlab.tasks.table import task

    raw = data.subset(load_raw(task("gsm8k"), "test", data_dir), problems, seed)
    return [encode_prompt(tokenizer, q) for q in raw["instruction"]], list(raw["gold"])


def run_decode(args) -> dict[str, Any]:
    from peftlab.models.registry import load_model

    say = progress(args.quiet)
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    model, tokenizer = load_model(args.model, head="causal-lm", seed=args.seed)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts, golds = gsm8k_prompts(tokenizer, args.problems, args.data_dir)
    configs = [DecodeConfig(p, prec, o) for prec in precisions for o in ORDERS for p in PATHS]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"decode-{slug(args.model)}-b{args.batch_size}"
    settings = {"model": args.model, "problems": len(prompts), "batch_size": args.batch_size,
                "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "precisions": list(precisions),
                "prompt_tokens": sum(len(p) for p in prompts), "threads": torch.get_num_threads()}

    def call(config: DecodeConfig):
        def fn():
            with torch.no_grad(), _autocast(config.precision):
                return decode(config.path, model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              batch_size=args.batch_size, order=config.order)
        return fn

    for config in configs:  # the untimed round: warms every path up and records what it generates
        say(f"decode: {config.label} (untimed round)")
        try:
            config.texts = call(config)()
        except Exception as err:  # one broken path must not hide the others' numbers
            config.error = f"{type(err).__name__}: {first_line(err)}"
            say(f"{config.label}: {config.error}")
    round_robin(configs, call, "seconds", args.repeats, 0, Clock(torch.device("cpu")), 1, say)
    rows = [decode_row(c, {c.label: c for c in configs}, precisions[0], tokenizer, golds) for c in configs]
    env = environment(torch.device("cpu"))
    env["loadavg_end"] = loadavg()
    result = {"kind": "decode", "environment": env, "settings": settings, "paths": PATH_TEXT, "rows": rows}
    return write_result(result, out_dir, name, markdown_decode)


def decode_row(c: DecodeConfig, by_label: dict, reference_precision: str, tokenizer, golds: list) -> dict[str, Any]:
    """One configuration's line: new tokens/s, identical texts and answers, accuracy, paired time ratios."""
    from peftlab.tasks.math_answers import answers_match, extract_answer

    row: dict[str, Any] = {"label": c.label, "path": c.path, "precision": c.precision, "order": c.order,
                           "error": c.error, "seconds": summarize(c.seconds)}
    if c.texts is None:
        return row
    problems = len(golds)
    new_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in c.texts)
    median = row["seconds"]["median"]
    loop = by_label[f"peftlab_loop/{c.precision}/{c.order}"]
    reference = by_label.get(f"peftlab_loop/{reference_precision}/by_length")
    answers = [extract_answer(t) for t in c.texts]
    row.update(
        new_tokens=new_tokens, tokens_per_s=new_tokens / median if median else None,
        seconds_per_problem=median / problems if median else None,
        same_texts_as_loop=(sum(a == b for a, b in zip(c.texts, loop.texts)) / problems if loop.texts else None),
        same_answers_as_reference=(sum(a == extract_answer(b) for a, b in zip(answers, reference.texts)) / problems
                                   if reference and reference.texts else None),
        accuracy=sum(answers_match(a, g) for a, g in zip(answers, golds)) / problems, texts=c.texts)
    # paired per round: this config's time / generate_stop's (< 1: faster than model.generate)
    row["time_vs_generate_stop"] = paired_ratio(c.seconds, by_label[f"generate_stop/{c.precision}/{c.order}"].seconds)
    row["time_vs_generate_plain"] = paired_ratio(c.seconds, by_label[f"generate_plain/{c.precision}/{c.order}"].seconds)
    return row


def rerender(result: dict) -> str:
    return markdown_decode(result)


def make_parser():
    made = parser(__doc__, __file__)
    made.add_argument("--model", default="smollm2-135m", help="registered decoder or path")
    made.add_argument("--problems", type=positive_int, default=32, help="GSM8K test problems")
    made.add_argument("--batch-size", type=positive_int, default=16, help="prompts per batch")
    made.add_argument("--max-new-tokens", type=positive_int, default=256,
                      help="generation limit (as peftlab's GSM8K evaluation)")
    made.add_argument("--repeats", type=positive_int, default=2, help="timed rounds")
    made.add_argument("--precision", choices=("both", "fp32", "bf16"), default="both",
                      help="fp32, bf16 autocast, or both")
    made.add_argument("--seed", type=nonnegative_int, default=0, help="seed of a random-config model")
    made.add_argument("--data-dir", default=None, help="data root holding gsm8k/ (default as in peftlab train)")
    return made


def cli_main(argv: list[str] | None = None) -> int:
    return main(make_parser(), run_decode, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
