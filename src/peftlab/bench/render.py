"""Markdown tables of bench results (also re-rendered from their JSON: ``peftlab bench --render``)."""

from __future__ import annotations

KASA_PEFT = "kasa-peft"  # the --compare-kasa-peft row (peftlab.bench.micro): its table gets a note


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
        "infer × base | merged ms | merged × base |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if row["error"]:
            lines.append(f"| {row['label']} | error: {row['error'][:80]} |" + " - |" * 11)
            continue
        ratios = row["ratios"]
        trainable = (row["trainable_params"] or {}).get("total")
        eps = row["examples_per_s"]
        lines.append(
            f"| {row['label']} | {'-' if trainable is None else f'{trainable:,}'} | {_s(row['init_s'])} | {_ms(row['train_step_s'])} | "
            f"{'-' if eps is None else f'{eps:.1f}'} | {_x(ratios['train_vs_lora'])} | {_x(ratios['train_vs_base'])} | "
            f"{_mb((row['memory'] or {}).get('peak_mb'))} | {_ms(row['infer_unmerged_s'])} | "
            f"{_x(ratios['infer_unmerged_vs_base'])} | {_ms(row['infer_merged_s'])} | "
            f"{_x(ratios['infer_merged_vs_base'])} |")
    lines += ["", f"Memory: {result['memory_method']}."]
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
