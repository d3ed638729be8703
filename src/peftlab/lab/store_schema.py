"""The results store's schema (version 2), how a row's columns are read, and how a pruned run is named.
FINISHED rows are never rerun under their key; NOT_OK rows are counted apart by a tune's candidate scores and a
figure's cells (reports keep labelled runs at their value: lab/table_model.Cell).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

from peftlab.errors import PeftlabError

SCHEMA_VERSION = 2
STATUSES = ("pending", "running", "ok", "diverged", "collapsed", "no_learning", "pruned", "failed")
RESULT_STATUSES = ("ok", "diverged", "collapsed", "no_learning", "pruned", "failed")  # what a run can end as
FINISHED = ("ok", "diverged", "collapsed", "no_learning", "pruned")  # never rerun under its key
NOT_OK = ("diverged", "collapsed", "failed", "no_learning", "pruned")  # a tune candidate / figure cell: not ok
PRUNED_MARK = ".pruned-e"  # <key>.pruned-e<N>, <run folder>.pruned-e<N>: a trial stopped after N epochs
SHORT_KEY = 12  # the characters of a run key shown in messages and run folder names

RUNS_TABLE = """
CREATE TABLE IF NOT EXISTS {name} (
    key TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ({statuses})),
    config TEXT NOT NULL,
    result TEXT,
    output_dir TEXT,
    started TEXT,
    finished TEXT,
    seconds REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    owner TEXT,
    created TEXT NOT NULL,
    updated TEXT NOT NULL
)"""
STATUS_LIST = ", ".join(f"'{s}'" for s in STATUSES)
SCHEMA = (RUNS_TABLE.format(name="runs", statuses=STATUS_LIST) + ";" + """
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, beat REAL NOT NULL);
""")  # owners: each holder's last heartbeat (peftlab.lab.store_owner); added to a store when a writer opens it

COLUMNS = ("key", "status", "config", "result", "output_dir", "started", "finished", "seconds", "attempts",
            "error", "owner", "created", "updated")


class StoreWriteError(PeftlabError):
    """A write the results store refused (full disk, I/O error, lock timeout); the store is as before it."""

    LOCKED = "another process held the store's write lock too long: let it finish, then rerun the same command"
    FULL = ("free disk space (or raise the quota or file-size limit), then rerun the same command: finished runs "
            "are kept and unfinished ones resume")

    def __init__(self, path, error: sqlite3.Error):
        self.error = error
        super().__init__(f"cannot write the results store {path}: {error}",
                         fix=self.LOCKED if "locked" in str(error) else self.FULL)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def seconds_between(start: str | None, end: str) -> float | None:
    if not start:
        return None
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def busy_seconds(rows: list[dict]) -> float:
    """Wall seconds during which any of ``rows`` ran: the union of their started-to-finished intervals (the pauses
    between a study's sessions left out; a resumed run counts from its last start)."""
    spans = sorted((datetime.fromisoformat(r["started"]), datetime.fromisoformat(r["finished"]))
                   for r in rows if r.get("started") and r.get("finished"))
    total, end = 0.0, None
    for begin, finish in spans:  # sorted by start: only what runs past the latest end so far is new
        total += max(0.0, (finish - (begin if end is None else max(begin, end))).total_seconds())
        end = finish if end is None else max(end, finish)
    return total


def row_dict(row: sqlite3.Row, *, parse: bool = True) -> dict:
    """A ``runs`` row as a dict (``parse``: config and result parsed from JSON)."""
    out = {name: row[name] for name in COLUMNS}
    if parse:
        for column in ("config", "result"):
            try:
                out[column] = json.loads(out[column]) if out[column] else None
            except ValueError as err:  # a torn or hand-edited row: one line, not a traceback
                raise PeftlabError(f"row {out['key'][:SHORT_KEY]}'s {column} is not JSON ({err})",
                                   fix="run `peftlab store check STORE --repair`") from None
    return out


def is_pruned_result(result: dict | None) -> bool:
    """A tune trial stopped before its last epoch, so never the complete run of its config: status ``pruned``;
    or ``stopped_early`` with status ``ok`` / ``no_learning`` (results written before ``pruned`` existed) or
    ``collapsed`` (the tune stops a collapsed trial at once: it keeps its status, not the complete run's key)."""
    if not isinstance(result, dict):
        return False
    status = result.get("status")
    return status == "pruned" or (status in ("ok", "no_learning", "collapsed") and bool(result.get("stopped_early")))


def effective_status(status: str, result: dict | None) -> str:
    """A row's status as it should read: ``pruned`` for a pruned trial a schema-1 store recorded as ``ok``."""
    return "pruned" if status in ("ok", "no_learning") and is_pruned_result(result) else status


def implied_status(result: dict) -> str | None:
    """The row status a run's result implies (None for a status no run ends with)."""
    status = result.get("status")
    if status not in RESULT_STATUSES:
        return None
    if is_pruned_result(result):
        return "collapsed" if status == "collapsed" else "pruned"
    return status


def epochs_run(result: dict | None) -> int:
    """Epochs a run trained: ``epochs_run``, else (older results) the epoch it was stopped at, else those logged."""
    result = result or {}
    if isinstance(result.get("epochs_run"), int):
        return result["epochs_run"]
    stopped = result.get("stopped_early")
    if isinstance(stopped, dict) and isinstance(stopped.get("epoch"), int):
        return stopped["epoch"]
    return len(result.get("epochs_log") or [])


def pruned_key(key: str, epochs: int) -> str:
    return f"{unpruned_key(key)}{PRUNED_MARK}{int(epochs)}"


def unpruned_key(key: str) -> str:
    return key.split(PRUNED_MARK, 1)[0]


def pruned_dir(folder: str | os.PathLike, epochs: int) -> str:
    return f"{Path(folder)}{PRUNED_MARK}{int(epochs)}"


def move_run_folder(src: str | os.PathLike, dst: str | os.PathLike) -> bool:
    """Rename run folder ``src`` to ``dst``, replacing one there (the same config stopped at the same epoch: the
    same computation); False when ``src`` is not there."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir() or src.resolve() == dst.resolve():
        return False
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(src, dst)
    return True


def parse_json(text: str | None) -> tuple:
    """A JSON column's ``(value, None)``, or ``(None, why it does not parse)``; ``(None, None)`` when empty."""
    if text is None:
        return None, None
    try:
        return json.loads(text), None
    except ValueError as err:
        return None, " ".join(str(err).split())


def migrate_v1(conn: sqlite3.Connection, stamp: str) -> list[tuple[str, str, str]]:
    """Schema 1 -> 2 inside the caller's transaction: the runs table rebuilt with the new statuses (SQLite
    cannot alter a CHECK constraint), rowids kept; each pruned trial recorded as ``ok`` moves to its pruned key.
    Returns ``(folder, pruned folder, the run's key)`` for the renames the caller does after the commit."""
    columns = ", ".join(COLUMNS)
    conn.execute(RUNS_TABLE.format(name="runs_v2", statuses=STATUS_LIST))
    conn.execute(f"INSERT INTO runs_v2 (rowid, {columns}) SELECT rowid, {columns} FROM runs")
    conn.execute("DROP TABLE runs")
    conn.execute("ALTER TABLE runs_v2 RENAME TO runs")
    conn.execute("CREATE INDEX IF NOT EXISTS runs_status ON runs (status)")
    moves = []
    for rowid, key, result, folder in conn.execute(
            "SELECT rowid, key, result, output_dir FROM runs WHERE status IN ('ok', 'no_learning') "
            "AND result IS NOT NULL").fetchall():
        result = parse_json(result)[0]
        if not is_pruned_result(result):
            continue
        epochs = epochs_run(result)
        new_dir = pruned_dir(folder, epochs) if folder else None
        conn.execute("UPDATE runs SET key = ?, status = 'pruned', output_dir = ?, updated = ? WHERE rowid = ?",
                     (pruned_key(key, epochs), new_dir, stamp, rowid))
        if new_dir:
            moves.append((folder, new_dir, key))
    conn.execute("UPDATE meta SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),))
    return moves
