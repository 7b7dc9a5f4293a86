"""The exit's training objective: self-distillation on the frozen target's own answers.

At every position the exit reads the target's layer-N output there (`hidden_states[N]`) and is trained
toward the target's own next-token distribution at the same position (soft cross-entropy, renormalised
over the draft vocabulary), on the positions the recipe's loss counts. Accuracy counts agreement with the
target's argmax, which is what acceptance asks. The target's outputs come from its forward, or from the
`FeatureCache` after the first epoch, as the EAGLE head's training reads them (`EagleObjective`, whose
teacher, labels, checkpoint keys and rank counts this shares: the exit's "features" are layer N's output).
"""

from __future__ import annotations

from ..eagle.objective import EagleObjective


class SelfSpecObjective(EagleObjective):
    def __init__(self, target, exit_, decay: float = 0.8, cache=None):
        super().__init__(target, exit_, steps=1, decay=decay, cache=cache)

    def forward(self, input_ids, attention_mask, loss_mask, train_backbone: bool = False):
        """The loss, its statistics and the ranks evaluation counts (train_backbone: the call every objective
        takes; the target stays frozen)."""
        layer_n, teacher, labels = self.target_outputs(input_ids, attention_mask)
        valid = loss_mask[:, 1:].bool()  # position p drafts token p + 1
        b, t = valid.nonzero(as_tuple=True)
        count = int(b.numel())
        logits = self.heads.logits(layer_n[b, t].to(self.heads.norm.weight.dtype)).float()
        if count:
            soft = teacher[b, t].float().log_softmax(-1)
            loss = -(soft.exp() * logits.log_softmax(-1)).sum(-1).mean()
        else:
            loss = logits.sum() * 0
        right = labels[b, t]
        top = logits.detach().topk(min(5, logits.shape[-1]), dim=-1).indices
        stats = {0: {"loss": loss.detach().item(), "top1": int((top[:, 0] == right).sum()),
                     "top5": int((top == right[:, None]).any(-1).sum()), "count": count}}
        return loss, stats, [(logits.detach(), right)]
