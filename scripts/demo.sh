#!/usr/bin/env bash
# The whole pipeline on the embedded SmolLM2-135M-Instruct: self-distilled data -> draft heads
# -> `gorgon bench` against plain generate on MT-Bench questions, the heads' tree merged with
# drafts from the context (the fastest setting measured on a CPU), the heads alone beside it.
#
#   bash scripts/demo.sh          short version: a few minutes on a 2-core CPU, weak Medusa heads
#   bash scripts/demo.sh --full   the EAGLE head's recipe (configs/heads/smollm2-135m-eagle.yaml)
#                                 on the full data: about 40 min to train on 2 cores, 80 questions
#
# Every stage resumes if killed: rerun the same command. Outputs go to runs/.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
export WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
# Data and training use every core; the bench times on one thread, as every timing here (two
# threads beside any other process can be many times slower). A set OMP_NUM_THREADS applies to all.
work=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}") timed=(env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}")
SHAREGPT=../shared/data/sharegpt_prompts.jsonl

if [ "${1:-}" = "--full" ]; then
  recipe=configs/heads/smollm2-135m-eagle.yaml; data=runs/data/smollm2-sharegpt
  heads=runs/heads/smollm2-135m-eagle-12ep
  if [ -f "$SHAREGPT" ]; then prompts=$SHAREGPT; else prompts=self; fi
  echo "demo: prompts from $prompts (the recipes' are $SHAREGPT: scripts/sharegpt_prompts.py makes it)" >&2
  "${work[@]}" gorgon data --prompts "$prompts" --limit 800 --max-new-tokens 128 --max-prompt-tokens 384 --batch-size 32 \
    --out "$data"
  bench=(--limit 80 --max-new-tokens 128)
else
  recipe=configs/heads/smollm2-135m-quick.yaml; data=runs/data/smollm2-quick; heads=runs/heads/smollm2-135m-quick
  # The target writes its own prompts (Magpie), then answers them: no dataset needed.
  "${work[@]}" gorgon data --prompts self --limit 48 --max-new-tokens 96 --batch-size 24 --out "$data"
  bench=(--per-category 1 --max-new-tokens 64)  # one question of each of the 8 categories
fi

if [ ! -f "$heads/model.safetensors" ]; then
  resume=()
  if [ -d "$heads/checkpoints" ]; then resume=(--resume true); fi
  "${work[@]}" accelerate launch -q --config_file configs/accelerate/cpu.yaml train/heads.py --config "$recipe" "${resume[@]}"
fi
"${timed[@]}" gorgon bench --heads "$heads" --context-draft --baselines generate,no-context --questions scripts/data/mt_bench.jsonl \
  "${bench[@]}" --out "$heads/bench.json" --overwrite
