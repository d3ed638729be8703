"""Helpers of the ``peftlab report`` tests (test_report.py, test_report_stats.py): Markdown tables compared by
their cells, not by tabulate's column padding."""

from __future__ import annotations

import re

from peftlab.lab.tables import render_markdown


def markdown(table, digits: int = 1) -> str:
    """render_markdown with tabulate's column padding squeezed out of the table lines (``| a | b |``,
    ``|---|---|``): the tests check cell contents, not how wide the aligned columns are."""
    return squash(render_markdown(table, digits))


def squash(text: str) -> str:
    out = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            if cells and all(cell and set(cell) <= {"-", ":"} for cell in cells):
                line = "|" + "|".join("---" for _ in cells) + "|"
            else:
                line = "| " + " | ".join(cells) + " |"
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")
