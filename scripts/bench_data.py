"""Batched self-distillation throughput against single-stream generation, in one process.

    OMP_NUM_THREADS=1 python scripts/bench_data.py --prompts ../shared/data/mt_bench.jsonl

The same prompts and settings go through `gorgon data`'s engine with batch size 1 and with
--batch-size B; each prints generated tokens/s and the ratio. Greedy, so both do the same work.
"""

import argparse
import json
import time

import torch

from gorgon.heads import load_target
from gorgon.train.data import DataSettings, Engine, chat_ids
from gorgon.train.prompts import load_conversations


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--target", default=None)
    p.add_argument("--limit", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--single-limit", type=int, default=8, help="prompts for the (slow) single-stream run")
    args = p.parse_args()
    target = load_target(args.target)
    convs = load_conversations(args.prompts, args.limit)
    prompts = [chat_ids(target.tokenizer, [{"role": "user", "content": c["turns"][0]}], None) for c in convs]
    results = {}
    for name, bs, subset in [("single", 1, prompts[: args.single_limit]), ("batched", args.batch_size, prompts)]:
        engine = Engine(target, DataSettings(prompts=args.prompts, batch_size=bs, max_new_tokens=args.max_new_tokens))
        engine.generate(subset[:1], seed=0)  # warm-up
        start = time.perf_counter()
        tokens = sum(map(len, engine.generate(subset, seed=0)))
        secs = time.perf_counter() - start
        results[name] = {"prompts": len(subset), "batch_size": bs, "tokens": tokens, "seconds": round(secs, 2),
                         "tokens_per_s": round(tokens / secs, 2)}
        print(name, results[name], flush=True)
    results["ratio"] = round(results["batched"]["tokens_per_s"] / results["single"]["tokens_per_s"], 2)
    results["threads"] = torch.get_num_threads()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
