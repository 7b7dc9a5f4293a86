"""Attention over a candidate tree without copying key/value heads (grouped-query attention on the CPU).

transformers' SDPA attention lets torch share each key/value head among its query heads
(`enable_gqa`) only when no mask is passed; with a mask, as verifying a tree needs, it first copies
every key/value head of the whole cache once per query head sharing it (`repeat_kv`). On a CPU that
copy is a large part of attention on a long cache. So the fast path registers an attention function
(transformers' `AttentionInterface`, its documented way to add one) that takes torch's sharing for
exactly that case, a masked forward over several tokens on the CPU, and hands every other call to
transformers' own SDPA function unchanged. Only models on transformers' SDPA attention switch to it;
the masks it is given are built as for SDPA.

A quantized target's attention (`QUANTIZED_NAME`) computes every query row alone, over the keys its mask row
allows, in their order: a one-token step's row on its own, and under `rows_alone` (verification, one sequence's
tree or every row's of a batch) each node of the tree, on gorgon's kernel (`row_attention.cpp`), which gives a row
the same bits whatever rows share the call, and skips the keys a batch's padding hides. Why: a
quantized layer rounds its input (to bfloat16 or an int8 grid), so attention's float32 sums taken in another order
(several rows under a mask against one row without) change a rounding now and then, and the output would leave
the target's own. Measured on the embedded target (int4, 10 MT-Bench questions, 96 tokens): 2/10 outputs equal to
`generate` with the batched call, 10/10 row by row. Its prefill (many rows, no `rows_alone`) stays on SDPA.

On CUDA, decoding runs torch's SDPA without its cuDNN backend (`decoding_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from gorgon.heads.native import native
from gorgon.heads.quantize import quantization

NAME = "gorgon_tree_sdpa"
QUANTIZED_NAME = "gorgon_rows"  # a quantized target's: tree_sdpa_attention, its rows alone on gorgon's kernel
# None: off; on, each mask's rows (`row_keys`), worked out once a forward: every layer gets the same mask.
_ROWS_ALONE = contextvars.ContextVar("gorgon_rows_alone", default=None)


@contextlib.contextmanager
def rows_alone(on: bool = True):
    """Within the block, masked forwards compute each query row's attention alone (the module's docstring)."""
    token = _ROWS_ALONE.set({} if on else None)
    try:
        yield
    finally:
        _ROWS_ALONE.reset(token)


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.device.type == "cpu" and query.shape[2] > 1 and attention_mask is not None and dropout == 0.0
            and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def quantized_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """A quantized target's attention: a one-token step of one sequence, and every row of each sequence of a
    masked forward under `rows_alone`, each row alone on `row_attention.cpp` (the module's docstring); anything
    else (a prefill, `generate`'s or `gorgon data`'s batched steps, training) as `tree_sdpa_attention` computes it."""
    one_step = query.shape[0] == 1 and query.shape[2] == 1
    alone = one_step or (_ROWS_ALONE.get() is not None and attention_mask is not None)
    if (not alone or query.device.type != "cpu" or dropout != 0.0
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return tree_sdpa_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    outs = []
    for b in range(query.shape[0]):
        counts, positions = ([key.shape[2]], None) if attention_mask is None else row_keys(attention_mask, b)
        outs.append(row_kernel().row_attention(query[b].transpose(0, 1).float(), key[b].float(), value[b].float(),
                                               counts, positions, scale))
    return torch.stack(outs).to(query.dtype), None


@functools.cache
def row_kernel():
    """row_attention.cpp, built for this CPU (`gorgon.heads.native`)."""
    return native(Path(__file__).with_name("row_attention.cpp"))


def row_keys(attention_mask: torch.Tensor, sequence: int = 0) -> tuple[list[int], torch.Tensor | None]:
    """Each query row's keys under a (B, 1, rows, keys) mask, for one `sequence` of the batch: their counts, and
    (rows, keys) their positions, None where every row sees the first keys only. Under `rows_alone` worked out at
    the first layer and kept for the others (every layer gets the same mask)."""
    memo = _ROWS_ALONE.get()
    if memo is not None and (id(attention_mask), sequence) in memo:
        return memo[id(attention_mask), sequence][1]
    allowed = attention_mask[min(sequence, attention_mask.shape[0] - 1), 0]
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    counts = allowed.sum(-1)
    prefixes = bool((allowed.cumsum(-1).gather(-1, (counts - 1)[:, None])[:, 0] == counts).all())
    # each row's allowed positions first, in order (a stable sort of "not allowed"), then the rest
    positions = None if prefixes else torch.sort((~allowed).to(torch.uint8), dim=-1, stable=True).indices
    found = counts.tolist(), positions
    if memo is not None:
        memo[id(attention_mask), sequence] = (attention_mask, found)  # the mask kept: its id is not reused meanwhile
    return found


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
    ours = QUANTIZED_NAME if quantization(model) != "none" else NAME
    implementation = ours if on and current == "sdpa" else "sdpa" if not on and current in (NAME, QUANTIZED_NAME) \
        else None
    if implementation == ours:
        AttentionInterface.register(ours, quantized_attention if ours == QUANTIZED_NAME else tree_sdpa_attention)
        AttentionMaskInterface.register(ours, sdpa_mask)
    if implementation and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    elif implementation:
        config._attn_implementation = implementation
    return current in (NAME, QUANTIZED_NAME)


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
