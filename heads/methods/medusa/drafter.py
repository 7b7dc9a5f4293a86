"""Medusa heads as a drafter: one pass of the heads over the last accepted hidden state gives
each head's top-k, and the tree's node tokens are read off by (depth, rank)."""

from __future__ import annotations

import torch

from ...drafter import dtype_name
from ...errors import GorgonError
from ...target import check_fits
from ...tree import build_tree, path_chance, token_paths, tree_from_accuracies
from .model import NODES, MedusaHeads

# Used when the heads were saved without trees: the tree built from a head-accuracy profile
# shaped like Medusa-1's published Vicuna-7B heads (top-1 0.56, 0.32, 0.20, 0.15 for heads
# 1-4), with later ranks taking a falling share. Training replaces it with measured accuracies.
REFERENCE_ACCURACIES = [
    [0.56, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01],
    [0.32, 0.10, 0.05, 0.03, 0.02, 0.015, 0.01, 0.01],
    [0.20, 0.08, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01],
    [0.15, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01],
    [0.12, 0.05, 0.03, 0.02, 0.02, 0.015, 0.01, 0.01],
]


class MedusaDrafter:
    """Proposes a fixed tree of rank paths from the heads' top-k. The heads never run on the other tree nodes."""

    feature_layers = None  # the target's last hidden state

    def __init__(self, heads: MedusaHeads, tree=None):
        weight = next(heads.parameters())
        device = weight.device
        shares = heads.lm_heads is None and heads.target is not None  # `is not None`: a compiled model has no len
        shared = heads.target.get_output_embeddings().weight if shares else None
        if shared is not None and shared.dtype != weight.dtype:
            raise GorgonError(f"the heads are in {weight.dtype} but the target's lm_head they share in "
                              f"{shared.dtype}: keep them in the target's dtype (heads.to({shared.dtype}))")
        self.heads = heads
        self.tree = build_tree(pick_tree(heads, tree, device.type)).to(device)
        if self.tree.max_depth > heads.config.num_heads:
            raise GorgonError(f"the tree is {self.tree.max_depth} deep but there are only {heads.config.num_heads} "
                              f"heads: use a tree at most {heads.config.num_heads} deep")
        accuracies = heads.accuracies or REFERENCE_ACCURACIES
        self.chances = [path_chance(accuracies, ranks) for ranks in self.tree.paths]
        choices = heads.config.draft_vocab_size or heads.config.vocab_size
        if self.tree.topk_needed > choices:
            raise GorgonError(f"the tree asks for rank {self.tree.topk_needed - 1} but the heads draft from {choices} "
                              f"tokens: use ranks below {choices}")

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    def check_target(self, model) -> None:
        """The heads read the target's hidden states as they are: other shapes, another dtype or another
        device would fail inside torch at the first step."""
        check_fits(self.heads.config, model.config.get_text_config())
        weight, theirs = next(self.heads.parameters()), model.get_output_embeddings().weight
        if (weight.dtype, weight.device) != (theirs.dtype, theirs.device):
            raise GorgonError(f"the heads are in {weight.dtype} on {weight.device} but the target in {theirs.dtype} "
                              f"on {theirs.device}: move them to the target's (heads.to({theirs.device.type!r}, "
                              f"{theirs.dtype}))")

    def settings(self) -> dict:
        return {"tree": [list(p) for p in self.tree.paths], "draft_dtype": dtype_name(self.heads)}

    def fresh(self) -> "MedusaDrafter":
        """Itself: the heads keep nothing between steps, so every row of a batch can share it."""
        return self

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        """The heads read the hidden state at the last accepted token only."""
        return self.tree.tokens(root, self.heads.draft_topk(features[-1], self.tree.topk_needed)), self.tree

    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The tree's candidates as token paths, each with its chance from the heads' held-out accuracies
        (the reference ones for heads saved without): the same for every step."""
        tokens, tree = self.propose(root, features, context)
        return [(list(path), chance) for path, chance in zip(token_paths(tokens, tree), self.chances)]


def pick_tree(heads: MedusaHeads, tree, device_type: str) -> list[list[int]]:
    """An explicit list of paths wins; a number N is the best N-node tree from the heads' measured
    accuracies (or the reference ones); then the tree saved with the heads for this device; then a default."""
    if isinstance(tree, list):
        return tree
    if isinstance(tree, int):
        accuracies = heads.accuracies or REFERENCE_ACCURACIES
        return tree_from_accuracies(accuracies[: heads.config.num_heads], tree)
    if tree not in (None, "auto"):
        raise GorgonError(f"unknown tree {tree!r}: pass a list of rank paths (a JSON file of them: json.load it), a "
                          "node count or 'auto'")
    return heads.saved_tree(device_type) or default_tree(heads.config.num_heads, device_type)


def default_tree(num_heads: int, device_type: str) -> list[list[int]]:
    """A tree sized for the device (a verify forward is far cheaper per token on a GPU)."""
    return tree_from_accuracies(REFERENCE_ACCURACIES[:num_heads], NODES.get(device_type, NODES["cpu"]))
