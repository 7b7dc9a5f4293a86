"""Draft vocabularies: a drafter that drafts from the target's most frequent tokens only (EAGLE-3's d2t/t2d,
a cut draft model) keeps `token_map`, the target id of each of its output rows, in increasing order."""

from __future__ import annotations

import torch


def draft_index(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each target token id's row in the draft vocabulary, -1 for a token outside it: the map back from
    `token_map`, to turn target labels into the draft's (and find those it can never draft)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=token_map.device)
    index[token_map] = torch.arange(token_map.numel(), device=token_map.device)
    return index


def is_draft_vocab(token_map: torch.Tensor, vocab_size: int) -> bool:
    """Whether `token_map` can be a draft vocabulary of a `vocab_size` one: a non-empty 1-D list of whole token
    ids below `vocab_size`, increasing (so each id once: one repeated would be proposed twice among siblings)."""
    return (token_map.dim() == 1 and token_map.dtype == torch.long and len(token_map) > 0
            and int(token_map[0]) >= 0 and int(token_map[-1]) < vocab_size
            and not bool((token_map[1:] <= token_map[:-1]).any()))
