"""docs/ARCHITECTURE.md matches the code: every module it names exists, and every module is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "peftlab"
DOC = ROOT / "docs" / "ARCHITECTURE.md"


def _modules() -> set[str]:
    """Package-relative module files, e.g. ``methods/kasa.py`` and ``config.py`` (no __init__/__main__)."""
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts}


def _named_in_table() -> set[str]:
    """``x.py`` names in the sub-package table, qualified by their row's package."""
    named = set()
    for line in DOC.read_text().splitlines():
        row = re.match(r"\| `([\w/]+)/` \|", line)  # a package, or a sub-package of one (`lab/tune/`)
        package = row.group(1) + "/" if row else "" if line.startswith("| top level |") else None
        if package is None:
            continue
        named |= {package + name for name in re.findall(r"`(\w+\.py)`", line)}
    return named


def test_every_module_is_in_the_architecture_table_and_every_name_there_exists():
    modules, named = _modules(), _named_in_table()
    assert not modules - named, f"modules missing from docs/ARCHITECTURE.md: {sorted(modules - named)}"
    assert not named - modules, f"docs/ARCHITECTURE.md names modules that do not exist: {sorted(named - modules)}"


def test_the_architecture_doc_stays_short():
    assert len(DOC.read_text().splitlines()) < 150
