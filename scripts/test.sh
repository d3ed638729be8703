#!/usr/bin/env bash
# Set everything up (first time only) and run the whole test suite.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# One pytest-xdist worker per core, at most 4 (each holds ~1.5 GB once the real models are loaded);
# PEFTLAB_TEST_WORKERS=0 runs in this process. worksteal evens out the minute-long tests. Arguments given here
# come after these and win: `bash scripts/test.sh -n 0 tests/test_study.py`.
cores=$(nproc)
python -m pytest -q -rs -p no:cacheprovider -n "${PEFTLAB_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}" --dist worksteal "$@"
