"""The feature-level head as a drafter: a tree ranked by draft confidence, built anew each step (EAGLE-2).

Each step the head first takes in what the target accepted: the target's features at those
tokens, each paired with the token after it, go into the head's own KV cache (causal, like the
target's). From the last of them it drafts the first level: its `topk` most likely tokens. Each
further level expands the `topk` best nodes so far (by the product of draft probabilities along
their path) with their own `topk` children, for `depth` levels; the best `nodes - 1` nodes overall
become the tree (a child is never likelier than its parent, so they form one); the expansion stops
early once no deeper node could enter it. Drafted levels are cached only for the step and cut off
after it: the cache holds the target's real features alone.

The tree's tokens are deterministic given the context, so the decoder's acceptance stays exact
under sampling (each candidate is a point-mass proposal).
"""

from __future__ import annotations

import math

import torch

from ..errors import GorgonError
from ..target import additive_mask, crop_cache
from ..tree import tree_from_token_paths
from .model import EagleHead, check_search


class EagleDrafter:
    def __init__(self, head: EagleHead, nodes: int | None = None, depth: int | None = None, topk: int | None = None):
        device_type = next(head.parameters()).device.type
        self.head = head
        self.nodes = nodes if nodes is not None else head.saved_tree(device_type)
        self.depth = depth if depth is not None else head.config.depth
        check_search(self.depth, head.config.topk if topk is None else topk, self.nodes)  # before any widening
        self.topk = topk if topk is not None else filling_topk(head.config.topk, self.depth, self.nodes)
        self.feature_layers = head.feature_layers
        self.cache, self.committed = None, 0

    @property
    def max_nodes(self) -> int:
        return self.nodes

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        return tree_from_token_paths(root, [path for path, _ in self.scored_paths(root, features, context)])

    @torch.no_grad()
    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The step's best `nodes - 1` candidates, best first, parents before children: each a token path
        under the root with its draft confidence (the product of draft probabilities along it)."""
        from transformers import DynamicCache

        head, device = self.head, root.device
        n, m = context.numel(), features.shape[0]
        start = n - m  # the cache must hold the context before the new features
        if self.cache is None or start == 0 or self.committed < start:
            if start != 0:
                raise GorgonError(f"the drafter holds {self.committed} tokens of context but was given features for "
                                  f"the last {m} of {n}: pass the features of every token accepted since its last "
                                  "call (the whole prompt at the first)")
            self.cache = DynamicCache()  # a new prompt
        crop_cache(self.cache, start)  # proposing again on the same context recommits its last tokens
        dtype = head.fc.weight.dtype
        # One rotary call for the step: the accepted tokens' positions, then one per drafted level.
        cos, sin = head.rope(torch.arange(start, n + self.depth - 1, device=device)[None], dtype)
        # 1. Take in the accepted tokens: the feature at p with the token at p + 1 (the root after the last).
        tokens = torch.cat([context[start + 1:], root.reshape(1)])
        allowed = torch.ones(n - start, n, dtype=torch.bool, device=device)
        allowed[:, start:] = torch.ones(n - start, n - start, dtype=torch.bool, device=device).tril()
        out = head.layer(head.fc(features.to(dtype))[None], tokens[None], (cos[:, :m], sin[:, :m]),
                         additive_mask(allowed, dtype)[None, None], self.cache)[0]
        self.committed = n
        # 2. Expand level by level from the last output. Per node, on the device: its parent (-1: the root),
        #    draft token and path log-probability; the host reads them once, after the search.
        logp = head.logits(out[-1:]).float().log_softmax(-1)[0]
        score, token = logp.topk(min(self.topk, logp.numel()))
        frontier_tokens = head.to_target_ids(token)  # nodes hold target ids: the head embeds them as the target does
        node_parents, node_tokens, node_scores = [torch.full_like(token, -1)], [frontier_tokens], score
        frontier, frontier_scores = torch.arange(score.numel(), device=device), score  # the nodes to expand next
        frontier_feature = out[-1:].expand(score.numel(), -1)           # the feature each of them reads
        # What each frontier node sees in the cache, as an additive mask: the context, its expanded
        # ancestors and, fed after the nodes expanded so far, itself (the diagonal of `itself`).
        sees = torch.zeros(score.numel(), n, dtype=dtype, device=device)
        itself = additive_mask(torch.eye(self.topk, dtype=torch.bool, device=device), dtype)
        for level in range(1, self.depth):
            if not can_grow(frontier_scores, node_scores, self.nodes - 1):
                break
            k = frontier.numel()
            sees = torch.cat([sees, itself[:k, :k]], dim=1)
            rope = (cos[:, m + level - 1:m + level], sin[:, m + level - 1:m + level])  # one position for all k
            out = head.layer(frontier_feature[None], frontier_tokens[None], rope, sees[None, None], self.cache)[0]
            child = head.logits(out).float().log_softmax(-1)                              # (k, V_draft)
            best, ids = child.topk(min(self.topk, child.shape[-1]), dim=-1)
            total = (frontier_scores[:, None] + best).flatten()
            frontier_scores, keep = total.topk(min(self.topk, total.numel()))
            parent = keep // best.shape[1]                                # which frontier node each child is of
            frontier_tokens = head.to_target_ids(ids.flatten()[keep])
            node_parents.append(frontier[parent])
            node_tokens.append(frontier_tokens)
            frontier = node_scores.numel() + torch.arange(keep.numel(), device=device)
            node_scores = torch.cat([node_scores, frontier_scores])
            frontier_feature, sees = out[parent], sees[parent]
        crop_cache(self.cache, self.committed)
        # 3. The best nodes, parents before children (ties go to the shallower node), as a tree whose
        #    siblings are ranked by score.
        scores = node_scores.tolist()
        parents, tokens_host = torch.stack([torch.cat(node_parents), torch.cat(node_tokens)]).tolist()
        depth_of = [0] * len(parents)
        for i, p in enumerate(parents):
            depth_of[i] = 1 if p < 0 else depth_of[p] + 1
        chosen: dict[int, None] = {}  # ordered, best first
        for i in sorted(range(len(parents)), key=lambda i: (-scores[i], depth_of[i])):
            if len(chosen) >= self.nodes - 1:
                break
            if parents[i] < 0 or parents[i] in chosen:
                chosen[i] = None

        def token_path(i: int) -> list[int]:
            return token_path(parents[i]) + [tokens_host[i]] if i >= 0 else []

        return [(token_path(i), math.exp(scores[i])) for i in chosen]


def filling_topk(saved: int, depth: int, nodes: int) -> int:
    """The search's top-k when none is asked for: the saved one, widened until `depth` levels of `topk`
    candidates can fill the tree's `nodes - 1`. A GPU verifies 64 nodes for about the price of one, and
    a level costs the same host time however many rows it drafts, so the wider search is free there;
    the CPU's few nodes leave the saved top-k as it is. (All 80 MT-Bench questions, the recipe's head
    merged with context drafts, 64 nodes, depth 4: tau 2.46 at top-k 4, 2.62 at 8, 2.75 at 16.)"""
    return max(saved, math.ceil((nodes - 1) / depth))


def can_grow(frontier_scores: torch.Tensor, scores: torch.Tensor, size: int) -> bool:
    """Whether another level could change the tree: a child's score is never above its parent's, and a
    tie goes to the shallower node, so once the best frontier node scores no higher than the `size`-th
    best node so far, no child can enter the best `size`. Stopping there saves the draft layer's later
    levels on the many steps where the head is unsure, and leaves the tree exactly as it was."""
    if scores.numel() < size:
        return True
    return bool(frontier_scores.max() > scores.topk(size).values[-1])
