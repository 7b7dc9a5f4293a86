"""Attention masks for trees of candidates, with no patched modeling file: an additive mask of what each node
may see (the context, its ancestors, itself), with sliding windows applied in the mask itself."""

from __future__ import annotations

import torch

from .errors import GorgonError


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask as the model's forward takes it, from a bool (..., queries, keys) of what may be seen:
    0 where a query may attend, the dtype's lowest value elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


_MASK_KINDS = {"full_attention", "sliding_attention"}


def layer_kinds(config) -> set[str]:
    """Which attention kinds a model's layers use: full, sliding, or both."""
    cfg = config.get_text_config()
    types = getattr(cfg, "layer_types", None)
    if types:
        kinds = set(types)
        if not kinds <= _MASK_KINDS:
            raise GorgonError(f"layer types {sorted(kinds - _MASK_KINDS)} are not supported by tree attention: "
                              "use a model with full or sliding-window attention")
        return kinds
    return {"sliding_attention"} if getattr(cfg, "sliding_window", None) else {"full_attention"}


def layer_masks(config, mask: torch.Tensor, query_positions: torch.Tensor, key_positions):
    """The attention_mask argument of a model's forward over tree nodes, from the additive (..., queries, keys)
    `mask` of what each may see in a cache built without the config (every layer keeps every token): as it
    is for full attention, with keys a sliding window leaves behind masked too (a query at position p sees
    position q only when p - q < window), and one mask per layer kind where a model mixes them (Gemma 2, 3).
    `key_positions()` gives the cache's positions; it is called only for sliding-window layers, so a model
    with full attention alone builds nothing per step. For a batch whose rows sit at their own positions, the
    query positions are (B, 1, T) and the key positions (B, 1, K)."""
    kinds = layer_kinds(config)
    window = getattr(config.get_text_config(), "sliding_window", None)

    def windowed():
        behind = (query_positions[..., :, None] - key_positions()[..., None, :]) >= window
        return mask.masked_fill(behind, torch.finfo(mask.dtype).min)

    masks = {"full_attention": lambda: mask, "sliding_attention": windowed}
    if len(kinds) == 1:
        return masks[kinds.pop()]()
    return {kind: make() for kind, make in masks.items()}
