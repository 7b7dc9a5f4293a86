"""The EAGLE head's training objective, on the frozen target's own answers.

At every position p of an answer the head reads the target's features at p and the token at
p + 1, and drafts token p + 2. Its loss is the soft cross-entropy to the target's own next-token
distribution there (renormalised over the draft vocabulary), counted on assistant tokens only.
Accuracy counts agreement with the target's own choice (its argmax), which is what acceptance
asks of a draft; on self-distilled data that is nearly always the data's token.
`hidden_weight` adds EAGLE-1's regression: the head's output feature at p is pulled toward the
target's (mixed) features at p + 1, which is what it stands in for when drafting deeper.

`steps` > 1 is EAGLE-3's training-time test: step j feeds the head its own output features of
step j - 1 instead of the target's, as deeper drafts see them, and predicts one token further
ahead. Its attention sees what drafting's cache holds: the context's keys from the target's
features (step 0, causal) and the same chain's earlier drafts (steps 1 .. j, one key each), so
every position of a conversation trains a chain of `steps` drafts at once. Step j's loss weighs decay^j.

`noise` > 0 adds uniform noise in [-noise, noise] times each feature layer's root mean square at that
position to the target's features while the head trains (not when it is evaluated), as EAGLE-1 adds
+-0.1 to its features: drafting deeper feeds the head features that are not the target's exact ones.
Scaled per layer because the layers' scales differ (SmolLM2-135M's layers 2, 15 and 27: 2.8, 6.1, 23).

`dropout` > 0 drops that share of the head layer's attention and MLP outputs while it trains: the
recipe's ~600 conversations are learnt by heart over its twelve epochs (training top-1 near 0.7,
held-out 0.43), and dropout 0.1 raised the held-out top-1 of the second unrolled step by 0.017 in
each of two seeded pairs (tau within the spread between seeds: README, Results).

With a `FeatureCache` the frozen target runs once per conversation: later epochs read its
features back, as EAGLE's own training precomputes them, and cost the head's step alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ...feature_cache import FeatureCache
from ...masks import additive_mask
from ...target import lm_logits, logit_scale
from ...vocab import draft_index


class EagleObjective(torch.nn.Module):
    """The whole loss as one module, so accelerate can wrap it (DDP, FSDP) as a unit."""

    def __init__(self, target, heads, steps: int = 1, decay: float = 0.8, hidden_weight: float = 0.0,
                 cache: FeatureCache | None = None, noise: float = 0.0, dropout: float = 0.0):
        super().__init__()
        self.target, self.heads = target, heads
        self.steps, self.decay, self.hidden_weight = steps, decay, hidden_weight
        self.cache, self.noise, self.dropout = cache, noise, dropout
        logit_scale(target)  # the teacher's logits are the forward's: measured now, before training

    def state_dict(self, *args, **kwargs):
        """Only the head: checkpoints need not repeat the frozen target."""
        return {f"heads.{k}": v for k, v in self.heads.state_dict(*args, **kwargs).items()}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.heads.load_state_dict({k.removeprefix("heads."): v for k, v in state_dict.items()},
                                          strict=strict, assign=assign)

    def draft_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each token's id in the draft vocabulary, -1 outside it."""
        token_map = self.heads.token_map
        if token_map is None:
            return input_ids
        return draft_index(token_map.to(input_ids.device), self.heads.config.vocab_size)[input_ids]

    @torch.no_grad()
    def target_outputs(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's features, its logits over the draft vocabulary (the teacher) and its choices
        (draft ids, -1 outside the draft vocabulary): what acceptance asks of a draft is the target's
        own choice. From the cache, the teacher is recomputed over the draft vocabulary's rows alone."""
        token_map = self.heads.token_map
        cached = self.cache.get(input_ids, attention_mask) if self.cache is not None else None
        if cached is not None:
            features, last_hidden, labels = cached
            return features, lm_logits(self.target, last_hidden, token_map), labels
        out = self.target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in self.heads.feature_layers], dim=-1)
        logits = lm_logits(self.target, out.last_hidden_state)
        labels = self.draft_labels(logits.argmax(-1))
        if self.cache is not None:
            self.cache.put(input_ids, attention_mask, features, out.last_hidden_state, labels)
        return features, logits if token_map is None else logits[..., token_map], labels

    def forward(self, input_ids, attention_mask, loss_mask, train_backbone: bool = False):
        """The loss over the unrolled steps, their statistics, and the ranks evaluation counts. (train_backbone:
        the call every objective takes; the target stays frozen here.)"""
        head = self.heads
        features, teacher, labels = self.target_outputs(input_ids, attention_mask)
        features = features.to(head.fc.weight.dtype)  # the head trains in its own dtype (float32 beside bfloat16)
        total = features.new_zeros((), dtype=torch.float32)
        stats, ranks = {}, []
        exact = features[:, :-1]                               # position p's features, p = 0 .. L-2
        noisy = self.noise and head.training
        fed = head.fc(with_noise(exact, self.noise, len(head.feature_layers)) if noisy else exact)
        mixed = head.fc(exact) if noisy and self.hidden_weight else fed  # the regression's targets stay exact
        tokens, keys = input_ids[:, 1:], attention_mask[:, 1:]
        cache = DynamicCache()  # gathers every step's keys, as drafting's does
        for j in range(self.steps):
            # Step j drafts token p + 2 + j at position p + j from the token at p + 1 + j: shift by j.
            n = tokens.shape[1] - j
            if n <= 0:
                break
            positions = torch.arange(j, j + n, device=tokens.device)[None].expand(len(tokens), n)
            out_j = head.layer(fed[:, :n], tokens[:, j:], head.rope(positions, fed.dtype),
                               unrolled_mask(keys, j, fed.dtype), cache, self.dropout)
            valid = loss_mask[:, 2 + j:2 + j + n].bool()
            target_ids = labels[:, 1 + j:1 + j + n]  # the target's choice at p + 1 + j, for token p + 2 + j
            b, t = valid.nonzero(as_tuple=True)
            count = int(b.numel())
            logits = head.logits(out_j[b, t]).float()
            soft = teacher[b, t + 1 + j].float().log_softmax(-1)
            loss = -(soft.exp() * logits.log_softmax(-1)).sum(-1).mean() if count else logits.sum() * 0
            inside = t + 1 < mixed.shape[1]  # the last position has no next features to match
            if self.hidden_weight and j == 0 and bool(inside.any()):
                loss = loss + self.hidden_weight * F.smooth_l1_loss(out_j[b[inside], t[inside]],
                                                                    mixed[b[inside], t[inside] + 1].detach())
            total = total + self.decay ** j * loss
            with torch.no_grad():
                top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
                right = target_ids[b, t]
                stats[j] = {"loss": loss.detach().item(), "top1": int((top[:, 0] == right).sum()),
                            "top5": int((top == right[:, None]).any(-1).sum()), "count": count}
                ranks.append((logits.detach(), right))
            # The next step reads this step's outputs as the features of the following position.
            fed = out_j
        return total, stats, ranks  # ranks: evaluation counts from them rather than run the target again

    def rank_counts(self, ranks, batch: dict, max_rank: int) -> torch.Tensor:
        """(steps, max_rank + 1) counts: how often the right token was the head's rank r at each unrolled
        step, plus the total. A token outside the draft vocabulary counts as missed. (`batch`: the call every
        objective takes; the ranks already hold what is needed.)"""
        counts = torch.zeros(self.steps, max_rank + 1, dtype=torch.long)
        for j, (logits, right) in enumerate(ranks):
            top = logits.topk(min(max_rank, logits.shape[-1]), dim=-1).indices
            hits = top == right[:, None]
            counts[j, :top.shape[1]] += hits.sum(0).cpu()
            counts[j, max_rank] += right.numel()
        return counts


def with_noise(features: torch.Tensor, width: float, layers: int) -> torch.Tensor:
    """Features (..., layers * hidden) plus uniform noise in [-width, width] times each layer's root mean
    square at each position."""
    per_layer = features.unflatten(-1, (layers, -1))
    scale = per_layer.pow(2).mean(-1, keepdim=True).sqrt()
    return (per_layer + width * scale * (2 * torch.rand_like(per_layer) - 1)).flatten(-2)


def unrolled_mask(keys: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Step `step`'s additive attention mask, (batch, 1, queries, keys of steps 0 .. step), from the
    (batch, length) key mask: index p sees step 0's keys up to p (the context, padding masked) and
    its own chain's key in each later step (index p again)."""
    b, length = keys.shape
    rows = torch.arange(length - step, device=keys.device)[:, None]
    context = (torch.arange(length, device=keys.device) <= rows)[None] & keys[:, None, :].bool()
    chain = [(torch.arange(length - i, device=keys.device) == rows)[None].expand(b, -1, -1)
             for i in range(1, step + 1)]
    return additive_mask(torch.cat([context, *chain], dim=-1)[:, None], dtype)
