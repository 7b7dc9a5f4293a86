"""Medusa's training objective: head losses and accuracies. Head k read at position t predicts the token at t+k+2.

Only positions whose label is an assistant token count. The vocabulary projection runs on
those positions alone, head by head: all heads over a whole batch at once would hold
K x B x L x V logits (1.6 GB for SmolLM2 at B=4, L=512).

With a `FeatureCache` (Medusa-1 only: its target is frozen) the target runs once per
conversation; later epochs read its last hidden states back and cost the heads' step alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...feature_cache import FeatureCache
from ...target import lm_logits, logit_scale
from ...vocab import draft_index


def head_targets(loss_mask: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions t (as batch and time indices) where head k has an assistant label at t+k+2."""
    shift = k + 2
    valid = torch.zeros_like(loss_mask)
    valid[:, :-shift] = loss_mask[:, shift:]
    return valid.nonzero(as_tuple=True)


def medusa_loss(heads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor, *,
               loss: str = "ce", decay: float = 0.8, target_logits: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict]:
    """Weighted sum over heads of CE to the data's tokens or KL to the target's own distribution.

    For `kl`, head k at t matches softmax(target_logits[t+k+1]): the target's prediction of the
    same token t+k+2, which the frozen forward has already computed.
    Heads with a draft vocabulary train over it: positions whose label lies outside are skipped
    (the head could never draft that token), and the KL teacher is renormalised over it.
    Accuracies count every assistant position, so they include the vocabulary's coverage.
    Returns the loss and per-head statistics (loss, top-1 and top-5 hits, count).
    """
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = {}
    index = None
    if heads.token_map is not None:  # token id -> position in the draft vocabulary, -1 outside
        index = draft_index(heads.token_map.to(input_ids.device), heads.config.vocab_size)
    for k in range(heads.config.num_heads):
        b, t = head_targets(loss_mask, k)
        count = int(b.numel())
        labels = input_ids[b, t + k + 2]
        if index is not None:
            inside = index[labels] >= 0
            b, t, labels = b[inside], t[inside], index[labels[inside]]
        if b.numel() == 0:
            continue
        logits = heads.head(k, hidden[b, t]).float()
        if loss == "kl":
            teacher = target_logits[b, t + k + 1].float()
            if heads.token_map is not None:
                teacher = teacher[:, heads.token_map]
            teacher = teacher.log_softmax(-1)
            head_loss = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="batchmean")
        else:
            head_loss = F.cross_entropy(logits, labels)
        total = total + decay ** k * head_loss
        with torch.no_grad():
            top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
            stats[k] = {"loss": head_loss.detach().item(), "top1": int((top[:, 0] == labels).sum()),
                        "top5": int((top == labels[:, None]).any(-1).sum()), "count": count}
    return total, stats


@torch.no_grad()
def rank_counts(heads, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                max_rank: int) -> torch.Tensor:
    """(K, max_rank + 1) counts: how often the right token was each head's rank r, plus the total."""
    counts = torch.zeros(heads.config.num_heads, max_rank + 1, dtype=torch.long)
    for k in range(heads.config.num_heads):
        b, t = head_targets(loss_mask, k)
        if b.numel() == 0:
            continue
        top = heads.draft_topk(hidden[b, t], max_rank)[k]  # ranks as the decoder will see them
        hits = top == input_ids[b, t + k + 2][:, None]
        counts[k, :max_rank] += hits.sum(0).cpu()
        counts[k, max_rank] += b.numel()
    return counts


class MedusaObjective(torch.nn.Module):
    """The whole training loss as one module, so `accelerate` can wrap it (DDP, FSDP) as a unit.

    medusa1: the target is frozen; its forward runs without gradients and only the heads learn.
    medusa2: the target carries LoRA adapters and learns too. Its own next-token distribution
    is held to the original model's by a KL term (teacher pass with the adapters disabled), so
    the base model's outputs stay put while its hidden states become easier to draft from.
    """

    def __init__(self, target, heads, mode: str = "medusa1", loss: str = "ce", decay: float = 0.8,
                 base_kl_weight: float = 1.0, cache: FeatureCache | None = None):
        super().__init__()
        self.target, self.heads = target, heads
        self.mode, self.loss, self.decay, self.base_kl_weight = mode, loss, decay, base_kl_weight
        self.cache = cache
        logit_scale(target)  # the teacher's logits are the forward's: measured now, before training

    def state_dict(self, *args, **kwargs):
        """Only what training changes: checkpoints need not repeat the frozen target (540 MB for SmolLM2)."""
        keep_vars = kwargs.pop("keep_vars", False)
        full = super().state_dict(*args, keep_vars=True, **kwargs)
        return {k: (v if keep_vars else v.detach()) for k, v in full.items()
                if isinstance(v, torch.nn.Parameter) and v.requires_grad}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The counterpart of `state_dict`: frozen target weights are expected to be absent."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        missing = [k for k in result.missing_keys if k in trainable]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"checkpoint does not match the model: missing {missing[:3]}, "
                               f"unexpected {result.unexpected_keys[:3]}")
        return type(result)(missing, result.unexpected_keys)

    def forward(self, input_ids, attention_mask, loss_mask, train_backbone: bool = True):
        def run(grad: bool):
            with torch.set_grad_enabled(grad):
                hidden = self.target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return hidden

        teacher_logits = None
        if self.mode == "medusa2":
            with torch.no_grad(), self.target.disable_adapter():
                teacher_logits = lm_logits(self.target, run(False))
            hidden = run(train_backbone)
        else:
            hidden = self.frozen_hidden(input_ids, attention_mask, run)
            if self.loss == "kl":
                with torch.no_grad():
                    teacher_logits = lm_logits(self.target, hidden)
        # The heads train in their own dtype (float32 beside a bfloat16 target): they read the hidden states
        # in it, while the target's lm_head (the KL terms' teacher and base_kl) reads them as they are.
        features = hidden.to(self.heads.blocks[0][0].linear.weight.dtype)
        total, stats = medusa_loss(self.heads, features if self.mode == "medusa2" else features.detach(), input_ids,
                                  loss_mask, loss=self.loss, decay=self.decay, target_logits=teacher_logits)
        if self.mode == "medusa2" and train_backbone:
            # The target's own prediction of token t+1, on assistant labels, against the original model.
            b, t = head_targets(loss_mask, -1)
            student = lm_logits(self.target, hidden[b, t]).float().log_softmax(-1)
            teacher = teacher_logits[b, t].float().log_softmax(-1)
            base_kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
            total = total + self.base_kl_weight * base_kl
            stats["base_kl"] = base_kl.detach().item()
        return total, stats, features  # evaluation reuses them rather than run the target again

    def frozen_hidden(self, input_ids, attention_mask, run) -> torch.Tensor:
        """The frozen target's last hidden states, from the cache when every conversation is in it
        (padding then reads zeros, which no loss position looks at)."""
        cached = self.cache.get(input_ids, attention_mask) if self.cache is not None else None
        if cached is not None:
            return cached[0]
        hidden = run(False)
        if self.cache is not None:
            self.cache.put(input_ids, attention_mask, hidden)
        return hidden

    def rank_counts(self, hidden: torch.Tensor, batch: dict, max_rank: int) -> torch.Tensor:
        """Held-out rank counts of the heads on a batch whose hidden states `forward` returned."""
        return rank_counts(self.heads, hidden, batch["input_ids"], batch["loss_mask"], max_rank)
