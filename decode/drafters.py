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
from .verify import crop_cache


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
        choices = heads.config.draft_vocab_size or heads.config.vocab_size
        if self.tree.max_rank > choices:
            raise GorgonError(f"the tree asks for rank {self.tree.max_rank - 1} but the heads draft from {choices} "
                              f"tokens: use ranks below {choices}")

    def propose(self, root: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.tree.tokens(root, self.heads.draft_topk(hidden, self.tree.max_rank))


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


# A longer chain is all but never accepted whole, and each drafted token costs a draft forward.
MAX_DRAFT_TOKENS = 64


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer proposes a chain of k tokens, greedily, with
    its own KV cache (classic draft-then-verify). The target verifies the chain in one forward
    and the same acceptance rules apply, so output stays exact.

    Between steps the draft's cache is cut back to the longest prefix it shares with the
    accepted tokens, and only the new tokens are fed: usually the accepted drafts and the bonus.
    """

    def __init__(self, draft_model, k: int = 4):
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise GorgonError(f"a draft model proposes 1 to {MAX_DRAFT_TOKENS} tokens per step, not {k}")
        self.model = draft_model
        self.tree = build_tree([[0] * d for d in range(1, k + 1)]).to(draft_model.device)
        self.cache = None
        self.seen = torch.empty(0, dtype=torch.long, device=draft_model.device)  # tokens in self.cache

    def check_vocab(self, target_model) -> "DraftModelDrafter":
        """Refuse a draft whose vocabulary differs from the target's (its token ids would mean other text)."""
        mine, theirs = self.model.config.get_text_config().vocab_size, target_model.config.get_text_config().vocab_size
        if mine != theirs:
            raise GorgonError(f"the draft model's vocabulary ({mine}) differs from the target's ({theirs}): "
                              "use a draft that shares the target's tokenizer")
        return self

    @torch.no_grad()
    def propose(self, root: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        n = min(self.seen.numel(), context.numel() - 1)  # always feed at least the newest token
        same = int((self.seen[:n] == context[:n]).cumprod(0).sum()) if n else 0
        if self.cache is None or same == 0:
            self.cache, same = DynamicCache(), 0
        crop_cache(self.cache, same)
        fed = context[same:]
        drafts = []
        for _ in range(self.tree.max_depth):
            logits = self.model(input_ids=fed[None], past_key_values=self.cache, use_cache=True,
                                logits_to_keep=1).logits[0, -1]  # no LM head over a re-fed prompt
            fed = logits.argmax(-1, keepdim=True)
            drafts.append(fed)
        self.seen = torch.cat([context] + drafts[:-1])  # the last draft was never fed
        return self.tree.tokens(root, torch.stack(drafts))
