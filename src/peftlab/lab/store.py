"""The results store: one SQLite row per run, keyed by a hash of the run's resolved config (:func:`config_key`).

A pruned tune trial never keeps the complete run's key (:meth:`Store.finish`), so a later complete run of the same
config trains afresh. A schema-1 store opened for writing is migrated in place; read-only it is left as it is.
Concurrency: WAL (a local file system, not NFS) and every read-modify-write in one ``BEGIN IMMEDIATE``
transaction; a ``running`` row whose holder stopped beating (:mod:`peftlab.lab.store_owner`) is claimable again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sqlite3
import time
from collections import Counter
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterable, Iterator

from peftlab.config import ROLES, TrainConfig, option_defaults
from peftlab.errors import PeftlabError
from peftlab.io_utils import json_default
from peftlab.lab.store_owner import Heartbeat, owner_alive, process_identity, read_beats, write_beat
from peftlab.lab.store_schema import (
    PRUNED_MARK, RESULT_STATUSES, SCHEMA_VERSION, SHORT_KEY, STATUSES, StoreWriteError, effective_status, epochs_run,
    implied_status, is_pruned_result, migrate_v1, move_run_folder, now_iso, parse_json, pruned_dir, pruned_key,
    row_dict, seconds_between, unpruned_key)
from peftlab.lab.store_schema import SCHEMA as _SCHEMA

# The run key's roles (peftlab.config_roles): an option of key schema 1 (KEY_FIELDS_V1) is hashed at every value; an
# option added since only when it differs from its default, so a run recorded before the option existed keeps its
# key. An option that may change on --resume (KEY_EXCLUDED) never changes the key; those key schema 1 hashed are
# hashed as the constant they held then (KEY_PINNED). tests/test_store_keys.py recomputes the committed keys.
KEY_FIELDS_V1 = ROLES.key_v1
KEY_EXCLUDED = ROLES.resumable
KEY_PINNED = ROLES.hashed_as
STORE_NAME = "results.sqlite"


def config_key(config: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a resolved config (``TrainConfig.to_dict()``): its resumable options
    left out (or pinned: KEY_PINNED), the options added after key schema 1 left out while at their defaults."""
    defaults = option_defaults_json()
    canonical = {k: KEY_PINNED[k] for k in config if k in KEY_PINNED}  # KEY_PINNED: a part of KEY_EXCLUDED
    for k, v in config.items():
        value = list(v) if isinstance(v, tuple) else v
        if k not in KEY_EXCLUDED and (k in KEY_FIELDS_V1 or k not in defaults or value != defaults[k]):
            canonical[k] = value
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def option_defaults_json() -> dict[str, Any]:
    """Every TrainConfig option's default as a run's config records it (flat names, tuples as JSON lists)."""
    return {name: list(value) if isinstance(value, tuple) else value
            for name, value in option_defaults(TrainConfig).items()}


def short_key(key: str) -> str:
    return key[:SHORT_KEY]


# --------------------------------------------------------------------------- the store


_CREATION_GRACE_S = 10.0  # how long a reader waits for a just-created store's schema to commit


class Store:
    """An SQLite results store; cheap to open, one connection per process (do not share across fork)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True, timeout: float = 120.0):
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise PeftlabError(f"results store not found: {self.path}",
                               fix="pass the results.sqlite of a sweep (or its output folder)")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        try:
            self.conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None,
                                        check_same_thread=False)
        except sqlite3.Error as err:
            raise PeftlabError(f"cannot open results store {self.path}: {err}") from None
        self.conn.row_factory = sqlite3.Row
        self.conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
        self._init_schema(create)
        self.owner = process_identity()
        self._heartbeat = None  # started by the first claim, so that the rows claimed here stay held

    def _being_created(self, started: float) -> bool:
        """Whether another driver has just created the file and not yet committed its schema (for a few seconds:
        a reader would otherwise take it for a foreign file)."""
        empty = self.conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        return empty and time.monotonic() - started < min(self.timeout, _CREATION_GRACE_S)

    def _init_schema(self, create: bool) -> None:
        started = time.monotonic()
        while True:
            try:
                if create:
                    self.journal_mode = self._create_schema()
                    break
                self.journal_mode = self.conn.execute("PRAGMA journal_mode").fetchone()[0]  # reading: change nothing
                if not self._being_created(started):
                    break
            except (sqlite3.DatabaseError, StoreWriteError) as err:
                if "locked" not in str(err) or time.monotonic() > started + self.timeout:
                    if isinstance(err, (StoreWriteError, sqlite3.OperationalError)):  # full disk, I/O, lock
                        raise StoreWriteError(self.path, getattr(err, "error", err)) from None
                    raise PeftlabError(f"cannot open results store {self.path}: {err}") from None
            time.sleep(0.05)
        try:
            row = self.conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
        except sqlite3.DatabaseError as err:
            raise PeftlabError(f"{self.path} is not a peftlab results store ({err})") from None
        if row is None or int(row[0]) > SCHEMA_VERSION:
            raise PeftlabError(f"{self.path} is not a results store this peftlab can read "
                               f"(schema {row[0] if row else 'missing'})")
        self.schema = int(row[0])  # 1: an older store opened read-only (pruned rows still say ok in it)

    def _create_schema(self) -> str:
        """The tables (a schema-1 store migrated); returns the journal mode."""
        mode = self.conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        self.conn.execute("PRAGMA synchronous = NORMAL")
        with self.transaction() as conn:
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)
            conn.execute("INSERT OR IGNORE INTO meta (name, value) VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            version = conn.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            moves = _migrations(conn) if version is not None and version[0] == "1" else []
        for src, dst in moves:  # after the commit: a kill in between leaves the folder where it was,
            move_run_folder(src, dst)  # and sweep.run_one sets a pruned folder aside when it meets one
        return mode

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``, rolled back on any error; a write SQLite refuses is a
        :class:`StoreWriteError`."""
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            finally:
                if self.conn.in_transaction:  # the body raised, or COMMIT failed (it may leave it open)
                    with suppress(sqlite3.Error):
                        self.conn.execute("ROLLBACK")
        except sqlite3.OperationalError as err:
            raise StoreWriteError(self.path, err) from None

    # ----------------------------------------------------------------- writing

    def register(self, runs: Iterable[tuple[str, dict, str]]) -> int:
        """Add ``(key, config, output_dir)`` rows as pending unless present; returns how many were new."""
        stamp = now_iso()
        with self.transaction() as conn:
            cur = conn.executemany(
                "INSERT OR IGNORE INTO runs (key, status, config, output_dir, attempts, created, updated) "
                "VALUES (?, 'pending', ?, ?, 0, ?, ?)",
                [(key, json.dumps(config, sort_keys=True), str(output_dir), stamp, stamp) for key, config, output_dir
                 in runs])
        return cur.rowcount

    def prepare(self, keys: Iterable[str], *, retry_failed: bool = False) -> dict[str, int]:
        """Before a sweep runs: running rows whose owner died and, with ``retry_failed``, failed rows go back to
        pending. Returns how many of each were reset."""
        wanted = set(keys)
        reset = {"running": 0, "failed": 0}
        stamp = now_iso()
        with self.transaction() as conn:
            rows = conn.execute("SELECT key, status, owner FROM runs WHERE status IN ('running', 'failed')").fetchall()
            beats, now = read_beats(conn), time.time()
            for row in rows:
                stale = row["status"] == "running" and not owner_alive(row["owner"], beats.get(row["owner"]), now)
                if row["key"] in wanted and (stale or (row["status"] == "failed" and retry_failed)):
                    conn.execute("UPDATE runs SET status = 'pending', owner = NULL, updated = ? WHERE key = ?",
                                 (stamp, row["key"]))
                    reset[row["status"]] += 1
        return reset

    def claim(self, key: str) -> dict | None:
        """Atomically mark a pending ``key`` running for this process; returns the row as it was, or None."""
        with self.transaction() as conn:
            row = conn.execute("SELECT * FROM runs WHERE key = ?", (key,)).fetchone()
            if row is None or row["status"] != "pending":
                return None
            stamp = now_iso()
            conn.execute(
                "UPDATE runs SET status = 'running', owner = ?, started = ?, finished = NULL, seconds = NULL, "
                "attempts = attempts + 1, error = NULL, updated = ? WHERE key = ?",
                (self.owner, stamp, stamp, key))
            write_beat(conn, self.owner, time.time())  # held from this commit on; the thread renews it
        if self._heartbeat is None:
            self._heartbeat = Heartbeat(self.path, self.owner)
            self._heartbeat.start()
        return row_dict(row)

    def release(self, key: str) -> bool:
        """Give a claimed run back (pending), e.g. on Ctrl-C."""
        with self.transaction() as conn:
            cur = conn.execute("UPDATE runs SET status = 'pending', owner = NULL, updated = ? "
                               "WHERE key = ? AND status = 'running' AND owner = ?", (now_iso(), key, self.owner))
            return cur.rowcount == 1

    def finish(self, key: str, result: dict, *, owner: str | None = None) -> bool:
        """Record a finished run's result (status from ``result['status']``); False if another process owns it.
        A pruned run's row moves to :func:`pruned_key` (rowid kept) and, after the commit, its folder to
        :func:`pruned_dir`: the complete run's key is then free (a sweep registers it pending)."""
        status = result.get("status")
        if status not in RESULT_STATUSES:
            raise ValueError(f"result status must be one of {'/'.join(RESULT_STATUSES)}, got {status!r}")
        error = result.get("status_reason") if status == "failed" else None
        return self._close(key, implied_status(result), result, error, owner)

    def fail(self, key: str, error: str, *, owner: str | None = None) -> bool:
        return self._close(key, "failed", None, error, owner)

    def _close(self, key: str, status: str, result: dict | None, error: str | None, owner: str | None) -> bool:
        owner = owner or self.owner
        pruned = is_pruned_result(result)
        new_key = pruned_key(key, epochs_run(result)) if pruned else key
        stamp = now_iso()
        with self.transaction() as conn:
            row = conn.execute("SELECT status, owner, started, output_dir FROM runs WHERE key = ?", (key,)).fetchone()
            if row is None or row["status"] != "running" or row["owner"] != owner:
                return False  # reclaimed by someone else (or never claimed): theirs wins
            folder = new_dir = row["output_dir"]
            if pruned:
                folder = folder or (result.get("config") or {}).get("output_dir")
                new_dir = pruned_dir(folder, epochs_run(result)) if folder else None
                conn.execute("DELETE FROM runs WHERE key = ?", (new_key,))  # same config, same stop: replaced
            conn.execute(
                "UPDATE runs SET key = ?, status = ?, result = ?, error = ?, output_dir = ?, finished = ?, "
                "seconds = ?, owner = NULL, updated = ? WHERE key = ?",
                (new_key, status, None if result is None else json.dumps(result, default=json_default), error,
                 new_dir, stamp, seconds_between(row["started"], stamp), stamp, key))
        if pruned and folder:  # after the commit (see _init_schema for why that order)
            move_run_folder(folder, new_dir)
        return True

    def add(self, config: dict, *, result: dict | None = None, status: str | None = None,
            error: str | None = None, output_dir: str | None = None) -> str:
        """Insert or replace one finished row (``status``: else ``result['status']``); a pruned result goes under
        :func:`pruned_key`, its folder not renamed (an import moves nothing)."""
        status = status or (result or {}).get("status")
        if status not in RESULT_STATUSES:
            raise ValueError(f"status must be one of {'/'.join(RESULT_STATUSES)}, got {status!r}")
        key = config_key(config)
        if is_pruned_result(result) or status == "pruned":
            if result is None:
                raise ValueError("a pruned run needs its result (the epochs it ran)")
            status = "collapsed" if result.get("status") == "collapsed" else "pruned"
            key = pruned_key(key, epochs_run(result))
        stamp = now_iso()
        with self.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO runs (key, status, config, result, output_dir, started, finished, seconds, "
                "attempts, error, owner, created, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, NULL, ?, ?)",
                (key, status, json.dumps(config, sort_keys=True),
                 None if result is None else json.dumps(result, default=json_default),
                 output_dir or config.get("output_dir"), stamp, stamp, (result or {}).get("train_seconds"),
                 error or ((result or {}).get("status_reason") if status == "failed" else None), stamp, stamp))
        return key

    # ----------------------------------------------------------------- reading

    def statuses(self) -> dict[str, str]:
        return {row["key"]: row["status"] for row in self.rows(parse=False)}

    def holder_alive(self, owner: str | None) -> bool:
        return owner_alive(owner, read_beats(self.conn).get(owner or ""), time.time())

    def get(self, key: str) -> dict | None:
        row = self.conn.execute("SELECT * FROM runs WHERE key = ?", (key,)).fetchone()
        return None if row is None else self._row(row)

    def pruned_rows(self, key: str) -> list[dict]:
        """The rows moved off ``key`` (a complete run's key) when runs of its config were pruned, oldest first."""
        prefix = unpruned_key(key) + PRUNED_MARK
        rows = self.conn.execute("SELECT * FROM runs WHERE substr(key, 1, ?) = ? ORDER BY rowid",
                                 (len(prefix), prefix)).fetchall()
        return [self._row(row) for row in rows]

    def find(self, key: str, *, settled: bool = False) -> dict | None:
        """The row of a run registered under ``key``: there, or where it moved when it was pruned (the latest).
        ``settled`` (the outcome of an attempt that just ended): a pending or running row under the key is a
        complete run a sweep queued since the attempt was pruned, so the pruned row is the attempt's outcome."""
        row = self.get(key)
        if row is not None and not (settled and row["status"] in ("pending", "running")):
            return row
        moved = self.pruned_rows(key)
        return moved[-1] if moved else row

    def rows(self, *, parse: bool = True) -> list[dict]:
        """All rows in insertion order (``parse``: config and result parsed from JSON)."""
        rows = self.conn.execute("SELECT * FROM runs ORDER BY rowid").fetchall()
        return [self._row(row, parse=parse) for row in rows]

    def _row(self, row: sqlite3.Row, *, parse: bool = True) -> dict:
        out = row_dict(row, parse=parse)
        if self.schema < 2 and out["status"] in ("ok", "no_learning"):
            result = out["result"] if parse else parse_json(out["result"])[0]
            out["status"] = effective_status(out["status"], result)
        return out

    def counts(self, keys: Iterable[str] | None = None) -> dict[str, int]:
        statuses = self.statuses()
        wanted = statuses.keys() if keys is None else keys
        return dict.fromkeys(STATUSES, 0) | Counter(statuses[key] for key in wanted if key in statuses)


def _migrations(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    """Migrate a schema-1 store (in the caller's transaction); the folder renames it calls for, for folders
    here that hold the run (relative paths are the cwd's, as the sweep that wrote them ran)."""
    return [(src, dst) for src, dst, key in migrate_v1(conn, now_iso()) if _folder_holds(src, key)]


def _folder_holds(folder: str, key: str) -> bool:
    """Whether ``folder`` (relative paths: to the cwd) holds a result.json of the run ``key``."""
    try:
        result = json.loads((Path(folder) / "result.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and config_key(result.get("config") or {}) == key


def resolve_store_path(path: str | os.PathLike) -> Path:
    """A store file, or a sweep output folder holding ``results.sqlite``."""
    path = Path(path)
    if path.is_dir():
        path = path / STORE_NAME
    if not path.is_file():
        raise PeftlabError(f"results store not found: {path}",
                           fix="pass a sweep's results.sqlite (default runs/<spec name>/results.sqlite)")
    return path
