"""``peftlab store check STORE [--repair] [--json]``: verify a results store, and requeue what is stale.

One line per problem (the row's short key, what is wrong, how to fix it). Run folders are found from here
(relative paths: the working directory, then beside the store). ``--repair`` (:mod:`peftlab.lab.store_repair`)
applies only the safe fixes, never deletes a row, and is idempotent.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from peftlab.errors import PeftlabError
from peftlab.lab.store import config_key, resolve_store_path, short_key
from peftlab.lab.store_owner import LEASE_SECONDS, owner_alive, owner_host, read_beats
from peftlab.lab.store_repair import repair
from peftlab.lab.store_schema import (
    FINISHED, PRUNED_MARK, STATUSES, effective_status, epochs_run, implied_status, is_pruned_result, parse_json,
    pruned_key, unpruned_key)

SQLITE_HEADER = b"SQLite format 3\x00"
REPAIR_HINT = "peftlab store check --repair"


@dataclass(frozen=True)
class Problem:
    """One thing wrong; ``action`` is what ``--repair`` does about it (None: nothing it can do safely)."""

    key: str  # the row's key; "store" for the file itself; a folder path for an orphaned run folder
    what: str
    fix: str
    action: tuple | None = None

    def line(self) -> str:
        label = self.key if self.key == "store" or "/" in self.key else short_key(unpruned_key(self.key)) + (
            self.key[len(unpruned_key(self.key)):])
        return f"{label}: {self.what}; fix: {self.fix}"


@dataclass
class Check:
    store: str
    rows: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    schema: int | None = None
    integrity: str = "not checked"
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"store": self.store, "clean": self.clean, "rows": self.rows, "counts": self.counts,
                "schema": self.schema, "integrity": self.integrity, "notes": self.notes,
                "problems": [{**asdict(p), "action": list(p.action) if p.action else None, "repairable":
                              p.action is not None} for p in self.problems]}


# --------------------------------------------------------------------------- reading the file


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that writes nothing. Where the store and its folder are writable it is an ordinary one
    (``query_only``), so that closing it removes the ``-wal``/``-shm`` files it made, as a sweep's does."""
    writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    target = str(path) if writable else f"file:{quote(str(path.resolve()))}?mode=ro"
    conn = sqlite3.connect(target, uri=not writable, timeout=30)
    conn.execute("PRAGMA query_only = 1")
    conn.row_factory = sqlite3.Row
    return conn


def _read(path: Path, check: Check) -> tuple[list[sqlite3.Row] | None, dict[str, float]]:
    """The rows, after the file's integrity checks (None when the file is too damaged to read them), and the
    holders' heartbeats."""
    with open(path, "rb") as handle:
        header = handle.read(len(SQLITE_HEADER))
    if header != SQLITE_HEADER:
        raise PeftlabError(f"{path} is not an SQLite file, so not a results store",
                           fix="pass a sweep's or tune's results.sqlite (or the folder holding it)")
    damaged = "restore the store from a copy, or salvage its rows: sqlite3 STORE .recover | sqlite3 NEW.sqlite"
    try:
        conn = _connect_read_only(path)
    except sqlite3.Error as err:
        raise PeftlabError(f"cannot open results store {path}: {err}") from None
    try:
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as err:
            check.integrity = str(err)
            check.problems.append(Problem("store", f"the file is damaged ({err})", damaged))
            return None, {}
        if not tables:  # what a sweep killed before its first transaction committed leaves: nothing to lose
            check.integrity = "ok"
            check.notes.append("the store has no tables yet (the sweep or tune that made it stopped before its "
                               "first write); the next one creates them")
            return [], {}
        if not {"runs", "meta"} <= tables:
            raise PeftlabError(f"{path} is an SQLite file without peftlab's runs/meta tables",
                               fix="pass a sweep's or tune's results.sqlite")
        try:
            findings = [r[0] for r in conn.execute("PRAGMA integrity_check")]
        except sqlite3.DatabaseError as err:
            findings = [str(err)]
        findings = [] if findings == ["ok"] else findings
        check.integrity = "; ".join(findings[:3]) or "ok"
        if findings:
            more = f" (and {len(findings) - 3} more)" if len(findings) > 3 else ""
            check.problems.append(Problem("store", f"integrity check failed: {check.integrity}{more}", damaged))
        try:
            version = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            check.schema = int(version[0]) if version else None
            return conn.execute("SELECT * FROM runs ORDER BY rowid").fetchall(), read_beats(conn)
        except (sqlite3.DatabaseError, ValueError) as err:
            if not findings:
                check.problems.append(Problem("store", f"its rows cannot be read ({err})", damaged))
            return None, {}
    finally:
        conn.close()


# --------------------------------------------------------------------------- the checks


def _folder(output_dir: str | None, store_path: Path) -> Path | None:
    """A row's run folder as found from here: the path itself (relative: to the cwd), else beside the store."""
    if not output_dir:
        return None
    path = Path(output_dir)
    return next((candidate for candidate in (path, store_path.parent / path.name) if candidate.is_dir()), None)


def check_row(row: sqlite3.Row, schema: int) -> list[Problem]:
    """The problems of one row, from the row alone (no folder, no process liveness)."""
    key, status = row["key"], row["status"]
    out: list[Problem] = []
    if status not in STATUSES:
        return [Problem(key, f"unknown status {status!r}", "rerun its spec (it registers the run afresh)")]
    config, why = parse_json(row["config"])
    if why or not isinstance(config, dict):
        out.append(Problem(key, f"its config does not parse ({why or 'not a JSON object'})",
                           "rerun its spec: the run is registered again under its config's key"))
    elif config_key(config) != unpruned_key(key):
        out.append(Problem(key, f"its key is not its config's ({short_key(config_key(config))}): the row is "
                                "filed under another run", "rerun its spec: the run is registered under its own key"))
    pruned_named = PRUNED_MARK in key
    if pruned_named and not key.split(PRUNED_MARK, 1)[1].isdigit():
        out.append(Problem(key, "a malformed pruned key", "rerun the tune that made it"))
    result, why = parse_json(row["result"])
    if status == "failed":
        if not (row["error"] or "").strip():
            reason = (result or {}).get("status_reason") if isinstance(result, dict) else None
            out.append(Problem(key, "failed, but no error is recorded", "--repair records that it is unknown",
                               ("error", key, reason or "no error was recorded (found by peftlab store check)")))
        if isinstance(result, dict) and implied_status(result) in FINISHED:
            out.append(Problem(key, f"failed, but its result says {implied_status(result)}",
                               "rerun with --retry-failed (the finished run folder is adopted)"))
        return out
    if status not in FINISHED:
        return out
    if row["result"] is None or why or not isinstance(result, dict):
        detail = "missing" if row["result"] is None else f"unreadable: {why or 'not a JSON object'}"
        what = "has no result" if row["result"] is None else f"its result does not parse ({why or 'not an object'})"
        return out + [Problem(key, f"{status}, but {what}", f"{REPAIR_HINT} marks it failed; --retry-failed reruns it",
                              ("fail", key, status, f"recorded {status}, but its result was {detail} "
                                                    "(found by peftlab store check)", row["result"]))]
    implied = implied_status(result)
    if schema < 2 and status in ("ok", "no_learning") and implied == "pruned":
        return out  # a schema-1 store keeps pruned trials under their config's key until it is opened for writing
    if implied is None or implied == "failed":
        said = "failed" if implied == "failed" else f"status {result.get('status')!r}"
        out.append(Problem(key, f"{status}, but its result says {said}", f"{REPAIR_HINT} marks it failed",
                           ("fail", key, status, result.get("status_reason") or f"its result says {said}",
                            row["result"])))
    elif implied != status:
        if "pruned" in (implied, status):
            out.append(Problem(key, f"{status}, but its result says {implied}",
                               "rerun the tune or sweep: the run is trained again under its own key"))
        else:
            out.append(Problem(key, f"{status}, but its result says {implied}", f"{REPAIR_HINT} takes the result's",
                               ("relabel", key, status, implied)))
    elif status == "pruned" and not pruned_named:
        new_key = pruned_key(key, epochs_run(result))
        out.append(Problem(key, "a pruned trial under the key of its config's complete run (a sweep would never "
                                "train that run)", f"{REPAIR_HINT} moves it to {short_key(key)}{new_key[len(key):]}",
                           ("rekey", key, new_key)))
    if pruned_named and not is_pruned_result(result):
        out.append(Problem(key, "under a pruned key, but its result is a complete run",
                           "rerun its spec: the complete run is registered under its own key"))
    return out


def check_running(row: sqlite3.Row, beats: dict[str, float], now: float) -> Problem | None:
    """A running row is stale when its holder stopped beating (or, on this machine, its pid is gone)."""
    owner = row["owner"]
    if owner_alive(owner, beats.get(owner or ""), now):
        return None
    host, pid = owner_host(owner)
    who = f"pid {pid} on {host}" if host else f"owner {owner!r}"
    beat = beats.get(owner or "")
    if beat is not None and now - beat > LEASE_SECONDS:
        why = f"stopped beating {now - beat:.0f} s ago (lease {LEASE_SECONDS:.0f} s)"
    else:  # a fresh beat of a dead pid of this machine, or no beat at all (killed before its first, older peftlab)
        why = "is gone" if beat is not None else "is gone (it never beat)"
    return Problem(row["key"], f"running, but its owner ({who}) {why}",
                   f"{REPAIR_HINT} requeues it (or rerun the sweep or tune: it resumes the run)",
                   ("requeue", row["key"], owner))


def check_folder(row: sqlite3.Row, folder: Path, schema: int = 2) -> Problem | None:
    """A finished row's run folder: its result.json parses and is the same run with the same status."""
    path = folder / "result.json"
    if not path.is_file():
        return None  # a folder a later run overwrote or never finished: the store's copy is the record
    try:
        on_disk = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        stored, _ = parse_json(row["result"])
        action = ("rewrite", row["key"], str(path), row["result"]) if isinstance(stored, dict) else None
        return Problem(row["key"], f"{path} does not parse ({' '.join(str(err).split())[:120]})",
                       f"{REPAIR_HINT} rewrites it from the store's copy" if action else "rerun the run", action)
    if not isinstance(on_disk, dict):
        return Problem(row["key"], f"{path} is not a JSON object", "rerun the run")
    if config_key(on_disk.get("config") or {}) != unpruned_key(row["key"]):
        return Problem(row["key"], f"{folder} holds another run than this row",
                       "move that folder away and rerun its spec")
    implied = implied_status(on_disk)
    status = effective_status(row["status"], parse_json(row["result"])[0]) if schema < 2 else row["status"]
    if implied is not None and implied != status and status != "failed":
        return Problem(row["key"], f"{path} says {implied}, the store says {status}",
                       "the folder was rerun outside the sweep: rerun the sweep with --retry-failed, or restore it")
    return None


def check_store(path: str | Path) -> Check:
    """Every check, reading only (the store may be read-only, and a live sweep may be writing it)."""
    store_path = resolve_store_path(path)
    check = Check(store=str(store_path))
    rows, beats = _read(store_path, check)
    if rows is None:
        return check
    schema = check.schema or 2
    check.rows = len(rows)
    check.counts = {s: n for s in STATUSES if (n := sum(1 for r in rows if r["status"] == s))}
    now = time.time()
    folders: dict[Path, str] = {}
    for row in rows:
        check.problems.extend(check_row(row, schema))
        if row["status"] == "running":
            check.problems.extend(filter(None, [check_running(row, beats, now)]))
        folder = _folder(row["output_dir"], store_path)
        if folder is None:
            continue
        resolved = folder.resolve()
        if resolved in folders:
            check.problems.append(Problem(row["key"], f"shares its run folder {folder} with row "
                                                      f"{short_key(folders[resolved])}",
                                          "rerun its spec: each run gets a folder named by its key"))
        folders.setdefault(resolved, row["key"])
        if row["status"] in FINISHED:
            check.problems.extend(filter(None, [check_folder(row, folder, schema)]))
    check.problems.extend(orphaned_folders(folders, store_path))
    found = len(folders)
    if rows and found < len(rows):
        check.notes.append(f"{len(rows) - found} of {len(rows)} run folders not found from here: not checked")
    return check


def orphaned_folders(folders: dict[Path, str], store_path: Path) -> list[Problem]:
    """Run folders (a config.yaml or result.json inside) beside the store's runs that no row names."""
    roots = {f.parent for f in folders} | ({store_path.parent.resolve()} if folders else set())
    out = []
    for root in sorted(roots):
        for child in sorted(p for p in root.iterdir() if p.is_dir()):
            resolved = child.resolve()
            if resolved in folders or not any((child / n).is_file() for n in ("config.yaml", "result.json")):
                continue
            out.append(Problem(str(child), "a run folder no row of this store names",
                               "remove it, or rerun the spec that made it (its finished run is adopted)"))
    return out


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser("store", help="check a results store (integrity, statuses, stale runs) and repair it",
                            description="Tools for a sweep's or tune's SQLite results store.")
    parser.set_defaults(func=run_cli)  # `check` is the one action (required: `peftlab store` alone is refused)
    actions = parser.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check", help="verify a store: SQLite integrity, every status against its result, stale running rows",
        description="Check a sweep's or tune's results store: SQLite's integrity_check; every row's config against "
                    "its key; every status against its result (a finished row's result parses and agrees, a failed "
                    "row has an error, pruned trials live under pruned keys); stale running rows (the holder stopped "
                    "beating, or its process is gone); run folders (result.json readable and the same run, no folder "
                    "shared or orphaned). One line per problem: key: what; fix: how. Exit status 0 clean, 1 "
                    "problems, 2 not a results store.")
    check.add_argument("store", metavar="STORE", help="a results.sqlite, or the folder holding it")
    check.add_argument("--repair", action="store_true",
                       help="requeue stale running rows, mark rows with an unreadable result failed, and the other "
                            "safe fixes listed; never deletes a row; idempotent")
    check.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    check.set_defaults(func=run_cli)


def run_cli(args) -> int:
    check = check_store(args.store)
    before, changes = check, []
    if args.repair:
        changes = repair(args.store, check.problems)
        check = check_store(args.store)
    if args.json:
        payload = check.to_dict()
        if args.repair:
            payload.update(found=before.to_dict()["problems"], changes=changes)
        print(json.dumps(payload, indent=2))
        return 0 if check.clean else 1
    counts = ", ".join(f"{n} {s}" for s, n in before.counts.items()) or "no rows"
    print(f"store {before.store}: {before.rows} row(s) ({counts}), schema {before.schema}, "
          f"integrity {before.integrity}")
    for note in before.notes:
        print(f"note: {note}")
    for problem in before.problems:
        print(problem.line())
    if args.repair:
        for change in changes:
            print(f"repaired {change}")
        if not changes:
            print("repaired nothing: no problem here can be fixed safely" if before.problems else "nothing to repair")
        for problem in check.problems:
            print(f"still: {problem.line()}", file=sys.stderr)
    remaining = len(check.problems)
    if remaining:
        fixable = sum(1 for p in check.problems if p.action is not None)
        hint = f"; {REPAIR_HINT} fixes {fixable} of them" if fixable and not args.repair else ""
        print(f"{remaining} problem(s){hint}", file=sys.stderr)
        return 1
    print("clean" if not before.problems else "clean after the repairs")
    return 0
