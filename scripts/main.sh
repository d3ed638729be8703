#!/usr/bin/env bash
# Set everything up (first time only), then the main job: Yao et al.'s recipe on real data with a local model.
# LoRA on W_q and W_v of MiniLM-L6 with eta_V = 4 * eta_QK (eta_QK = 1e-3), SST-2: 8,000 training sentences
# (a seeded subset of 67,349), 2 epochs, scored before fine-tuning and after each epoch on the full dev set (872).
# Re-running it resumes (or, once finished, just reports) the same run; pass extra flags to change it.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
peftlab train --task sst2 --model minilm-l6 --method lora --targets q,v --lr 1e-3 --lr-ratio 4 --head-lr 1e-3 \
  --max-train-samples 8000 --epochs 2 --eval-before --output-dir runs/sst2_minilm_lora_qv_lambda4 --resume "$@"
