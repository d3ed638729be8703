"""E2E NLG corpus metrics, computed as the official E2E NLG Challenge script computes them.

The LoRA and KaSA E2E tables come from :data:`OFFICIAL`; :func:`corpus_scores` gives its five numbers on the same
outputs and references (tests/test_nlg_score.py pins the script's values). Each text is one stripped line, as
the script reads files.

* ``bleu``: the script's mteval-v13a port (lower-cased 13a tokens, n-grams clipped over all references, the
  closest reference length), by sacrebleu (``BLEU(lowercase=True)``); peftlab supplies the port's n-gram totals,
  which sacrebleu counts differently on degenerate outputs (k tokens add k-n+1 n-grams even when negative, an
  empty output is one empty token, an order without a match has 1e-15 matches). A fraction (reports show x100).
* ``nist``: the port's mteval NIST (n = 5), :func:`mteval_nist`: no library computes this variant (nltk's
  ``corpus_nist`` clips against one best reference, sacrebleu has none).
* ``meteor``, ``rouge_l``, ``cider``: coco-caption's scorers as pycocoevalcap packages them unchanged (METEOR
  1.5 jar, ``-l en -norm``; ROUGE-L beta 1.2; CIDEr-D) on the tokens of coco-caption's ``PTBTokenizer`` (Java).

**Without Java** METEOR is left out (no other METEOR stands in for 1.5) and ROUGE-L and CIDEr use nltk's tokens
(:func:`nltk_tokenize`: 98.7 % of the PTB tokens on the E2E references, so ROUGE-L 0.01 % and CIDEr 0.25 % off
there, CIDEr up to 16 % on outputs full of brackets and SGML entities); ``notes`` and ``implementations`` say
so. A metric the formula cannot give (NIST when an order's n-gram total is 0) is left out with its reason.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import Sequence

from peftlab.extras import require

METRICS = ("bleu", "nist", "meteor", "rouge_l", "cider")
SCORED_BY = "--task e2e (its BLEU, NIST, METEOR, ROUGE-L, CIDEr)"  # its row of peftlab.extras.NEEDS
# The script whose numbers these are: repository, commit, command.
OFFICIAL = "tuetschek/e2e-metrics @ 1b9c4d87fd0bbb171ea966741cdc012588581ed4, measure_scores.py -p"
# The script's printed names, in its order (``peftlab nlg-score`` prints them the same way).
OFFICIAL_NAMES = {"bleu": "BLEU", "nist": "NIST", "meteor": "METEOR", "rouge_l": "ROUGE_L", "cider": "CIDEr"}
NIST_BETA = -math.log(0.5) / math.log(1.5) ** 2  # mteval-v13a: the length penalty is 0.5 at 2/3 of the length


@dataclass(frozen=True)
class NlgScores:
    metrics: dict[str, float]  # metric -> value (only the metrics that could be computed)
    implementations: dict[str, str]  # metric -> the package, version and settings that produced it
    unavailable: dict[str, str] = field(default_factory=dict)  # metric -> why it is not in ``metrics``
    notes: tuple[str, ...] = ()  # where the numbers depart from the official script's (no Java), else empty


@dataclass(frozen=True)
class JavaRuntime:
    path: str | None  # the ``java`` found on PATH
    version: str | None  # the first line of ``java -version``
    reason: str | None = None  # why Java cannot run the jars; None when it can

    @property
    def available(self) -> bool:
        return self.reason is None


def java_runtime() -> JavaRuntime:
    """The ``java`` that pycocoevalcap's jars will run (they call ``java`` from PATH), checked by running it."""
    return _probe_java(shutil.which("java"))


@lru_cache(maxsize=8)
def _probe_java(path: str | None) -> JavaRuntime:
    if path is None:
        return JavaRuntime(None, None, "no `java` on PATH")
    try:
        done = subprocess.run([path, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return JavaRuntime(path, None, f"`{path} -version` failed: {err}")
    lines = (done.stderr or done.stdout).strip().splitlines()
    if done.returncode != 0:
        return JavaRuntime(path, None, f"`{path} -version` exited {done.returncode}: {lines[-1] if lines else ''}")
    return JavaRuntime(path, lines[0] if lines else "unknown version")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def meteor_missing(java: JavaRuntime) -> str | None:
    """Why METEOR is not computed with this ``java``, or None when it is."""
    return None if java.available else f"METEOR 1.5 needs Java: {java.reason}"


def no_java_note(java: JavaRuntime) -> str:
    return (f"Java unavailable ({java.reason}): METEOR 1.5 not computed; ROUGE-L and CIDEr on nltk's tokens instead "
            f"of coco-caption's PTB tokenizer, so they approximate the official E2E script's")


def implementations(java: JavaRuntime | None = None) -> dict[str, str]:
    """metric -> how it is computed, for result.json (``meteor`` only where Java runs)."""
    java = java or java_runtime()
    coco, sacrebleu = f"pycocoevalcap {_version('pycocoevalcap')}", f"sacrebleu {_version('sacrebleu')}"
    tokens = ("coco-caption PTBTokenizer tokens (Stanford CoreNLP 3.4.1, Java; lower-cased, punctuation removed)"
              if java.available else
              f"nltk {_version('nltk')} NLTKWordTokenizer tokens (lower-cased, punctuation removed) INSTEAD of "
              f"coco-caption's PTBTokenizer ({java.reason}): approximates the official script")
    described = {
        "bleu": f"{sacrebleu} BLEU, lower-cased 13a tokens, all references, n-gram totals as mteval-v13a's Python "
                f"port (as {OFFICIAL})",
        "nist": f"mteval-v13a NIST n=5 as e2e-metrics' Python port (peftlab's code) on {sacrebleu} lower-cased 13a "
                "tokens: matches clipped against all references, average reference length",
        "meteor": f"{coco} METEOR 1.5 jar (-l en -norm, {java.version}) on {tokens}, corpus score",
        "rouge_l": f"{coco} Rouge (ROUGE-L, beta 1.2, best precision and recall over references) on {tokens}, "
                   "mean over inputs",
        "cider": f"{coco} Cider (CIDEr-D, document frequencies from the evaluated references) on {tokens}",
    }
    if not java.available:
        described.pop("meteor")
    return described


@lru_cache(maxsize=1)
def _tokenizer_13a():
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()  # one instance: its own cache of tokenised lines lives on it


def mteval_tokens(text: str) -> list[str]:
    """Lower-cased mteval-v13a tokens (sacrebleu's 13a tokeniser); an empty text is one empty token, as in
    e2e-metrics' ``pymteval`` (``''.split(' ')``), which counts it in the output length."""
    return _tokenizer_13a()(text.lower()).split() or [""]


def mteval_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """BLEU of ``measure_scores.py -p`` from sacrebleu's match counts and closest reference lengths."""
    from sacrebleu.metrics.bleu import BLEU

    depth = max(len(refs) for refs in references)  # sacrebleu's streams: the k-th reference of every input
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(depth)]
    stats = BLEU(lowercase=True, tokenize="13a", force=True).corpus_score(list(hypotheses), streams)
    lengths = [len(mteval_tokens(h)) for h in hypotheses]
    totals = [max(sum(length - n for length in lengths), 1e-9) for n in range(4)]  # the port's n-gram totals
    return BLEU.compute_bleu(list(stats.counts), totals, sum(lengths), stats.ref_len, smooth_method="floor",
                             smooth_value=1e-15).score / 100.0


def mteval_nist(hyp_tokens: Sequence[list[str]], ref_tokens: Sequence[Sequence[list[str]]], max_n: int = 5) -> float:
    """mteval-v13a NIST as e2e-metrics' ``pymteval.NISTScore`` computes it; ZeroDivisionError, as there, when
    some order's n-gram total (tokens - n + 1 summed over the outputs) is 0."""
    from nltk.util import ngrams

    ref_counts = [Counter() for _ in range(max_n + 1)]  # order n -> every reference's n-gram counts; 0: words
    hits = [Counter() for _ in range(max_n + 1)]  # order n -> matched n-grams (clipped), over the corpus
    totals = [0] * (max_n + 1)  # order n -> sum over outputs of (tokens - n + 1), negative terms included
    avg_ref_len = 0.0
    for hyp, refs in zip(hyp_tokens, ref_tokens):
        for n in range(1, max_n + 1):
            totals[n] += len(hyp) - n + 1
            most = Counter()
            for ref in refs:
                counts = Counter(ngrams(ref, n))
                most |= counts  # the most frequent count over the references
                ref_counts[n].update(counts)
            hits[n].update(Counter(ngrams(hyp, n)) & most)
        ref_counts[0][()] += sum(len(ref) for ref in refs)
        avg_ref_len += sum(len(ref) for ref in refs) / len(refs)

    def info(gram: tuple) -> float:  # log2(count of its first n-1 words / count of the n-gram) in the references
        return math.log(ref_counts[len(gram) - 1][gram[:-1]] / ref_counts[len(gram)][gram], 2)

    score = sum(sum(info(gram) * count for gram, count in hits[n].items()) / totals[n] for n in range(1, max_n + 1))
    ratio = totals[1] / avg_ref_len
    penalty = 1.0 if ratio >= 1 else 0.0 if ratio <= 0 else math.exp(-NIST_BETA * math.log(ratio) ** 2)
    return penalty * score


def ptb_tokenize(texts_per_input: Sequence[Sequence[str]]) -> list[list[str]]:
    """coco-caption's PTBTokenizer (pycocoevalcap, Java) on every text, as the official script calls it."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    captions = {i: [{"caption": text} for text in texts] for i, texts in enumerate(texts_per_input)}
    tokenized = PTBTokenizer().tokenize(captions)
    if [len(tokenized.get(i, ())) for i in captions] != [len(t) for t in texts_per_input]:
        raise RuntimeError("the PTB tokenizer (java) returned fewer lines than it was given")
    return [tokenized[i] for i in captions]


def nltk_tokenize(texts_per_input: Sequence[Sequence[str]]) -> list[list[str]]:
    """The stand-in for the PTB tokenizer without Java (see the module docstring)."""
    from nltk.tokenize import NLTKWordTokenizer, PunktSentenceTokenizer
    from pycocoevalcap.tokenizer.ptbtokenizer import PUNCTUATIONS

    sentences, words = PunktSentenceTokenizer(), NLTKWordTokenizer()

    def one(text: str) -> str:
        tokens = (w.lower() for s in sentences.tokenize(text) for w in words.tokenize(s, convert_parentheses=True))
        return " ".join(t for t in tokens if t not in PUNCTUATIONS)

    return [[one(text) for text in texts] for texts in texts_per_input]


@lru_cache(maxsize=1)
def _meteor_process():
    """pycocoevalcap's METEOR 1.5 wrapper: one jvm per Python process, kept for every later evaluation (loading
    its paraphrase table is most of METEOR's cost; each EVAL sends its own statistics, so nothing carries over).
    The jvm ends with this process: its wrapper's ``__del__`` kills it, and it exits when its stdin closes."""
    from pycocoevalcap.meteor.meteor import Meteor

    return Meteor()


def meteor_score(hyps: list[str], refs: list[list[str]]) -> float:
    """METEOR 1.5's corpus score (the statistics of every input summed), as the official script's."""
    meteor = _meteor_process()
    try:
        score, _ = meteor.compute_score({i: r for i, r in enumerate(refs)}, {i: [h] for i, h in enumerate(hyps)})
    except BaseException:
        _meteor_process.cache_clear()  # a jvm that failed once is not asked again
        if meteor.lock.locked():  # the wrapper keeps its lock when it fails; its __del__ would wait on it forever
            meteor.lock.release()
        raise
    return float(score)


def one_line(text: str | None) -> str:
    """A text as the script reads it from a file: one stripped line (line breaks become spaces)."""
    return " ".join((text or "").splitlines()).strip()


def corpus_scores(hypotheses: Sequence[str], references: Sequence[Sequence[str]],
                  java: JavaRuntime | None = None) -> NlgScores:
    """BLEU, NIST, METEOR, ROUGE-L and CIDEr of ``hypotheses[i]`` against ``references[i]`` (one or more), equal
    to :data:`OFFICIAL`'s (METEOR and the PTB tokenizer only where ``java`` runs: :func:`java_runtime`)."""
    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(f"need one list of references per hypothesis, got {len(hypotheses)} and {len(references)}")
    if any(not refs for refs in references):
        raise ValueError("every hypothesis needs at least one reference")
    require(SCORED_BY)  # the 'nlg' extra: one line naming it, not an ImportError from the first scorer
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    java = java or java_runtime()
    hyps = [one_line(h) for h in hypotheses]
    refs = [[one_line(r) for r in group] for group in references]
    metrics: dict[str, float] = {"bleu": mteval_bleu(hyps, refs)}
    unavailable: dict[str, str] = {}
    notes: list[str] = []
    try:
        metrics["nist"] = mteval_nist([mteval_tokens(h) for h in hyps], [[mteval_tokens(r) for r in g] for g in refs])
    except ZeroDivisionError:
        unavailable["nist"] = ("NIST is undefined on these outputs: for some n-gram order the script's n-gram total "
                               "(tokens - n + 1, summed over outputs) is 0, and it divides by it")

    if java.available:
        try:
            coco_refs = ptb_tokenize(refs)
            coco_hyps = [texts[0] for texts in ptb_tokenize([[h] for h in hyps])]
        except (OSError, RuntimeError) as err:  # java runs, the tokenizer does not: scored as without java
            java = JavaRuntime(java.path, java.version, f"coco-caption's PTB tokenizer failed under {java.path}: {err}")
    if java.available:
        try:
            metrics["meteor"] = meteor_score(coco_hyps, coco_refs)
        except (OSError, ValueError) as err:  # the jar died (e.g. no memory for its 2 GB heap): no number from it
            unavailable["meteor"] = f"METEOR 1.5 failed under {java.version}: {err!r}"
            notes.append(f"METEOR 1.5 not computed: {unavailable['meteor']}")
    else:
        coco_refs = nltk_tokenize(refs)
        coco_hyps = [texts[0] for texts in nltk_tokenize([[h] for h in hyps])]
        unavailable["meteor"] = meteor_missing(java)
        notes.append(no_java_note(java))
    gts = dict(enumerate(coco_refs))
    res = {i: [h] for i, h in enumerate(coco_hyps)}
    metrics["rouge_l"] = float(Rouge().compute_score(gts, res)[0])
    metrics["cider"] = float(Cider().compute_score(gts, res)[0])
    described = implementations(java)
    ordered = {name: metrics[name] for name in METRICS if name in metrics}
    return NlgScores(ordered, {name: described[name] for name in ordered}, unavailable, tuple(notes))
