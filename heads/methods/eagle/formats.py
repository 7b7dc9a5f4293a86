"""The layouts serving engines load an EAGLE head from: export to them, import from them.

- eagle3: what vLLM (model_executor/models/llama_eagle3.py, qwen3_eagle3.py) and SGLang
  (srt/models/llama_eagle3.py) load: config.json of a one-layer Llama (`architectures:
  ["LlamaForCausalLMEagle3"]`) or, for a head whose layer has Qwen3's q/k norms, a one-layer Qwen3
  (`["Eagle3Qwen3ForCausalLM"]`, vLLM only: SGLang has no class of that name), with
  `draft_vocab_size`, `target_hidden_size`, `norm_before_residual: false` (vLLM's speculators path
  assumes true when it is missing); weights `fc`, `midlayer.*` (q/k/v take twice the hidden
  size; `hidden_norm`), `norm`, `lm_head` over the draft vocabulary, `d2t` (int64: target id =
  draft id + d2t[draft id]) and `t2d` (bool over the target vocabulary). The embedding is the
  target's in both engines, so it is not written.
- speculators: the `speculators` library's Eagle3 layout, which vLLM also reads: the same weights
  with `layers.0.` for `midlayer.` and the embedding included, and a config.json with
  `speculators_model_type: "eagle3"`, `transformer_layer_config` (its `model_type`, llama or qwen3,
  picks vLLM's class: in the change that added `Eagle3Qwen3ForCausalLM`, vLLM PR #43132; older
  releases build every speculators draft as Llama and fail loading a Qwen3 head's q/k norms, as they
  fail on the eagle3 layout's unknown class), and `speculators_config` (`proposal_methods`,
  `default_proposal_method`, `verifier`). The verifier is the folder the target loaded from where that
  is the target the head was trained on (the embedded build's too), so that speculators and `vllm serve
  <export>` load it offline; `base_model_name_or_path` keeps the name engines elsewhere know it by.

Both also carry a `gorgon` entry, which the engines' configs (transformers' PretrainedConfig, and the
speculators library's, which allows extra fields) keep without reading: the target's layer count, its
fingerprint and the drafting settings (`SAVED_SETTINGS`), so that an imported head is checked against its
target and exports again exactly as it was exported. A folder written elsewhere has none: its head drafts
as deep as its `speculative_tokens` (speculators), gets `EagleConfig`'s other defaults and no fingerprint
(checked against a target by shape only), and for the target's layer count the fewest its layers allow
(one more than the highest: the engines read no state after the last layer), which the export's checks
need; attaching it checks its layers against the real target. A folder that names no target layers
(null, as `speculators convert` writes) reads those the engines then read: [2, L // 2, L - 3] of its
target's L layers, counted in the config of the target it names.

Which target layers feed `fc`: vLLM reads explicit ids from the top level and uses them as the
input of layer k (our hidden_states index k); SGLang reads `eagle_config` ids and adds one. Both
are written, one apart, so the two engines read the same layers (inferred from their code, not run).
Both capture them in increasing order and neither captures the final normed state (transformers'
last hidden_states entry), so a head that reads its layers otherwise does not export.
The head's computation is the engines' (model.py), so an exported head drafts as it does here;
only a Llama or Qwen3 layer's weights export (vLLM fails on any other weight, SGLang skips it); a
family whose attention has q/k/v biases (Qwen2) exports as Llama with `attention_bias`, which vLLM
reads and SGLang ignores. A head over the whole vocabulary has no `d2t`/`t2d` (vLLM then has no
parameter to load them into). `dtype` is the target's when the head trained, or the one `gorgon
export --dtype` writes the weights in: SGLang runs the draft in its config's dtype, not the
target's, and fails when they differ.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ...errors import GorgonError, check_keys
from ...files import read_safetensors_folder, write_weights
from ...target import hub_name, recorded_target, target_text_config

FORMATS = ("eagle3", "speculators")
# The layers the engines build a draft's midlayer as (model_type), and the eagle3 architecture naming each.
ENGINE_LAYERS = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
EAGLE3_ARCHITECTURES = (*ENGINE_LAYERS.values(), "Eagle3LlamaForCausalLM")
# The config fields a one-layer EAGLE-3 draft (Llama or Qwen3) needs from the target's text config.
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
                "rope_parameters", "attention_bias", "mlp_bias", "dtype")
GORGON_KEY = "gorgon"  # config.json's entry for what gorgon needs back on import and the engines ignore
SAVED_SETTINGS = ("target_fingerprint", "depth", "topk", "nodes", "accuracies")  # EagleConfig fields kept there


def engine_layer_config(head, model_type: str) -> dict:
    """The head's decoder layer as a one-layer config of `model_type` (what the engines build the midlayer from)."""
    src = head.config.layer_config
    attn = head.midlayer.self_attn
    config = {k: src[k] for k in LAYER_FIELDS if src.get(k) is not None}
    config.update(model_type=model_type, num_hidden_layers=1, vocab_size=head.config.vocab_size,
                  attention_bias=attn.q_proj.bias is not None, tie_word_embeddings=False,
                  mlp_bias=getattr(head.midlayer.mlp.gate_proj, "bias", None) is not None)
    return config


def export_head(head, fmt: str, out: str | Path, base_model: str | None = None, dtype: str | None = None) -> Path:
    """Write `head` in a serving engine's layout to the folder `out`. `dtype`: the draft's dtype its config
    records (default: the target's when the head trained), which should be the served target's."""

    if fmt not in FORMATS:
        raise GorgonError(f"unknown format {fmt!r} for an EAGLE head: use one of {', '.join(FORMATS)}")
    check_exportable_layers(head.config)
    attn = head.midlayer.self_attn
    state = {k: v for k, v in head.state_dict().items() if k != "token_map"}
    if attn.q_proj.bias is not None and attn.o_proj.bias is None:  # Llama's attention_bias covers o_proj too
        state["midlayer.self_attn.o_proj.bias"] = attn.o_proj.weight.new_zeros(attn.o_proj.out_features)
    if attn.q_proj.bias is not None and fmt == "eagle3":
        print("gorgon export: note: this head's q/k/v have biases (its target's family has them): vLLM reads them, "
              "but SGLang's EAGLE-3 loader builds its attention without biases and leaves them out, so the head "
              "drafts worse there", file=sys.stderr)
    layer = with_top_level_rope(engine_layer(head, state))
    if dtype is not None:
        layer["dtype"] = dtype
    vocab, draft = head.config.vocab_size, head.config.draft_vocab_size or head.config.vocab_size
    if head.token_map is not None:
        state["d2t"] = (head.token_map.cpu() - torch.arange(draft)).long()
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, head.token_map.cpu(), True)
    layers = list(head.config.feature_layers)
    base = base_model or head.config.target_name
    common = {"draft_vocab_size": draft, "target_hidden_size": head.config.hidden_size,
              "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": layers,
              GORGON_KEY: {"target_num_hidden_layers": head.config.layer_config["num_hidden_layers"],
                           **{k: getattr(head.config, k) for k in SAVED_SETTINGS}}}
    if fmt == "eagle3":
        config = {**layer, "architectures": [ENGINE_LAYERS[layer["model_type"]]], **common,
                  "eagle_config": {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]},
                  "base_model_name_or_path": base}
    else:
        state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
        if head.target is None:
            raise GorgonError("the speculators layout includes the target's embedding: pass --target (or load the "
                              "head with target=...)")
        state["embed_tokens.weight"] = head.target.get_input_embeddings().weight
        verifier_arch = getattr(head.target.config, "architectures", None) or []
        verifier = verifier_name(head, base)
        if verifier != base:
            print(f"gorgon export: note: the speculators verifier is {verifier}, where the target loaded from, so that "
                  f"the export loads offline here (speculators' from_pretrained and `vllm serve <export>` load it); "
                  f"base_model_name_or_path keeps {base}", file=sys.stderr)
        config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                  "transformer_layer_config": layer, **common, "speculators_version": "0.3.0",
                  "speculators_config": {
                      "algorithm": "eagle3",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": head.config.depth,
                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                      "default_proposal_method": "greedy",
                      "verifier": {"name_or_path": verifier, "architectures": list(verifier_arch)}},
                  "base_model_name_or_path": base}
    out = Path(out)
    write_weights(out, state, config)
    return out


def verifier_name(head, base: str | None) -> str | None:
    """The speculators verifier, which speculators' `from_pretrained` and `vllm serve <export>` load: the folder the
    target loaded from (absolute) where `base` names that target (its path, or the Hub id `gorgon export` gives the
    target the head was trained on, as the embedded build's), so that it loads offline; any other name as given
    (a --base-model to publish under)."""
    if base is None:  # a head saved without its target's name, exported without --base-model
        return None
    if Path(base).expanduser().is_dir():
        return str(Path(base).expanduser().resolve())
    loaded = getattr(head.target.config, "_name_or_path", None)  # from_pretrained's argument
    if loaded and base == hub_name(head.config.target_name or "") and Path(loaded).is_dir():
        return str(Path(loaded).resolve())
    return base


def with_top_level_rope(config: dict) -> dict:
    """transformers 5 keeps the rotary settings in `rope_parameters` only; SGLang's layers read `rope_theta`
    (default 10000) and `rope_scaling` from the top level, so both are written there too."""
    rope = config.get("rope_parameters") or {}
    extra = {}
    if "rope_theta" not in config and "rope_theta" in rope:
        extra["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        extra["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {**config, **extra}


def computes_rms_norm(norm: torch.nn.Module) -> bool:
    """Whether a norm module computes weight * rms_norm(x in float32), cast back before the weight, as the
    engines' layers do (Llama's RMS norm and its copies in Qwen2/3 and Mistral; not Gemma's 1 + weight):
    checked on a probe with a weight that is not all ones, to within float32 rounding, on the CPU wherever the
    norm is (or the default device is: a head built under `with torch.device("cuda")`)."""
    if not isinstance(getattr(norm, "variance_epsilon", None), float) or getattr(norm, "weight", None) is None:
        return False
    with torch.device("cpu"), torch.no_grad():
        probe = copy.deepcopy(norm).to("cpu", torch.float32)
        x = torch.randn(4, probe.weight.numel(), generator=torch.Generator().manual_seed(0))
        probe.weight.normal_(generator=torch.Generator().manual_seed(1))
        fused = probe.weight * F.rms_norm(x, probe.weight.shape, eps=probe.variance_epsilon)
        return torch.allclose(probe(x), fused, rtol=1e-5, atol=1e-6)


def check_exportable_layers(config) -> None:
    """The target layers must be ones the engines capture, in the order they concatenate them."""
    layers, count = list(config.feature_layers), config.layer_config["num_hidden_layers"]
    if len(layers) != 3:
        raise GorgonError(f"the EAGLE-3 layout mixes exactly 3 target layers, and this head reads {len(layers)} "
                          f"({layers}): train with 3 feature_layers (the default) to export")
    if layers != sorted(set(layers)) or layers[-1] >= count:
        raise GorgonError(f"serving engines read 3 distinct target layers in increasing order, below the last "
                          f"({count}, whose output they take before the final norm and transformers after it), "
                          f"and this head reads {layers}: train with such feature_layers (the default) to export")


def engine_layer(head, state: dict) -> dict:
    """The one-layer config (`engine_layer_config`) of the engine layer (ENGINE_LAYERS) that holds exactly the
    head's midlayer weights. Any other weight would fail to load in vLLM and be dropped without a word by
    SGLang, so a head with none such does not export."""
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    if not all(computes_rms_norm(norm) for norm in (head.midlayer.input_layernorm, head.norm)):
        raise GorgonError("this head's norms scale by 1 + weight (a Gemma-style layer) and the engines' Llama and "
                          "Qwen3 layers by the weight alone: use it in gorgon's decoder, or train it on a Llama- or "
                          "Qwen3-shaped target to export")
    ours = {k for k in state if k.startswith("midlayer.")}
    expected = {}
    for model_type, config_cls, layer_cls in (("llama", LlamaConfig, LlamaDecoderLayer),
                                              ("qwen3", Qwen3Config, Qwen3DecoderLayer)):
        config = engine_layer_config(head, model_type)
        with torch.device("meta"):
            layer = layer_cls(config_cls(**{k: v for k, v in config.items() if k != "model_type"}), layer_idx=0)
        expected[model_type] = {f"midlayer.{k}" for k in layer.state_dict()} | {"midlayer.hidden_norm.weight"}
        if ours == expected[model_type]:
            return config
    odd = ", ".join(sorted(ours ^ expected["llama"]))
    raise GorgonError(f"this head's decoder layer is neither a Llama nor a Qwen3 layer (beside a Llama layer's "
                      f"weights: {odd}), the layers the EAGLE-3 layout holds: use it in gorgon's decoder, or train it "
                      f"on a Llama- or Qwen3-shaped target to export")


def foreign_format(config: dict) -> str | None:
    """Which engine layout a heads config.json holds, if any."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if set(config.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        return "eagle3"
    return None


def check_layer_fields(layer: dict, needed: tuple[str, ...], where: str) -> None:
    """A hand-edited or foreign config.json: a missing field, or a model_type this transformers cannot build,
    is one line naming the file and the field, not a KeyError or transformers' list of every model type."""
    from transformers import CONFIG_MAPPING, __version__

    missing = [k for k in needed if k not in layer]
    if missing:
        raise GorgonError(f"{where} lacks {', '.join(missing)}: copy them from the target's config.json")
    if layer["model_type"] not in CONFIG_MAPPING:
        raise GorgonError(f"{where} has model_type {layer['model_type']!r}, which transformers {__version__} does not "
                          "know: upgrade transformers, or correct it to the target's family (llama, qwen3, ...)")


def engines_default_layers(count: int) -> list[int]:
    """The target layers vLLM and speculators read for a draft that names none: (2, L // 2, L - 3) of the target's L
    layers, in vLLM's `get_eagle3_default_aux_hidden_state_layers` (model_executor/models/interfaces.py; the inputs
    of those layers, our hidden_states indices) and speculators' `resolve_target_layer_ids` (models/utils.py, from
    the verifier's config)."""
    return [2, count // 2, count - 3]


def target_layer_count(folder: Path, config: dict) -> int:
    """How many layers the target of a folder that names no layers has (the engines' default layers count them):
    read from the config of the target it names."""
    name = recorded_target(config)
    fix = "add eagle_aux_hidden_state_layer_ids (the target layers the head reads) to its config.json"
    if name is None:
        raise GorgonError(f"{folder} names neither the target layers it reads nor its target: {fix}")
    try:
        return target_text_config(name).num_hidden_layers
    except GorgonError as err:
        raise GorgonError(f"{folder} does not name the target layers it reads (the engines then read [2, L // 2, "
                          f"L - 3] of its target's L layers), and its target's config cannot be read ({err}): {fix}"
                          ) from None


def import_head(folder: Path, config: dict, fmt: str):
    """Our (EagleConfig fields, state dict) from an EAGLE-3 or speculators folder; what its `gorgon` entry
    saved, else the defaults (module docstring)."""
    where = folder / "config.json"
    if fmt == "speculators" and not isinstance(config.get("transformer_layer_config"), dict):
        raise GorgonError(f"{where} lacks transformer_layer_config (the draft's layer): re-export the head")
    layer = dict(config["transformer_layer_config"] if fmt == "speculators" else config)
    check_layer_fields(layer, ("model_type", "hidden_size", "vocab_size", "rms_norm_eps"),
                       f"{where}'s transformer_layer_config" if fmt == "speculators" else str(where))
    saved = dict(config.get(GORGON_KEY) or {})
    check_keys(saved, {"target_num_hidden_layers", *SAVED_SETTINGS}, f"in {where}'s {GORGON_KEY} entry")
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if not layers and (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
        layers = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # SGLang's count
    if not layers:  # null or empty, as `speculators convert` writes it: the engines' default layers
        if "target_num_hidden_layers" not in saved:
            saved["target_num_hidden_layers"] = target_layer_count(folder, config)
        layers = engines_default_layers(saved["target_num_hidden_layers"])
    proposed = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    if "depth" not in saved and isinstance(proposed[0], dict) and "speculative_tokens" in proposed[0]:
        saved["depth"] = proposed[0]["speculative_tokens"]  # how deep it drafts elsewhere (vLLM reads the first)
    raw = read_safetensors_folder(folder, fmt)
    state = {}
    for key, value in raw.items():
        key = key.replace("layers.0.", "midlayer.", 1).removeprefix("model.")
        if key in ("t2d", "embed_tokens.weight"):
            continue  # t2d follows from d2t; the embedding is the target's
        state[key] = value
    d2t = state.pop("d2t", None)
    vocab, draft = layer["vocab_size"], config.get("draft_vocab_size") or layer["vocab_size"]
    if d2t is not None and draft < vocab:
        state["token_map"] = (d2t.long() + torch.arange(draft)).long()
    fields = {k: layer[k] for k in LAYER_FIELDS + ("model_type", "vocab_size") if layer.get(k) is not None}
    fields["num_hidden_layers"] = saved.pop("target_num_hidden_layers", max(layers) + 1)  # the target's, as ours
    eagle = dict(hidden_size=layer["hidden_size"], vocab_size=vocab, layer_config=fields, feature_layers=list(layers),
                 draft_vocab_size=draft if draft < vocab else None,
                 target_name=recorded_target(config), **saved)
    return eagle, state
