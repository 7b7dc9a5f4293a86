"""The draft model's objective: trl's GKD, the target as teacher, on assistant tokens.

GKD matches the draft to the target's full next-token distribution on the target's own answers
(`gorgon data`): beta 0 is the forward KL, 1 the reverse KL, between them the generalised JSD;
lmbda > 0 lets the draft answer part of the prompts itself (on-policy distillation). Here: the
batches trl's GKD trainer reads and the held-out agreement with the target; the trainer itself is
set up by the training script (train/draft.py).
"""

from __future__ import annotations

import torch


def gkd_batch(batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """What trl's GKD trainer reads, from a gorgon batch (right-padded input_ids, attention_mask,
    loss_mask): labels on assistant tokens only (-100 elsewhere), and each conversation's opening
    prompt, left-padded, for on-policy answers."""
    out = dict(batch)
    loss_mask = out.pop("loss_mask")
    out["labels"] = out["input_ids"].masked_fill(~loss_mask, -100)
    starts = loss_mask.int().argmax(1).tolist()  # the first assistant token of each row
    width = max(starts)
    out["prompts"] = torch.full((len(starts), width), pad_id, dtype=torch.long)
    out["prompt_attention_mask"] = torch.zeros(len(starts), width, dtype=torch.long)
    for row, n in enumerate(starts):
        out["prompts"][row, width - n:] = out["input_ids"][row, :n]
        out["prompt_attention_mask"][row, width - n:] = 1
    return out


@torch.no_grad()
def agreement(draft, target, batches) -> dict:
    """How closely the draft follows the target on assistant tokens: the mean KL(target || draft)
    and the share of positions where both pick the same next token (a greedy draft's acceptance
    rate, before the cost of a rejection cutting a chain short). `batches`: this process's share
    of the held-out gorgon batches; the sums are added over all processes."""
    from accelerate import PartialState
    from accelerate.utils import reduce

    state = PartialState()
    device = next(draft.parameters()).device
    kl_sum, same, count = 0.0, 0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        mask = batch.pop("loss_mask")[:, 1:]  # position t predicts token t+1
        teacher = target(**batch).logits[:, :-1][mask].float().log_softmax(-1)
        student = draft(**batch).logits[:, :-1][mask].float().log_softmax(-1)
        kl_sum += float((teacher.exp() * (teacher - student)).sum())
        same += int((teacher.argmax(-1) == student.argmax(-1)).sum())
        count += int(mask.sum())
    kl_sum, same, count = reduce(torch.tensor([kl_sum, same, count], dtype=torch.float64, device=state.device),
                                 reduction="sum").tolist()
    return {"kl": kl_sum / max(1, count), "top1": same / max(1, count), "tokens": int(count)}
