#!/usr/bin/env bash
# benchmarks/micro.py on one CUDA GPU, random-weight models only (nothing to download or carry), in under 8 minutes.
#
#   bash scripts/gpu_bench.sh [OUT_DIR]      # default OUT_DIR: bench_gpu/
#
# Writes into OUT_DIR: micro-roberta-base-random-s128-b32-cuda.{json,md} (RoBERTa-base shape, seq 128,
# batch 32), micro-llama3-8b-2l-random-s512-b8-cuda.{json,md} (Llama-3.1-8B layer shape, 2 layers, seq 512,
# batch 8), one .log per run and gpu.txt (nvidia-smi). Every method in peftlab.methods.table.METHODS on q,v and
# q,k,v, plus the base model; bf16 autocast, torch.cuda.Event timing, round-robin order.
# Installs nothing: torch, transformers and peft must already be importable by $PYTHON (default python3);
# peftlab is taken from this checkout's src/. Each run has a hard timeout and a softer time budget
# (--max-seconds) after which its timing phases stop at 3 rounds; results are written after every phase,
# so even a killed run leaves its JSON.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-bench_gpu}"
py="${PYTHON:-python3}"

if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu_bench.sh: no Python interpreter '$py' found (set PYTHON=...)" >&2
  exit 1
fi
state="$("$py" -c '
try:
    import torch
except Exception:
    print("no-torch")
else:
    print("cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "no-cuda")
' 2>/dev/null)"
case "$state" in
  cuda) ;;
  no-cuda)
    echo "gpu_bench.sh: no CUDA GPU visible to torch (torch.cuda.is_available() is False); nothing was run" >&2
    exit 1 ;;
  *)
    echo "gpu_bench.sh: '$py' cannot import torch; this script installs nothing (set PYTHON to an interpreter with torch, transformers and peft)" >&2
    exit 1 ;;
esac
if ! "$py" -c 'import transformers, peft' 2>/dev/null; then
  echo "gpu_bench.sh: '$py' cannot import transformers and peft; this script installs nothing" >&2
  exit 1
fi

mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"   # one GPU
nvidia-smi > "$out/gpu.txt" 2>&1 || echo "nvidia-smi not available" > "$out/gpu.txt"

status=0
run() {  # run LIMIT_S LOG_NAME micro.py args...
  local limit="$1" log="$2"
  shift 2
  echo "gpu_bench.sh: $* (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$py" benchmarks/micro.py --device cuda --out-dir "$out" "$@" \
    > "$out/$log.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "gpu_bench.sh: run failed or timed out (exit $rc); see $out/$log.log" >&2
    status=1
  fi
}

# Hard limits 160 s + 290 s (the CUDA check before them takes seconds) keep the whole script under 8 minutes.
# Llama gets more: its init runs ~40 full SVDs of 4096-wide matrices (PiSSA, MiLoRA, KaSA x2, CorDA).
# --compare-kasa-peft adds KaSA with peft's per-module regulariser, to measure peftlab's batched one on GPU.
run 160 roberta-base --model roberta-base-random --seq-len 128 --batch-size 32 \
  --warmup 3 --repeats 10 --inner 5 --init-repeats 2 --max-seconds 120 --compare-kasa-peft
run 290 llama3-8b-2l --model llama3-8b-2l-random --seq-len 512 --batch-size 8 \
  --warmup 3 --repeats 10 --inner 3 --init-repeats 1 --max-seconds 230 --compare-kasa-peft

ls -l "$out" >&2
exit "$status"
