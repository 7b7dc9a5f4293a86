"""A span of the target's own decoder layers, run over a few tokens with a tree mask and the target's own cache.

Self-speculation (heads/methods/self_spec) drafts with the target's first layers and then verifies with the
rest, both writing the one KV cache the target decodes with. Both run layers start .. stop - 1 of the
target's decoder as its forward does (embeddings, rotary embedding, each layer with the mask of its attention
kind; the final norm after the last), so nothing is copied and no modeling file is patched. A family whose
forward does anything else between its layers would draft wrongly; `check_splits` refuses it once per model,
comparing a split forward with the model's own.

`DraftedLayers` is what a drafting pass leaves for verification: which tree paths the cache's first layers
already hold after the accepted tokens, in the cache's order, and their hidden states after those layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cache import growing_cache, with_cache
from .errors import GorgonError, first_problem
from .masks import additive_mask, layer_masks


@dataclass
class DraftedLayers:
    """The target cache's layers below `layers` after a drafting pass: past_len accepted tokens, then one entry
    per drafted node in `paths` order (each a token path under the root; () is the root), whose hidden states
    after layer `layers - 1` are `hidden` (len(paths), H). The layers from `layers` on still hold past_len."""

    layers: int
    past_len: int
    paths: list[tuple[int, ...]]
    hidden: torch.Tensor


def decoder_layers(model) -> list:
    return list(model.get_decoder().layers[: model.config.get_text_config().num_hidden_layers])


def embed(model, tokens: torch.Tensor) -> torch.Tensor:
    """(1, n) hidden states entering layer 0 for (n,) token ids."""
    return model.get_decoder().embed_tokens(tokens[None])


def run_layers(model, hidden: torch.Tensor, start: int, stop: int, mask: torch.Tensor, positions: torch.Tensor,
               cache, key_positions: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Layers start .. stop - 1 over `hidden` (1, n, H) at `positions` (n,), appending their keys and values to
    `cache`; `mask` (n, keys) additive over what each layer's cache holds then, `key_positions()` those keys'
    positions (read only for sliding-window layers). Returns the hidden states after layer stop - 1."""
    decoder = model.get_decoder()
    positions = positions[None]
    rotary = decoder.rotary_emb(hidden, positions)
    masks = layer_masks(model.config, mask[None, None], positions[0], key_positions)
    for layer in decoder_layers(model)[start:stop]:
        layer_mask = masks[getattr(layer, "attention_type", "full_attention")] if isinstance(masks, dict) else masks
        out = layer(hidden, attention_mask=layer_mask, position_ids=positions, position_embeddings=rotary,
                    use_cache=True, **with_cache(layer, cache))
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def final_norm(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.get_decoder().norm(hidden)


def check_splits(model, at: int) -> None:
    """Refuse, in one line, a target whose forward split at layer `at` (the first layers, then the rest, each over
    the same cache) does not give its own forward's last hidden state: a family that computes something between
    its layers (per-layer embeddings, several rotary embeddings) cannot draft with its own layers here. Probed
    once per model and split."""
    done = getattr(model, "_gorgon_splits", set())
    if at in done:
        return
    problem = split_problem(model, at)
    if problem:
        kind = getattr(model.config.get_text_config(), "model_type", type(model).__name__)
        raise GorgonError(f"{kind}'s forward cannot be run a span of layers at a time ({problem}): self-speculation "
                          "needs a decoder of plain stacked layers (Llama, Qwen, Mistral, ...); use an EAGLE head")
    model._gorgon_splits = done | {at}


@torch.inference_mode()
def split_problem(model, at: int) -> str | None:
    vocab = model.config.get_text_config().vocab_size
    device = model.get_input_embeddings().weight.device
    ids = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(0)).to(device)
    dtype = model.get_input_embeddings().weight.dtype
    causal = additive_mask(torch.ones(6, 6, dtype=torch.bool, device=device).tril(), dtype)
    positions = torch.arange(6, device=device)
    try:
        cache = growing_cache()
        low = run_layers(model, embed(model, ids), 0, at, causal, positions, cache, lambda: positions)
        ours = final_norm(model, run_layers(model, low, at, len(decoder_layers(model)), causal, positions, cache,
                                            lambda: positions))[0].float()
        theirs = model.get_decoder()(input_ids=ids[None]).last_hidden_state[0].float()
    except Exception as err:  # a family built otherwise fails in many ways
        return f"{type(err).__name__}: {first_problem(err, 120)}"
    tolerance = 1e-4 if dtype == torch.float32 else 0.05
    if (ours - theirs).abs().max() > tolerance * theirs.abs().max().clamp_min(1e-6):
        return "its layers run one after another do not give its forward's output"
    return None

