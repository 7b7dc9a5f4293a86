"""Which exit layer N should self-speculation draft from? Held-out agreement and drafting cost per N.

    OMP_NUM_THREADS=1 python scripts/exit_sweep.py --data runs/data/smollm2-sharegpt --layers 4,6,8,10,12,15 \\
        --out runs/sweep/exits.json

The target runs once over --conversations of the data (`gorgon data` output), keeping every layer's output at
the answer tokens; per N an exit (heads/methods/self_spec) is trained for --steps on positions drawn from
nine tenths of them against the target's own next-token distribution (what `train/heads.py` does, minus its
run folder: the exit reads one position at a time, so positions can be drawn freely) and scored on the rest:
top-1 agreement with the target, before training (LayerSkip's plain early exit) and after. A drafted level's
cost is timed as the decoder's calibration times it (`level_trial`), against a plain target step timed just
before it (so the ratio holds on a busy machine too; the times themselves need a quiet one), and the
figure of merit is a greedy chain's: the most tokens per unit of time over chain depths d,
(1 + p + ... + p^d) / (1 + d * cost), with p the trained top-1. Prints a table, writes the JSON and a PNG.
"""

import json
import random
from pathlib import Path

import torch

from gorgon.decode.calibrate import TIMED_CONTEXT, cpu_flags, measure_verify_costs, median_ms
from gorgon.decode.kernels import use_cpu_kernels
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.files import atomic_write_text, save_figure
from gorgon.heads.methods.self_spec import EarlyExit, SelfSpecDrafter
from gorgon.heads.methods.self_spec.model import ADAPTER_SIZE, check_exit_layer
from gorgon.heads.outputs import check_report_output
from gorgon.heads.target import lm_logits, load_target
from gorgon.train.examples import frequent_tokens, load_examples, read_conversations, split

DEPTHS = range(1, 9)


def is_sweep(path: Path) -> bool:
    """A JSON this script wrote (the only file --out may replace, with --overwrite)."""
    try:
        return "exit_sweep" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def chain_speed(p: float, cost: float) -> tuple[float, int]:
    """The best greedy chain's tokens per unit of time (a plain step is 1), and its depth."""
    return max((sum(p ** i for i in range(d + 1)) / (1 + d * cost), d) for d in DEPTHS)


@torch.no_grad()
def layer_outputs(model, examples, layers):
    """Per exit layer, the (positions, H) outputs at answer positions, with the target's final hidden states."""
    outs, last = {n: [] for n in layers}, []
    for ex in examples:
        ids = torch.tensor(ex["input_ids"])[None]
        keep = torch.tensor(ex["loss_mask"][1:] + [False])  # position p drafts token p + 1, an answer token
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
        for n in layers:
            outs[n].append(out.hidden_states[n][0, keep])
        last.append(out.last_hidden_state[0, keep])
    return {n: torch.cat(v) for n, v in outs.items()}, torch.cat(last)


def level_against_step(drafter, model, repeat: int = 20) -> float:
    """A drafted level (two rows after 256 cached tokens) in plain one-token steps, both timed now, one after the
    other: the calibration's cached step would set a level timed on a busy machine against a quiet one's step."""
    with torch.inference_mode():
        step = measure_verify_costs(model, sizes=(1,), repeat=repeat)[1]
        level, reset = drafter.level_trial(TIMED_CONTEXT)
        return median_ms(level, repeat, reset) / step


def top1(exit_, hidden, labels) -> float:
    with torch.no_grad():
        return float((exit_.logits(hidden).argmax(-1) == labels).float().mean())


def train_exit(exit_, hidden, teacher, steps: int, batch: int, seed: int) -> None:
    exit_.train()
    optimizer = torch.optim.AdamW([p for p in exit_.parameters() if p.requires_grad], lr=1e-3)
    rows = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pick = torch.randint(0, len(hidden), (batch,), generator=rows)
        soft = teacher(pick)
        loss = -(soft.exp() * exit_.logits(hidden[pick]).float().log_softmax(-1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    exit_.eval()


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    n = [r["exit_layer"] for r in rows]
    left.plot(n, [r["top1_untrained"] for r in rows], marker="o", label="plain early exit")
    left.plot(n, [r["top1"] for r in rows], marker="o", label="trained exit")
    left.set(xlabel="exit layer N", ylabel="held-out top-1 agreement", title="agreement with the target")
    left.legend()
    right.plot(n, [r["chain_speed"] for r in rows], marker="o")
    right.set(xlabel="exit layer N", ylabel="tokens per plain step's time", title="best greedy chain (estimate)")
    save_figure(fig, path)


def main(argv=None) -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="gorgon data output (or any conversation file)")
    p.add_argument("--target", default=None, help="the target (default: the embedded one)")
    p.add_argument("--layers", default="4,6,8,10,12,15", help="exit layers N to compare, comma-separated")
    p.add_argument("--conversations", type=int_at_least(2), default=200, help="conversations the target runs on")
    p.add_argument("--adapter-size", type=int_at_least(1), default=ADAPTER_SIZE, help="the exit's MLP width")
    p.add_argument("--draft-vocab-size", type=int_at_least(1), default=8192, help="tokens the exit drafts from")
    p.add_argument("--steps", type=int_at_least(0), default=300, help="training steps per exit")
    p.add_argument("--batch", type=int_at_least(1), default=256, help="positions per training step")
    p.add_argument("--seed", type=int, default=0, help="seeds the data split, the draws of positions and the exits")
    p.add_argument("--out", required=True, help="the JSON to write (a PNG beside it)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier sweep's JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    check_report_output(out, is_sweep, args.overwrite)
    target = load_target(args.target) if args.target else load_target()
    model = target.model
    use_cpu_kernels(model, "fast")  # as decoding runs it: the stock kernel's products of a few rows cost far more
    layers = [int(x) for x in args.layers.split(",")]
    for n in layers:
        check_exit_layer(n, model.config.get_text_config().num_hidden_layers)
    examples = load_examples(args.data, target.tokenizer, 512, target.fingerprints, read_conversations(args.data))
    random.Random(args.seed).shuffle(examples)
    train_ex, held_ex = split(examples[:args.conversations], 0.1, args.seed)
    draft_tokens, _ = frequent_tokens(train_ex, args.draft_vocab_size, model.config.vocab_size)
    draft_tokens = draft_tokens.sort().values
    train_h, train_last = layer_outputs(model, train_ex, layers)
    held_h, held_last = layer_outputs(model, held_ex, layers)
    index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    index[draft_tokens] = torch.arange(len(draft_tokens))
    with torch.no_grad():
        held_labels = index[lm_logits(model, held_last).argmax(-1)]

    def teacher(pick):
        with torch.no_grad():
            return lm_logits(model, train_last[pick], draft_tokens).float().log_softmax(-1)

    rows = []
    for n in layers:
        exit_ = EarlyExit.for_target(model, n, args.adapter_size, draft_tokens)
        before = top1(exit_, held_h[n], held_labels)
        train_exit(exit_, train_h[n], teacher, args.steps, args.batch, args.seed)
        after = top1(exit_, held_h[n], held_labels)
        cost = level_against_step(SelfSpecDrafter(exit_, nodes=4, depth=3, topk=2), model)
        speed, depth = chain_speed(after, cost)
        rows.append({"exit_layer": n, "top1_untrained": before, "top1": after, "level_cost": cost,
                     "chain_speed": speed, "chain_depth": depth})
        print(f"N={n:2d}  top-1 {before:.3f} -> {after:.3f}  level {cost:.3f} steps  chain {speed:.2f} (depth {depth})",
              flush=True)
    report = {"exit_sweep": rows, "conversations": args.conversations, "held_out_positions": len(held_labels),
              "adapter_size": args.adapter_size, "steps": args.steps, "draft_vocab_size": args.draft_vocab_size,
              "threads": torch.get_num_threads(), "cpu_flags": cpu_flags()}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=2))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    run_script(main, "scripts/exit_sweep.py")
