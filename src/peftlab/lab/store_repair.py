"""``peftlab store check --repair``: the safe fixes of the problems :mod:`peftlab.lab.store_check` found.

Each problem's action is applied in its own conditional transaction (a row a live sweep changed meanwhile is left
alone: its ``UPDATE`` matches nothing), and each change is reported in one line. No action deletes a row."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from peftlab.io_utils import atomic_write_text
from peftlab.lab.store import Store, resolve_store_path, short_key
from peftlab.lab.store_schema import now_iso, parse_json


def repair(store_path: str | Path, problems: list) -> list[str]:
    """Apply each problem's action (its kind, the row's key, then the kind's arguments); one line per change."""
    changes = []
    actions = [p.action for p in problems if p.action is not None]
    if not actions:
        return changes
    with Store(resolve_store_path(store_path), create=False) as store:
        for action in actions:
            kind, key = action[0], action[1]
            if kind == "rewrite":
                if _rewrite_result(Path(action[2]), action[3]):
                    changes.append(f"{short_key(key)}: rewrote {action[2]} from the store's copy")
                continue
            with store.transaction() as conn:
                done = ROW_ACTIONS[kind](conn, store, key, *action[2:], stamp=now_iso())
            if done is not None:
                changes.append(f"{short_key(key)}: {done}")
    return changes


def _rewrite_result(path: Path, text: str) -> bool:
    """Rewrite an unreadable result.json from the store's copy; False when it is readable again (a rerun wrote
    it meanwhile)."""
    try:
        json.loads(path.read_text())
        return False
    except (OSError, ValueError):
        atomic_write_text(path, json.dumps(json.loads(text), indent=2) + "\n")
        return True


def _requeue(conn: sqlite3.Connection, store: Store, key: str, owner: str | None, *, stamp: str) -> str | None:
    """A running row whose holder is gone (still the same holder, still not beating) goes back to pending."""
    row = conn.execute("SELECT owner FROM runs WHERE key = ? AND status = 'running'", (key,)).fetchone()
    if row is None or row["owner"] != owner or store.holder_alive(row["owner"]):
        return None
    cur = conn.execute("UPDATE runs SET status = 'pending', owner = NULL, updated = ? WHERE key = ? "
                       "AND status = 'running' AND owner IS ?", (stamp, key, owner))
    return "running -> pending (its owner is gone; the next sweep or tune resumes it)" if cur.rowcount == 1 else None


def _fail(conn: sqlite3.Connection, store: Store, key: str, status: str, error: str, result: str | None, *,
          stamp: str) -> str | None:
    """A finished row whose result is unreadable or says failed is marked failed with the reason."""
    # an unparseable result is dropped with the row's status (every reader would trip on it); a parseable one that
    # says failed is kept, as Store.finish keeps a failed run's result
    kept = result if parse_json(result)[1] is None else None
    cur = conn.execute("UPDATE runs SET status = 'failed', error = ?, result = ?, updated = ? "
                       "WHERE key = ? AND status = ? AND result IS ?", (error, kept, stamp, key, status, result))
    return f"{status} -> failed ({error})" if cur.rowcount == 1 else None


def _relabel(conn: sqlite3.Connection, store: Store, key: str, status: str, new_status: str, *,
             stamp: str) -> str | None:
    """A finished row takes the finished status its result names (the result is the run's own record)."""
    cur = conn.execute("UPDATE runs SET status = ?, updated = ? WHERE key = ? AND status = ?",
                       (new_status, stamp, key, status))
    return f"{status} -> {new_status} (as its result says)" if cur.rowcount == 1 else None


def _record_error(conn: sqlite3.Connection, store: Store, key: str, error: str, *, stamp: str) -> str | None:
    """A failed row without an error gets one."""
    cur = conn.execute("UPDATE runs SET error = ?, updated = ? WHERE key = ? AND status = 'failed' "
                       "AND (error IS NULL OR trim(error) = '')", (error, stamp, key))
    return f"recorded the error: {error}" if cur.rowcount == 1 else None


def _rekey(conn: sqlite3.Connection, store: Store, key: str, new_key: str, *, stamp: str) -> str | None:
    """A pruned row under a complete run's key moves to its pruned key (unless a row is already there)."""
    cur = conn.execute("UPDATE runs SET key = ?, updated = ? WHERE key = ? AND status = 'pruned' AND "
                       "NOT EXISTS (SELECT 1 FROM runs WHERE key = ?)", (new_key, stamp, key, new_key))
    return f"moved to its pruned key {short_key(key)}{new_key[len(key):]}" if cur.rowcount == 1 else None


ROW_ACTIONS = {"requeue": _requeue, "fail": _fail, "relabel": _relabel, "error": _record_error, "rekey": _rekey}
