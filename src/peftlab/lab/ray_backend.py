"""``peftlab sweep --backend ray`` (and ``tune``, ``study``): each run as a Ray task.

The driver owns the SQLite store as the local backend does: it claims each run, submits it as a task and records
what the task returns (:class:`peftlab.lab.runner.Detached`), so the store never has to be reachable from other
machines. A task trains with :func:`peftlab.lab.runner.run_detached` (adopting a finished result.json, resuming a
checkpoint). A worker or node that dies mid-run is retried by Ray (``--max-retries``), resuming the run's
checkpoint, then recorded ``failed``; a killed driver leaves rows with a dead owner, which the next sweep resumes.

A cluster needs peftlab on every node and the runs' root and data at the same paths (run folders are absolute);
the driver's ``PEFTLAB_*``, ``HF_*``, ``TRANSFORMERS_*`` and ``TOKENIZERS_PARALLELISM`` variables reach the tasks.
Without ``--address`` a local Ray is started for the command and stopped after it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from peftlab.argtypes import nonnegative_float, nonnegative_int, positive_float, text
from peftlab.errors import PeftlabError
from peftlab.lab.runner import (
    Detached, limit_threads, log_path, resolve_train_fn, run_detached, train_fn_name, with_epoch_hook)

INSTALL_HINT = 'pip install "peftlab[ray]"  (or: pip install "ray[default]")'
DEFAULT_MAX_RETRIES = 2
# Seconds --address gets to answer before the command ends with one line: Ray's own join retries for minutes
# (its GCS client waits 30 s per attempt, 20 attempts) on an address where nothing, or something silent, listens.
DEFAULT_RAY_TIMEOUT = 30.0
UNREACHABLE_FIX = ("start the cluster (`ray start --head` on the head node), check HOST:PORT (the head's GCS port, "
                   "6379 by default), or raise --ray-timeout; drop --address to start a local Ray instead")
FORWARDED_ENV_PREFIXES = ("PEFTLAB_", "HF_", "TRANSFORMERS_")
FORWARDED_ENV = ("TOKENIZERS_PARALLELISM",)


def require_ray():
    """The ``ray`` module, or the one-line error that says how to install it."""
    try:
        import ray
    except ImportError:
        raise PeftlabError("--backend ray needs Ray, which is not installed", fix=INSTALL_HINT) from None
    return ray


@dataclass(frozen=True)
class RayOptions:
    """How runs are placed on Ray (``--address``, ``--cpus-per-run``, ``--gpus-per-run``, ``--max-retries``)."""

    address: str | None = None  # None: start a local Ray for this command
    cpus_per_run: float = 1.0
    gpus_per_run: float | None = None  # None: 1 when the cluster has GPUs, else 0
    max_retries: int = DEFAULT_MAX_RETRIES
    timeout: float = DEFAULT_RAY_TIMEOUT  # seconds --address gets to answer

    def __post_init__(self):
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise PeftlabError(f"--ray-timeout must be a number of seconds > 0, got {self.timeout!r}",
                               fix=f"e.g. --ray-timeout {DEFAULT_RAY_TIMEOUT:g}")
        if not self.cpus_per_run > 0:
            raise PeftlabError(f"--cpus-per-run must be > 0, got {self.cpus_per_run}")
        if self.gpus_per_run is not None and self.gpus_per_run < 0:
            raise PeftlabError(f"--gpus-per-run must be >= 0, got {self.gpus_per_run}",
                               fix="e.g. --gpus-per-run 1, or 0.25 to pack four small runs on one GPU")
        if self.max_retries < 0:
            raise PeftlabError(f"--max-retries must be >= 0, got {self.max_retries}")

    @classmethod
    def from_args(cls, args) -> "RayOptions":
        return cls(address=args.address, cpus_per_run=args.cpus_per_run, gpus_per_run=args.gpus_per_run,
                   max_retries=args.max_retries, timeout=args.ray_timeout)


def add_backend_flags(parser) -> None:
    """``--backend``, ``--address``, ``--ray-timeout``, ``--cpus-per-run``, ``--gpus-per-run``, ``--max-retries``
    (sweep, tune and study), each checked while the arguments are parsed, so ``--dry-run`` refuses a bad one too."""
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="local (default: this machine's processes) or ray (each run a Ray task; "
                             f"needs {INSTALL_HINT})")
    parser.add_argument("--address", type=text, default=None,
                        help="--backend ray: the Ray cluster to use (HEAD:6379 or auto; default: start a "
                             "local Ray for this command)")
    parser.add_argument("--ray-timeout", type=positive_float, default=DEFAULT_RAY_TIMEOUT, metavar="SECONDS",
                        help="--backend ray --address: seconds the cluster gets to answer before the command ends "
                             f"with one line saying so (default {DEFAULT_RAY_TIMEOUT:g})")
    parser.add_argument("--cpus-per-run", type=positive_float, default=1.0, metavar="N",
                        help="--backend ray: CPUs each run reserves (default 1)")
    parser.add_argument("--gpus-per-run", type=nonnegative_float, default=None, metavar="F",
                        help="--backend ray: GPUs each run reserves, fractions allowed (0.25: four runs per GPU; "
                             "default 1 when the cluster has GPUs, else 0)")
    parser.add_argument("--max-retries", type=nonnegative_int, default=DEFAULT_MAX_RETRIES, metavar="N",
                        help="--backend ray: times a run whose worker process died is started again, resuming "
                             f"its checkpoint (default {DEFAULT_MAX_RETRIES}); then it is recorded failed")


def check_backend_args(args) -> None:
    """Ray-only flags with the local backend are a mistake worth one line, not a silent no-op."""
    if getattr(args, "backend", "local") == "ray":
        return
    given = [flag for flag, value, default in (("--address", args.address, None),
                                                ("--cpus-per-run", args.cpus_per_run, 1.0),
                                                ("--gpus-per-run", args.gpus_per_run, None),
                                                ("--max-retries", args.max_retries, DEFAULT_MAX_RETRIES),
                                                ("--ray-timeout", args.ray_timeout, DEFAULT_RAY_TIMEOUT))
             if value != default]
    if given:
        raise PeftlabError(f"{given[0]} only applies to --backend ray", fix="add --backend ray, or drop it")


# --------------------------------------------------------------------------- connecting


@dataclass
class Connection:
    started_here: bool  # a local Ray this command started (and stops)
    gpus_per_run: float
    cpus_per_run: float
    slots: int  # runs the cluster can hold at once with these resources

    def describe(self) -> str:
        gpus = f", {self.gpus_per_run:g} GPU" if self.gpus_per_run else ""
        return f"Ray: {self.slots} run(s) at a time ({self.cpus_per_run:g} CPU{gpus} each)"


def probe_address(address: str, timeout: float) -> None:
    """Make sure something answers as a Ray cluster at ``address`` within ``timeout`` seconds, else one line.

    Ray's own join (``ray.init(address=...)``) retries for minutes where nothing listens, or where a listener
    accepts and never answers. Here: a TCP connection to the address as written (``auto``: the running
    cluster's recorded address), then gRPC's channel handshake (Ray's GCS speaks gRPC), both within the timeout.
    No proxy is used for it, so only that address is contacted."""
    import socket
    from urllib.parse import urlsplit

    import grpc

    target = address.split("://", 1)[-1]  # ray://HOST:PORT (Ray Client) is gRPC too
    if target == "auto":
        from ray._private.services import get_ray_address_from_environment

        target = get_ray_address_from_environment("auto", None)
        if target is None:
            return  # no cluster recorded here: ray.init says so at once
    parts = urlsplit(f"//{target}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise PeftlabError(f"--address {address} is not HOST:PORT", fix="e.g. --address 10.0.0.5:6379, or auto")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ConnectionRefusedError:
        raise PeftlabError(f"cannot reach Ray at --address {address}: nothing listens there (connection refused)",
                           fix=UNREACHABLE_FIX) from None
    except TimeoutError:
        raise PeftlabError(f"cannot reach Ray at --address {address}: no connection within --ray-timeout "
                           f"{timeout:g} s", fix=UNREACHABLE_FIX) from None
    except OSError as err:  # an unknown host name, an unreachable network
        raise PeftlabError(f"cannot reach Ray at --address {address}: {err.strerror or err}",
                           fix=UNREACHABLE_FIX) from None
    channel = grpc.insecure_channel(f"{host}:{port}", options=[("grpc.enable_http_proxy", 0)])
    try:
        grpc.channel_ready_future(channel).result(timeout=max(0.1, deadline - time.monotonic()))
    except grpc.FutureTimeoutError:
        raise PeftlabError(f"cannot reach Ray at --address {address}: it accepts connections but did not answer as "
                           f"a Ray cluster within --ray-timeout {timeout:g} s", fix=UNREACHABLE_FIX) from None
    finally:
        channel.close()


def connect(options: RayOptions, *, show_output: bool = False) -> Connection:
    """Join ``options.address`` (or a Ray this process already joined), else start a local Ray.
    ``show_output`` (``--verbose``): the tasks' output is printed here instead of only in the run logs."""
    ray = require_ray()
    started = False
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": show_output}
        if options.address:
            probe_address(options.address, options.timeout)
            kwargs["address"] = options.address
        else:
            kwargs["include_dashboard"] = False
        try:
            ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as err:
            where = f"--address {options.address}" if options.address else "a local Ray"
            raise PeftlabError(f"cannot start or reach Ray ({where}): {' '.join(str(err).split())[:300]}",
                               fix="start the cluster with `ray start --head` and pass its address "
                                   "(HEAD:6379, or auto on the head), or drop --address for a local Ray") from None
        started = not options.address
    resources = ray.cluster_resources()
    gpus = options.gpus_per_run
    if gpus is None:
        gpus = 1.0 if resources.get("GPU", 0) >= 1 else 0.0
    if gpus > resources.get("GPU", 0):
        _shutdown_if(started)
        raise PeftlabError(f"--gpus-per-run {gpus:g} but the Ray cluster has {resources.get('GPU', 0):g} GPU(s)",
                           fix="lower --gpus-per-run, or add GPU nodes (ray start --address ... --num-gpus N)")
    if options.cpus_per_run > resources.get("CPU", 0):
        _shutdown_if(started)
        raise PeftlabError(f"--cpus-per-run {options.cpus_per_run:g} but the Ray cluster has "
                           f"{resources.get('CPU', 0):g} CPU(s)", fix="lower --cpus-per-run")
    slots = int(resources.get("CPU", 0) // options.cpus_per_run)
    if gpus:
        slots = min(slots, int(resources.get("GPU", 0) // gpus))
    return Connection(started_here=started, gpus_per_run=gpus, cpus_per_run=options.cpus_per_run,
                      slots=max(1, slots))


def _shutdown_if(started: bool) -> None:
    if started:
        require_ray().shutdown()


def forwarded_env(local: bool) -> dict[str, str]:
    """The driver's variables the tasks get; on a local Ray also its import path (like multiprocessing's spawn),
    so a train function named "module:attr" imports in the workers as it does here."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV}
    if local:
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    return env


# --------------------------------------------------------------------------- inside a Ray worker


def execute_run(run: dict, fn_name: str, log: str | None, threads: int, reporter=None) -> dict:
    """One run in a Ray worker (:func:`peftlab.lab.runner.run_detached`); returns its outcome for the driver.

    ``reporter`` (``peftlab tune``) has ``hook()``: the run's ``on_epoch_end``, which reports each epoch's dev
    metric to the study and answers whether to stop (prune) the run."""
    limit_threads(threads)
    train_fn = with_epoch_hook(resolve_train_fn(fn_name), reporter.hook() if reporter is not None else None)
    return run_detached(run, train_fn, Path(log) if log else None, where="in a Ray worker",
                        adopt_pruned=reporter is not None)


# --------------------------------------------------------------------------- the driver's executor


def _absolute_run(run: dict) -> dict:
    """The task's copy of a run with an absolute output_dir (a worker's cwd is not the driver's on a cluster).
    The store keeps the config as registered: output_dir is not part of a run's key."""
    config = dict(run["config"])
    config["output_dir"] = str(Path(config["output_dir"]).resolve())
    return {"key": run["key"], "config": config}


class RayTasks(Detached):
    """Runs as Ray tasks: the driver claims each run, submits it, and records what the task returns."""

    def __init__(self, store, connection: Connection, options: RayOptions, *, train_fn: Callable | str | None,
                 log_dir: Path | None):
        super().__init__(store)
        ray = require_ray()
        self.ray = ray
        self.connection = connection
        self.slots = connection.slots
        self.log_dir = log_dir.resolve() if log_dir is not None else None
        self.fn_name = train_fn_name(train_fn)
        self.remote = ray.remote(execute_run).options(
            num_cpus=connection.cpus_per_run, num_gpus=connection.gpus_per_run,
            max_retries=options.max_retries, retry_exceptions=False,
            runtime_env={"env_vars": forwarded_env(local=connection.started_here or not options.address)})
        self.max_retries = options.max_retries
        self.in_flight: dict[Any, str] = {}  # object ref -> run key

    def start(self, run: dict, reporter) -> None:
        log = log_path(self.log_dir, run["key"])
        threads = max(1, int(self.connection.cpus_per_run))
        ref = self.remote.remote(_absolute_run(run), self.fn_name, str(log) if log else None, threads, reporter)
        self.in_flight[ref] = run["key"]

    def finished(self, timeout: float) -> list[tuple[str, dict]]:
        """Outcomes of the tasks that finished within ``timeout`` seconds: ``(key, {"result"|"error"})``."""
        if not self.in_flight:
            return []
        done, _ = self.ray.wait(list(self.in_flight), num_returns=len(self.in_flight), timeout=timeout)
        out = []
        for ref in done:
            key = self.in_flight.pop(ref)
            try:
                out.append((key, self.ray.get(ref)))
            except self.ray.exceptions.RayError as err:  # the worker (or node) died max_retries + 1 times
                reason = " ".join(str(err).split())[:300]
                out.append((key, {"result": None, "error": f"Ray worker died {self.max_retries + 1} time(s) "
                                                            f"({type(err).__name__}: {reason})"}))
        return out

    def cancel(self) -> None:
        """Stop every task still in flight (Ctrl-C)."""
        for ref in list(self.in_flight):
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - already finished or gone
                pass
        self.in_flight.clear()


# --------------------------------------------------------------------------- the sweep


class RaySession:
    """A sweep's Ray: :meth:`backend` is ``run_sweep``'s executor factory (``backend(store, log_dir, note)``), which
    starts (or joins) Ray only once a run is pending; :meth:`close` stops it if this command started it.
    :func:`peftlab.lab.sweep.run_sweep_ray` runs a sweep through one."""

    def __init__(self, options: RayOptions, *, train_fn: str | None = None, capture_output: bool = True):
        require_ray()
        self.options, self.train_fn, self.capture_output = options, train_fn, capture_output
        self.connections: list[Connection] = []

    def backend(self, store, log_dir, note) -> RayTasks:
        connection = connect(self.options, show_output=not self.capture_output)
        self.connections.append(connection)
        note(connection.describe())
        return RayTasks(store, connection, self.options, train_fn=self.train_fn, log_dir=log_dir)

    def close(self) -> None:
        for connection in self.connections:
            _shutdown_if(connection.started_here)
        self.connections.clear()
