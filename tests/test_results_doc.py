"""docs/RESULTS.md cannot drift from a study's numbers: a block between ``<!-- from PATH -->`` and ``<!-- end -->``
must be PATH's content verbatim (a study's SECTION.md, written with its REPORT.md from verdicts.json)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"<!-- from (\S+) -->\n(.*?)<!-- end -->", re.S)


def embedded_blocks(text: str) -> list[tuple[str, str]]:
    return BLOCK.findall(text)


def stale_blocks(doc: Path, root: Path) -> list[str]:
    """The PATHs whose block in ``doc`` differs from the file (or whose file is missing)."""
    stale = []
    for path, body in embedded_blocks(doc.read_text()):
        source = root / path
        if not source.is_file() or source.read_text() != body:
            stale.append(path)
    return stale


def test_results_blocks_equal_the_study_sections_they_name():
    assert stale_blocks(ROOT / "docs" / "RESULTS.md", ROOT) == []


def test_a_block_that_drifts_from_its_section_is_caught(tmp_path):
    from peftlab.lab import study_protocol as sp
    from peftlab.lab.study import run_fair_study
    from peftlab.lab.study_fair_report import SECTION_FILE
    from peftlab.lab.study_plan import StudyPaths
    from test_study import BASE, FAKE

    rows = (sp.Row("lora", {"method": "lora"}, 2e-3), sp.Row("head", {"method": "head"}, 2e-3))
    design = sp.Design("kasa", ("rte",), dict(BASE), rows, sp.Protocol(selection_samples=8, max_extensions=0),
                       heldout_seeds=2, paper_arms=False)
    paths = StudyPaths(tmp_path / "s", tmp_path / "s" / "results.sqlite")
    run_fair_study(design, paths, workers=0, train_fn=FAKE, progress=False, say=lambda *a: None)
    section = (paths.root / SECTION_FILE).read_text()
    assert section.startswith("### rte") and "lora − head (what the adapter adds)" in section
    doc = tmp_path / "RESULTS.md"
    doc.write_text(f"# Results\n\n<!-- from s/{SECTION_FILE} -->\n{section}<!-- end -->\n")
    assert stale_blocks(doc, tmp_path) == []
    doc.write_text(doc.read_text().replace("lora − head", "lora - head"))
    assert stale_blocks(doc, tmp_path) == [f"s/{SECTION_FILE}"]


@pytest.mark.parametrize("text, found", [("<!-- from a/B.md -->\nx\n<!-- end -->", [("a/B.md", "x\n")]),
                                         ("no block", [])])
def test_blocks_are_found(text, found):
    assert embedded_blocks(text) == found
