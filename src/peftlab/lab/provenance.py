"""Which code a table's runs ran (result.json ``code``, or an older run's ``git_commit``). ``peftlab report``
prints how many code versions and dirty runs a table mixes (:func:`code_line`) and refuses more than one unless
``--allow-mixed-code`` (:func:`require_one_code`): numbers computed by different code are not one experiment.
"""

from __future__ import annotations

from typing import Iterable

from peftlab.errors import PeftlabError
from peftlab.lab.table_model import CodeSummary

UNKNOWN = "unknown"
DIRTY_SUFFIX = "+dirty"
SHOWN_GROUPS = 4  # the line and the error name this many groups, then "n more"


def run_code(result: dict) -> tuple[str, bool, str | None]:
    """The code a run recorded (``code`` first, else the older ``git_commit`` string): its group (the commit,
    else ``source <digest>``, else unknown), whether its tree was dirty, and its source digest."""
    code = result.get("code")
    if isinstance(code, dict) and (code.get("commit") or code.get("source_digest")):
        digest = code.get("source_digest") or None
        group = code.get("commit") or f"source {digest[:12]}"
        return group, code.get("dirty") is True, digest
    legacy = result.get("git_commit")
    if isinstance(legacy, str) and legacy:
        return legacy.removesuffix(DIRTY_SUFFIX) or UNKNOWN, legacy.endswith(DIRTY_SUFFIX), None
    return UNKNOWN, False, None


def summarize(results: Iterable[dict | None]) -> CodeSummary:
    """The code of the runs that contribute to a table (rows without a result.json tell nothing)."""
    summary = CodeSummary()
    digests = set()
    for result in filter(None, results):
        group, dirty, digest = run_code(result)
        summary.runs += 1
        summary.groups[group] += 1
        summary.dirty += dirty
        digests.add(digest)
    summary.digests = len(digests - {None})
    return summary


def _short(group: str) -> str:
    return group[:7] if group != UNKNOWN and not group.startswith("source ") else group


def _group_list(summary: CodeSummary) -> str:
    shown = [f"{_short(g)} ×{n}" for g, n in summary.groups.most_common(SHOWN_GROUPS)]
    more = len(summary.groups) - SHOWN_GROUPS
    return ", ".join(shown) + (f", {more} more" if more > 0 else "")


def code_line(summary: CodeSummary) -> str:
    """The footnote line: ``code: 1 commit (2eae817), no dirty runs``; or how many commits it mixes."""
    if not summary.runs or set(summary.groups) == {UNKNOWN}:
        return (f"code: not recorded by {'any of the ' + str(summary.runs) if summary.runs > 1 else 'the'} "
                f"run{'s' if summary.runs != 1 else ''} (result.json has no \"code\" or \"git_commit\")")
    commits = [g for g in summary.groups if g != UNKNOWN and not g.startswith("source ")]
    sources = [g for g in summary.groups if g.startswith("source ")]
    parts = []
    if commits:
        parts.append(f"{len(commits)} commit{'s' if len(commits) != 1 else ''}")
    if sources:
        parts.append(f"{len(sources)} source digest{'s' if len(sources) != 1 else ''} without a commit")
    if UNKNOWN in summary.groups:
        parts.append(f"{summary.groups[UNKNOWN]} run{'s' if summary.groups[UNKNOWN] != 1 else ''} recording no code")
    text = "code: " + ", ".join(parts) + f" ({_group_list(summary)})"
    text += (f"; {summary.dirty} of {summary.runs} runs from a dirty tree (uncommitted changes)" if summary.dirty
             else "; no dirty runs")
    if summary.digests > 1:
        text += f"; {summary.digests} different source digests"
    if len(summary.groups) > 1:
        text += "; MIXED code, shown because of --allow-mixed-code"
    return text


def require_one_code(summary: CodeSummary, *, allow_mixed: bool) -> None:
    """Refuse a table whose runs come from more than one commit (or source digest, or unrecorded code)."""
    if len(summary.groups) <= 1 or allow_mixed:
        return
    raise PeftlabError(
        f"the table mixes runs of {len(summary.groups)} code versions ({_group_list(summary)})",
        fix="re-run from one clean commit, narrow the runs with --where, or pass --allow-mixed-code "
            "(the footnote then says what it mixes)")
