"""Drafters for tests: they propose known tokens so that deep acceptance is exercised."""

from __future__ import annotations

import torch

from gorgon.decode.tree import build_tree


class OracleDrafter:
    """Knows the true greedy continuation; hides the right token at a random rank per depth.

    With it most steps accept several tokens along varying branches, which exercises path
    selection and cache compaction far more than random heads (which accept almost nothing).
    """

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, paths, seed: int = 0):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.tree = build_tree(paths)
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, root, hidden, context):
        i = context.numel() - self.prompt_len - 1           # index of root in the continuation
        depth, width = self.tree.max_depth, self.tree.max_rank
        topk = torch.empty(depth, width, dtype=torch.long)
        for d in range(depth):
            row = torch.randperm(self.vocab, generator=self.gen)[:width]
            j = i + d + 1
            if j < len(self.reference):
                truth = self.reference[j]
                row = row[row != truth][: width - 1]
                at = int(torch.randint(0, width, (1,), generator=self.gen))
                row = torch.cat([row[:at], torch.tensor([truth]), row[at:]])[:width]
            topk[d] = row
        return self.tree.tokens(root, topk)


class TargetRolloutDrafter:
    """Proposes the target's own top-k along its greedy rollout: likely tokens, so rejection
    sampling accepts often and deep, which is what the exactness test needs to exercise."""

    def __init__(self, model, paths):
        self.model = model
        self.tree = build_tree(paths)

    @torch.no_grad()
    def propose(self, root, hidden, context):
        seq = context.clone()
        rows = []
        for _ in range(self.tree.max_depth):
            logits = self.model(seq[None]).logits[0, -1]
            top = logits.topk(self.tree.max_rank).indices
            rows.append(top)
            seq = torch.cat([seq, top[:1]])
        return self.tree.tokens(root, torch.stack(rows))
