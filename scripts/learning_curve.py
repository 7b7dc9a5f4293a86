"""Held-out tau against training data: heads trained on shares of one recipe's data, on the same questions.

    accelerate launch --config_file configs/accelerate/cpu.yaml train/heads.py \\
        --config configs/heads/smollm2-135m.yaml --out runs/heads/lc/medusa-148 --train_conversations 148
    ... (each share, each method)
    OMP_NUM_THREADS=1 python scripts/learning_curve.py --heads runs/heads/lc/medusa-* runs/heads/smollm2-135m \\
        runs/heads/lc/eagle-* runs/heads/smollm2-135m-eagle --questions scripts/data/mt_bench.jsonl \\
        --per-category 3 --max-new-tokens 64 --out runs/lc/curve.json

Each folder's metrics.json gives its method, its training conversations and its held-out top-1 per draft
position; tau is measured with nothing timed (`gorgon.decode.tau`), every drafter on a tree of the same
--nodes, so the steps cost alike. Prints a table and each method's gain per doubling of the data (a least-
squares line against log2 of the conversations, where a method has two shares or more), and writes the JSON
and a PNG beside it (tau and top-1 per position against conversations, one line per method and position): a
curve still rising says data limits tau, and the lines say how many doublings a gap between methods needs.
"""

import json
import math
from pathlib import Path

from gorgon.decode.questions import load_questions, per_category_sample
from gorgon.decode.tau import measure_tau
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.errors import GorgonError
from gorgon.heads.files import atomic_write_text, save_figure
from gorgon.heads.loading import drafter_for, load_heads
from gorgon.heads.outputs import check_report_output
from gorgon.heads.tree import MAX_TREE_NODES


def is_curve(path: Path) -> bool:
    """A JSON this script wrote (the only file --out may replace, with --overwrite)."""
    try:
        curve = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(curve, dict) and isinstance(curve.get("points"), list) and "nodes" in curve


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    for arch in sorted({p["arch"] for p in points}):
        line = sorted((p for p in points if p["arch"] == arch), key=lambda p: p["train_conversations"])
        x = [p["train_conversations"] for p in line]
        drawn = left.plot(x, [p["tau"] for p in line], marker="o", label=arch)
        for position in range(min(len(p["top1_per_position"]) for p in line)):
            right.plot(x, [p["top1_per_position"][position] for p in line], marker="o", color=drawn[0].get_color(),
                       linestyle=("-", "--", ":", "-.")[position % 4], label=f"{arch}, draft {position + 1}")
    left.set_title("tau on held-out questions")
    left.set_ylabel("tokens per target forward")
    right.set_title("held-out top-1 per draft position")
    right.set_ylabel("share of tokens")
    shares = sorted({p["train_conversations"] for p in points})
    for ax in (left, right):
        ax.set_xscale("log", base=2)  # each share doubles the last
        ax.set_xticks(shares, [str(x) for x in shares])
        ax.minorticks_off()
        ax.margins(x=0.15)  # one share alone sits mid-axis, not on its edge
        ax.set_xlabel("training conversations")
        ax.legend()
    save_figure(fig, path)


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares line's slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def per_doubling(points: list[dict]) -> dict[str, dict]:
    """Each method's gain per doubling of its training conversations, in tau and in top-1 per draft position
    (methods with two shares or more)."""
    gains = {}
    for arch in sorted({p["arch"] for p in points}):
        line = [p for p in points if p["arch"] == arch]
        x = [math.log2(p["train_conversations"]) for p in line]
        if len(set(x)) < 2:
            continue
        positions = min(len(p["top1_per_position"]) for p in line)
        gains[arch] = {"tau": slope(x, [p["tau"] for p in line]),
                       "top1_per_position": [slope(x, [p["top1_per_position"][i] for p in line])
                                             for i in range(positions)]}
    return gains


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", required=True, help="heads folders from train/heads.py")
    p.add_argument("--questions", required=True, help="held-out MT-Bench/Spec-Bench .jsonl")
    p.add_argument("--per-category", type=int_at_least(1), default=None,
                   help="the first N questions of each category only")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="most tokens per answer (default 64)")
    p.add_argument("--nodes", type=int_at_least(2, MAX_TREE_NODES), default=8,
                   help="tree nodes per step for every drafter (default 8)")
    p.add_argument("--out", required=True, help="the JSON to write (a PNG goes beside it)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier curve at --out")
    args = p.parse_args()
    out = Path(args.out)
    check_report_output(out, is_curve, args.overwrite)  # before the measuring, not after
    for folder in args.heads:
        if not (Path(folder) / "metrics.json").is_file():
            raise GorgonError(f"{folder} has no metrics.json: pass heads folders that train/heads.py wrote")
    questions = per_category_sample(load_questions(args.questions), args.per_category)
    points = []
    for folder in args.heads:
        metrics = json.loads((Path(folder) / "metrics.json").read_text())
        target, heads = load_heads(folder, device="cpu", dtype="float32")
        report = measure_tau(target, drafter_for(heads, args.nodes), questions, args.max_new_tokens)
        points.append({"heads": folder, "arch": metrics.get("arch", "medusa"),
                       "train_conversations": metrics["train_conversations"], "top1": metrics["top1"][0],
                       "top1_per_position": metrics["top1"], "tau": report["tau"],
                       "per_category": report["per_category"]})
        print(f"{folder}: {metrics['train_conversations']} conversations, top-1 {metrics['top1'][0]:.3f}, "
              f"tau {report['tau']:.3f}", flush=True)
    gains = per_doubling(points)
    atomic_write_text(out, json.dumps({"questions_file": args.questions, "questions": len(questions),
                                       "max_new_tokens": args.max_new_tokens, "nodes": args.nodes,
                                       "points": points, "per_doubling": gains}, indent=1) + "\n")
    plot(points, out.with_suffix(".png"))
    print("| method | training conversations | held-out top-1 per draft position | tau |\n|---|---|---|---|")
    for q in sorted(points, key=lambda q: (q["arch"], q["train_conversations"])):
        top1 = ", ".join(f"{a:.3f}" for a in q["top1_per_position"])
        print(f"| {q['arch']} | {q['train_conversations']} | {top1} | {q['tau']:.2f} |")
    for arch, gain in gains.items():
        top1 = ", ".join(f"{g:+.3f}" for g in gain["top1_per_position"])
        print(f"{arch}: per doubling of the data, tau {gain['tau']:+.3f}, top-1 per draft position {top1}")
    print(f"{out} (plot: {out.with_suffix('.png')})")


if __name__ == "__main__":
    run_script(main, "scripts/learning_curve.py")
