"""`gorgon bench`: tau, tokens/s and speedup over plain `generate`, measured in one process.

For each question, the baseline and gorgon run on the same model, device and dtype, one after
the other (the order alternating between questions, so drift hits both alike), after a
warm-up. A second turn is asked after the model's own first answer (the baseline's, so both
methods see the same prompt). With greedy decoding the outputs must be identical; the report
counts the questions where they are. It also says whether its figures can be trusted (`trust`): a
machine busy with other work while timing, or figures no quiet machine gives, are flagged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch

from gorgon.heads.card import check_card_folder, refresh_model_card
from gorgon.heads.command import ArgumentParser, int_at_least, user_path
from gorgon.heads.errors import GorgonError, user_error_line
from gorgon.heads.files import atomic_write_text, save_figure
from gorgon.heads.outputs import changed_settings, check_report_output, holding
from gorgon.heads.quantize import quantization
from gorgon.heads.target import check_model_source, context_length, load_causal_lm

from .acceptance import Sampling
from .attention import decoding_attention
from .bench_batch import (
    batch_report,
    batch_sizes_option,
    batch_table,
    plot_batches,
    run_batch_bench,
    write_batch_report,
)
from .calibrate import BUSY_LIMIT, busy_cores, cpu_reading, machine_setup, sync
from .generate import GenerationResult, generation_config_as_applied, speculative_generate
from .kernels import kernels_in_use, stock_kernels
from .options import (
    DecodeSettings,
    add_model_arguments,
    chain_drafter,
    check_sampling_options,
    compared_drafters,
    load_drafter,
)
from .questions import ask, load_questions, per_category_sample

BASELINES = ("generate", "stock", "prompt-lookup", "no-context", "chain")


def is_speculative(name: str) -> bool:
    """Whether a timed method decodes with a drafter, and so also reports tau and an identical count: no-context,
    chain, and each compared drafter (compare, compare2, ... in the order --compare-heads and --compare-draft name
    them; "-no-context" the same one without context drafts)."""
    return name in ("no-context", "chain") or name.startswith("compare")


def timed_generate(model, ids, max_new_tokens: int, sampling: Sampling, **extra):
    """Plain `generate`, timed; returns the new tokens and seconds. Every generation setting goes into the
    config it is given (transformers warns on settings passed beside one); what is not a setting
    (an assistant model) is passed on."""
    settings = dict(do_sample=False) if sampling.greedy else dict(  # top_k 0 is off (None would take the model's)
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    config = generation_config_as_applied(model)
    passed_on = config.update(max_new_tokens=max_new_tokens, **settings, **extra)
    sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **passed_on)
    sync(model.device)
    return out[0, ids.shape[1]:].tolist(), time.perf_counter() - start


def timed_speculative(model, drafter, ids, max_new_tokens: int, sampling: Sampling, generator=None) -> GenerationResult:
    sync(model.device)
    start = time.perf_counter()
    result = speculative_generate(model, drafter, ids, max_new_tokens, sampling=sampling, generator=generator)
    sync(model.device)
    result.seconds = time.perf_counter() - start
    return result


def summarize(rows: list[dict], greedy: bool, extra: tuple[str, ...], stock: bool = False) -> dict:
    """Aggregate figures over question rows (each one question, all its turns).

    With `stock`, plain `generate` was also timed on torch's defaults (stock CPU kernels; on CUDA,
    its own choice of attention): `speedup_vs_stock` is gorgon against that (what a user gains end
    to end), `speedup` against `generate` on the kernels and attention gorgon runs on (what
    speculation alone gives). Each name in `extra` is another method timed
    in the same rotation; a speculative one (`is_speculative`) also has its tau and identical count.
    """
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    base_tokens = sum(r["baseline_tokens"] for r in rows)
    base_seconds = sum(r["baseline_seconds"] for r in rows)
    tps, base_tps = tokens / max(seconds, 1e-9), base_tokens / max(base_seconds, 1e-9)
    out = {
        "prompts": len(rows),
        "tau": tokens / max(1, sum(r["target_forwards"] for r in rows)),
        "tokens_per_s": tps,
        "baseline_tokens_per_s": base_tps,
        "speedup": tps / base_tps,
        "speedup_median": statistics.median(r["speedup"] for r in rows),
        "identical": sum(r["identical"] for r in rows) if greedy else None,
    }
    if stock:
        stock_tps = sum(r["stock_tokens"] for r in rows) / max(sum(r["stock_seconds"] for r in rows), 1e-9)
        out["stock_tokens_per_s"] = stock_tps
        out["speedup_vs_stock"] = tps / stock_tps
        out["identical_vs_stock"] = sum(r["identical_vs_stock"] for r in rows) if greedy else None
    for name in extra:
        t = sum(r[f"{name}_tokens"] for r in rows)
        s = sum(r[f"{name}_seconds"] for r in rows)
        out[f"{name}_tokens_per_s"] = t / max(s, 1e-9)
        out[f"{name}_speedup"] = (t / max(s, 1e-9)) / base_tps
        if is_speculative(name):
            out[f"{name}_tau"] = t / max(1, sum(r[f"{name}_target_forwards"] for r in rows))
            out[f"{name}_identical"] = sum(r[f"{name}_identical"] for r in rows) if greedy else None
    return out


def timed_methods(model, drafter, baselines: tuple[str, ...], assistant, sampling: Sampling, generator,
                  compare: list[dict] = (), chain=None) -> dict:
    """What is timed on each turn, by name: a function of (prompt ids, max new tokens) returning a
    GenerationResult. `baseline` is plain `generate`, `gorgon` the drafter under test, `compare` (and compare2,
    ...) the drafters of `options.compared_drafters`, `chain` `options.chain_drafter`'s; the rest are the baselines
    asked for. `generate` runs on
    the kernels and attention gorgon decodes with; `stock` on torch's defaults: its stock CPU kernels where the fast
    ones are on (and a quantized target's float weights), on CUDA its own choice of attention, cuDNN's included
    (`decoding_attention`); elsewhere it would equal `baseline` and is left out."""

    def plain(**extra):
        def run(ids, max_new_tokens):
            with decoding_attention(model.device):
                tokens, seconds = timed_generate(model, ids, max_new_tokens, sampling, **extra)
            return GenerationResult(tokens, target_forwards=0, seconds=seconds)
        return run

    def speculative(chosen):
        return lambda ids, max_new_tokens: timed_speculative(model, chosen, ids, max_new_tokens, sampling, generator)

    def on_stock_kernels(ids, max_new_tokens):
        with stock_kernels(model):
            tokens, seconds = timed_generate(model, ids, max_new_tokens, sampling)
        return GenerationResult(tokens, target_forwards=0, seconds=seconds)

    methods = {"baseline": plain(), "gorgon": speculative(drafter)}
    if "stock" in baselines and (kernels_in_use(model) == "fast" or model.device.type == "cuda"
                                 or quantization(model) != "none"):
        methods["stock"] = on_stock_kernels
    if "prompt-lookup" in baselines:
        methods["prompt-lookup"] = plain(prompt_lookup_num_tokens=10)
    if "no-context" in baselines:
        check_no_context(hasattr(drafter, "drafter"))  # a merged drafter's own (heads/drafter.py); `main` checked
        methods["no-context"] = speculative(drafter.drafter)
    if chain is not None:
        methods["chain"] = speculative(chain)
    for other in compare:
        methods[other["name"]] = speculative(other["drafter"])
        if "no-context" in baselines:
            methods[f"{other['name']}-no-context"] = speculative(other["drafter"].drafter)
        if other.get("chain") is not None:
            methods[f"{other['name']}-chain"] = speculative(other["chain"])
    if assistant is not None:
        methods["assistant"] = plain(assistant_model=assistant)
    return methods


def run_bench(target, drafter, questions: list[dict], max_new_tokens: int = 256, sampling: Sampling = Sampling(),
              baselines: tuple[str, ...] = ("generate", "stock"), assistant=None, seed: int = 0,
              progress: bool = True, compare: list[dict] = (), chain=None, checkpoint=None,
              earlier: dict | None = None) -> dict:
    """Run every question through plain `generate`, gorgon and the baselines asked for, interleaved (which
    goes first rotates from question to question, so drift hits all alike); returns the report.
    `checkpoint`, if given, gets the report of the questions done so far after each one, so that a run
    stopped early (a time limit, Ctrl-C) still leaves what it measured; `earlier`, such a report of the same
    settings, is gone on from: its questions are kept, not run again (each was timed against its baselines
    on its own, so they add up; context drafts start their record of what came true afresh)."""
    from tqdm.auto import tqdm

    model = target.model
    generator = torch.Generator(device=model.device).manual_seed(seed)
    methods = timed_methods(model, drafter, baselines, assistant, sampling, generator, compare, chain)
    stock = "stock" in methods
    extra = tuple(name for name in methods if name not in ("baseline", "gorgon", "stock"))

    busy_before = busy_cores()  # the minute before the timings
    warm = target.chat_ids([{"role": "user", "content": "Hello"}])  # load kernels and caches outside the timings
    for method in methods.values():
        method(warm, 8)

    context = context_length(model)
    rows, skipped, histogram = [], [], {}
    if earlier is not None:
        rows, skipped = list(earlier["questions"]), list(earlier["skipped"])
        histogram = {int(n): count for n, count in earlier["accepted_histogram"].items()}
    done = {r["question_id"] for r in rows + skipped}
    names = list(methods)
    bar = tqdm(total=len(questions), initial=len(done), desc="gorgon bench", unit="question", disable=not progress,
               dynamic_ncols=True)
    for qi, q in enumerate(questions):
        if q["question_id"] in done:
            continue
        row = empty_row(q, stock, extra)

        def run_turn(ids):
            """Every method on this turn, in this question's order; the baseline's reply continues it."""
            order = names[qi % len(names):] + names[:qi % len(names)]  # each goes first in turn
            runs = {name: methods[name](ids, max_new_tokens) for name in order}
            add_turn(row, histogram, runs, stock, extra)
            return runs["baseline"].tokens

        start = cpu_reading()
        if ask(target, q, max_new_tokens, run_turn):
            row["busy_cores"] = busy_cores(start)
            base_rate = row["baseline_tokens"] / max(row["baseline_seconds"], 1e-9)
            row["speedup"] = (row["tokens"] / max(row["seconds"], 1e-9)) / max(base_rate, 1e-9)
            rows.append(row)
        else:  # not even the first turn fit: nothing is counted
            first = target.chat_ids([{"role": "user", "content": q["turns"][0]}]).shape[1]
            skipped.append({"question_id": q["question_id"], "category": q["category"],
                            "reason": f"the first turn ({first} tokens) plus --max-new-tokens {max_new_tokens} "
                                      f"exceeds the context of {context}"})
        bar.update(1)
        if checkpoint is not None and len(rows) + len(skipped) < len(questions) and rows:
            checkpoint(bench_report(rows, skipped, histogram, sampling.greedy, extra, stock, busy_before))
    bar.close()

    if not rows:
        raise GorgonError(f"no question fits the context of {context} tokens with --max-new-tokens {max_new_tokens}: "
                          "lower --max-new-tokens or use shorter questions")
    return bench_report(rows, skipped, histogram, sampling.greedy, extra, stock, busy_before)


def empty_row(q: dict, stock: bool, extra: tuple[str, ...]) -> dict:
    """A question's row of the report before its turns: gorgon's counts (tokens, seconds, target_forwards,
    identical), the baseline's, and each other method's under its name."""
    row = {"question_id": q["question_id"], "category": q["category"], "tokens": 0, "seconds": 0.0,
           "target_forwards": 0, "baseline_tokens": 0, "baseline_seconds": 0.0, "identical": True}
    if stock:
        row.update({"stock_tokens": 0, "stock_seconds": 0.0, "identical_vs_stock": True})
    for name in extra:
        row.update({f"{name}_tokens": 0, f"{name}_seconds": 0.0})
        if is_speculative(name):
            row.update({f"{name}_target_forwards": 0, f"{name}_identical": True})
    return row


def add_turn(row: dict, histogram: dict, runs: dict, stock: bool, extra: tuple[str, ...]) -> None:
    """Add one turn's runs (method name -> its result) to the question's row, and gorgon's accepted lengths to
    the histogram. Outputs are compared with the baseline's (stock `generate`'s too, where it ran)."""
    base, spec = runs["baseline"], runs["gorgon"]
    row["baseline_tokens"] += len(base.tokens)
    row["baseline_seconds"] += base.seconds
    row["tokens"] += len(spec.tokens)
    row["seconds"] += spec.seconds
    row["target_forwards"] += spec.target_forwards
    row["identical"] &= spec.tokens == base.tokens
    if stock:
        row["stock_tokens"] += len(runs["stock"].tokens)
        row["stock_seconds"] += runs["stock"].seconds
        row["identical_vs_stock"] &= spec.tokens == runs["stock"].tokens
    for n in spec.accepted[1:]:  # the prefill's single token is not a verify step
        histogram[n] = histogram.get(n, 0) + 1
    for name in extra:
        row[f"{name}_tokens"] += len(runs[name].tokens)
        row[f"{name}_seconds"] += runs[name].seconds
        if is_speculative(name):
            row[f"{name}_target_forwards"] += runs[name].target_forwards
            row[f"{name}_identical"] &= runs[name].tokens == base.tokens


def bench_report(rows: list[dict], skipped: list[dict], histogram: dict, greedy: bool, extra: tuple[str, ...],
                 stock: bool, busy_before: float) -> dict:
    """The report of the questions run: the figures over all of them and per category, the accepted-length
    histogram, the rows and the questions skipped, the cores other work kept busy (`busy_before` the timings,
    while timing: the mean over the questions) and whether the figures can be trusted."""
    report = summarize(rows, greedy, extra, stock)
    report["per_category"] = {c: summarize([r for r in rows if r["category"] == c], greedy, extra, stock)
                              for c in sorted({r["category"] for r in rows})}
    report["accepted_histogram"] = {str(k): histogram[k] for k in sorted(histogram)}
    report["questions"] = rows
    report["skipped"] = skipped
    timed = [r["busy_cores"] for r in rows if "busy_cores" in r]  # rows of an earlier gorgon's report have none
    report["busy_cores"] = {"before": busy_before, "while_timing": statistics.mean(timed) if timed else None,
                            "cores": os.cpu_count()}
    report["trust"] = trust(report)
    return report


# What the figures of a report can be trusted to show. A speculative step (the draft, one target forward over the
# tree, the acceptance) costs at least a plain step, so a speedup is at most tau x (plain step time / speculative
# step time) <= tau. It may come out above: oneDNN multiplies in blocks of rows (3 to 6 tokens cost 0.93x one:
# calibrate.py), greedy verification reads the output layer in bfloat16 (an eighth of a step) where `generate` reads
# it in float32, and `generate` does work of its own each step (on the embedded target, MT-Bench's first coding
# question took 0.8 plain steps a speculative step, in two runs; an 80-question run in the README 0.96: Medusa heads
# alone, 1.37x at tau 1.32); a category of one question is timed once. A speedup more than this share above tau
# is flagged:
SPEEDUP_TOLERANCE = 0.5
# How far the questions' step costs may spread beyond what the run's own noise explains (`spread_beyond_noise`):
# a tree sized per step differs between questions by itself. With context drafts alone on the embedded target, the
# first question of each MT-Bench category spread 2.1x in each of three runs, busy or not (0.8 to 1.9 plain steps a
# step: the trees grow where the text repeats).
SPREAD_ALLOWANCE = 3.0
# Questions needed to tell a spread (with fewer, the extremes are all there is).
SPREAD_QUESTIONS = 3


def speedup_bound(tau: float) -> float:
    """The most speedup over plain `generate` (same kernels) that `tau` tokens per target forward allow, tolerance
    included."""
    return tau * (1 + SPEEDUP_TOLERANCE)


def spread(values: list[float]) -> float:
    """How many times the largest of some positive values is the smallest."""
    return max(values) / min(values)


def spread_beyond_noise(rows: list[dict]) -> str | None:
    """Why the questions' step costs spread further than the run's own noise explains; None if they do not.

    A question's step cost is gorgon's seconds per target forward over the baseline's seconds per token (its tau
    over its speedup): the part of its speed ratio that tau does not explain. The noise is the spread of the
    baseline's seconds per token over the questions: the same plain step, timed again in every question's
    rotation. A step cost divides one timing by another, so noise alone spreads it up to the noise squared;
    SPREAD_ALLOWANCE times that is allowed."""
    if len(rows) < SPREAD_QUESTIONS:
        return None
    plain = [r["baseline_seconds"] / max(r["baseline_tokens"], 1) for r in rows]
    costs = [r["seconds"] / max(r["target_forwards"], 1) / max(p, 1e-9) for r, p in zip(rows, plain, strict=True)]
    noise, allowed = spread(plain), SPREAD_ALLOWANCE * spread(plain) ** 2
    if spread(costs) <= allowed:
        return None
    return (f"the questions' step costs (tau over speedup) spread {spread(costs):.1f}x, beyond the {allowed:.1f}x "
            f"that the baseline's own spread ({noise:.2f}x over the questions) allows")


def claimed_speedups(report: dict) -> list[tuple[str, float, float]]:
    """Each speedup over plain `generate` that a report's table claims beside a tau, as (row, tau, speedup):
    gorgon's and each other speculative method's, in every category and over all."""
    claims = []
    for category, r in [*report["per_category"].items(), ("all", report)]:
        claims.append((category, r["tau"], r["speedup"]))
        claims += [(f"{category} ({m})", r[f"{m}_tau"], r[f"{m}_speedup"]) for m in extra_names(report)
                   if f"{m}_tau" in r]
    return claims


def trust(report: dict) -> dict:
    """Whether a report's figures can be trusted, and if not why: other work busy while timing (`busy_cores`
    above calibrate's BUSY_LIMIT), a speedup above its bound (each row of the table, gorgon's and each other
    speculative method's), the questions' step costs spread beyond the run's noise."""
    reasons = []
    busy = report["busy_cores"]["while_timing"]
    if busy is not None and busy > BUSY_LIMIT:
        reasons.append(f"other work kept about {busy:.1f} of {report['busy_cores']['cores']} cores busy while timing")
    reasons += [f"{label}: speedup {speedup:.2f}x at tau {tau:.2f}, above the {speedup_bound(tau):.2f}x that tau allows"
                for label, tau, speedup in claimed_speedups(report) if speedup > speedup_bound(tau)]
    spread_reason = spread_beyond_noise(report["questions"])
    if spread_reason:
        reasons.append(spread_reason)
    return {"ok": not reasons, "reasons": reasons}


def distrust(report: dict) -> str | None:
    """Why a report's figures cannot be trusted, in one line (its first reason, and how many more); None where
    they can, or where the report is an earlier gorgon's, which was not checked."""
    reasons = report.get("trust", {}).get("reasons")
    if not reasons:
        return None
    return reasons[0] + (f" (and {len(reasons) - 1} more reasons)" if len(reasons) > 1 else "")


def environment(model, drafter, sampling: Sampling, max_new_tokens: int) -> dict:
    import platform

    import transformers

    return {**machine_setup(model), **drafter_settings(drafter), "tree_size": drafter.max_nodes,
            "max_new_tokens": max_new_tokens, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                                  "python": platform.python_version()}}


def drafter_settings(drafter) -> dict:
    """What the report records of the drafter (`settings()`, the drafter interface's): its tree, the dtype of its
    weights, its context-draft settings; a drafter of the user's without `settings` records none."""
    return {"tree": None, "draft_dtype": None, "context_draft": None, **getattr(drafter, "settings", dict)()}


def extra_names(report: dict) -> list[str]:
    """The baselines besides plain `generate` (and stock kernels) that a report timed."""
    return [key[: -len("_speedup")] for key in report if key.endswith("_speedup")]


def baseline_label(report: dict, name: str) -> str:
    """A baseline's name, with the heads or draft model it drafted with where it is a compared drafter."""
    for other in report.get("compare", []):
        if name in (other["name"], f"{other['name']}-no-context", f"{other['name']}-chain"):
            return f"{name} ({Path(other.get('heads') or other['draft']).name})"
    return name


def markdown_table(report: dict) -> str:
    stock = "speedup_vs_stock" in report
    extra = extra_names(report)
    head = "| category | prompts | tau | tokens/s | baseline tokens/s | speedup | median speedup | identical |"
    if stock:
        head += " stock tokens/s | speedup vs stock | identical vs stock |"
    head += "".join(f" {name} speedup |" + (f" {name} tau |" if f"{name}_tau" in report else "") for name in extra)
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    rows = list(report["per_category"].items()) + [("**all**", report)]
    for name, r in rows:
        ident = "-" if r["identical"] is None else f"{r['identical']}/{r['prompts']}"
        line = (f"| {name} | {r['prompts']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
                f"{r['baseline_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_median']:.2f}x | {ident} |")
        if stock:
            ident = "-" if r["identical_vs_stock"] is None else f"{r['identical_vs_stock']}/{r['prompts']}"
            line += f" {r['stock_tokens_per_s']:.1f} | {r['speedup_vs_stock']:.2f}x | {ident} |"
        for other in extra:
            line += f" {r[f'{other}_speedup']:.2f}x |" + (f" {r[f'{other}_tau']:.2f} |" if f"{other}_tau" in r else "")
        lines.append(line)
    for other in report.get("compare", []):
        kind = "heads" if "heads" in other else "draft"
        lines.append(f"\n{other['name']}: the {'heads in' if kind == 'heads' else 'draft model'} {other[kind]}")
    for q in report["skipped"]:
        lines.append(f"\nskipped question {q['question_id']} ({q['category']}): {q['reason']}")
    if distrust(report):
        lines.append("\n**These figures are not to be trusted** (rerun on a quiet machine):")
        lines += [f"- {reason}" for reason in report["trust"]["reasons"]]
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> None:
    """Accepted tokens per verify step (histogram) and speedup per category, gorgon beside each baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [("gorgon", "speedup", "#08519c")]
    if "speedup_vs_stock" in report:
        bars.append(("gorgon vs stock kernels", "speedup_vs_stock", "#6baed6"))
    colors = ("#fd8d3c", "#74c476", "#9e9ac8", "#e377c2", "#8c8c8c")
    bars += [(baseline_label(report, name), f"{name}_speedup", color)
             for name, color in zip(extra_names(report), colors, strict=False)]
    legend = len(bars) > 1  # below the axes, where it hides no bar: the figure grows to hold it
    why = distrust(report)  # said above the axes, in red: the figure grows to hold it too
    note = textwrap.wrap(f"NOT TO BE TRUSTED: {why}; rerun on a quiet machine", 120) if why else []
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4 + 0.5 * legend + 0.2 * len(note)), dpi=120)
    if note:
        fig.suptitle("\n".join(note), color="#b2182b", fontsize=9, fontweight="bold")
    hist = report["accepted_histogram"]
    left.bar([int(k) for k in hist], list(hist.values()), color="#3182bd")
    left.set_xticks([int(k) for k in hist])
    left.set_xlabel("tokens per target forward (bonus included)")
    left.set_ylabel("verify steps")
    left.set_title(f"accepted length (tau {report['tau']:.2f})")
    cats = list(report["per_category"])
    height = 0.8 / len(bars)
    for i, (label, key, color) in enumerate(bars):
        offset = (len(bars) - 1) / 2 * height - i * height  # the first bar on top
        drawn = right.barh([c + offset for c in range(len(cats))], [report["per_category"][c][key] for c in cats],
                           height=height, color=color, label=label)
        right.bar_label(drawn, fmt="%.2fx", fontsize=6, padding=2)  # 1.05x and 1.04x look alike as bars
    right.set_yticks(list(range(len(cats))), cats)
    right.margins(x=0.12)  # room for the labels
    right.axvline(1.0, color="black", lw=0.8)
    right.set_xlabel("speedup over plain generate")
    right.set_title(f"speedup ({report['speedup']:.2f}x overall)")
    if legend:
        right.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=min(3, len(bars)),
                     frameon=False)
    save_figure(fig, path)


def read_report(path: Path) -> dict | None:
    """The report `gorgon bench` wrote at `path`; None for anything else."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return report if isinstance(report, dict) and str(report.get("command", "")).startswith("gorgon bench") else None


def is_report(path: Path) -> bool:
    """A report `gorgon bench` wrote (the only file --out may replace, with --overwrite)."""
    return read_report(path) is not None


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="gorgon bench",
        description="Measure gorgon against plain `generate` on MT-Bench-style questions, interleaved in one "
                    "process: tau (tokens per target forward), tokens/s, speedup, and (greedy) how many outputs are "
                    "identical to the baseline's.")
    add_model_arguments(p)
    p.add_argument("--questions", type=user_path, required=True,
                   help="MT-Bench/Spec-Bench .jsonl, e.g. scripts/data/mt_bench.jsonl")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="first N questions only (default: all)")
    p.add_argument("--per-category", type=int_at_least(1), default=None,
                   help="the first N questions of each category only, as scripts/tau.py takes them (default: all)")
    p.add_argument("--baselines", default="generate,stock",
                   help="comma-separated, timed in the same rotation as gorgon: generate (plain `generate`, always "
                        "run), stock (plain `generate` on torch's defaults: its stock CPU kernels when gorgon runs on "
                        "the fast ones; on CUDA, SDPA free to pick cuDNN's attention, which gorgon avoids), "
                        "prompt-lookup (transformers' prompt lookup), no-context (with --context-draft: the "
                        "--heads or --draft drafter alone), chain (the --heads or --draft drafter alone drafting "
                        "one chain, its top candidate per level for --draft-depth or its own depth: the shape vLLM "
                        "verifies; each --compare-heads drafter's chain too, as compare-chain, ...). "
                        "Default: generate,stock")
    p.add_argument("--assistant", type=user_path, default=None,
                   help="also time transformers' assisted generation with this draft model")
    p.add_argument("--compare-heads", type=user_path, nargs="+", default=[], metavar="FOLDER",
                   help="other heads for the same target (any method's: Medusa-1, EAGLE, parallel, "
                        "self-speculation), timed in the same rotation and drafted as --heads are (the same --tree "
                        "and --context-draft options): reported as compare, compare2, ... in the order given (and "
                        "compare-no-context, ... with --baselines no-context)")
    p.add_argument("--compare-draft", type=user_path, nargs="+", default=[], metavar="MODEL",
                   help="draft models for the same target, timed like --compare-heads (after them, in the order "
                        "given), each drafting its default chain of 3 tokens")
    p.add_argument("--out", type=user_path, default=None,
                   help="write the JSON report here (and a PNG beside it). After each question it holds the questions "
                        "run so far, marked \"complete\": false, so a run stopped early keeps what it measured; the "
                        "same command then goes on from them")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier report at --out")
    p.add_argument("--update-card", action="store_true",
                   help="write the figures into the model card (README.md) of the --heads or --draft folder")
    p.add_argument("--batch-sizes", type=batch_sizes_option, default=None,
                   help="instead, decode the questions' first turns in batches of each size (1,4,16: distinct "
                        "questions together, as a server batches requests), gorgon's batched decoder against plain "
                        "batched `generate`: throughput, speedup, the tree width chosen and identical rows per batch "
                        "size, a plot, and the draft length per batch size an engine takes (greedy)")
    return p


def check_no_context(merged: bool) -> None:
    """The no-context baseline is the merged drafter's own drafter alone."""
    if not merged:
        raise GorgonError("--baselines no-context times the --heads or --draft drafter without the context "
                          "draft: it needs --context-draft together with --heads or --draft")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise GorgonError(f"unknown baseline {unknown[0]!r}: use {', '.join(BASELINES)}")
    if args.batch_sizes:
        check_batch_options(args, baselines)
    if "no-context" in baselines:  # before the target loads
        check_no_context(args.context_draft and bool(args.heads or args.draft))
    if "chain" in baselines and not (args.heads or args.draft):
        raise GorgonError("--baselines chain drafts the --heads or --draft drafter as one chain: pass one of them")
    if args.assistant:
        check_model_source(args.assistant, "assistant model")
    if args.update_card and not (args.heads or args.draft):
        raise GorgonError("--update-card writes into a --heads or --draft folder's card: pass one")
    if args.update_card:
        check_card_folder(Path(args.heads or args.draft))
    for flag, given in (("--compare-heads", args.compare_heads), ("--compare-draft", args.compare_draft)):
        if given and not (args.heads or args.draft):
            raise GorgonError(f"{flag} times other drafters beside the --heads or --draft under test: pass one too")
    for draft in args.compare_draft:
        check_model_source(draft, "draft model")
    earlier = None if args.overwrite or not args.out else unfinished_report(Path(args.out))
    if args.out:  # going on from a stopped report rewrites it, and writes its plot: checked as --overwrite's are
        check_report_output(args.out, is_report, args.overwrite or earlier is not None)
    questions = per_category_sample(load_questions(args.questions, args.limit), args.per_category)
    check_sampling_options(args)  # its range check, before the target loads
    settings = DecodeSettings.from_args(args)
    out = Path(args.out) if args.out else None  # locked: two benches wrote it in turn, and one's figures were lost
    with holding(out.parent / f".{out.name}.lock", "gorgon bench", out) if out else contextlib.nullcontext():
        if args.batch_sizes:
            return batch_bench_command(args, settings, argv, questions, earlier)
        return bench_command(args, settings, argv, baselines, questions, earlier)


def check_batch_options(args, baselines: tuple[str, ...]) -> None:
    """What --batch-sizes measures: gorgon's batched decoder against batched `generate`, greedily."""
    if args.temperature:
        raise GorgonError("--batch-sizes benches greedy decoding (it counts rows identical to `generate`'s): drop "
                          "--temperature")
    others = [b for b in baselines if b not in ("generate", "stock")]
    given = [name for name, value in (("--assistant", args.assistant), ("--compare-heads", args.compare_heads),
                                      ("--compare-draft", args.compare_draft),
                                      ("--baselines " + ",".join(others), others)) if value]
    if given:
        raise GorgonError(f"--batch-sizes times gorgon against batched `generate` only: drop {given[0]}")


def batch_bench_command(args, settings: DecodeSettings, argv, questions: list, earlier: dict | None) -> int:
    """`gorgon bench --batch-sizes` once its options are checked: load, time each batch size, report."""
    target, drafter = load_drafter(settings)
    about = environment(target.model, drafter, Sampling(), args.max_new_tokens)
    about.update({"target": target.name, "drafter": settings.name, "questions_file": args.questions,
                  "batch_sizes": args.batch_sizes, "questions_planned": len(questions),
                  "command": "gorgon bench " + " ".join(sys.argv[2:] if argv is None else argv)})
    if earlier is not None:
        check_same_bench({k: v for k, v in earlier.items() if k not in ("batches", "schedule", "trust")}, about,
                         args.out)

    def record(entries: list[dict], complete: bool) -> dict:
        report = {**about, **batch_report(entries), "complete": complete}
        if args.out:
            write_batch_report(Path(args.out), report)
        return report

    entries = run_batch_bench(target, drafter, questions, args.batch_sizes, args.max_new_tokens,
                              checkpoint=lambda entries: record(entries, False),
                              earlier=earlier["batches"] if earlier else None)
    report = record(entries, True)
    print(batch_table(report))
    quantized = "" if report.get("quantize", "none") == "none" else f", weights {report['quantize']}"
    print(f"\n{report['device']}, {report['dtype']}{quantized}, {report['threads']} thread(s); the questions' first "
          f"turns, {args.max_new_tokens} new tokens; width: nodes per row a step (root included)")
    if args.out:
        plot_batches(report, Path(args.out).with_suffix(".png"))
        print(f"report: {args.out} (plot: {Path(args.out).with_suffix('.png')})")
    if args.update_card:
        if not report["trust"]["ok"]:
            raise GorgonError(f"these figures are not to be trusted, so the model card is left as it was: "
                              f"{report['trust']['reasons'][0]}; rerun on a quiet machine")
        folder = Path(args.heads or args.draft)
        refresh_model_card(folder, report, "batch_bench")
        print(f"model card updated: {folder / 'README.md'}")
    return 0


def bench_command(args, settings: DecodeSettings, argv, baselines: tuple[str, ...], questions: list,
                  earlier: dict | None) -> int:
    """`gorgon bench` once its options are checked: load, time, report."""
    target, drafter = load_drafter(settings, keep_float="stock" in baselines)
    sampling = Sampling.like_generate(target.model, args.temperature, args.top_k, args.top_p)
    compare = compared_drafters(settings, args.compare_heads, args.compare_draft, target, drafter,
                                chains="chain" in baselines)
    chain = chain_drafter(settings, target) if "chain" in baselines else None
    assistant = None
    if args.assistant:
        assistant, _ = load_causal_lm(args.assistant, "assistant model", dtype=target.model.dtype, tokenizer="none")
        assistant.to(target.model.device)
    seed = 0 if args.seed is None else args.seed  # reproducible unless asked otherwise
    about = environment(target.model, drafter, sampling, args.max_new_tokens)
    if chain is not None:
        about["chain"] = drafter_settings(chain)["tree"]
    if compare:
        about["compare"] = [{key: value for key, value in other.items() if key not in ("drafter", "chain")}
                            | {"tree": drafter_settings(other["drafter"])["tree"],
                               "tree_size": other["drafter"].max_nodes}
                            | ({"chain": drafter_settings(other["chain"])["tree"]} if "chain" in other else {})
                            for other in compare]
    about.update({"target": target.name, "drafter": settings.name, "questions_file": args.questions,
                  "baselines": list(baselines), "questions_planned": len(questions),
                  "command": "gorgon bench " + " ".join(sys.argv[2:] if argv is None else argv)})
    if earlier is not None:
        check_same_bench(earlier, about, args.out)
        print(f"gorgon bench: going on from the {len(earlier['questions']) + len(earlier['skipped'])} questions "
              f"in {args.out} (--overwrite starts over)", file=sys.stderr)

    written = False  # whether this run has written --out (a stopped run's hint is of its own report only)

    def record(report: dict, complete: bool) -> None:
        """Add what describes the run; with --out, write the report (after every question: until the last
        it is marked incomplete)."""
        nonlocal written
        report.update(about, complete=complete)
        if args.out:
            atomic_write_text(Path(args.out), json.dumps(report, indent=1) + "\n")
            written = True

    if not args.out:
        print("gorgon bench: no --out, so the report is printed at the end only (--out FILE keeps it, question by "
              "question)", file=sys.stderr)
    try:
        report = run_bench(target, drafter, questions, args.max_new_tokens, sampling, baselines, assistant, seed,
                           compare=compare, chain=chain, earlier=earlier,
                           checkpoint=(lambda partial: record(partial, False)) if args.out else None)
    except KeyboardInterrupt:
        kept = unfinished_report(Path(args.out)) if args.out and (written or earlier) else None
        if kept is not None:
            print(f"\ngorgon bench: {args.out} keeps the {len(kept['questions']) + len(kept['skipped'])} questions "
                  f"finished so far: rerun the same command{' without --overwrite' if args.overwrite else ''} to go "
                  "on from them", file=sys.stderr)
        raise
    record(report, True)
    print(markdown_table(report))
    print("\ntau: tokens per target forward; speedup: gorgon's tokens/s over plain `generate`'s (the baseline, on "
          "the same kernels), each question timed for both in one rotation; median: of the per-question ratios"
          + ("; vs stock: over `generate` on torch's default kernels" if "speedup_vs_stock" in report else "")
          + (" and the float weights" if "speedup_vs_stock" in report and report.get("quantize", "none") != "none"
             else ""))
    drafts = f"drafts in {report['draft_dtype']}" if report["draft_dtype"] else "drafts from the context"
    quantized = "" if report.get("quantize", "none") == "none" else f", weights {report['quantize']}"
    print(f"{report['device']}, {report['dtype']}{quantized} ({drafts}), "
          f"{report['threads']} thread(s), "
          + (f"tree of {report['tree_size']} nodes" if isinstance(report["tree"], list)
             else f"tree built per step, up to {report['tree_size']} nodes"))
    if args.out:
        out = Path(args.out)
        try:
            plot_report(report, out.with_suffix(".png"))
        except OSError as err:  # the report is whole: said, or a rerun would time every question again
            line = user_error_line(err)
            if line is None:
                raise
            raise GorgonError(f"{out} is written, but not its plot: {line}") from err
        print(f"report: {out} (plot: {out.with_suffix('.png')})")
    if args.update_card:
        if distrust(report):
            raise GorgonError(f"these figures are not to be trusted, so the model card is left as it was: "
                              f"{distrust(report)}; rerun on a quiet machine")
        folder = Path(args.heads or args.draft)  # a local training folder: its card is rewritten in place
        refresh_model_card(folder, report)
        print(f"model card updated: {folder / 'README.md'}")
    return 0


def unfinished_report(out: Path) -> dict | None:
    """The report at `out` of a bench stopped before its last question or batch size ("complete": false), if it is
    one."""
    report = read_report(out)
    unfinished = report is not None and report.get("complete") is False
    return report if unfinished and ("questions" in report or "batches" in report) else None


# What may differ between a stopped bench and the run that goes on from it: how each was started.
MAY_DIFFER = ("command", "complete")


def check_same_bench(earlier: dict, about: dict, out) -> None:
    """Refuse to go on from a report measured otherwise (another drafter, tree, machine or version): its
    questions' figures would not add up with these."""
    about = json.loads(json.dumps(about))  # as the report holds it: lists, not tuples
    changed = changed_settings(earlier, about, MAY_DIFFER, absent_is_none=True)
    if changed:
        raise GorgonError(f"{out} holds an unfinished bench with other settings ({', '.join(changed)}): rerun with "
                          "the same ones to go on from it (--tree N fixes a tree that --tree auto sized otherwise), "
                          "or pass --overwrite to start over")
