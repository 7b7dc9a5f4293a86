"""Attention over a candidate tree without copying key/value heads (grouped-query attention on the CPU).

transformers' SDPA attention lets torch share each key/value head among its query heads
(`enable_gqa`) only when no mask is passed; with a mask, as verifying a tree needs, it first copies
every key/value head of the whole cache once per query head sharing it (`repeat_kv`). On a CPU that
copy is a large part of attention on a long cache. So the fast path registers an attention function
(transformers' `AttentionInterface`, its documented way to add one) that takes torch's sharing for
exactly that case, a masked forward over several tokens on the CPU, and hands every other call to
transformers' own SDPA function unchanged. Only models on transformers' SDPA attention switch to it;
the masks it is given are built as for SDPA.

Under `rows_alone` (verifying on a quantized target), each query row of a masked forward is computed alone,
over the keys it may see, with no mask: exactly the call a one-token step of `generate` makes. Why: a
quantized layer rounds its input to bfloat16, so attention's float32 sums taken in another order (several
rows under a mask against one row without) change a rounding now and then, and the output would leave the
target's own. Measured on the embedded target (int4, 10 MT-Bench questions, 96 tokens): 2/10 outputs equal
to `generate` with the batched call, 10/10 row by row.

On CUDA, decoding runs torch's SDPA without its cuDNN backend (`decoding_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

NAME = "gorgon_tree_sdpa"
_ROWS_ALONE = contextvars.ContextVar("gorgon_rows_alone", default=False)


@contextlib.contextmanager
def rows_alone(on: bool = True):
    """Within the block, masked forwards compute each query row's attention alone (the module's docstring)."""
    token = _ROWS_ALONE.set(on)
    try:
        yield
    finally:
        _ROWS_ALONE.reset(token)


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ROWS_ALONE.get() and attention_mask is not None and query.shape[0] == 1 and dropout == 0.0:
        return attention_row_by_row(module, query, key, value, attention_mask, scaling, **kwargs)
    if (query.device.type == "cpu" and query.shape[2] > 1 and attention_mask is not None and dropout == 0.0
            and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def attention_row_by_row(module, query, key, value, attention_mask, scaling, **kwargs):
    """Each query row (batch of one) attends alone to the keys its mask row allows, in their order: the first
    n keys as a view (a chain's nodes, the root), others gathered (a node after a sibling)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = []
    for r in range(query.shape[2]):
        allowed = attention_mask[0, 0, r]
        seen = (allowed if allowed.dtype == torch.bool else allowed == 0).nonzero()[:, 0]
        n = seen.numel()
        if int(seen[-1]) == n - 1:
            k, v = key[:, :, :n], value[:, :, :n]
        else:
            k, v = key.index_select(2, seen), value.index_select(2, seen)
        out, _ = sdpa_attention_forward(module, query[:, :, r:r + 1], k, v, None, dropout=0.0, scaling=scaling,
                                        is_causal=False, **kwargs)
        rows.append(out)
    return torch.cat(rows, dim=1), None


def use_tree_attention(model: torch.nn.Module, on: bool) -> bool:
    """Put a model on transformers' SDPA attention onto `tree_sdpa_attention` (on), or back (off); returns
    whether it was on it before. Models on other attention (eager, flash, flex) are left as they are.
    A module that is not a transformers model but holds its layers (an EAGLE head's decoder
    layer, which drafts each level as a masked forward over several tokens) switches through the
    config those layers read."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = attention_config(model)
    current = getattr(config, "_attn_implementation", None)
    implementation = NAME if on and current == "sdpa" else "sdpa" if not on and current == NAME else None
    if implementation == NAME:
        AttentionInterface.register(NAME, tree_sdpa_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    if implementation and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    elif implementation:
        config._attn_implementation = implementation
    return current == NAME


def attention_config(model: torch.nn.Module):
    """The transformers config whose `_attn_implementation` picks the module's attention function: a
    model's own, else the first one among its submodules (None: no transformers attention inside)."""
    return next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")),
                None)


@contextlib.contextmanager
def decoding_attention(device: torch.device):
    """On CUDA, run the block's SDPA calls on flash, memory-efficient or math attention, never cuDNN's.

    torch (from 2.9, with a cuDNN newer than 9.15) tries cuDNN's attention first on Hopper and
    Blackwell GPUs, and cuDNN builds an execution graph for every new pair of query and key lengths
    (its cache is keyed by shapes and strides: `aten/src/ATen/native/cudnn/MHA.cpp`). Decoding meets a new pair
    at almost every call: the cache grows by a token or more each step, the tree's size changes
    from step to step, and an EAGLE head attends once per drafted level. The other backends
    launch their kernels for any shape with no such setup. A no-op off CUDA."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
