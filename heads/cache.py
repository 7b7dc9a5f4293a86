"""The KV caches the target's decoding and every drafter keep: passed to a transformers forward as its release
expects, grown in place as tokens are accepted, and cut back to the accepted ones."""

from __future__ import annotations

import functools
import inspect

import torch

from .errors import GorgonError


def with_cache(module: torch.nn.Module, cache) -> dict:
    """The keyword argument that passes a KV cache to a transformers module's forward: `cache` from
    transformers 5.24 on (which deprecates `past_key_values`, to be removed in 5.40), else
    `past_key_values`."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(module_type: type) -> str:
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def growing_cache():
    """A `DynamicCache` whose layers append in place (`growing_layer_class`): transformers' own concatenates,
    which copies a layer's whole cache at every forward, so a step costs more the longer the context. Measured
    with scripts/revision_ab.py on one CPU thread: 2.4-3.5% less a token on Spec-Bench's RAG and
    summarization prompts (670-1,190 tokens), 0-0.7% on MT-Bench's short ones."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = growing_layer_class()
    return cache


@functools.cache
def growing_layer_class():
    """`GrowingLayer`, defined at first use: importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values are views into buffers with room to spare (`_key_room`,
        `_value_room`), so an update writes the new positions after them instead of copying everything into
        a new tensor. `crop_cache` and `keep_path` slice and write through the views; anything that puts
        other tensors in their place costs one copy into a new buffer at the next update."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys = _append(self, "_key_room", self.keys, key_states)
            self.values = _append(self, "_value_room", self.values, value_states)
            return self.keys, self.values

    return GrowingLayer


def _append(layer, room_name: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`old` then `new` along the sequence (dim -2), as a view of the layer's buffer `room_name`: written in
    place when `old` is that buffer's front and it has room, else into a new buffer with a quarter to spare."""
    room = getattr(layer, room_name, None)
    length = old.shape[-2] if old.dim() == new.dim() else 0  # a new layer's keys are an empty 1-D tensor
    end = length + new.shape[-2]
    fits = (room is not None and room.shape[-2] >= end and room.shape[:-2] == new.shape[:-2]
            and (room.dtype, room.device) == (new.dtype, new.device))
    if not (fits and (length == 0 or (old.data_ptr() == room.data_ptr() and old.stride() == room.stride()))):
        room = new.new_empty(*new.shape[:-2], end + max(256, end // 4), new.shape[-1])
        if length:
            room[..., :length, :] = old
        setattr(layer, room_name, room)
    room[..., length:end, :] = new
    return room[..., :end, :]


def crop_cache(cache, length: int, layers: int | None = None) -> None:
    """Keep the first `length` positions of every layer of a `DynamicCache` (of its first `layers` only, where
    given: self-speculation's draft writes those alone). This slices the tensors directly: `Cache.crop`
    changed meaning between transformers releases (an absolute length in 5.17, a count to remove later)."""
    for layer in cache.layers[:layers]:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def cache_for_new_features(cache, committed: int, context: int, new: int):
    """A drafter's own cache, ready to take the features of the last `new` of `context` tokens: a fresh one at a
    new prompt, else cut back to the tokens before them (proposing again on the same context recommits its last
    tokens). `committed`: the tokens the cache holds for good."""
    start = context - new
    if cache is None or start == 0 or committed < start:
        if start != 0:
            raise GorgonError(f"the drafter holds {committed} tokens of context but was given features for the last "
                              f"{new} of {context}: pass the features of every token accepted since its last call "
                              "(the whole prompt at the first)")
        cache = growing_cache()  # a new prompt
    crop_cache(cache, start)
    return cache


def stacked_cache(caches: list, lengths: list[int]):
    """One cache for a batch from each row's own (batch of one): row b's first `lengths[b]` entries, then room
    up to the longest row's, which masks keep every other row from seeing. Rows prefilled alone get exactly the
    prefill `generate` gives a single prompt. An EAGLE head's rows are stacked so for each step they draft
    together (`scored_paths_together`)."""
    batch = growing_cache()
    longest = max(lengths)
    if longest == 0:  # no row holds anything yet
        return batch
    shape = next(cache for cache, length in zip(caches, lengths) if length)  # a row of length 0 may hold no layer
    for i in range(len(shape.layers)):
        stacked = []
        for name in ("keys", "values"):
            first = getattr(shape.layers[i], name)
            buf = first.new_zeros(len(caches), *first.shape[1:-2], longest, first.shape[-1])
            for row, (cache, length) in enumerate(zip(caches, lengths)):
                if length:
                    buf[row, ..., :length, :] = getattr(cache.layers[i], name)[0, ..., :length, :]
            stacked.append(buf)
        batch.update(*stacked, i)
    return batch


def keep_rows(cache, rows: list[int], length: int) -> None:
    """Keep only the given rows of a batch's cache (a finished request leaves), cut to `length` positions (the
    longest remaining row's)."""
    index = torch.tensor(rows, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[index, :, :length], layer.values[index, :, :length]
