"""Dynamic draft trees (EAGLE-2): the likeliest continuations, found level by level.

A drafter that drafts one level at a time into a KV cache of its own (an EAGLE head, a
draft model) gives the first level's log-probabilities and a function that drafts the children
of a frontier of nodes in one masked forward; `grow_tree` does the rest, the same for both. Each
level expands the `topk` best nodes so far (by the product of draft probabilities along their
path) with their own `topk` children, for `depth` levels; the best `nodes - 1` nodes overall
become the tree (a child is never likelier than its parent, so they form one); the expansion
stops early once no deeper node could enter it, or could pay for the time its level takes to
draft. With top-k 1 the tree is a greedy chain.

The cache holds what every node sees first (`committed` entries), then each level's frontier in
turn; the drafter crops those levels off after the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .errors import GorgonError
from .masks import additive_mask
from .tree import MAX_TREE_NODES, best_first, tree_from_token_paths

# expand(level, parent, tokens, sees) -> (k, V) log-probabilities: see grow_tree
Expand = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def search_settings(depth: int, topk: int, level_cost: float) -> str:
    """How a drafter that searches builds its tree each step, as a report describes it."""
    stop = f", no deeper once chances sum below {level_cost:.2f}" if level_cost else ""
    return f"built per step (depth {depth}, top-k {topk}{stop})"


def check_search(depth: int, topk: int, nodes: int) -> None:
    """A search's settings, checked where they are set (config, command line, Python)."""
    if not (isinstance(depth, int) and depth >= 1):
        raise GorgonError(f"the draft depth must be a whole number >= 1 (levels drafted per step), not {depth!r}")
    if not (isinstance(topk, int) and topk >= 1):
        raise GorgonError(f"the draft top-k must be a whole number >= 1, not {topk!r}")
    if not (isinstance(nodes, int) and 2 <= nodes <= MAX_TREE_NODES):
        raise GorgonError(f"a tree needs 2 (the root and one candidate) to {MAX_TREE_NODES} nodes, not {nodes!r}")


class SearchDrafter:
    """What the drafters that grow their tree with this search share (an EAGLE head, a draft model):
    the tree's size, the proposal made from their `scored_paths`, and the level cost, checked wherever it is
    set (the options set it after the drafter is built, once it has been timed)."""

    nodes: int
    _level_cost = 0.0

    @property
    def max_nodes(self) -> int:
        return self.nodes

    @property
    def level_cost(self) -> float:
        """A drafted level's time in plain target steps (measured: `level_trial`): a step drafts no deeper once its
        frontier's chances sum below it (`can_grow`). 0 drafts every level the tree could use."""
        return self._level_cost

    @level_cost.setter
    def level_cost(self, value: float) -> None:
        if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise GorgonError(f"a draft level's cost is a finite number of target steps >= 0, not {value!r}")
        self._level_cost = value

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        return tree_from_token_paths(root, [path for path, _ in self.scored_paths(root, features, context)])


def grow_tree(first: torch.Tensor, expand: Expand, committed: int, depth: int, topk: int, nodes: int,
              mask_dtype: torch.dtype, to_target=None, level_cost: float = 0.0) -> list[tuple[list[int], float]]:
    """The best `nodes - 1` candidates after the root, best first, parents before children: each a token path
    with its draft confidence (the product of draft probabilities along it).

    `first`: (V,) log-probabilities of the root's children. `expand(level, parent, tokens, sees)` drafts the
    frontier at `level` (1: the root's children) in one forward and returns (k, V) log-probabilities of its
    nodes' children: `tokens` (k,) are the nodes' ids, `parent` (k,) the row of the previous call's output
    each node continues (at level 1, of the root's: all 0), `sees` (k, cache length) the additive mask
    (`mask_dtype`) over the cache: the `committed` entries, each node's fed ancestors and, last, itself.
    `to_target` maps the distribution's ids to the ids fed and returned (a draft vocabulary's; None: the same).
    `level_cost`: a level's drafting time in tokens the target decodes meanwhile (`can_grow`; 0: free).
    """
    def one_row(level, parent, tokens, sees):
        return expand(level, parent[0], tokens[0], sees[0])[None]

    sees = torch.zeros(1, committed, dtype=mask_dtype, device=first.device)
    return grow_trees(first[None], one_row, sees, depth, topk, nodes, to_target, level_cost)[0]


def grow_trees(first: torch.Tensor, expand: Expand, sees: torch.Tensor, depth: int, topk: int, nodes: int,
               to_target=None, level_cost: float = 0.0) -> list[list[tuple[list[int], float]]]:
    """`grow_tree` for R rows at once (a batch's requests), each row's tree its own: one `expand` a level drafts
    every row's frontier. `first` (R, V); `sees` (R, cache length): each row's additive mask over the cache
    before the first level; `expand` takes and returns each argument of `grow_tree`'s with a leading row
    dimension. A row whose search stops (`can_grow`) takes no node of the later levels the others draft."""
    device, to_target = first.device, to_target or (lambda ids: ids)
    rows = torch.arange(first.shape[0], device=device)[:, None]
    score, token = first.topk(min(topk, first.shape[-1]), dim=-1)                    # (R, k)
    frontier_tokens = to_target(token)
    # Per node, on the device: its parent (-1: the root), token and path log-probability; read once, after.
    node_parents, node_tokens, node_scores = [torch.full_like(token, -1)], [frontier_tokens], score
    frontier, frontier_scores = torch.arange(score.shape[1], device=device).expand_as(token), score  # to expand next
    parent = torch.zeros_like(token)
    sees = sees[:, None, :].expand(-1, score.shape[1], -1)
    itself = additive_mask(torch.eye(topk, dtype=torch.bool, device=device), sees.dtype)
    growing = None  # rows still searching (None: all, never asked)
    for level in range(1, depth):
        grows = can_grow(frontier_scores, node_scores, nodes - 1, level_cost)
        if grows is not None:
            growing = grows if growing is None else growing & grows
            if not growing.any():
                break
            frontier_scores = frontier_scores.masked_fill(~growing[:, None], -math.inf)  # its children never chosen
        k = frontier.shape[1]
        sees = torch.cat([sees, itself[:k, :k].expand(len(rows), k, k)], dim=2)
        child = expand(level, parent, frontier_tokens, sees)                          # (R, k, V)
        best, ids = child.topk(min(topk, child.shape[-1]), dim=-1)
        total = (frontier_scores[..., None] + best).flatten(1)
        frontier_scores, keep = total.topk(min(topk, total.shape[1]), dim=-1)
        parent = keep // best.shape[-1]                               # which frontier node each child is of
        frontier_tokens = to_target(ids.flatten(1).gather(1, keep))
        node_parents.append(frontier.gather(1, parent))
        node_tokens.append(frontier_tokens)
        frontier = node_scores.shape[1] + torch.arange(keep.shape[1], device=device).expand_as(keep)
        node_scores = torch.cat([node_scores, frontier_scores], dim=1)
        sees = sees[rows, parent]
    parents, tokens = torch.cat(node_parents, dim=1), torch.cat(node_tokens, dim=1)
    return [best_paths(parents[r], tokens[r], node_scores[r], nodes - 1) for r in range(first.shape[0])]


def best_paths(parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor,
               size: int) -> list[tuple[list[int], float]]:
    """The `size` best nodes, parents before children (`best_first`), best first, each as its token path with
    the chance exp(score); nodes are listed parents first."""
    rows = torch.stack([scores.double(), parents.double(), tokens.double()]).tolist()  # one wait for a GPU
    scores, parents, tokens = rows[0], [int(p) for p in rows[1]], [int(t) for t in rows[2]]
    paths: list[tuple[int, ...]] = []
    for p, token in zip(parents, tokens):
        paths.append((paths[p] if p >= 0 else ()) + (token,))
    chance = {path: score for path, score in zip(paths, scores) if score > -math.inf}  # not a stopped row's
    return [(list(path), math.exp(chance[path])) for path in best_first(chance, size)]


def can_grow(frontier_scores: torch.Tensor, scores: torch.Tensor, size: int,
             level_cost: float = 0.0) -> torch.Tensor | None:
    """Whether another level could change the tree and pay for itself, per row: (..., k) frontier scores and
    (..., N) scores of the nodes so far give (...) bools; None where nothing needs asking.

    Change: a child's score is never above its parent's, and a tie goes to the shallower node, so once
    the best frontier node scores no higher than the `size`-th best node so far, no child can enter the
    best `size`; stopping there leaves the tree exactly as it was. Pay: a node's children together are
    no likelier than it, so a level adds at most the frontier's summed chance in expected tokens; below
    `level_cost` (the tokens the target decodes in a level's drafting time) it, and every deeper one,
    costs more than it can bring. Both stops save the later levels on the many steps where the drafter
    is unsure. With no level cost and fewer nodes than `size` every level pays, and is not asked (each
    answer waits for a GPU)."""
    grows = frontier_scores.exp().sum(-1) >= level_cost if level_cost else None
    if scores.shape[-1] < size:
        return grows
    changes = frontier_scores.max(-1).values > scores.topk(size, dim=-1).values[..., -1]
    return changes if grows is None else grows & changes
