"""The EAGLE head as a drafter: a tree ranked by draft confidence, built anew each step (EAGLE-2).

Each step the head first takes in what the target accepted: the target's features at those
tokens, each paired with the token after it, go into the head's own KV cache (causal, like the
target's). From the last of them it grows the step's tree (`gorgon.heads.search`): each level a
masked forward of the head's layer over the frontier, each node reading the feature its parent's
forward drafted. Drafted levels are cached only for the step and cut off after it: the cache
holds the target's real features alone.

The tree's tokens are deterministic given the context, so the decoder's acceptance stays exact
under sampling (each candidate is a point-mass proposal).
"""

from __future__ import annotations

import copy
import math

import torch

from ...cache import cache_for_new_features, crop_cache, growing_cache
from ...drafter import check_same_device, dtype_name
from ...masks import additive_mask
from ...search import SearchDrafter, check_search, grow_tree, search_settings
from ...target import check_fits
from .model import EagleHead


class EagleDrafter(SearchDrafter):
    """`nodes`, `depth`, `topk`: the search's (None: those saved with the head, top-k widened to fill the
    tree); `level_cost`: `SearchDrafter.level_cost`."""

    def __init__(self, head: EagleHead, nodes: int | None = None, depth: int | None = None, topk: int | None = None,
                 level_cost: float = 0.0):
        device_type = next(head.parameters()).device.type
        self.head = head
        self.nodes = nodes if nodes is not None else head.saved_nodes(device_type)
        self.depth = depth if depth is not None else head.config.depth
        check_search(self.depth, head.config.topk if topk is None else topk, self.nodes)  # before any widening
        self.topk = topk if topk is not None else filling_topk(head.config.topk, self.depth, self.nodes)
        self.level_cost = level_cost
        self.feature_layers = head.feature_layers
        self.cache, self.committed = None, 0

    def fresh(self) -> "EagleDrafter":
        """The same head and search with an empty cache of its own: one per row of a batch."""
        twin = copy.copy(self)
        twin.cache, twin.committed = None, 0
        return twin

    def check_target(self, model) -> None:
        """The head reads the target's hidden states: other shapes or another device would fail inside torch
        at the first step (another dtype is cast: bfloat16 drafts for a float32 target)."""
        check_fits(self.head.config, model.config.get_text_config())
        check_same_device(self.head, model, "the head")

    def settings(self) -> dict:
        return {"tree": search_settings(self.depth, self.topk, self.level_cost), "draft_dtype": dtype_name(self.head)}

    @torch.no_grad()
    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The step's best `nodes - 1` candidates, best first, parents before children: each a token path
        under the root with its draft confidence (the product of draft probabilities along it)."""
        head, device = self.head, root.device
        n, m = context.numel(), features.shape[0]
        start = n - m  # the cache must hold the context before the new features
        self.cache = cache_for_new_features(self.cache, self.committed, n, m)
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
        # 2. Grow the tree from the last output: each level's frontier reads the feature its parent drafted.
        drafted = out[-1:]

        def expand(level, parent, tokens, sees):
            nonlocal drafted
            rope = (cos[:, m + level - 1:m + level], sin[:, m + level - 1:m + level])  # one position for all
            drafted = head.layer(drafted[parent][None], tokens[None], rope, sees[None, None], self.cache)[0]
            return head.logits(drafted).float().log_softmax(-1)

        first = head.logits(out[-1:]).float().log_softmax(-1)[0]
        paths = grow_tree(first, expand, n, self.depth, self.topk, self.nodes, dtype, head.to_target_ids,
                          self.level_cost)
        crop_cache(self.cache, self.committed)
        return paths

    def level_trial(self, context: int):
        """One level of this drafter's search to time (`gorgon.decode.calibrate.drafted_level_cost`): `level()` runs
        the head's layer over `topk` drafted features after `context` cached ones, its logits and their
        log-probabilities; `reset()` cuts them off the cache again."""
        head, rows = self.head, self.topk
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        features = torch.randn(1, context + rows, head.config.hidden_size, dtype=dtype, device=device)
        tokens = torch.randint(0, head.config.vocab_size, (1, context + rows), device=device)
        cos, sin = head.rope(torch.arange(context + rows, device=device)[None], dtype)
        causal = additive_mask(torch.ones(context, context, dtype=torch.bool, device=device).tril(), dtype)
        sees = torch.zeros(1, 1, rows, context + rows, dtype=dtype, device=device)
        cache = growing_cache()
        head.layer(features[:, :context], tokens[:, :context], (cos[:, :context], sin[:, :context]),
                   causal[None, None], cache)

        def level():
            drafted = head.layer(features[:, context:], tokens[:, context:], (cos[:, context:], sin[:, context:]),
                                 sees, cache)
            head.logits(drafted).float().log_softmax(-1)

        return level, lambda: crop_cache(cache, context)


def filling_topk(saved: int, depth: int, nodes: int) -> int:
    """The search's top-k when none is asked for: the saved one, widened until `depth` levels of `topk`
    candidates can fill the tree's `nodes - 1`. A GPU verifies 64 nodes for about the price of one, and
    a level costs the same host time however many rows it drafts, so the wider search is free there;
    the CPU's few nodes leave the saved top-k as it is. (All 80 MT-Bench questions, the recipe's head
    merged with context drafts, 64 nodes, depth 4: tau 2.46 at top-k 4, 2.62 at 8, 2.75 at 16.)"""
    return max(saved, math.ceil((nodes - 1) / depth))
