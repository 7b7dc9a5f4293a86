#!/usr/bin/env bash
# The test suite: unit tests on tiny random models and integration tests on the embedded target.
# One OpenMP thread: on these 2-core machines two threads can be many times slower.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast subset (about two minutes on 2 busy
# cores). It fails when a test not marked slow takes over 5 s (GORGON_FAST_TEST_LIMIT=10 on a loaded machine):
# mark @pytest.mark.slow each test that trains, benches or starts a process, or runs longer.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec ${PYTHON:-python3} -m pytest -q "$@"
