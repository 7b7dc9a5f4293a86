"""What `gorgon generate`, `gorgon bench` and the profiling script share: the target, the drafter
the options name, the tree, sampling, device and CPU kernels."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import sys
from pathlib import Path

import torch

from gorgon.heads import (
    DRAFT_TOKENS,
    MAX_DRAFT_TOKENS,
    ContextDrafter,
    DraftModelDrafter,
    GorgonError,
    MergedDrafter,
    load_draft,
    load_target,
)
from gorgon.heads.command import int_at_least, user_path
from gorgon.heads.files import read_text
from gorgon.heads.hub import resolve_heads_folder
from gorgon.heads.loading import chain_for, check_heads_options, drafter_for, load_heads, load_heads_for
from gorgon.heads.quantize import check_scheme, quantize_linears, scheme_problem
from gorgon.heads.target import check_model_source
from gorgon.heads.tree import MAX_TREE_NODES, best_tree_size

from .acceptance import Sampling
from .calibrate import drafted_level_cost, verify_costs
from .kernels import DRAFT_DTYPES, KERNELS, draft_dtype, draft_scheme, stock_rows, use_cpu_kernels


def probability(text: str) -> float:
    """--top-p: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1] (1 is off), not {text!r}")
    return value


def draft_level_cost_value(text: str):
    """--draft-level-cost: 'auto' or a finite number >= 0."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected auto or a number of target steps >= 0, not {text!r}")
    return value


def quantize_scheme(value: str) -> str:
    problem = scheme_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def read_tree(value: str):
    """'auto', a node count, or a JSON file of rank paths."""
    if value == "auto":
        return "auto"
    if value.lstrip("+-").isdigit():
        if not 2 <= int(value) <= MAX_TREE_NODES:  # before any model loads
            raise GorgonError(f"--tree {value}: a tree needs 2 (the root and one candidate) to {MAX_TREE_NODES} nodes")
        return int(value)
    path = Path(value)
    if not path.is_file():
        raise GorgonError(f"tree file {value} not found: pass 'auto', a node count or a JSON file with a list of "
                          "rank paths")
    try:
        paths = json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise GorgonError(f"tree file {value} is not valid JSON ({err.msg}): "
                          "write a list like [[0],[1],[0,0]]") from err
    if not isinstance(paths, list) or not all(isinstance(x, list) for x in paths):
        raise GorgonError(f"tree file {value} must hold a list of rank paths like [[0],[1],[0,0]]")
    return paths


def option(default=None, help: str = "", parse=None, choices=None):
    """A decode setting: its default, the help `--help` prints, and `parse`, the one check of its value (an
    argparse type: the command line parses with it, and Python values go through it too)."""
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


@dataclasses.dataclass
class DecodeSettings:
    """The target, the drafter, the tree and the kernels to decode with. `gorgon generate`, `gorgon bench`, the
    scripts and Python (`from_options`) all build one: the command line maps each option onto a field of the
    same name, and every check of a setting is written here, once, and runs before any model loads.

    The drafter: `heads` (Medusa or EAGLE heads) or `draft` (a small model with the target's tokenizer),
    and/or `context_draft` (prompt lookup, merged into the other's tree when both are given)."""

    target: str | None = option(None, "hub id or local path of the target (default: with --heads, the target their "
                                      "config.json records; else the embedded SmolLM2-135M-Instruct)", user_path)
    heads: str | None = option(None, "heads folder or hub id (from train/heads.py or save_pretrained)", user_path)
    draft: str | None = option(None, "a small draft model (hub id or path) sharing the target's tokenizer", user_path)
    draft_tokens: int | None = option(None, f"levels a --draft model drafts per step (its chain's length), 1 to "
                                            f"{MAX_DRAFT_TOKENS} (default {DRAFT_TOKENS})",
                                      int_at_least(1, MAX_DRAFT_TOKENS))
    draft_level_cost: float | str | None = option(
        None, "what drafting one more level costs, in target steps: a --draft model or EAGLE head drafts no "
              "deeper in a step once the level's expected accepted tokens (its candidates' chances, summed) fall "
              "below it; auto (the default) times it on this machine, 0 drafts every level", draft_level_cost_value)
    context_draft: bool = option(False, "also draft from the context (prompt lookup: the tokens that followed the "
                                        "latest earlier occurrence of the text's last n-gram), in the same tree as "
                                        "--heads or --draft, or alone")
    context_ngram: int = option(3, "longest n-gram looked up (default 3)", int_at_least(1))
    context_tokens: int = option(5, "tokens per context continuation (default 5)", int_at_least(1))
    context_max_tokens: int | None = option(None, "a continuation grows to the length of the run the text has copied "
                                                  "so far, up to this many tokens (default 10, as transformers' "
                                                  "prompt lookup, or --context-tokens if larger; set it to "
                                                  "--context-tokens for fixed-length continuations)", int_at_least(1))
    context_branches: int = option(2, "distinct earlier continuations proposed as branches (default 2)",
                                   int_at_least(1))
    tree_budget: int | None = option(None, "with --context-draft and another drafter: nodes of the merged tree, "
                                           "every step (default: sized per step, up to 16 nodes or the other "
                                           "drafter's tree if larger: as many of the likeliest candidates as pay for "
                                           "their verify time, measured on this machine)", int_at_least(2))
    tree: str | int | list = option("auto", "'auto' (the node count that gives the most tokens per unit of time on "
                                            "this machine, from the heads' held-out accuracies and verify costs "
                                            "measured here; heads without accuracies: the size saved with them), a "
                                            "node count N (Medusa: the best N-node tree from the heads' accuracies; an "
                                            "EAGLE head or a --draft model: N nodes per step, by default all "
                                            "a --draft model drafts), or a JSON file with a list of rank paths "
                                            "(Medusa), e.g. [[0],[1],[0,0]] (from Python, also the list itself)")
    draft_depth: int | None = option(None, "an EAGLE head's tree levels drafted per step (default: the one "
                                           "saved with it)", int_at_least(1))
    draft_topk: int | None = option(None, "tokens kept and expanded per level: an EAGLE head's (default: the "
                                          "one saved with it, widened so that the levels' candidates can fill the "
                                          "tree, as a GPU's larger tree needs), or a --draft model's (default 1, a "
                                          "greedy chain; more grows a tree of its likeliest continuations, "
                                          "--draft-tokens levels deep)", int_at_least(1))
    device: str = option("auto", "auto (default: cuda when there is a GPU, else cpu), cpu, cuda or cuda:N")
    dtype: str = option("auto", "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    quantize: str = option("none", "the target's weights: none (default: as loaded), int4 (4-bit, groups of 32), "
                                   "int8 (8-bit per row), w8a8 (int8 weights and activations) or w4a8 (int4's weights, "
                                   "int8 activations, gorgon's kernel: the fastest measured), on the CPU; output "
                                   "then equals the quantized target's own generate", quantize_scheme)
    cpu_kernels: str = option("fast", "on the CPU: fast (default: linear layers on weights prepacked for oneDNN, so "
                                      "verifying a few tokens costs about one step) or stock (torch's default "
                                      "kernels); ignored on CUDA", choices=KERNELS)
    draft_dtype: str = option("auto", "dtype of an EAGLE head or --draft model (drafts only propose, so "
                                      "output is unchanged): float32, bfloat16, or w4a8 (its linear layers as "
                                      "--quantize w4a8's); auto (default) is w4a8 beside a w4a8 target, bfloat16 for "
                                      "a float32 target on the CPU fast kernels where this CPU runs bfloat16, else "
                                      "the target's dtype",
                              choices=DRAFT_DTYPES)

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, parse, choices = getattr(self, field.name), field.metadata["parse"], field.metadata["choices"]
            flag = "--" + field.name.replace("_", "-")
            if parse is not None and value is not None:
                try:
                    setattr(self, field.name, parse(value if isinstance(value, str) else str(value)))
                except argparse.ArgumentTypeError as err:
                    raise GorgonError(f"argument {flag}: {err}") from None
            if choices is not None and value not in choices:
                raise GorgonError(f"argument {flag}: invalid choice: {value!r} (choose from {', '.join(choices)})")
        if not isinstance(self.tree, list):
            self.tree = read_tree(str(self.tree))
        self.check_together()

    def check_together(self) -> None:
        """The settings that need another: each names what it needs."""
        drafts = self.heads or self.draft
        if self.heads and self.draft:
            raise GorgonError("argument --draft: not allowed with argument --heads")
        if not (drafts or self.context_draft):
            raise GorgonError("no drafter: pass --heads FOLDER or --draft MODEL, and/or --context-draft")
        if self.tree_budget is not None and not (self.context_draft and drafts):
            raise GorgonError("--tree-budget sizes a merged tree: it needs --context-draft with --heads or --draft")
        if self.draft_depth and not self.heads:
            raise GorgonError("--draft-depth shapes an EAGLE head's search: it needs --heads (a --draft model "
                              "drafts --draft-tokens levels)")
        if self.draft_level_cost is not None and not drafts:
            raise GorgonError("--draft-level-cost stops a search's levels: it needs --draft or --heads (an "
                              "EAGLE head)")
        if self.draft_topk and not drafts:
            raise GorgonError("--draft-topk shapes a search: it needs --heads or --draft")
        if self.draft_tokens and not self.draft:
            raise GorgonError("--draft-tokens sets a --draft model's levels per step: it needs --draft (an "
                              "EAGLE head's are --draft-depth)")
        if self.draft_dtype != "auto" and not drafts:
            raise GorgonError("--draft-dtype sets the dtype of a drafter's own weights: it needs --heads or --draft "
                              "(context drafts have none)")
        if not drafts and self.tree != "auto":
            raise GorgonError("--tree sizes a --heads or --draft tree: --context-draft alone proposes what the "
                              "context repeats")
        if self.draft and isinstance(self.tree, list):
            raise GorgonError("a --draft model grows its tree each step: --tree takes a node count with --draft, "
                              "not rank paths")
        if self.context_draft:
            context_drafter(self)  # its own checks (an n-gram it can look up)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **changes) -> "DecodeSettings":
        """The settings a command line parsed (`add_model_arguments`), with `changes` (a script's own tree)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)} | changes)

    @property
    def name(self) -> str:
        """The drafter, for reports: the heads or draft model, "+ context" when merged."""
        return " + ".join(n for n in (self.heads or self.draft, "context" if self.context_draft else None) if n)


def add_model_arguments(p: argparse.ArgumentParser, sampling: bool = True, generates: bool = True) -> None:
    """The options of `DecodeSettings`, each mapped onto its field, and what `gorgon generate` and `gorgon bench`
    add: the answers' length and sampling. Tools that decode greedily only (tau, step profiles) leave the
    sampling options out, and those that time a step rather than answers (step profiles) the answers' length."""
    drafters = p.add_mutually_exclusive_group()
    for field in dataclasses.fields(DecodeSettings):
        flag, meta = "--" + field.name.replace("_", "-"), field.metadata
        where = drafters if field.name in ("heads", "draft") else p
        if field.type == "bool":
            where.add_argument(flag, action="store_true", help=meta["help"])
        else:
            where.add_argument(flag, type=meta["parse"], choices=meta["choices"], default=field.default,
                               help=meta["help"])
    if generates:
        p.add_argument("--max-new-tokens", type=int_at_least(1), default=256,
                       help="most tokens generated per answer (default 256)")
    if sampling:
        p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
        p.add_argument("--top-k", type=int_at_least(0), default=None,
                       help="when sampling, keep the k likeliest tokens; 0 is off (default: the target's "
                            "generation_config, as `generate` takes it: 50 where it sets none)")
        p.add_argument("--top-p", type=probability, default=None,
                       help="when sampling, keep the likeliest tokens whose chances sum to p; 1 is off (default: "
                            "the target's generation_config, as `generate` takes it: 1 where it sets none)")
        p.add_argument("--seed", type=int, default=None, help="seed for sampling (default: generate draws a fresh "
                       "one each run; bench and the scripts use 0, so their runs repeat)")


def load_drafter(settings: DecodeSettings, keep_float: bool = False):
    """The target and the drafter the settings name, on the chosen CPU kernels; --context-draft merges
    prompt lookup into the other drafter's tree, or drafts alone. `keep_float`: a quantized target keeps its
    float weights too (a bench times stock full-precision `generate` on them)."""
    if settings.draft:
        check_model_source(settings.draft, "draft model")  # before the target loads
    context = context_drafter(settings) if settings.context_draft else None
    if not (settings.heads or settings.draft):
        return load_target_and_heads(settings, keep_float)[0], context
    target, drafter = load_model_drafter(settings, keep_float)
    if context is None:
        return target, drafter
    costs = verify_costs(target.model) if settings.tree_budget is None else None
    return target, MergedDrafter(drafter, context, settings.tree_budget, costs)


def from_options(**options):
    """The target and the drafter as `gorgon generate` builds them, for Python: `from_options(heads=FOLDER,
    context_draft=True)` is `--heads FOLDER --context-draft`, with the same defaults (the target on the CPU fast
    kernels, the drafter in its draft dtype, the tree and a search's level cost sized for this machine). Keys
    are `DecodeSettings`' fields (the options' names with underscores: `gorgon generate --help` lists them); a
    key it lacks is refused in one line."""
    known = {f.name for f in dataclasses.fields(DecodeSettings)}
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
            raise GorgonError(f"from_options takes no {key!r}: {hint}")
    return load_drafter(DecodeSettings(**options))


def context_drafter(settings: DecodeSettings) -> ContextDrafter:
    """A fresh context drafter with the --context-* settings (each drafter learns its own record)."""
    return ContextDrafter(settings.context_ngram, settings.context_tokens, settings.context_branches,
                          settings.context_max_tokens)


def load_target_and_heads(settings: DecodeSettings, keep_float: bool = False):
    """The target the settings name on the chosen CPU kernels, and the --heads loaded onto it (None without
    --heads; their options checked against their folder before the target loads)."""
    if not settings.heads:
        target = load_target(settings.target, device=settings.device, dtype=settings.dtype,
                             quantize=settings.quantize, keep_float=keep_float)
        use_cpu_kernels(target.model, settings.cpu_kernels)
        return target, None
    folder = resolve_heads_folder(settings.heads)  # a hub id downloaded once
    check_heads_options(folder, settings.heads, settings.draft_depth, settings.draft_topk, settings.draft_dtype,
                        settings.draft_level_cost)
    target, heads = load_heads(folder, settings.target, device=settings.device, dtype=settings.dtype,
                               quantize=settings.quantize, keep_float=keep_float)
    use_cpu_kernels(target.model, settings.cpu_kernels)
    return target, heads


def load_model_drafter(settings: DecodeSettings, keep_float: bool = False):
    """The target and the drafter the arguments name, on the chosen CPU kernels.

    With heads and `--tree auto`, the tree's size is chosen for this machine: from the heads'
    measured accuracies and the verify costs measured here (a few seconds, cached).
    """
    tree = settings.tree
    target, heads = load_target_and_heads(settings, keep_float)
    if heads is not None:
        return target, heads_drafter(heads, target, settings, tree, settings.heads)
    nodes = None if tree == "auto" else tree
    return target, draft_model_drafter(settings, settings.draft, target, settings.draft_tokens or DRAFT_TOKENS,
                                       settings.draft_topk or 1, nodes)


def draft_model_drafter(settings: DecodeSettings, name: str, target, tokens: int, topk: int, nodes: int | None,
                        level_cost: float | None = None):
    """The drafter of the draft model `name` for `target` (on its kernels already): in its draft dtype on the
    target's kernels, drafting `tokens` levels of `topk` (up to `nodes` nodes), its level cost `level_cost` or, if
    None, chosen as --draft-level-cost says."""
    draft, token_map = load_draft(name, target)
    if token_map is not None:
        print(f"gorgon: the draft drafts from its {len(token_map)}-token draft vocabulary", file=sys.stderr)
    draft = draft.to(target.model.device, draft_dtype(target.model, settings.cpu_kernels, settings.draft_dtype)).eval()
    quantize_draft(draft, target.model, settings.draft_dtype)
    use_drafter_kernels(draft, target.model, settings.cpu_kernels)
    drafter = DraftModelDrafter(draft, tokens, topk, nodes, token_map)
    drafter.level_cost = level_cost if level_cost is not None else chosen_level_cost(
        settings, drafter.depth, lambda: drafted_level_cost(drafter, target.model))
    return drafter


def chosen_level_cost(settings: DecodeSettings, levels: int, measure) -> float:
    """--draft-level-cost: the number given or, with auto (the default), a level's cost timed here by
    `measure()`; with one level only there is nothing to stop, so nothing is timed."""
    if settings.draft_level_cost not in (None, "auto"):
        return settings.draft_level_cost
    if levels < 2:
        return 0.0
    cost = measure()
    print(f"gorgon: a drafted level costs {cost:.2f} target steps here: a step drafts no deeper once its "
          "candidates' chances sum below that (--draft-level-cost 0 to draft every level)", file=sys.stderr)
    return cost


def heads_drafter(heads, target, settings: DecodeSettings, tree, folder: str):
    """The drafter for the heads of `folder`, loaded onto `target` (on its kernels already; the options checked
    against the folder with `check_heads_options` before it loaded): the head in its draft dtype on the
    target's kernels, and with `--tree auto` the tree size that suits this machine."""
    on_drafting_kernels(heads, target, settings)
    if tree == "auto" and heads.accuracies:
        tree = best_tree_size(heads.level_accuracies(settings.draft_depth), verify_costs(target.model))
        print(f"gorgon: a {tree}-node tree fits {folder} best on this machine (--tree N to choose another)",
              file=sys.stderr)
    drafter = drafter_for(heads, tree, settings.draft_depth, settings.draft_topk)
    if hasattr(drafter, "level_trial"):  # a search whose levels can stop: timed at its (possibly widened) top-k
        drafter.level_cost = chosen_level_cost(settings, drafter.depth,
                                               functools.partial(drafted_level_cost, drafter, target.model))
    return drafter


def on_drafting_kernels(heads, target, settings: DecodeSettings) -> None:
    """Heads that draft in their own dtype in the one --draft-dtype chooses; all on the target's kernels."""
    if heads.drafts_in_own_dtype:
        heads.to(draft_dtype(target.model, settings.cpu_kernels, settings.draft_dtype))
        quantize_draft(heads, target.model, settings.draft_dtype)
    use_drafter_kernels(heads, target.model, settings.cpu_kernels)


def quantize_draft(drafter: torch.nn.Module, target_model: torch.nn.Module, choice: str) -> None:
    """The drafter's linear layers on the scheme `draft_scheme` chooses, their float weights kept (the drafter reads
    their dtype and device)."""
    scheme = draft_scheme(target_model, choice)
    if scheme != "none":
        check_scheme(scheme, next(drafter.parameters()).device)
        quantize_linears(drafter, scheme, keep_float=True)


def chain_drafter(settings: DecodeSettings, target, length: int | None = None, heads=None):
    """The --heads or --draft drafter drafting one chain, the top candidate of each level with every level drafted:
    what vLLM verifies (`gorgon bench --baselines chain`, scripts/serving_parity.py). `length` levels (default:
    --draft-depth, --draft-tokens, else the drafter's own depth); the same draft dtype and kernels. `heads`: the
    --heads already loaded onto `target` (else they are loaded)."""
    if settings.draft:
        return draft_model_chain(settings, settings.draft, target, length or settings.draft_tokens or DRAFT_TOKENS)
    if not settings.heads:
        raise GorgonError("a chain drafts from --heads or --draft: context drafts alone have no chain of their own")
    heads = heads if heads is not None else load_heads_for(resolve_heads_folder(settings.heads), target)
    on_drafting_kernels(heads, target, settings)
    return chain_for(heads, length or settings.draft_depth)


def draft_model_chain(settings: DecodeSettings, name: str, target, tokens: int):
    """The draft model `name` drafting one chain of `tokens`, every level drafted."""
    return draft_model_drafter(settings, name, target, tokens, topk=1, nodes=None, level_cost=0.0)


def load_chain(settings: DecodeSettings, length: int | None = None):
    """The target and `chain_drafter`'s chain alone, for a script that drafts nothing else."""
    target, heads = load_target_and_heads(settings)
    return target, chain_drafter(settings, target, length, heads)


def compared_drafters(settings: DecodeSettings, heads: list[str], drafts: list[str], target, drafter,
                      chains: bool = False) -> list[dict]:
    """`gorgon bench --compare-heads/--compare-draft`: other heads and draft models, loaded onto the same target
    and drafted as the drafter under test is (the same tree option; a draft model at its own default length and
    chain), each merged with a context drafter of its own when --context-draft is on. Returned in the order given,
    heads first, as {"name", "heads" or "draft", "drafter"}: the first is named compare, the next compare2, ...;
    with `chains`, each also has its "chain" (`chain_drafter`'s, at --draft-depth or its own depth)."""
    others = []
    for kind, name in [("heads", h) for h in heads] + [("draft", d) for d in drafts]:
        if kind == "heads":
            folder = resolve_heads_folder(name)
            check_heads_options(folder, name, settings.draft_depth, settings.draft_topk, settings.draft_dtype,
                                settings.draft_level_cost)
            module = load_heads_for(folder, target)
            other = heads_drafter(module, target, settings, settings.tree, name)
            chain = chain_for(module, settings.draft_depth) if chains else None
        else:
            other = draft_model_drafter(settings, name, target, tokens=DRAFT_TOKENS, topk=1, nodes=None)
            chain = draft_model_chain(settings, name, target, DRAFT_TOKENS) if chains else None
        if isinstance(drafter, MergedDrafter):
            other = MergedDrafter(other, context_drafter(settings), settings.tree_budget, drafter.costs)
        entry = {"name": "compare" + (str(len(others) + 1) if others else ""), kind: name, "drafter": other}
        others.append(entry | ({"chain": chain} if chains else {}))
    return others


def use_drafter_kernels(drafter: torch.nn.Module, target_model: torch.nn.Module, kernels: str) -> None:
    """The drafter's linear layers on the target's CPU kernels; the row counts left on the stock kernel as the
    target's where the drafter shares its dtype (timed on this machine already), else timed for the drafter's
    own (a bfloat16 drafter of a float32 target: oneDNN can win from one row). A no-op off the CPU."""
    weight, target_weight = next(drafter.parameters()), next(target_model.parameters())
    if weight.device.type == "cpu":
        same = weight.dtype == target_weight.dtype
        use_cpu_kernels(drafter, kernels, stock_rows=(stock_rows(target_model) or 0) if same else "measure")


def check_sampling_options(args) -> None:
    """--temperature's range, and no --top-k or --top-p with greedy decoding (where they would do nothing),
    before the target loads."""
    Sampling(args.temperature)
    given = [name for name, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if given and args.temperature == 0:
        raise GorgonError(f"{' and '.join(given)} {'shapes' if len(given) == 1 else 'shape'} sampling, and "
                          "--temperature 0 decodes greedily: pass a --temperature above 0 too, or drop "
                          f"{'it' if len(given) == 1 else 'them'}")
