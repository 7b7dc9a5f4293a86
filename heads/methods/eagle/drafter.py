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
from torch.nn.utils.rnn import pad_sequence

from ...cache import cache_for_new_features, crop_cache, growing_cache, stacked_cache
from ...drafter import check_same_device, dtype_name
from ...masks import additive_mask
from ...search import SearchDrafter, check_search, grow_trees, search_settings
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

    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The step's best `nodes - 1` candidates, best first, parents before children: each a token path
        under the root with its draft confidence (the product of draft probabilities along it)."""
        return self.scored_paths_together([self], [root], [features], [context])[0]

    @staticmethod
    @torch.no_grad()
    def scored_paths_together(drafters: list["EagleDrafter"], roots: list[torch.Tensor], features: list[torch.Tensor],
                              contexts: list[torch.Tensor]) -> list[list[tuple[list[int], float]]]:
        """Each drafter's `scored_paths`, for the rows of a batch (`fresh` twins of one drafter, each with its own
        cache) drafted together: one forward of the head takes in every row's accepted tokens, and one drafts each
        level of every row's tree, where row by row each row paid for its own. The rows' caches are stacked for
        the step (`stacked_cache`: a row's entries, then room its mask hides) and what each row took in is written
        back to its own; a single row drafts in its own cache."""
        first_drafter, rows = drafters[0], len(drafters)
        head, device = first_drafter.head, roots[0].device
        depth, dtype = first_drafter.depth, head.fc.weight.dtype
        context_lengths = [context.numel() for context in contexts]
        new = [f.shape[0] for f in features]
        held = [n - m for n, m in zip(context_lengths, new)]  # what each row's cache must hold before the step
        for drafter, n, m in zip(drafters, context_lengths, new):
            drafter.cache = cache_for_new_features(drafter.cache, drafter.committed, n, m)
        cache = first_drafter.cache if rows == 1 else stacked_cache([d.cache for d in drafters], held)
        past, width = max(held), max(new)
        held_t, new_t, lengths_t = (torch.tensor(v, device=device) for v in (held, new, context_lengths))
        # One rotary call for the step: each row's accepted tokens' positions, then one per drafted level.
        steps = torch.arange(width, device=device)
        positions = torch.cat([held_t[:, None] + steps, lengths_t[:, None] + torch.arange(depth - 1, device=device)], 1)
        cos, sin = head.rope(positions, dtype)
        # 1. Take in the accepted tokens: the feature at p with the token at p + 1 (the root after the last); each
        # sees its row's cache and the row's tokens up to itself (a shorter row's padding: never read).
        tokens = pad_sequence([torch.cat([c[h + 1:], r.reshape(1)]) for c, h, r in zip(contexts, held, roots)],
                              batch_first=True)
        real = steps < new_t[:, None]                                                    # (rows, width)
        own = (torch.arange(past, device=device) < held_t[:, None])                      # (rows, past)
        allowed = torch.cat([own[:, None].expand(-1, width, -1),
                             torch.ones(width, width, dtype=torch.bool, device=device).tril() & real[:, None]], 2)
        out = head.layer(head.fc(pad_sequence(features, batch_first=True).to(dtype)), tokens,
                         (cos[:, :width], sin[:, :width]), additive_mask(allowed, dtype)[:, None], cache)
        if rows > 1:
            layer = cache.layers[0]
            for r, (drafter, m) in enumerate(zip(drafters, new)):
                drafter.cache.update(layer.keys[r:r + 1, :, past:past + m], layer.values[r:r + 1, :, past:past + m], 0)
        for drafter, n in zip(drafters, context_lengths):
            drafter.committed = n
        # 2. Grow the trees from each row's last output: each level's frontier reads the feature its parent drafted.
        index = torch.arange(rows, device=device)[:, None]
        drafted = out[index, new_t[:, None] - 1]                                         # (rows, 1, H)

        def expand(level, parent, tokens, sees):
            nonlocal drafted
            at = width + level - 1  # one position a row for all its level's nodes
            drafted = head.layer(drafted[index, parent], tokens, (cos[:, at:at + 1], sin[:, at:at + 1]), sees[:, None],
                                 cache)
            return head.logits(drafted).float().log_softmax(-1)

        first = head.logits(drafted[:, 0]).float().log_softmax(-1)
        paths = grow_trees(first, expand, additive_mask(torch.cat([own, real], 1), dtype), depth, first_drafter.topk,
                           first_drafter.nodes, head.to_target_ids, first_drafter.level_cost)
        if rows == 1:
            crop_cache(cache, first_drafter.committed)  # the drafted levels (rows > 1 drafted in a stacked copy)
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
