"""Medusa checkpoint formats other tools read and write: export to them, import from them.

- vllm: vLLM's Medusa draft model (vllm/model_executor/models/medusa.py, its config in
  vllm/transformers_utils/configs/medusa.py): config.json with model_type "medusa"; weights
  `blocks.{h}.layers.{layer}.weight/bias`, and `lm_heads.{h}.weight` per head or, with
  `original_lm_head`, one `lm_head.weight` shared by all heads. Always over the whole vocabulary:
  vLLM 0.32's loader refuses a draft vocabulary (its `load_weights` makes `token_map` a parameter
  after the loader listed the parameters to load, and never reports it loaded, so
  `track_weights_loading` raises "Following weights were not initialized from checkpoint:
  {'token_map'}"), while whole-vocabulary heads (`truncated_vocab_size` = `vocab_size`, no
  `token_map`) load in it and in the releases before it that sized heads to the draft vocabulary.
  Heads that draft from a draft vocabulary then draft from every token there: the engine's drafts
  may differ from gorgon's, its output does not (the target accepts or rejects every draft).
- medusa: FasterDecoding Medusa's `medusa_lm_head.safetensors` (read by TGI and TensorRT-LLM,
  e.g. TensorRT-LLM's load_medusa_hf): `{h}.{layer}.linear.weight/bias` and each head's own LM head
  `{h}.{num_layers}.weight`; config.json with medusa_num_heads, medusa_num_layers and
  base_model_name_or_path. This format has no draft vocabulary: heads that draft from one are
  exported drafting from the full vocabulary. Legacy `medusa_lm_head.pt` files are read with
  `torch.load(weights_only=True)` only, so a pickle that holds code is refused.

Both formats compute a head as ours does (x + SiLU(Wx + b) per layer, then an LM head), so a
round trip gives identical logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ...errors import GorgonError
from ...files import read_safetensors_folder, write_weights
from ...target import recorded_target

FORMATS = ("vllm", "medusa")
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_LEGACY = "medusa_lm_head.pt"
# Why a format cannot keep heads' draft vocabulary, and what loads instead (the export's note).
NO_DRAFT_VOCAB = {
    "vllm": "vLLM's Medusa loader refuses a draft vocabulary (0.32: \"weights were not initialized from checkpoint: "
            "token_map\"), so they are exported drafting from every token, as vLLM's Medusa loaders read them "
            "(checked in 0.32)",
    "medusa": "the FasterDecoding layout holds no draft vocabulary, so they are exported drafting from every token"}


def export_heads(heads, fmt: str, out: str | Path, base_model: str | None = None) -> Path:
    """Write `heads` in a serving engine's format to the folder `out`."""

    if fmt not in FORMATS:
        raise GorgonError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    cfg = heads.config
    if cfg.shared_lm_head and heads.target is None:
        raise GorgonError("these heads share the target's lm_head, which the export must include: pass --target "
                          "(or load the heads with target=...)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for h, block in enumerate(heads.blocks):
        for layer, res in enumerate(block):
            prefix = f"blocks.{h}.layers.{layer}" if fmt == "vllm" else f"{h}.{layer}.linear"
            state[f"{prefix}.weight"] = res.linear.weight
            state[f"{prefix}.bias"] = res.linear.bias
    if fmt == "vllm":
        if cfg.shared_lm_head:
            state["lm_head.weight"] = heads.lm_head_weight(0)
        else:
            state.update({f"lm_heads.{h}.weight": heads.lm_head_weight(h) for h in range(cfg.num_heads)})
        config = {"model_type": "medusa", "architectures": ["MedusaModel"], "num_heads": cfg.num_heads,
                  "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "truncated_vocab_size": cfg.vocab_size,
                  "original_lm_head": cfg.shared_lm_head,
                  "medusa_fc_bias": True, "base_model_name_or_path": base_model or cfg.target_name}
        weights_name = "model.safetensors"
    else:
        state.update({f"{h}.{cfg.num_layers}.weight": heads.lm_head_weight(h) for h in range(cfg.num_heads)})
        config = {"medusa_num_heads": cfg.num_heads, "medusa_num_layers": cfg.num_layers,
                  "base_model_name_or_path": base_model or cfg.target_name, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size}
        weights_name = MEDUSA_WEIGHTS
    write_weights(out, state, config, weights_name)
    if heads.token_map is not None:
        print(f"gorgon export: note: these heads draft from {cfg.draft_vocab_size} of the {cfg.vocab_size} tokens; "
              f"{NO_DRAFT_VOCAB[fmt]}. The output is the target's either way; the drafts, and how many are accepted, "
              "may differ from gorgon's", file=sys.stderr)
    return out


def foreign_format(folder: Path, config: dict) -> str | None:
    """Which foreign format a heads folder holds, if any."""
    if config.get("model_type") == "medusa":
        return "vllm"
    if (folder / MEDUSA_WEIGHTS).is_file() or (folder / MEDUSA_LEGACY).is_file() or "medusa_num_heads" in config:
        return "medusa"
    return None


def _load_medusa_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (folder / MEDUSA_WEIGHTS).is_file():
        return load_file(folder / MEDUSA_WEIGHTS)
    if not (folder / MEDUSA_LEGACY).is_file():
        raise GorgonError(f"{folder} has a Medusa config.json but no {MEDUSA_WEIGHTS} or {MEDUSA_LEGACY}")
    import pickle

    try:
        state = torch.load(folder / MEDUSA_LEGACY, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise GorgonError(f"refused {folder / MEDUSA_LEGACY}: it holds more than tensors (code a full unpickle would "
                          "run); convert it to safetensors where you trust it, or get a safetensors copy") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise GorgonError(f"{folder / MEDUSA_LEGACY} is not a state dict of tensors")
    return state


def import_heads(folder: Path, config: dict, fmt: str):
    """Our (MedusaConfig fields, state dict) from a vLLM or FasterDecoding Medusa folder."""
    if fmt == "vllm":
        raw = read_safetensors_folder(folder, "vLLM Medusa")
        raw = {k.replace("medusa_heads.", ""): v for k, v in raw.items()}
        heads, layers = config["num_heads"], config["num_hidden_layers"]
        shared = bool(config.get("original_lm_head", False))
        state = {}
        for h in range(heads):
            for layer in range(layers):
                w = raw[f"blocks.{h}.layers.{layer}.weight"]
                state[f"blocks.{h}.{layer}.linear.weight"] = w
                bias = raw.get(f"blocks.{h}.layers.{layer}.bias", torch.zeros(w.shape[0]))  # medusa_fc_bias off
                state[f"blocks.{h}.{layer}.linear.bias"] = bias
            if not shared:
                state[f"lm_heads.{h}.weight"] = raw[f"lm_heads.{h}.weight"]
        draft = None
        if config.get("truncated_vocab_size", config["vocab_size"]) < config["vocab_size"]:
            if "token_map" not in raw:
                raise GorgonError(f"{folder} declares a truncated vocabulary but has no token_map tensor")
            state["token_map"] = raw["token_map"].long()
            draft = int(state["token_map"].numel())
        fields = dict(num_heads=heads, num_layers=layers, hidden_size=config["hidden_size"],
                      vocab_size=config["vocab_size"], shared_lm_head=shared,
                      target_name=recorded_target(config), draft_vocab_size=draft)
        return fields, state
    raw = _load_medusa_state(folder)
    heads = config.get("medusa_num_heads") or 1 + max(int(k.split(".")[0]) for k in raw)
    layers = config.get("medusa_num_layers") or 1 + max(int(k.split(".")[1]) for k in raw
                                                         if k.endswith("linear.weight"))
    state = {}
    for h in range(heads):
        for layer in range(layers):
            state[f"blocks.{h}.{layer}.linear.weight"] = raw[f"{h}.{layer}.linear.weight"]
            state[f"blocks.{h}.{layer}.linear.bias"] = raw[f"{h}.{layer}.linear.bias"]
        state[f"lm_heads.{h}.weight"] = raw[f"{h}.{layers}.weight"]
    vocab, hidden = raw[f"0.{layers}.weight"].shape
    fields = dict(num_heads=heads, num_layers=layers, hidden_size=hidden, vocab_size=vocab, shared_lm_head=False,
                  target_name=recorded_target(config))
    return fields, state
