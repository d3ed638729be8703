"""Who holds a running row of a results store: an owner string ``host|pid|process start time``, and whether
that process still runs (:mod:`peftlab.lab.store` claims rows with it; ``peftlab store check`` and a sweep
waiting for another process's runs read it).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def _proc_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), so a recycled pid is not mistaken for it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def process_identity(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}|{pid}|{_proc_start_time(pid) or ''}"


def owner_alive(owner: str | None) -> bool:
    """Whether the process named by an owner string still runs. Other hosts' processes count as alive."""
    if not owner:
        return False
    try:
        host, pid_text, start = owner.split("|")
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True  # cannot tell; never steal another machine's run
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if _proc_state(pid) in ("Z", "X"):  # killed but not yet reaped
        return False
    current = _proc_start_time(pid)
    return not (start and current and current != start)


def on_this_host(owner: str | None) -> bool:
    """Whether an owner string names a process of this machine (whose liveness :func:`owner_alive` can see)."""
    return (owner or "").split("|", 1)[0] == socket.gethostname() and (owner or "").count("|") == 2
