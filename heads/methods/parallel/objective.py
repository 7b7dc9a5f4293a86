"""The parallel drafter's training objective, on the frozen target's own answers.

Every position p of a conversation anchors a block, as drafting does at the last accepted token:
position 0 of the block reads the target's features at p and the token at p + 1 and drafts token
p + 2; mask position j (1 .. k - 1) sits at rotary position p + j and drafts token p + 2 + j. Each is
trained with the soft cross-entropy to the target's own distribution for its token (renormalised over
the draft vocabulary), on answer tokens, weighed head_decay ** j; accuracy counts agreement with
the target's argmax. The blocks of all anchors go through the layer together: position j of every
anchor is one pass, which attends to the context (the target's features, causal, padding masked)
and to its own anchor's earlier block positions, as drafting's cache holds them (the EAGLE
head's unrolled mask, `unrolled_mask`; P-EAGLE's mask in speculators, models/peagle/attention.py).
So a conversation of L tokens trains L blocks in k passes. (P-EAGLE samples fewer anchors for the
deeper positions to save memory, its COD sampling; every anchor is trained here.)

The target's outputs, the feature cache, the checkpointed state and the rank counts are the
EAGLE head's (`EagleObjective`); only the forward differs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..eagle.objective import EagleObjective, unrolled_mask


class ParallelObjective(EagleObjective):
    """The whole loss as one module (accelerate wraps it); `heads` is the `ParallelHead`."""

    def __init__(self, target, heads, decay: float = 0.8, cache=None):
        super().__init__(target, heads, heads.config.block_size, decay, cache=cache)

    def forward(self, input_ids, attention_mask, loss_mask, train_backbone: bool = False):
        """The loss over the block's positions, their statistics, and the ranks evaluation counts. (train_backbone:
        the call every objective takes; the target stays frozen here.)"""
        head = self.heads
        features, teacher, labels = self.target_outputs(input_ids, attention_mask)
        tokens, keys = input_ids[:, 1:], attention_mask[:, 1:]
        b, length = tokens.shape
        fed, embedded = head.inputs(features[:, :-1], tokens, 1)  # every anchor's first position, then a mask one
        mask_fed, mask_embedded = fed[:, -1:], embedded[:, -1:]
        total = fed.new_zeros((), dtype=torch.float32)
        stats, ranks = {}, []
        cache = DynamicCache()  # gathers every pass's keys, as drafting's cache holds the block's
        for j in range(self.steps):
            n = length - j  # anchors p = 0 .. n - 1 have a position j inside the conversation
            if n <= 0:
                break
            positions = torch.arange(j, j + n, device=tokens.device)[None].expand(b, n)
            inputs = (fed[:, :n], embedded[:, :n]) if j == 0 else (mask_fed.expand(b, n, -1),
                                                                   mask_embedded.expand(b, n, -1))
            out = head.layer(*inputs, head.rope(positions, fed.dtype), unrolled_mask(keys, j, fed.dtype), cache)
            valid = loss_mask[:, 2 + j:2 + j + n].bool()
            rows, t = valid.nonzero(as_tuple=True)
            logits = head.logits(out[rows, t]).float()
            soft = teacher[rows, t + 1 + j].float().log_softmax(-1)
            loss = -(soft.exp() * logits.log_softmax(-1)).sum(-1).mean() if rows.numel() else logits.sum() * 0
            total = total + self.decay ** j * loss
            with torch.no_grad():
                right = labels[:, 1 + j:1 + j + n][rows, t]  # the target's choice for token p + 2 + j
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                stats[j] = {"loss": loss.detach().item(), "top1": int((top[:, 0] == right).sum()),
                            "top5": int((top == right[:, None]).any(-1).sum()), "count": int(rows.numel())}
                ranks.append((logits.detach(), right))
        return total, stats, ranks
