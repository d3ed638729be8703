"""``--compile auto|on|off``: ``torch.compile`` of the model for the train step, and the fallback to eager.

What is compiled: the run's prepared model, as the train step calls it (``model(**batch).loss``); AOTAutograd
compiles its backward with it. The method's extra loss (KaSA's regulariser), the optimizer step (AdamW over the
per-projection groups, whose learning rates the scheduler changes every step) and the gradient clipping stay
eager. The compiled module is a view of the run's model (:class:`CompiledTraining` ``.module``: it shares the
parameters and is used by :mod:`peftlab.training.step` only), so everything else uses the eager module as before:
the dev evaluations and generation (whose shapes and no-grad mode would compile graphs of their own), ``--save
best``'s copies, checkpoints and the saved adapter (no state dict ever carries ``_orig_mod.`` prefixes).

How it compiles (:func:`compile_for_training`):

* ``dynamic=True``: length-grouped batches change their padded length every batch (and the last batch its row
  count), so the graph is traced with symbolic batch and length dimensions once, instead of once per shape
  (dynamo would otherwise retrace at the second shape, and per shape for graphs behind a graph break such as
  DoRA's). Only a dimension of size 1 is specialised (dynamo's 0/1 rule): a batch of one row or one token
  compiles one more graph. ``tests/test_compile.py`` counts the graphs of a length-grouped run.
* inductor (C++ through the system compiler on a CPU) with ``fallback_random``: dropout draws its masks with the
  eager ops from torch's generator instead of inductor's own random stream, so a compiled run trains on the
  masks its eager twin draws (the same experiment: equal loss curves within float tolerance; a checkpoint's RNG
  state resumes it the same way).
* ``--packing``'s per-example attention (:mod:`peftlab.models.packed_attention`) loops over a data-dependent
  number of examples; it runs eagerly between compiled graphs (``torch.compiler.disable``: a graph break per
  layer, not a recompile per batch).

Failure: compilation happens at the first call. When the first compiled step fails in any way (dynamo cannot
trace the method, inductor or the C++ compiler fails, ...) the run prints one line and trains eagerly from that
very batch: its gradients are cleared and torch's RNG restored first, so the eager retry is exactly the step an
eager run makes. A compile error at a later step (a new shape, e.g. a batch of one) falls back the same way when
no gradient of the accumulation window is pending; otherwise it is raised (the run fails and can resume, with
``--compile off`` if need be: the key may change on ``--resume``). result.json ``compile`` records the choice,
the fallback and the graphs compiled.

``auto`` (:func:`choose`): compile when the run's optimizer steps reach the break-even measured on this device
type (:data:`AUTO_BREAK_EVEN_STEPS`: the steps after which the per-step gain has paid for the compile time).
Until ``python benchmarks/against_trainer.py --compile`` has measured it on a device type, auto stays eager there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

COMPILE_CHOICES = ("auto", "on", "off")
BACKEND = "inductor"  # torch.compile's backend (tests swap in "aot_eager": the same tracing without C++ builds)


def backend_name() -> str:
    """BACKEND as result.json records it: torch.compile also takes a callable backend, which JSON cannot hold."""
    return BACKEND if isinstance(BACKEND, str) else getattr(BACKEND, "__name__", type(BACKEND).__name__)
INDUCTOR_OPTIONS = {"fallback_random": True}  # dropout masks from torch's generator, as in eager (module doc)

# `--compile auto`: from how many optimizer steps a run compiles, per device type: the break-even of the compile
# time against the per-step gain, measured by `python benchmarks/against_trainer.py --compile` (MiniLM-L6, LoRA q,v,
# batch 32: docs/BENCHMARKS.md, "Compiled training steps"). None: not measured on that device type yet, so auto
# trains eagerly there (a compile that costs more than it saves must not be a default). math.inf: measured, and
# the compiled step is no faster than the eager one, so no run is long enough. CPU: measured on a 2-core AMD EPYC
# (AVX-512, no AMX), torch 2.13: compiled step 0.99x eager on RTE and 1.03x on MRPC (474 steps to break even), after a
# 23-25 s compile: within noise of no gain, so auto stays eager on CPU.
AUTO_BREAK_EVEN_STEPS: dict[str, float | None] = {"cpu": math.inf, "cuda": None}
BREAK_EVEN_SOURCE = "docs/BENCHMARKS.md, \"Compiled training steps\""


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
    if optimizer_steps < break_even:
        return CompileChoice(False, f"auto: {optimizer_steps} optimizer steps < {break_even}, the break-even "
                                    f"measured on {device_type} ({BREAK_EVEN_SOURCE})")
    return CompileChoice(True, f"auto: {optimizer_steps} optimizer steps >= {break_even}, the break-even measured "
                               f"on {device_type} ({BREAK_EVEN_SOURCE})")


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
    module doc: a failed compiled step is undone (``clear()`` drops its gradients; torch's RNG is restored) and
    run again eagerly, after one line through ``say``. The first call's seconds are kept (``first_step_s``)."""
    if compiled is None:
        return work()
    start = time.perf_counter() if compiled.first_step_s is None else None
    result = _attempt(compiled, work, trainable, clear, say)
    if start is not None:
        compiled.first_step_s = time.perf_counter() - start
    return result


def _attempt(compiled: CompiledTraining, work: Callable[[], T], trainable: list, clear: Callable[[], None],
             say: Callable[[str], None]) -> T:
    if not compiled.active:
        return work()
    pending = any(p.grad is not None for p in trainable)  # an accumulation window's earlier batches
    rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        result = work()
    except Exception as err:
        if pending or (compiled.confirmed and not is_compile_error(err)):
            raise
        compiled.fallback = one_line(err)
        say(f"compile: the train step did not compile ({compiled.fallback}); training eagerly")
        clear()
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])
        return work()
    if not compiled.confirmed:
        compiled.confirmed = True
        compiled.graphs_after_first_step = compiled_graphs()
    return result
