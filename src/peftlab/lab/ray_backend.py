"""``peftlab sweep --backend ray`` (and ``tune``, ``study``): each run as a Ray task.

The driver owns the SQLite store as the local backend does: it claims each run, submits it as a task and records
what the task returns (:class:`peftlab.lab.runner.Executor`), so the store never has to be reachable from other
machines. A task trains with :func:`peftlab.lab.runner.run_logged` (adopting a finished result.json, resuming a
checkpoint). A worker or node that dies mid-run is retried by Ray (``--max-retries``), resuming the run's
checkpoint, then recorded ``failed``; a killed driver leaves rows with a dead owner, which the next sweep resumes.

A cluster needs peftlab on every node and the runs' root and data at the same paths (run folders are absolute);
the driver's ``PEFTLAB_*``, ``HF_*``, ``TRANSFORMERS_*`` and ``TOKENIZERS_PARALLELISM`` variables reach the tasks.
Without ``--address`` a local Ray is started for the command and stopped after it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from peftlab.argtypes import nonnegative_float, nonnegative_int, positive_float, text
from peftlab.errors import PeftlabError
from peftlab.lab.runner import (
    Executor, limit_threads, log_path, resolve_train_fn, run_logged, train_fn_name, with_epoch_hook)

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
    """How runs are placed on Ray: each field is the flag of its name (``--cpus-per-run``...)."""

    address: str | None = None  # None: start a local Ray for this command
    cpus_per_run: float = 1.0
    gpus_per_run: float | None = None  # None: 1 when the cluster has GPUs, else 0
    max_retries: int = DEFAULT_MAX_RETRIES
    ray_timeout: float = DEFAULT_RAY_TIMEOUT  # seconds --address gets to answer

    @classmethod
    def from_args(cls, args) -> "RayOptions":
        return cls(**{field.name: getattr(args, field.name) for field in fields(cls)})  # each field is a flag


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
    given = [field.name for field in fields(RayOptions) if getattr(args, field.name) != field.default]
    if given:
        raise PeftlabError(f"--{given[0].replace('_', '-')} only applies to --backend ray",
                           fix="add --backend ray, or drop it")


# --------------------------------------------------------------------------- connecting


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


def forwarded_env(local: bool) -> dict[str, str]:
    """The driver's variables the tasks get; on a local Ray also its import path (like multiprocessing's spawn),
    so a train function named "module:attr" imports in the workers as it does here."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV}
    if local:
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    return env


# --------------------------------------------------------------------------- inside a Ray worker


def execute_run(run, fn_name: str, log: str | None, threads: int, reporter=None) -> dict:
    """One run in a Ray worker (:func:`peftlab.lab.runner.run_logged`); returns its outcome for the driver.

    ``reporter`` (``peftlab tune``) has ``hook()``: the run's ``on_epoch_end``, which reports each epoch's dev
    metric to the study and answers whether to stop (prune) the run."""
    limit_threads(threads)
    return run_logged(run, with_epoch_hook(resolve_train_fn(fn_name), reporter), Path(log) if log else None,
                      where="in a Ray worker", adopt_pruned=reporter is not None)


# --------------------------------------------------------------------------- the driver's executor


class RayTasks(Executor):
    """Runs as Ray tasks: the driver claims each run, submits it, and records what the task returns. Ray is
    started (or joined) at the first run, and stopped at :meth:`close` if this command started it."""

    def __init__(self, store, train_fn: Callable | str | None, log_dir: Path | None, options: RayOptions, *,
                 note: Callable[[str], None], wait_if_held: bool):
        super().__init__(store, log_dir.resolve() if log_dir is not None else None, wait_if_held=wait_if_held)
        self.ray, self.options, self.note = require_ray(), options, note
        self.fn_name = train_fn_name(train_fn)
        self.refs: dict[Future, Any] = {}  # -> the task's object ref
        self.started_here = False  # a local Ray this command started (and stops)
        self.remote = None  # the task, once Ray is up
        self.fit = 1  # runs the cluster holds at once with these resources

    @property
    def slots(self) -> int:
        self.connect()
        return self.fit

    def connect(self) -> None:
        """Join ``--address`` (or a Ray this process already joined), else start a local Ray; once. The tasks'
        output is printed here too with ``--verbose`` (no log folder)."""
        if self.remote is not None:
            return
        ray, options = self.ray, self.options
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": self.log_dir is None}
            if options.address:
                probe_address(options.address, options.ray_timeout)
                kwargs["address"] = options.address
            else:
                kwargs["include_dashboard"] = False
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as err:
                where = f"--address {options.address}" if options.address else "a local Ray"
                raise PeftlabError(f"cannot start or reach Ray ({where}): {' '.join(str(err).split())[:300]}",
                                   fix="start the cluster with `ray start --head` and pass its address (HEAD:6379, "
                                       "or auto on the head), or drop --address for a local Ray") from None
            self.started_here = not options.address  # close() stops it, also after an error below
        resources = ray.cluster_resources()
        cpus, gpus = options.cpus_per_run, options.gpus_per_run
        if gpus is None:
            gpus = 1.0 if resources.get("GPU", 0) >= 1 else 0.0
        if gpus > resources.get("GPU", 0):
            raise PeftlabError(f"--gpus-per-run {gpus:g} but the Ray cluster has {resources.get('GPU', 0):g} GPU(s)",
                               fix="lower --gpus-per-run, or add GPU nodes (ray start --address ... --num-gpus N)")
        if cpus > resources.get("CPU", 0):
            raise PeftlabError(f"--cpus-per-run {cpus:g} but the Ray cluster has {resources.get('CPU', 0):g} CPU(s)",
                               fix="lower --cpus-per-run")
        fit = [resources.get("CPU", 0) // cpus] + ([resources.get("GPU", 0) // gpus] if gpus else [])
        self.fit = max(1, int(min(fit)))
        self.note(f"Ray: {self.fit} run(s) at a time ({cpus:g} CPU{f', {gpus:g} GPU' if gpus else ''} each)")
        self.remote = ray.remote(execute_run).options(
            num_cpus=cpus, num_gpus=gpus, max_retries=options.max_retries, retry_exceptions=False,
            runtime_env={"env_vars": forwarded_env(local=self.started_here or not options.address)})

    def start(self, run, reporter) -> Future:
        log = log_path(self.log_dir, run.key)
        self.connect()
        threads = max(1, int(self.options.cpus_per_run))
        # the task's copy has an absolute output_dir (a worker's cwd is not the driver's on a cluster); the store
        # keeps the config as registered: output_dir is not part of a run's key
        run = replace(run, config={**run.config, "output_dir": str(Path(run.output_dir).resolve())})
        ref = self.remote.remote(run, self.fn_name, str(log) if log else None, threads, reporter)
        future = ref.future()
        self.refs[future] = ref  # held until the outcome is in the future: Ray frees an object nobody refers to
        future.add_done_callback(lambda done: self.refs.pop(done, None))
        return future

    def lost(self, key: str, err: Exception) -> str:
        if not isinstance(err, self.ray.exceptions.RayError):
            raise err
        # the worker (or node) died max_retries + 1 times
        return (f"Ray worker died {self.options.max_retries + 1} time(s) "
                f"({type(err).__name__}: {' '.join(str(err).split())[:300]})")

    def cancel(self) -> None:
        """Stop every task still in flight (Ctrl-C)."""
        for ref in list(self.refs.values()):
            with contextlib.suppress(Exception):  # already finished or gone
                self.ray.cancel(ref, force=True)

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()
