"""Every committed store still reports the same tables: ``peftlab report`` on each store under docs/ (with the
options the docs quote it with) must print exactly what tests/golden/report/ holds, written by the code that
produced the published numbers. A refactor that moves one digit of one cell fails here.

After a deliberate change to the report, rewrite the goldens and review their diff:
``PEFTLAB_WRITE_GOLDEN=1 pytest tests/test_report_golden.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from peftlab.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "report"
LAMBDA, RESULTS, KASA = "docs/study/lambda/results.sqlite", "docs/study/results.sqlite", "docs/study/kasa/results.sqlite"
HELDOUT = ("--seeds", "100-109")

# name -> the report's arguments (paths relative to the repository root). Where the docs quote a command on a store,
# it is here as quoted; every committed store has at least one case.
CASES: dict[str, tuple[str, ...]] = {
    # README.md and docs/RESULTS.md: the lambda study's held-out tables, STS-B with power, SST-2, LaTeX
    "lambda_stsb_power.md": (LAMBDA, "--where", "task=stsb,epochs=2", *HELDOUT,
                             "--baseline", "lr=0.001,lr_ratio=1,targets=q,v", "--power"),
    "lambda_sst2.md": (LAMBDA, "--where", "task=sst2,epochs=2", *HELDOUT,
                       "--baseline", "lr=0.008,lr_ratio=1,targets=q,v"),
    "lambda_stsb.tex": (LAMBDA, "--where", "task=stsb,epochs=2", *HELDOUT,
                        "--baseline", "lr=0.001,lr_ratio=1,targets=q,v", "--format", "latex"),
    "lambda_all.md": (LAMBDA,),
    # the KaSA study's store: its held-out rows against LoRA (labelled runs, the sensitivity without them), CSV
    "kasa_heldout.md": (KASA, "--where", "epochs=2", *HELDOUT, "--baseline", "method=lora"),
    "kasa_heldout.csv": (KASA, "--where", "epochs=2", *HELDOUT, "--baseline", "method=lora", "--format", "csv"),
    "kasa_all.md": (KASA, "--which", "final", "--params", "yao"),
    # the fair KaSA study on STS-B, finished: every held-out arm (docs/study/kasa-fair/REPORT.md holds its comparisons)
    "kasa_fair_stsb_heldout.md": ("docs/study/kasa-fair/results.sqlite", *HELDOUT),
    # the fair KaSA study on SST-2, finished: every held-out arm (docs/study/kasa-fair-sst2/REPORT.md)
    "kasa_fair_sst2_heldout.md": ("docs/study/kasa-fair-sst2/results.sqlite", *HELDOUT),
    # the fair lambda study on STS-B, finished: every held-out arm, the W_k ablation's seeds 110-119 included
    "lambda_fair_stsb_heldout.md": ("docs/study/lambda-fair/results.sqlite", "--seeds", "100-119"),
    # the MRPC pilot of the fair KaSA study, stopped: every finished search run no_learning (docs/RESULTS.md)
    "kasa_fair_mrpc_pilot.md": ("docs/study/kasa-fair-mrpc/results.sqlite",),
    # docs/RESULTS.md: the pilot, read with paired tests and power
    "pilot_power.md": (RESULTS, "--baseline", "method=lora,targets=q,k,v,lr_ratio=1",
                       "--where", "method=lora,lr_ratio=1,epochs=2", "--power", "--power-diff", "1.0",
                       "--allow-mixed-code"),
    "pilot_full.md": (RESULTS, "--baseline", "method=full,lr_ratio=1", "--where", "method=full",
                      "--allow-mixed-code"),
    "pilot_kasa.md": (RESULTS, "--baseline", "method=kasa", "--where", "lr_ratio=1,targets=q,v,lr=0.002",
                      "--allow-mixed-code"),
    "pilot_kasa_holm_bootstrap.csv": (RESULTS, "--baseline", "method=kasa", "--where",
                                      "lr_ratio=1,targets=q,v,lr=0.002", "--allow-mixed-code", "--correction",
                                      "holm", "--ci", "bootstrap", "--equivalence-margin", "1", "--format", "csv"),
    # docs/RESULTS.md: the bf16 measurement (quoted on its sweep folder; its store is committed here)
    "bf16_cpu.md": ("docs/study/bf16_cpu.sqlite", "--baseline", "mixed_precision=no,model=mpnet-base",
                    "--test", "student"),
    "bf16_cpu.csv": ("docs/study/bf16_cpu.sqlite", "--baseline", "mixed_precision=no,model=mpnet-base",
                     "--test", "student", "--format", "csv"),
    # the grid and the tunes that scripts/tune_vs_grid.py compares
    "lambda_grid.md": ("docs/study/lambda_grid.sqlite", "--allow-mixed-code"),
    "tune_qqp.md": ("docs/study/tune_qqp.sqlite",),
    "tune_sst2.md": ("docs/study/tune_sst2.sqlite",),
    "tune_stsb.md": ("docs/study/tune_stsb.sqlite",),
    # docs/probe/heldout/: run folders of peftlab train (the probe's held-out runs)
    "probe_heldout_sst2.md": ("docs/probe/heldout/", "--where", "task=sst2", "--allow-mixed-code"),
    "probe_heldout_stsb.md": ("docs/probe/heldout/", "--where", "task=stsb", "--allow-mixed-code"),
}


def report_output(args: tuple[str, ...], capsys) -> str:
    """What ``peftlab report ARGS`` prints (run from the repository root, so paths print as the docs show them)."""
    if args[0] == "docs/probe/heldout/":  # the shell's glob of `peftlab report docs/probe/heldout/*/`
        args = tuple(sorted(str(p.relative_to(ROOT)) + "/" for p in (ROOT / args[0]).iterdir())) + args[1:]
    capsys.readouterr()
    assert main(["report", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def first_difference(got: str, want: str) -> str:
    for number, (a, b) in enumerate(zip(got.splitlines(), want.splitlines()), start=1):
        if a != b:
            return f"line {number}:\n  now:    {a}\n  golden: {b}"
    return f"the outputs differ in length ({len(got.splitlines())} lines now, {len(want.splitlines())} golden)"


def test_every_committed_store_has_a_case():
    stores = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.sqlite")}
    covered = {args[0] for args in CASES.values()}
    assert stores - covered == set()


@pytest.mark.parametrize("name", sorted(CASES))
def test_report_equals_golden(name, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    got = report_output(CASES[name], capsys)
    golden = GOLDEN / name
    if os.environ.get("PEFTLAB_WRITE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
    assert golden.is_file(), f"no golden {golden}: write it with PEFTLAB_WRITE_GOLDEN=1"
    want = golden.read_text()
    assert got == want, f"peftlab report {' '.join(CASES[name])} changed, {first_difference(got, want)}"
