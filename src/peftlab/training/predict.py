"""``peftlab predict RUN_DIR --input FILE``: batch inference of a trained classifier to JSONL.

Input: any file a user task reads (:mod:`peftlab.tasks.labelled_files`). Output, one JSON line per input record in
order: ``{"index", "label", "label_id", "probabilities"}`` for classification (``label``: the class name the run
was trained with), ``{"index", "score"}`` for regression; written atomically."""

from __future__ import annotations

import json
from pathlib import Path

from peftlab.argtypes import positive_int, text
from peftlab.io_utils import path_problem
from peftlab.errors import PeftlabError


def text_fields(task, columns: list[str], fields: str | None, own: tuple[str, ...] = ()) -> list[str]:
    """The one or two input columns: --fields, else the run's own (a user task's --text-fields, or the task's
    GLUE names), else text_a/text_b (sentence/text)."""
    own = tuple(own) or tuple(task.text_fields)
    wanted = len(own)
    if fields:
        names = [f.strip() for f in fields.split(",") if f.strip()]
        candidates = [names]
    else:
        candidates = [list(own), ["text_a", "text_b"][:wanted], ["sentence", "text"][:1],
                      ["text"], ["sentence1", "sentence2"][:wanted]]
    for names in candidates:
        if len(names) == wanted and all(n in columns for n in names):
            return names
    raise PeftlabError(f"--input has columns {', '.join(columns)}, none of which give the {wanted} text field(s) "
                       f"of task '{task.name}' ({', '.join(own)})",
                       fix="rename the columns or pass --fields A" + (",B" if wanted > 1 else ""))


def predict_run(run_dir: str | Path, input_path: str | Path, output_path: str | Path, *,
                adapter: str | Path | None = None, fields: str | None = None, batch_size: int = 64) -> int:
    """Write one prediction per input record to ``output_path`` (JSONL); returns the record count."""
    import torch

    from peftlab.training.evaluation import load_run
    from peftlab.io_utils import atomic_write_text
    from peftlab.tasks.labelled_data import column_texts
    from peftlab.tasks.labelled_files import check_file, read_file
    from peftlab.training.devices import make_accelerator

    records = read_file(check_file(str(input_path), "--input"))  # one-line errors naming a bad line
    run = load_run(run_dir, adapter=adapter)
    task = run.task
    if task.head == "causal-lm":
        raise PeftlabError(f"predict serves classification and regression runs; {run_dir} is the instruction task "
                           f"'{task.name}'", fix="generate with the model through transformers instead")
    own = tuple(run.cfg.text_fields.split(",")) if run.cfg.text_fields else ()
    names = text_fields(task, list(records.columns), fields, own)
    columns = [column_texts(records, n) for n in names]
    label_names = run.label_names or task.label_names
    accelerator = make_accelerator(run.precision)
    model = accelerator.prepare(run.model)
    model.eval()
    lines = []
    with torch.no_grad():
        for start in range(0, len(records), batch_size):
            texts = [column[start:start + batch_size] for column in columns]
            batch = run.tokenizer(*texts, truncation=True, max_length=run.cfg.max_length, padding=True,
                                  return_tensors="pt").to(accelerator.device)
            logits = model(**batch).logits.float().cpu()
            for offset, row in enumerate(logits):
                index = start + offset
                if task.kind == "regression":
                    lines.append({"index": index, "score": float(row[0])})
                    continue
                probabilities = torch.softmax(row, dim=-1)
                label_id = int(probabilities.argmax())
                lines.append({"index": index, "label": label_names[label_id], "label_id": label_id,
                              "probabilities": [round(float(p), 6) for p in probabilities]})
    atomic_write_text(output_path, "".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def add_parser(sub) -> None:
    parser = sub.add_parser("predict", help="predict labels (or regression scores) for a file of texts with a run",
                            description="Rebuild RUN_DIR's model (as peftlab evaluate does) and write one JSON line "
                                        "per input record: label, label id and class probabilities (or a score).")
    parser.add_argument("run_dir", help="a folder written by peftlab train (holds config.yaml and adapter/)")
    parser.add_argument("--input", required=True, help="JSONL, JSON, CSV, TSV or Parquet file of texts")
    parser.add_argument("--output", type=text, default=None,
                        help="JSONL to write (default: <input stem>.predictions.jsonl)")
    parser.add_argument("--adapter", default=None, help="adapter folder to use instead of RUN_DIR/adapter")
    parser.add_argument("--fields", type=text, default=None, metavar="A[,B]",
                        help="input column(s) holding the text(s) (default: the run's --text-fields, the task's GLUE "
                             "names, or text_a,text_b)")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="records per forward pass (default 64)")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    output = Path(args.output) if args.output else Path(args.input).with_suffix("").with_name(
        Path(args.input).stem + ".predictions.jsonl")
    problem = path_problem(output, kind="file")  # also the default beside --input: below a file, too long, read-only
    if problem is not None:
        raise PeftlabError(f"--output {output} cannot be written: {problem}",
                           fix="pass a file path in a folder you can write in as --output")
    count = predict_run(args.run_dir, args.input, output, adapter=args.adapter, fields=args.fields,
                        batch_size=args.batch_size)
    print(f"wrote {count} predictions to {output}")
    return 0
