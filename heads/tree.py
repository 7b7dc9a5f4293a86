"""Candidate trees: pure functions from a list of paths to the tensors the decoder needs, and from the
drafts' chances and the measured verify costs to the tree that pays best (`best_tree_size`,
`worth_verifying`).

A tree is a list of paths of top-k ranks, one rank per head, as Medusa's `medusa_choices`:
[[0], [1], [0, 0]] means "head 0's best token", "head 0's second token" and "head 0's best
followed by head 1's best". Node 0 is the root: the token the target itself chose last step.
Every path's parent must be in the tree too, so the nodes form a tree under the root.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from .errors import GorgonError


@dataclass(frozen=True)
class Tree:
    """The buffers of one tree, built once. Node 0 is the root; nodes are sorted by depth."""

    paths: tuple[tuple[int, ...], ...]   # one per non-root node, in node order (node i = paths[i-1])
    depth: torch.Tensor                  # (T,) depth of each node; root 0
    parent: torch.Tensor                 # (T,) parent node; root points at itself
    rank: torch.Tensor                   # (T,) top-k rank of the node's token in its head; root 0
    ancestors: torch.Tensor              # (T, T) bool: [i, j] when j is i or an ancestor of i
    children: torch.Tensor               # (T, C) child nodes in rank order, -1 padded
    path_to: tuple[tuple[int, ...], ...]  # node indices from the root to each node

    @property
    def size(self) -> int:
        return int(self.depth.numel())

    # These two read the host-side paths: reading the tensors would make the host wait for the GPU each step.
    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def topk_needed(self) -> int:
        """How many ranked tokens each head must supply: one more than the deepest rank the tree uses."""
        return 1 + max((p[-1] for p in self.paths), default=0)

    def to(self, device) -> "Tree":
        return Tree(self.paths, *(host_to_device(t, device) for t in (self.depth, self.parent, self.rank,
                                                                     self.ancestors, self.children)), self.path_to)

    def tokens(self, root: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        """The token at each node: the root, then topk[head, rank] with head = depth - 1.

        `topk` is (num_heads, k) token ids sorted by rank, k >= topk_needed.
        """
        heads = (self.depth[1:] - 1).clamp(min=0)
        return torch.cat([root.reshape(1), topk[heads, self.rank[1:]]])


def host_to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A small host tensor on `device` without making the host wait for the GPU: a copy from pageable
    memory to CUDA synchronises, and a decoding step makes a few (its tree, the accepted path), so they
    go through pinned memory, asynchronously (torch keeps the pinned block until the copy is done)."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


# The most nodes a tree may have: beyond this a verify forward costs far more than the tokens it
# could save, on any hardware (the trees trained for a GPU have 64).
MAX_TREE_NODES = 256


def build_tree(paths) -> Tree:
    """Validate a list of rank paths and compute the tree's buffers."""
    bad = [r for p in paths for r in p if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise GorgonError(f"tree ranks must be whole numbers >= 0 (0 is a head's best token), not {bad[0]!r}")
    unique = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    if not unique or any(len(p) == 0 for p in unique):
        raise GorgonError("a tree needs at least one non-empty path of ranks, e.g. [[0], [0, 0]]")
    if len(unique) + 1 > MAX_TREE_NODES:
        raise GorgonError(f"a tree of {len(unique) + 1} nodes is more than {MAX_TREE_NODES}: use a smaller tree")
    index = {(): 0}
    parent, path_to, kids = [0], [(0,)], [[]]
    for i, p in enumerate(unique, start=1):
        up = index.get(p[:-1])
        if up is None:
            raise GorgonError(f"tree path {list(p)} has no parent path {list(p[:-1])}: add it")
        index[p] = i
        parent.append(up)
        path_to.append(path_to[up] + (i,))
        kids.append([])
        kids[up].append(i)  # in rank order: siblings are sorted by their last rank
    # Each buffer is made in one call: a write per node cost more than the rest of a step's host work.
    n = len(unique) + 1
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    ancestors[[i for i, nodes in enumerate(path_to) for _ in nodes], [j for nodes in path_to for j in nodes]] = True
    width = max(len(k) for k in kids)
    children = torch.tensor([k + [-1] * (width - len(k)) for k in kids])
    depth = torch.tensor([0] + [len(p) for p in unique])
    rank = torch.tensor([0] + [p[-1] for p in unique])
    return Tree(tuple(unique), depth, torch.tensor(parent), rank, ancestors, children, tuple(path_to))


def root_only_tree(device=None) -> Tree:
    """The tree of the root alone: a step that verifies no candidate (a drafter with nothing to propose)."""
    one = torch.zeros(1, dtype=torch.long, device=device)
    return Tree((), one, one, one, torch.ones(1, 1, dtype=torch.bool, device=device),
                torch.full((1, 1), -1, device=device), ((0,),))


def tree_from_token_paths(root: torch.Tensor, chains: list[list[int]]) -> tuple[torch.Tensor, Tree]:
    """A tree whose paths are the given token chains under `root`, shared prefixes merged, siblings ranked in
    the order they first appear; returns a token per node (the root first) and the tree. No chains: the root alone."""
    rank_path, token_path = {(): ()}, {}
    children: dict[tuple[int, ...], int] = {}  # token prefix -> how many children it has so far
    for chain in chains:
        for depth in range(1, len(chain) + 1):
            prefix = tuple(chain[:depth])
            if prefix not in rank_path:
                rank = children.get(prefix[:-1], 0)
                children[prefix[:-1]] = rank + 1
                rank_path[prefix] = rank_path[prefix[:-1]] + (rank,)
                token_path[rank_path[prefix]] = chain[depth - 1]
    if not token_path:
        return root.reshape(1), root_only_tree(root.device)
    tree = build_tree([list(p) for p in token_path]).to(root.device)
    drafted = host_to_device(torch.tensor([token_path[p] for p in tree.paths]), root.device)
    return torch.cat([root.reshape(1).to(drafted.dtype), drafted]), tree


def cut_tree(tokens: torch.Tensor, tree: Tree, max_depth: int) -> tuple[torch.Tensor, Tree]:
    """The proposed tree without its nodes deeper than `max_depth` (a prefix: nodes are sorted by depth)."""
    if not tree.paths or len(tree.paths[-1]) <= max_depth:  # the last node is the deepest: nothing to cut
        return tokens, tree
    keep = 1 + sum(len(p) <= max_depth for p in tree.paths)
    if keep == 1:
        return tokens[:1], root_only_tree(tokens.device)
    return tokens[:keep], build_tree([list(p) for p in tree.paths[:keep - 1]]).to(tokens.device)


def token_paths(tokens: torch.Tensor, tree: Tree) -> list[tuple[int, ...]]:
    """Each non-root node of a proposed tree as the token path from the root to it, in node order."""
    host = tokens.tolist()
    return [tuple(host[j] for j in path[1:]) for path in tree.path_to[1:]]


def tree_from_accuracies(accuracies, size: int) -> list[list[int]]:
    """The tree of `size` nodes (root included) that maximises the expected accepted length.

    `accuracies[k][r]` is the measured chance that head k's rank-r token is the right one.
    Assuming heads are right independently, a path's chance is the product of its ranks'
    accuracies, and the expected number of accepted tokens is the sum over the tree's paths.
    A child never beats its parent, so taking paths best-first (Medusa's greedy construction)
    always yields a valid tree and is optimal for that sum.
    """
    if not 2 <= size <= MAX_TREE_NODES:
        raise GorgonError(f"a tree needs a size from 2 (the root and one candidate) to {MAX_TREE_NODES}, not {size}")
    frontier = [(-float(accuracies[0][r]), (r,)) for r in range(len(accuracies[0]))]
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < size - 1:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(list(path))
        if len(path) < len(accuracies):
            for r, acc in enumerate(accuracies[len(path)]):
                heapq.heappush(frontier, (neg_p * float(acc), path + (r,)))
    return chosen


def path_chance(accuracies, ranks) -> float:
    """The chance that a path of ranks is accepted, heads assumed right independently (0 for a rank
    or head past those measured)."""
    chance = 1.0
    for k, r in enumerate(ranks):
        chance *= float(accuracies[k][r]) if k < len(accuracies) and r < len(accuracies[k]) else 0.0
    return chance


def expected_accepted(accuracies, paths) -> float:
    """Expected tokens per step under the independence assumption: 1 (the bonus) + sum of path chances."""
    return 1.0 + sum(path_chance(accuracies, p) for p in paths)


def chain_tau(top1: float, depth: int) -> float:
    """Tokens per target forward of a greedy chain of `depth` drafts, each right independently with chance
    `top1`: 1 + top1 + ... + top1 ** depth (the bonus token included). A floor for a ranked tree."""
    return sum(top1 ** d for d in range(depth + 1))


def interpolate_cost(costs: dict[int, float], size: int) -> float:
    """A forward's cost for `size` tokens, linear between the measured sizes: the smallest's below them, in
    proportion to the size above them."""
    sizes = sorted(costs)
    if size <= sizes[0]:
        return costs[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if size <= hi:
            return costs[lo] + (costs[hi] - costs[lo]) * (size - lo) / (hi - lo)
    return costs[sizes[-1]] * size / sizes[-1]


def best_tree_size(accuracies, costs: dict[int, float]) -> int:
    """The node count whose best tree gives the most tokens per unit of time on this machine.

    The best tree of n nodes is the first n - 1 paths of the best-first order (`tree_from_accuracies`),
    so this is `worth_verifying` over those paths' chances, with at least one candidate: the choice
    follows both the heads' accuracies and the hardware. `costs` maps token counts to measured forward
    times and must include 1.
    """
    if 1 not in costs:
        raise GorgonError("verify costs must include a one-token forward (size 1)")
    max_size = max(costs)
    chances = [path_chance(accuracies, p) for p in tree_from_accuracies(accuracies, max_size)]
    chances += [0.0] * (max_size - 1 - len(chances))  # past the last path a larger size adds nothing
    return 1 + worth_verifying(chances, costs, at_least=1)


def best_first(chances: dict[tuple[int, ...], float], size: int) -> list[tuple[int, ...]]:
    """The `size` likeliest token paths whose parent path is kept too (ties go to the shorter), best first: the
    candidates of a tree of `size` + 1 nodes."""
    chosen: dict[tuple[int, ...], None] = {}  # ordered, best first
    for path in sorted(chances, key=lambda p: (-chances[p], len(p))):
        if len(chosen) == size:
            break
        if len(path) == 1 or path[:-1] in chosen:
            chosen[path] = None
    return list(chosen)


def worth_verifying(chances: list[float], costs: dict[int, float], at_least: int = 0) -> int:
    """How many of the candidates (chances best first) to verify, at least `at_least`: the count whose tree
    gives the most expected tokens, 1 + the sum of their chances, per unit of a forward's measured time
    over that many nodes plus the root (the expected speedup: a plain step, no candidate, gives one
    token per forward over one). Ties go to the smaller tree."""
    best, best_gain, expected = at_least, -1.0, 1.0
    for count in range(len(chances) + 1):
        if count:
            expected += chances[count - 1]
        gain = expected / (interpolate_cost(costs, count + 1) / costs[1])
        if count >= at_least and gain > best_gain:
            best, best_gain = count, gain
    return best


class TreesInConfig:
    """For a drafter module whose config keeps its held-out rank accuracies (`accuracies`, one row per drafted
    level or position) and its tree size per device type (`nodes`), as saved in its config.json."""

    def set_trees(self, accuracies: list[list[float]], sizes: dict[str, int]) -> None:
        self.config.accuracies = accuracies
        self.config.nodes = dict(sizes)

    @property
    def accuracies(self) -> list[list[float]] | None:
        return self.config.accuracies

    def saved_nodes(self, device_type: str) -> int:
        """The number of tree nodes per step saved for this device type (else the CPU one)."""
        return self.config.nodes.get(device_type) or self.config.nodes["cpu"]
