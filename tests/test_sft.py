"""Instruction tuning (peftlab.tasks.instructions) and answer extraction (peftlab.tasks.math_answers): response-only loss, truncation,
collation, instruction files and their errors, GSM8K/Alpaca tiny runs through the real training loop."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.decode import greedy_loop
from peftlab.tasks import generation
from peftlab.tasks import instruction_data as idata
from peftlab.tasks import instructions as sft
from peftlab.tasks.math_answers import answers_match, extract_answer, normalize_number
from peftlab.tasks.prepare import build_pipeline
from peftlab.tasks.table import task
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.training.loop import train

from conftest import DATA_DIR as DATA, needs_data as _needs_data  # noqa: E402
needs_data = _needs_data("gsm8k", "test.jsonl")


@pytest.fixture(scope="module")
def tokenizer():
    from peftlab.models.registry import load_tokenizer

    return load_tokenizer("tiny-llama")  # SmolLM2's tokenizer: chat template, pad = eos = <|im_end|>


@pytest.fixture(scope="module")
def tiny_llama():
    from peftlab.models.registry import load_model

    model, _ = load_model("tiny-llama", head="causal-lm")
    return model.eval()


# --------------------------------------------------------------------------- answer extraction

EXTRACTION = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("so the total is 1,234,567 dollars", "1234567"),
    ("The answer is $5.", "5"),
    ("She pays $1,250.50 in total.", "1250.5"),
    ("It costs 5 dollars.", "5"),
    ("The discount is 25%.", "25"),
    ("He has 5.0 apples left", "5"),
    ("x = 3.50.", "3.5"),
    ("The temperature dropped to -7 degrees.", "-7"),
    ("The answer is \u221212", "-12"),  # Unicode minus
    ("10-3=7", "7"),  # a hyphen between numbers is subtraction, not a sign
    ("It is 5 - 3 = 2", "2"),
    ("#### -4", "-4"),
    ("The answer is 18. Then she also bought 3 more things.", "18"),  # the phrase wins over the last number
    ("First 2 then 3 so #### 5 and later 6", "5"),  # #### wins over everything after it
    ("We get \\boxed{42} after checking 3 cases.", "42"),
    ("Answer: 0.5", "0.5"),
    ("half of it is .5", "0.5"),
    ("1, 2, 3", "3"),  # not a thousands group: separate numbers
    ("She walked 12km and then 8km, 20km in all.", "20"),
    ("There are no numbers here.", None),
    ("", None),
    ("The final answer is: **1,000**.", "1000"),
    ("007 agents", "7"),
    ("#### 18\n<|im_end|>", "18"),
]


@pytest.mark.parametrize("text,expected", EXTRACTION)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("a,b,same", [("5.0", "5", True), ("1,234", "1234", True), ("$7", "7", True),
                                      ("-3", "3", False), ("0.50", ".5", True), (None, "5", False),
                                      ("5", None, False), ("abc", "abc", False)])
def test_answers_match(a, b, same):
    assert answers_match(a, b) is same


def test_normalize_number():
    assert normalize_number("1,234.500") == "1234.5"
    assert normalize_number("-0.0") == "0"
    assert normalize_number("12.") == "12"
    assert normalize_number("nan") is None and normalize_number("inf") is None


# --------------------------------------------------------------------------- masking and truncation


def test_labels_mask_exactly_the_prompt(tokenizer):
    example = sft.encode_example(tokenizer, "What is 2+2?", "", "2+2=4\n#### 4", max_length=256)
    # The prompt length computed independently, by the chat template's own generation prompt.
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                           add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    n = len(prompt)
    ids, labels = example["input_ids"], example["labels"]
    assert ids[:n] == list(prompt) and example["prompt_length"] == n
    assert labels[:n] == [-100] * n
    assert labels[n:] == ids[n:] and all(label != -100 for label in labels[n:])
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # the model learns to stop
    assert tokenizer.decode(ids[n:], skip_special_tokens=True).strip() == "2+2=4\n#### 4"


def test_input_field_joins_the_user_message(tokenizer):
    with_input = sft.prompt_text(tokenizer, "Summarise.", "The cat sat on the mat.")
    assert "Summarise.\n\nThe cat sat on the mat." in with_input
    assert sft.prompt_text(tokenizer, "Summarise.", "   ") == sft.prompt_text(tokenizer, "Summarise.", "")


def test_plain_format_without_chat_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    assert sft.prompt_text(plain, "Add.", "2 and 3") == "### Instruction:\nAdd.\n\n### Input:\n2 and 3\n\n### Response:\n"
    example = sft.encode_example(plain, "Add.", "2 and 3", "5", max_length=128)
    n = example["prompt_length"]
    assert example["labels"][:n] == [-100] * n
    assert example["input_ids"][-1] == plain.eos_token_id and example["labels"][-1] == plain.eos_token_id


def test_truncation_cuts_the_prompt_first(tokenizer):
    long_prompt = "Tell me. " * 80
    full = sft.encode_example(tokenizer, long_prompt, "", "Short answer.", max_length=10_000)
    response_tokens = len(full["input_ids"]) - full["prompt_length"]
    cut = sft.encode_example(tokenizer, long_prompt, "", "Short answer.", max_length=64)
    assert len(cut["input_ids"]) == 64 and cut["truncated"]
    assert cut["input_ids"][-response_tokens:] == full["input_ids"][-response_tokens:]  # whole response kept
    assert cut["input_ids"][:cut["prompt_length"]] == full["input_ids"][full["prompt_length"] - cut["prompt_length"]:
                                                                         full["prompt_length"]]  # prompt's end kept
    # A response longer than the limit: the prompt keeps half, the response is cut from the right.
    long_answer = sft.encode_example(tokenizer, "Q?", "", "word " * 200, max_length=40)
    assert len(long_answer["input_ids"]) == 40 and long_answer["labels"][-1] != -100
    assert long_answer["prompt_length"] == min(20, len(sft.encode_prompt(tokenizer, "Q?")))
    assert sft.encode_example(tokenizer, "Q?", "", "", max_length=1) is None  # no response token left


def test_prompt_logits_cannot_change_the_loss(tokenizer, tiny_llama):
    collate = sft.SFTCollator(tokenizer)
    features = [sft.encode_example(tokenizer, "Name a colour.", "", "Blue.", 128),
                sft.encode_example(tokenizer, "Count to three, please.", "", "1, 2, 3", 128)]
    batch = collate(features)
    assert batch["labels"][1, -1].item() == -100 or batch["labels"][0, -1].item() == -100  # padding is -100
    with torch.no_grad():
        out = tiny_llama(**batch)
    logits, labels = out.logits, batch["labels"]
    # The loss by hand: next-token cross-entropy over the positions whose next label is a response token.
    positions = [(b, t) for b in range(labels.shape[0]) for t in range(labels.shape[1] - 1) if labels[b, t + 1] != -100]
    by_hand = torch.stack([torch.nn.functional.cross_entropy(logits[b, t], labels[b, t + 1]) for b, t in positions]).mean()
    torch.testing.assert_close(out.loss, by_hand)
    assert len(positions) == sum(len(f["input_ids"]) - f["prompt_length"] for f in features)
    # Scrambling the logits at every position that predicts a prompt (or padding) token changes nothing.
    scrambled = logits.clone()
    predicts_prompt = torch.ones_like(labels, dtype=torch.bool)
    for b, t in positions:
        predicts_prompt[b, t] = False
    scrambled[predicts_prompt] = torch.randn_like(scrambled[predicts_prompt]) * 100
    loss_fn = tiny_llama.loss_function
    vocab = tiny_llama.config.vocab_size
    torch.testing.assert_close(loss_fn(scrambled, labels, vocab), out.loss)
    sums, counts = sft.response_loss_sums(scrambled, labels)
    torch.testing.assert_close(sums.sum() / counts.sum(), out.loss)
    # ... while one response-predicting position does change it.
    b, t = positions[0]
    scrambled[b, t] = torch.randn_like(scrambled[b, t]) * 100
    assert not torch.allclose(loss_fn(scrambled, labels, vocab), out.loss)


def test_collator_pads_right(tokenizer):
    collate = sft.SFTCollator(tokenizer)
    batch = collate([{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7], "extra": 1},
                     {"input_ids": [8], "attention_mask": [1], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, tokenizer.pad_token_id, tokenizer.pad_token_id]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert sft.SFTCollator(tokenizer, pad_to=5)([{"input_ids": [1], "attention_mask": [1], "labels": [1]}])["input_ids"].shape == (1, 5)
    fixed = sft.SFTCollator(tokenizer, pad_to=5)([{"input_ids": [1], "attention_mask": [1], "labels": [1]}])
    assert fixed["labels"].tolist() == [[1, -100, -100, -100, -100]] and fixed["attention_mask"].tolist() == [[1, 0, 0, 0, 0]]
    # Training pads on the right even for a tokenizer that pads on the left, and leaves that tokenizer as it was.
    left = copy.copy(tokenizer)
    left.padding_side = "left"
    again = sft.SFTCollator(left)([{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
                                   {"input_ids": [8], "attention_mask": [1], "labels": [8]}])
    assert {k: v.tolist() for k, v in again.items()} == {k: v.tolist() for k, v in batch.items()}
    assert left.padding_side == "left"


@pytest.fixture(scope="module")
def chatty_model(chatty_llama):
    """The model of conftest's chatty_llama (these tests bring their own tokenizer fixture)."""
    return chatty_llama[0]


def test_generation_equals_hf_generate_while_rows_leave_the_batch(tokenizer, chatty_model, monkeypatch):
    from transformers import GenerationConfig

    questions = ["Hi", "What is 2+2? Think.", "A much longer question about cats and dogs, is it not?", "Why?"]
    prompts = [sft.encode_prompt(tokenizer, q) for q in questions]

    def reference(prompt, stops):
        """HF greedy generation of one unpadded prompt; the text excludes the stop token, as peftlab's does."""
        ids = torch.tensor([prompt])
        config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=list(stops), pad_token_id=2)
        out = chatty_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = out[0, len(prompt):].tolist()
        tokens = tokens[:next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]
        return tokenizer.decode(tokens, skip_special_tokens=True).strip(), tokens

    plain = [reference(p, [2]) for p in prompts]
    assert len({text for text, _ in plain}) == len(prompts)  # the model says different things
    assert greedy_loop(chatty_model, tokenizer, prompts, max_new_tokens=12, batch_size=4) == [t for t, _ in plain]
    # Make a token that the second prompt emits at step 4 a stop token: that row leaves the batch early and
    # the rows left in the (pruned) KV cache must still decode exactly as alone.
    stop = plain[1][1][4]
    from peftlab.tasks import generation

    monkeypatch.setattr(generation, "stop_token_ids", lambda tok: [2, stop])  # the stop tokens both paths look up
    expected = [reference(p, [2, stop])[0] for p in prompts]
    assert expected[1] == tokenizer.decode(plain[1][1][:4], skip_special_tokens=True).strip()
    assert greedy_loop(chatty_model, tokenizer, prompts, max_new_tokens=12, batch_size=4) == expected
    assert greedy_loop(chatty_model, tokenizer, prompts, max_new_tokens=12, batch_size=3) == expected


def test_gsm8k_evaluation_generates_what_the_old_greedy_loop_did(tokenizer, chatty_model, tmp_path, monkeypatch):
    """GSM8K's evaluation runs model.generate (generate_greedy); its generations are the hand-written loop's
    (benchmarks/decode.py's greedy_loop, the path it ran before), also when rows stop at different steps."""
    from types import SimpleNamespace

    import datasets

    from peftlab.tasks import generation
    from peftlab.tasks.math_answers import answer_is_final

    questions = ["Natalia sold clips to 48 of her friends. How many clips did she sell?", "What is 2+2?",
                 "Tom has 3 apples and eats one. How many are left?", "Why?", "A train goes 60 miles an hour. How far "
                 "does it go in 3 hours?"]
    eval_raw = datasets.Dataset.from_dict({"instruction": questions, "gold": ["48", "4", "2", "1", "180"]})
    cfg = build_run_config(overrides=dict(task="gsm8k", model="tiny-llama", output_dir=str(tmp_path),
                                                   max_new_tokens=14, eval_batch_size=3))
    accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"), is_main_process=True,
                                  unwrap_model=lambda model: model)
    prompts = [sft.encode_prompt(tokenizer, q) for q in questions]

    def both_paths():
        evaluation = sft.gsm8k_evaluator(cfg, tokenizer, eval_raw)(chatty_model, accelerator, "before")
        assert evaluation.extras["generations_file"] == "generations_before.jsonl"
        new = [r["generated"] for r in generation.read_generations(tmp_path / "generations_before.jsonl")]
        old = greedy_loop(chatty_model, tokenizer, prompts, max_new_tokens=14, batch_size=3, stop_when=answer_is_final)
        return new, old

    new, old = both_paths()
    assert new == old and len(set(new)) == len(questions) and all(new)
    # A token that the fourth prompt emits at step 3 becomes a stop token: that row ends early (model.generate pads
    # it, the loop drops it from the batch), the others run on; the texts still agree.
    stop = tokenizer(old[3], add_special_tokens=False)["input_ids"][3]
    stops = generation.stop_token_ids(tokenizer)
    monkeypatch.setattr(generation, "stop_token_ids", lambda tok: stops + [stop])
    cut_new, cut_old = both_paths()
    assert cut_new == cut_old and len(cut_new[3]) < len(new[3])


@pytest.mark.parametrize("text,final", [("so #### 18\n", True), ("so #### 18", False), ("#### 1,2", False),
                                        ("no answer yet\n", False), ("#### the answer\n", False),
                                        ("#### x5\nthen 6", False), ("#### -4.5 dollars\nmore", True)])
def test_answer_is_final(text, final):
    from peftlab.tasks.math_answers import answer_is_final

    assert answer_is_final(text) is final
    if final:  # nothing appended can change the extracted answer
        assert extract_answer(text + "7 #### 9\n") == extract_answer(text)


# --------------------------------------------------------------------------- instruction files


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_read_records_json_and_jsonl(tmp_path):
    listing = write(tmp_path / "a.json", json.dumps([{"instruction": "a", "output": "b"},
                                                     {"instruction": "c", "input": "d", "output": "e"}]))
    assert idata.read_records(listing) == [{"instruction": "a", "input": "", "output": "b"},
                                         {"instruction": "c", "input": "d", "output": "e"}]
    lines = write(tmp_path / "b.jsonl", '{"q": "1+1?", "a": "2"}\n\n{"q": "2+2?", "a": "4"}\n')
    assert [r["output"] for r in idata.read_records(lines, idata.parse_fields("q,a"))] == ["2", "4"]
    assert idata.parse_fields("q,,a") == idata.Fields("q", None, "a")


def test_instruction_files_keep_their_text_as_written(tmp_path):
    # pyarrow would read a lone ISO date as a timestamp: the text comes back as written.
    dated = write(tmp_path / "c.jsonl", '{"q": "When?", "a": "1969-07-20"}\n')
    assert idata.read_records(dated, idata.parse_fields("q,a"))[0]["output"] == "1969-07-20"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # nothing written next to the data


def test_instruction_token_cache_reused_and_follows_the_file(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / "train.jsonl", '{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    fields = idata.parse_fields("q,a")

    def tokenised():
        ds = idata.make_dataset(idata.read_records(path, fields))
        return sft.tokenize_instructions(ds, tokenizer, 64, task="json", cache_key="k")

    first, again = tokenised(), tokenised()
    assert again.cache_files == first.cache_files != []  # the second read of the same file hits the cache
    path.write_text('{"q": "1+1?", "a": "two"}\n{"q": "2+2?", "a": "4"}\n')
    edited = tokenised()
    assert edited.cache_files != first.cache_files and edited["input_ids"] != first["input_ids"]


@pytest.mark.parametrize("name,text,fields,where,what", [
    ("bad.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n', "instruction,input,output",
     "bad.jsonl:2", "invalid JSON"),
    ("bad.json", '[{"instruction": "a", "output": "b"},\n {"instruction": }]', "instruction,input,output",
     "bad.json:2", "invalid JSON"),
    ("missing.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a", "answer": "b"}\n',
     "instruction,input,output", "missing.jsonl:2", "no 'output' field"),
    ("type.json", '[{"instruction": "a", "output": "b"}, {"instruction": 3, "output": "b"}]',
     "instruction,input,output", "record 2", "'instruction' is a JSON int"),
    ("input.jsonl", '{"instruction": "a", "input": ["x"], "output": "b"}\n', "instruction,input,output",
     "input.jsonl:1", "'input' is a JSON list"),
    ("notobj.json", '[["a", "b"]]', "instruction,input,output", "record 1", "expected an object"),
    ("empty.jsonl", "\n\n", "instruction,input,output", "empty.jsonl", "no records"),
    ("emptyresp.jsonl", '{"instruction": "a", "output": "  "}\n', "instruction,input,output", "emptyresp.jsonl:1",
     "is empty"),
])
def test_bad_instruction_files(tmp_path, name, text, fields, where, what):
    path = write(tmp_path / name, text)
    with pytest.raises(PeftlabError) as err:
        idata.read_records(path, idata.parse_fields(fields))
    assert where in str(err.value) and what in str(err.value)


def test_an_empty_instruction_is_a_record_a_missing_one_is_not(tmp_path):
    """Alpaca-style data has records whose instruction is blank (the input says it all): they train; only the
    response must hold text, and a record without the prompt field at all is refused."""
    path = write(tmp_path / "d.jsonl", '{"instruction": "", "input": "2+2?", "output": "4"}\n')
    assert idata.read_records(path) == [{"instruction": "", "input": "2+2?", "output": "4"}]
    with pytest.raises(PeftlabError, match="no 'instruction' field"):
        idata.read_records(write(tmp_path / "e.jsonl", '{"input": "2+2?", "output": "4"}\n'))


def test_bad_fields_flag_and_missing_train_file(tmp_path):
    with pytest.raises(PeftlabError, match="instruction-fields"):
        idata.parse_fields("only_one")
    cfg = build_run_config(overrides=dict(task="json", model="tiny-llama", output_dir=str(tmp_path / "r")))
    with pytest.raises(PeftlabError, match="--train-file"):
        idata.load_instruction_data(cfg, task("json"))


def test_offline_without_data_names_the_paths_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(PeftlabError) as err:
        idata.load_raw(task("gsm8k"), "test", tmp_path)
    message = str(err.value)
    assert str(tmp_path / "gsm8k" / "test.jsonl") in message and "not trying the Hub" in message


def test_json_task_pipeline_with_held_out_split(tmp_path, tokenizer):
    records = [{"q": f"What is {i} plus {i}?", "a": f"{2 * i}"} for i in range(20)]
    path = write(tmp_path / "train.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    cfg = build_run_config(overrides=dict(task="json", model="tiny-llama", train_file=str(path),
                                                   instruction_fields="q,,a", max_length=64,
                                                   output_dir=str(tmp_path / "r")))
    train_raw, eval_raw = idata.load_instruction_data(cfg, task("json"))
    assert len(train_raw) == 18 and len(eval_raw) == 2  # 10% held out, the same split on every call
    assert list(idata.load_instruction_data(cfg, task("json"))[1]["instruction"]) == list(eval_raw["instruction"])
    assert not set(train_raw["instruction"]) & set(eval_raw["instruction"])
    pipeline = build_pipeline(cfg, tokenizer, None)
    assert pipeline.primary_metric == "eval_loss" and pipeline.num_eval_examples == 2
    assert {"input_ids", "attention_mask", "labels", "length"} <= set(pipeline.train_dataset.column_names)
    again = build_pipeline(cfg, tokenizer, None)  # tokenised once: the second build reads the cache file
    assert again.train_dataset.cache_files == pipeline.train_dataset.cache_files != []


# --------------------------------------------------------------------------- tiny runs through the loop


def tiny_cfg(tmp_path, **overrides) -> TrainConfig:
    values = dict(model="tiny-llama", method="lora", targets="q,v", rank=4, epochs=1, batch_size=8,
                  max_length=64, max_train_samples=16, max_eval_samples=4, max_new_tokens=8, eval_batch_size=4,
                  output_dir=str(tmp_path / "run"), log_every=1)
    values.update(overrides)
    return build_run_config(overrides=values)


@needs_data
def test_gsm8k_tiny_run_writes_readable_generations(tmp_path):
    result = train(tiny_cfg(tmp_path, task="gsm8k", lr_ratio=2))
    assert result["status"] == "ok" and result["primary_metric"] == "accuracy"
    assert result["majority_baseline"] == 0.0
    assert set(result["before"]["metrics"]) >= {"accuracy", "answered"}
    assert "accuracy" in result["final"]["metrics"]
    assert result["generations"] == {"before": "generations_before.jsonl", "epoch1": "generations_epoch1.jsonl"}
    assert result["generations_file"] == "generations_epoch1.jsonl"
    before = generation.read_generations(tmp_path / "run" / "generations_before.jsonl")
    after = generation.read_generations(tmp_path / "run" / "generations_epoch1.jsonl")
    assert len(before) == len(after) == 4
    assert [r["question"] for r in before] == [r["question"] for r in after]  # the same problems
    for record in before + after:
        assert set(record) == {"question", "gold", "generated", "extracted", "correct"}
        assert record["correct"] == answers_match(record["extracted"], record["gold"])
    assert result["before"]["metrics"]["accuracy"] == sum(r["correct"] for r in before) / 4
    test_questions = {json.loads(line)["question"] for line in (DATA / "gsm8k" / "test.jsonl").open()}
    assert {r["question"] for r in before} <= test_questions
    # `peftlab evaluate` re-scores the saved adapter into its own file: same generations, run files untouched.
    from peftlab.training.evaluation import evaluate_run

    before_text = (tmp_path / "run" / "generations_before.jsonl").read_text()
    assert evaluate_run(tmp_path / "run") == result["final"]["metrics"]
    assert generation.read_generations(tmp_path / "run" / "generations_evaluate.jsonl") == after
    assert (tmp_path / "run" / "generations_before.jsonl").read_text() == before_text


@needs_data
def test_alpaca_tiny_run_reports_held_out_loss(tmp_path):
    result = train(tiny_cfg(tmp_path, task="alpaca", epochs=2, eval_before=True))
    assert result["status"] == "ok" and result["primary_metric"] == "eval_loss"
    for entry in [result["before"]] + result["epochs_log"]:
        metrics = entry["metrics"]
        assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    losses = [e["metrics"]["eval_loss"] for e in result["epochs_log"]]
    assert result["best"]["metrics"]["eval_loss"] == min(losses)  # lower is better
    assert result["eval_examples"] == 4
