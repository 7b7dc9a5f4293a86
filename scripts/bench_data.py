"""Continuously batched self-distillation throughput against single-stream `generate`, in one run.

    OMP_NUM_THREADS=1 python scripts/bench_data.py --prompts scripts/data/mt_bench.jsonl \\
        --limit 64 --batch-size 32 --max-new-tokens 256 --single-limit 4
    OMP_NUM_THREADS=1 python scripts/bench_data.py --prompts ../shared/data/sharegpt_prompts.jsonl \\
        --limit 32 --dtypes float32 bfloat16 --rounds 2

The batched side is `gorgon data`'s engine over all prompts; the single-stream side is plain
greedy `model.generate` on the first --single-limit prompts, one at a time. The two alternate for
--rounds rounds so a noisy neighbour slows both alike; each side's tokens/s is its total tokens
over its total time. The single-stream answers must equal the batched ones (exact greedy).
With several --dtypes the batched side runs once per dtype in each round (the target loaded in
each, as `gorgon data --dtype` loads it), and counts the answers that differ from the first's.
With --vllm, `gorgon data --engine vllm`'s engine runs too in each round (the first dtype), its answers
compared the same way. Its first round is the one to quote: later rounds ask vLLM the same prompts again,
which its prefix cache answers without their prefill. Inside vLLM's process the transformers engine's
continuous batching ran 2.7x slower than in gorgon's own environment (plain `generate` did not): time that
side with a run without --vllm. Run the script with the python of vLLM's venv, gorgon installed in it:

    export VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind
    OMP_NUM_THREADS=1 ~/.cache/gorgon/engines/vllm/bin/python scripts/bench_data.py --vllm \
        --prompts ../shared/data/sharegpt_prompts.jsonl --limit 64 --max-new-tokens 128 --rounds 2
"""

import argparse
import json
import time

import torch

from gorgon.decode.calibrate import cpu_flags
from gorgon.decode.kernels import KERNELS
from gorgon.heads import load_target
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.train.data import DataSettings, Engine, VllmEngine, chat_ids, check_vllm
from gorgon.train.records import load_conversations


def main():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="a prompts file, dataset folder or hub dataset, as `gorgon data` "
                   "takes")
    p.add_argument("--target", default=None, help="hub id or local path (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--limit", type=int_at_least(1), default=32, help="prompts for the batched side (default 32)")
    p.add_argument("--batch-size", type=int_at_least(1), default=32, help="rows generated together (default 32)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="longest answer (default 64)")
    p.add_argument("--max-prompt-tokens", type=int_at_least(1), default=None, help="leave out longer prompts")
    p.add_argument("--single-limit", type=int_at_least(1), default=4,
                   help="prompts for the (slow) single-stream side (default 4)")
    p.add_argument("--rounds", type=int_at_least(1), default=1, help="alternations of the two sides (default 1)")
    p.add_argument("--cpu-kernels", choices=KERNELS, default="fast", help="for both sides (default fast)")
    p.add_argument("--dtypes", nargs="+", default=["float32"],
                   help="the target's dtype for the batched side, each timed in every round (default float32); the "
                        "single-stream side takes the first")
    p.add_argument("--vllm", action="store_true",
                   help="also time `gorgon data --engine vllm`'s engine in each round (run from vLLM's venv)")
    args = p.parse_args()
    if args.vllm:
        check_vllm()
    targets = {dtype: load_target(args.target, dtype=dtype) for dtype in args.dtypes}
    target = targets[args.dtypes[0]]
    convs = load_conversations(args.prompts, args.limit)
    prompts = [chat_ids(target.tokenizer, [{"role": "user", "content": c["turns"][0]}], None) for c in convs]
    prompts = [q for q in prompts if not args.max_prompt_tokens or len(q) <= args.max_prompt_tokens]
    settings = DataSettings(prompts=args.prompts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            dtype=args.dtypes[0])  # vLLM's dtype; the transformers engines run their target's
    engine = Engine(target, settings, args.cpu_kernels)
    # Each side answers every prompt in each round: `batched` is the first dtype, then the other dtypes and vLLM.
    sides = {"batched": engine} | {dtype: Engine(targets[dtype], settings, args.cpu_kernels)
                                   for dtype in args.dtypes[1:]}
    if args.vllm:  # a target of its own: vLLM's engine releases the transformers weights it is given
        sides["vllm"] = VllmEngine(load_target(args.target, dtype=args.dtypes[0]), settings)

    def single(prompt):
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                        pad_token_id=engine.pad)[0, len(prompt):].tolist()
        return out[:next((j for j, t in enumerate(out) if t in engine.eos), len(out))]

    single(prompts[0][:8])  # warm-up
    totals = {side: [0, 0.0] for side in [*sides, "single"]}
    mismatches, differing = 0, dict.fromkeys(list(sides)[1:], 0)
    for _ in range(args.rounds):
        answers = {}
        for side, answering in sides.items():
            start = time.perf_counter()
            answers[side] = answering.generate(prompts, seeds=list(range(len(prompts))))
            totals[side][0] += sum(map(len, answers[side]))
            totals[side][1] += time.perf_counter() - start
        batched = answers["batched"]
        for side in differing:
            differing[side] += sum(a != b for a, b in zip(answers[side], batched))
        for prompt, answer in zip(prompts[: args.single_limit], batched):
            start = time.perf_counter()
            alone = single(prompt)
            totals["single"][1] += time.perf_counter() - start
            totals["single"][0] += len(alone)
            mismatches += alone != answer
        print({k: round(t / s, 2) for k, (t, s) in totals.items()}, flush=True)
    rates = {k: t / s for k, (t, s) in totals.items()}
    print(json.dumps({
        "prompts": len(prompts), "single_prompts": min(args.single_limit, len(prompts)), "rounds": args.rounds,
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
        "cpu_kernels": args.cpu_kernels, "dtype": args.dtypes[0], "cpu_flags": cpu_flags(),
        "batched_tokens_per_s": round(rates["batched"], 2), "single_tokens_per_s": round(rates["single"], 2),
        "ratio": round(rates["batched"] / rates["single"], 2), "batched_seconds": round(totals["batched"][1], 1),
        "single_answers_differing_from_batched": mismatches,
        "other_sides": {side: {"batched_tokens_per_s": round(rates[side], 2),
                               "ratio_to_first": round(rates[side] / rates["batched"], 2),
                               "answers_differing_from_first": differing[side]} for side in differing}}))


if __name__ == "__main__":
    run_script(main, "scripts/bench_data.py")
