"""LLM-Adapters' commonsense test records -> the fields lm-evaluation-harness's own task configs read.

The local test sets are the harness's evaluation splits in LLM-Adapters' order, rewritten into one instruction
per item. Each function here is a harness ``process_docs`` (named in the shipped YAMLs by ``!function``) that
recovers the original fields, so the harness's prompts, choices and targets apply unchanged. ARC's labels
become "1".."k" (LLM-Adapters dropped the letters; the harness only uses the index). SIQA's context and
question were joined with one space, as the harness's prompt joins them, so splitting at any single space
renders its prompt exactly. BoolQ is not here: LLM-Adapters dropped its passage, the harness's prompt starts
with it.
"""

from __future__ import annotations

import re

from peftlab.errors import PeftlabError

_CHOOSE = "Please choose the correct answer to the question: "
_PIQA = re.compile(r"Please choose the correct solution to the question: (?P<goal>.*)\n\nSolution1: (?P<sol1>.*)"
                   r"\n\nSolution2: (?P<sol2>.*)\n\nAnswer format: solution1/solution2", re.S)
_WINOGRANDE = re.compile(r"Please choose the correct answer to fill in the blank to complete the given sentence: "
                         r"(?P<sentence>.*)\n\nOption1: (?P<option1>.*) Option2: (?P<option2>.*) "
                         r"Answer format: option1/option2", re.S)
_NUMBERED = re.compile(r"(?:^| )Answer(\d+): ")
_LAST_SENTENCE = re.compile(r"(?<=[.!?\"'])( )(?=[^ ][^.!?]*\?$)")


def _fail(set_name: str, index: int, what: str):
    return PeftlabError(f"{set_name} test record {index + 1}: {what}",
                        where=f"commonsense/{set_name}/test.json",
                        fix="use LLM-Adapters' published test files unchanged")


def parse_numbered(set_name: str, index: int, instruction: str) -> tuple[str, list[str], int]:
    """(question, choices, number of choices) of a "question\\n\\nAnswer1: a Answer2: b\\n\\nAnswer format:
    answer1/answer2" instruction (ARC, OpenBookQA, SIQA)."""
    if not instruction.startswith(_CHOOSE) or instruction.count("\n\nAnswer format: ") != 1:
        raise _fail(set_name, index, "not LLM-Adapters' 'Please choose the correct answer' format")
    body, _, answer_format = instruction[len(_CHOOSE):].rpartition("\n\nAnswer format: ")
    question, sep, listed = body.rpartition("\n\n")
    count = len(answer_format.strip().split("/"))
    pieces = _NUMBERED.split(listed)
    numbers, texts = pieces[1::2], pieces[2::2]
    if not sep or pieces[0] != "" or numbers != [str(i) for i in range(1, count + 1)]:
        raise _fail(set_name, index, f"expected choices Answer1 .. Answer{count} after the question")
    return question, texts, count


def _answer_number(set_name: str, index: int, answer: str, prefix: str, count: int) -> int:
    if not answer.startswith(prefix) or not answer[len(prefix):].isdigit() or not 1 <= int(answer[len(prefix):]) <= count:
        raise _fail(set_name, index, f"gold answer '{answer}' is not {prefix}1 .. {prefix}{count}")
    return int(answer[len(prefix):])


def _map(dataset, convert):
    return dataset.map(convert, with_indices=True, remove_columns=dataset.column_names)


def _choices_record(set_name: str, stem_field: str):
    def convert(record, index):
        question, texts, count = parse_numbered(set_name, index, record["instruction"])
        gold = _answer_number(set_name, index, record["answer"], "answer", count)
        return {stem_field: question, "choices": {"text": texts, "label": [str(i) for i in range(1, count + 1)]},
                "answerKey": str(gold)}
    return convert


def arc_easy(dataset):
    return _map(dataset, _choices_record("ARC-Easy", "question"))


def arc_challenge(dataset):
    return _map(dataset, _choices_record("ARC-Challenge", "question"))


def openbookqa(dataset):
    return _map(dataset, _choices_record("openbookqa", "question_stem"))


def split_context(joined: str) -> tuple[str, str]:
    """SIQA's "context question" -> (context, question), split at one space (the last sentence, a question,
    when there is one): ``context + " " + question == joined`` always."""
    found = list(_LAST_SENTENCE.finditer(joined))
    cut = found[-1].start(1) if found else joined.rfind(" ")
    if cut < 0:
        raise ValueError("no space to split context and question at")
    return joined[:cut], joined[cut + 1:]


def social_iqa(dataset):
    def convert(record, index):
        joined, texts, count = parse_numbered("social_i_qa", index, record["instruction"])
        if count != 3:
            raise _fail("social_i_qa", index, f"expected 3 choices, found {count}")
        try:
            context, question = split_context(joined)
        except ValueError as err:
            raise _fail("social_i_qa", index, str(err)) from None
        gold = _answer_number("social_i_qa", index, record["answer"], "answer", 3)
        return {"context": context, "question": question, "answerA": texts[0], "answerB": texts[1],
                "answerC": texts[2], "label": str(gold)}
    return _map(dataset, convert)


def piqa(dataset):
    def convert(record, index):
        found = _PIQA.fullmatch(record["instruction"])
        if found is None or record["instruction"].count("\n\nSolution") != 2:
            raise _fail("piqa", index, "not LLM-Adapters' 'Solution1: .. Solution2: ..' format")
        gold = _answer_number("piqa", index, record["answer"], "solution", 2)
        return {"goal": found["goal"], "sol1": found["sol1"], "sol2": found["sol2"], "label": gold - 1}
    return _map(dataset, convert)


def winogrande(dataset):
    def convert(record, index):
        found = _WINOGRANDE.fullmatch(record["instruction"])
        if found is None or " Option2: " in found["option1"] or "_" not in found["sentence"]:
            raise _fail("winogrande", index, "not LLM-Adapters' 'sentence with _, Option1: .. Option2: ..' format")
        gold = _answer_number("winogrande", index, record["answer"], "option", 2)
        return {"sentence": found["sentence"], "option1": found["option1"], "option2": found["option2"],
                "answer": str(gold)}
    return _map(dataset, convert)
