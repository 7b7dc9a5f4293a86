#!/usr/bin/env bash
# The test suite: unit tests on tiny random models and integration tests on the embedded target.
# One OpenMP thread: on these 2-core machines two threads can be many times slower.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec ${PYTHON:-python3} -m pytest -q "$@"
