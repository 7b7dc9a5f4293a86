"""Drafts from the context itself (prompt lookup): no model, no training.

The longest recent n-gram that ends the text so far (prompt and output) is looked up earlier in
the text; the tokens that followed it there are proposed. Where earlier matches continue
differently, each continuation is a branch. Text that repeats its input (translation, edits,
summaries, code) drafts well this way; heads know the target's style instead, and `MergedDrafter`
puts both in one verified tree.
"""

from __future__ import annotations

import torch

from ...drafter import scored_paths_of_rows
from ...errors import GorgonError
from ...tree import MAX_TREE_NODES, best_first, tree_from_token_paths, worth_verifying


def lookup(tokens: list[int], max_ngram: int = 3, length: int = 5, branches: int = 2,
           max_length: int | None = None) -> tuple[int, list[list[int]]]:
    """The size n of the longest n-gram (max_ngram down to 1) that ends `tokens` and occurred before, and
    its continuations, most recent match first: at most `branches` of them, distinct in their first
    token. Each is at most `length` tokens, or as many as the run the text has copied so far (the
    n-gram and as far back as the earlier text goes on matching), up to `max_length` (default:
    `length`, no growth). (0, []) when nothing matches."""
    max_length = length if max_length is None else max_length
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        found, firsts = [], set()
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[start:start + n] == suffix and tokens[start + n] not in firsts:
                run = n  # how far back this earlier text equals the text's end
                while run < max_length and start + n - run > 0 and tokens[start + n - run - 1] == tokens[-run - 1]:
                    run += 1
                firsts.add(tokens[start + n])
                found.append(tokens[start + n:start + n + max(length, run)])
                if len(found) == branches:
                    break
        if found:
            return n, found
    return 0, []


# The longest n-gram looked up: one this long already singles out the passage being copied, and each step tries
# every size from the longest down, so a longer one (--context-ngram 100000) only slows every step.
MAX_NGRAM = 32


def check_context_settings(max_ngram: int, length: int, branches: int, max_length: int) -> None:
    for name, value in (("n-gram size", max_ngram), ("context draft length", length), ("branches", branches)):
        if not (isinstance(value, int) and value >= 1):
            raise GorgonError(f"the {name} must be a whole number >= 1, not {value!r}")
    if max_ngram > MAX_NGRAM:
        raise GorgonError(f"the n-gram size (--context-ngram) must be from 1 to {MAX_NGRAM}, not {max_ngram}: a longer "
                          "one finds no passage a shorter one misses, and slows every step")
    if not (isinstance(max_length, int) and max_length >= length):
        raise GorgonError(f"the longest context draft (--context-max-tokens, max_length: {max_length!r}) must be a "
                          f"whole number at least the context draft length (--context-tokens, length: {length}): "
                          f"raise it, or set it to {length} for drafts of a fixed length")


class ContextDrafter:
    """Proposes the continuations `lookup` finds, as a tree (one chain per distinct continuation).
    A chain grows while the text keeps copying, up to `max_length` (default 10, as transformers'
    prompt lookup proposes, or `length` if larger): on 24 MT-Bench questions that raised a merged
    tree's tau from 2.10 to 2.15 (extraction 3.07 to 3.56) for 0.22 more nodes per step (README).

    For a merged tree each candidate also gets its chance of being accepted (`scored_paths`),
    learned as the drafter goes: how often, so far, a chain from an n-gram of this size, in this
    branch, was right at this depth where it was right up to it. It starts at 1/2 and follows the
    text: long copied runs earn a chain its place in the tree, lone one-token matches lose it.
    """

    feature_layers = None  # reads tokens only

    def __init__(self, max_ngram: int = 3, length: int = 5, branches: int = 2, max_length: int | None = None):
        max_length = max(10, length) if max_length is None else max_length
        check_context_settings(max_ngram, length, branches, max_length)
        self.max_ngram, self.length, self.branches, self.max_length = max_ngram, length, branches, max_length
        self.record: dict[tuple[int, int, int], list[int]] = {}  # (n, branch, depth) -> [right, judged]
        self.last = None  # (context length, n, chains) of the last scored proposal, judged at the next one

    @property
    def max_nodes(self) -> int:
        return 1 + self.max_length * self.branches

    def settings(self) -> dict:
        return {"tree": "built per step", "context_draft": {"ngram": self.max_ngram, "tokens": self.length,
                                                            "max_tokens": self.max_length, "branches": self.branches}}

    def fresh(self) -> "ContextDrafter":
        """The same settings with nothing learned: a row of a batch learns from its own text."""
        return ContextDrafter(self.max_ngram, self.length, self.branches, self.max_length)

    def chains(self, text: list[int]) -> tuple[int, list[list[int]]]:
        return lookup(text, self.max_ngram, self.length, self.branches, self.max_length)

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        return tree_from_token_paths(root, self.chains(text_of(root, context))[1])

    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """Every prefix of every chain with its learned chance of acceptance, parents before children."""
        text = text_of(root, context)
        self._judge_last(text, features)
        n, chains = self.chains(text)
        self.last = (context.numel(), n, chains)
        paths = []
        for branch, chain in enumerate(chains):
            chance = 1.0
            for depth in range(1, len(chain) + 1):
                right, judged = self.record.get((n, branch, depth), (0, 0))
                chance *= (right + 1) / (judged + 2)
                paths.append((chain[:depth], chance))
        return paths

    def _judge_last(self, text: list[int], features: torch.Tensor) -> None:
        """Count where the last proposal's chains were right: the text since then (the last root, the
        accepted tokens, and the new root the target chose) is what the target wrote after them.
        The features tell a continued text from a new prompt (they cover what is new since the last
        call: the accepted tokens, or a whole prompt, even one that extends the last text)."""
        if self.last is None:
            return
        before, n, chains = self.last
        if len(text) - 1 - features.shape[0] != before:
            return  # a new prompt: nothing to judge
        written = text[before + 1:]
        for branch, chain in enumerate(chains):
            for depth, (token, truth) in enumerate(zip(chain, written), 1):
                counts = self.record.setdefault((n, branch, depth), [0, 0])
                counts[0] += token == truth
                counts[1] += 1
                if token != truth:
                    break


def text_of(root: torch.Tensor, context: torch.Tensor) -> list[int]:
    """The context and the root as token ids, read in one transfer (one wait for a GPU, not three)."""
    return torch.cat([context, root.reshape(1).to(context.dtype)]).tolist()


class MergedDrafter:
    """Two drafters' candidates in one tree under one root, each token path once, the likeliest first.

    The other drafter proposes its own tree, the context its chains, each candidate with its chance
    of being accepted (`scored_paths`: a head's draft confidence or measured accuracy, a draft
    model's probabilities, the context's learned record); a path both propose keeps the higher.
    Taking them best first keeps parents before children (a path is never likelier than its prefix).
    With `costs` (a forward's time per token count, measured on this machine) each step keeps as
    many as pay for themselves: the count that gives the most expected tokens (1 + the sum of
    chances) per unit of verify time, up to `budget` nodes; without, always `budget` nodes. So a
    chain the text is copying joins the tree, and a lone one-token match does not crowd out the
    head: with the embedded target's EAGLE head (4 nodes alone) on 24 MT-Bench questions,
    tau 2.11 at 5.5 nodes per step and 1.41x over `generate`, against 1.87 and 1.35x at a fixed 4
    (README, "Drafting from the context"). Verification and acceptance are unchanged, and every
    candidate is a point-mass proposal fixed by the text so far, so sampling stays exact.
    """

    def __init__(self, drafter, context: ContextDrafter, budget: int | None = None,
                 costs: dict[int, float] | None = None):
        self.drafter, self.context, self.costs = drafter, context, costs
        if hasattr(drafter, "check_target"):  # the context drafter has no weights to check
            self.check_target = drafter.check_target
        self.budget = budget if budget is not None else max(DEFAULT_BUDGET, drafter.max_nodes)
        if not (isinstance(self.budget, int) and 2 <= self.budget <= MAX_TREE_NODES):
            raise GorgonError(f"a merged tree needs a budget of 2 (the root and one candidate) to {MAX_TREE_NODES} "
                              f"nodes, not {self.budget!r}")
        if not hasattr(drafter, "scored_paths"):
            raise GorgonError(f"{type(drafter).__name__} does not rank its candidates by chance (scored_paths), "
                              "so its tree cannot be merged with context drafts: use it without --context-draft")
        self.feature_layers = drafter.feature_layers
        if hasattr(drafter, "attach_cache"):  # a self-speculation draft: what it wrote in the target's cache
            self.attach_cache = drafter.attach_cache

    @property
    def drafted(self):
        return self.drafter.drafted

    @property
    def max_nodes(self) -> int:
        return self.budget

    def settings(self) -> dict:
        """The merged drafter's tree (its search's: the fixed tree is merged per step) and both drafters'."""
        mine = self.drafter.settings()
        tree = mine["tree"] if isinstance(mine["tree"], str) else "built per step"
        return {**mine, "tree": tree, "context_draft": self.context.settings()["context_draft"]}

    def fresh(self) -> "MergedDrafter":
        """Both drafters fresh (`Drafter.fresh`), with this one's budget and costs."""
        return MergedDrafter(self.drafter.fresh(), self.context.fresh(), self.budget, self.costs)

    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """Both drafters' candidates, each path once with the higher chance, the best `budget - 1` best first."""
        return self.merged(self.context.scored_paths(root, features, context),
                           self.drafter.scored_paths(root, features, context))

    @staticmethod
    def scored_paths_together(drafters: list["MergedDrafter"], roots: list[torch.Tensor], features: list[torch.Tensor],
                              contexts: list[torch.Tensor]) -> list[list[tuple[list[int], float]]]:
        """`scored_paths` for a batch's rows (`scored_paths_of_rows`): the other drafter's together where it can."""
        theirs = scored_paths_of_rows([d.drafter for d in drafters], roots, features, contexts)
        return [d.merged(d.context.scored_paths(r, f, c), paths)
                for d, r, f, c, paths in zip(drafters, roots, features, contexts, theirs)]

    def merged(self, *proposals: list[tuple[list[int], float]]) -> list[tuple[list[int], float]]:
        """The proposals' candidates, each path once with its highest chance, the best `budget - 1` best first."""
        chance: dict[tuple[int, ...], float] = {}
        for path, p in (pair for paths in proposals for pair in paths):
            chance[tuple(path)] = max(p, chance.get(tuple(path), 0.0))
        return [(list(p), chance[p]) for p in best_first(chance, self.budget - 1)]

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        paths = self.scored_paths(root, features, context)
        if self.costs is not None:
            paths = paths[:worth_verifying([p for _, p in paths], self.costs)]
        return tree_from_token_paths(root, [path for path, _ in paths])


# The most nodes a merged tree takes when sized per step (unless the other drafter's own tree is larger):
# a bound, not a target; the verify costs decide, and on a CPU they keep a step far below it.
DEFAULT_BUDGET = 16
