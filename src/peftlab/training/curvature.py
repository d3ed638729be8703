"""curvature: the largest Hessian eigenvalue of a loss, block by block (``peftlab probe``'s numbers).

The operator is curvlinops' :class:`~curvlinops.HessianLinearOperator` (the exact Hessian through ``torch.func``);
the eigen-solver is scipy's ``eigsh`` (``which="LA"``). A block is a set of the parameters: its eigenvalue is that
of the principal sub-matrix H_bb. All blocks of one batch are solved side by side, one ``eigsh`` thread each, and
every round of their Hessian-vector products is one product of the operator with a matrix (one column per block),
about 2.5x cheaper than the same products one at a time on MiniLM-L6. Preconditioned curvature (Cohen et al.
2022): with Adam's denominator P, the top eigenvalue of P^-1/2 H P^-1/2 (``scale`` = P^-1/2, flat). SDPA's fused
CPU kernels have no forward-mode derivative: the products run on SDPA's math kernel, in fp32, in eval mode.
"""

from __future__ import annotations

import threading
from math import nan
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from peftlab.errors import PeftlabError

EXTRA = "probe"
RESTARTS = 8  # eigsh's implicit restarts: at most ~ncv + RESTARTS * (ncv - 1) products per block and batch
# curvlinops-for-pytorch declares backpack-for-pytorch, which needs torchvision, whose install would replace the
# local CPU torch: the packages its Hessian operator imports are installed without their declared dependencies.
EXTRA_PACKAGES = ("curvlinops-for-pytorch>=3.0,<4", "einops>=0.3", "einconv>=0.1", "linear_operator>=0.2",
                  "opt-einsum>=3.4")
INSTALL = "pip install --no-deps " + " ".join(f"'{p}'" for p in EXTRA_PACKAGES)


def require_extra() -> None:
    """One line naming the extra when curvlinops is not installed."""
    try:
        import curvlinops  # noqa: F401
    except ImportError:
        raise PeftlabError(f"peftlab probe needs the optional extra '{EXTRA}' (curvlinops-for-pytorch), which is "
                           "not installed", fix=f"{INSTALL} (peftlab[{EXTRA}]; --no-deps keeps the CPU torch)") from None


@dataclass(frozen=True)
class Solve:
    """One block's top eigenvalue on one batch."""

    value: float  # NaN when eigsh did not converge
    matvecs: int  # Hessian-vector products eigsh asked for
    converged: bool


class LossOperatorInput(torch.nn.Module):
    """``objective(model, batch)`` as a module whose output is the loss (curvlinops' "prediction"): every task's
    own loss (and a method's extra loss) is then the function whose Hessian is taken, whatever its form."""

    def __init__(self, model: torch.nn.Module, objective: Callable):
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, batch):
        return self.objective(self.model, batch).reshape(1)


class TakeLoss(torch.nn.Module):
    """curvlinops' loss function of :class:`LossOperatorInput`: the loss itself (one batch: a sum of one)."""

    reduction = "sum"

    def forward(self, prediction, target):
        return prediction.sum()


def hessian_operator(model: torch.nn.Module, objective: Callable, params: list, batch):
    """curvlinops' Hessian of ``objective(model, batch)`` with respect to ``params``, on this one batch."""
    from curvlinops import HessianLinearOperator

    return HessianLinearOperator(LossOperatorInput(model, objective), TakeLoss(), params,
                                 [(batch, torch.zeros(1))], batch_size_fn=lambda batch: 1, num_data=1,
                                 check_deterministic=False)


def positions(params: list, members: list[list[int]]) -> list[torch.Tensor]:
    """For each block (indices into ``params``), its coordinates in the flat vector of all ``params``."""
    offsets = np.cumsum([0] + [p.numel() for p in params])
    return [torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in block]) for block in members]


class Rounds:
    """The eigsh threads of one batch meet here: when every running solver has asked for its product, one
    operator-matrix product answers all of them (``multiply``: {slot: vector} -> {slot: H_b vector})."""

    def __init__(self, multiply: Callable[[dict], dict], slots):
        self.multiply, self.active = multiply, set(slots)
        self.pending: dict = {}
        self.results: dict = {}
        self.error: BaseException | None = None
        self.lock = threading.Condition()

    def request(self, slot, vector: np.ndarray) -> np.ndarray:
        with self.lock:
            self.pending[slot] = vector
            self._run_when_all_asked()
            while slot not in self.results and self.error is None:
                self.lock.wait()
            if self.error is not None:
                raise RuntimeError("a Hessian-vector product failed") from self.error
            return self.results.pop(slot)

    def finish(self, slot) -> None:
        with self.lock:
            self.active.discard(slot)
            self._run_when_all_asked()

    def _run_when_all_asked(self) -> None:
        if not self.pending or set(self.pending) != self.active:
            return
        asked, self.pending = self.pending, {}
        try:
            self.results.update(self.multiply(asked))
        except BaseException as err:  # every waiting solver raises it
            self.error = err
        self.lock.notify_all()


def block_products(operator, index: list[torch.Tensor], scales: list, size: int, dtype):
    """``multiply`` of :class:`Rounds`: each block's vector embedded in the flat parameter vector (zeros
    elsewhere), scaled by its block's scale on both sides (preconditioning), one matrix product for all."""

    def multiply(asked: dict) -> dict:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        slots = list(asked)
        columns = torch.zeros(size, len(slots), dtype=dtype)
        for j, slot in enumerate(slots):
            block, scale = index[slot], scales[slot]
            vector = torch.as_tensor(asked[slot], dtype=dtype)
            columns[block, j] = vector if scale is None else vector * scale[block]
        with sdpa_kernel([SDPBackend.MATH]):  # forward-mode AD: SDPA's fused CPU kernels have none
            product = operator @ columns
        out = {}
        for j, slot in enumerate(slots):
            block, scale = index[slot], scales[slot]
            column = product[block, j] if scale is None else product[block, j] * scale[block]
            out[slot] = column.detach().to(torch.float64).cpu().numpy()
        return out

    return multiply


def solve(rounds: Rounds, slot, size: int, *, tol: float, ncv: int, seed: int, out: dict) -> None:
    """eigsh on one block, its products through ``rounds``; the result (or the error) in ``out[slot]``.

    A block whose top eigenvalue is close to the next ones relative to the whole spectrum converges slowly in any
    Krylov method (an indefinite preconditioned Hessian whose negative end is far larger: Adam's scale where it
    has seen almost no gradient; a 520-dimensional such block of a tiny model needed 600 to 3,000 products). After
    ``RESTARTS`` restarts the block is reported as not converged (value NaN), never as a guess."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    count = [0]

    def matvec(vector):
        count[0] += 1
        return rounds.request(slot, np.asarray(vector).reshape(-1))

    try:
        start = np.random.default_rng(seed).standard_normal(size)
        operator = LinearOperator((size, size), matvec=matvec, dtype=np.float64)
        if size == 1:  # ARPACK needs two dimensions: a 1x1 block is its own eigenvalue
            out[slot] = Solve(float(matvec(np.ones(1))[0]), count[0], True)
            return
        try:
            values = eigsh(operator, k=1, which="LA", tol=tol, ncv=min(ncv, size), v0=start, maxiter=RESTARTS,
                           return_eigenvectors=False)
        except ArpackNoConvergence as err:
            values = err.eigenvalues  # the converged ones: none, for k=1
        out[slot] = Solve(float(np.max(values)), count[0], True) if len(values) else Solve(nan, count[0], False)
    except BaseException as err:  # raised in the caller's thread
        out[slot] = err
    finally:
        rounds.finish(slot)


def top_eigenvalues(model: torch.nn.Module, objective: Callable, params: list, blocks: list[list[int]], batch, *,
                    scales: list | None = None, tol: float = 2e-2, ncv: int = 8, seed: int = 0) -> list[Solve]:
    """The top eigenvalue of the Hessian of ``objective(model, batch)`` restricted to each block (indices into
    ``params``), on this batch. ``scales``: per block None (H_bb) or a flat tensor S, one entry per coordinate
    of all ``params`` (S H S restricted to the block: preconditioned curvature)."""
    operator = hessian_operator(model, objective, params, batch)
    size = sum(p.numel() for p in params)
    index = positions(params, blocks)
    scales = [None] * len(blocks) if scales is None else scales
    multiply = block_products(operator, index, scales, size, params[0].dtype)
    out: dict = {}
    # Side by side where scipy's ARPACK is re-entrant (its C translation); before, eigsh holds a process-wide
    # lock, so the blocks are solved one after another.
    waves = [list(range(len(blocks)))] if arpack_is_reentrant() else [[slot] for slot in range(len(blocks))]
    for wave in waves:
        rounds = Rounds(multiply, wave)
        threads = [threading.Thread(target=solve, args=(rounds, slot, len(index[slot])),
                                    kwargs={"tol": tol, "ncv": ncv, "seed": seed + slot, "out": out}, daemon=True)
                   for slot in wave]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for slot in range(len(blocks)):
        if isinstance(out[slot], BaseException):
            raise out[slot]
    return [out[slot] for slot in range(len(blocks))]


def arpack_is_reentrant() -> bool:
    """scipy >= 1.17: ARPACK in C, no lock around eigsh (1.16 and before: a lock, and Fortran SAVE state)."""
    import scipy

    major, minor = (int(part) for part in scipy.__version__.split(".")[:2])
    return (major, minor) >= (1, 17)
