"""One target forward over a whole candidate tree, and keeping only the accepted path's cache.

No modeling file is patched. The model's own forward takes a 4D float mask (0 where a node
may attend: the whole prefix, its ancestors and itself; a large negative elsewhere), position
ids by depth, and a `DynamicCache`. The cache is built without the model config, so sliding-
window layers keep every token; their window is applied in the mask instead (a node at
position p sees position q only when p - q < window). Models with both kinds of layers
(Gemma 2 and 3) take one mask per layer type.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from gorgon.heads.cache import crop_cache, growing_cache, with_cache
from gorgon.heads.errors import GorgonError, first_problem
from gorgon.heads.layers import DraftedLayers, decoder_layers, embed, final_norm, run_layers
from gorgon.heads.masks import additive_mask, layer_kinds, layer_masks
from gorgon.heads.quantize import quantization
from gorgon.heads.tree import Tree, host_to_device, token_paths, tree_from_token_paths

from .attention import rows_alone


def tree_mask(tree: Tree, past_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The (1, 1, T, past_len + T) additive mask for verifying `tree` after `past_len` cached tokens."""
    allowed_past = torch.ones(tree.size, past_len, dtype=torch.bool, device=tree.depth.device)
    return additive_mask(torch.cat([allowed_past, tree.ancestors], dim=1), dtype)[None, None]


def verify_mask(config, tree: Tree, past_len: int, positions: torch.Tensor, dtype: torch.dtype):
    """The mask argument for the model's forward over the tree's nodes at `positions`: a tensor, or a dict per
    layer type when mixed."""
    return layer_masks(config, tree_mask(tree, past_len, dtype), positions,
                       lambda: torch.cat([torch.arange(past_len, device=positions.device), positions]))


def verify(model, cache, tokens: torch.Tensor, tree: Tree, hidden_states: bool = False,
           drafted: DraftedLayers | None = None):
    """Run the target over all tree nodes at once; returns the decoder's output for them (batch of one),
    every layer's hidden states included when asked for (a drafter reading several layers needs them). A
    quantized target's attention takes each node alone (`gorgon.decode.attention.rows_alone`), so every node
    gets what a one-token step of `generate` gives it, to the bit. `drafted`: what a self-speculation draft
    left in the cache's first layers (`verify_drafted`)."""
    if drafted is not None:
        with rows_alone(quantization(model) != "none"):
            return verify_drafted(model, cache, tokens, tree, drafted)
    past_len = cache.get_seq_length()
    positions = past_len + tree.depth
    decoder = model.get_decoder()
    with rows_alone(quantization(model) != "none"):
        return decoder(
            input_ids=tokens[None],
            attention_mask=verify_mask(model.config, tree, past_len, positions, model.dtype),
            position_ids=positions[None],
            **with_cache(decoder, cache),
            use_cache=True,
            output_hidden_states=hidden_states,
        )


def verify_batch(model, cache, lengths: list[int], tokens: list[torch.Tensor], trees: list[Tree],
                 hidden_states: bool = False):
    """One target forward over every row's tree in a batch: row b's tree after its own `lengths[b]` cached
    entries, in a cache as long as the longest row's (what lies past a row's length is room that its mask
    hides). Trees narrower than the widest are padded with nodes that repeat the row's root and see its
    context alone; their outputs and cache entries are never used. Returns the decoder's output, (B, widest)."""
    past = cache.get_seq_length()
    width = max(tree.size for tree in trees)
    device = tokens[0].device
    rows = len(trees)
    ids = torch.stack([torch.cat([t, t[:1].expand(width - t.numel())]) for t in tokens])
    depth = torch.stack([torch.cat([tree.depth, tree.depth.new_zeros(width - tree.size)]) for tree in trees])
    starts = torch.tensor(lengths, device=device)
    positions = starts[:, None] + depth
    allowed = torch.zeros(rows, width, past + width, dtype=torch.bool, device=device)
    allowed[:, :, :past] = (torch.arange(past, device=device)[None, :] < starts[:, None])[:, None, :]
    allowed[:, :, past:] = torch.eye(width, dtype=torch.bool, device=device)
    for row, tree in enumerate(trees):
        allowed[row, :tree.size, past:past + tree.size] = tree.ancestors
    mask = additive_mask(allowed, model.dtype)[:, None]
    decoder = model.get_decoder()
    with rows_alone(quantization(model) != "none"):
        return decoder(
            input_ids=ids,
            attention_mask=layer_masks(model.config, mask, positions[:, None],
                                       lambda: torch.cat([torch.arange(past, device=device).expand(rows, past),
                                                          positions], dim=1)[:, None]),
            position_ids=positions,
            **with_cache(decoder, cache),
            use_cache=True,
            output_hidden_states=hidden_states,
        )


def keep_paths(cache, past: int, lengths: list[int], paths: list[Sequence[int]]) -> None:
    """`keep_path` for a batch verified by `verify_batch` after `past` cached positions: each row's accepted nodes
    move, in order, to right after its own `lengths[b]` entries; the cache is cut to the longest row's new length."""
    device = cache.layers[0].keys.device
    rows = torch.tensor([row for row, path in enumerate(paths) for _ in path], device=device)
    src = torch.tensor([past + node for path in paths for node in path], device=device)
    dst = torch.tensor([start + i for start, path in zip(lengths, paths) for i in range(len(path))], device=device)
    for layer in cache.layers:
        for buf in (layer.keys, layer.values):
            buf[rows, :, dst] = buf[rows, :, src]
    crop_cache(cache, max(start + len(path) for start, path in zip(lengths, paths)))


def verify_drafted(model, cache, tokens: torch.Tensor, tree: Tree, drafted: DraftedLayers):
    """Verify a tree whose nodes the target's first `drafted.layers` layers have partly run already, as they
    drafted it (self-speculation): those layers run only over the nodes the draft never fed (its last level,
    context drafts merged in), each seeing the context and its ancestors wherever the cache holds them; their
    cache entries are then put in node order, and the later layers run over every node from its layer-N state,
    as `verify`'s one forward would. Returns the decoder's output for the nodes, with `reused_rows` (how many
    nodes' first layers came from the draft)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    past, n, device = drafted.past_len, drafted.layers, tokens.device
    paths = [(), *token_paths(tokens, tree)]
    slot = {path: i for i, path in enumerate(drafted.paths)}
    have = [slot.get(path) for path in paths]
    missing = [i for i, s in enumerate(have) if s is None]
    drafted_count = len(drafted.paths)
    # Where each node's entries sit in the first layers' cache: drafted ones in draft order, then the missing.
    where = [past + s if s is not None else past + drafted_count + missing.index(i) for i, s in enumerate(have)]
    hidden = drafted.hidden.new_empty(tree.size, drafted.hidden.shape[-1])
    reused = [i for i, s in enumerate(have) if s is not None]
    hidden[reused] = drafted.hidden[[have[i] for i in reused]]
    if missing:
        seen = torch.zeros(len(missing), past + drafted_count + len(missing), dtype=torch.bool)
        seen[:, :past] = True
        for row, i in enumerate(missing):
            seen[row, [where[a] for a in tree.path_to[i]]] = True
        depth = tree.depth.tolist()
        drafted_positions = [past + len(p) for p in drafted.paths]
        missing_positions = torch.tensor([past + depth[i] for i in missing], device=device)
        hidden[missing] = run_layers(
            model, embed(model, tokens[missing]), 0, n, additive_mask(seen.to(device), model.dtype),
            missing_positions, cache,
            lambda: torch.cat([torch.arange(past, device=device), torch.tensor(drafted_positions, device=device),
                               missing_positions]))[0]
    keep_path(cache, past, host_to_device(torch.tensor(where) - past, device), n)  # the first layers in node order
    positions = past + tree.depth
    out = run_layers(model, hidden[None], n, len(decoder_layers(model)), tree_mask(tree, past, model.dtype)[0, 0],
                     positions, cache, lambda: torch.cat([torch.arange(past, device=device), positions]))
    result = BaseModelOutputWithPast(last_hidden_state=final_norm(model, out))
    result.reused_rows = len(reused)
    return result


def features(output, layers: tuple[int, ...] | None, row: int = 0) -> torch.Tensor:
    """A drafter's features from a decoder output (its batch row `row`): the last hidden state, or the
    `hidden_states` of the given layers concatenated (see `gorgon.heads.drafter`)."""
    if layers is None:
        return output.last_hidden_state[row]
    return torch.cat([output.hidden_states[i][row] for i in layers], dim=-1)


def accepted_rows(path: Sequence[int], device) -> torch.Tensor | slice:
    """The accepted path's nodes as an index into the tree's rows. When they are the tree's first nodes
    (the root alone, or with its first child: most steps) a slice, so nothing is gathered or moved;
    else a tensor on `device`."""
    if list(path) == list(range(len(path))):
        return slice(0, len(path))
    return host_to_device(torch.tensor(path), device)


def keep_path(cache, past_len: int, nodes: torch.Tensor | slice, layers: int | None = None) -> None:
    """Keep the cache entries of the accepted nodes, in order, right after the prefix; drop the rest.

    After verification the cache holds past_len + T entries in node order; the accepted path's
    nodes (ascending, root first; a slice from `accepted_rows` when already in place) move to
    past_len, past_len + 1, ... and the rest is cut off. `layers`: the first that many layers only
    (`verify_drafted` puts a draft's entries in node order with it).
    """
    if isinstance(nodes, slice):
        crop_cache(cache, past_len + nodes.stop, layers)
        return
    src = past_len + nodes
    for layer in cache.layers[:layers]:
        for buf in (layer.keys, layer.values):
            buf[:, :, past_len: past_len + nodes.numel()] = buf[:, :, src]
    crop_cache(cache, past_len + nodes.numel(), layers)


def check_verifies_trees(model) -> None:
    """Refuse, in one line, a target whose forward cannot verify a tree exactly, before the prefill: layers that
    are not attention (`layer_kinds`), positions taken from a token's place in the input rather than
    `position_ids` (ALiBi: Bloom, MPT; RWKV), or attention that masks by that place itself (GPT-Neo's local
    layers). Any other family is probed once per model (`tree_probe_problem`): its output for the prompt
    would otherwise differ from `generate`'s without a word."""
    if getattr(model, "_gorgon_verifies_trees", False):
        return
    cfg = model.config.get_text_config()
    kind = getattr(cfg, "model_type", type(model).__name__)
    layer_kinds(model.config)
    decoder = model.get_decoder()
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        raise GorgonError(f"{kind} places each token by its order in the input (its forward takes no position_ids), "
                          "so the nodes of a tree would sit at wrong positions: use a model with rotary or learned "
                          "positions (Llama, Qwen, Mistral, Gemma, ...)")
    if "local" in str(getattr(cfg, "attention_layers", "")):
        raise GorgonError(f"{kind}'s local attention layers mask keys by their order in the input, not by the tree: "
                          "use a model with full or sliding-window attention")
    problem = tree_probe_problem(model, decoder)
    if problem:
        raise GorgonError(f"{kind} cannot verify a tree of candidates in one forward ({problem}): gorgon needs a "
                          "forward that takes a 4D attention mask, position_ids and a KV cache")
    model._gorgon_verifies_trees = True


@torch.inference_mode()
def tree_probe_problem(model, decoder) -> str | None:
    """What goes wrong when the model verifies a small tree after a short prompt, or None: the prefill must fill
    the KV cache, and the nodes of a branch that follows a sibling (so a node's place in the input differs from
    its depth) must get the hidden states a plain forward gives the same tokens (to float32 rounding; 10% of
    the largest in a 16-bit or quantized model, whose tree and plain forwards round apart: a quantized
    layer rounds its input to bfloat16, so float32's differences in attention's sums become bfloat16's)."""
    vocab = model.config.get_text_config().vocab_size
    device = model.get_input_embeddings().weight.device
    ids = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(0)).to(device)
    prompt, chain = ids[:6], ids[6:]  # the branch root -> b -> d, verified beside a sibling a of b
    sibling = int(chain[1] + 1) % vocab
    tokens, tree = tree_from_token_paths(chain[0], [[sibling], chain[1:].tolist()])
    ranks = [tuple(p) for p in tree.paths]
    rows = [0, 1 + ranks.index((1,)), 1 + ranks.index((1, 0))]
    try:
        cache = growing_cache()
        decoder(input_ids=prompt[None], **with_cache(decoder, cache), use_cache=True)
        if cache.get_seq_length() != prompt.numel():
            return "its forward left the KV cache empty: it keeps no cache, or a state of its own"
        nodes = verify(model, cache, tokens, tree).last_hidden_state[0, rows].float()
        plain = decoder(input_ids=ids[None]).last_hidden_state[0, -3:].float()
    except GorgonError:
        raise
    except Exception as err:  # a forward that takes no 4D mask or no cache fails in many ways
        return f"{type(err).__name__}: {first_problem(err, 120)}"
    tolerance = 1e-3 if model.dtype == torch.float32 and quantization(model) == "none" else 0.1
    if (nodes - plain).abs().max() > tolerance * plain.abs().max().clamp_min(1e-6):
        return "its outputs for the tree's nodes differ from a plain forward's over the same tokens"
    return None

