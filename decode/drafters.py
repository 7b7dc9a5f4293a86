"""Drafters propose the candidate tree; the decoder verifies and accepts whatever they propose.

A drafter has a `tree` (the shape of what it proposes) and `propose(root, hidden, context)`,
which returns one token per tree node, the root first. Verification and acceptance are
written once, in `gorgon.decode.generate`, for every drafter.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gorgon.heads.errors import GorgonError
from gorgon.heads.model import MedusaHeads

from .tree import REFERENCE_ACCURACIES, Tree, build_tree, default_tree, tree_from_accuracies


class Drafter(Protocol):
    tree: Tree

    def propose(self, root: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Tokens for every tree node. root: the next token (scalar); hidden: the target's
        last hidden state at the last accepted token (H,); context: all tokens so far (n,)."""


class HeadsDrafter:
    """Medusa heads: one pass of the heads over the last accepted hidden state gives each
    head's top-k, and node tokens are read off by (depth, rank). The heads never run on the
    other tree nodes."""

    def __init__(self, heads: MedusaHeads, tree=None):
        device = next(heads.parameters()).device
        self.heads = heads
        self.tree = build_tree(pick_tree(heads, tree, device.type)).to(device)
        if self.tree.max_depth > heads.config.num_heads:
            raise GorgonError(f"the tree is {self.tree.max_depth} deep but there are only {heads.config.num_heads} "
                              f"heads: use a tree at most {heads.config.num_heads} deep")

    def propose(self, root: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        logits = self.heads(hidden)                                  # (K, V)
        topk = logits.topk(self.tree.max_rank, dim=-1).indices
        return self.tree.tokens(root, topk)


def pick_tree(heads: MedusaHeads, tree, device_type: str) -> list[list[int]]:
    """An explicit list of paths wins; a number N is the best N-node tree from the heads' measured
    accuracies (or the reference ones); then the tree saved with the heads for this device; then a default."""
    if isinstance(tree, list):
        return tree
    if isinstance(tree, int):
        accuracies = heads.trees.get("accuracies") or REFERENCE_ACCURACIES
        return tree_from_accuracies(accuracies[: heads.config.num_heads], tree)
    if tree not in (None, "auto"):
        raise GorgonError(f"unknown tree {tree!r}: pass a list of rank paths, a node count, a JSON file, or 'auto'")
    saved = heads.trees.get(device_type) or heads.trees.get("cpu")
    return saved or default_tree(heads.config.num_heads, device_type)
