"""Decoder tasks scored on generated text (commonsense, math, e2e): answer extraction, the E2E metrics against
the official E2E script's values, batched generation, bad input, and tiny runs through `peftlab train`, `sweep`
and `report` on a random tiny Llama."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.tasks import commonsense, e2e, generation, generative, math_tasks, nlg_metrics
from peftlab.tasks.nlg_metrics import corpus_scores
from peftlab.tasks.nlg_score import score_files
from peftlab.tasks.prepare import build_pipeline

from conftest import DATA_DIR, needs_data  # noqa: E402

needs_commonsense = needs_data("commonsense", "boolq", "train.json")
needs_math = needs_data("math", "math_data.json")
needs_e2e = needs_data("e2e", "testset_w_refs.csv")

TINY = {"model": "tiny-llama", "method": "lora", "targets": "q,v", "rank": 4, "epochs": 1, "batch_size": 8,
        "max_length": 64, "max_train_samples": 8, "max_eval_samples": 2, "max_new_tokens": 6, "eval_batch_size": 8,
        "threads": 1, "report_to": "none"}


def train_argv(task: str, out: Path, **overrides) -> list[str]:
    argv = ["train", "--task", task, "--output-dir", str(out)]
    for key, value in {**TINY, **overrides}.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- commonsense answer extraction

@pytest.mark.parametrize("set_name,text,expected", [
    ("boolq", "the correct answer is true", "true"),
    ("boolq", "false, it is not true", "false"),  # the first answer word wins
    ("boolq", "True", ""),  # LLM-Adapters' regex is case-sensitive
    ("boolq", "it is untrue", "true"),  # ... and matches inside words, as LLM-Adapters' does
    ("piqa", "the correct answer is solution2, not solution1", "solution2"),
    ("piqa", "Solution1", ""),
    ("social_i_qa", "the correct answer is answer3", "answer3"),
    ("ARC-Easy", "answer4", "answer4"),
    ("ARC-Challenge", "answer 2", ""),
    ("openbookqa", "I pick answer5 then answer1", "answer5"),
    ("winogrande", "the correct answer is option2", "option2"),
    ("winogrande", "answer1", ""),  # another set's answer word is no answer here
    ("piqa", "", ""),
])
def test_commonsense_extracts_the_first_answer_word(set_name, text, expected):
    assert commonsense.extract_answer(set_name, text) == expected


# --------------------------------------------------------------------------- math answer extraction

@pytest.mark.parametrize("text,gold,strict,flexible,strict_ok,flexible_ok", [
    ("5 + 3 = 8.\n#### 8", "8.0", "8", "8", True, True),
    ("The answer is 1,234.", "1234", "1,234", "1,234.", True, True),
    ("The answer is 18. Then she buys 3 more.", "18.0", "18.", "3", True, False),  # flexible: the last number
    ("I think it is 42", "42", None, "42", False, True),  # no final-answer format: only flexible finds it
    ("The answer is 4.\n#### 5", "5", "5", "5", True, True),  # the harness's '####' regex is tried first
    ("#### -3", "-3.0", "-3", "-3", True, True),
    ("It costs $5", "5", None, "$5", False, True),
    ("x is 7", "7", None, "7", False, True),  # a single digit: the flexible regex's second alternative
    ("The answer is 1.833.\n", "1.8333333333333335", "1.833", "1.833.", True, True),  # within 0.001
    ("The answer is 1.83.\n", "1.8333333333333335", "1.83", "1.83.", False, False),
    # The harness's cot regex ends in an unescaped '.', which takes the last digit when nothing follows.
    ("The answer is 576", "576.0", "57", "576", False, True),
    ("no numbers", "5", None, None, False, False),
])
def test_math_strict_and_flexible_extraction(text, gold, strict, flexible, strict_ok, flexible_ok):
    assert math_tasks.strict_answer(text) == strict
    assert math_tasks.flexible_answer(text) == flexible
    assert math_tasks.is_correct(math_tasks.strict_answer(text), gold) is strict_ok
    assert math_tasks.is_correct(math_tasks.flexible_answer(text), gold) is flexible_ok


@pytest.mark.parametrize("text,strict,flexible", [
    ("so the speed is 3.85 miles.The answer is (D).", "D", "D"),
    ("The answer is B", "B", "B"),
    ("#### (C)", "C", "C"),
    ("A man walks 3 miles, so (E) fits", None, "E"),
    ("A man walks 3 miles", None, "A"),  # the loose extraction counts an article
    ("Bill is ABC", None, None),  # letters inside words are not choices
])
def test_aqua_answers_are_letters(text, strict, flexible):
    assert math_tasks.strict_answer(text, letters=True) == strict
    assert math_tasks.flexible_answer(text, letters=True) == flexible
    assert math_tasks.is_correct(strict, "D", letters=True) is (strict == "D")


# --------------------------------------------------------------------------- E2E metrics

HYPOTHESES = ["The Eagle is a cheap coffee shop near Burger King.", "Alimentum serves Italian food in the city centre.",
              "Blue Spice is a family friendly pub."]
REFERENCES = [["The Eagle is a low-priced coffee shop near Burger King.",
               "Near Burger King is The Eagle, a cheap cafe."],
              ["In the city centre, Alimentum serves Italian food."],
              ["Blue Spice is a family-friendly pub by the river.", "A pub called Blue Spice is family friendly.",
               "Blue Spice, a family friendly pub."]]


# The official E2E script's values (tuetschek/e2e-metrics @ 1b9c4d87fd0bbb171ea966741cdc012588581ed4,
# measure_scores.py -p, unrounded) on these references, for these outputs, the first references ("perfect") and
# degenerate ones (two empty outputs and a two-token one: mteval's n-gram totals go negative, which the script
# takes as they are). Agreement to 1e-9 relative leaves room for float summation order only (see test_nlg_score).
OFFICIAL_SMALL = {
    "outputs": {"bleu": 0.7045300514618555, "nist": 5.563453970358034, "meteor": 0.49218001068849665,
                "rouge_l": 0.7786871270247229, "cider": 5.639699031682042},
    "perfect": {"bleu": 1.0, "nist": 5.762250676008356, "meteor": 1.0, "rouge_l": 1.0, "cider": 7.017963427953312},
    "degenerate": {"bleu": 1.6233119629655864e-06, "nist": 1.578707894876075e-07, "meteor": 0.02954755309325946,
                   "rouge_l": 0.15288220551378445, "cider": 0.29986390932925894},
}
SMALL_OUTPUTS = {"outputs": HYPOTHESES, "perfect": [refs[0] for refs in REFERENCES], "degenerate": ["", "", "a pub"]}
needs_java = pytest.mark.skipif(shutil.which("java") is None,
                                reason="java: no `java` on PATH; METEOR 1.5 and the PTB tokenizer need it")


@needs_java
@pytest.mark.parametrize("name", list(OFFICIAL_SMALL))
def test_e2e_metrics_equal_the_official_script(name):
    scores = corpus_scores(SMALL_OUTPUTS[name], REFERENCES)
    assert scores.metrics == pytest.approx(OFFICIAL_SMALL[name], rel=1e-9, abs=1e-15)
    assert scores.unavailable == {} and scores.notes == ()
    assert set(scores.implementations) == set(scores.metrics)


def test_e2e_bleu_and_nist_need_no_java(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no java there
    for name, outputs in SMALL_OUTPUTS.items():
        scores = corpus_scores(outputs, REFERENCES)
        assert {k: scores.metrics[k] for k in ("bleu", "nist")} == pytest.approx(
            {k: OFFICIAL_SMALL[name][k] for k in ("bleu", "nist")}, rel=1e-9, abs=1e-15)
        assert "meteor" not in scores.metrics and "no `java` on PATH" in scores.unavailable["meteor"]
        assert "nltk" in scores.implementations["rouge_l"] and scores.notes


def test_e2e_nist_left_out_where_the_script_divides_by_zero():
    no_java = nlg_metrics.JavaRuntime(None, None, "not needed here")
    scores = corpus_scores(["a b c d", "w x y z"], [["a b c d e"], ["w x"]], java=no_java)  # 5-gram total: 0
    assert "nist" not in scores.metrics and "divides by it" in scores.unavailable["nist"]
    assert scores.metrics["bleu"] > 0


def test_e2e_csv_groups_every_reference_per_mr(tmp_path):
    path = tmp_path / "refs.csv"
    path.write_text('mr,ref\n"name[A], food[Thai]","A serves Thai food."\n"name[B]","B."\n'
                    '"name[A], food[Thai]","Thai food at A."\n')
    assert e2e.group_references(e2e.read_e2e_csv(path)) == [
        ("name[A], food[Thai]", ["A serves Thai food.", "Thai food at A."]), ("name[B]", ["B."])]
    bad = tmp_path / "bad.csv"
    bad.write_text("meaning,text\nx,y\n")
    with pytest.raises(PeftlabError, match="header 'mr,ref'"):
        e2e.read_e2e_csv(bad)
    bad.write_text('mr,ref\n"name[A]",""\n')
    with pytest.raises(PeftlabError, match=r"bad.csv:2"):
        e2e.read_e2e_csv(bad)


# --------------------------------------------------------------------------- generation


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(chatty_llama):
    from transformers import GenerationConfig

    from peftlab.tasks.generation import stop_token_ids
    from peftlab.tasks.instructions import encode_prompt

    model, tokenizer = chatty_llama
    questions = ["Hi", "What is 2+2? Think.", "A much longer question about cats and dogs, is it not?", "Why?"]
    prompts = [encode_prompt(tokenizer, q) for q in questions]
    stops = stop_token_ids(tokenizer)

    def alone(prompt):
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
            max_new_tokens=10, do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id))
        tokens = out[0, len(prompt):].tolist()
        tokens = tokens[:next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]
        return tokenizer.decode(tokens, skip_special_tokens=True).strip()

    expected = [alone(p) for p in prompts]
    assert len(set(expected)) == len(prompts)  # the model says different things
    for batch_size in (4, 3):
        assert generation.generate_greedy(model, tokenizer, prompts, max_new_tokens=10,
                                          batch_size=batch_size) == expected
    # Per-row stop rules: row 1 stops as soon as it has any text; the others are unaffected.
    rules = [lambda t: False, lambda t: bool(t.strip()), lambda t: False, lambda t: False]
    stopped = generation.generate_greedy(model, tokenizer, prompts, max_new_tokens=10, batch_size=4,
                                         stop_when=rules)
    assert stopped[0] == expected[0] and stopped[2:] == expected[2:]
    assert stopped[1] and expected[1].startswith(stopped[1]) and len(stopped[1]) < len(expected[1])


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("overrides,message", [
    ({"task": "commonsense", "eval_sets": "boolq,piqq"}, "unknown commonsense set 'piqq' (did you mean 'piqa'?)"),
    ({"task": "commonsense", "eval_sets": "hellaswag"}, "HellaSwag's test set is not available offline"),
    ({"task": "commonsense", "train_sets": "piqa"}, "unknown commonsense set 'piqa'"),  # no train split offline
    ({"task": "math", "eval_sets": "gsm9k"}, "did you mean 'gsm8k'?"),
    ({"task": "rte", "eval_sets": "boolq"}, "task 'rte' has no named sets"),
    ({"task": "e2e", "train_sets": "boolq"}, "task 'e2e' has no named sets"),
    ({"task": "math", "eval_sets": " , "}, "names no set"),
])
def test_bad_set_names_are_one_line_errors(overrides, message):
    with pytest.raises(PeftlabError) as err:
        build_run_config(overrides={"model": "tiny-llama", **overrides})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_set_names_are_canonicalised_and_defaults_per_task():
    cfg = build_run_config(overrides={"model": "tiny-llama", "task": "commonsense",
                                               "eval_sets": "arc-easy, BOOLQ,arc-easy", "train_sets": "boolq"})
    assert cfg.eval_sets == "ARC-Easy,boolq" and cfg.train_sets == "boolq"
    assert cfg.max_new_tokens == 32 and cfg.eval_every == 0 and cfg.max_length == 256
    assert build_run_config(overrides={"model": "tiny-llama", "task": "e2e"}).max_new_tokens == 64
    assert build_run_config(overrides={"model": "tiny-llama", "task": "math",
                                                "max_new_tokens": 9}).max_new_tokens == 9


@pytest.mark.parametrize("task,missing", [("commonsense", "commonsense/boolq/train.json"),
                                          ("math", "math/math_data.json"), ("e2e", "e2e/devset.csv")])
def test_missing_data_files_fail_in_one_line_and_leave_nothing(tmp_path, capsys, task, missing):
    empty = tmp_path / "data"
    empty.mkdir()
    out = tmp_path / "run"
    assert main(train_argv(task, out, data_dir=str(empty))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not found" in err and str(empty / missing) in err
    assert not out.exists()


def test_malformed_llm_adapters_files_name_the_record(tmp_path):
    path = tmp_path / "test.json"
    path.write_text('[{"instruction": "q", "answer": "true"},\n {"instruction": }]')
    with pytest.raises(PeftlabError, match=r"test.json:2"):
        generative.read_llm_adapters_json(path)
    path.write_text('[{"instruction": "q", "answer": "true"}, {"instruction": "q2", "answer": 3}]')
    with pytest.raises(PeftlabError, match=r"'answer' is a JSON int.*record 2"):
        generative.read_llm_adapters_json(path)
    (tmp_path / "commonsense" / "boolq").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "commonsense" / "boolq" / f"{split}.json").write_text(json.dumps(
            [{"instruction": "Is it?", "input": "", "output": "the correct answer is true", "answer": "maybe"}]))
    cfg = build_run_config(overrides={"model": "tiny-llama", "task": "commonsense", "train_sets": "boolq",
                                               "eval_sets": "boolq", "data_dir": str(tmp_path)})
    with pytest.raises(PeftlabError, match=r"gold answer 'maybe' is not one of true/false.*record 1"):
        build_pipeline(cfg, _tokenizer(), None)


def _tokenizer():
    from peftlab.models.registry import load_tokenizer

    return load_tokenizer("tiny-llama")


# --------------------------------------------------------------------------- tiny runs through `peftlab train`


@needs_commonsense
def test_commonsense_train_scores_each_set_and_their_mean(tmp_path, monkeypatch):
    real = generation.generate_greedy

    def answer_true(*args, **kwargs):  # the real generation, then a BoolQ answer word the random model lacks
        return [text + " the correct answer is true" for text in real(*args, **kwargs)]

    monkeypatch.setattr(generation, "generate_greedy", answer_true)
    out = tmp_path / "run"
    assert main(train_argv("commonsense", out, eval_sets="boolq,piqa,ARC-Easy", max_eval_samples=3)) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "ok" and result["primary_metric"] == "accuracy"
    assert result["eval_sets"] == ["boolq", "piqa", "ARC-Easy"]
    assert result["train_sets"] == ["boolq", "ARC-Easy", "ARC-Challenge", "openbookqa"]
    assert set(result["data_files"]) == {"train/boolq", "train/ARC-Easy", "train/ARC-Challenge", "train/openbookqa",
                                         "test/boolq", "test/piqa", "test/ARC-Easy"}
    assert any("HellaSwag" in n and "commonsense_170k" in n for n in result["report_notes"])
    assert result["generations"] == {"before": "generations_before.jsonl", "epoch1": "generations_epoch1.jsonl"}
    records = read_jsonl(out / "generations_epoch1.jsonl")
    assert [r["set"] for r in records] == ["boolq"] * 3 + ["piqa"] * 3 + ["ARC-Easy"] * 3
    golds = {r["instruction"]: r["answer"] for r in json.loads((DATA_DIR / "commonsense/boolq/test.json").read_text())}
    metrics = result["final"]["metrics"]
    boolq = [r for r in records if r["set"] == "boolq"]
    assert all(r["gold"] == golds[r["instruction"]] for r in boolq)  # the real test set's answers
    assert metrics["boolq_answered"] == 1.0
    assert metrics["boolq_accuracy"] == pytest.approx(sum(r["gold"] == "true" for r in boolq) / 3)
    for name in ("boolq", "piqa", "ARC-Easy"):  # recomputed from the logged texts
        rows = [r for r in records if r["set"] == name]
        key = commonsense.metric_key(name)
        assert metrics[f"{key}_accuracy"] == pytest.approx(
            sum(commonsense.extract_answer(name, r["generated"]) == r["gold"] for r in rows) / 3)
    assert metrics["accuracy"] == pytest.approx(
        (metrics["boolq_accuracy"] + metrics["piqa_accuracy"] + metrics["arc_easy_accuracy"]) / 3)
    assert result["before"]["metrics"].keys() == metrics.keys()


@needs_math
def test_math_train_reports_strict_and_flexible_per_set(tmp_path, monkeypatch):
    golds = {}
    for name in ("gsm8k", "AQuA"):
        for r in json.loads((DATA_DIR / "math" / name / "test.json").read_text()):
            golds[r["instruction"].strip()] = (name, r["answer"])

    def final_answer_then_noise(model, tok, prompts, **kwargs):
        """The gold answer in the final-answer format, then a wrong last number/letter: strict right, flexible
        wrong."""
        texts = []
        for prompt in prompts:
            decoded = tok.decode(prompt)
            name, gold = next(v for q, v in golds.items() if q in decoded)
            texts.append(f"The answer is ({gold}). {'B' if gold == 'A' else 'A'}" if name == "AQuA"
                         else f"The answer is {gold}. So 99999 it is")
        return texts

    monkeypatch.setattr(generation, "generate_greedy", final_answer_then_noise)
    out = tmp_path / "run"
    assert main(train_argv("math", out, eval_sets="gsm8k,AQuA")) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "ok" and result["primary_metric"] == "strict_match"
    metrics = result["final"]["metrics"]
    assert metrics == {"gsm8k_strict_match": 1.0, "aqua_strict_match": 1.0, "strict_match": 1.0,
                       "gsm8k_flexible_extract": 0.0, "aqua_flexible_extract": 0.0, "flexible_extract": 0.0}
    assert any("MetaMathQA" in n for n in result["report_notes"])
    assert result["train_records_without_output"] == 3  # math_data.json's records with no solution
    records = read_jsonl(out / "generations_epoch1.jsonl")
    assert {r["set"] for r in records} == {"gsm8k", "AQuA"} and len(records) == 4
    assert all(r["strict_correct"] and not r["flexible_correct"] for r in records)


@needs_e2e
def test_e2e_train_scores_generations_against_all_references(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert main(train_argv("e2e", out, max_eval_samples=3)) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "ok" and result["primary_metric"] == "bleu"
    assert any("devset.csv" in n and "not available offline" in n for n in result["report_notes"])
    records = read_jsonl(out / "generations_epoch1.jsonl")
    assert len(records) == 3 and result["eval_examples"] == 3
    refs = {}
    for row in csv.DictReader(io.StringIO((DATA_DIR / "e2e" / "testset_w_refs.csv").read_text(encoding="utf-8-sig"))):
        refs.setdefault(row["mr"], []).append(row["ref"])
    assert all(r["references"] == refs[r["mr"]] for r in records)  # every reference of each MR
    assert result["eval_references"] == sum(len(r["references"]) for r in records)
    # The metrics are `peftlab nlg-score`'s on the logged generations written in the official script's formats
    # (one output per line; references one per line, a blank line between MRs), and each names its package.
    (tmp_path / "hyps.txt").write_text("".join(nlg_metrics.one_line(r["generated"]) + "\n" for r in records))
    (tmp_path / "refs.txt").write_text("\n\n".join("\n".join(r["references"]) for r in records) + "\n")
    again = score_files(tmp_path / "refs.txt", tmp_path / "hyps.txt").scores
    assert result["final"]["metrics"] == pytest.approx(again.metrics)
    assert set(again.metrics) <= set(result["metric_implementations"])
    assert result["metrics_reproduce"] == nlg_metrics.OFFICIAL
    # A metric one evaluation cannot give (NIST on a tiny model's short outputs, where the script divides by
    # zero) is explained in that evaluation's metric_notes.
    explained = {name for notes in result.get("metric_notes", {}).values() for name in notes}
    assert set(nlg_metrics.METRICS) <= set(result["final"]["metrics"]) | explained
    if shutil.which("java"):  # METEOR 1.5 and the PTB tokenizer, as the official script
        assert "meteor" in result["final"]["metrics"] and result["java"]
        assert result["metrics_unavailable"] == {} and "PTBTokenizer" in result["metric_implementations"]["cider"]
    else:  # said in result.json and in every report, never silently
        assert "meteor" not in result["final"]["metrics"] and result["java"] is None
        assert "needs Java" in result["metrics_unavailable"]["meteor"]
        assert any("Java unavailable" in n for n in result["report_notes"])
    # `peftlab evaluate` re-scores the saved adapter into its own generations file.
    from peftlab.training.evaluation import evaluate_run

    assert evaluate_run(out) == pytest.approx(result["final"]["metrics"])
    assert read_jsonl(out / "generations_evaluate.jsonl") == records
    # Without the 'nlg' extra, `peftlab evaluate` says so in one line before the base model is loaded.
    from peftlab import extras
    from peftlab.models import registry

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing extra was found")

    monkeypatch.setattr(extras, "installed", lambda module: module not in extras.EXTRAS["nlg"])
    monkeypatch.setattr(registry, "load_model_with_pooling", no_model)
    capsys.readouterr()
    assert main(["evaluate", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--task e2e (its BLEU, NIST, METEOR, ROUGE-L, CIDEr) needs the 'nlg' extra" in line


# --------------------------------------------------------------------------- sweep + report


@pytest.mark.slow
@needs_commonsense
@needs_math
@needs_e2e
def test_sweep_and_report_of_the_three_families(tmp_path, capsys):
    root = tmp_path / "runs"
    spec = tmp_path / "families.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(root), "base": {**TINY, "max_eval_samples": 1,
                                                                      "max_new_tokens": 4},
                                    "grid": {"task": ["commonsense", "math", "e2e"]}}))
    assert main(["sweep", str(spec)]) == 0
    results = {r["task"]: r for r in (json.loads(p.read_text()) for p in root.rglob("result.json"))}
    assert set(results) == {"commonsense", "math", "e2e"} and {r["status"] for r in results.values()} == {"ok"}
    assert len(results["commonsense"]["eval_sets"]) == 7 and len(results["math"]["eval_sets"]) == 7
    assert {"boolq_accuracy", "openbookqa_accuracy", "accuracy"} <= set(results["commonsense"]["final"]["metrics"])
    assert {"mawps_strict_match", "svamp_flexible_extract"} <= set(results["math"]["final"]["metrics"])

    out = tmp_path / "report.csv"
    assert main(["report", str(root / "results.sqlite"), "--format", "csv", "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    header = rows[0].keys()
    for task in ("commonsense", "math", "e2e"):
        assert f"{task}_mean" in header and f"{task}_n" in header
    trained = [r for r in rows if r.get("commonsense_n") == "1"]
    assert trained and all(r["math_n"] == r["e2e_n"] == "1" for r in trained)
    capsys.readouterr()
    assert main(["report", str(root / "results.sqlite")]) == 0
    text = capsys.readouterr().out
    assert "COMMONSENSE" in text and "MATH" in text and "E2E" in text
    assert "HellaSwag" in text and "MetaMathQA" in text and "devset.csv" in text  # the offline caveats
    # A per-set column on request: the report's --metric.
    assert main(["report", str(root / "results.sqlite"), "--metric", "boolq_accuracy", "--format", "csv",
                 "--out", str(out)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert any(r.get("commonsense_n") == "1" for r in rows)


def test_e2e_and_judged_mt_bench_need_their_extra_before_any_generation(monkeypatch):
    """`peftlab evaluate` has no preflight: the builders check the extra first (no tokenizer is even looked at)."""
    from types import SimpleNamespace

    from peftlab import extras
    from peftlab.tasks import mt_bench
    from peftlab.tasks.table import task

    monkeypatch.setattr(extras, "installed", lambda module: False)
    cfg = SimpleNamespace(model="tiny-llama", judge_url="http://127.0.0.1:9/v1", judge_api_key_env="HOME")
    with pytest.raises(PeftlabError, match=r"--task e2e .* needs the 'nlg' extra"):
        e2e.build_pipeline(cfg, None, None, task("e2e"))
    with pytest.raises(PeftlabError, match=r"MT-Bench judging \(--judge-url\) needs the 'judge' extra"):
        mt_bench.build_pipeline(cfg, None, None, task("mt-bench"))
