"""Self-speculation's trained exit: the target's own first N layers draft, through a small adapter.

The draft is no second model: it is the target's layers 0 .. N - 1 (the same modules), then this exit,
then the target's own final norm and LM head (over a draft vocabulary's rows where one is chosen). The
exit is a residual gated MLP (SwiGLU, as the target's own MLPs) on a norm of its own, its output layer
zero at the start, so an untrained exit is LayerSkip's plain early exit (the target's norm and head on
layer N's output). Kangaroo's adapter is an attention layer with two norms, which would need a KV cache
of its own; a per-token adapter keeps the one cache the target already has. Only the adapter (and the
draft vocabulary) is saved: 3 * hidden * adapter_size parameters, 0.66% of the embedded target's at 512.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...card import short_card
from ...errors import GorgonError, config_from_dict
from ...files import read_config, reading_weights, write_weights
from ...hub import CONFIG_NAME, PushToHubMixin, resolve_heads_folder
from ...layers import final_norm
from ...outputs import check_heads_destination
from ...quantize import QuantizedLinear
from ...target import attach_to_target, check_fits, lm_logits, logit_scale
from ...tree import TreesInConfig, chain_tau
from ...vocab import is_draft_vocab

WEIGHTS_NAME = "model.safetensors"
ARCH = "self_spec"  # config.json's "arch": how a heads folder says it holds a self-speculation exit
ADAPTER_SIZE = 512
NODES = {"cpu": 4, "cuda": 32}  # tree nodes per step by device type, unless training or the user chose others


@dataclass
class SelfSpecConfig:
    """Everything needed to rebuild the exit and to check it fits a target."""

    hidden_size: int
    vocab_size: int
    num_layers: int                      # the target's decoder layers
    exit_layer: int                      # N: the draft runs the target's layers 0 .. N - 1
    adapter_size: int = ADAPTER_SIZE     # the exit's MLP width
    rms_norm_eps: float = 1e-6
    draft_vocab_size: int | None = None  # drafts come from this many frequent tokens (None: all)
    depth: int = 3                       # tree levels drafted per step
    topk: int = 2                        # candidates kept and expanded per level
    nodes: dict = field(default_factory=lambda: dict(NODES))  # tree nodes per step, by device type
    accuracies: list[list[float]] | None = None  # held-out rank accuracies of the exit
    target_name: str | None = None
    target_fingerprint: str | None = None
    arch: str = ARCH

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "SelfSpecConfig":
        config = config_from_dict(cls, data, source, "a gorgon self-speculation exit's config")
        check_exit_layer(config.exit_layer, config.num_layers)
        check_adapter_size(config.adapter_size)
        return config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_exit_layer(n, num_layers: int) -> None:
    """The draft runs layers 0 .. n - 1 and verification the rest: both must hold at least one."""
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n < num_layers):
        raise GorgonError(f"exit_layer must be a whole number from 1 to {num_layers - 1} (the target's "
                          f"{num_layers} layers: the draft runs the first exit_layer), not {n!r}")


def check_adapter_size(size) -> None:
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise GorgonError(f"adapter_size is the width of the exit's MLP: a whole number >= 1, not {size!r}")


class EarlyExit(TreesInConfig, PushToHubMixin, nn.Module):
    """The exit's weights. Call `attach(target_model)` before use: the layers, norm and LM head are the target's."""

    drafts_in_own_dtype = False  # it drafts through the target's own layers, in the target's dtype

    def __init__(self, config: SelfSpecConfig):
        super().__init__()
        check_exit_layer(config.exit_layer, config.num_layers)
        check_adapter_size(config.adapter_size)
        self.config = config
        h, a = config.hidden_size, config.adapter_size
        self.norm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, a, bias=False)
        self.up_proj = nn.Linear(h, a, bias=False)
        self.down_proj = nn.Linear(a, h, bias=False)
        nn.init.zeros_(self.down_proj.weight)  # starts as the plain early exit
        size = config.draft_vocab_size
        self.register_buffer("token_map", torch.zeros(size, dtype=torch.long) if size else None)
        object.__setattr__(self, "_target", None)
        object.__setattr__(self, "_head_rows", None)  # the target's LM head rows of the draft vocabulary

    @classmethod
    def for_target(cls, target_model: nn.Module, exit_layer: int, adapter_size: int = ADAPTER_SIZE,
                   draft_tokens: torch.Tensor | None = None, target_name: str | None = None,
                   target_fingerprint: str | None = None, **search) -> "EarlyExit":
        """A fresh exit at layer `exit_layer` of a target. `draft_tokens`: the target ids to draft from (None:
        the whole vocabulary)."""
        cfg = target_model.config.get_text_config()
        check_exit_layer(exit_layer, cfg.num_hidden_layers)
        draft_size = None if draft_tokens is None else int(draft_tokens.numel())
        config = SelfSpecConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                num_layers=cfg.num_hidden_layers, exit_layer=exit_layer, adapter_size=adapter_size,
                                rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), draft_vocab_size=draft_size,
                                target_name=target_name, target_fingerprint=target_fingerprint, **search)
        exit_ = cls(config)
        if draft_tokens is not None:
            exit_.token_map = torch.as_tensor(draft_tokens, dtype=torch.long).sort().values
            if not is_draft_vocab(exit_.token_map, cfg.vocab_size):
                raise GorgonError(f"draft_tokens must be distinct token ids below the target's {cfg.vocab_size}")
        weight = target_model.get_input_embeddings().weight
        return exit_.to(device=weight.device, dtype=weight.dtype if weight.is_floating_point() else None) \
            .attach(target_model)

    def attach(self, target_model: nn.Module, fingerprints: tuple[str, ...] = ()) -> "EarlyExit":
        """Check the exit fits `target_model` (shapes, depth, fingerprint) and bind the target's layers."""
        cfg = target_model.config.get_text_config()
        check_fits(self.config, cfg, fingerprints)
        if cfg.num_hidden_layers != self.config.num_layers:
            raise GorgonError(f"this exit was trained for a target of {self.config.num_layers} layers, and this one "
                              f"has {cfg.num_hidden_layers}: use it with the target it was trained for")
        object.__setattr__(self, "_target", target_model)
        head = target_model.get_output_embeddings()
        rows = None
        if self.token_map is not None and not isinstance(head, QuantizedLinear):
            rows = head.weight.detach()[self.token_map.to(head.weight.device)]
        object.__setattr__(self, "_head_rows", rows)
        return self

    @property
    def target(self) -> nn.Module | None:
        return self._target

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden state the exit reads in training: layer N's output (`hidden_states[N]`)."""
        return (self.config.exit_layer,)

    def extra_bytes(self) -> int:
        """Memory beyond the target during generation: the adapter, and the draft vocabulary's LM head rows."""
        own = sum(t.numel() * t.element_size() for t in self.state_dict().values())
        rows = self._head_rows
        return own + (0 if rows is None else rows.numel() * rows.element_size())

    # -- compute ------------------------------------------------------------------------------
    def adapted(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.norm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits (over the draft vocabulary: draft ids) from layer N's output."""
        if self._target is None:
            raise GorgonError("the exit uses the target's layers and LM head: call exit.attach(target_model) first")
        x = final_norm(self._target, self.adapted(hidden))
        if self._head_rows is None:
            return lm_logits(self._target, x, self.token_map)
        return F.linear(x.to(self._head_rows.dtype), self._head_rows) * logit_scale(self._target)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    # -- trees and measured accuracy, saved in config.json ------------------------------------
    def level_accuracies(self, depth: int | None = None) -> list[list[float]]:
        """Held-out rank accuracies per drafted level: the exit's one row for every level (it drafts each level
        from the target's own layers over the drafts before it, as in training over the data's tokens)."""
        return [self.config.accuracies[0]] * (depth or self.config.depth) if self.config.accuracies else []

    def expected_tau(self, device_type: str) -> float:
        if not self.config.accuracies:
            return 1.0
        return chain_tau(self.config.accuracies[0][0], min(self.config.depth, self.saved_nodes(device_type) - 1))

    # -- save / load ----------------------------------------------------------------------------
    def model_card(self, repo_id: str) -> str:
        return short_card(repo_id, self.config.target_name, "A self-speculation exit (the target's own first "
                          f"{self.config.exit_layer} layers draft)", ARCH)

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict | None = None) -> None:
        """Write config.json and model.safetensors (each atomically); a folder holding another model is refused."""
        check_heads_destination(Path(path), WEIGHTS_NAME)
        write_weights(Path(path), state_dict or self.state_dict(), self.config.to_dict(), WEIGHTS_NAME)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, target=None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None) -> "EarlyExit":
        """Load an exit from a folder or hub id; with `target` check and attach it (a `Target` is also checked by
        fingerprint, a bare model by shape and depth only)."""
        from safetensors.torch import load_file

        folder = resolve_heads_folder(name_or_path)
        config = SelfSpecConfig.from_dict(read_config(folder / CONFIG_NAME, "exit"), str(folder / CONFIG_NAME))
        with reading_weights(folder, WEIGHTS_NAME):
            exit_ = cls(config)
            exit_.load_state_dict(load_file(folder / WEIGHTS_NAME))
        if exit_.token_map is not None and not is_draft_vocab(exit_.token_map, config.vocab_size):
            raise GorgonError(f"{folder}'s token_map is not distinct token ids below {config.vocab_size} in "
                              "increasing order: retrain the exit")
        return attach_to_target(exit_, target, device, dtype)
