"""peftlab.tasks.data_files: reading the shared GLUE TSVs, errors on bad files, subsets, token cache, collator, batching."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from peftlab.tasks import data_files as data
from peftlab.tasks import batching
from peftlab.errors import PeftlabError
from peftlab.tasks.metrics import chance_level
from peftlab.tasks.table import task as registered

REPO = Path(__file__).resolve().parents[1]


from conftest import DATA_DIR, needs_data  # noqa: E402

SHARED = DATA_DIR
needs_glue = needs_data("glue", "CoLA", "dev.tsv")

DEV_ROWS = {"cola": 1043, "sst2": 872, "mrpc": 408, "rte": 277, "stsb": 1500, "wnli": 71, "qnli": 5463}
TRAIN_ROWS = {"cola": 8551, "sst2": 67349, "mrpc": 3668, "rte": 2490, "stsb": 5749, "wnli": 635}
PAIR_TASKS = {"mrpc", "rte", "stsb", "wnli", "qnli"}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """No PEFTLAB_DATA_DIR and a working directory without ./data or ../shared/data."""
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("PEFTLAB_DATA_DIR", raising=False)
    return work


def fake_glue(root: Path, task_dir: str, name: str, text: str, *, glue_sub: bool = True) -> Path:
    folder = (root / "glue" if glue_sub else root) / task_dir
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


RTE_HEADER = "index\tsentence1\tsentence2\tlabel\n"
STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"


def stsb_row(i: int, score: str) -> str:
    return f"{i}\tmain\tMSRvid\t2012\t{i:04d}\tnone\tnone\tA man sings.\tA man is singing.\t{score}\n"


# --------------------------------------------------------------------------- the shared GLUE files


@needs_glue
@pytest.mark.parametrize("task", sorted(DEV_ROWS))
def test_validation_row_counts_and_columns(task):
    ds = data.load_split(task, "validation", SHARED)
    assert len(ds) == DEV_ROWS[task]
    expected = ["text_a", "text_b", "label"] if task in PAIR_TASKS else ["text_a", "label"]
    assert ds.column_names == expected
    labels = ds["label"]
    if task == "stsb":
        assert ds.features["label"].dtype == "float32"
        assert min(labels) >= 0.0 and max(labels) <= 5.0
    else:
        assert set(labels) == {0, 1}  # every dev set has both classes
    assert all(isinstance(t, str) and t for t in ds["text_a"])


@needs_glue
@pytest.mark.parametrize("task", sorted(TRAIN_ROWS))
def test_train_row_counts(task):
    assert len(data.load_split(task, "train", SHARED)) == TRAIN_ROWS[task]


@needs_glue
def test_mrpc_dev_bom_and_stray_quote():
    ds = data.load_split("mrpc", "validation", SHARED)
    first = ds[0]
    # The header line starts with a BOM; it must not turn into a data row or break the header.
    assert first["text_a"] == (
        "He said the foodservice pie business doesn 't fit the company 's long-term growth strategy ."
    )
    # An unbalanced quote: with csv quoting on, this would swallow the following lines.
    assert first["text_b"] == '" The foodservice pie business does not fit our long-term growth strategy .'
    assert first["label"] == 1
    assert ds[1]["label"] == 0
    assert not any(t.startswith("\ufeff") for t in ds["text_a"][:3])


@needs_glue
def test_label_mapping_by_name():
    rte = data.load_split("rte", "validation", SHARED)
    assert rte[0]["label"] == 1 and rte[1]["label"] == 0  # not_entailment, entailment
    qnli = data.load_split("qnli", "validation", SHARED)
    assert qnli[0]["label"] == 0 and qnli[1]["label"] == 1
    cola = data.load_split("cola", "validation", SHARED)  # no header: row 1 is data
    assert cola[0] == {"text_a": "The sailors rode the breeze clear of the rocks.", "label": 1}
    stsb = data.load_split("stsb", "validation", SHARED)
    assert stsb[0]["label"] == 5.0 and stsb[1]["label"] == pytest.approx(4.75)
    assert stsb[0]["text_a"] == "A man with a hard hat is dancing."
    wnli = data.load_split("wnli", "validation", SHARED)
    assert wnli[0]["label"] == 0 and wnli[1]["label"] == 1


@needs_glue
def test_fingerprint_is_content_addressed():
    a = data.load_split("rte", "validation", SHARED)
    b = data.load_split("rte", "validation", SHARED)
    c = data.load_split("rte", "train", SHARED)
    assert a._fingerprint == b._fingerprint != c._fingerprint
    # What the token cache keys on: peftlab's own digest of the rows.
    assert batching.train_examples_digest(a) == batching.train_examples_digest(b) != batching.train_examples_digest(c)


def test_qnli_train_and_mnli_offline_name_the_paths(offline, tmp_path):
    # A data root with GLUE's QNLI dev set only: no QNLI train, no MNLI, and no glue_subsets to fall back on.
    fake_glue(tmp_path, "QNLI", "dev.tsv", "index\tquestion\tsentence\tlabel\n0\tq?\ts.\tentailment\n")
    with pytest.raises(PeftlabError) as err:
        data.load_split("qnli", "train", tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "glue" / "QNLI" / "train.tsv") in msg
    assert str(tmp_path / "glue_subsets" / "QNLI" / "train.json") in msg  # the subset was looked for too
    assert "--data-dir" in msg and "PEFTLAB_DATA_DIR" in msg and "network" in msg
    with pytest.raises(PeftlabError, match="MNLI") as err:
        data.load_split("mnli", "validation_mismatched", tmp_path)
    assert str(tmp_path / "glue" / "MNLI" / "dev_mismatched.tsv") in str(err.value)


@needs_glue
@pytest.mark.parametrize("task, labels", [("qqp", 2), ("mnli", 3), ("qnli", 2)])
def test_glue_subsets_stand_in_for_missing_full_train_sets(offline, task, labels):
    train = data.load_split(task, "train", SHARED)
    assert len(train) == 8999 and set(train["label"]) == set(range(labels))
    assert train["text_a"][0] and train["text_b"][0]
    source, _ = data.locate_split(task, "train", SHARED)
    assert source.dataset == "glue_subsets" and source.path == SHARED / "glue_subsets" / task.upper() / "train.json"
    dev_source, _ = data.locate_split(task, "validation", SHARED)
    if task == "qnli":  # GLUE's real QNLI dev set is found first
        assert dev_source.dataset == "glue" and len(data.load_split(task, "validation", SHARED)) == 5463
    else:
        assert dev_source.dataset == "glue_subsets" and len(data.load_split(task, "validation", SHARED)) == 1000
    if task == "mnli":  # one dev set in the subsets: no matched/mismatched pair
        assert data.available_eval_splits("mnli", SHARED) == ("validation",)
        with pytest.raises(PeftlabError, match="MNLI"):
            data.load_split("mnli", "validation_mismatched", SHARED)


def test_glue_subset_bad_record_names_file_and_record(tmp_path):
    folder = tmp_path / "glue_subsets" / "QQP"
    folder.mkdir(parents=True)
    (folder / "train.json").write_text('{"0": {"text_a": "a", "text_b": "b", "label": "0"}, '
                                       '"1": {"text_a": "a", "text_b": "b", "label": "maybe"}}')
    with pytest.raises(PeftlabError, match=r"train.json: record '1' needs text_a, text_b and a label in 0, 1"):
        data.load_split("qqp", "train", tmp_path)


def test_no_data_anywhere_lists_every_folder_tried(isolated, offline, monkeypatch, tmp_path):
    monkeypatch.setenv("PEFTLAB_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(PeftlabError) as err:
        data.load_split("qqp", "train")
    msg = str(err.value)
    for root in (tmp_path / "nowhere", isolated / "data", isolated.parent / "shared" / "data"):
        assert str(root / "glue" / "QQP" / "train.tsv") in msg
    assert "not trying the Hub" in msg


# --------------------------------------------------------------------------- finding the data


def test_data_roots_order(isolated, monkeypatch, tmp_path):
    def found(data_dir=None):
        return data.locate_data_file(data_dir, ("f.txt",))[0]

    assert found() is None
    (isolated / "data").mkdir()
    (isolated / "data" / "f.txt").write_text("x")
    assert found() == isolated / "data" / "f.txt"
    env = tmp_path / "env"
    env.mkdir()
    (env / "f.txt").write_text("x")
    monkeypatch.setenv("PEFTLAB_DATA_DIR", str(env))
    assert found() == env / "f.txt"
    (tmp_path / "f.txt").write_text("x")
    assert found(str(tmp_path)) == tmp_path / "f.txt"
    with pytest.raises(PeftlabError, match="does not exist"):
        found(str(tmp_path / "missing"))


def test_data_roots_shared_fallback(tmp_path, monkeypatch):
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    (shared / "f.txt").write_text("x")
    work = tmp_path / "repo"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("PEFTLAB_DATA_DIR", raising=False)
    assert data.locate_data_file(None, ("f.txt",))[0] == shared / "f.txt"


def test_glue_data_layout_and_env_var(isolated, monkeypatch, tmp_path):
    root = tmp_path / "glue_data"
    fake_glue(root, "WNLI", "dev.tsv", RTE_HEADER + "0\tA b.\tC d.\t1\n1\tE f.\tG h.\t0\n", glue_sub=False)
    ds = data.load_split("wnli", "validation", root)  # a glue_data folder holding WNLI/ directly
    assert ds.to_dict() == {"text_a": ["A b.", "E f."], "text_b": ["C d.", "G h."], "label": [1, 0]}
    monkeypatch.setenv("PEFTLAB_DATA_DIR", str(root))
    assert len(data.load_split("wnli", "validation")) == 2


def test_mnli_layout(tmp_path):
    header = ("index\tpromptID\tpairID\tgenre\ts1b\ts2b\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3"
              "\tlabel4\tlabel5\tgold_label\n")
    row = "0\t1\t1n\tgov\tx\tx\tx\tx\tPremise.\tHypothesis.\tneutral\tneutral\tneutral\tneutral\tneutral\tneutral\n"
    row2 = row.replace("neutral", "contradiction")
    fake_glue(tmp_path, "MNLI", "dev_matched.tsv", header + row + row2)
    fake_glue(tmp_path, "MNLI", "dev_mismatched.tsv", header + row2)
    matched = data.load_split("mnli", "validation_matched", tmp_path)
    assert matched.to_dict() == {"text_a": ["Premise."] * 2, "text_b": ["Hypothesis."] * 2, "label": [1, 2]}
    assert data.load_split("mnli", "validation", tmp_path)["label"] == [1, 2]  # validation = matched
    assert data.load_split("mnli", "validation_mismatched", tmp_path)["label"] == [2]


def test_explicit_missing_data_dir(tmp_path):
    with pytest.raises(PeftlabError, match="does not exist"):
        data.load_split("rte", "train", tmp_path / "nope")


@pytest.mark.parametrize(
    "task,split,match",
    [("nosuch", "train", "unknown task"), ("rte", "test", "no labels"), ("rte", "validation_matched", "unknown split"),
     ("gsm8k", "train", "not a GLUE task")],
)
def test_bad_task_or_split(task, split, match):
    with pytest.raises(PeftlabError, match=match):
        data.load_split(task, split)


# --------------------------------------------------------------------------- malformed files


def test_wrong_column_count_names_file_and_line(tmp_path):
    path = fake_glue(tmp_path, "RTE", "train.tsv", RTE_HEADER + "0\ta\tb\tentailment\n1\ta\tb\n")
    with pytest.raises(PeftlabError) as err:
        data.load_split("rte", "train", tmp_path)
    assert f"{path}:3" in str(err.value) and "3 tab-separated columns, expected 4" in str(err.value)


def test_cola_wrong_column_count(tmp_path):
    path = fake_glue(tmp_path, "CoLA", "dev.tsv", "gj04\t1\t\tFine.\ngj04\t0\tBad sentence.\n")
    with pytest.raises(PeftlabError, match="expected 4") as err:
        data.load_split("cola", "validation", tmp_path)
    assert f"{path}:2" in str(err.value)


def test_unknown_label(tmp_path):
    path = fake_glue(tmp_path, "RTE", "dev.tsv", RTE_HEADER + "0\ta\tb\tentailment\n1\ta\tb\tmaybe\n")
    with pytest.raises(PeftlabError, match="unknown label 'maybe'") as err:
        data.load_split("rte", "validation", tmp_path)
    assert f"{path}:3" in str(err.value) and "entailment, not_entailment" in str(err.value)


def test_non_numeric_stsb_score(tmp_path):
    path = fake_glue(tmp_path, "STS-B", "dev.tsv", STSB_HEADER + stsb_row(0, "4.5") + stsb_row(1, "high"))
    with pytest.raises(PeftlabError, match="score 'high' is not a number") as err:
        data.load_split("stsb", "validation", tmp_path)
    assert f"{path}:3" in str(err.value)


@pytest.mark.parametrize("content", ["", RTE_HEADER, "\n\n"])
def test_empty_file(tmp_path, content):
    path = fake_glue(tmp_path, "RTE", "train.tsv", content)
    with pytest.raises(PeftlabError, match="no data rows") as err:
        data.load_split("rte", "train", tmp_path)
    assert str(path) in str(err.value)


def test_missing_file_offline(tmp_path, offline):
    fake_glue(tmp_path, "RTE", "dev.tsv", RTE_HEADER + "0\ta\tb\tentailment\n")
    with pytest.raises(PeftlabError) as err:
        data.load_split("rte", "train", tmp_path)
    assert str(tmp_path / "glue" / "RTE" / "train.tsv") in str(err.value)
    assert "fix:" in str(err.value)


def test_crlf_bom_and_quotes(tmp_path):
    text = "\ufeff" + RTE_HEADER.replace("\n", "\r\n") + '0\tHe said " yes.\t"Quoted" end\tentailment\r\n'
    fake_glue(tmp_path, "RTE", "dev.tsv", text)
    ds = data.load_split("rte", "validation", tmp_path)
    assert ds.to_dict() == {"text_a": ['He said " yes.'], "text_b": ['"Quoted" end'], "label": [0]}


# --------------------------------------------------------------------------- the Hub path (simulated)


def test_hub_fallback_maps_columns(tmp_path, monkeypatch):
    import datasets

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls = []

    def fake_load_dataset(path, name, split):
        calls.append((path, name, split))
        features = datasets.Features({
            "question": datasets.Value("string"), "sentence": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["entailment", "not_entailment"]), "idx": datasets.Value("int32"),
        })
        return datasets.Dataset.from_dict(
            {"question": ["q1", "q2", "q3"], "sentence": ["s1", "s2", "s3"], "label": [1, -1, 0], "idx": [0, 1, 2]},
            features=features,
        )

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = data.load_split("qnli", "train", tmp_path)
    assert calls == [("nyu-mll/glue", "qnli", "train")]
    assert ds.column_names == ["text_a", "text_b", "label"]
    assert ds.to_dict() == {"text_a": ["q1", "q3"], "text_b": ["s1", "s3"], "label": [1, 0]}

    def failing(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(PeftlabError, match="Couldn't reach the Hub") as err:
        data.load_split("mnli", "validation", tmp_path)
    assert str(tmp_path / "glue" / "MNLI" / "dev_matched.tsv") in str(err.value)


# --------------------------------------------------------------------------- subsets


def _toy(n: int = 20):
    import datasets

    return datasets.Dataset.from_dict({"text_a": [f"s{i}" for i in range(n)], "label": [i % 2 for i in range(n)]})


def test_subset_deterministic():
    ds = _toy()
    a, b = data.subset(ds, 5, seed=3), data.subset(ds, 5, seed=3)
    assert a["text_a"] == b["text_a"] and len(a) == 5
    assert a._fingerprint == b._fingerprint
    assert data.subset(ds, 5, seed=4)["text_a"] != a["text_a"]
    assert data.subset(ds, 8, seed=3)["text_a"][:5] == a["text_a"]  # prefix property
    assert data.subset(ds, None, seed=3) is ds
    everything = data.subset(ds, 100, seed=3)
    assert len(everything) == 20 and sorted(everything["text_a"]) == sorted(ds["text_a"])
    assert everything["text_a"][:5] == a["text_a"]
    for bad in (0, -1, 2.5):
        with pytest.raises(PeftlabError, match="positive integer"):
            data.subset(ds, bad, seed=0)


# --------------------------------------------------------------------------- tokenisation


@pytest.fixture(scope="module")
def tokenizer():
    from peftlab.models.registry import MODELS, load_tokenizer

    if not MODELS["minilm-l6"].available():
        pytest.skip("minilm-l6 is not installed")
    return load_tokenizer("minilm-l6")


def _pairs():
    import datasets

    return datasets.Dataset.from_dict({
        "text_a": ["A short one.", "A much longer first sentence with many more words in it than the others."],
        "text_b": ["Second.", "And a second sentence."],
        "label": [0, 1],
    })


def test_tokenize_columns_and_truncation(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    out = batching.tokenize(_pairs(), tokenizer, 12, task="mrpc", cache_key="t")
    assert set(out.column_names) == {"input_ids", "attention_mask", "token_type_ids", "labels", "length"}
    assert out["labels"] == [0, 1]
    assert out["length"] == [len(ids) for ids in out["input_ids"]]
    assert out["length"][1] == 12 and out["length"][0] < 12  # truncated, not padded
    assert tokenizer.sep_token_id in out["input_ids"][0]
    assert max(out["token_type_ids"][0]) == 1  # a pair: segment ids 0 then 1


def test_tokenize_single_sentence_and_float_labels(tokenizer, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    single = datasets.Dataset.from_dict({"text_a": ["One sentence."], "label": [1]})
    out = batching.tokenize(single, tokenizer, 32, task="sst2", cache_key="s")
    assert max(out["token_type_ids"][0]) == 0
    stsb = datasets.Dataset.from_dict(
        {"text_a": ["a"], "text_b": ["b"], "label": [3.5]},
        features=datasets.Features({"text_a": datasets.Value("string"), "text_b": datasets.Value("string"),
                                    "label": datasets.Value("float32")}),
    )
    assert batching.tokenize(stsb, tokenizer, 32, task="stsb", cache_key="s")["labels"] == [3.5]


def test_tokenize_cache_reused(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    calls = []
    original = type(tokenizer).__call__

    def counting(self, *args, **kwargs):
        calls.append(len(args[0]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    ds = _pairs()
    first = batching.tokenize(ds, tokenizer, 16, task="mrpc", cache_key="train")
    assert sum(calls) == 2
    files = list((tmp_path / "cache" / "tokenized").glob("*.arrow"))
    assert len(files) == 1 and first.cache_files[0]["filename"] == str(files[0])

    second = batching.tokenize(_pairs(), tokenizer, 16, task="mrpc", cache_key="train")  # same content, new object
    assert sum(calls) == 2, "second call re-tokenised"
    assert second["input_ids"] == first["input_ids"] and second._fingerprint == first._fingerprint

    batching.tokenize(ds, tokenizer, 8, task="mrpc", cache_key="train")  # another max_length: a new cache file
    assert sum(calls) == 4
    batching.tokenize(ds, tokenizer, 16, task="mrpc", cache_key="eval")  # another cache key: a new cache file
    assert sum(calls) == 6
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.arrow"))) == 3


def test_tokenize_cache_follows_file_content(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    path = fake_glue(tmp_path, "RTE", "dev.tsv", RTE_HEADER + "0\tOne.\tTwo.\tentailment\n")
    a = batching.tokenize(data.load_split("rte", "validation", tmp_path), tokenizer, 16, task="rte", cache_key="k")
    path.write_text(RTE_HEADER + "0\tThree four five.\tSix.\tnot_entailment\n", encoding="utf-8")
    b = batching.tokenize(data.load_split("rte", "validation", tmp_path), tokenizer, 16, task="rte", cache_key="k")
    assert a["input_ids"] != b["input_ids"] and b["labels"] == [1]


@needs_glue
def test_tokenize_subset_of_real_split(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    raw = data.subset(data.load_split("mrpc", "validation", SHARED), 32, seed=0)
    out = batching.tokenize(raw, tokenizer, 64, task="mrpc", cache_key="minilm-l6-validation")
    assert len(out) == 32 and max(out["length"]) <= 64 and out["labels"] == raw["label"]
    again = batching.tokenize(data.subset(data.load_split("mrpc", "validation", SHARED), 32, seed=0), tokenizer, 64,
                          task="mrpc", cache_key="minilm-l6-validation")
    assert again.cache_files == out.cache_files


# --------------------------------------------------------------------------- collator


def test_collator_dynamic_and_max_padding(tokenizer, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    out = batching.tokenize(_pairs(), tokenizer, 20, task="mrpc", cache_key="c")
    features = [out[i] for i in range(len(out))]
    longest = max(out["length"])

    batch = batching.Collator(tokenizer, False, 20)(features)
    assert "length" not in batch
    assert batch["input_ids"].shape == (2, longest)
    assert batch["labels"].tolist() == [0, 1] and batch["labels"].dtype == torch.long
    assert batch["attention_mask"].sum(dim=1).tolist() == out["length"]
    assert batch["input_ids"][0, -1].item() == tokenizer.pad_token_id

    fixed = batching.Collator(tokenizer, True, 20)(features)
    assert fixed["input_ids"].shape == (2, 20) and fixed["attention_mask"].shape == (2, 20)
    assert fixed["attention_mask"].sum(dim=1).tolist() == out["length"]

    reg = [{"input_ids": [101, 7, 102], "attention_mask": [1, 1, 1], "labels": 2.5, "length": 3}]
    assert batching.Collator(tokenizer, False, 8)(reg)["labels"].dtype == torch.float32


# --------------------------------------------------------------------------- length-grouped batches


def test_length_grouped_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 200, size=1000).tolist()
    a = batching.length_grouped_batches(lengths, 16, seed=1, epoch=0)
    assert a == batching.length_grouped_batches(lengths, 16, seed=1, epoch=0)
    assert a != batching.length_grouped_batches(lengths, 16, seed=1, epoch=1)
    assert a != batching.length_grouped_batches(lengths, 16, seed=2, epoch=0)
    flat = [i for batch in a for i in batch]
    assert sorted(flat) == list(range(1000))  # every index exactly once
    assert Counter(len(b) for b in a) == Counter({16: 62, 8: 1})
    assert max(lengths) in [lengths[i] for i in a[0]]  # the longest batch comes first
    spread = np.mean([np.ptp([lengths[i] for i in b]) for b in a if len(b) == 16])
    assert spread < 40  # random batches of 16 would spread over ~170
    # the batch order is shuffled: batches are not sorted by length across the epoch
    maxima = [max(lengths[i] for i in b) for b in a[1:]]
    assert maxima != sorted(maxima, reverse=True)


def test_length_grouped_batches_small_and_empty():
    assert batching.length_grouped_batches([], 4, seed=0, epoch=0) == []
    batches = batching.length_grouped_batches([3, 1, 2], 8, seed=0, epoch=0)
    assert len(batches) == 1 and sorted(batches[0]) == [0, 1, 2]
    with pytest.raises(PeftlabError):
        batching.length_grouped_batches([1, 2], 0, seed=0, epoch=0)


# --------------------------------------------------------------------------- majority baseline


def glue_chance(name: str, eval_labels) -> float:
    task = registered(name)
    return chance_level(task.kind, task.primary_metric, eval_labels, task.num_labels)


def test_majority_baseline():
    # the eval set's own majority class (the training set plays no part)
    assert glue_chance("rte", [0, 1, 1, 1]) == pytest.approx(0.75)
    assert glue_chance("sst2", [1, 1, 0, 1]) == pytest.approx(0.75)
    assert glue_chance("mnli", [2, 0, 0]) == pytest.approx(2 / 3)
    assert glue_chance("rte", [1, 1, 1, 1, 1, 0, 0, 0]) == pytest.approx(0.625)
    assert glue_chance("cola", [1, 0]) == 0.0
    assert glue_chance("stsb", [3.0]) == 0.0
    assert chance_level("classification", "f1", [0, 0, 1], 2) == 0.0  # majority 0 never predicts the positive class
    assert chance_level("classification", "f1", [1, 1, 0], 2) == pytest.approx(0.8)
    with pytest.raises(PeftlabError):
        registered("nosuch")


@needs_glue
def test_majority_baseline_real_rte():
    train = data.load_split("rte", "train", SHARED)["label"]
    dev = data.load_split("rte", "validation", SHARED)["label"]
    assert len(train) > 0
    chance = glue_chance("rte", dev)
    majority = Counter(dev).most_common(1)[0][0]
    assert chance == pytest.approx(sum(1 for y in dev if y == majority) / len(dev))
    assert 0.45 < chance < 0.55
