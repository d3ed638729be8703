# Sourced by main.sh and test.sh: set up (first time only), enter .venv, and point peftlab at the local data.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
. .venv/bin/activate
export PEFTLAB_DATA_DIR="${PEFTLAB_DATA_DIR:-$(cd "$root/.." && pwd)/shared/data}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
