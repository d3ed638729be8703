"""CorDA (Yang et al., NeurIPS 2024): context-oriented decomposition, through peft.

CorDA runs the model over a few calibration samples, accumulates each adapted layer's input covariance
``C = X^T X`` and initialises the adapter from r components of the SVD of ``W C``: the r smallest in the
knowledge-preserved mode (``kpm``), the r largest in the instruction-previewed mode (``ipm``). Either way they are
subtracted from the base weight, PiSSA's bookkeeping, so a trained CorDA adapter is saved converted to a plain
rank-2r LoRA (:func:`peftlab.methods.svd_lora.save_converted`). peftlab samples both modes' covariance from the
run's own training inputs (``--corda-samples``): ``ipm`` is the paper's setting, ``kpm`` preserves what the model
does on the task's own inputs (the paper samples a knowledge benchmark). peft's covariance hook expects one
sequence per forward call (it normalises each call's activations by their maximum), so the samples are fed one at
a time, with padding removed.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

# keys of a collated example that are not model inputs for a calibration forward pass
_NOT_INPUTS = ("labels", "label", "length")


def unpadded(batch: dict[str, Any]) -> dict[str, Any]:
    """A collated batch of ONE example with padded positions removed (left or right padding) and no labels."""
    batch = {k: v for k, v in batch.items() if k not in _NOT_INPUTS}
    mask = batch.get("attention_mask")
    if mask is None:
        return batch
    keep = mask[0].bool()
    length = keep.shape[0]
    return {k: (v[:, keep] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[:2] == (1, length) else v)
            for k, v in batch.items()}


def calibration_from_examples(model: nn.Module, examples: Callable[[], Iterable[dict[str, Any]]]
                              ) -> Callable[[], None]:
    """A zero-argument callable that runs ``model`` (no grad, eval mode) over collated one-example batches,
    unpadded; ``examples`` returns them when CorDA asks (nothing is read before)."""

    @torch.no_grad()
    def run() -> None:
        was_training = model.training
        model.eval()
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            for batch in examples():
                batch = unpadded(batch)
                model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
        finally:
            model.train(was_training)

    return run


def calibration_runner(model: nn.Module, train_dataset, collate: Callable, samples: int) -> Callable[[], None]:
    """Calibration over the first ``samples`` training examples (the run's seeded subset), one per forward.
    ``train_dataset`` and ``collate`` are the run's :class:`peftlab.tasks.prepare.Pipeline` fields, so the inputs
    are tokenised, truncated and collated exactly like the training batches."""
    def examples():
        for index in range(min(int(samples), len(train_dataset))):
            yield collate([{k: v for k, v in train_dataset[index].items() if k != "length"}])

    return calibration_from_examples(model, examples)


def build(model: nn.Module, lora_config, cfg, calibration: Callable[[], None]) -> nn.Module:
    """``preprocess_corda`` (covariance over ``calibration``, SVD of W*C) then ``get_peft_model``."""
    from peft import get_peft_model
    from peft.tuners.lora.corda import preprocess_corda

    preprocess_corda(model, lora_config, run_model=calibration)
    model = get_peft_model(model, lora_config)
    # The init is done (and the adapter is saved converted to plain LoRA): a corda_config left in the saved
    # adapter_config.json would only make peft warn "corda_config ... will be ignored" on every load.
    model.peft_config["default"].corda_config = None
    return model
