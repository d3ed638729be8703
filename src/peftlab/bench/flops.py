"""Model FLOPs of one train step, counted from the architecture: the numerator of model FLOP utilisation.

What is counted: the model's matrix products, 2·m·k·n FLOPs each (a multiply-add is two), over the examples'
real tokens (``lengths``; padding is not model work):

* **every layer**: the q, k, v and o projections and the MLP's (up and down, and gate where it has one) over
  every token; the attention scores Q·Kᵀ and the values P·V over each example's own length L, per query head,
  the whole L×L square (PaLM's convention; a causal kernel that skips the upper triangle does about half);
* **the head**: a causal LM's ``lm_head`` over every token; a classifier's head linears (BERT's pooler and
  classifier, RoBERTa's and MPNet's dense and out_proj) over one vector per example for encoders, over every
  token for decoders (Llama's ``score`` runs on every position);
* **LoRA-structured adapters** (peft's ``lora_A``/``lora_B``: LoRA, PiSSA, MiLoRA, CorDA, KaSA, DoRA's low-rank
  part): x·Aᵀ and then ·Bᵀ, reported apart as ``adapter`` and included in the totals.

**Backward**, as autograd runs it: each product's gradient with respect to each operand that requires one, at
the forward product's cost. A weight operand needs one only if it trains (frozen weights get no gradient); an
activation operand wherever a trainable parameter lies below it: through every layer above the lowest trainable
parameter, and in that lowest layer only along the trainable paths (with LoRA on q and v there, neither K nor the
frozen q/k/v inputs get a gradient).

Not counted: embedding lookups, norms, activations, softmax, RoPE, the loss and the optimizer (no matrix
products); DoRA's weight norm and VeRA's or FourierFT's own products (the result says so in ``notes``). Norm and
bias parameters are taken as frozen, as every peftlab method leaves them. ``torch.utils.flop_counter.
FlopCounterMode`` counts the same products on a tiny model with eager attention (tests/test_mfu.py); it counts
nothing for CPU SDPA kernels (``_scaled_dot_product_flash_attention_for_cpu`` has no formula), one reason the
count is made from the architecture.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from peftlab.methods.registry import ADAPTER_PREFIXES  # the prefixes every registered method's tensors carry

# model types whose blocks are sequential (attention, then MLP, each with a residual) with plain softmax attention
COUNTED_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "mpnet", "llama", "mistral", "qwen2",
                 "qwen3", "gpt2", "phi3")
# peft's adapter internals (lora_A, lora_B, lora_dropout, lora_magnitude_vector, vera_lambda_b, ...) and the unused
# original copy of a trained head (ModulesToSaveWrapper): never a layer of the model's own
_ADAPTER_PART = re.compile(r"\.(" + "|".join(rf"{prefix}\w+" for prefix in ADAPTER_PREFIXES) + r"|original_module)(\.|$)")


@dataclass(frozen=True)
class Linear:
    """One linear layer as the count sees it."""

    name: str
    in_features: int
    out_features: int
    trains: bool = False  # its own weight trains (full fine-tuning, a head)
    lora_rank: int = 0  # the rank of a LoRA-structured adapter on it, 0: none
    adapted: bool = False  # some trainable adapter acts on it (its output then needs a gradient)


@dataclass(frozen=True)
class Layer:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    mlp: tuple[Linear, ...]  # (gate, up, down) or (up, down)
    query_heads: int
    head_dim: int

    @property
    def gated(self) -> bool:
        return len(self.mlp) == 3


@dataclass(frozen=True)
class Architecture:
    model_type: str
    layers: tuple[Layer, ...]
    head: tuple[Linear, ...]  # in the order they run
    head_per_token: bool  # the head runs on every token (causal LM, decoder classifier), else once per example
    embeddings_train: bool = False
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one train step (forward + backward) on ``examples`` examples of ``tokens`` real tokens."""

    forward: int
    backward: int
    adapter: int  # the adapters' share of forward + backward
    tokens: int
    examples: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "notes": list(self.notes)}


class _Tally:
    def __init__(self):
        self.forward = self.backward = self.adapter = 0

    def product(self, flops: int, grad_first: bool, grad_second: bool, adapter: bool = False) -> None:
        """One product; its backward computes the gradient of each operand that needs one, at the same cost."""
        backward = flops * (int(grad_first) + int(grad_second))
        self.forward += flops
        self.backward += backward
        if adapter:
            self.adapter += flops + backward

    def linear(self, lin: Linear, rows: int, input_grad: bool) -> bool:
        """``rows`` vectors through ``lin`` (and its LoRA adapter); returns whether its output needs a gradient."""
        self.product(2 * rows * lin.in_features * lin.out_features, input_grad, lin.trains)
        if lin.lora_rank:
            self.product(2 * rows * lin.in_features * lin.lora_rank, input_grad, True, adapter=True)
            self.product(2 * rows * lin.lora_rank * lin.out_features, True, True, adapter=True)
        return input_grad or lin.trains or lin.adapted or lin.lora_rank > 0


def count_step(arch: Architecture, lengths) -> StepFlops:
    """The model FLOPs of a train step on examples of these real lengths (the module docstring says what counts)."""
    lengths = [int(n) for n in lengths]
    tokens, squares = sum(lengths), sum(n * n for n in lengths)
    tally = _Tally()
    needs_grad = arch.embeddings_train  # does the running hidden state need a gradient?
    for layer in arch.layers:
        q, k, v = (tally.linear(lin, tokens, needs_grad) for lin in (layer.q, layer.k, layer.v))
        attention = 2 * layer.query_heads * layer.head_dim * squares
        tally.product(attention, q, k)  # scores = Q Kᵀ
        probabilities = q or k
        tally.product(attention, probabilities, v)  # P V
        out = tally.linear(layer.o, tokens, probabilities or v)
        needs_grad = needs_grad or out  # the residual adds the attention's output
        if layer.gated:
            gate, up, down = layer.mlp
            gated, lifted = tally.linear(gate, tokens, needs_grad), tally.linear(up, tokens, needs_grad)
            hidden = gated or lifted  # act(gate) * up
        else:
            up, down = layer.mlp
            hidden = tally.linear(up, tokens, needs_grad)
        down_out = tally.linear(down, tokens, hidden)  # counted whatever the residual needs
        needs_grad = needs_grad or down_out
    rows = tokens if arch.head_per_token else len(lengths)
    for lin in arch.head:
        needs_grad = tally.linear(lin, rows, needs_grad)
    return StepFlops(tally.forward, tally.backward, tally.adapter, tokens, len(lengths), arch.notes)


# --------------------------------------------------------------------------- reading the architecture off a model


class _BaseLayers:
    """``model``'s modules under the names :func:`peftlab.methods.targets.resolve_targets` matches: a peft wrapper's
    ``base_layer`` under the wrapper's own name, adapter internals and unused head copies left out."""

    def __init__(self, model):
        self.config = getattr(model, "config", None)
        self._model = model

    def named_modules(self):
        for name, module in self._model.named_modules():
            if _ADAPTER_PART.search(name):
                continue
            if name.endswith(".base_layer"):
                yield name[: -len(".base_layer")], module
            elif not hasattr(module, "base_layer"):
                yield name, module


def _shape(module) -> tuple[int, int]:
    if hasattr(module, "in_features"):
        return int(module.in_features), int(module.out_features)
    rows, cols = module.weight.shape  # transformers' Conv1D stores (in, out)
    return int(rows), int(cols)


def _linear(model, name: str, notes: list[str]) -> Linear:
    wrapper = model.get_submodule(name)
    base = getattr(wrapper, "base_layer", wrapper)
    in_features, out_features = _shape(base)
    adapter = [p for n, p in wrapper.named_parameters()
               if p.requires_grad and not n.startswith("base_layer.") and n not in ("weight", "bias")]
    rank = 0
    for adapter_name in getattr(wrapper, "active_adapters", ()) if adapter else ():
        lora_a = getattr(wrapper, "lora_A", {})
        if adapter_name in lora_a and hasattr(lora_a[adapter_name], "out_features"):
            rank += int(lora_a[adapter_name].out_features)
        if getattr(wrapper, "use_dora", {}).get(adapter_name):
            notes.append("DoRA's weight norm is not counted")
    if adapter and not rank:
        parts = type(wrapper).__module__.split(".")  # peft.tuners.<tuner>.layer
        tuner = parts[parts.index("tuners") + 1] if "tuners" in parts[:-1] else type(wrapper).__name__
        notes.append(f"{tuner}'s own products are not counted (only LoRA-structured adapters' are)")
    return Linear(name, in_features, out_features, trains=bool(base.weight.requires_grad), lora_rank=rank,
                  adapted=bool(adapter))


def architecture(model) -> Architecture:
    """The count's view of ``model`` (a transformers model, peft-wrapped or not); raises ValueError, with the
    reason, for an architecture the count does not cover."""
    from peftlab.errors import PeftlabError
    from peftlab.methods.targets import layer_of, linear_layer_names, resolve_targets
    from peftlab.models.registry import family_of

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if config.model_type not in COUNTED_TYPES:
        raise ValueError(f"model FLOPs are counted for {', '.join(COUNTED_TYPES)}, not {config.model_type}")
    view = _BaseLayers(model)
    try:
        found = resolve_targets(view, "q,k,v,o,up,down").modules
        try:
            found["gate"] = resolve_targets(view, "gate").modules["gate"]
        except PeftlabError:
            pass
    except PeftlabError as err:
        raise ValueError(f"cannot read the projections: {err}") from None
    notes: list[str] = []
    per_layer: dict[int, dict[str, Linear]] = {}
    for role, names in found.items():
        for name in names:
            per_layer.setdefault(layer_of(name), {})[role] = _linear(model, name, notes)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    layers = []
    for index in sorted(per_layer):
        parts = per_layer[index]
        head_dim = getattr(config, "head_dim", None) or parts["q"].out_features // heads
        if parts["q"].out_features != heads * head_dim:
            raise ValueError(f"layer {index}: q has {parts['q'].out_features} outputs, not {heads} x {head_dim}")
        mlp = tuple(parts[r] for r in ("gate", "up", "down") if r in parts)
        layers.append(Layer(parts["q"], parts["k"], parts["v"], parts["o"], mlp, heads, head_dim))
    projections = {name for names in found.values() for name in names}
    output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if output is not None:  # a causal LM: lm_head over every token
        head_names = [n for n, m in model.named_modules() if m is output or getattr(m, "base_layer", None) is output]
        head_names = head_names[:1] or ["lm_head"]
        head = (Linear(head_names[0], *_shape(output), trains=bool(output.weight.requires_grad)),)
        per_token = True
    else:  # a classifier: every other linear layer, in the order they run
        head = tuple(_linear(model, n, notes) for n in linear_layer_names(view) if n not in projections)
        per_token = family_of(base) == "decoder"
    embeddings = base.get_input_embeddings()
    return Architecture(config.model_type, tuple(layers), head, per_token,
                        embeddings_train=any(p.requires_grad for p in embeddings.parameters()),
                        notes=tuple(dict.fromkeys(notes)))


def step_flops(model, lengths) -> tuple[StepFlops | None, str | None]:
    """(the count, None), or (None, why not) for an architecture it does not cover."""
    try:
        return count_step(architecture(model), lengths), None
    except ValueError as err:
        return None, str(err)
