"""The task table: every task peftlab can train, registered once as a :class:`Task`.

A task's row says everything the code needs to know about it: kind and head, labels, metrics (and so its chance
level), files, the pipeline that builds its data and scores it (a key of :data:`peftlab.tasks.prepare.BUILDERS`)
and its defaults. Code takes the ``Task`` (resolved once from the name, :func:`task`), never branches on a task's
name. ``config.TaskName`` is read off this table, which is why it is torch-free and imports nothing of peftlab at
module level.
"""

from __future__ import annotations

from dataclasses import dataclass

SELECTION_PREFIX = "selection_"  # the selection split's metrics in an evaluation's flat dict


@dataclass(frozen=True)
class TsvLayout:
    """Where a GLUE task's fields are in its TSV rows (column indices; negative counts from the end)."""

    text_a: int
    text_b: int | None
    label: int
    header: bool = True
    columns: int | None = None  # expected column count; None = the header's


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "classification", "regression", "instruction", or a generation family: commonsense, math, e2e
    primary_metric: str  # the papers' table column
    label_names: tuple[str, ...] = ()  # index = class id; raw labels in files are mapped by name
    text_fields: tuple[str, ...] = ()  # Hub (nyu-mll/glue) column names of the one or two input texts
    glue_dir: str = ""  # folder name in the GLUE glue_data layout
    eval_splits: tuple[str, ...] = ("validation",)  # MNLI has matched and mismatched
    eval_before: bool = False  # evaluate the untrained model too (GSM8K: accuracy before and after)
    # Defaults for --max-length / --batch-size when not given (None: TrainConfig's). GSM8K question + worked
    # answer is ~175 tokens (p99 ~350) with the chat template, so 128 would cut most answers before "#### N";
    # 32 x 512 tokens of a 49k-vocabulary decoder would need ~30 GB of activations and logits on CPU.
    default_max_length: int | None = None
    default_batch_size: int | None = None
    # Default --eval-every (None: 1). GSM8K's evaluation generates an answer per problem, about as costly as
    # an epoch of training on 500 examples, so by default it runs only before and after fine-tuning (0).
    default_eval_every: int | None = None
    # Generation-scored task families (commonsense, math): the named test sets --eval-sets picks from (all by
    # default) and the training splits --train-sets picks from; default --max-new-tokens (None: TrainConfig's).
    eval_set_names: tuple[str, ...] = ()
    train_set_names: tuple[str, ...] = ()
    default_max_new_tokens: int | None = None
    # How its data is read and scored: a key of peftlab.tasks.prepare.BUILDERS.
    pipeline: str = "glue"
    # The metrics its evaluation reports (GLUE; two: also their mean, "combined"); () = the primary metric alone.
    metrics: tuple[str, ...] = ()
    tsv: TsvLayout | None = None  # GLUE: the columns of its glue_data TSV files
    subsets: bool = False  # GLUE: 10k subsets in <data>/glue_subsets/<Task>/ (the full set is not offline)
    user_data: bool = False  # the user brings data, labels and metric (--train-file / --dataset, --metric)
    # Instruction tasks: where (train, eval) come from: "test_split" (its own test split), "held_out" (10 % of its
    # training split), "files" (--train-file / --eval-file).
    instruction_source: str = ""
    record_format: str = "instruction"  # instruction tasks' records; "gsm8k": question/answer, answers end "#### N"

    @property
    def num_labels(self) -> int:
        return 1 if self.kind == "regression" else len(self.label_names)

    @property
    def reported_metrics(self) -> tuple[str, ...]:
        return self.metrics or (self.primary_metric,)

    @property
    def head(self) -> str:
        return {"classification": "classification", "regression": "regression"}.get(self.kind, "causal-lm")


_BIN = ("0", "1")
# LLM-Adapters' test sets as laid out in <data>/commonsense/<set>/ and <data>/math/<set>/ (HellaSwag and the
# commonsense_170k training mix are not available offline; only these four sets have a train.json).
COMMONSENSE_TEST_SETS = ("boolq", "piqa", "social_i_qa", "winogrande", "ARC-Easy", "ARC-Challenge", "openbookqa")
COMMONSENSE_TRAIN_SETS = ("boolq", "ARC-Easy", "ARC-Challenge", "openbookqa")
MATH_TEST_SETS = ("gsm8k", "AQuA", "AddSub", "MultiArith", "SVAMP", "SingleEq", "mawps")

TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        # GLUE. TSV columns: CoLA source, label, original label, sentence (no header); SST-2 sentence, label;
        # MRPC Quality, #1 ID, #2 ID, #1 String, #2 String; QQP id, qid1, qid2, question1, question2, is_duplicate;
        # STS-B index, genre, filename, year, old_index, source1, source2, s1, s2, score; MNLI ..., sentence1,
        # sentence2, label1[..label5], gold_label; QNLI/RTE/WNLI index, text, text, label.
        Task("cola", "classification", "matthews_correlation", _BIN, ("sentence",), "CoLA",
             tsv=TsvLayout(3, None, 1, header=False, columns=4)),
        Task("sst2", "classification", "accuracy", _BIN, ("sentence",), "SST-2", tsv=TsvLayout(0, None, 1)),
        Task("mrpc", "classification", "accuracy", _BIN, ("sentence1", "sentence2"), "MRPC",
             metrics=("accuracy", "f1"), tsv=TsvLayout(3, 4, 0)),
        Task("qqp", "classification", "accuracy", _BIN, ("question1", "question2"), "QQP",
             metrics=("accuracy", "f1"), tsv=TsvLayout(3, 4, 5), subsets=True),
        Task("stsb", "regression", "pearson", (), ("sentence1", "sentence2"), "STS-B",
             metrics=("pearson", "spearman"), tsv=TsvLayout(7, 8, -1)),
        Task("mnli", "classification", "accuracy", ("entailment", "neutral", "contradiction"),
             ("premise", "hypothesis"), "MNLI", ("validation_matched", "validation_mismatched"),
             tsv=TsvLayout(8, 9, -1), subsets=True),
        Task("qnli", "classification", "accuracy", ("entailment", "not_entailment"), ("question", "sentence"), "QNLI",
             tsv=TsvLayout(1, 2, 3), subsets=True),
        Task("rte", "classification", "accuracy", ("entailment", "not_entailment"), ("sentence1", "sentence2"), "RTE",
             tsv=TsvLayout(1, 2, 3)),
        Task("wnli", "classification", "accuracy", _BIN, ("sentence1", "sentence2"), "WNLI", tsv=TsvLayout(1, 2, 3)),
        Task("gsm8k", "instruction", "accuracy", eval_splits=("test",), eval_before=True,
             default_max_length=512, default_batch_size=8, default_eval_every=0, pipeline="instruction",
             instruction_source="test_split", record_format="gsm8k"),
        Task("alpaca", "instruction", "eval_loss", default_max_length=512, default_batch_size=8,
             pipeline="instruction", instruction_source="held_out"),
        Task("json", "instruction", "eval_loss", default_max_length=512, default_batch_size=8,
             pipeline="instruction", instruction_source="files"),
        # MT-Bench: instruction tuning (alpaca or --train-file), then 80 two-turn questions graded 1-10 by an LLM
        # judge (peftlab.tasks.mt_bench); 160 generations (+ judge calls) per evaluation: only after the last epoch.
        Task("mt-bench", "instruction", "mt_bench_score", default_max_length=512, default_batch_size=8,
             default_eval_every=0, pipeline="mt_bench"),
        # Generation-scored families (peftlab.tasks.commonsense / math_tasks / e2e): the answer or text is generated
        # and scored, before and after fine-tuning only (generation over 7 test sets costs more than an epoch).
        # LLM-Adapters generates 32 new tokens for commonsense answers ("the correct answer is answer2").
        Task("commonsense", "commonsense", "accuracy", eval_before=True, default_max_length=256, default_batch_size=8,
             default_eval_every=0, eval_set_names=COMMONSENSE_TEST_SETS, train_set_names=COMMONSENSE_TRAIN_SETS,
             default_max_new_tokens=32, pipeline="commonsense"),
        Task("math", "math", "strict_match", eval_before=True, default_max_length=512, default_batch_size=8,
             default_eval_every=0, eval_set_names=MATH_TEST_SETS, default_max_new_tokens=256,
             pipeline="math"),
        # E2E test references: 30 tokens on average, p99 51, longest 92 (SmolLM2's tokenizer).
        Task("e2e", "e2e", "bleu", eval_before=True, default_max_length=256, default_batch_size=8, default_eval_every=0,
             default_max_new_tokens=64, pipeline="e2e"),
        # The user's own labelled data (peftlab.tasks.labelled_data): --train-file / --eval-file or --dataset,
        # --text-fields, --label-field, --metric. The label names, text fields and metric come from the data and
        # the flags (labelled_data.head_labels), not from this row; primary_metric is the default --metric.
        Task("classify", "classification", "accuracy", pipeline="labelled", user_data=True),
        Task("regress", "regression", "pearson", pipeline="labelled", user_data=True),
    ]
}
TASK_NAMES = tuple(TASKS)  # config.TaskName: the --task choices, in this order


def task(name: str) -> Task:
    """The registered task called ``name`` (one line naming the choices if there is none): a run's entry resolves
    its task so, once, and passes the :class:`Task` along."""
    found = find_task(name)
    if found is None:
        from peftlab.errors import unknown

        raise unknown("task", name, TASKS)
    return found


def find_task(name: str) -> Task | None:
    """The registered task called ``name``, or None: readers of run records meet names that are no task (a user
    task's column is named after its data, ``tickets``)."""
    return TASKS.get(name)


def task_title(name: str) -> str:
    """A task's title in tables and figures: GLUE's own spelling (CoLA, SST-2), else the name upper-cased; a
    name that is no task (a user task's data) as it is."""
    found = find_task(name)
    return name if found is None else found.glue_dir or name.upper()


# Tasks whose data, labels and metric the user brings (--train-file or --dataset).
USER_TASKS = tuple(name for name, t in TASKS.items() if t.user_data)
# --metric choices of the user tasks (the first is the default), as result.json and reports name them.
USER_METRICS = {"classify": ("accuracy", "f1", "f1_macro", "matthews_correlation"), "regress": ("pearson", "spearman")}
METRIC_ALIASES = {"matthews": "matthews_correlation", "mcc": "matthews_correlation", "macro_f1": "f1_macro"}


def primary_metric(name: str, metric: str | None = None) -> str:
    """The metric a run of the task ``name`` is judged by: ``metric`` (a user task's --metric) when given, else the
    table's."""
    return metric if metric and name in USER_TASKS else task(name).primary_metric


def task_label(config: dict) -> str:
    """The name reports and plots give a run's task (its column): the task itself, or for a user task the
    training file's stem (``tickets`` for tickets.csv), the save_to_disk folder's name or the Hub dataset's
    (``ag_news``, ``glue:sst2``). A name that is also a table task's keeps its file suffix (``sst2.csv``) so
    that a user's file is never reported as that task."""
    from pathlib import PurePath

    task = str(config.get("task"))
    if task not in USER_TASKS:
        return task
    if config.get("train_file"):
        path = PurePath(str(config["train_file"]))
        return path.name if path.stem.lower() in TASKS else path.stem
    source = str(config.get("dataset") or task).rstrip("/\\")
    name, _, subset = source.partition(":") if not PurePath(source).is_absolute() else (source, "", "")
    label = PurePath(name).name + (f":{subset}" if subset else "")
    return source if label.lower() in TASKS else label

GLUE_TASKS = tuple(name for name, t in TASKS.items() if t.glue_dir)

# Sets the papers use that cannot be had offline: asking for one says so instead of "unknown".
UNAVAILABLE_SETS = {"hellaswag": "HellaSwag's test set is not available offline (LLM-Adapters' copy is not in the "
                                 "shared data)"}


def pick_names(value, groups: dict[str, tuple[str, ...]], option: str, *, noun: str, what: str,
               aliases: dict[str, str] | None = None, unavailable: dict[str, str] | None = None) -> list[str]:
    """Comma-separated names or ``aliases`` (any case) -> the names they stand for (``groups``: name -> names), in
    order, duplicates dropped. One line for a name in ``unavailable`` (-> why), an unknown name or none."""
    from peftlab.errors import PeftlabError, unknown

    lookup = {name.lower(): names for name, names in groups.items()}
    lookup.update({alias.lower(): groups[name] for alias, name in (aliases or {}).items()})
    known = ", ".join(sorted({name for names in groups.values() for name in names}))
    chosen: list[str] = []
    for piece in (p.strip() for p in str(value or "").split(",")):
        if piece.lower() in (unavailable or {}):
            raise PeftlabError(f"{option} {piece}: {unavailable[piece.lower()]}", fix=f"use some of: {known}")
        if piece and piece.lower() not in lookup:
            raise unknown(what, piece, groups, where=option)
        chosen += [n for n in lookup.get(piece.lower(), ()) if n not in chosen]
    if not chosen:
        raise PeftlabError(f"{option} names no {noun}", fix=f"use some of: {known}")
    return chosen


def canonical_sets(value: str | None, task: Task, flag: str) -> str | None:
    """``--eval-sets``/``--train-sets`` -> the canonical set names, comma-joined in the order given; None stays None
    (every set). A task that has no named sets is refused (the option would be ignored)."""
    if value is None:
        return None
    from peftlab.errors import PeftlabError

    names = task.eval_set_names if flag == "eval_sets" else task.train_set_names
    option = "--" + flag.replace("_", "-")
    if not names:
        having = [n for n, t in TASKS.items() if (t.eval_set_names if flag == "eval_sets" else t.train_set_names)]
        raise PeftlabError(f"{option} is set, but task '{task.name}' has no named sets (it would be ignored)",
                           fix=f"remove {option}, or use a task that has them: {', '.join(having)}")
    return ",".join(pick_names(value, {n: (n,) for n in names}, option, noun="set", what=f"{task.name} set",
                               unavailable=UNAVAILABLE_SETS))

# Metrics where smaller is better (held-out loss of instruction tuning): best-epoch choice and report Avg.
LOWER_IS_BETTER = frozenset({"eval_loss", "perplexity"})
