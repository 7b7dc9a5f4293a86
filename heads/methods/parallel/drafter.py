"""The parallel drafter: one forward a step, then a fixed tree of rank paths over the block's candidates.

Each step the drafter takes in what the target accepted (the target's features at those tokens, each
paired with the token after it, into its own KV cache, as the EAGLE head's drafter does) and,
in the same forward, the block's k - 1 mask positions; the mask positions' keys are cut off the cache
after the step, so it holds the target's real features alone. Position j's top candidates stand for
the token j + 1 places after the root whatever is drafted before it (the positions see mask vectors,
not each other's drafts), so the candidates form a tree of rank paths as Medusa's heads do: the best
tree of N nodes from the measured per-position accuracies (`tree_from_accuracies`), or a chain of the
top-1 of each position. Each candidate is a point-mass proposal, so sampling stays exact.
"""

from __future__ import annotations

import copy

import torch

from ...cache import cache_for_new_features, crop_cache
from ...drafter import check_same_device, dtype_name
from ...errors import GorgonError
from ...masks import additive_mask
from ...target import check_fits
from ...tree import build_tree, token_paths, tree_from_accuracies
from .model import ParallelHead

# A node count for a drafter never measured (no held-out accuracies): rank r of every position taken as right
# with chance 2 ** -(r + 1), so the tree spends its nodes on a chain and the likeliest second choices.
UNMEASURED = [2.0 ** -(r + 1) for r in range(8)]


class ParallelDrafter:
    """`tree`: rank paths, a node count (the best tree of that size), or None / "auto" (the tree of the size saved
    for this device type, from the measured accuracies; a chain of the whole block when none were measured)."""

    def __init__(self, head: ParallelHead, tree=None):
        device = next(head.parameters()).device
        self.head = head
        self.tree = build_tree(pick_tree(head, tree, device.type)).to(device)
        k = head.config.block_size
        if self.tree.max_depth > k:
            raise GorgonError(f"the tree is {self.tree.max_depth} deep but the drafter drafts a block of {k}: use a "
                              f"tree at most {k} deep")
        choices = head.config.draft_vocab_size or head.config.vocab_size
        if self.tree.topk_needed > choices:
            raise GorgonError(f"the tree asks for rank {self.tree.topk_needed - 1} but the drafter drafts from "
                              f"{choices} tokens: use ranks below {choices}")
        self.feature_layers = head.feature_layers
        self.cache, self.committed = None, 0

    def fresh(self) -> "ParallelDrafter":
        """The same head and tree with an empty cache of its own: one per row of a batch."""
        twin = copy.copy(self)
        twin.cache, twin.committed = None, 0
        return twin

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    def check_target(self, model) -> None:
        """Other shapes or another device would fail inside torch at the first step (another dtype is cast)."""
        check_fits(self.head.config, model.config.get_text_config())
        check_same_device(self.head, model, "the parallel drafter")

    def settings(self) -> dict:
        return {"tree": [list(p) for p in self.tree.paths], "draft_dtype": dtype_name(self.head)}

    @torch.no_grad()
    def block(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """(k, V) log-probabilities of the block's positions over the draft vocabulary, from one forward that also
        takes in the features of the tokens accepted since the last call."""
        head, device = self.head, root.device
        n, m, k = context.numel(), features.shape[0], head.config.block_size
        start = n - m  # the cache must hold the context before the new features
        self.cache = cache_for_new_features(self.cache, self.committed, n, m)
        dtype = head.mask_hidden.dtype
        tokens = torch.cat([context[start + 1:], root.reshape(1)])  # the feature at p with the token at p + 1
        fed, embedded = head.inputs(features[None], tokens[None], k - 1)
        positions = torch.arange(start, n + k - 1, device=device)
        causal = torch.arange(n + k - 1, device=device)[None] <= positions[:, None]
        out = head.layer(fed, embedded, head.rope(positions[None], dtype), additive_mask(causal, dtype)[None, None],
                         self.cache)[0]
        self.committed = n
        crop_cache(self.cache, n)  # the mask positions were for this step only
        return head.logits(out[m - 1:]).float().log_softmax(-1)

    def ranked(self, root, features, context) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's best `topk_needed` log-probabilities and target token ids, (k, topk) each."""
        scores, ids = self.block(root, features, context).topk(self.tree.topk_needed, dim=-1)
        return scores, self.head.to_target_ids(ids)

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        return self.tree.tokens(root, self.ranked(root, features, context)[1]), self.tree

    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The tree's candidates as token paths, each with its draft confidence this step (the product of its
        positions' draft probabilities), for merging with context drafts."""
        scores, ids = self.ranked(root, features, context)
        tokens, host = self.tree.tokens(root, ids), scores.exp().tolist()
        chances = []
        for ranks in self.tree.paths:
            chance = 1.0
            for position, rank in enumerate(ranks):
                chance *= host[position][rank]
            chances.append(chance)
        return [(list(path), chance) for path, chance in zip(token_paths(tokens, self.tree), chances)]


def pick_tree(head: ParallelHead, tree, device_type: str) -> list[list[int]]:
    """An explicit list of rank paths wins; a number N is the best N-node tree from the measured accuracies; None
    or "auto", the saved size's for this device, or the block's top-1 chain when nothing was measured."""
    k = head.config.block_size
    if isinstance(tree, list):
        return tree
    accuracies = head.accuracies or [UNMEASURED] * k
    if isinstance(tree, int) and not isinstance(tree, bool):
        return tree_from_accuracies(accuracies[:k], tree)
    if tree not in (None, "auto"):
        raise GorgonError(f"unknown tree {tree!r}: pass a list of rank paths, a node count or 'auto'")
    if head.accuracies:
        return tree_from_accuracies(accuracies[:k], head.saved_nodes(device_type))
    return [[0] * depth for depth in range(1, k + 1)]
