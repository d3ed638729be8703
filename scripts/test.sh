#!/usr/bin/env bash
# Set everything up (first time only) and run the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
. .venv/bin/activate
export PEFTLAB_DATA_DIR="${PEFTLAB_DATA_DIR:-$(cd "$root/.." && pwd)/shared/data}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -p no:cacheprovider "$@"
