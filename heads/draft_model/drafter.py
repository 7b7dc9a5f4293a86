"""A draft model as a drafter: it proposes a greedy chain of tokens, the target verifies them in one forward."""

from __future__ import annotations

import torch

from ..errors import GorgonError
from ..target import crop_cache, with_cache
from ..tree import build_tree
from .model import check_draft_vocab

# A longer chain is all but never accepted whole, and each drafted token costs a draft forward.
MAX_DRAFT_TOKENS = 64


class DraftModelDrafter:
    """A small causal LM with the target's tokenizer proposes a chain of k tokens, greedily, with
    its own KV cache (classic draft-then-verify). The target verifies the chain in one forward
    and the same acceptance rules apply, so output stays exact.

    Between steps the draft's cache is cut back to the longest prefix it shares with the
    accepted tokens, and only the new tokens are fed: usually the accepted drafts and the bonus.
    """

    feature_layers = None  # unused: the draft reads tokens only

    def __init__(self, draft_model, k: int = 4):
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise GorgonError(f"a draft model proposes 1 to {MAX_DRAFT_TOKENS} tokens per step, not {k}")
        self.model = draft_model
        self.tree = build_tree([[0] * d for d in range(1, k + 1)]).to(draft_model.device)
        self.cache = None
        self.seen = torch.empty(0, dtype=torch.long, device=draft_model.device)  # tokens in self.cache

    def check_vocab(self, target_model) -> "DraftModelDrafter":
        """Refuse a draft whose vocabulary differs from the target's (its token ids would mean other text)."""
        check_draft_vocab(self.model, target_model)
        return self

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        drafts, _ = self.draft_chain(root, context)
        return self.tree.tokens(root, drafts[:, None]), self.tree

    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """Each prefix of the chain with the product of the draft's probabilities along it."""
        drafts, probs = self.draft_chain(root, context)
        tokens, chances = drafts.tolist(), probs.cumprod(0).tolist()
        return [(tokens[:d], chances[d - 1]) for d in range(1, len(tokens) + 1)]

    @torch.no_grad()
    def draft_chain(self, root: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's greedy chain after the root, (k,) tokens, and the draft's probability of each."""
        from transformers import DynamicCache

        context = torch.cat([context, root.reshape(1)])
        n = min(self.seen.numel(), context.numel() - 1)  # always feed at least the newest token
        same = int((self.seen[:n] == context[:n]).cumprod(0).sum()) if n else 0
        if self.cache is None or same == 0:
            self.cache, same = DynamicCache(), 0
        crop_cache(self.cache, same)
        fed = context[same:]
        drafts, probs = [], []
        for _ in range(self.tree.max_depth):
            logits = self.model(input_ids=fed[None], **with_cache(self.model, self.cache), use_cache=True,
                                logits_to_keep=1).logits[0, -1]  # no LM head over a re-fed prompt
            prob, fed = logits.float().softmax(-1).max(-1, keepdim=True)
            drafts.append(fed)
            probs.append(prob)
        self.seen = torch.cat([context] + drafts[:-1])  # the last draft was never fed
        return torch.cat(drafts), torch.cat(probs)
