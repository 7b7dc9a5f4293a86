"""Tokens per target forward (tau) of a drafter on a question set, with nothing timed.

    python scripts/tau.py --heads runs/heads/smollm2-135m --questions scripts/data/mt_bench.jsonl --max-new-tokens 64
    python scripts/tau.py --heads runs/heads/smollm2-135m --context-draft --tree-budget 8 \\
        --questions ../shared/data/spec_bench_dev.jsonl --per-category 8 --json
    python scripts/tau.py --heads runs/heads/eagle --chain --questions scripts/data/mt_bench.jsonl  # what vLLM verifies

Nothing is timed (`gorgon.decode.tau`), so this can run beside training where `gorgon bench` cannot,
to compare drafters or tree-merging rules. The mean tree nodes per step is what a step costs (see
scripts/profile_step.py for the cost of a forward over N tokens).
`--json` prints one JSON line: {"drafter", "tau", "nodes_per_step", "per_category", "train_conversations", ...}.
"""

import json
from pathlib import Path

from gorgon.decode.options import DecodeSettings, add_model_arguments, load_chain, load_drafter
from gorgon.decode.questions import load_questions, per_category_sample
from gorgon.decode.tau import measure_tau
from gorgon.heads.command import ArgumentParser, int_at_least, run_script


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, sampling=False)
    p.add_argument("--questions", required=True, help="MT-Bench/Spec-Bench .jsonl")
    p.add_argument("--per-category", type=int_at_least(1), default=None,
                   help="the first N questions of each category only")
    p.add_argument("--chain", action="store_true",
                   help="the --heads or --draft drafter drafting one chain instead, its top candidate per level for "
                        "--draft-depth (or its own depth), every level drafted: the shape vLLM and llama.cpp verify")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args()
    if args.chain and args.context_draft:
        p.error("--chain drafts the --heads or --draft drafter alone: drop --context-draft")
    questions = per_category_sample(load_questions(args.questions), args.per_category)
    settings = DecodeSettings.from_args(args)
    target, drafter = load_chain(settings) if args.chain else load_drafter(settings)
    report = measure_tau(target, drafter, questions, args.max_new_tokens)
    metrics = Path(args.heads) / "metrics.json" if args.heads else None
    report.update({"drafter": settings.name + (" (chain)" if args.chain else ""), "max_tree_nodes": drafter.max_nodes,
                   "questions": len(questions),
                   "max_new_tokens": args.max_new_tokens,
                   "train_conversations": json.loads(metrics.read_text()).get("train_conversations")
                   if metrics is not None and metrics.is_file() else None})
    if args.json:
        print(json.dumps(report))
        return
    print(f"{report['drafter']} on {len(questions)} questions, up to {args.max_new_tokens} new tokens:")
    print("| category | tau | nodes per step |\n|---|---|---|")
    for name, r in list(report["per_category"].items()) + [("**all**", report)]:
        print(f"| {name} | {r['tau']:.2f} | {r['nodes_per_step']:.1f} |")


if __name__ == "__main__":
    run_script(main, "scripts/tau.py")
