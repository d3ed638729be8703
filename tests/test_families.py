"""Every supported model family, one row each in ``FAMILIES``: the checks Yao et al.'s recipe needs on it.

For each row, a tiny random model (hidden 32, 2 layers, built offline from transformers' config class):

* q, k, v, o resolve to the family's modules, with the widths its config implies (GQA/MQA k and v narrower);
* a fused QKV matrix (GPT-2, Phi-3, Falcon in its three layouts, ModernBERT) splits into q/k/v layers whose
  outputs are exactly the slices the family's own attention code reads as query, key and value (the reference
  splits below are copied from each modeling file, or call it), and the split model computes the fused one's
  logits; a family with separate q/k/v is left as it is;
* ``--targets q,v --lr-ratio 4`` (LoRA, DoRA, full fine-tuning): the optimizer's groups put q at lr and v at
  4 x lr, there is no k group, and after a few AdamW steps k (and its slice of the fused matrix) is
  bit-identical while q and v moved;
* merged and fused back, the model saves as a standard folder of the original architecture that plain
  ``AutoModelForSequenceClassification.from_pretrained`` loads and that reproduces the trained logits.

Expectations are written from the configs and the modeling code, not from ``peftlab.methods.fused_qkv``.
A new family is one row.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from conftest import build_tiny, tiny_inputs
from peftlab.methods.optim_groups import OptimConfig, adamw, param_groups
from peftlab.methods.saving import merged
from peftlab.methods.table import MethodConfig, apply_method

pytestmark = pytest.mark.usefixtures("single_thread")

LR, LR_RATIO = 1e-2, 4.0
PEFT_PREFIX = "base_model.model."


def heads_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def gqa_widths(config) -> tuple[int, int, int]:
    """q, k, v output widths of a (grouped-query) attention: heads x head_dim, kv heads x head_dim."""
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_attention_heads * heads_dim(config), kv * heads_dim(config), kv * heads_dim(config)


def falcon_widths(config) -> tuple[int, int, int]:
    if config.new_decoder_architecture:
        return config.hidden_size, config.num_kv_heads * heads_dim(config), config.num_kv_heads * heads_dim(config)
    if config.multi_query:
        return config.hidden_size, heads_dim(config), heads_dim(config)
    return (config.hidden_size,) * 3


# ---- how each family's own attention code reads query, key and value out of its fused output (b, s, n):
# copied from (or calling) transformers' modeling files; each returns (q, k, v) flattened to (b, s, width).

def gpt2_reference(attn, fused):  # GPT2Attention.forward
    return fused.split(attn.split_size, dim=2)


def phi3_reference(attn, fused):  # Phi3Attention.forward
    query_pos = attn.config.num_attention_heads * attn.head_dim
    kv = attn.num_key_value_heads * attn.head_dim
    return fused[..., :query_pos], fused[..., query_pos:query_pos + kv], fused[..., query_pos + kv:]


def modernbert_reference(attn, fused):  # ModernBertAttention.forward
    qkv = fused.view(*fused.shape[:-1], 3, -1, attn.head_dim)
    return tuple(t.flatten(-2) for t in qkv.unbind(dim=-3))


def falcon_reference(attn, fused):  # FalconAttention._split_heads itself (k, v broadcast to all heads in GQA)
    return tuple(t.flatten(2, 3) for t in attn._split_heads(fused))


@dataclass(frozen=True)
class Family:
    model_type: str
    layer: str  # the attention module of block {i}
    projections: dict  # q, k, v, o -> module path under the layer (after the split, for a fused matrix)
    heads: tuple  # what a classification run trains in full
    widths: Callable = gqa_widths  # config -> q, k, v output widths
    fused: str | None = None  # the fused QKV module under the layer
    reference: Callable | None = None  # (attention module, fused output) -> q, k, v as the family reads them
    overrides: dict = field(default_factory=dict)  # config beyond conftest's TINY_OVERRIDES (a layout variant)

    def module(self, projection: str, i: int) -> str:
        return f"{self.layer.format(i=i)}.{self.projections[projection]}"

    def build(self):
        return build_tiny(self.model_type, **self.overrides)


BERT_LIKE = {"q": "self.query", "k": "self.key", "v": "self.value", "o": "output.dense"}
LLAMA_LIKE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def split_names(fused: str, o: str) -> dict:
    return {"q": f"{fused}.q_proj", "k": f"{fused}.k_proj", "v": f"{fused}.v_proj", "o": o}


FALCON = dict(model_type="falcon", layer="transformer.h.{i}.self_attention",
              projections=split_names("query_key_value", "dense"), heads=("score",), widths=falcon_widths,
              fused="query_key_value", reference=falcon_reference)
FAMILIES = {
    "bert": Family("bert", "bert.encoder.layer.{i}.attention", BERT_LIKE, ("classifier", "bert.pooler.dense")),
    "roberta": Family("roberta", "roberta.encoder.layer.{i}.attention", BERT_LIKE, ("classifier",)),
    "xlm-roberta": Family("xlm-roberta", "roberta.encoder.layer.{i}.attention", BERT_LIKE, ("classifier",)),
    "deberta-v2": Family("deberta-v2", "deberta.encoder.layer.{i}.attention",
                         {"q": "self.query_proj", "k": "self.key_proj", "v": "self.value_proj", "o": "output.dense"},
                         ("pooler", "classifier")),
    "electra": Family("electra", "electra.encoder.layer.{i}.attention", BERT_LIKE, ("classifier",)),
    "modernbert": Family("modernbert", "model.layers.{i}.attn", split_names("Wqkv", "Wo"), ("classifier",),
                         fused="Wqkv", reference=modernbert_reference),
    "gpt2": Family("gpt2", "transformer.h.{i}.attn", split_names("c_attn", "c_proj"), ("score",),
                   widths=lambda c: (c.n_embd,) * 3, fused="c_attn", reference=gpt2_reference),
    "llama": Family("llama", "model.layers.{i}.self_attn", LLAMA_LIKE, ("score",)),
    "qwen2": Family("qwen2", "model.layers.{i}.self_attn", LLAMA_LIKE, ("score",)),
    "qwen3": Family("qwen3", "model.layers.{i}.self_attn", LLAMA_LIKE, ("score",)),
    "gemma3_text": Family("gemma3_text", "model.layers.{i}.self_attn", LLAMA_LIKE, ("score",)),
    "phi3": Family("phi3", "model.layers.{i}.self_attn", split_names("qkv_proj", "o_proj"), ("score",),
                   fused="qkv_proj", reference=phi3_reference),
    "falcon-multi-query": Family(**FALCON),  # Falcon-7B's layout, the config's default
    "falcon-multi-head": Family(**FALCON, overrides=dict(multi_query=False, bias=True)),  # per-head interleave
    "falcon-new-arch": Family(**FALCON, overrides=dict(new_decoder_architecture=True, num_kv_heads=2)),  # 40B/180B
}
FUSED = sorted(name for name, f in FAMILIES.items() if f.fused)
METHODS_ON_EVERY_FAMILY = ("lora", "dora", "full")


def test_the_table_covers_the_issue_families():
    wanted = {"bert", "roberta", "xlm-roberta", "deberta-v2", "electra", "modernbert", "gpt2", "llama", "qwen2",
              "qwen3", "gemma3_text", "phi3", "falcon"}
    assert wanted == {f.model_type for f in FAMILIES.values()}
    assert {"modernbert", "gpt2", "phi3", "falcon-multi-query", "falcon-multi-head", "falcon-new-arch"} <= set(FUSED)


def test_a_fused_family_without_a_known_layout_is_refused_in_one_line():
    """Bloom fuses q, k, v in self_attention.query_key_value too, in a layout peftlab has no row for: refused,
    never guessed."""
    from peftlab.errors import PeftlabError

    with pytest.raises(PeftlabError) as err:
        apply_method(build_tiny("bloom"), MethodConfig(method="lora", targets=("q", "v")), task_type="SEQ_CLS")
    message = str(err.value)
    assert "\n" not in message and "'bloom'" in message and "query_key_value" in message and "falcon" in message


def test_an_adapter_split_otherwise_than_its_base_is_refused(tmp_path):
    """fused_qkv.json says how the base was split; a base that splits differently (Falcon multi-query instead of
    new_decoder_architecture) or a corrupt note is one line, before peft loads anything."""
    from peftlab.errors import PeftlabError
    from peftlab.methods.fused_qkv import split_for_adapter, write_note

    applied, _ = adapted(FAMILIES["falcon-new-arch"], "lora")
    write_note(tmp_path, applied.split)
    assert split_for_adapter(FAMILIES["falcon-new-arch"].build(), tmp_path) == applied.split
    with pytest.raises(PeftlabError, match="was trained on falcon split as 'new_decoder_architecture"):
        split_for_adapter(FAMILIES["falcon-multi-query"].build(), tmp_path)
    (tmp_path / "fused_qkv.json").write_text("{not json")
    with pytest.raises(PeftlabError, match="corrupt .*fused_qkv.json"):
        split_for_adapter(FAMILIES["falcon-new-arch"].build(), tmp_path)


def strip(name: str) -> str:
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def out_features(module) -> int:
    return module.weight.shape[1] if type(module).__name__ == "Conv1D" else module.weight.shape[0]


def rows(module) -> torch.Tensor:
    """A fused module's weight as (1, in, out): each input unit's fused output row, what a reference splits."""
    weight = module.weight.detach()
    return (weight if type(module).__name__ == "Conv1D" else weight.T).unsqueeze(0)


def reference_parts(family: Family, model, i: int) -> list[torch.Tensor]:
    """Block i's q, k, v weight slices and bias slices as the family's attention code reads its fused matrix."""
    attn = model.get_submodule(family.layer.format(i=i))
    fused = getattr(attn, family.fused)
    parts = list(family.reference(attn, rows(fused)))
    if fused.bias is not None:
        parts += list(family.reference(attn, fused.bias.detach().view(1, 1, -1)))
    return [p.clone() for p in parts]


def adapted(family: Family, method: str, targets=("q", "v")):
    model = family.build()
    original = copy.deepcopy(model)
    applied = apply_method(model, MethodConfig(method=method, targets=targets, rank=4, alpha=8.0),
                           task_type="SEQ_CLS")
    return applied, original


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_q_k_v_o_resolve_with_the_config_widths(name):
    family = FAMILIES[name]
    applied, original = adapted(family, "lora", ("q", "k", "v", "o"))
    expected = {p: tuple(family.module(p, i) for i in range(2)) for p in ("q", "k", "v", "o")}
    assert applied.targets.modules == expected
    assert applied.heads == list(family.heads)
    inner = applied.model.base_model.model
    q, k, v = family.widths(original.config)
    for projection, width in (("q", q), ("k", k), ("v", v), ("o", original.config.hidden_size)):
        for module in expected[projection]:
            assert out_features(inner.get_submodule(module).get_base_layer()) == width, (module, width)
    if family.fused:
        assert applied.split is not None and [m.name for m in applied.split.modules] == \
            [f"{family.layer.format(i=i)}.{family.fused}" for i in range(2)]
    else:
        assert applied.split is None


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_split_model_computes_the_fused_one(name):
    """Before any training the split model's logits are the fused model's (float rounding: three matmuls for
    one), and each split layer holds exactly the rows the family's attention reads as q, k or v."""
    from peftlab.methods.fused_qkv import split_fused_qkv

    family = FAMILIES[name]
    model = family.build()
    original = copy.deepcopy(model)
    inputs = tiny_inputs()
    split = split_fused_qkv(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, original(**inputs).logits, atol=1e-6, rtol=1e-5)
    if not family.fused:
        assert not split
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in original.named_parameters()]
        return
    hidden = original.config.hidden_size
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(3))
    for i in range(2):
        attn = original.get_submodule(family.layer.format(i=i))
        with torch.no_grad():
            want = family.reference(attn, getattr(attn, family.fused)(x))
            got = [model.get_submodule(family.module(p, i))(x) for p in ("q", "k", "v")]
        for projection, w, g in zip("qkv", want, got):
            repeat = w.shape[-1] // g.shape[-1]  # Falcon's new architecture broadcasts each kv head to its group
            g = g.unflatten(-1, (-1, heads_dim(original.config))).repeat_interleave(repeat, dim=-2).flatten(-2)
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=f"block {i} {projection}")


def train_steps(model, groups, steps: int = 3) -> None:
    """A few AdamW steps on one batch with labels (dropout on): every trainable tensor moves."""
    optimizer = adamw(groups)
    inputs = tiny_inputs()
    labels = torch.tensor([0, 1, 1])
    model.train()
    for _ in range(steps):
        model(**inputs, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def k_and_qv(family: Family, model, i: int) -> tuple[list, list]:
    """Block i's k tensors (weight, and bias where it has one) and its q and v weights: slices of the fused
    matrix, or the separate modules' own."""
    if family.fused:
        parts = reference_parts(family, model, i)  # q, k, v weight rows (then q, k, v bias rows)
        return parts[1::3], [parts[0], parts[2]]
    modules = {p: model.get_submodule(family.module(p, i)) for p in "qkv"}
    k = [t.detach().clone() for t in modules["k"].parameters()]
    return k, [modules[p].weight.detach().clone() for p in "qv"]


def trained(family: Family, method: str):
    applied, original = adapted(family, method)
    groups = param_groups(applied.model, applied.targets, applied.heads, OptimConfig(lr=LR, lr_ratio=LR_RATIO),
                          verbose=False)
    train_steps(applied.model, groups)
    return applied, original, groups


@pytest.mark.parametrize("method", METHODS_ON_EVERY_FAMILY)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_q_and_v_train_at_their_rates_and_k_stays(name, method):
    family = FAMILIES[name]
    applied, original, groups = trained(family, method)
    # the optimizer's groups: q at lr, v at lr_ratio x lr, the head at its own; no k
    assert {g["name"] for g in groups} == {"q", "v", "head"}
    for g in groups:
        for param_name in g["param_names"]:
            module = strip(param_name)
            owner = [p for p in ("q", "v") for i in range(2) if module.startswith(family.module(p, i) + ".")]
            owner += ["head" for head in family.heads if module.startswith(head + ".")]
            assert owner == [g["name"]], (param_name, g["name"], owner)
        if g["name"] in ("q", "v"):
            assert math.isclose(g["lr"], LR * (LR_RATIO if g["name"] == "v" else 1.0)), (g["name"], g["lr"])
    # k is bit-identical, as a separate module and as its slice of the fused matrix; q and v moved
    plain = merged(applied.model, split=applied.split)
    for i in range(2):
        k_before, qv_before = k_and_qv(family, original, i)
        k_after, qv_after = k_and_qv(family, plain, i)
        assert all(torch.equal(a, b) for a, b in zip(k_before, k_after)), f"block {i}: k changed"
        assert not any(torch.equal(a, b) for a, b in zip(qv_before, qv_after)), f"block {i}: q or v did not train"


@pytest.mark.parametrize("method", METHODS_ON_EVERY_FAMILY)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_merged_export_is_the_original_architecture_and_reproduces_the_logits(name, method, tmp_path):
    from transformers import AutoModelForSequenceClassification

    family = FAMILIES[name]
    applied, original, _ = trained(family, method)
    inputs = tiny_inputs(seed=5)
    with torch.no_grad():
        want = applied.model(**inputs).logits
    plain = merged(applied.model, split=applied.split)
    plain.save_pretrained(tmp_path / "export", safe_serialization=True)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    assert type(loaded) is type(original) and loaded.config.model_type == original.config.model_type
    assert {n: p.shape for n, p in loaded.named_parameters()} == {n: p.shape for n, p in original.named_parameters()}
    assert [type(m).__name__ for m in loaded.modules()] == [type(m).__name__ for m in original.modules()]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, want, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- through the CLI (the issue's "done when")

# registry model -> its row above (the layout its tiny config has)
CLI_MODELS = {"tiny-gpt2": "gpt2", "tiny-phi3": "phi3", "tiny-falcon": "falcon-new-arch", "tiny-modernbert": "modernbert"}
CLI_CASES = [(model, "lora") for model in CLI_MODELS] + [("tiny-gpt2", "full")]  # full: Conv1D saved transposed back


@pytest.mark.parametrize("model_name,method", CLI_CASES, ids=[f"{m}-{x}" for m, x in CLI_CASES])
def test_peftlab_train_q_v_at_lr_ratio_4_on_a_fused_model(model_name, method, tmp_path, capsys):
    """`peftlab train --targets q,v --lr-ratio 4`: the printed groups are q at 1x and v at 4x (no k); `peftlab
    export --merged` writes the original architecture, whose k slices are the base's, bit for bit, and whose
    logits are peftlab's."""
    import json

    from transformers import AutoModelForSequenceClassification

    from peftlab.cli.main import main
    from peftlab.models.registry import load_model
    from peftlab.training.evaluation import load_run

    family = FAMILIES[CLI_MODELS[model_name]]
    run, export = tmp_path / "run", tmp_path / "export"
    lr = 1e-3 if method == "lora" else 1e-2
    code = main(["train", "--task", "rte", "--model", model_name, "--method", method, "--targets", "q,v",
                 "--lr-ratio", "4", "--lr", str(lr), "--epochs", "1", "--batch-size", "8", "--max-length", "32",
                 "--max-train-samples", "16", "--max-eval-samples", "8", "--pooling", "native",
                 "--output-dir", str(run)])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    groups = dict(re.findall(r"^\s+(\w+)\s+lr=(\S+)\s", printed.split("parameter groups:")[1], flags=re.M))
    assert {g: float(v) for g, v in groups.items() if g != "head"} == {"q": pytest.approx(lr), "v": pytest.approx(4 * lr)}
    result = json.loads((run / "result.json").read_text())
    assert result["status"] in ("ok", "no_learning") and set(result["group_lrs"]) == {"q", "v", "head"}

    assert main(["export", str(run), "--merged", str(export)]) == 0
    exported = AutoModelForSequenceClassification.from_pretrained(export).eval()
    base, tokenizer = load_model(model_name, seed=result["seed"], pooling="native")
    assert type(exported) is type(base)
    for i in range(2):
        k_base, qv_base = k_and_qv(family, base, i)
        k_exported, qv_exported = k_and_qv(family, exported, i)
        assert all(torch.equal(a, b) for a, b in zip(k_base, k_exported)), f"block {i}: k changed"
        assert not any(torch.equal(a, b) for a, b in zip(qv_base, qv_exported)), f"block {i}: q or v did not train"
    ours = load_run(run).model.eval()
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=1e-4)


def test_peftlab_methods_names_every_fused_family(capsys):
    """The `peftlab methods` note (printed without importing torch) names each family that FAMILIES splits."""
    from peftlab.cli.main import main
    from peftlab.methods.fused_qkv import FAMILIES as SPLIT

    assert main(["methods"]) == 0
    printed = capsys.readouterr().out
    assert set(SPLIT) == {"gpt2", "phi3", "falcon", "modernbert"}
    for fused in ("c_attn", "qkv_proj", "query_key_value", "Wqkv"):
        assert f"({fused})" in printed
    assert re.search(r"^kasa .* yes\s+no\s+yes", printed, flags=re.M)  # fused QKV yes, Conv1D no
