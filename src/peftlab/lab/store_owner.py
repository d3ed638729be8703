"""Who holds a running row of a results store, and whether it still does: a heartbeat in the store itself.

A claim writes its owner (``host|pid|token``) into the row and its beat into the ``owners`` table; a daemon thread
renews the beat while the Store that claimed is open. A beat older than the lease is gone; on the holder's own
machine a missing pid is gone at once, and a recycled pid never beats under the old token. The lease must exceed
the clock skew between machines and the longest wait for the write lock.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import sqlite3
import threading
import time
from pathlib import Path

BEAT_SECONDS = 5.0
LEASE_SECONDS = 60.0

_identity: tuple[int, str] | None = None  # (pid, owner string): a forked child gets its own


def process_identity() -> str:
    """This process's owner string ``host|pid|token``; the token tells a recycled pid from this process."""
    global _identity
    if _identity is None or _identity[0] != os.getpid():
        _identity = (os.getpid(), f"{socket.gethostname()}|{os.getpid()}|{secrets.token_hex(4)}")
    return _identity[1]


def owner_host(owner: str | None) -> tuple[str | None, int | None]:
    """(host, pid) of an owner string; (None, None) when it is not one."""
    match = re.fullmatch(r"([^|]*)\|(\d+)\|[^|]*", owner or "")
    return (match[1], int(match[2])) if match else (None, None)


def owner_alive(owner: str | None, beat: float | None, now: float) -> bool:
    """Whether the holder named by ``owner`` still holds its rows: its last ``beat`` (unix seconds; None when it
    never beat) is within the lease at ``now``, and, when it names a process of this machine, that pid exists."""
    host, pid = owner_host(owner)
    if host is None or beat is None or now - beat > LEASE_SECONDS:
        return False
    if host == socket.gethostname():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False  # killed: no need to wait out its lease
        except PermissionError:
            pass  # another user's process: it exists
    return True


def read_beats(conn: sqlite3.Connection) -> dict[str, float]:
    """owner -> last beat; empty for a store written before heartbeats (no ``owners`` table)."""
    try:
        return {row[0]: float(row[1]) for row in conn.execute("SELECT owner, beat FROM owners")}
    except sqlite3.OperationalError:  # no such table: nobody beats there, so no running row is held
        return {}


def write_beat(conn: sqlite3.Connection, owner: str, now: float) -> None:
    conn.execute("INSERT OR REPLACE INTO owners (owner, beat) VALUES (?, ?)", (owner, now))


class Heartbeat(threading.Thread):
    """The beat of one Store that claimed a row: a daemon thread with its own connection, renewing ``owner``'s
    beat until :meth:`stop` (the Store's close). Several Stores of one process beat under the same owner."""

    def __init__(self, path: Path, owner: str):
        super().__init__(name=f"peftlab-heartbeat-{Path(path).name}", daemon=True)
        self.path, self.owner = path, owner
        self.stopped = threading.Event()

    def run(self) -> None:
        conn = sqlite3.connect(str(self.path), timeout=BEAT_SECONDS, isolation_level=None)
        try:
            while not self.stopped.wait(BEAT_SECONDS):
                with contextlib.suppress(sqlite3.Error):  # locked, or a full disk: the next tick tries again
                    write_beat(conn, self.owner, time.time())
        finally:
            conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.join()
