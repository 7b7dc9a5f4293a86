"""Self-speculation as a drafter: a tree grown by the target's own first layers, in the target's own cache.

Each step the root, then each level's frontier, goes through the target's layers 0 .. N - 1 with a tree
mask, their keys and values appended to those layers of the target's cache (the later layers are not
touched), and the exit turns each node's layer-N state into its children's chances; the search
(`gorgon.heads.search`) picks what to expand and the tree. The drafter leaves `drafted`
(`gorgon.heads.layers.DraftedLayers`): which nodes those layers now hold, and their layer-N states, so
verification runs only the layers from N on over them (and the first layers over the nodes the draft never
fed: the last level's, context drafts merged in), then keeps the accepted path in every layer. Nothing
drafted survives a rejection: the first layers are cut back with the rest.

The tree's tokens are fixed by the context, so every candidate is a point-mass proposal and sampling stays
exact.
"""

from __future__ import annotations

import torch

from ...cache import crop_cache, growing_cache
from ...drafter import check_same_device, dtype_name
from ...errors import GorgonError
from ...layers import DraftedLayers, check_splits, embed, run_layers
from ...masks import additive_mask
from ...search import SearchDrafter, check_search, grow_tree, search_settings
from .model import EarlyExit


class SelfSpecDrafter(SearchDrafter):
    """`nodes`, `depth`, `topk`: the search's (None: those saved with the exit); `level_cost`:
    `SearchDrafter.level_cost` (a level here runs N of the target's L layers: a large share of a step)."""

    feature_layers = None  # it reads the target's cache, not its features

    def __init__(self, exit_: EarlyExit, nodes: int | None = None, depth: int | None = None, topk: int | None = None,
                 level_cost: float = 0.0):
        self.exit = exit_
        device_type = next(exit_.parameters()).device.type
        self.nodes = nodes if nodes is not None else exit_.saved_nodes(device_type)
        self.depth = depth if depth is not None else exit_.config.depth
        self.topk = topk if topk is not None else exit_.config.topk
        check_search(self.depth, self.topk, self.nodes)
        self.level_cost = level_cost
        self.cache, self.drafted = None, None

    def check_target(self, model) -> None:
        """The exit runs on the very target it was attached to, whose forward must split at its layer."""
        if self.exit.target is not model:
            raise GorgonError("a self-speculation exit drafts with the target it was loaded on: load it with "
                              "load_heads(target, folder), or call exit.attach(model) on this target")
        check_same_device(self.exit, model, "the exit")
        check_splits(model, self.exit.exit_layer)

    def attach_cache(self, cache) -> None:
        """The target's KV cache, after its prefill: the draft writes its first layers."""
        self.cache, self.drafted = cache, None

    def settings(self) -> dict:
        return {"tree": search_settings(self.depth, self.topk, self.level_cost), "draft_dtype": dtype_name(self.exit),
                "exit_layer": self.exit.exit_layer}

    @torch.no_grad()
    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The step's best `nodes - 1` candidates, best first, parents before children, each a token path under
        the root with its draft confidence; `drafted` says what the target's first layers now hold."""
        if self.cache is None:
            raise GorgonError("the self-speculation drafter writes the target's cache: speculative_generate gives it "
                              "(attach_cache) after the prefill")
        model, n = self.exit.target, self.exit.exit_layer
        past, device = context.numel(), root.device
        crop_cache(self.cache, past, n)  # an earlier proposal's drafts, never verified
        dtype = model.get_input_embeddings().weight.dtype
        key_positions = [torch.arange(past + 1, device=device)]  # the context, then the root

        def keys():
            return torch.cat(key_positions)

        sees = torch.zeros(1, past + 1, dtype=dtype, device=device)
        hidden = run_layers(model, embed(model, root.reshape(1)), 0, n, sees, key_positions[0][-1:], self.cache,
                            keys)[0]
        paths, states, frontier = [()], [hidden], [()]

        def expand(level, parent, tokens, sees):
            nonlocal frontier
            key_positions.append(torch.full((tokens.numel(),), past + level, device=device))
            out = run_layers(model, embed(model, tokens), 0, n, sees, key_positions[-1], self.cache, keys)[0]
            frontier = [frontier[p] + (t,) for p, t in zip(parent.tolist(), tokens.tolist())]
            paths.extend(frontier)
            states.append(out)
            return self.exit.logits(out).float().log_softmax(-1)

        first = self.exit.logits(hidden).float().log_softmax(-1)[0]
        best = grow_tree(first, expand, past + 1, self.depth, self.topk, self.nodes, dtype, self.exit.to_target_ids,
                         self.level_cost)
        self.drafted = DraftedLayers(n, past, paths, torch.cat(states))
        return best

    def level_trial(self, context: int):
        """One level to time (`gorgon.decode.calibrate.drafted_level_cost`): `topk` tokens through the target's
        first N layers after `context` cached ones, and the exit's log-probabilities; `reset()` cuts them off."""
        model, n, rows = self.exit.target, self.exit.exit_layer, self.topk
        device = model.get_input_embeddings().weight.device
        dtype = model.get_input_embeddings().weight.dtype
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (context + rows,), device=device)
        positions = torch.arange(context, device=device)
        causal = additive_mask(torch.ones(context, context, dtype=torch.bool, device=device).tril(), dtype)
        cache = growing_cache()
        run_layers(model, embed(model, ids[:context]), 0, n, causal, positions, cache, lambda: positions)
        level_positions = torch.full((rows,), context, device=device)
        sees = torch.zeros(rows, context + rows, dtype=dtype, device=device)

        def level():
            out = run_layers(model, embed(model, ids[context:]), 0, n, sees, level_positions, cache,
                             lambda: torch.cat([positions, level_positions]))
            self.exit.logits(out[0]).float().log_softmax(-1)

        return level, lambda: crop_cache(cache, context)
