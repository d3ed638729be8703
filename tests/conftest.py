"""Shared fixtures: offline environment, fixed seeds and tiny random-config transformers.

Tiny models follow peft's test style: ``AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2,
num_attention_heads=4, intermediate_size=64)`` plus ``AutoModelForSequenceClassification.from_config``, built
from a fixed seed so that two builds of the same architecture have identical weights.
"""

from __future__ import annotations

import gc
import os

# Never reach the network from the test suite (set before transformers/huggingface_hub are imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# scripts/test.sh runs the suite in one pytest-xdist worker per core (this process is one when this is set).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
# Under that run, inductor's default pool of compile subprocesses (one per core, each importing torch) only adds
# work to cores that are already busy: measured on the compiled-equals-eager test with a cold cache, 128 -> 106
# CPU-s. Set before torch is imported, as inductor reads it at import.
if XDIST_WORKER:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

import pytest  # noqa: E402

if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported where it is used, never at this module's top: the fake train functions that sweep, tune and
# study tests hand to subprocesses and spawned workers live in test modules that import DATA_DIR from here, and
# each of those processes would otherwise pay torch's import (~1.5 s) for nothing.


def pytest_configure(config):
    """Each worker computes with one thread, so two workers on two cores do not oversubscribe them (OpenMP
    threads spin-wait on a busy core). Subprocesses a test starts keep torch's default or the --threads the test
    gives them."""
    if XDIST_WORKER:
        import torch

        torch.set_num_threads(1)

# --------------------------------------------------------------------------- the shared data, found once
# The one place tests look for ../shared/data: $PEFTLAB_DATA_DIR, else ./data in the checkout, else the
# shared folder beside it. A test that needs a file is marked with needs_data(...): without the file it is
# skipped with a reason starting "data:", and with PEFTLAB_REQUIRE_DATA=1 (CI) that skip is a failure.
REPO = Path(__file__).resolve().parents[1]
REQUIRE_DATA = os.environ.get("PEFTLAB_REQUIRE_DATA", "") not in ("", "0")


def _data_dir() -> Path:
    for root in (os.environ.get("PEFTLAB_DATA_DIR"), REPO / "data", REPO.parent / "shared" / "data"):
        if root and Path(root).is_dir():
            return Path(root).resolve()
    return (REPO.parent / "shared" / "data").resolve()


DATA_DIR = _data_dir()


def needs_data(*parts: str):
    """skipif the data file DATA_DIR/<parts> is missing (a failure in CI, see REQUIRE_DATA)."""
    path = DATA_DIR.joinpath(*parts)
    return pytest.mark.skipif(not path.exists(), reason=f"data: {path} not found (set PEFTLAB_DATA_DIR)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_DATA and report.skipped and isinstance(report.longrepr, tuple) and "data:" in str(report.longrepr[2]):
        report.outcome = "failed"
        report.longrepr = f"PEFTLAB_REQUIRE_DATA is set, so a missing-data skip fails: {report.longrepr[2]}"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Run the modules that hold a ``slow`` test first, each module's tests kept together and in order.

    Why: scripts/test.sh runs pytest-xdist's worksteal, which hands each worker a contiguous share and lets an idle
    worker steal from the end of the longest queue. A minute-long test near the end of the collection can only be
    run by whichever worker reaches it, so the other one idles; at the front, the light tests behind it are what
    gets stolen and both workers end together. Whole modules move (not single tests) so that a module's fixtures
    are still built once per worker. The order is a pure function of the collection: every worker computes the
    same one, as xdist requires.
    """
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    slow_modules = {module(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: module(item) not in slow_modules)  # a stable sort: the rest keeps its order


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap_per_module():
    """Move every object alive at a test module's start into gc's permanent generation.

    Why: the lab's runner ends every run with ``gc.collect()`` and Python runs automatic full collections; each
    one walks the whole heap of this long pytest process (torch, transformers, every imported test module), so
    test_study.py took 57 s alone but 215 s late in the full suite. Frozen objects are skipped by later
    collections, which then scan only what the module itself made. Cyclic garbage is collected first, so
    nothing that is already unreachable is kept.
    """
    gc.collect()
    gc.freeze()
    yield


TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TINY_VOCAB = 128  # small embedding tables keep model construction in milliseconds
PAD_ID = 0  # decoders need a pad token for sequence classification; test inputs never contain it

# model_type -> extra config overrides. GPT-2 (Conv1D ``attn.c_attn``), Phi-3, Falcon and ModernBERT fuse q, k, v.
TINY_OVERRIDES: dict[str, dict] = {
    "bert": {},
    "llama": dict(num_key_value_heads=2),  # GQA: k and v are 32 -> 16
    "deberta-v2": {},
    "qwen2": dict(num_key_value_heads=2),  # like Llama, but q/k/v carry biases
    "qwen3": dict(num_key_value_heads=2, head_dim=8),  # q/k norms; its default head_dim is 128
    "gemma3_text": dict(num_key_value_heads=2, head_dim=8),  # default head_dim 256
    "mpnet": {},
    "gpt2": dict(n_inner=64),
    "phi3": dict(num_key_value_heads=2),  # fused qkv_proj with GQA widths 32 | 16 | 16
    "falcon": {},  # multi-query by default: query_key_value is [q | one k head | one v head]
}


def build_tiny(model_type: str, *, num_labels: int = 2, seed: int = 0, **overrides):
    """A tiny random ``AutoModelForSequenceClassification`` of ``model_type`` in eval mode, from ``seed``;
    ``overrides`` go into its config after ``TINY_OVERRIDES`` (e.g. Falcon's ``new_decoder_architecture=True``)."""
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    config = AutoConfig.for_model(
        model_type, vocab_size=TINY_VOCAB, num_labels=num_labels, pad_token_id=PAD_ID,
        **{**TINY, **TINY_OVERRIDES.get(model_type, {}), **overrides},
    )
    import torch

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    return model.eval()


def tiny_inputs(batch: int = 3, length: int = 9, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids in [1, TINY_VOCAB) (no pad token) with an all-ones attention mask."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, TINY_VOCAB, (batch, length), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def corrupt_parts(folder: Path, count: int) -> list[Path]:
    """``count`` small fake part-wheel files of different bytes: their join matches no real SHA-256."""
    parts = [folder / f"part{i:03d}" for i in range(count)]
    for i, part in enumerate(parts):
        part.write_bytes(bytes([i]) * 1000)
    return parts


@pytest.fixture(autouse=True)
def _fixed_seed():
    """Every test starts from the same global RNG state."""
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture
def single_thread():
    """One intra-op thread for tests of tiny models: their matrices are too small to split, and on a busy
    2-core machine the thread pool's hand-offs made a 32 x 32 SVD take ~0.1 s instead of ~0.1 ms."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_model():
    """Factory fixture: ``tiny_model("bert")`` -> a fresh tiny model; same weights on every call."""
    return build_tiny


@pytest.fixture(scope="session")
def inputs():
    return tiny_inputs()


@pytest.fixture(scope="module")
def chatty_llama():
    """tiny-llama with large random weights: greedy decoding says different things, of different lengths, for
    different prompts (a freshly initialised tiny model repeats one token)."""
    import torch

    from peftlab.models.registry import load_model

    model, tokenizer = load_model("tiny-llama", head="causal-lm")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.eval(), tokenizer

