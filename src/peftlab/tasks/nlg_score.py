"""``peftlab nlg-score``: any system's E2E-style outputs scored as the official E2E NLG Challenge script scores them.

Reads the script's formats as it reads them: ``--refs``, one reference per line with a blank line between
instances (no blank line at all: one reference per instance), or an E2E ``.csv`` (consecutive rows with the same
MR are one instance, with the script's repairs of mis-encoded ``£`` and ``é``); ``--hyps``, one output per line
(a blank line is an empty output). Prints the script's five numbers in its format (``--json``: full precision,
how each was computed, what is missing).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.extras import require
from peftlab.io_utils import read_text_utf8
from peftlab.tasks.nlg_metrics import METRICS, OFFICIAL, OFFICIAL_NAMES, NlgScores, corpus_scores, java_runtime

FORMAT_FIX = ("references: one per line, a blank line between instances; outputs: one per line, in the "
              "instances' order")
# measure_scores.py's repairs of its CSV input (mis-decoded UTF-8 of the E2E files), in its order.
CSV_REPAIRS = (("Ł", "£"), ("Â£", "£"), ("Ã©", "é"), ("ã©", "é"))


@dataclass(frozen=True)
class ScoredFiles:
    references: list[list[str]]
    outputs: list[str]
    scores: NlgScores


def _lines(path: Path, what: str) -> list[str]:
    """The stripped lines of a UTF-8 text file (line breaks as Python's splitlines, as the script's reader)."""
    if not path.exists():
        raise PeftlabError(f"{what} file not found", where=str(path), fix=f"pass an existing file ({FORMAT_FIX})")
    if path.is_dir():
        raise PeftlabError(f"{what} path is a folder, not a file", where=str(path), fix=FORMAT_FIX)
    text = read_text_utf8(path, what=f"{what} file")
    lines = [line.strip() for line in text.splitlines()]
    if not lines:
        raise PeftlabError(f"{what} file is empty", where=str(path), fix=FORMAT_FIX)
    return lines


def read_references(path) -> list[list[str]]:
    """Each instance's references (see the module docstring)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        return _csv_references(path)
    lines = _lines(path, "references")
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise PeftlabError("references file holds only blank lines", where=str(path), fix=FORMAT_FIX)
    if all(lines):  # no separator at all: one reference per instance, as the script reads it
        return [[line] for line in lines]
    groups: list[list[str]] = [[]]
    for number, line in enumerate(lines, start=1):
        if line:
            groups[-1].append(line)
            continue
        if not groups[-1]:
            raise PeftlabError(f"instance {len(groups)} has no reference (a blank line at its start or two in a row)",
                               where=f"{path}:{number}", fix="separate instances by exactly one blank line")
        groups.append([])
    return groups


def _csv_references(path: Path) -> list[list[str]]:
    from peftlab.tasks.e2e import read_e2e_csv

    rows = read_e2e_csv(path)
    repaired = []
    for mr, ref in rows:
        for bad, good in CSV_REPAIRS:
            ref = ref.replace(bad, good)
        repaired.append((mr, ref))
    return [[ref for _, ref in group] for _, group in itertools.groupby(repaired, key=lambda row: row[0])]


def read_outputs(path) -> list[str]:
    """One output per line; a blank line is an empty output."""
    return _lines(Path(path), "outputs")


def score_files(refs_path, hyps_path) -> ScoredFiles:
    references, outputs = read_references(refs_path), read_outputs(hyps_path)
    if len(references) != len(outputs):
        raise PeftlabError(f"{len(outputs)} outputs but {len(references)} instances of references",
                           where=f"{hyps_path} vs {refs_path}",
                           fix=f"{FORMAT_FIX} (a references file without blank lines holds one reference per "
                               "instance; a blank line among the outputs is an empty output)")
    return ScoredFiles(references, outputs, corpus_scores(outputs, references))


def as_text(scored: ScoredFiles) -> str:
    scores = scored.scores
    lines = [f"{len(scored.outputs)} outputs, {sum(map(len, scored.references))} references; scored as {OFFICIAL}",
             "SCORES:", "=============="]
    for name in METRICS:
        value = scores.metrics.get(name)
        shown = f"{value:.4f}" if value is not None else f"not computed ({scores.unavailable.get(name, 'unknown')})"
        lines.append(f"{OFFICIAL_NAMES[name]}: {shown}")
    lines += [f"note: {note}" for note in scores.notes]
    return "\n".join(lines)


def as_json(scored: ScoredFiles, refs_path, hyps_path) -> dict:
    scores, java = scored.scores, java_runtime()
    return {"metrics": scores.metrics, "unavailable": scores.unavailable, "notes": list(scores.notes),
            "implementations": scores.implementations, "official": OFFICIAL,
            "java": java.version if java.available else None,
            "outputs": len(scored.outputs), "references": sum(map(len, scored.references)),
            "refs_file": str(refs_path), "hyps_file": str(hyps_path)}


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "nlg-score", help="score outputs against references as the official E2E NLG script does (BLEU ... CIDEr)",
        description="BLEU, NIST, METEOR, ROUGE-L and CIDEr of one output per line against its references, equal to "
                    "the E2E NLG Challenge script's (tuetschek/e2e-metrics measure_scores.py -p). METEOR and the "
                    "PTB tokenizer need Java; without it METEOR is left out and ROUGE-L/CIDEr approximate. Needs the "
                    "'nlg' extra.")
    parser.add_argument("--refs", required=True, type=Path,
                        help="references: one per line, a blank line between instances (or an E2E .csv, mr,ref)")
    parser.add_argument("--hyps", required=True, type=Path, help="outputs: one per line, in the instances' order")
    parser.add_argument("--json", action="store_true", help="print one JSON object (full precision) instead")
    parser.set_defaults(func=run)


def run(args) -> int:
    require("peftlab nlg-score")  # the 'nlg' extra, before any file is read
    scored = score_files(args.refs, args.hyps)
    print(json.dumps(as_json(scored, args.refs, args.hyps), indent=2) if args.json else as_text(scored))
    return 0
