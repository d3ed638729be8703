"""Model FLOPs of a train step: the numerator of model FLOP utilisation, counted by
``torch.utils.flop_counter.FlopCounterMode``.

The step (forward, then backward from the logits) runs on a **meta-device copy** of the model: the same modules,
adapters and ``requires_grad`` flags, no data, no memory, no time; every matrix product's FLOPs (2·m·k·n, a
multiply-add is two) are counted as autograd runs them, backward included (a frozen weight gets no gradient, an
activation one only where a trainable parameter lies below it). The copy uses eager attention, so the scores
Q·Kᵀ and the values P·V are counted over each example's whole L×L square (PaLM's convention;
``FlopCounterMode`` has no formula for the CPU SDPA kernel). The loss itself (no matrix product) is left out:
backward starts from the logits' sum. Everything the step multiplies is counted, whichever architecture or
method: a LoRA-structured adapter's x·Aᵀ·Bᵀ (reported apart as ``adapter``: the ``lora_*`` modules), and also
DoRA's weight norm or VeRA's own products.

The tokens are the examples' real tokens (padding is not model work). A step's count is additive over the
examples of a batch, and for one example a polynomial ``c + a·n + b·n²`` of its length n (linear layers, then
the attention square): :class:`ExampleFlops` counts three lengths and checks a fourth, so the model FLOPs of a
whole training set cost four meta steps.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

METHOD = ("counted by torch.utils.flop_counter.FlopCounterMode on a meta-device copy (eager attention: each "
          "example's whole score square), forward and backward from the logits, every matrix product the step runs")
_ADAPTER_MODULE = re.compile(r"\.lora_[AB]\.[^.]+$")  # peft's LoRA factors (LoRA, PiSSA, MiLoRA, CorDA, KaSA, DoRA)


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one train step (forward + backward) on ``examples`` examples of ``tokens`` real tokens."""

    forward: int
    backward: int
    adapter: int  # the LoRA factors' share of forward + backward
    tokens: int
    examples: int

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every parameter and buffer on the meta device (tied weights stay tied), eager attention."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                            if isinstance(tensor, torch.nn.Parameter) else empty)
    meta = copy.deepcopy(model, memo)
    base = meta.get_base_model() if hasattr(meta, "get_base_model") else meta
    base.set_attn_implementation("eager")
    if getattr(base.config, "use_cache", None) is False:  # (Trainer turns it off) with no cache and no mask,
        base.config.use_cache = True  # transformers checks the position ids for packing: data a meta tensor lacks
    return meta


def _adapter_flops(counter: FlopCounterMode) -> int:
    counts = counter.get_flop_counts()
    return sum(sum(ops.values()) for name, ops in counts.items() if _ADAPTER_MODULE.search(name))


def count_step(meta: torch.nn.Module, rows: int, length: int) -> StepFlops:
    """The FLOPs of one train step of the meta copy on ``rows`` examples of ``length`` tokens each."""
    ids = torch.ones(rows, length, dtype=torch.long, device="meta")
    meta.train()
    with FlopCounterMode(display=False) as forward:
        logits = meta(input_ids=ids).logits
    with FlopCounterMode(display=False) as backward:
        if logits.requires_grad:  # nothing trains: no backward
            logits.float().sum().backward()
    meta.zero_grad(set_to_none=True)
    adapter = _adapter_flops(forward) + _adapter_flops(backward)
    return StepFlops(forward.get_total_flops(), backward.get_total_flops(), adapter, rows * length, rows)


def step_flops(model: torch.nn.Module, rows: int, length: int) -> tuple[StepFlops | None, str | None]:
    """(the count of a ``rows`` x ``length`` train step of ``model``, None), or (None, why it cannot be counted)."""
    try:
        return count_step(meta_copy(model), rows, length), None
    except Exception as err:  # an architecture the meta device or eager attention cannot run: say so, go on
        return None, f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def _quadratic(f1: int, f2: int, f3: int) -> tuple[int, int, int]:
    """(2c, 2a, 2b) of ``c + a·n + b·n²`` through its values at n = 1, 2, 3 (integers throughout)."""
    b2 = f3 - 2 * f2 + f1
    a2 = 2 * (f2 - f1) - 3 * b2
    return 2 * f1 - a2 - b2, a2, b2


class ExampleFlops:
    """The train-step FLOPs of one example as a function of its length, fitted exactly from meta steps."""

    FIELDS = ("forward", "backward", "adapter")

    def __init__(self, model: torch.nn.Module):
        meta = meta_copy(model)
        steps = [count_step(meta, 1, n) for n in (1, 2, 3)]
        self.coefficients = {f: _quadratic(*(getattr(step, f) for step in steps)) for f in self.FIELDS}
        check = count_step(meta, 2, 7).total
        if check != 2 * self.total(7):
            raise ValueError(f"a step's FLOPs are not additive over examples of one length ({check} counted for "
                             f"2 examples of 7 tokens, {2 * self.total(7)} expected)")

    def _value(self, field: str, length: int) -> int:
        c2, a2, b2 = self.coefficients[field]
        return (c2 + a2 * length + b2 * length * length) // 2

    def total(self, length: int) -> int:
        """FLOPs of one example of ``length`` tokens, forward and backward."""
        return self._value("forward", length) + self._value("backward", length)

    def of(self, lengths) -> StepFlops:
        """The model FLOPs of training on examples of these real lengths (every one at once: additive)."""
        lengths = [int(n) for n in lengths]
        forward, backward, adapter = (sum(self._value(f, n) for n in lengths) for f in self.FIELDS)
        return StepFlops(forward, backward, adapter, sum(lengths), len(lengths))

    def executed(self, shapes) -> int:
        """FLOPs of batches of ``(rows, length)``: what padded batches compute."""
        return sum(rows * self.total(length) for rows, length in shapes)
