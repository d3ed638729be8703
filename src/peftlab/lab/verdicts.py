"""The sentences of a study's REPORT.md, written from verdicts.json's data alone.

A study stores each comparison in verdicts.json as numbers (difference, CI, pairs, p and Holm p, TOST, power,
labels); the functions here are pure: they take that data as ``json.load`` gives it back and write the sentence, so
a sentence cannot say what its numbers do not.
"""

from __future__ import annotations

import math

MINUS = "−"  # a typographic minus: "−9.92", as the report's "a − b"
ALPHA = 0.05  # the studies' level: a p-value is never rounded across it
POWER = "80 % power"


# --------------------------------------------------------------------------- numbers


def signed(value: float, digits: int = 2) -> str:
    return f"{value:+.{digits}f}".replace("-", MINUS)


def p_text(p: float | None) -> str:
    """``p < 0.001``, ``p = 0.043`` (two significant digits below 0.1, more where rounding would cross 0.05: a
    Holm p of 0.0496 reads 0.0496, not 0.05), ``p = 0.44``, ``p n/a``."""
    if p is None or not math.isfinite(p):
        return "p n/a"
    if p < 0.001:
        return "p < 0.001"
    text = f"{p:.2f}" if p >= 0.1 else f"{p:.2g}"
    for digits in (3, 4, 6):
        if (float(text) < ALPHA) == (p < ALPHA):
            return f"p = {text}"
        text = f"{p:.{digits}g}"
    return f"p = {text if (float(text) < ALPHA) == (p < ALPHA) else repr(p)}"


def direction(data: dict | None) -> str:
    """better | worse | no-difference: a − b after Holm (higher is better: a study refuses other metrics)."""
    if not data or not data.get("significant"):
        return "no-difference"
    return "better" if data["diff"] > 0 else "worse"


def testable(data: dict | None) -> bool:
    """A comparison with a difference to judge (at least two seeds with a value on both sides)."""
    return bool(data) and data.get("diff") is not None


def outcome(data: dict) -> str:
    return {"better": "significantly better", "worse": "significantly worse",
            "no-difference": "no significant difference"}[direction(data)]


# --------------------------------------------------------------------------- one comparison


def comparison_text(data: dict) -> str:
    """``−9.92 [95 % CI −14.33, −5.51] on 10 pairs, paired t p = 0.0022, Holm p = 0.011: significantly worse``,
    then power (where nothing was found), equivalence (where the design has a margin) and the labelled runs."""
    if data.get("same_runs"):
        return f"the same runs: {data['a']}'s chosen rate and settings are {data['b']}'s, so nothing to compare"
    if data.get("diff") is None:
        n = data.get("n_pairs") or 0
        return f"not testable: {n} seed{'s' if n != 1 else ''} with a value on both sides (2 needed)"
    low, high = data["ci"]
    text = (f"{signed(data['diff'])} [95 % CI {signed(low)}, {signed(high)}] on {data['n_pairs']} pairs, "
            f"paired t {p_text(data.get('p'))}, Holm {p_text(data.get('p_holm'))}: {outcome(data)}")
    if not data.get("significant") and data.get("detectable_80") is not None:
        text += f"; {POWER} to detect |Δ| ≥ {data['detectable_80']:.2f}"
    margin = data.get("margin")
    if margin is not None and data.get("tost_p_holm") is not None:
        tost = f"TOST Holm {p_text(data['tost_p_holm'])}"
        text += (f"; equivalent within ±{margin:g} ({tost})" if data.get("equivalent")
                 else f"; not shown equivalent within ±{margin:g} ({tost})")
    labels = labels_text(data)
    return text + (f"; labelled runs, paired at their value: {labels}" if labels else "")


def labels_text(data: dict) -> str:
    """``head 7 no_learning; lora 1 diverged (1 no value)``: each arm's labelled runs, empty when there are none."""
    parts = []
    for side in ("a", "b"):
        if counts := label_counts((data.get("labels") or {}).get(side) or {},
                                  (data.get("no_value") or {}).get(side) or {}):
            parts.append(f"{data.get(side, side)} {counts}")
    return "; ".join(parts)


def label_counts(labels: dict[str, int], no_value: dict[str, int]) -> str:
    """``2 no_learning, 1 diverged (1 no value)``: labelled runs by label, those without a value said so."""
    return ", ".join(f"{n} {label}" + (f" ({no_value[label]} no value)" if no_value.get(label) else "")
                     for label, n in sorted(labels.items()) if n)


def comparison_lines(data: dict) -> list[str]:
    """The comparison as a list item (``name: text``)."""
    return [f"- {data['name']}: {comparison_text(data)}"]


def family_heading(family: dict[str, dict], intro: str) -> str:
    """``Comparisons (paired by seed; Holm over ...):``, naming what Holm was applied over (the section's family)
    and the families of their own: the equivalence tests, the comparisons without labelled runs (where any)."""
    present = [d for d in family.values() if d]
    over = (present[0] if present else {}).get("family") or f"these {len(family)} comparisons"
    apart = []
    if any(d.get("tost_p_holm") is not None for d in present):
        apart.append("the equivalence tests")
    if any(d.get("without_labels") for d in present):
        apart.append("the comparisons without labelled runs")
    text = f"{intro} (paired by seed; Holm over {over}"
    if apart:
        text += f"; {' and '.join(apart)} {'each ' if len(apart) > 1 else ''}form a family of their own"
    return text + "):"


# --------------------------------------------------------------------------- verdicts


def lambda_verdict(comparisons: dict[str, dict]) -> str:
    """Which of "a larger eta_V" (the ratio) and "a larger learning rate" the held-out comparisons support."""
    if not any(testable(comparisons.get(k)) for k in ("off_vs_diag", "off_vs_same_eta_qk", "off_vs_same_eta_v")):
        return "Verdict: not testable yet (no comparison has two seeds with a value on both sides)."
    best = direction(comparisons.get("off_vs_diag"))
    at_qk, at_v = direction(comparisons.get("off_vs_same_eta_qk")), direction(comparisons.get("off_vs_same_eta_v"))
    if best == "better":
        claim = ("**the ratio**: lambda > 1 beats the best lambda-1 rate on held-out seeds, so a larger eta_V at "
                 "fixed eta_QK is not just a larger learning rate")
        if at_v == "better":
            claim += ", and it beats lambda 1 at the same eta_V too"
    elif best == "worse":
        claim = "**a larger learning rate**: the best lambda-1 rate beats the best lambda > 1 cell on held-out seeds"
    elif at_qk == "better":
        claim = ("**a larger learning rate**: lambda > 1 beats lambda 1 at the same eta_QK, but not the best "
                 "lambda-1 rate; what the ratio gives, a larger shared rate gives too")
    else:
        claim = ("**neither**: on held-out seeds lambda > 1 differs neither from lambda 1 at its eta_QK nor from "
                 "the best lambda-1 rate")
    return f"Verdict: {claim}."


def key_verdict(data: dict | None) -> str:
    """Does freezing W_k lose anything: equivalence (TOST) is the only way to say it does not."""
    margin = (data or {}).get("margin")
    if not testable(data):
        return "not testable yet (fewer than two seeds with a value on both sides)"
    if data.get("equivalent"):
        return f"freezing W_k loses nothing beyond ±{margin:g} points (TOST)"
    if direction(data) != "no-difference":
        return f"freezing W_k {'gains' if data['diff'] > 0 else 'loses'} significantly"
    return (f"no significant difference, but equivalence within ±{margin:g} is not shown either: absence of "
            "evidence, not evidence of absence")


def key_lines(data: dict) -> list[str]:
    return [f"{data['name']}: {comparison_text(data)}. Verdict: {key_verdict(data)}."]


def kasa_verdict(comparisons: dict[str, dict]) -> str:
    """Where KaSA (the family's comparisons whose first arm is KaSA) is significantly better or worse."""
    kasa = {k: d for k, d in comparisons.items() if k.startswith("kasa")}
    untested = sum(not testable(d) for d in kasa.values())
    if kasa and untested == len(kasa):
        return "Verdict: not testable yet (no KaSA comparison has two seeds with a value on both sides)."
    better = [k for k, d in kasa.items() if direction(d) == "better"]
    worse = [k for k, d in kasa.items() if direction(d) == "worse"]
    text = ("KaSA is significantly better in: " + ", ".join(better) if better
            else "KaSA is significantly better in none of its comparisons")
    if untested:
        text += f" ({untested} of {len(kasa)} not testable yet)"
    return "Verdict: " + text + ("; significantly worse in: " + ", ".join(worse) if worse else "") + "."
