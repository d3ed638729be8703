"""KaSA's remaining knobs: --kasa-truncate-rank k (drop k components, learn rank r) and --kasa-mode reference.

Expectations are computed directly: singular values of the original weights, the authors' truncation
(``svd_rank = self.in_features - r`` in their peft fork's ``LoraLayer.update_layer``) and their ``loss_fn``
(main.py) written out literally with d x d Gram matrices, on a tiny Llama whose projections are square, tall,
wide, and "slightly wide" (out < in < out + r), the case where the authors' truncation drops fewer than r.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.config import KasaOptions
from peftlab.methods.table import MethodConfig, apply_method, extra_loss

RANK = 4


def tiny_llama_shapes(seed: int = 0):
    """Llama, hidden 32, 2 heads of 14, one KV head: q 32->28 (slightly wide), k/v 32->14 (wide), o 28->32 (tall)."""
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=14, intermediate_size=64, num_labels=2,
                                  pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config).eval()


PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def module_names(model_type: str, targets) -> list[str]:
    if model_type == "bert":
        names = {"q": "attention.self.query", "v": "attention.self.value"}
        return [f"bert.encoder.layer.{i}.{names[t]}" for i in range(2) for t in targets]
    return [f"model.layers.{i}.self_attn.{PROJ[t]}" for i in range(2) for t in targets]


def layer(model, name):
    return model.base_model.model.get_submodule(name)


def base_weight(model, name) -> torch.Tensor:
    return layer(model, name).get_base_layer().weight.detach().float()


@torch.no_grad()
def perturb(model, scale: float = 0.05, seed: int = 7) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
        param.add_(scale * torch.randn(param.shape, generator=generator))


# --------------------------------------------------------------------------- --kasa-truncate-rank


@pytest.mark.parametrize("k", [2, 7])
def test_truncate_rank_drops_k_and_learns_rank_r(k, tiny_model):
    model = tiny_model("llama")  # q, o: 32 x 32; k, v: 32 -> 16 (GQA)
    original = copy.deepcopy(model)
    targets = ("q", "k", "v", "o")
    cfg = MethodConfig(method="kasa", targets=targets, rank=RANK, kasa=KasaOptions(truncate_rank=k))
    applied = apply_method(model, cfg, task_type="SEQ_CLS")
    model, resolved = applied.model, applied.targets
    names = module_names("llama", targets)
    assert sorted(resolved.all_modules) == sorted(names)
    for name in names:
        s_orig = torch.linalg.svdvals(original.get_submodule(name).weight.detach().float())
        s_new = torch.linalg.svdvals(base_weight(model, name))
        n = s_orig.shape[0]
        assert torch.all(s_new[n - k:] < 1e-5 * s_orig[0]), f"{name}: the {k} smallest are not removed"
        torch.testing.assert_close(s_new[: n - k], s_orig[: n - k], rtol=1e-4, atol=0)
        # the adapter keeps rank r, whatever k is
        adapted = layer(model, name)
        n_out, n_in = original.get_submodule(name).weight.shape
        A, B = adapted.lora_A["default"].weight, adapted.lora_B["default"].weight
        assert A.shape == (RANK, n_in) and B.shape == (n_out, RANK)
        assert adapted.lora_diag["default"].shape == (RANK,)
        assert torch.linalg.matrix_rank(A.detach()) == RANK
        # truncated base = the rank-(n - k) SVD approximation of the original weight
        W = original.get_submodule(name).weight.detach().float()
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        torch.testing.assert_close(base_weight(model, name), U[:, : n - k] @ torch.diag(S[: n - k]) @ Vh[: n - k],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [0, -1, 16, 40])
def test_truncate_rank_out_of_range_is_one_line(k, tiny_model):
    with pytest.raises(PeftlabError) as err:
        cfg = MethodConfig(method="kasa", targets=("q", "k"), rank=RANK, kasa=KasaOptions(truncate_rank=k))
        apply_method(tiny_model("llama"), cfg)  # k's min(in, out) is 16
    message = str(err.value)
    assert "\n" not in message and "--kasa-truncate-rank" in message and str(k) in message
    if k >= 16:
        assert "min(in, out) = 16" in message


def test_knob_validation_and_flags():
    for bad in (dict(kasa_mode="papr"), dict(corda_mode="xpm"), dict(corda_samples=0), dict(kasa_truncate_rank=2.5)):
        with pytest.raises(PeftlabError) as err:
            MethodConfig.from_dict({"method": "kasa", **bad})  # flat names, as config.yaml spells them
        assert "\n" not in str(err.value)
    with pytest.raises(PeftlabError, match="did you mean 'paper'"):
        MethodConfig(method="kasa", kasa=KasaOptions(mode="papr"))
    # flags (strings) and sweep keys reach the config fields
    cfg = build_run_config(flag_values={"method": "kasa", "kasa_truncate_rank": "6",
                                                 "kasa_mode": "REFERENCE", "corda_mode": "kpm", "corda_samples": "32"})
    assert (cfg.kasa.truncate_rank, cfg.kasa.mode, cfg.corda.mode, cfg.corda.samples) == (6, "reference", "kpm", 32)
    assert TrainConfig(method="kasa").kasa.truncate_rank is None and TrainConfig().kasa.mode == "paper"


# --------------------------------------------------------------------------- --kasa-mode reference


def authors_truncation(weight: torch.Tensor, r: int) -> torch.Tensor:
    """Their peft fork, LoraLayer.update_layer: svd_rank = self.in_features - r; U[:, :svd_rank] ..."""
    in_features = weight.shape[1]
    svd_rank = in_features - r
    U, S, Vh = torch.linalg.svd(weight.float(), full_matrices=False)
    U_principle, S_principle, Vh_principle = U[:, :svd_rank], S[:svd_rank], Vh[:svd_rank, :]
    return U_principle @ torch.diag(S_principle) @ Vh_principle


def authors_loss_fn(model, beta: float, gamma: float) -> torch.Tensor:
    """Their main.py ``loss_fn``, literally (d x d Gram matrices, divided by the number of lora_diag blocks)."""
    l2_loss, l3_loss, block_num = 0.0, 0.0, 0
    for name, param in model.named_parameters():
        if param.requires_grad:
            if "lora_diag" in name:
                block_num += 1
                l2_loss += torch.sum(param ** 2)
            elif "lora_A" in name or "lora_B" in name:
                matmul_result = param.T @ param if "lora_A" in name else param @ param.T
                eye = torch.eye(matmul_result.size(0))
                l3_loss += torch.norm(matmul_result - eye, p="fro")
    return (beta * l2_loss + gamma * l3_loss) / block_num


def test_reference_truncation_matches_authors_code_on_wide_layers():
    r = 6
    model = tiny_llama_shapes()
    original = copy.deepcopy(model)
    targets = ("q", "k", "v", "o")
    applied = apply_method(model, MethodConfig(method="kasa", targets=targets, rank=r,
                                               kasa=KasaOptions(mode="reference")),
                           task_type="SEQ_CLS")
    model = applied.model
    dropped = {}
    for name in module_names("llama", targets):
        W = original.get_submodule(name).weight.detach()
        torch.testing.assert_close(base_weight(model, name), authors_truncation(W, r), atol=1e-5, rtol=0)
        s_orig = torch.linalg.svdvals(W.float())
        s_new = torch.linalg.svdvals(base_weight(model, name))
        dropped[name.rsplit(".", 1)[1]] = int((s_new < 1e-5 * s_orig[0]).sum())
    # (out, in): q (28, 32) slightly wide: in - r = 26 < 28 keeps 26, drops 2; k/v (14, 32) wide: nothing dropped;
    # o (32, 28) tall: drops r, as in the paper
    assert dropped == {"q_proj": 2, "k_proj": 0, "v_proj": 0, "o_proj": r}

    applied = apply_method(tiny_llama_shapes(), MethodConfig(method="kasa", targets=targets, rank=r),
                           task_type="SEQ_CLS")
    paper = applied.model
    for name in module_names("llama", targets):
        s_new = torch.linalg.svdvals(base_weight(paper, name))
        assert int((s_new < 1e-5 * s_new[0]).sum()) == r, f"paper mode must drop r on {name}"


@pytest.mark.parametrize("model_kind", ["bert", "llama-wide"])
def test_reference_penalty_matches_authors_loss_fn(model_kind, tiny_model):
    beta, gamma = 0.3, 0.7
    model = tiny_model("bert") if model_kind == "bert" else tiny_llama_shapes()
    targets = ("q", "v") if model_kind == "bert" else ("q", "k", "v", "o")
    cfg = MethodConfig(method="kasa", targets=targets, rank=RANK,
                       kasa=KasaOptions(mode="reference", beta=beta, gamma=gamma))
    applied = apply_method(model, cfg, task_type="SEQ_CLS")
    model = applied.model
    perturb(model)

    ours = extra_loss(model, cfg)
    theirs = authors_loss_fn(model, beta, gamma)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # same gradients, too (ours is computed from r x r Grams, theirs from d x d)
    params = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    for g_ours, g_theirs in zip(torch.autograd.grad(ours, params), torch.autograd.grad(theirs, params)):
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-6)

    # --kasa-reduction sum: the same without the division by the number of modules
    n_modules = 2 * len(targets)
    cfg_sum = replace(cfg, kasa=replace(cfg.kasa, reduction="sum"))
    torch.testing.assert_close(extra_loss(model, cfg_sum), theirs * n_modules, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_reference_penalty_floor_is_sqrt_d_minus_r(tiny_model):
    cfg_ref = MethodConfig(method="kasa", targets=("q",), rank=RANK,
                           kasa=KasaOptions(mode="reference", beta=0.0, gamma=1.0, reduction="sum"))
    applied = apply_method(tiny_llama_shapes(), cfg_ref, task_type="SEQ_CLS")
    model = applied.model
    floor = 0.0
    for name in module_names("llama", ("q",)):
        adapted = layer(model, name)
        A, B = adapted.lora_A["default"].weight, adapted.lora_B["default"].weight  # (r, 32), (28, r)
        A.copy_(torch.linalg.qr(torch.randn(A.shape[1], RANK))[0].T)  # orthonormal rows
        B.copy_(torch.linalg.qr(torch.randn(B.shape[0], RANK))[0])  # orthonormal columns
        floor += (A.shape[1] - RANK) ** 0.5 + (B.shape[0] - RANK) ** 0.5
    torch.testing.assert_close(extra_loss(model, cfg_ref), torch.tensor(floor), rtol=1e-5, atol=0)
    cfg_paper = replace(cfg_ref, kasa=replace(cfg_ref.kasa, mode="paper"))
    assert float(extra_loss(model, cfg_paper)) < 1e-5  # peft's r x r penalty is 0 at orthonormal factors


# --------------------------------------------------------------------------- through peftlab train


def test_train_kasa_reference_and_truncate_rank(tmp_path):
    from peftlab.training.loop import train

    cfg = build_run_config(overrides=dict(
        task="rte", model="tiny-bert", method="kasa", targets="q,v", rank=4, kasa_mode="reference",
        kasa_truncate_rank=6, epochs=1, batch_size=8, max_length=32, max_train_samples=16, max_eval_samples=16,
        output_dir=str(tmp_path / "run")))
    result = train(cfg)
    assert result["status"] in ("ok", "no_learning")  # trained to its end (a tiny model need not learn)
    assert result["config"]["kasa_mode"] == "reference" and result["config"]["kasa_truncate_rank"] == 6
    assert result["calibration_seconds"] is None  # only CorDA calibrates
    assert result["kasa_sigma"] and all(len(v) == 4 for v in result["kasa_sigma"].values())


# --------------------------------------------------------------------------- save / load of a non-peft truncation


@pytest.mark.parametrize("extra", [{"kasa": KasaOptions(truncate_rank=16)}, {"kasa": KasaOptions(mode="reference")}])
def test_saved_kasa_adapter_with_own_truncation_reloads_exactly(tmp_path, extra):
    """save_trained writes a truncation peft's loader would not redo as a plain LoRA (no plan file: plain peft
    loads it); load_trained reproduces the adapted model exactly."""
    import torch

    from peftlab.methods.saving import load_trained, save_trained
    from peftlab.methods.table import MethodConfig, apply_method
    from peftlab.models.registry import load_model

    torch.manual_seed(0)
    model, _ = load_model("tiny-bert", num_labels=2)
    fresh, _ = load_model("tiny-bert", num_labels=2)
    applied = apply_method(model, MethodConfig(method="kasa", targets=("q", "v"), rank=4, **extra),
                           task_type="SEQ_CLS")
    adapted = applied.model
    with torch.no_grad():
        for p in adapted.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    save_trained(adapted, tmp_path / "adapter", applied=applied)
    # a plain LoRA exactly when the truncation differs from peft's (reference mode on square BERT: it does not)
    import json

    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (saved.get("kasa_config") is None) == bool(applied.init_stats.kasa_plan)
    assert bool(applied.init_stats.kasa_plan) == (extra["kasa"].truncate_rank is not None)
    reloaded = load_trained(fresh, tmp_path / "adapter")
    ids = torch.randint(1, 1000, (2, 9))
    adapted.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-5)
