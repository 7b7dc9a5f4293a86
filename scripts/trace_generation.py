r"""Where real generations spend their time, by step part and by operator: torch.profiler over gorgon's
decoder and plain `generate` on the first turns of a question file.

    OMP_NUM_THREADS=1 python scripts/trace_generation.py --heads runs/heads/smollm2-135m-eagle-12ep \
        --context-draft --questions scripts/data/mt_bench.jsonl --limit 2 --max-new-tokens 64
    python scripts/trace_generation.py --heads ... --device cuda --dtype bfloat16 --trace runs/trace.json

`scripts/profile_step.py` times one step's parts on a random prompt, where an EAGLE head is
unsure and drafts a small tree; this traces whole generations on real questions. It prints the
milliseconds per token of each without the profiler, then the host time of each part of gorgon's
steps (drafter, verify forward, acceptance, cache compaction) per step, the operators each part
dispatches per step (views left out: on a GPU each of the others launches a kernel, so where a small
target leaves the host the bottleneck this counts its work on any machine) against `generate`'s per
token, then the top operators by host time and, on a GPU, by device time. `--trace FILE` writes the
Chrome trace of gorgon's generations (open it in Perfetto or chrome://tracing).
"""

import argparse
import collections
import contextlib
import functools
import os
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

import gorgon.decode.generate as generate_module
from gorgon.decode.acceptance import Sampling
from gorgon.decode.attention import decoding_attention
from gorgon.decode.bench import timed_generate, timed_speculative
from gorgon.decode.options import DecodeSettings, add_model_arguments, load_drafter
from gorgon.decode.questions import load_questions
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.errors import GorgonError
from gorgon.heads.files import atomic_write
from gorgon.heads.outputs import check_writable

# The decoder's step parts, as speculative_generate calls them: each is labelled in the trace.
PARTS = {"verify forward": "verify", "greedy acceptance": "accept_greedy", "sampled acceptance": "accept_sampled",
         "cache compaction": "keep_path", "tree cut": "cut_tree"}


class OperatorCount(TorchDispatchMode):
    """Operators dispatched while active, by the step part running (views, which launch nothing, left out)."""

    def __init__(self):
        super().__init__()
        self.part, self.counts = "rest of the step", collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[self.part] += 1
        return func(*args, **(kwargs or {}))


def host_ms_per_step(events, steps: int) -> dict[str, float]:
    """Host milliseconds per verify step of each labelled part. On CUDA the profiler reports a label twice,
    as its CPU range and as a GPU annotation of the same name with no CPU time: only the first counts."""
    return {e.key: e.cpu_time_total / 1000 / max(steps, 1) for e in events
            if e.key in [*PARTS, "drafter propose"] and e.device_type == DeviceType.CPU}


@contextlib.contextmanager
def labelled_parts(drafter, count: OperatorCount):
    """Label each step part (and the drafter's proposal) in the profiler's record while the block runs,
    and tell `count` which part is running (an inactive count keeps the names unused)."""
    def labelled(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            outer, count.part = count.part, name
            try:
                with record_function(name):
                    return fn(*args, **kwargs)
            finally:
                count.part = outer
        return run

    saved = {attr: getattr(generate_module, attr) for attr in PARTS.values()}
    propose = drafter.propose
    try:
        for name, attr in PARTS.items():
            setattr(generate_module, attr, labelled(name, saved[attr]))
        drafter.propose = labelled("drafter propose", propose)
        yield
    finally:
        for attr, fn in saved.items():
            setattr(generate_module, attr, fn)
        del drafter.propose  # the instance attribute goes; the class's method is back


def main():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--questions", required=True, help="MT-Bench/Spec-Bench .jsonl, e.g. scripts/data/mt_bench.jsonl")
    p.add_argument("--limit", type=int_at_least(1), default=2, help="first N questions, first turns (default 2)")
    p.add_argument("--rows", type=int_at_least(1), default=15, help="operators listed per table (default 15)")
    p.add_argument("--trace", default=None,
                   help="also write the Chrome trace of gorgon's generations to this new file (an existing one is "
                        "never written over)")
    args = p.parse_args()
    if not (args.heads or args.draft or args.context_draft):
        p.error("one of --heads, --draft or --context-draft is required")
    if args.trace:
        if os.path.lexists(args.trace):
            raise GorgonError(f"--trace {args.trace} already exists: choose a new file")
        check_writable(Path(args.trace).parent, "choose a writable --trace")
    target, drafter = load_drafter(DecodeSettings.from_args(args))
    model, sampling = target.model, Sampling.like_generate(target.model, args.temperature, args.top_k, args.top_p)
    prompts = [target.chat_ids([{"role": "user", "content": q["turns"][0]}])
               for q in load_questions(args.questions, args.limit)]
    gen = torch.Generator(device=model.device).manual_seed(args.seed or 0)

    def gorgon(ids):
        result = timed_speculative(model, drafter, ids, args.max_new_tokens, sampling, gen)
        return len(result.tokens), result.seconds, result.target_forwards

    def plain(ids):  # on the attention gorgon decodes with, as `gorgon bench` times it
        with decoding_attention(model.device):
            tokens, seconds = timed_generate(model, ids, args.max_new_tokens, sampling)
        return len(tokens), seconds, len(tokens)

    methods = {"gorgon": gorgon, "generate": plain}  # each returns tokens, seconds and target forwards
    for run in methods.values():  # load kernels and caches outside the figures
        run(prompts[0][:, :16])
    on_gpu = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    def run_all(run):  # tokens, seconds and target forwards over every prompt
        return [sum(column) for column in zip(*(run(ids) for ids in prompts))]

    for name, run in methods.items():
        def parts(count):  # gorgon's step parts labelled (plain `generate` has none)
            return labelled_parts(drafter, count) if name == "gorgon" else contextlib.nullcontext()

        tokens, seconds, forwards = run_all(run)
        steps = forwards - len(prompts)  # the verify steps: every forward but each prompt's prefill
        count = OperatorCount()
        with parts(count), count:  # a pass of its own: dispatch counting would slow the profiled one
            counted_tokens, _, counted_forwards = run_all(run)
        with parts(OperatorCount()), profile(activities=activities) as prof:
            run_all(run)
        print(f"\n== {name}: {1000 * seconds / tokens:.2f} ms per token without the profiler"
              + (f", {tokens / forwards:.2f} tokens per target forward" if name == "gorgon" else ""))
        events = prof.key_averages()
        per_step, per_token = max(counted_forwards - len(prompts), 1), sum(count.counts.values()) / counted_tokens
        if name == "gorgon":
            print("host time per verify step: " + ", ".join(
                f"{part} {ms:.2f} ms" for part, ms in host_ms_per_step(events, steps).items()))
            print("operators per verify step (views left out; the prefills' in the rest): " + ", ".join(
                f"{part} {n / per_step:.0f}" for part, n in count.counts.most_common())
                + f"; {per_token:.0f} per token")
        else:
            print(f"operators per token (views left out; the prefill's included): {per_token:.0f}")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if on_gpu:
            print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
        if name == "gorgon" and args.trace:
            atomic_write(Path(args.trace), prof.export_chrome_trace)
            print(f"trace: {args.trace}")


if __name__ == "__main__":
    run_script(main, "scripts/trace_generation.py")
