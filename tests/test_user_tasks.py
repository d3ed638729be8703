"""`--task classify` / `--task regress`: the user's own labelled files and save_to_disk folders as tasks.

A learnable made-up data set (the class is fixed by a keyword; the score by a word) trains tiny-bert through the
CLI above its majority class, and predict / evaluate / export --merged name the classes; every kind of bad data
is one line naming file, row and column, exit 2, nothing written; the held-out split is stratified and the
same for every --seed; the run key follows the file's bytes; a save_to_disk folder trains offline."""

from __future__ import annotations

import json
import random
from collections import Counter
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError

KEYWORDS = {"billing": ("refund", "invoice"), "login": ("password", "locked"), "shipping": ("parcel", "courier")}
FILLERS = ("help", "please", "now", "today")
SCORES = {"great": 5.0, "fine": 3.0, "awful": 1.0}
# Small and fast enough to learn the keyword in a few seconds (measured: accuracy 1.0 from epoch 3 on).
SCHEMA = json.loads(resources.files("peftlab").joinpath("schemas/result.schema.json").read_text())
FAST = ["--model", "tiny-bert", "--method", "lora", "--lr", "0.02", "--head-lr", "0.02", "--epochs", "6",
        "--batch-size", "16", "--max-length", "8", "--report-to", "none", "--threads", "1"]


def load_labelled(cfg):
    """``cfg``'s labelled data, read for the task its ``task`` names (as the run's pipeline reads it)."""
    from peftlab.tasks.labelled_data import load_labelled as load
    from peftlab.tasks.table import task

    return load(cfg, task(cfg.task))


def write_tickets(path: Path, n: int = 180, seed: int = 0) -> Path:
    """A CSV whose label is fixed by a keyword of the text (billing / login / shipping, in turn)."""
    rng = random.Random(seed)
    rows = ["text,label"]
    for i in range(n):
        label = list(KEYWORDS)[i % 3]
        rows.append(f"{rng.choice(KEYWORDS[label])} {rng.choice(FILLERS)},{label}")
    path.write_text("\n".join(rows) + "\n")
    return path


def write_reviews(path: Path, n: int = 180, seed: int = 0) -> Path:
    """A JSONL whose score is fixed by one word of the review (plus a little noise)."""
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            word = list(SCORES)[i % 3]
            fh.write(json.dumps({"review": f"{word} {rng.choice(('food', 'room', 'staff'))}",
                                 "score": SCORES[word] + rng.uniform(-0.3, 0.3)}) + "\n")
    return path


def cfg_for(**values) -> TrainConfig:
    return build_run_config(overrides={"model": "tiny-bert", **values})


@pytest.fixture(scope="module")
def tickets_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    csv_file = write_tickets(root / "tickets.csv")
    out = root / "run"
    code = main(["train", "--task", "classify", "--train-file", str(csv_file), "--text-fields", "text",
                 "--label-field", "label", "--output-dir", str(out), *FAST])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def reviews_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("regress")
    jsonl = write_reviews(root / "reviews.jsonl")
    out = root / "run"
    code = main(["train", "--task", "regress", "--train-file", str(jsonl), "--text-fields", "review",
                 "--label-field", "score", "--output-dir", str(out), *FAST])
    assert code == 0
    return out


def test_classify_csv_learns_above_its_majority_class_and_records_the_labels(tickets_run):
    result = json.loads((tickets_run / "result.json").read_text())
    jsonschema.validate(result, SCHEMA)
    assert result["status"] == "ok" and result["primary_metric"] == "accuracy"
    # 180 rows, 60 per class: the stratified held-out 10% is 6 per class, so always predicting the most
    # frequent training class scores 1/3
    assert result["majority_baseline"] == pytest.approx(1 / 3)
    assert result["best"]["metrics"]["accuracy"] >= 0.9 > result["majority_baseline"] + 0.05
    assert set(result["best"]["metrics"]) >= {"accuracy", "f1_macro", "matthews_correlation"}
    assert result["id2label"] == {"0": "billing", "1": "login", "2": "shipping"}
    assert result["label2id"] == {"billing": 0, "login": 1, "shipping": 2}
    assert result["task_label"] == "tickets" and result["dataset"] == "tickets.csv"
    assert result["heldout"] == {"fraction": 0.1, "seed": 0, "stratified": True}
    assert result["num_eval_examples"] == 18
    config = yaml.safe_load((tickets_run / "config.yaml").read_text())
    assert config["text_fields"] == "text" and config["metric"] == "accuracy" and len(config["data_digest"]) == 64
    labels = json.loads((tickets_run / "adapter" / "labels.json").read_text())
    assert labels["num_labels"] == 3 and labels["id2label"] == result["id2label"]


def test_predict_names_the_classes(tickets_run, tmp_path, capsys):
    texts = ["refund please", "password now", "courier today", "invoice help"]
    inputs = tmp_path / "new.csv"
    inputs.write_text("text\n" + "\n".join(texts) + "\n")
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(tickets_run), "--input", str(inputs), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["label"] for r in rows] == ["billing", "login", "shipping", "billing"]
    assert all(["billing", "login", "shipping"][r["label_id"]] == r["label"] and len(r["probabilities"]) == 3
               for r in rows)


def test_evaluate_reproduces_the_best_epoch(tickets_run, capsys):
    result = json.loads((tickets_run / "result.json").read_text())
    capsys.readouterr()
    assert main(["evaluate", str(tickets_run)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["accuracy"] == pytest.approx(result["best"]["metrics"]["accuracy"])


def test_export_merged_is_a_plain_transformers_model_with_label_names(tickets_run, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from peftlab.models.registry import load_tokenizer

    assert main(["export", str(tickets_run), "--merged", str(tmp_path / "merged")]) == 0
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    assert plain.config.id2label == {0: "billing", 1: "login", 2: "shipping"}
    assert plain.config.label2id == {"billing": 0, "login": 1, "shipping": 2}
    batch = load_tokenizer("tiny-bert")(["parcel now", "locked please"], padding=True, return_tensors="pt")
    with torch.no_grad():
        predicted = plain(**batch).logits.argmax(-1).tolist()
    assert [plain.config.id2label[i] for i in predicted] == ["shipping", "login"]


def test_regress_jsonl_learns_a_positive_pearson_and_predicts_scores(reviews_run, tmp_path):
    result = json.loads((reviews_run / "result.json").read_text())
    jsonschema.validate(result, SCHEMA)
    assert result["status"] == "ok" and result["primary_metric"] == "pearson" and result["majority_baseline"] == 0.0
    assert result["best"]["metrics"]["pearson"] > 0.8 and "spearman" in result["best"]["metrics"]
    assert result["heldout"]["stratified"] is False and "id2label" not in result
    inputs = tmp_path / "new.jsonl"
    inputs.write_text("".join(json.dumps({"review": t}) + "\n" for t in ("awful room", "great food")))
    out = tmp_path / "scores.jsonl"
    assert main(["predict", str(reviews_run), "--input", str(inputs), "--output", str(out)]) == 0
    low, high = (json.loads(line) for line in out.read_text().splitlines())
    assert set(low) == {"index", "score"} and low["score"] < high["score"]
    assert main(["export", str(reviews_run), "--merged", str(tmp_path / "merged")]) == 0


def test_labels_json_lets_plain_transformers_load_an_adapter_with_its_class_names(tmp_path):
    """A peft adapter folder has no config.json: labels.json holds the head's config values for from_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertModel

    from peftlab.methods.saving import write_head_labels
    from peftlab.tasks.labelled_data import HeadLabels

    config = AutoConfig.for_model("bert", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64)
    BertModel(config).save_pretrained(tmp_path / "base")  # a base checkpoint without a head, as on the Hub
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3,
                                                               problem_type="single_label_classification")
    model.config.update(HeadLabels(3, ("billing", "login", "shipping")).config_values())
    adapted = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", target_modules=["query", "value"], r=4))
    with torch.no_grad():
        for param in (p for p in adapted.parameters() if p.requires_grad):
            param.add_(torch.randn_like(param) * 0.5)
    adapted.save_pretrained(tmp_path / "adapter")
    write_head_labels(adapted, tmp_path / "adapter")
    labels = json.loads((tmp_path / "adapter" / "labels.json").read_text())
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "adapter", **labels).eval()
    assert [plain.config.id2label[k] for k in sorted(plain.config.id2label)] == ["billing", "login", "shipping"]
    batch = {"input_ids": torch.tensor([[1, 5, 7, 9]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, adapted.eval()(**batch).logits)


def test_reports_name_the_column_after_the_file(tickets_run):
    from peftlab.lab.records import collect, load_rows
    from peftlab.lab.report import build_table

    records, _ = collect(load_rows([tickets_run]))
    assert [r.task for r in records] == ["tickets"]
    table = build_table(load_rows([tickets_run]))
    assert table.tasks == ["tickets"]
    assert table.majority is not None  # the majority-class row of a classification task


# --------------------------------------------------------------------------- bad data: one line, exit 2


def _bad(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


BAD_DATA = [
    # (file name, content, extra flags, task, expected piece of the message: what, where = file:row, column)
    ("t.csv", "text,label\na,x\nb,y\n", ["--text-fields", "txt"], "classify",
     ["no column 'txt' (did you mean 'text'?)", "t.csv, --text-fields", "the columns are: text, label"]),
    ("t.csv", "text,label\nrefund,billing\nhello,\nparcel,shipping\n", [], "classify",
     ["empty label", "t.csv:3, column label"]),
    ("t.csv", "text,label\nrefund,billing\nparcel,billing\n", [], "classify",
     ["one class only", "t.csv, column label"]),
    ("r.jsonl", '{"text": "a", "score": 1.5}\n{"text": "b", "score": "high"}\n{"text": "c", "score": 2}\n', [],
     "regress", ["target 'high' is not a number", "r.jsonl:2, column score"]),
    ("r.csv", "text,score\na,1.5\nb,\nc,2\n", [], "regress", ["empty target", "r.csv:3, column score"]),
    ("t.csv", "text,label\nrefund,billing\nx,y,z\nparcel,shipping\n", [], "classify",
     ["row has 3 comma-separated fields, the header has 2", "t.csv:3"]),
    ("t.csv", 'text,label\nrefund,billing\n"parcel,shipping\nlast,billing\n', [], "classify",
     ["malformed CSV record", "t.csv:3"]),
    ("t.tsv", "text\tlabel\nrefund\tbilling\nx\ty\tz\n", [], "classify",
     ["row has 3 tab-separated fields, the header has 2", "t.tsv:3"]),
    ("t.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": \n', [], "classify",
     ["invalid JSON", "t.jsonl:2"]),
    ("t.jsonl", '{"text": "a", "label": "x"}\n["b", "y"]\n', [], "classify", ["not an object", "t.jsonl:2"]),
    ("t.csv", b"text,label\nrefund,billing\ncaf\xe9,shipping\n", [], "classify", ["not valid UTF-8", "t.csv:3"]),
    ("t.csv", "", [], "classify", ["t.csv is empty"]),
    ("t.csv", "text,label\n", [], "classify", ["header but no data rows", "t.csv"]),
    ("t.csv", "text,label\na,x\nb,x\nc,y\nd,y\ne,z\n", [], "classify",
     ["label 'z' has only one example", "t.csv:6, column label", "--eval-file"]),
    ("t.csv", "text,label\na,0.5\nb,1\n", [], "classify", ["label 0.5 is not a class", "t.csv:2, column label"]),
    ("t.json", '[{"text": "a", "label": "x"}, {"text": null, "label": "y"}]', [], "classify",
     ["empty text", "t.json, record 2, column text"]),
]


@pytest.mark.parametrize("name, content, flags, task, pieces", BAD_DATA,
                         ids=[f"{i}-{case[-1][0][:30]}" for i, case in enumerate(BAD_DATA)])
def test_bad_data_is_one_line_naming_file_row_and_column(tmp_path, capsys, name, content, flags, task, pieces):
    path = _bad(tmp_path, name, content)
    label = ["--label-field", "score"] if task == "regress" else []
    out = tmp_path / "run"
    code = main(["train", "--task", task, "--train-file", str(path), *label, *flags, "--output-dir", str(out), *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("peftlab: error: "), err
    for piece in pieces:
        assert piece in err[0], err[0]
    assert "fix: " in err[0]
    assert not out.exists()


def test_an_eval_label_train_never_saw_names_the_eval_row(tmp_path, capsys):
    train_file = write_tickets(tmp_path / "tickets.csv", n=30)
    eval_file = _bad(tmp_path, "dev.csv", "text,label\nrefund now,billing\nwhere is my money,refunds\n")
    out = tmp_path / "run"
    code = main(["train", "--task", "classify", "--train-file", str(train_file), "--eval-file", str(eval_file),
                 "--output-dir", str(out), *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "eval label 'refunds' never occurs in the training data" in err[0] and "dev.csv:3, column label" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("flags, piece", [
    (["--task", "classify"], "no data given"),
    (["--task", "classify", "--train-file", "FOLDER"], "is a folder, not a file"),
    (["--task", "classify", "--train-file", "MISSING"], "not found"),
    (["--task", "classify", "--train-file", "TICKETS", "--eval-split", "test"], "--eval-split picks a split"),
    (["--task", "classify", "--train-file", "TICKETS", "--metric", "pearson"], "pearson is a --task regress metric"),
    (["--task", "classify", "--train-file", "TICKETS", "--metric", "f1"], "--metric f1 is binary F1, but the data has"),
    (["--task", "rte", "--metric", "f1"], "--metric is set, but task 'rte' reads its own data"),
    (["--task", "classify", "--dataset", "no/such-dataset"], "the Hub is not tried offline"),
])
def test_bad_options_are_one_line(tmp_path, capsys, flags, piece):
    tickets = write_tickets(tmp_path / "tickets.csv", n=30)
    (tmp_path / "folder").mkdir()
    flags = [{"FOLDER": str(tmp_path / "folder"), "MISSING": str(tmp_path / "missing.csv"),
              "TICKETS": str(tickets)}.get(f, f) for f in flags]
    code = main(["train", *flags, "--output-dir", str(tmp_path / "run"), *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and piece in err[0], err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the held-out split, keys, folders


def test_the_held_out_split_is_stratified_and_the_same_for_every_seed(tmp_path):
    from peftlab.models.registry import load_tokenizer
    from peftlab.tasks.prepare import build_pipeline

    rows = ["text,label"] + [f"w{i} a,a" for i in range(160)] + [f"w{i} b,b" for i in range(40)]
    path = tmp_path / "skewed.csv"
    path.write_text("\n".join(rows) + "\n")
    data = load_labelled(cfg_for(task="classify", train_file=str(path)))
    assert Counter(data.eval["label"][:]) == {0: 16, 1: 4}  # 10% of each class: stratified (80% / 20%)
    assert len(data.train) == 180 and not set(data.train["text_a"][:]) & set(data.eval["text_a"][:])
    # exactly scikit-learn's stratified split with the fixed seed 0, rows kept in file order
    from sklearn.model_selection import train_test_split

    _, expected = train_test_split(list(range(200)), test_size=20, random_state=0, stratify=[0] * 160 + [1] * 40)
    assert data.eval["text_a"][:] == [rows[1 + i].split(",")[0] for i in sorted(expected)]
    tokenizer = load_tokenizer("tiny-bert")
    pipelines = [build_pipeline(cfg_for(task="classify", train_file=str(path), seed=seed, max_train_samples=50,
                                        max_length=8), tokenizer, None) for seed in (0, 7)]
    assert pipelines[0].eval_sets["validation"]["text_a"][:] == pipelines[1].eval_sets["validation"]["text_a"][:]
    assert pipelines[0].extras["eval_examples_digest"] == pipelines[1].extras["eval_examples_digest"]
    # --seed still draws the --max-train-samples subset (from the same training part)
    assert pipelines[0].train_examples_digest != pipelines[1].train_examples_digest
    assert pipelines[0].chance == pytest.approx(0.8)  # the training majority (a) on the held-out part


def test_one_changed_byte_changes_the_run_key_and_an_old_config_refuses_the_new_data(tmp_path):
    from peftlab.lab.store import config_key

    path = write_tickets(tmp_path / "tickets.csv", n=30)
    before = cfg_for(task="classify", train_file=str(path))
    assert config_key(cfg_for(task="classify", train_file=str(path)).to_dict()) == config_key(before.to_dict())
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"please")] = ord("P")  # one byte of one text
    path.write_bytes(bytes(raw))
    after = cfg_for(task="classify", train_file=str(path))
    assert after.data_digest != before.data_digest
    assert config_key(after.to_dict()) != config_key(before.to_dict())
    with pytest.raises(PeftlabError, match="the data changed since this run was configured"):
        load_labelled(before)  # e.g. `peftlab evaluate` of a run trained on the old bytes


def test_a_sweep_over_files_is_an_axis_with_a_key_per_file(tmp_path):
    from peftlab.lab.spec import load_spec

    files = [str(write_tickets(tmp_path / f"{name}.csv", n=30, seed=i)) for i, name in enumerate(("a", "b"))]
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({"base": {"task": "classify", "model": "tiny-bert", "epochs": 1},
                                    "grid": {"train_file": files, "seed": [0, 1]}}))
    sweep = load_spec(spec, output_dir=str(tmp_path / "runs"))
    assert len(sweep.runs) == 4 and len({run.key for run in sweep.runs}) == 4
    assert len({run.config["data_digest"] for run in sweep.runs}) == 2


def test_a_save_to_disk_folder_trains_offline_with_its_class_names(tmp_path, capsys):
    import datasets

    rng = random.Random(1)
    names = ["negative", "positive"]

    def split(n):
        rows = [(f"{rng.choice(('awful', 'bad'))} {rng.choice(FILLERS)}", 0) if i % 2 == 0 else
                (f"{rng.choice(('great', 'good'))} {rng.choice(FILLERS)}", 1) for i in range(n)]
        return datasets.Dataset.from_dict({"sentence": [r[0] for r in rows], "label": [r[1] for r in rows]},
                                          features=datasets.Features({"sentence": datasets.Value("string"),
                                                                      "label": datasets.ClassLabel(names=names)}))

    folder = tmp_path / "reviews_ds"
    datasets.DatasetDict({"train": split(120), "validation": split(20), "test": split(10)}).save_to_disk(str(folder))
    out = tmp_path / "run"
    assert main(["train", "--task", "classify", "--dataset", str(folder), "--text-fields", "sentence",
                 "--metric", "f1", "--output-dir", str(out), *FAST]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["id2label"] == {"0": "negative", "1": "positive"} and result["primary_metric"] == "f1"
    assert result["data_files"]["validation"] == f"{folder} [validation]" and result["num_eval_examples"] == 20
    assert result["task_label"] == "reviews_ds" and len(result["config"]["data_digest"]) == 64
    capsys.readouterr()
    assert main(["train", "--task", "classify", "--dataset", str(folder), "--text-fields", "sentence",
                 "--eval-split", "dev", "--output-dir", str(tmp_path / "run2"), *FAST]) == 2
    assert "unknown split of" in capsys.readouterr().err and not (tmp_path / "run2").exists()


def test_every_file_format_reads_the_same_examples(tmp_path):
    import datasets


    rows = [{"question": f"q{i} \"quoted\"" if i == 3 else f"q{i}", "passage": f"p{i}", "label": ["no", "yes"][i % 2]}
            for i in range(40)]
    table = datasets.Dataset.from_list(rows)
    paths = {"csv": tmp_path / "d.csv", "tsv": tmp_path / "d.tsv", "json": tmp_path / "d.json",
             "jsonl": tmp_path / "d.jsonl", "parquet": tmp_path / "d.parquet"}
    table.to_csv(str(paths["csv"]), index=False)
    paths["tsv"].write_text("question\tpassage\tlabel\n" + "".join(f"{r['question']}\t{r['passage']}\t{r['label']}\n"
                                                                 for r in rows))
    paths["json"].write_text(json.dumps(rows))
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    table.to_parquet(str(paths["parquet"]))
    read = {kind: load_labelled(cfg_for(task="classify", train_file=str(path), text_fields="question,passage"))
            for kind, path in paths.items()}
    for kind, data in read.items():
        assert data.label_names == ("no", "yes"), kind
        assert data.train["text_a"][:] == read["csv"].train["text_a"][:], kind  # the quote survives every format
        assert data.train["text_b"][:] == read["csv"].train["text_b"][:], kind
        assert data.eval["text_a"][:] == read["csv"].eval["text_a"][:] and sorted(data.eval["label"][:]) == [0, 0, 1, 1]
    assert 'q3 "quoted"' in read["tsv"].train["text_a"][:]


def test_a_single_dataset_folder_is_split_held_out(tmp_path):
    import datasets


    folder = tmp_path / "one_split"
    datasets.Dataset.from_dict({"text": [f"t{i}" for i in range(40)],
                                "label": ["yes", "no"] * 20}).save_to_disk(str(folder))
    data = load_labelled(cfg_for(task="classify", dataset=str(folder)))
    assert data.label_names == ("no", "yes") and len(data.eval) == 4 and Counter(data.eval["label"][:]) == {0: 2, 1: 2}


def test_integer_labels_sort_numerically_and_the_baseline_is_the_eval_majority(tmp_path):
    from peftlab.tasks.metrics import chance_level

    lines = lambda labels: "".join(json.dumps({"text": f"t{i}", "label": v}) + "\n" for i, v in enumerate(labels))
    (tmp_path / "train.jsonl").write_text(lines([10, 2, 2, 10, 10, 1]))
    (tmp_path / "dev.jsonl").write_text(lines([2, 2, 2, 10]))
    data = load_labelled(cfg_for(task="classify", train_file=str(tmp_path / "train.jsonl"),
                                 eval_file=str(tmp_path / "dev.jsonl")))
    assert data.label_names == ("1", "2", "10")  # numerically, not as strings ("1", "10", "2")
    assert data.train["label"][:] == [2, 1, 1, 2, 2, 0] and data.eval["label"][:] == [1, 1, 1, 2]
    # the eval set's majority is 2 (id 1), although the training set's is 10: chance accuracy = 3/4, the bar a
    # constant prediction reaches on that set (as for GLUE)
    assert chance_level("classification", "accuracy", data.eval["label"][:], 3) == 0.75
    assert chance_level("classification", "matthews_correlation", data.eval["label"][:], 3) == 0
    # F1 of class id 1: 2 x 0.75 / 1.75 = 6/7; id 2 gets 0; scikit-learn's macro mean runs over the classes
    # present (id 0 is in neither the gold nor the predictions)
    assert chance_level("classification", "f1_macro", data.eval["label"][:], 3) == pytest.approx((6 / 7) / 2)
    assert chance_level("regression", "pearson", [3.0, 1.0], 1) == 0.0


def test_metric_aliases_and_sklearn_values(tmp_path):
    from sklearn.metrics import f1_score, matthews_corrcoef

    from peftlab.tasks.metrics import compute_label_metrics

    tickets = str(write_tickets(tmp_path / "tickets.csv", n=30))
    assert cfg_for(task="classify", train_file=tickets, metric="matthews").metric == "matthews_correlation"
    gold, pred = [0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 1]
    out = compute_label_metrics("classification", torch.nn.functional.one_hot(torch.tensor(pred), 2).numpy(), gold, 2)
    assert out["f1"] == pytest.approx(f1_score(gold, pred)) and out["f1"] != pytest.approx(out["f1_macro"])
    assert out["matthews_correlation"] == pytest.approx(matthews_corrcoef(gold, pred))
