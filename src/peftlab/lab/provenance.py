"""Which code a table's runs ran: result.json ``code`` ({commit, dirty, version, source_digest}), or an older
run's ``git_commit`` (``"<sha>"`` or ``"<sha>+dirty"``).

A run is grouped by its commit; a run without any commit by its source digest (``source <digest>``), else as
``unknown``. ``peftlab report`` prints under each table how many groups and dirty runs it mixes
(:func:`code_line`) and refuses a table of more than one group unless ``--allow-mixed-code``
(:func:`require_one_code`): numbers computed by different code are not one experiment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from peftlab.errors import PeftlabError
from peftlab.lab.table_model import CodeSummary

UNKNOWN = "unknown"
DIRTY_SUFFIX = "+dirty"
SHOWN_GROUPS = 4  # the line and the error name this many groups, then "n more"


@dataclass(frozen=True)
class RunCode:
    commit: str | None
    dirty: bool | None
    source_digest: str | None

    @property
    def group(self) -> str:
        if self.commit:
            return self.commit
        return f"source {self.source_digest[:12]}" if self.source_digest else UNKNOWN


def run_code(result: dict | None) -> RunCode:
    """The code a run recorded: ``code`` first, else the older ``git_commit`` string."""
    result = result or {}
    code = result.get("code")
    if isinstance(code, dict):
        commit, dirty, digest = code.get("commit"), code.get("dirty"), code.get("source_digest")
        if commit or digest:
            return RunCode(commit or None, dirty if isinstance(dirty, bool) else None, digest or None)
    legacy = result.get("git_commit")
    if isinstance(legacy, str) and legacy:
        dirty = legacy.endswith(DIRTY_SUFFIX)
        return RunCode(legacy.removesuffix(DIRTY_SUFFIX), dirty, None)
    return RunCode(None, None, None)


def summarize(results: Iterable[dict | None]) -> CodeSummary:
    """The code of the runs that contribute to a table (rows without a result.json, e.g. crashed runs that
    left none, tell nothing and are not counted)."""
    summary = CodeSummary()
    digests = set()
    for result in results:
        if not result:
            continue
        code = run_code(result)
        summary.runs += 1
        summary.groups[code.group] += 1
        summary.dirty += bool(code.dirty)
        if code.source_digest:
            digests.add(code.source_digest)
    summary.digests = len(digests)
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
