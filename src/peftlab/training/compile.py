"""``--compile auto|on|off``: ``torch.compile`` of the model for the train step, and the fallback to eager.

Only the train step's ``model(**batch).loss`` and its backward are compiled, through a view sharing the run's
parameters (:class:`CompiledTraining` ``.module``); the extra loss, the optimizer step, evaluation, generation,
checkpoints and the saved adapter use the eager module (no ``_orig_mod.`` prefixes). ``dynamic=True``:
length-grouped batches change their padded length every batch. Inductor's ``fallback_random``: dropout draws its
masks from torch's generator, so a compiled run trains on the masks of its eager twin and resumes the same way.

A compiled step that fails prints one line and the run trains eagerly from that very batch (gradients cleared,
torch's RNG restored); a later compile error falls back the same way unless a gradient of the accumulation window
is pending (then it is raised). ``auto`` compiles when the run's optimizer steps reach the break-even measured on
its device type (:data:`AUTO_BREAK_EVEN_STEPS`, by ``python benchmarks/against_trainer.py --compile``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

BACKEND = "inductor"  # torch.compile's backend (tests swap in "aot_eager": the same tracing without C++ builds)
INDUCTOR_OPTIONS = {"fallback_random": True}  # dropout masks from torch's generator, as in eager (module doc)

# `--compile auto`: from how many optimizer steps a run compiles, per device type (docs/BENCHMARKS.md, "Compiled
# training steps"). None: not measured there yet, so auto trains eagerly (a compile that costs more than it saves
# must not be a default). math.inf: the compiled step is no faster. CPU: on a 2-core AMD EPYC (AVX-512, no AMX),
# torch 2.13, the compiled step ran 0.99x-1.03x eager after a 23-25 s compile: within noise of no gain.
AUTO_BREAK_EVEN_STEPS: dict[str, float | None] = {"cpu": math.inf, "cuda": None}
BREAK_EVEN_SOURCE = "docs/BENCHMARKS.md, \"Compiled training steps\""


def backend_name() -> str:
    """BACKEND as result.json records it: torch.compile also takes a callable backend, which JSON cannot hold."""
    return BACKEND if isinstance(BACKEND, str) else getattr(BACKEND, "__name__", type(BACKEND).__name__)


@dataclass(frozen=True)
class CompileChoice:
    """Whether a run compiles its train step, and why (the start-up line and result.json ``compile``)."""

    enabled: bool
    reason: str


def choose(requested: str, device_type: str, optimizer_steps: int) -> CompileChoice:
    """``--compile`` resolved for a run of ``optimizer_steps`` optimizer steps on ``device_type``."""
    if requested == "off":
        return CompileChoice(False, "--compile off")
    if requested == "on":
        return CompileChoice(True, "--compile on")
    break_even = AUTO_BREAK_EVEN_STEPS.get(device_type)
    if break_even is None:
        return CompileChoice(False, f"auto: no break-even measured on {device_type} yet ({BREAK_EVEN_SOURCE})")
    if math.isinf(break_even):
        return CompileChoice(False, f"auto: a compiled step measured no faster than an eager one on {device_type} "
                                    f"({BREAK_EVEN_SOURCE}); --compile on forces it")
    enough = optimizer_steps >= break_even
    return CompileChoice(enough, f"auto: {optimizer_steps} optimizer steps {'>=' if enough else '<'} {break_even}, "
                                 f"the break-even measured on {device_type} ({BREAK_EVEN_SOURCE})")


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class CompiledTraining:
    """The train step's compiled view of the run's model, and what became of it (never saved, never evaluated)."""

    requested: str  # --compile as given
    choice: CompileChoice
    module: torch.nn.Module | None = None  # torch.compile(model): shares its parameters; None when not compiling
    confirmed: bool = False  # a compiled step has run through (forward and backward)
    fallback: str | None = None  # why the run went eager after all (one line)
    graphs_at_start: int = 0  # compiled_graphs() before the first step: this run's graphs are those after it
    graphs_after_first_step: int | None = None
    first_step_s: float | None = None  # the first batch's forward and backward (compiled: its compilation too)

    @property
    def active(self) -> bool:
        return self.module is not None and self.fallback is None

    def record(self) -> dict:
        """result.json ``compile``: the choice, whether it stayed compiled, the graphs compiled (all steps, and
        after the first: more means recompiles)."""
        graphs = compiled_graphs() - self.graphs_at_start if self.module is not None else 0
        first = None if self.graphs_after_first_step is None else self.graphs_after_first_step - self.graphs_at_start
        return {"requested": self.requested, "enabled": self.choice.enabled, "reason": self.choice.reason,
                "compiled": self.active and self.confirmed, "fallback": self.fallback,
                "backend": backend_name() if self.module is not None else None, "graphs": graphs,
                "graphs_after_first_step": first, "first_step_s": self.first_step_s}


def compile_for_training(model: torch.nn.Module, requested: str, device_type: str,
                         optimizer_steps: int) -> CompiledTraining:
    """``--compile`` for a run: the choice, and when it compiles the (lazy) compiled module of ``model``."""
    choice = choose(requested, device_type, optimizer_steps)
    compiled = CompiledTraining(requested, choice)
    if not choice.enabled:
        return compiled
    import torch._dynamo

    # One run at a time per process: a sweep worker's earlier runs must not leave compiled code whose guards count
    # toward dynamo's recompile limit (past it dynamo runs eagerly without a word).
    torch._dynamo.reset()
    options = dict(INDUCTOR_OPTIONS) if BACKEND == "inductor" else None
    try:
        compiled.module = torch.compile(model, backend=BACKEND, dynamic=True, options=options)
    except Exception as err:  # torch.compile itself refuses (e.g. an unsupported Python): eager, said once
        compiled.fallback = one_line(err)
    compiled.graphs_at_start = compiled_graphs()
    return compiled


def training_module(compiled: CompiledTraining | None, model: torch.nn.Module) -> torch.nn.Module:
    """What the train step calls: the compiled module while it works, else the eager model."""
    return compiled.module if compiled is not None and compiled.active else model


def one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def is_compile_error(err: BaseException) -> bool:
    """dynamo's and inductor's own failures (``TorchDynamoException``: BackendCompilerFailed, InductorError,
    Unsupported ...), as opposed to what the model itself raises (a bad batch, out of memory)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(err, TorchDynamoException)


def guarded_step(compiled: CompiledTraining | None, work: Callable[[], T], trainable: list,
                 clear: Callable[[], None], say: Callable[[str], None] = print) -> T:
    """``work()`` (one batch's forward and backward through :func:`training_module`) with the fallback of the
    module doc: a failed compiled step is undone (``clear()`` drops its gradients) and run again eagerly, after one
    line through ``say``. The first call's seconds are kept (``first_step_s``)."""
    if compiled is None:
        return work()
    start, active = time.perf_counter(), compiled.active
    pending = active and any(p.grad is not None for p in trainable)  # an accumulation window's earlier batches
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        result = work()
    except Exception as err:
        if not active or pending or (compiled.confirmed and not is_compile_error(err)):
            raise
        compiled.fallback = one_line(err)
        say(f"compile: the train step did not compile ({compiled.fallback}); training eagerly")
        clear()
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        result = work()
    if compiled.active and not compiled.confirmed:
        compiled.confirmed = True
        compiled.graphs_after_first_step = compiled_graphs()
    if compiled.first_step_s is None:
        compiled.first_step_s = time.perf_counter() - start
    return result
