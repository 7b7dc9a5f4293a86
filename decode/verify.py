"""One target forward over a whole candidate tree, and keeping only the accepted path's cache.

No modeling file is patched. The model's own forward takes a 4D float mask (0 where a node
may attend: the whole prefix, its ancestors and itself; a large negative elsewhere), position
ids by depth, and a `DynamicCache`. The cache is built without the model config, so sliding-
window layers keep every token; their window is applied in the mask instead (a node at
position p sees position q only when p - q < window). Models with both kinds of layers
(Gemma 2 and 3) take one mask per layer type.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gorgon.heads.cache import crop_cache, with_cache
from gorgon.heads.masks import additive_mask, layer_masks
from gorgon.heads.target import base_model
from gorgon.heads.tree import Tree, host_to_device


def tree_mask(tree: Tree, past_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The (1, 1, T, past_len + T) additive mask for verifying `tree` after `past_len` cached tokens."""
    allowed_past = torch.ones(tree.size, past_len, dtype=torch.bool, device=tree.depth.device)
    return additive_mask(torch.cat([allowed_past, tree.ancestors], dim=1), dtype)[None, None]


def verify_mask(config, tree: Tree, past_len: int, positions: torch.Tensor, dtype: torch.dtype):
    """The mask argument for the model's forward over the tree's nodes at `positions`: a tensor, or a dict per
    layer type when mixed."""
    return layer_masks(config, tree_mask(tree, past_len, dtype), positions,
                       lambda: torch.cat([torch.arange(past_len, device=positions.device), positions]))


def verify(model, cache, tokens: torch.Tensor, tree: Tree, hidden_states: bool = False):
    """Run the target over all tree nodes at once; returns the decoder's output for them (batch of one),
    every layer's hidden states included when asked for (a drafter reading several layers needs them)."""
    past_len = cache.get_seq_length()
    positions = past_len + tree.depth
    decoder = base_model(model)
    return decoder(
        input_ids=tokens[None],
        attention_mask=verify_mask(model.config, tree, past_len, positions, model.dtype),
        position_ids=positions[None],
        **with_cache(decoder, cache),
        use_cache=True,
        output_hidden_states=hidden_states,
    )


def features(output, layers: tuple[int, ...] | None) -> torch.Tensor:
    """A drafter's features from a decoder output (batch of one): the last hidden state, or the
    `hidden_states` of the given layers concatenated (see `gorgon.heads.drafter`)."""
    if layers is None:
        return output.last_hidden_state[0]
    return torch.cat([output.hidden_states[i][0] for i in layers], dim=-1)


def accepted_rows(path: Sequence[int], device) -> torch.Tensor | slice:
    """The accepted path's nodes as an index into the tree's rows. When they are the tree's first nodes
    (the root alone, or with its first child: most steps) a slice, so nothing is gathered or moved;
    else a tensor on `device`."""
    if list(path) == list(range(len(path))):
        return slice(0, len(path))
    return host_to_device(torch.tensor(path), device)


def keep_path(cache, past_len: int, nodes: torch.Tensor | slice) -> None:
    """Keep the cache entries of the accepted nodes, in order, right after the prefix; drop the rest.

    After verification the cache holds past_len + T entries in node order; the accepted path's
    nodes (ascending, root first; a slice from `accepted_rows` when already in place) move to
    past_len, past_len + 1, ... and the rest is cut off.
    """
    if isinstance(nodes, slice):
        crop_cache(cache, past_len + nodes.stop)
        return
    src = past_len + nodes
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):
            buf[:, :, past_len: past_len + nodes.numel()] = buf[:, :, src]
    crop_cache(cache, past_len + nodes.numel())
