"""curvature: the largest Hessian eigenvalue of a loss, block by block (``peftlab probe``'s numbers).

The operator is curvlinops' :class:`~curvlinops.HessianLinearOperator` (forward-over-reverse Hessian-vector
products through ``torch.func``: the exact Hessian, not the Gauss-Newton part); the solver is scipy's ``eigsh``
(ARPACK's Lanczos, ``which="LA"``). A block's eigenvalue is that of the Hessian restricted to the block (the
principal sub-matrix H_bb; the other parameters held where they are). Preconditioned curvature (Cohen et al.,
"Adaptive Gradient Methods at the Edge of Stability", 2022): the top eigenvalue of P^-1/2 H P^-1/2, P = Adam's
denominator diag(sqrt(v_hat) + eps) (``scale`` = P^-1/2, flat over the parameters).

SDPA on the CPU has no forward-mode derivative for its fused kernels: the products run on SDPA's math kernel (the
same function), in fp32, the model in eval mode (no dropout).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import nan
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


def block_solve(operator, block: torch.Tensor, scale: torch.Tensor | None, size: int, dtype, *, tol: float,
                ncv: int, seed: int) -> Solve:
    """eigsh on one block: its vector embedded in the flat parameter vector (zeros elsewhere), scaled on both
    sides by ``scale`` (preconditioning). A block whose top eigenvalue lies close to the next ones relative to the
    whole spectrum converges slowly in any Krylov method (Adam's scale where it has seen almost no gradient):
    after ``RESTARTS`` restarts it is reported as not converged (value NaN), never as a guess."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh
    from torch.nn.attention import SDPBackend, sdpa_kernel

    factor = None if scale is None else scale[block]
    count = 0

    def matvec(vector):
        nonlocal count
        count += 1
        column = torch.zeros(size, 1, dtype=dtype)
        part = torch.as_tensor(np.asarray(vector).reshape(-1), dtype=dtype)
        column[block, 0] = part if factor is None else part * factor
        with sdpa_kernel([SDPBackend.MATH]):  # forward-mode AD: SDPA's fused CPU kernels have none
            product = (operator @ column)[block, 0]
        product = product if factor is None else product * factor
        return product.detach().to(torch.float64).cpu().numpy()

    n = len(block)
    if n == 1:  # ARPACK needs two dimensions: a 1x1 block is its own eigenvalue
        return Solve(float(matvec(np.ones(1))[0]), count, True)
    try:
        values = eigsh(LinearOperator((n, n), matvec=matvec, dtype=np.float64), k=1, which="LA", tol=tol,
                       ncv=min(ncv, n), v0=np.random.default_rng(seed).standard_normal(n), maxiter=RESTARTS,
                       return_eigenvectors=False)
    except ArpackNoConvergence as err:
        values = err.eigenvalues  # the converged ones: none, for k=1
    return Solve(float(np.max(values)), count, True) if len(values) else Solve(nan, count, False)


def top_eigenvalues(model: torch.nn.Module, objective: Callable, params: list, blocks: list[list[int]], batch, *,
                    scales: list | None = None, tol: float = 2e-2, ncv: int = 8, seed: int = 0) -> list[Solve]:
    """The top eigenvalue of the Hessian of ``objective(model, batch)`` restricted to each block (indices into
    ``params``), on this batch. ``scales``: per block None (H_bb) or a flat tensor S, one entry per coordinate
    of all ``params`` (S H S restricted to the block: preconditioned curvature)."""
    operator = hessian_operator(model, objective, params, batch)
    size = sum(p.numel() for p in params)
    scales = [None] * len(blocks) if scales is None else scales
    return [block_solve(operator, index, scale, size, params[0].dtype, tol=tol, ncv=ncv, seed=seed + slot)
            for slot, (index, scale) in enumerate(zip(positions(params, blocks), scales))]
