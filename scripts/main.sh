#!/usr/bin/env bash
# Set everything up (first time only), then the main job: Yao et al.'s recipe on real data with a local model.
# LoRA on W_q and W_v of MiniLM-L6 with eta_V = 4 * eta_QK, full RTE train set (2,490), 3 epochs, dev set 277.
# Re-running it resumes (or, once finished, just reports) the same run; pass extra flags to change it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
. .venv/bin/activate
export PEFTLAB_DATA_DIR="${PEFTLAB_DATA_DIR:-$(cd "$root/.." && pwd)/shared/data}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
peftlab train --task rte --model minilm-l6 --method lora --targets q,v --lr-ratio 4 --epochs 3 \
  --output-dir runs/rte_minilm_lora_qv_lambda4 --resume "$@"
