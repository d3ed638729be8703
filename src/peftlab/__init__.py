"""peftlab: attention-targeted parameter-efficient fine-tuning lab.

The public entry points are small and composable:

    model, tokenizer = load_model("minilm-l6", head="classification", num_labels=2)
    model = apply_method(model, MethodConfig(method="kasa", targets=("q", "v"), rank=8))
    optimizer = configure_optimizer(model, OptimConfig(lr=1e-4, lr_ratio=4))
"""

__version__ = "0.1.0"

from peftlab.errors import PeftlabError  # noqa: F401
