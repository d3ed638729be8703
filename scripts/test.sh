#!/usr/bin/env bash
# Set everything up (first time only) and run the whole test suite.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m pytest -q -rs -p no:cacheprovider "$@"
