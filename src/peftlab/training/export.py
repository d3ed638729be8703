"""``peftlab export RUN_DIR --merged OUT_DIR``: a trained run as a standard transformers model folder.

The adapter is merged (a split fused QKV fused back: :mod:`peftlab.methods.fused_qkv`) and saved with
``save_pretrained`` into a staging folder, which is loaded back with plain ``AutoModelFor...`` and renamed to
``OUT_DIR`` only when its logits equal peftlab's on a few dev examples. Mean pooling is peftlab's, not the
architecture's (plain transformers reads [CLS]): such a run is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

from peftlab.argtypes import output_folder, text
from peftlab.errors import PeftlabError

TOLERANCE = 1e-4  # max abs logit difference between peftlab's model and the exported one (fp32: ~1e-6)


def _sample_batch(run, n: int = 4):
    from peftlab.tasks.prepare import build_pipeline

    cfg = run.cfg
    pipeline = build_pipeline(cfg, run.tokenizer, run.model, run.task)
    split = next(iter(pipeline.eval_sets.values()))
    rows = split.select(range(min(n, len(split))))
    if "text_a" in rows.column_names:
        texts = [list(rows["text_a"])] + ([list(rows["text_b"])] if "text_b" in rows.column_names else [])
    else:  # instruction data: the prompt field
        texts = [[str(r) for r in rows[rows.column_names[0]]]]
    return run.tokenizer(*texts, truncation=True, max_length=min(cfg.max_length, 128), padding=True,
                         return_tensors="pt")


def export_merged(run_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> dict:
    """Write the merged model + tokenizer to ``out_dir``; returns ``{"max_abs_diff", "path"}``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from peftlab.methods.fused_qkv import read_split
    from peftlab.methods.saving import merged
    from peftlab.models.cache_folders import write_and_publish
    from peftlab.training.evaluation import load_run

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise PeftlabError(f"{out} already exists", fix="choose another OUT_DIR, or pass --overwrite")
    run = load_run(run_dir)
    if run.cfg.pooling == "mean" or run.pooling == "mean":
        raise PeftlabError(f"{run_dir} was trained with mean pooling, which plain transformers would not apply "
                           "(it reads [CLS]): the exported model would predict differently",
                           fix="export a run trained with --pooling native, or use peftlab evaluate/predict")
    batch = _sample_batch(run)
    with torch.no_grad():  # peftlab's own model, before the merge: the check covers merging and fusing back
        expected = run.model.eval()(**batch).logits.float()
    model = merged(run.model, split=read_split(Path(run_dir) / "adapter"))  # split q/k/v fused back
    model.eval()
    auto = AutoModelForCausalLM if run.task.head == "causal-lm" else AutoModelForSequenceClassification
    diffs = []

    def write(staging: Path) -> None:  # published by one rename once its logits are checked
        model.save_pretrained(staging, safe_serialization=True)
        if run.tokenizer is not None:
            run.tokenizer.save_pretrained(staging)
        reloaded = auto.from_pretrained(staging).eval()
        with torch.no_grad():
            diffs.append(float((reloaded(**batch).logits.float() - expected).abs().max()))
        if not diffs[0] <= TOLERANCE:
            raise PeftlabError(f"the exported model's logits differ from peftlab's by {diffs[0]:.2e} (> {TOLERANCE:g})",
                               fix="report this run's method and model; evaluate it with peftlab instead")
        if out.exists():  # --overwrite: a folder that cannot be removed stops the export, never stays as ours
            shutil.rmtree(out)

    write_and_publish(out, write, finished=lambda _: False)  # no concurrent exporter: a failed rename is an error
    return {"max_abs_diff": diffs[0], "path": str(out)}


def add_parser(sub) -> None:
    parser = sub.add_parser("export", help="write a trained run as a merged, standard transformers model folder",
                            description="Merge RUN_DIR's adapter into its base model and save model + tokenizer "
                                        "with save_pretrained, checked to predict as peftlab does.")
    parser.add_argument("run_dir", help="a folder written by peftlab train")
    parser.add_argument("--merged", required=True, type=output_folder, metavar="OUT_DIR",
                        help="folder to write the merged model to")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    parser.add_argument("--push-to-hub", type=text, default=None, metavar="REPO",
                        help="also upload the checked folder to this Hugging Face Hub repo (needs network and a token)")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    done = export_merged(args.run_dir, args.merged, overwrite=args.overwrite)
    print(f"wrote {done['path']} (max |logit difference| vs peftlab: {done['max_abs_diff']:.1e})")
    if args.push_to_hub:
        from huggingface_hub import HfApi

        HfApi().upload_folder(folder_path=done["path"], repo_id=args.push_to_hub, repo_type="model")
        print(f"pushed {done['path']} to {args.push_to_hub}")
    return 0
