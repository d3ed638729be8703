#!/usr/bin/env bash
# Set everything up (first time only), then the main job: Yao et al.'s recipe on real data with a local model.
# LoRA on W_q and W_v of MiniLM-L6 with eta_V = 4 * eta_QK, full RTE train set (2,490), 3 epochs, dev set 277.
# Re-running it resumes (or, once finished, just reports) the same run; pass extra flags to change it.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
peftlab train --task rte --model minilm-l6 --method lora --targets q,v --lr-ratio 4 --epochs 3 \
  --output-dir runs/rte_minilm_lora_qv_lambda4 --resume "$@"
