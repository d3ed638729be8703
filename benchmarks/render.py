"""Markdown tables of bench results (also re-rendered from their JSON: ``python benchmarks/rerender.py``)."""

from __future__ import annotations

KASA_PEFT = "kasa-peft"  # the --compare-kasa-peft row (benchmarks.micro): its table gets a note


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _ms(summary: dict | None) -> str:
    if not summary or summary.get("median") is None:
        return "-"
    return f"{summary['median'] * 1e3:.1f} ± {summary['iqr'] * 1e3:.1f}"


def _s(summary: dict | None) -> str:
    if not summary or summary.get("median") is None:
        return "-"
    value = summary["median"]
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _x(ratio: dict | None) -> str:
    if not ratio or ratio.get("median") is None:
        return "-"
    return f"{ratio['median']:.3f} [{ratio['q25']:.3f}, {ratio['q75']:.3f}]"


def _mb(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _rounds_text(settings: dict) -> str:
    timed = settings.get("rounds_timed") or {}
    if timed and len(set(timed.values())) == 1:
        return f"{next(iter(timed.values()))} timed rounds"
    if timed:
        return "timed rounds " + ", ".join(f"{k} {v}" for k, v in timed.items())
    return f"{settings['repeats']} timed rounds"


def markdown_micro(result: dict) -> str:
    s, env = result["settings"], result["environment"]
    lines = [
        f"## {s['model']}: seq {s['seq_len']}, batch {s['batch_size']}, rank {s['rank']}, {s['precision']}, "
        f"{env['device']}" + (" (partial)" if result.get("partial") else ""),
        "",
        f"{env.get('gpu') or env['cpu_model']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"peft {env['peft']}; {env['torch_threads']} threads; load average at start "
        f"{', '.join(f'{x:.1f}' for x in env['loadavg_start'] or [])}"
        + (f", at end {', '.join(f'{x:.1f}' for x in env['loadavg_end'])}" if env.get("loadavg_end") else "") + ".",
        f"{_rounds_text(s)} after {s['warmup']} warm-up rounds ({s['inner']} step(s) per sample), "
        f"round-robin over configurations; times are median ± IQR, ratios are medians of per-round paired "
        f"ratios [q25, q75].",
        "",
        "| config | trainable | init s | train step ms | ex/s | × LoRA | × base | peak MB | infer ms | "
        "infer × base | merged ms | merged × base | model GFLOP/s | of GEMM peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if row["error"]:
            lines.append(f"| {row['label']} | error: {row['error'][:80]} |" + " - |" * 13)
            continue
        ratios = row["ratios"]
        trainable = (row["trainable_params"] or {}).get("total")
        eps = row["examples_per_s"]
        lines.append(
            f"| {row['label']} | {'-' if trainable is None else f'{trainable:,}'} | {_s(row['init_s'])} | {_ms(row['train_step_s'])} | "
            f"{'-' if eps is None else f'{eps:.1f}'} | {_x(ratios['train_vs_lora'])} | {_x(ratios['train_vs_base'])} | "
            f"{_mb((row['memory'] or {}).get('peak_mb'))} | {_ms(row['infer_unmerged_s'])} | "
            f"{_x(ratios['infer_unmerged_vs_base'])} | {_ms(row['infer_merged_s'])} | "
            f"{_x(ratios['infer_merged_vs_base'])} | {_utilisation(row.get('utilisation'))} |")
    lines += ["", f"Memory: {result['memory_method']}."]
    lines += _peak_lines(result)
    by_note: dict[str, list[str]] = {}
    for row in result["rows"]:
        for note in filter(None, (row.get("note") or "").split("; ")):
            by_note.setdefault(note, []).append(row["label"])
    notes = [f"{', '.join(labels)}: {note}" for note, labels in by_note.items()]
    if any(row["method"] == KASA_PEFT for row in result["rows"]):
        notes.append(f"{KASA_PEFT}: KaSA trained with peft's per-module `_get_kasa_loss` (+ a module walk), the "
                     "regulariser peftlab used before `peftlab.methods.kasa.regulariser` was batched")
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    lines.append("")
    return "\n".join(lines)


def _utilisation(value: dict | None) -> str:
    """The two MFU cells: model GFLOP/s of the median train step, and its share of the GEMM peak."""
    if not value or value.get("model_gflops") is None:
        return "- | -"
    share = value.get("of_peak")
    return f"{value['model_gflops']:.1f} | " + ("-" if share is None else f"{100 * share:.0f} %")


def _peak_lines(result: dict) -> list[str]:
    peak = result.get("gemm_peak")
    if not peak:
        return []
    sizes = ", ".join(f"{s['n']}: {s['gflops_best']:.1f}" for s in peak["sizes"])
    missing = sorted({row["model_flops_unavailable"] for row in result["rows"] if row.get("model_flops_unavailable")})
    # results written before FlopCounterMode counted the FLOPs carry no flops_method: theirs were counted by hand
    counted = result.get("flops_method") or ("counted from the architecture (projections, MLP, attention scores "
                                             "and values, the head, LoRA's A and B; backward without frozen weights' "
                                             "gradients)")
    return ["", f"Model FLOP/s: the train step's model FLOPs, {counted}, over its median time. "
                f"GEMM peak: {peak['peak_gflops']:.1f} GFLOP/s "
                f"({peak['dtype']}, {peak['threads']} thread(s); {peak['method']}; best GFLOP/s by n: {sizes})."
                + (f" Not counted: {'; '.join(missing)}." if missing else "")]


def _num(value, fmt=".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _per_seed(values) -> str:
    return f"[{', '.join(f'{v:.2f}' for v in values)}] " if values and len(values) > 1 else ""


def markdown_e2e(result: dict) -> str:
    s = result["settings"]
    subset = f"{s['max_train_samples']} training examples" if s["max_train_samples"] else "the full training set"
    evals = f"{s['max_eval_samples']} dev examples" if s["max_eval_samples"] else "the full dev set"
    lines = [
        f"## End to end: {s['model']}, {', '.join(s['methods'])} on {s['targets']} (rank {s['rank']}), "
        f"{s['epochs']} epoch(s), batch {s['batch_size']}, seeds {', '.join(map(str, s['seeds']))}",
        "",
        f"{subset}, {evals}. dynamic = {result['setups']['dynamic']}; pad_to_max = {result['setups']['pad_to_max']}. "
        "Train s/epoch: the optimizer steps (forward, extra loss, backward, clipping, AdamW) as `peftlab train` "
        "times them; wall s/epoch: the whole `train()` call (model load, tokenisation or its cache, batching, "
        "dev evaluation each epoch, checkpoints) divided by the epochs. Speed-up = pad_to_max / dynamic train "
        "s/epoch (median over seeds of the runs of one seed, which ran back to back); per seed in brackets; CPU "
        "speed-up: the same for the process CPU time of the whole run, which other jobs on a shared machine "
        "hardly move. Metrics: mean ± sd over seeds.",
        "",
        f"| task | method | metric | dynamic train s/epoch | pad-{s['max_length']} train s/epoch | speed-up | "
        f"dynamic wall s/epoch | pad-{s['max_length']} wall s/epoch | wall speed-up | CPU speed-up | dynamic metric | "
        f"pad-{s['max_length']} metric | token slots pad/dyn |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    metric_names = {r["task"]: r["primary_metric"] for r in result["runs"]}
    for row in result["summary"]:
        dyn, pad = row["dynamic"], row["pad_to_max"]
        padding = (result.get("padding") or {}).get(row["task"]) or {}

        def metric(d):
            if d["metric_mean"] is None:
                return "-"
            return f"{d['metric_mean']:.4f}" + (f" ± {d['metric_std']:.4f}" if d["metric_std"] is not None else "")

        lines.append(
            f"| {row['task']} | {row['method']} | {metric_names.get(row['task'], '')} | "
            f"{_num(dyn['train_seconds_per_epoch'], '.1f')} | {_num(pad['train_seconds_per_epoch'], '.1f')} | "
            f"{_num(row.get('speedup_train'), '.2f')}× {_per_seed(row.get('speedup_train_per_seed'))}| "
            f"{_num(dyn['wall_seconds_per_epoch'], '.1f')} | "
            f"{_num(pad['wall_seconds_per_epoch'], '.1f')} | {_num(row.get('speedup_wall'), '.2f')}× | "
            f"{_num(row.get('speedup_cpu'), '.2f')}{'×' if row.get('speedup_cpu') else ''} | "
            f"{metric(dyn)} | {metric(pad)} | "
            f"{_num(padding.get('slot_ratio'), '.2f')} |")
    lines += ["", "Runs:", "",
              "| task | method | seed | setup | status | train s | wall s | CPU s | metric |",
              "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['task']} | {r['method']} | {r['seed']} | {r['setup']} | {r['status']} | "
                     f"{_num(r['train_seconds'], '.1f')} | {_num(r['wall_seconds'], '.1f')} | "
                     f"{_num(r.get('cpu_seconds'), '.1f')} | {_num(r['final_metric'], '.4f')} |")
    lines.append("")
    return "\n".join(lines)


def _ratio(ratio: dict | None) -> str:
    if not ratio or ratio.get("geomean") is None:
        return "-"
    spread = f" [{ratio['min']:.2f}, {ratio['max']:.2f}]" if ratio["n"] > 1 else ""
    return f"{ratio['geomean']:.2f}×{spread}"


def _env_line(env: dict) -> str:
    return (f"{env.get('cpu_model')}, {env.get('cpus_usable')} usable CPUs; torch {env.get('torch')}, transformers "
            f"{env.get('transformers')}, peft {env.get('peft')}; load average at start "
            f"{', '.join(f'{x:.1f}' for x in env.get('loadavg_start') or [])}"
            + (f", at end {', '.join(f'{x:.1f}' for x in env['loadavg_end'])}" if env.get("loadavg_end") else "")
            + ".")


def markdown_against_trainer(result: dict) -> str:
    """An older against-trainer result (each setup alone, round-robin): one row per task and setup."""
    s = result["settings"]
    lines = [
        f"## peftlab vs transformers.Trainer: {s['model']}, LoRA q,v rank {s['rank']}, batch {s['batch_size']}, "
        f"T={s['max_length']}, {s['train_examples']} training examples, {s['epochs']} epoch(s), "
        f"{s['mixed_precision'] if s['mixed_precision'] != 'no' else 'fp32'}, {s['threads']} thread(s)",
        "",
        _env_line(result["environment"]),
        f"{s['repeats']} repeat(s) per setup (seeds {', '.join(map(str, s['seeds']))}), each run its own process, "
        "setups round-robin (order rotated each repeat). Optimizer: AdamW, q at "
        f"{s['lr']:g}, v at {s['lr_ratio']:g} × that, head {s['head_lr']:g}, linear schedule, warm-up "
        f"{s['warmup_ratio']:g}. Dev metric on {s['eval']}.",
        "",
        "Setups: " + "; ".join(f"**{k}** = {v}" for k, v in result["setups"].items()) + ".",
        "",
        "Train s/epoch: the epoch loops' wall time (batch loading and collation included; evaluation, checkpoints, "
        "saving not); ex/s from it; median over repeats. Peak RSS: the run's process (ru_maxrss). Process s: the "
        "whole subprocess (start, imports, load, tokenisation, training, evaluation). peftlab ÷ setup: geometric "
        "mean over repeats of the per-repeat ratio setup train s / peftlab train s (= peftlab ex/s ÷ setup ex/s) "
        "[min, max].",
        "",
        "| task | setup | runs | train s/epoch | ex/s | peak RSS MB | process s | real-token share | dev metric | "
        "peftlab ex/s ÷ this | peftlab process ÷ this |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for row in result["summary"]:
        for setup, d in row["setups"].items():
            metric = "-" if d["metric_mean"] is None else (
                f"{row['metric']} {d['metric_mean']:.4f}" + (f" ± {d['metric_std']:.4f}" if d["metric_std"] else ""))
            vs = row["peftlab_vs"].get(setup) or {}
            share = "-" if d["real_token_share"] is None else f"{100 * d['real_token_share']:.0f} %"
            lines.append(
                f"| {row['task']} | {setup} | {d['runs']} | {_num(d['train_s_per_epoch'], '.1f')} | "
                f"{_num(d['examples_per_s'], '.1f')} | {_mb(d['peak_rss_mb'])} | {_num(d['process_wall_s'], '.1f')} | "
                f"{share} | {metric} | {_ratio(vs.get('examples_per_s_ratio'))} | "
                f"{_ratio(vs.get('process_wall_ratio'))} |")
    lines += ["", "Runs:", "", "| task | repeat | seed | setup | status | train s | ex/s | peak RSS MB | process s | "
              "dev metrics |", "|---|---:|---:|---|---|---:|---:|---:|---:|---|"]
    for r in result["runs"]:
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in (r.get("dev_metrics") or {}).items()
                            if isinstance(v, (int, float))) or r.get("error", "-")
        lines.append(f"| {r['task']} | {r['repeat']} | {r['seed']} | {r['setup']} | {r['status']} | "
                     f"{_num(r.get('train_s'), '.1f')} | {_num(r.get('examples_per_s'), '.1f')} | "
                     f"{_mb(r.get('peak_rss_mb'))} | {_num(r.get('process_wall_s'), '.1f')} | {metrics} |")
    lines.append("")
    return "\n".join(lines)


def markdown_sweep_overhead(result: dict) -> str:
    """``benchmarks/sweep_overhead.py``: the sweep's wall time by phase."""
    s, b = result["settings"], result["breakdown"]
    share = "-" if b["overhead_share"] is None else f"{100 * b['overhead_share']:.1f} %"
    lines = [
        f"## Sweep overhead: {b['runs']} runs of {s['model']} on {s['task']} ({s['train_examples']} training "
        f"examples, {s['epochs']} epoch(s), LoRA q,v rank {s['rank']}), `peftlab sweep --workers {s['workers']}`",
        "",
        _env_line(result["environment"]),
        f"Command: `peftlab {result['command']}` (spec in a temporary folder; runs: lambda x seed). Phases from each "
        "run's result.json `timings`; outside the runs: the sweep's wall time minus the runs' own spans.",
        "",
        f"**Sweep wall time {b['wall_s']:.1f} s; training (sum of train_s) {b['train_s']:.1f} s; overhead share "
        f"1 - train/wall = {share}.**",
        "",
        "| phase | seconds | share of wall | per run s |",
        "|---|---:|---:|---:|",
    ]
    for p in b["phases"]:
        part = "-" if p["share"] is None else f"{100 * p['share']:.1f} %"
        lines.append(f"| {p['phase']} | {_num(p['seconds'], '.2f')} | {part} | {_num(p['per_run_s'], '.2f')} |")
    lines.append("")
    return "\n".join(lines)


def _share(value) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def markdown_decode(result: dict) -> str:
    """``benchmarks/decode.py``: one row per decoding path, precision and prompt order."""
    s = result["settings"]
    lines = [
        f"## GSM8K decoding: {s['model']}, {s['problems']} problems, batch {s['batch_size']}, up to "
        f"{s['max_new_tokens']} new tokens, {s['threads']} thread(s)",
        "",
        _env_line(result["environment"]),
        f"{s['repeats']} timed round(s) after one untimed round, round-robin over configurations; seconds for all "
        f"problems, median ± IQR; ratios: median of per-round paired time ratios [q25, q75] (< 1: faster). New "
        f"tokens: the generated texts re-tokenised. Paths: " + "; ".join(f"**{k}** = {v}" for k, v in
                                                                     result["paths"].items()) + ".",
        "",
        "| path | precision | prompts | s (all problems) | new tokens | new tokens/s | s/problem | time ÷ generate_stop | "
        "time ÷ generate_plain | texts = loop's | answers = fp32 loop's | accuracy |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if row.get("error"):
            lines.append(f"| {row['path']} | {row['precision']} | {row['order']} | error: {row['error'][:80]} |"
                         + " - |" * 8)
            continue
        lines.append(
            f"| {row['path']} | {row['precision']} | {row['order']} | {_s(row['seconds'])} | {row['new_tokens']} | "
            f"{_num(row.get('tokens_per_s'), '.1f')} | {_num(row.get('seconds_per_problem'), '.2f')} | "
            f"{_x(row.get('time_vs_generate_stop'))} | {_x(row.get('time_vs_generate_plain'))} | "
            f"{_share(row.get('same_texts_as_loop'))} | {_share(row.get('same_answers_as_reference'))} | "
            f"{_num(row.get('accuracy'), '.3f')} |")
    lines.append("")
    return "\n".join(lines)
