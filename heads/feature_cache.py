"""What a frozen target computed for each conversation, kept for later epochs.

A drafter trained on a frozen target (Medusa-1 heads, an EAGLE head) sees the same target
outputs for a conversation every epoch, so after its first pass they are kept in CPU memory and
read back, as EAGLE's own training precomputes them: later epochs cost the drafter's step alone.
Entries are keyed by the conversation's token ids, so batching, padding, resume and several
processes need no bookkeeping (each process fills its own).
"""

from __future__ import annotations

import torch


class FeatureCache:
    """Per-conversation target outputs, each (length, ...) and right-padded back to a batch on request."""

    def __init__(self):
        self.rows: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def get(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """A right-padded batch's outputs, padded alike (with zeros), or None when a conversation is missing."""
        keys = conversations(input_ids, attention_mask)
        if not all(k in self.rows for k in keys):
            return None
        columns = []
        for parts in zip(*(self.rows[k] for k in keys)):
            padded = parts[0].new_zeros((len(parts), input_ids.shape[1]) + parts[0].shape[1:])
            for row, part in enumerate(parts):
                padded[row, :len(part)] = part
            columns.append(padded.to(input_ids.device))
        return tuple(columns)

    def put(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *outputs: torch.Tensor) -> None:
        """Keep each conversation's outputs, without its padding."""
        for row, key in enumerate(conversations(input_ids, attention_mask)):
            self.rows[key] = tuple(o[row, :len(key)].detach().cpu().clone() for o in outputs)


def conversations(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple]:
    """A right-padded batch's conversations as token-id tuples: the cache's keys."""
    return [tuple(ids[:int(n)].tolist()) for ids, n in zip(input_ids, attention_mask.sum(-1))]
