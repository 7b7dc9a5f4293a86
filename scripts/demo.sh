#!/usr/bin/env bash
# The whole pipeline on the embedded SmolLM2-135M-Instruct: self-distilled data -> Medusa heads
# -> `gorgon bench` against plain generate on MT-Bench questions.
#
#   bash scripts/demo.sh          short version: a few minutes on a 2-core CPU, weak heads
#   bash scripts/demo.sh --full   the full recipe (configs/heads/smollm2-135m.yaml): about an hour
#
# Every stage resumes if killed: rerun the same command. Outputs go to runs/.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
SHAREGPT=../shared/data/sharegpt_prompts.jsonl

if [ "${1:-}" = "--full" ]; then
  recipe=configs/heads/smollm2-135m.yaml; data=runs/data/smollm2-sharegpt; heads=runs/heads/smollm2-135m
  if [ -f "$SHAREGPT" ]; then prompts=$SHAREGPT; else prompts=self; fi
  gorgon data --prompts "$prompts" --limit 800 --max-new-tokens 128 --max-prompt-tokens 384 --batch-size 32 \
    --out "$data"
  bench=(--limit 80 --max-new-tokens 128)
else
  recipe=configs/heads/smollm2-135m-quick.yaml; data=runs/data/smollm2-quick; heads=runs/heads/smollm2-135m-quick
  # The target writes its own prompts (Magpie), then answers them: no dataset needed.
  gorgon data --prompts self --limit 48 --max-new-tokens 96 --batch-size 24 --out "$data"
  bench=(--limit 4 --max-new-tokens 64)
fi

if [ ! -f "$heads/model.safetensors" ]; then
  resume=()
  if [ -d "$heads/checkpoints" ]; then resume=(--resume true); fi
  accelerate launch -q --config_file configs/accelerate/cpu.yaml train/heads.py --config "$recipe" "${resume[@]}"
fi
gorgon bench --heads "$heads" --questions scripts/data/mt_bench.jsonl "${bench[@]}" --out "$heads/bench.json" --overwrite
