"""The public Python API in ``peftlab/__init__.py``: its docstring example runs as written (a doctest on
tiny-bert), every exported name resolves, and ``import peftlab`` alone does not import torch."""

from __future__ import annotations

import doctest
import subprocess
import sys

import pytest


def test_the_docstring_example_runs_as_written():
    import peftlab

    outcome = doctest.testmod(peftlab, optionflags=doctest.ELLIPSIS, verbose=False)
    assert outcome.attempted >= 8, "the example lost its steps"
    assert outcome.failed == 0


def test_every_exported_name_resolves():
    import peftlab

    for name in peftlab.__all__:
        assert getattr(peftlab, name) is not None, name
    assert set(peftlab.__all__) <= set(dir(peftlab))
    with pytest.raises(AttributeError, match="no attribute 'apply_methods'"):
        peftlab.apply_methods  # noqa: B018 - a typo is an AttributeError, not a silent None


def test_import_peftlab_does_not_import_torch():
    code = "import sys, peftlab; peftlab.PeftlabError; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_configure_optimizer_groups_follow_lr_ratio():
    import peftlab

    model, _ = peftlab.load_model("tiny-bert")
    applied = peftlab.apply_method(model, peftlab.MethodConfig(method="lora", targets=("q", "k", "v"), rank=2),
                                   task_type="SEQ_CLS")
    optimizer = peftlab.configure_optimizer(applied, peftlab.OptimConfig(lr=2e-4, lr_ratio=8, head_lr=1e-3))
    lrs = {group["name"]: group["lr"] for group in optimizer.param_groups}
    assert lrs == {"q": 2e-4, "k": 2e-4, "v": 1.6e-3, "head": 1e-3}
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in applied.model.parameters() if p.requires_grad}
