"""`gorgon bench --batch-sizes`: where speculation stops paying as requests are batched.

For each batch size B, the questions' first turns are taken in groups of B distinct questions (a server's
batch holds different requests), each group decoded by plain batched `generate` and by gorgon's batched decoder
(`gorgon.decode.batch`) on the same model and kernels, one after the other (which goes first alternates between
groups, so drift hits both alike). Reported per batch size: tokens/s over the batch for both, the speedup, tau,
the tree width the batch chose and the share of rows that drafted, and how many rows are identical to their
prompt's own one-row `generate` (and to batched `generate`'s row); from those, the draft length per batch size an
engine can take (`schedule`).

The batched decoder also does what a serving loop does besides drafting (a finished row leaves the batch, where
`generate` decodes it to the end with the others; the cache grows in place; the greedy choice is screened on a
bfloat16 copy of the output layer): so each group is also decoded by it with no drafts at all (`NoDrafts`), in the
same rotation, and the report says how much of the speedup the drafts themselves give (`draft_gain`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gorgon.heads.errors import GorgonError
from gorgon.heads.files import atomic_write_text, save_figure
from gorgon.heads.target import context_length, fits_context
from gorgon.heads.tree import tree_from_token_paths

from .batch import Pace, speculative_generate_batch
from .calibrate import BUSY_LIMIT, busy_cores, cpu_reading, sync, verify_costs
from .generate import generation_config_as_applied


class NoDrafts:
    """A drafter that never proposes a candidate: the batched decoder then takes plain steps."""

    feature_layers = None
    max_nodes = 1

    def fresh(self) -> "NoDrafts":
        return self

    def scored_paths(self, root, features, context) -> list:
        return []

    def propose(self, root, features, context):
        return tree_from_token_paths(root, [])


def batch_sizes_option(text: str) -> list[int]:
    """--batch-sizes: whole numbers >= 1, comma-separated, each once, ascending."""
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes takes whole numbers >= 1, comma-separated (1,4,16), not "
                                         f"{text!r}")
    return sizes


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (each 1-D) as a tokenizer pads them for `generate`: on the left, with the mask saying where."""
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():], mask[i, width - r.numel():] = r, 1
    return ids, mask


def generated_rows(out: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens from batched `generate`'s output, up to and with its first EOS (after which it pads)."""
    rows = []
    for row in out[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def first_turns(target, questions: list[dict], max_new_tokens: int) -> list[torch.Tensor]:
    """Each question's first turn as prompt ids (1-D), those that fit the context with the reply."""
    context = context_length(target.model)
    prompts = [target.chat_ids([{"role": "user", "content": q["turns"][0]}])[0] for q in questions]
    return [p for p in prompts if fits_context(context, p.numel(), max_new_tokens)]


def run_batch_bench(target, drafter, questions: list[dict], batch_sizes: list[int], max_new_tokens: int,
                    progress: bool = True, checkpoint=None, earlier: list[dict] | None = None) -> list[dict]:
    """One entry per batch size (`batch_figures`); `checkpoint(entries)` after each size, `earlier` entries of the
    same settings are kept and their sizes not run again."""
    from tqdm.auto import tqdm

    model, tokenizer = target.model, target.tokenizer
    prompts = first_turns(target, questions, max_new_tokens)
    if len(prompts) < max(batch_sizes):
        raise GorgonError(f"--batch-sizes {max(batch_sizes)} needs as many distinct questions, and "
                          f"{len(prompts)} fit: pass more questions (--questions, --limit) or smaller batch sizes")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    config = generation_config_as_applied(model)
    config.update(max_new_tokens=max_new_tokens, do_sample=False)
    entries = list(earlier or [])
    done = {e["batch"] for e in entries}
    for batch in batch_sizes:  # the verify costs a batch is sized from: timed before any timing, once a machine
        for size in {batch} | {2 ** k for k in range(batch.bit_length()) if 2 ** k < batch}:
            verify_costs(model, size)

    def plain(ids, mask):
        sync(model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        sync(model.device)
        return generated_rows(out, ids.shape[1], eos), time.perf_counter() - start

    # What each row must equal: its prompt's own one-row greedy `generate` (untimed, once). A row of batched
    # `generate` can differ from it (its padded prefill sums attention in another order, and a quantized target's
    # rounding can then move), so rows equal to batched `generate`'s are counted apart.
    own = [plain(p[None], torch.ones_like(p[None]))[0][0]
           for p in tqdm(prompts, desc="each prompt's own generate", unit="prompt", disable=not progress,
                         dynamic_ncols=True, leave=False)]
    paces = {}  # one per batch size, carried across its groups as a server's loop carries it across calls

    def gorgon(ids, mask, chosen=drafter, pace=None):
        sync(model.device)
        start = time.perf_counter()
        result = speculative_generate_batch(model, chosen, ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                            pace=pace)
        sync(model.device)
        return result, time.perf_counter() - start

    methods = {"baseline": plain, "gorgon": lambda ids, mask: gorgon(ids, mask, pace=paces.get(ids.shape[0])),
               "no_drafts": lambda ids, mask: gorgon(ids, mask, NoDrafts())}
    warm = left_padded(prompts[:2], pad)  # kernels and caches loaded outside the timings
    for method in methods.values():
        method(*warm)
    for batch in batch_sizes:
        if batch in done:
            continue
        paces[batch] = Pace(on=True)
        starts = range(0, len(prompts) - batch + 1, batch)
        groups = [(prompts[i:i + batch], own[i:i + batch]) for i in starts]
        totals = dict(tokens=0, seconds=0.0, baseline_tokens=0, baseline_seconds=0.0, no_drafts_tokens=0,
                      no_drafts_seconds=0.0, forwards=0, identical=0, identical_batched=0, rows=0, widths=[],
                      drafting=[], busy=[])
        names = list(methods)
        for g, (group, wanted) in enumerate(tqdm(groups, desc=f"batch {batch}", unit="batch", disable=not progress,
                                                 dynamic_ncols=True, leave=False)):
            ids, mask = left_padded(group, pad)
            start = cpu_reading()
            order = names[g % len(names):] + names[:g % len(names)]  # each goes first in turn
            runs = {name: methods[name](ids, mask) for name in order}
            totals["busy"].append(busy_cores(start))
            (reference, base_seconds), (result, seconds) = runs["baseline"], runs["gorgon"]
            plain_result, plain_seconds = runs["no_drafts"]
            totals["tokens"] += result.tokens
            totals["seconds"] += seconds
            totals["baseline_tokens"] += sum(len(r) for r in reference)
            totals["baseline_seconds"] += base_seconds
            totals["no_drafts_tokens"] += plain_result.tokens
            totals["no_drafts_seconds"] += plain_seconds
            totals["forwards"] += sum(r.target_forwards for r in result.rows)
            totals["identical"] += sum(r.tokens == want for r, want in zip(result.rows, wanted))
            totals["identical_batched"] += sum(r.tokens == ref for r, ref in zip(result.rows, reference))
            totals["rows"] += len(group)
            totals["widths"] += result.widths
            totals["drafting"] += [d / len(group) for d in result.drafting]
        entries.append(batch_figures(batch, len(groups), totals))
        if checkpoint is not None:
            checkpoint(entries)
    return sorted(entries, key=lambda e: e["batch"])


def batch_figures(batch: int, groups: int, t: dict) -> dict:
    """One batch size's figures from its groups' totals."""
    tps = t["tokens"] / max(t["seconds"], 1e-9)
    base_tps = t["baseline_tokens"] / max(t["baseline_seconds"], 1e-9)
    plain_tps = t["no_drafts_tokens"] / max(t["no_drafts_seconds"], 1e-9)
    widths = t["widths"]
    return {"batch": batch, "groups": groups, "rows": t["rows"], "tokens_per_s": tps, "baseline_tokens_per_s": base_tps,
            "speedup": tps / base_tps, "no_drafts_tokens_per_s": plain_tps, "draft_gain": tps / plain_tps,
            "tau": t["tokens"] / max(1, t["forwards"]),
            "mean_width": statistics.mean(widths) if widths else None,
            "median_width": statistics.median(widths) if widths else None,
            "drafting_share": statistics.mean(t["drafting"]) if t["drafting"] else None,
            "identical": t["identical"], "identical_batched": t["identical_batched"],
            "busy_cores": statistics.mean(t["busy"])}


def schedule(entries: list[dict]) -> list[list[int]]:
    """The draft length per batch size an engine takes (vLLM's `num_speculative_tokens_per_batch_size`: inclusive
    ranges of batch sizes, from 1, each with its draft tokens a step): at each measured size, the candidates a
    row's tree had on the median step (0 where the drafts did not beat the same decoder without them), for the
    sizes from just above the one measured before it."""
    ranges, start = [], 1
    for e in sorted(entries, key=lambda e: e["batch"]):
        drafts = 0 if e["draft_gain"] < 1 or e["median_width"] is None else max(0, round(e["median_width"] - 1))
        ranges.append([start, e["batch"], drafts])
        start = e["batch"] + 1
    return ranges


def batch_report(entries: list[dict]) -> dict:
    busy = [e["busy_cores"] for e in entries]
    reasons = [f"other work kept about {max(busy):.1f} cores busy while timing"] if max(busy) > BUSY_LIMIT else []
    return {"batches": entries, "schedule": schedule(entries), "trust": {"ok": not reasons, "reasons": reasons}}


def batch_table(report: dict) -> str:
    lines = ["| batch | rows | tau | tokens/s | generate tokens/s | speedup | no drafts tokens/s | from drafts "
             "| median width | rows drafting | identical | as batched generate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["batches"]:
        width = "-" if e["median_width"] is None else f"{e['median_width']:g}"
        drafting = "-" if e["drafting_share"] is None else f"{e['drafting_share']:.0%}"
        batched = f"{e['identical_batched']}/{e['rows']}" if "identical_batched" in e else "-"  # older reports
        lines.append(f"| {e['batch']} | {e['rows']} | {e['tau']:.2f} | {e['tokens_per_s']:.1f} | "
                     f"{e['baseline_tokens_per_s']:.1f} | {e['speedup']:.2f}x | {e['no_drafts_tokens_per_s']:.1f} | "
                     f"{e['draft_gain']:.2f}x | {width} | {drafting} | "
                     f"{e['identical']}/{e['rows']} | {batched} |")
    lines.append(f"\nschedule (vLLM's num_speculative_tokens_per_batch_size): {json.dumps(report['schedule'])}")
    if not report["trust"]["ok"]:
        lines.append("\n**These figures are not to be trusted** (rerun on a quiet machine): "
                     + "; ".join(report["trust"]["reasons"]))
    return "\n".join(lines)


def plot_batches(report: dict, path: Path) -> None:
    """Speedup over plain batched `generate` against batch size, and both methods' tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = report["batches"]
    sizes = [e["batch"] for e in entries]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    left.plot(sizes, [e["speedup"] for e in entries], "o-", color="#08519c", label="over batched generate")
    left.plot(sizes, [e["draft_gain"] for e in entries], "^:", color="#74c476", label="from the drafts alone")
    for e in entries:
        left.annotate(f"{e['speedup']:.2f}x", (e["batch"], e["speedup"]), fontsize=7, textcoords="offset points",
                      xytext=(0, 6), ha="center")
    left.legend(fontsize=7, frameon=False)
    left.axhline(1.0, color="black", lw=0.8)
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(s) for s in sizes])
    left.set_xlabel("batch size (requests decoded together)")
    left.set_ylabel("speedup")
    left.set_title("speedup by batch size")
    right.plot(sizes, [e["tokens_per_s"] for e in entries], "o-", color="#08519c", label="gorgon")
    right.plot(sizes, [e["no_drafts_tokens_per_s"] for e in entries], "^:", color="#74c476",
               label="gorgon, no drafts")
    right.plot(sizes, [e["baseline_tokens_per_s"] for e in entries], "s--", color="#fd8d3c", label="generate")
    right.set_xscale("log", base=2)
    right.set_xticks(sizes, [str(s) for s in sizes])
    right.set_xlabel("batch size")
    right.set_ylabel("tokens/s over the batch")
    right.set_title("throughput")
    right.legend(fontsize=7, frameon=False)
    if not report["trust"]["ok"]:
        fig.suptitle("NOT TO BE TRUSTED: " + report["trust"]["reasons"][0], color="#b2182b", fontsize=9)
    save_figure(fig, path)


def write_batch_report(path: Path, report: dict) -> None:
    atomic_write_text(path, json.dumps(report, indent=1) + "\n")
