"""Feature-level draft heads (the EAGLE family): a draft that knows the tokens before it.

Medusa's head k guesses token t+k+2 from the hidden state at t alone. This head drafts one token
at a time, each from the target's features at the previous position and the embedding of the
token there, through one decoder layer of the target's own architecture with a small KV cache
of its own, so every draft knows the drafts before it (EAGLE, Li et al. 2024).

The computation is EAGLE-3's, so that its checkpoints load in vLLM and SGLang unchanged
(heads/methods/eagle/formats.py):
- features: the target's hidden states at `feature_layers` (by default a low, a middle and a
  high one: `default_feature_layers`), concatenated and mixed by `fc`;
- `midlayer`: the target's decoder layer class, built from its config, whose attention reads
  cat(input_layernorm(embedding), hidden_norm(features)) (its q/k/v take twice the width); the
  residual is the features, as vLLM's `norm_before_residual: false` and SGLang compute;
- `norm` then `lm_head` over the draft vocabulary (EAGLE-3's d2t/t2d: `token_map` holds the
  target id of each draft id). The layer's output before `norm` is the feature for the next step.
The embedding is the target's own (shared, never saved), as in both engines.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...cache import with_cache
from ...card import short_card
from ...errors import GorgonError, config_from_dict
from ...files import read_config, reading_weights, write_weights
from ...hub import CONFIG_NAME, PushToHubMixin, resolve_heads_folder
from ...masks import additive_mask
from ...outputs import check_heads_destination
from ...quantize import float_parameter
from ...target import Target, attach_to_target, check_fits
from ...tree import TreesInConfig, chain_tau
from ...vocab import is_draft_vocab
from .. import DEPTH, TOPK
from .formats import check_layer_fields, computes_rms_norm, foreign_format, import_head

WEIGHTS_NAME = "model.safetensors"
ARCH = "eagle"  # config.json's "arch": how a heads folder says it holds EAGLE heads
NODES = {"cpu": 8, "cuda": 48}  # tree nodes per step by device type, unless training or the user chose others


@dataclass
class EagleConfig:
    """Everything needed to rebuild the head and to check it fits a target."""

    hidden_size: int
    vocab_size: int
    layer_config: dict                   # the target's text config: its decoder layer is rebuilt from it
    feature_layers: list[int]            # indices into the target's hidden_states (0: embeddings, i: after layer i)
    draft_vocab_size: int | None = None  # drafts come from this many frequent tokens (None: all)
    depth: int = DEPTH                   # tree levels drafted per step (EAGLE-2)
    topk: int = TOPK                     # tokens kept per level, each expanded once
    nodes: dict = field(default_factory=lambda: dict(NODES))  # tree nodes per step, by device type
    accuracies: list[list[float]] | None = None  # held-out rank accuracies per unrolled step
    target_name: str | None = None
    target_fingerprint: str | None = None
    arch: str = ARCH

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "EagleConfig":
        """A config.json's fields, checked so that a hand-edited or foreign one fails in one line naming
        the field, not with a TypeError here or transformers' error when the layer is built."""
        config = config_from_dict(cls, data, source, "a gorgon EAGLE head's config")
        check_layer_fields(data["layer_config"], ("model_type", "rms_norm_eps", "num_hidden_layers"),
                           f"{source}'s layer_config")
        return config

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Where the target was loaded from (a cache or home folder): left out of a head's saved layer config.
LOCAL_KEYS = ("_name_or_path", "_model_name_or_path")


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: (2, L // 2, L - 3) as vLLM and SGLang choose them by default.

    Below 7 layers those repeat, so 4 to 6 layers give the lowest, middle and highest the engines read
    (1 to L - 1: never the last, normed state). Always 3, since `fc` and the export expect 3: below 4 layers
    no 3 distinct ones export, so the last is taken too (3 layers) and repeated (1 or 2)."""
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers >= 4:
        return [1, num_layers // 2, num_layers - 1]
    return [1, min(2, num_layers), num_layers]


def check_feature_layers(layers: list[int], num_layers: int) -> None:
    """The hidden states a head reads must be the outputs of the target's layers (1 to `num_layers`)."""
    if not all(isinstance(i, int) and 0 < i <= num_layers for i in layers):
        raise GorgonError(f"feature_layers must lie between 1 and {num_layers} (the target's layers), not {layers}")


def not_llama_shaped(model_type: str) -> GorgonError:
    return GorgonError(f"EAGLE heads need a target whose decoder layers are Llama-shaped (input and "
                       f"post-attention RMS norms, rotary q/k/v projections, one MLP), which {model_type} is not: "
                       "use Medusa heads (arch: medusa) for this target")


def _decoder_layer(layer_config: dict, attn_implementation: str):
    """One decoder layer of the target's architecture, built from its config, with attention that reads
    twice the width (the token's embedding beside the features), and the rotary embedding for it. A family
    whose layers are not Llama-shaped is refused in one line, whichever step of building the layer finds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    refusal = not_llama_shaped(layer_config.get("model_type"))
    try:
        config = AutoConfig.for_model(**copy.deepcopy(layer_config))
        config.num_hidden_layers = 1
        for key in ("layer_types", "sliding_window"):  # the draft attends to its whole context
            if getattr(config, key, None) is not None:
                setattr(config, key, ["full_attention"] if key == "layer_types" else None)
        config._attn_implementation = attn_implementation
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config)  # only to find the family's classes
        layer_cls, rotary_cls = type(shell.get_decoder().layers[0]), type(shell.get_decoder().rotary_emb)
        layer = layer_cls(config, layer_idx=0)
        eps = config.rms_norm_eps
    except Exception as err:  # a family built otherwise fails here in many ways (a missing attribute, a config
        raise refusal from err  # that refuses one full-attention layer, a layer that takes other arguments)
    needed = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    attn = getattr(layer, "self_attn", None)
    if not all(hasattr(layer, n) for n in needed) or hasattr(layer, "pre_feedforward_layernorm") \
            or not all(isinstance(getattr(attn, p, None), nn.Linear) for p in ("q_proj", "k_proj", "v_proj")):
        raise refusal
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, nn.Linear(2 * old.in_features, old.out_features, bias=old.bias is not None))
    layer.hidden_norm = type(layer.input_layernorm)(config.hidden_size, eps=eps)
    return layer, rotary_cls(config=config)


class EagleHead(TreesInConfig, PushToHubMixin, nn.Module):
    """The draft head. Call `attach(target_model)` before use: the embedding is the target's."""

    # Its inputs are cast to its own weights' dtype, so it may draft in bfloat16 beside a float32 target.
    drafts_in_own_dtype = True

    def __init__(self, config: EagleConfig, attn_implementation: str = "sdpa"):
        super().__init__()
        self.config = config
        feature_width = len(config.feature_layers) * config.hidden_size
        self.fc = nn.Linear(feature_width, config.hidden_size, bias=False)
        self.midlayer, rotary = _decoder_layer(config.layer_config, attn_implementation)
        self.norm = type(self.midlayer.input_layernorm)(config.hidden_size, eps=config.layer_config["rms_norm_eps"])
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size or config.vocab_size, bias=False)
        size = config.draft_vocab_size
        self.register_buffer("token_map", torch.zeros(size, dtype=torch.long) if size else None)
        self.rotary = rotary                           # buffers only, none saved
        self.fused_norms = computes_rms_norm(self.norm)
        object.__setattr__(self, "_target", None)      # the target's embedding is used, never saved

    def _apply(self, fn, recurse=True):
        """Moves and casts as any module, except that the rotary frequencies stay float32: rounded to
        bfloat16 (a head drafting in bfloat16) they would turn distant positions by wrong angles."""
        exact = dict(self.rotary.named_buffers())
        super()._apply(fn, recurse)
        for name, moved in list(self.rotary.named_buffers()):
            setattr(self.rotary, name, exact[name].to(moved.device))
        return self

    # -- the target ---------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target_model: nn.Module, feature_layers: list[int] | None = None,
                   draft_tokens: torch.Tensor | None = None, target_name: str | None = None,
                   target_fingerprint: str | None = None, **search) -> "EagleHead":
        """A fresh head shaped for a target: its decoder layer starts as a copy of the target's last
        (the doubled q/k/v inputs: zeros for the embedding half), its norm and LM head as the target's.
        `draft_tokens`: the target ids to draft from (None: the whole vocabulary)."""
        cfg = target_model.config.get_text_config()
        layers = feature_layers or default_feature_layers(cfg.num_hidden_layers)
        check_feature_layers(layers, cfg.num_hidden_layers)
        draft_size = None if draft_tokens is None else int(draft_tokens.numel())
        if draft_size is not None and not 1 <= draft_size <= cfg.vocab_size:
            raise GorgonError(f"a draft vocabulary of {draft_size} tokens does not fit the target's {cfg.vocab_size}: "
                              f"use 1 to {cfg.vocab_size}")
        layer = {k: v for k, v in cfg.to_dict().items() if k not in LOCAL_KEYS}
        config = EagleConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, layer_config=layer,
                             feature_layers=list(layers), draft_vocab_size=draft_size, target_name=target_name,
                             target_fingerprint=target_fingerprint, **search)
        head = cls(config, getattr(target_model.config, "_attn_implementation", None) or "sdpa")
        if draft_tokens is not None:
            head.token_map = torch.as_tensor(draft_tokens, dtype=torch.long).sort().values
            if not is_draft_vocab(head.token_map, cfg.vocab_size):
                raise GorgonError(f"draft_tokens must be distinct token ids below the target's {cfg.vocab_size}")
        lm_weight = target_model.get_output_embeddings().weight.detach()
        source = target_model.get_decoder().layers[-1]
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_weight if head.token_map is None else lm_weight[head.token_map])
            head.norm.load_state_dict(target_model.get_decoder().norm.state_dict())
            # fc starts by passing the highest feature layer through, so the layer sees familiar features
            head.fc.weight.zero_()
            head.fc.weight[:, -cfg.hidden_size:].copy_(torch.eye(cfg.hidden_size))
            for name, ours in head.midlayer.named_parameters():
                if name.startswith("hidden_norm."):
                    continue  # the features' norm is the head's own
                try:
                    theirs = float_parameter(source, name)  # under an unmerged PEFT adapter: its base weight
                except AttributeError as err:  # its last layer differs from the others (a mixture of experts)
                    raise GorgonError(f"the target's last decoder layer has no {name} as a dense Llama-shaped layer "
                                      "has: use Medusa heads (arch: medusa) for this target") from err
                if ours.shape == theirs.shape:
                    ours.copy_(theirs)
                else:  # a doubled q/k/v input: the features half starts as the target's projection
                    ours.zero_()
                    ours[:, theirs.shape[1]:].copy_(theirs)
        head.to(device=lm_weight.device, dtype=lm_weight.dtype).attach(target_model)
        head.check_layer_runs()
        return head

    def attach(self, target_model: nn.Module, fingerprints: tuple[str, ...] = ()) -> "EagleHead":
        """Check this head fits `target_model` and bind its embedding. Refuses another target, and one too
        shallow for the layers it reads (a head without a fingerprint is otherwise checked by shape only,
        and would fail indexing the target's hidden states mid-decode)."""
        check_fits(self.config, target_model.config.get_text_config(), fingerprints)
        count = target_model.config.get_text_config().num_hidden_layers
        if max(self.feature_layers) > count:
            raise GorgonError(f"this head reads the target's hidden states {list(self.feature_layers)} and this "
                              f"target has {count} layers (hidden states 0 to {count}): use the head with the "
                              "target it was trained for, or train one for this target")
        object.__setattr__(self, "_target", target_model)
        return self

    def check_layer_runs(self) -> None:
        """Run the layer once over two positions: a family whose layer passed for Llama-shaped but is called
        otherwise (attention that wants position_ids, an MLP that returns a tuple) is refused now, in one line,
        not when it first drafts."""
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        features = torch.zeros(1, 2, self.config.hidden_size, device=device, dtype=dtype)
        causal = torch.ones(2, 2, dtype=torch.bool, device=device).tril()
        try:
            with torch.no_grad():
                out = self.layer(features, torch.zeros(1, 2, dtype=torch.long, device=device),
                                 self.rope(torch.arange(2, device=device)[None], dtype),
                                 additive_mask(causal, dtype)[None, None])
        except Exception as err:  # the family's layer takes or returns other things than Llama's
            raise not_llama_shaped(self.config.layer_config.get("model_type")) from err
        if not isinstance(out, torch.Tensor) or out.shape != features.shape:
            raise not_llama_shaped(self.config.layer_config.get("model_type"))

    @property
    def target(self) -> nn.Module | None:
        return self._target

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    # -- compute ------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._target is None:
            raise GorgonError("the head uses the target's embedding: call head.attach(target_model) first")
        return self._target.get_input_embeddings()(tokens)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding (cos, sin) of (batch, length) positions, as `layer` takes it: computed by the
        caller, so that drafting computes one step's positions in one call rather than one per level (a rope
        that rescales with the length, as dynamic NTK does, then rescales the step's positions together)."""
        return self.rotary(torch.empty((), dtype=dtype, device=positions.device), positions)

    def layer(self, features: torch.Tensor, tokens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
              mask: torch.Tensor, cache=None, dropout: float = 0.0) -> torch.Tensor:
        """The decoder layer over (batch, length) pairs of a feature (H wide, after `fc` or a previous
        output) and the token that follows it; `rope`: their positions' rotary embedding (`EagleHead.rope`);
        `mask` is additive, (batch, 1, length, keys). Returns the output features, before `norm` (the
        next step's input). `dropout`: the rate on the attention's and the MLP's outputs (training only)."""
        layer = self.midlayer
        embedded = self.embed(tokens).to(features.dtype)  # the head may run in another dtype than the target
        x = torch.cat([self.normed(layer.input_layernorm, embedded), self.normed(layer.hidden_norm, features)], dim=-1)
        attn = layer.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=mask,
                               **with_cache(layer.self_attn, cache))[0]
        drop = dropout if self.training else 0.0
        h = features + (F.dropout(attn, drop) if drop else attn)
        mlp = layer.mlp(self.normed(layer.post_attention_layernorm, h))
        return h + (F.dropout(mlp, drop) if drop else mlp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (draft ids; `token_map` turns them into target ids)."""
        return self.lm_head(self.normed(self.norm, hidden))

    def normed(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`norm(x)`, on torch's fused RMS norm where that computes the same (`fused_norms`): one operator
        where transformers' formula dispatches eight, at four norms a drafted level; on a GPU, where a
        small model's drafting is bound by the host, each operator costs time."""
        if not self.fused_norms:
            return norm(x)
        return norm.weight * F.rms_norm(x.float(), norm.weight.shape, eps=norm.variance_epsilon).to(x.dtype)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    # -- trees and measured accuracy, saved in config.json ------------------------------------
    # (set_trees, accuracies and saved_nodes: TreesInConfig; its rows are the unrolled steps)
    def level_accuracies(self, depth: int | None = None) -> list[list[float]]:
        """Held-out rank accuracies per drafted level, as Medusa's per head (for choosing a tree size):
        unrolled step k's for level k, and the last unrolled step's for the deeper levels training
        did not unroll."""
        steps = self.config.accuracies
        return [steps[min(level, len(steps) - 1)] for level in range(depth or self.config.depth)]

    def expected_tau(self, device_type: str) -> float:
        """A floor on tokens per step from the first step's top-1 accuracy: a greedy chain as deep as the
        tree allows, each draft right independently. The ranked tree does better; the bench measures it."""
        if not self.config.accuracies:
            return 1.0
        return chain_tau(self.config.accuracies[0][0], min(self.config.depth, self.saved_nodes(device_type) - 1))

    # -- save / load ----------------------------------------------------------------------------
    def model_card(self, repo_id: str) -> str:
        """The card `push_to_hub` gives a repo without one."""
        return short_card(repo_id, self.config.target_name, "An EAGLE draft head (EAGLE-3's layout)", "eagle")

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict | None = None) -> None:
        """Write config.json and model.safetensors (each atomically); a folder holding another model is
        refused. `state_dict`: the weights to write instead of the module's own (training gathers them whole
        from shards)."""
        check_heads_destination(Path(path), WEIGHTS_NAME)
        write_weights(Path(path), state_dict or self.state_dict(), self.config.to_dict(), WEIGHTS_NAME)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, target=None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None) -> "EagleHead":
        """Load a head from a folder or hub id; with `target` check and attach it (a `Target` is also checked
        by fingerprint; a bare model by shape only). EAGLE-3 and speculators folders are read too."""
        from safetensors.torch import load_file

        folder = resolve_heads_folder(name_or_path)
        config_path = folder / CONFIG_NAME
        data = read_config(config_path, "head")
        model = target.model if isinstance(target, Target) else target
        with reading_weights(folder, WEIGHTS_NAME):
            fmt = foreign_format(data)
            if fmt:
                fields, state = import_head(folder, data, fmt)
                config = EagleConfig.from_dict(fields, str(config_path))
            else:
                config, state = EagleConfig.from_dict(data, str(config_path)), load_file(folder / WEIGHTS_NAME)
            attn = getattr(model.config, "_attn_implementation", None) if model is not None else None
            head = cls(config, attn or "sdpa")
            head.load_state_dict(state)
        if head.token_map is not None and not is_draft_vocab(head.token_map, config.vocab_size):
            saved_as = "d2t" if fmt else "token_map"
            raise GorgonError(f"{folder}'s draft vocabulary ({saved_as}) is not distinct token ids below "
                              f"{config.vocab_size} in increasing order: re-export the head")
        return attach_to_target(head, target, device, dtype)
