"""gorgon's decoder at a git revision against the working tree's, interleaved in one process.

    OMP_NUM_THREADS=1 python scripts/revision_ab.py --against HEAD~1 --heads runs/heads/eagle-drop01-12ep \\
        --questions scripts/data/mt_bench.jsonl --limit 8 --rounds 2 --max-new-tokens 64 [--tree 6]
    python scripts/revision_ab.py --against HEAD~1 --heads ... --device cuda --dtype bfloat16 ...
    OMP_NUM_THREADS=1 python scripts/revision_ab.py --against HEAD~1 --heads ... --context-draft --batch-size 4 \
        --questions scripts/data/mt_bench.jsonl --limit 40 --rounds 2 --max-new-tokens 64   # batches of 4

Speed work changes code, not settings, so `gorgon bench` (one code, several methods) cannot time it,
and two processes run at different times: a CPU's memory-bound speed drifts between them by more than
a small change gains. This copies the revision's heads/ and decode/ (or a folder's, on a machine
without the history) into a temporary package beside the working tree's, its `gorgon.` imports
renamed, loads a target and drafter with each from the same arguments, and generates the first turns
of the questions with each in turn, the order alternating by round: greedily, or sampled with
--temperature (each question and round seeded alike on both sides, from --seed: equal code gives equal
tokens). For each: milliseconds per token and per proposal (medians; a proposal's is host time until
the drafter returns: on CUDA, work it queued may run on), tokens per target forward, and operators per
proposal (torch's dispatches, views left out: on a GPU each launches a kernel; counted in one more
pass, untimed); and whether both gave the same tokens and proposed the same trees. `--batch-size B` decodes
groups of B questions greedily with `speculative_generate_batch` instead (each side's `Pace` carried from group
to group, as a serving loop does): milliseconds per token over the group, tau, and the share of rows drafting
a step. With the same code on both sides the one loaded second ran a few percent faster on a CPU: run both
`--load-first` orders and average. A
search's level stop (`--draft-level-cost auto`, the default) is timed by each side on its own, so
its levels, and the operators counted, can differ with the same code: pass a number to give both
the same (a revision older than the option ignores it).
"""

import argparse
import importlib
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gorgon.decode.bench_batch import left_padded
from gorgon.decode.options import add_model_arguments
from gorgon.decode.questions import load_questions
from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.errors import GorgonError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("heads", "decode")


def revision_package(revision: str, folder: Path) -> str:
    """Copy a revision's heads/ and decode/ into `folder` as a package of their own; returns its name.
    `revision`: a git revision of this repository, or a folder holding another copy's heads/ and decode/
    (where there is no git history, as on a machine the working tree was copied to)."""
    source = Path(revision)
    if source.is_dir():
        missing = [package for package in PACKAGES if not (source / package).is_dir()]
        if missing:
            raise GorgonError(f"--against {revision}: this folder has no {' or '.join(missing)}: pass a folder holding "
                              "another copy's heads/ and decode/, or a git revision")
        name = "gorgon_" + re.sub(r"\W", "_", source.resolve().name)
        for package in PACKAGES:
            shutil.copytree(source / package, folder / name / package, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        name = extract_revision(revision, folder)
    (folder / name / "__init__.py").write_text("")
    for path in (folder / name).rglob("*.py"):
        text = re.sub(r"\bgorgon\.(heads|decode)\b", rf"{name}.\1", path.read_text())
        # The attention functions it registers with transformers under names of its own: under one name the side
        # loaded second would run both sides' attention (a quantized target's reads its own module's state).
        path.write_text(re.sub(r"\"(gorgon_tree_sdpa|gorgon_rows)\"", rf'"\1_{name}"', text))
    return name


def extract_revision(revision: str, folder: Path) -> str:
    """Unpack heads/ and decode/ at a git revision into `folder` / gorgon_<commit>; returns that name."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{revision}^{{commit}}"],
                                capture_output=True, text=True, check=True).stdout.strip()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, *PACKAGES],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", None) or str(err)
        detail = detail.decode() if isinstance(detail, bytes) else detail
        raise GorgonError(f"--against {revision}: no such revision of this repository with heads/ and decode/ "
                          f"({detail.strip().splitlines()[-1] if detail.strip() else err}): pass a commit, tag or "
                          "branch, e.g. HEAD~1, or a folder holding another copy's heads/ and decode/") from err
    name = f"gorgon_{commit}"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder / name, filter="data")
    return name


class OperatorCount(TorchDispatchMode):
    """Operators dispatched while active (views, which launch nothing, left out)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


class Side:
    """One code's target, drafter and figures. `package`: "gorgon" or a revision's copy."""

    def __init__(self, label: str, package: str, args):
        options = importlib.import_module(f"{package}.decode.options")
        self.label = label
        self.generate = importlib.import_module(f"{package}.decode.generate").speculative_generate
        if args.batch_size > 1:  # a revision older than batches has no decode/batch.py, and one row needs none
            batch = importlib.import_module(f"{package}.decode.batch")
            self.generate_batch, self.pace = batch.speculative_generate_batch, batch.Pace(on=True)
        self.drafting = []  # rows drafting per step over rows in the batch (batches only)
        self.attention = importlib.import_module(f"{package}.decode.attention").decoding_attention
        if hasattr(options, "DecodeSettings"):
            self.target, self.drafter = options.load_drafter(options.DecodeSettings.from_args(args))
        else:  # a revision from before the decode settings were a dataclass
            self.target, self.drafter = options.load_drafter(args, options.read_tree(args.tree))
        sampling = importlib.import_module(f"{package}.decode.acceptance").Sampling
        self.sampling = sampling.like_generate(self.target.model, args.temperature, args.top_k, args.top_p) \
            if args.temperature else None
        self.propose_ms, self.token_ms, self.ops, self.trees = [], [], [], []
        self.forwards = self.generated = 0
        self.count_ops = False
        propose = self.drafter.propose

        def recorded(*a, **kw):
            start = time.perf_counter()
            if self.count_ops:
                with OperatorCount() as count:
                    tokens, tree = propose(*a, **kw)
                self.ops.append(count.count)
                return tokens, tree
            tokens, tree = propose(*a, **kw)
            self.propose_ms.append(1000 * (time.perf_counter() - start))
            self.trees.append((tokens.tolist(), tree.paths))
            return tokens, tree

        self.drafter.propose = recorded

    def run(self, ids: torch.Tensor, max_new_tokens: int, count: bool = False, seed: int = 0) -> list[int]:
        model = self.target.model
        self.count_ops = count
        sampled = {} if self.sampling is None else {
            "sampling": self.sampling, "generator": torch.Generator(device=model.device).manual_seed(seed)}
        with torch.inference_mode(), self.attention(model.device):
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            start = time.perf_counter()
            result = self.generate(model, self.drafter, ids.to(model.device), max_new_tokens=max_new_tokens,
                                   **sampled)
            seconds = time.perf_counter() - start
        self.count_ops = False
        if not count:
            self.token_ms.append(1000 * seconds / max(len(result.tokens), 1))
            self.forwards += result.target_forwards
            self.generated += len(result.tokens)
        return result.tokens

    def run_batch(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
        """One group's rows decoded together (greedy), its pace carried on."""
        model = self.target.model
        with torch.inference_mode():
            start = time.perf_counter()
            result = self.generate_batch(model, self.drafter, ids.to(model.device), mask.to(model.device),
                                         max_new_tokens=max_new_tokens, pace=self.pace)
            seconds = time.perf_counter() - start
        self.token_ms.append(1000 * seconds / max(result.tokens, 1))
        self.forwards += sum(row.target_forwards for row in result.rows)
        self.generated += result.tokens
        self.drafting.append(sum(result.drafting) / max(len(result.drafting), 1) / len(result.rows))
        return [row.tokens for row in result.rows]

    def figures(self) -> dict:
        if self.drafting:
            return {"ms_per_token": round(statistics.median(self.token_ms), 3),
                    "tau": round(self.generated / max(self.forwards, 1), 3),
                    "rows_drafting": round(statistics.mean(self.drafting), 3), "groups": len(self.token_ms)}
        return {"ms_per_token": round(statistics.median(self.token_ms), 3),
                "ms_per_proposal": round(statistics.median(self.propose_ms), 3),
                "operators_per_proposal": round(statistics.mean(self.ops), 1) if self.ops else None,
                "tau": round(self.generated / max(self.forwards, 1), 3), "proposals": len(self.propose_ms)}


def compare_rows(revision: Side, current: Side, prompts: list[torch.Tensor], args) -> dict[str, list]:
    """Each prompt generated alone by each side, the order alternating by round; proposals counted after."""
    outputs = {revision.label: [], current.label: []}
    for side in (revision, current):  # load kernels and caches outside the figures
        side.run(prompts[0][:, :16], 4, count=True)
        side.ops.clear()
    for round_ in range(args.rounds):
        order = (revision, current) if round_ % 2 == 0 else (current, revision)
        for i, ids in enumerate(prompts):
            for side in order:
                outputs[side.label].append(side.run(ids, args.max_new_tokens,
                                                    seed=(args.seed or 0) + 1000 * round_ + i))
    for side in (revision, current):
        for ids in prompts:
            side.run(ids, args.max_new_tokens, count=True)
    return outputs


def compare_batches(revision: Side, current: Side, prompts: list[torch.Tensor], args) -> dict[str, list]:
    """Groups of --batch-size prompts decoded together by each side, the order alternating by round."""
    size = args.batch_size
    groups = [left_padded([p[0] for p in prompts[i:i + size]], 0) for i in range(0, len(prompts), size)]
    outputs = {revision.label: [], current.label: []}
    for side in (revision, current):  # verify costs, kernels and caches outside the figures
        side.run_batch(*groups[0], 4)
        side.token_ms.clear()
        side.drafting.clear()
        side.forwards = side.generated = 0
    for round_ in range(args.rounds):
        order = (revision, current) if round_ % 2 == 0 else (current, revision)
        for ids, mask in groups:
            for side in order:
                outputs[side.label].append(side.run_batch(ids, mask, args.max_new_tokens))
    return outputs


def main() -> None:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the git revision to compare with (a commit, tag or branch), or "
                   "a folder holding another copy's heads/ and decode/")
    add_model_arguments(p)
    p.add_argument("--questions", required=True, help="MT-Bench/Spec-Bench .jsonl, e.g. scripts/data/mt_bench.jsonl")
    p.add_argument("--limit", type=int_at_least(1), default=8, help="first N questions, first turns (default 8)")
    p.add_argument("--rounds", type=int_at_least(1), default=2, help="times each question is generated by each "
                   "side, the side going first alternating by round (default 2)")
    p.add_argument("--load-first", choices=["revision", "working-tree"], default="revision",
                   help="which side's target and drafter load first (default revision): in one process the two "
                        "sides' speeds drift apart by a few percent with the order their weights were allocated in")
    p.add_argument("--batch-size", type=int_at_least(1), default=1,
                   help="decode the questions in groups of this many with speculative_generate_batch (default 1: "
                        "one at a time with speculative_generate, proposals timed and counted)")
    args = p.parse_args()
    if not (args.heads or args.draft or args.context_draft):
        p.error("one of --heads, --draft or --context-draft is required")
    if args.batch_size > 1 and args.temperature:
        p.error("--batch-size compares greedy batches: leave out --temperature (one row at a time samples)")
    questions = load_questions(args.questions, args.limit)
    with tempfile.TemporaryDirectory() as folder:
        sys.path.insert(0, folder)
        package = revision_package(args.against, Path(folder))
        if args.load_first == "revision":
            revision, current = Side(args.against, package, args), Side("working tree", "gorgon", args)
        else:
            current, revision = Side("working tree", "gorgon", args), Side(args.against, package, args)
        prompts = [current.target.chat_ids([{"role": "user", "content": q["turns"][0]}]) for q in questions]
        if args.batch_size > 1:
            outputs = compare_batches(revision, current, prompts, args)
        else:
            outputs = compare_rows(revision, current, prompts, args)
    report = {side.label: side.figures() for side in (revision, current)}
    report["same tokens"] = outputs[revision.label] == outputs[current.label]
    if args.batch_size == 1:
        report["same trees"] = revision.trees == current.trees
        report["proposal ms, revision / working tree"] = round(
            report[revision.label]["ms_per_proposal"] / report[current.label]["ms_per_proposal"], 3)
    report["ms per token, revision / working tree"] = round(
        report[revision.label]["ms_per_token"] / report[current.label]["ms_per_token"], 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    run_script(main, "scripts/revision_ab.py")
