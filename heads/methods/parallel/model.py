"""A parallel drafter (the P-EAGLE / DFlash family): a whole block of k drafts in one forward.

The EAGLE head (heads/methods/eagle) drafts one token per forward: each level reads the
feature its parent's forward produced, so a block of k drafts costs k forwards. This drafter puts
k positions through the same layer at once. The first is the EAGLE head's own input: the
target's features at the last accepted token and the embedding of the token after it (the root).
The other k - 1 are learned mask positions (`mask_hidden` in place of the features, `mask_embedding`
in place of a token's embedding), at the next k - 1 rotary positions. Attention is causal: each
position reads the context's keys (the target's features, as the EAGLE head caches them)
and the block's positions before it, as P-EAGLE's mask does (speculators, models/peagle/attention.py).
DFlash lets a block's positions see each other both ways (speculators, models/dflash/attention.py),
so a position's output would depend on the ones after it, and by default drafts from the mask
positions only; here every position drafts: position j the token j + 1 places after the root.

The layers, norms and LM head are an EAGLE head's (`EagleHead`, built from the target's own
decoder layer); only the two mask vectors are new. P-EAGLE learns `mask_hidden` (as wide as the
concatenated features, before `fc`) and a mask token's row of its own trainable embedding; the
embedding here is the target's, never saved, so the mask token is a vector of its own.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ...cache import with_cache
from ...card import short_card
from ...errors import GorgonError, config_from_dict
from ...files import read_config, reading_weights, write_weights
from ...hub import CONFIG_NAME, PushToHubMixin, resolve_heads_folder
from ...outputs import check_heads_destination
from ...target import Target, attach_to_target
from ...tree import TreesInConfig, chain_tau
from ..eagle.formats import check_layer_fields
from ..eagle.model import EagleHead

WEIGHTS_NAME = "model.safetensors"
ARCH = "parallel"  # config.json's "arch": how a heads folder says it holds a parallel drafter
BLOCK_SIZE = 4     # drafts per forward, unless training chose another
NODES = {"cpu": 8, "cuda": 32}  # tree nodes per step by device type, unless training or the user chose others


@dataclass
class ParallelConfig:
    """Everything needed to rebuild the drafter and to check it fits a target (the EAGLE head's fields
    that build its layer, and the block's)."""

    hidden_size: int
    vocab_size: int
    layer_config: dict                   # the target's text config: its decoder layer is rebuilt from it
    feature_layers: list[int]            # indices into the target's hidden_states (0: embeddings, i: after layer i)
    block_size: int = BLOCK_SIZE         # positions drafted in one forward: the first, then k - 1 mask positions
    draft_vocab_size: int | None = None  # drafts come from this many frequent tokens (None: all)
    nodes: dict = field(default_factory=lambda: dict(NODES))  # tree nodes per step, by device type
    accuracies: list[list[float]] | None = None  # held-out rank accuracies per block position
    target_name: str | None = None
    target_fingerprint: str | None = None
    arch: str = ARCH

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "ParallelConfig":
        config = config_from_dict(cls, data, source, "a gorgon parallel drafter's config")
        check_layer_fields(data["layer_config"], ("model_type", "rms_norm_eps", "num_hidden_layers"),
                           f"{source}'s layer_config")
        check_block_size(config.block_size)
        return config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_block_size(k) -> None:
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise GorgonError(f"block_size is the number of drafts a forward makes: use a whole number >= 1, not {k!r}")


class ParallelHead(TreesInConfig, PushToHubMixin, nn.Module):
    """The drafter's weights. Call `attach(target_model)` before use: the embedding is the target's."""

    drafts_in_own_dtype = True  # its inputs are cast to its weights' dtype, as the EAGLE head's

    def __init__(self, config: ParallelConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        check_block_size(config.block_size)
        self.config = config
        self.eagle = EagleHead(config, attn_implementation)  # fc, the decoder layer, norm, lm_head, rotary
        self.mask_hidden = nn.Parameter(torch.randn(len(config.feature_layers) * config.hidden_size))
        self.mask_embedding = nn.Parameter(torch.zeros(config.hidden_size))

    @classmethod
    def for_target(cls, target_model: nn.Module, block_size: int = BLOCK_SIZE, feature_layers: list[int] | None = None,
                   draft_tokens: torch.Tensor | None = None, target_name: str | None = None,
                   target_fingerprint: str | None = None) -> "ParallelHead":
        """A fresh drafter for a target: its layers start as a fresh EAGLE head's (the target's last
        decoder layer, norm and LM head), its mask token as the mean of the target's embedding rows."""
        check_block_size(block_size)
        eagle = EagleHead.for_target(target_model, feature_layers, draft_tokens, target_name, target_fingerprint)
        return cls.from_eagle(eagle, block_size)

    @classmethod
    def from_eagle(cls, eagle: EagleHead, block_size: int = BLOCK_SIZE) -> "ParallelHead":
        """A drafter whose layers start as an EAGLE head's (a trained one: its first position drafts as
        that head's first level does), attached to the same target."""
        c = eagle.config
        config = ParallelConfig(hidden_size=c.hidden_size, vocab_size=c.vocab_size, layer_config=c.layer_config,
                                feature_layers=list(c.feature_layers), block_size=block_size,
                                draft_vocab_size=c.draft_vocab_size, target_name=c.target_name,
                                target_fingerprint=c.target_fingerprint)
        weight = eagle.fc.weight
        head = cls(config, getattr(eagle.midlayer.self_attn.config, "_attn_implementation", None) or "sdpa")
        head.to(device=weight.device, dtype=weight.dtype)
        head.eagle.load_state_dict(eagle.state_dict())
        if eagle.target is not None:
            with torch.no_grad():
                head.mask_embedding.copy_(eagle.target.get_input_embeddings().weight.mean(0))
            head.attach(eagle.target)
        return head

    def attach(self, target_model: nn.Module, fingerprints: tuple[str, ...] = ()) -> "ParallelHead":
        """Check the drafter fits `target_model` (shapes, fingerprint, layers) and bind its embedding."""
        self.eagle.attach(target_model, fingerprints)
        return self

    @property
    def target(self) -> nn.Module | None:
        return self.eagle.target

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.eagle.feature_layers

    @property
    def token_map(self) -> torch.Tensor | None:
        return self.eagle.token_map

    # -- compute ------------------------------------------------------------------------------
    def inputs(self, features: torch.Tensor, tokens: torch.Tensor, masks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's inputs for (batch, m) pairs of the target's features (before `fc`) and the token after
        each, then `masks` mask positions: (batch, m + masks, H) features and embeddings."""
        dtype = self.mask_hidden.dtype
        b = features.shape[0]
        fed = self.eagle.fc(torch.cat([features.to(dtype), self.mask_hidden.expand(b, masks, -1)], dim=1))
        embedded = self.eagle.embed(tokens).to(dtype)
        return fed, torch.cat([embedded, self.mask_embedding.expand(b, masks, -1)], dim=1)

    def layer(self, features: torch.Tensor, embedded: torch.Tensor, rope, mask: torch.Tensor, cache=None):
        """The EAGLE head's decoder layer (`EagleHead.layer`) on embeddings rather than token ids, so
        that a mask position can feed its own vector: (batch, length, H) each, `mask` additive."""
        eagle, layer = self.eagle, self.eagle.midlayer
        x = torch.cat([eagle.normed(layer.input_layernorm, embedded), eagle.normed(layer.hidden_norm, features)], -1)
        h = features + layer.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=mask,
                                       **with_cache(layer.self_attn, cache))[0]
        return h + layer.mlp(eagle.normed(layer.post_attention_layernorm, h))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.eagle.rope(positions, dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (draft ids; `to_target_ids` maps them)."""
        return self.eagle.logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.eagle.to_target_ids(draft_ids)

    # -- trees and measured accuracy, saved in config.json ------------------------------------
    # (set_trees, accuracies and saved_nodes: TreesInConfig; its rows are the block positions)
    def level_accuracies(self, depth: int | None = None) -> list[list[float]]:
        """Held-out rank accuracies per drafted level: block position k's for level k."""
        return (self.accuracies or [])[: depth or self.config.block_size]

    def expected_tau(self, device_type: str) -> float:
        """A floor on tokens per step from the first position's top-1 accuracy: a chain as deep as the block
        and the tree allow, each draft right independently."""
        if not self.accuracies:
            return 1.0
        depth = min(self.config.block_size, self.saved_nodes(device_type) - 1)
        return chain_tau(self.accuracies[0][0], depth)

    # -- save / load ----------------------------------------------------------------------------
    def model_card(self, repo_id: str) -> str:
        return short_card(repo_id, self.config.target_name, "A parallel (P-EAGLE-style) drafter", ARCH)

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict | None = None) -> None:
        """Write config.json and model.safetensors (each atomically); a folder holding another model is refused."""
        check_heads_destination(Path(path), WEIGHTS_NAME)
        write_weights(Path(path), state_dict or self.state_dict(), self.config.to_dict(), WEIGHTS_NAME)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, target=None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None) -> "ParallelHead":
        """Load a drafter from a folder or hub id; with `target` check and attach it (a `Target` is also checked by
        fingerprint, a bare model by shape only)."""
        from safetensors.torch import load_file

        folder = resolve_heads_folder(name_or_path)
        config = ParallelConfig.from_dict(read_config(folder / CONFIG_NAME, "drafter"), str(folder / CONFIG_NAME))
        model = target.model if isinstance(target, Target) else target
        with reading_weights(folder, WEIGHTS_NAME):
            head = cls(config, getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa")
            head.load_state_dict(load_file(folder / WEIGHTS_NAME))
        return attach_to_target(head, target, device, dtype)
