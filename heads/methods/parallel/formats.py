"""The layout vLLM serves a parallel drafter from: the speculators library's `peagle` type. Export to it, import
from it.

What the loaders read (speculators c05b95b, vLLM 055e47c; read, not run):
- speculators (src/speculators/models/peagle/config.py, core.py): `PEagleSpeculatorConfig` is the EAGLE-3 config
  (`Eagle3SpeculatorConfig`) with `speculators_model_type: "peagle"`, `architectures: ["PEagleSpeculator"]` and
  `mask_token_id`; `PEagleDraftModel` is the EAGLE-3 model plus `mask_hidden` (1, 1, 3H), the features fed to the
  mask positions (through `fc`), and feeds them the `mask_token_id` row of its own `embed_tokens`.
- vLLM (transformers_utils/configs/speculators/base.py, algos.py): a `peagle` folder is served as method `eagle3`
  with `parallel_drafting` (`update_peagle` maps it to `PeagleLlamaForCausalLM` / `PeagleQwen3ForCausalLM`, which
  model_executor/models/registry.py builds as the EAGLE-3 classes, and sets `pard_token` from `mask_token_id`).
  `Eagle3LlamaForCausalLM.load_weights` (llama_eagle3.py) reads `mask_hidden` (viewed as (1, 3H)) and keeps an
  `embed_tokens` that differs from the target's (`_maybe_share_embeddings`, v1/spec_decode); each step
  (v1/worker/gpu/spec_decode, `parallel_eagle`) appends N - 1 `pard_token` positions after the last accepted token,
  with `fc(mask_hidden)` as their features, at the next positions, causal, and drafts N tokens from one forward.

That is this drafter's computation (model.py), with one difference in how the mask positions' embedding is held:
here it is a vector of its own beside the target's embedding; there, a row of the draft's embedding. The export
writes the target's embedding with the mask vector in the row speculators' trainer would pick
(train/utils.py `resolve_mask_token_id`): the tokenizer's mask token, else the first row no token of the tokenizer
has (an embedding padded past its tokenizer, as Qwen's are), else its pad, eos or unk token. Only in that last case
does a token read the mask vector in vLLM (where the context holds it: the drafts there change, the output does
not); the export says so. The rest (layer, norms, LM head, d2t/t2d, the `gorgon` entry, the verifier) is the EAGLE
head's speculators export (eagle/formats.py), with `speculative_tokens` the block size.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from ...errors import GorgonError
from ...files import read_config, reading_weights, write_weights
from ...target import Target, attach_to_target
from ...vocab import is_draft_vocab
from ..eagle import formats as eagle_formats
from ..eagle.model import EagleConfig
from .model import BLOCK_SIZE, ParallelConfig, ParallelHead

FORMATS = ("peagle",)
WEIGHTS_NAME = "model.safetensors"
# What gorgon's parallel drafter does not compute: a folder of another tool that sets one is refused on import.
UNCOMPUTED = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def is_peagle(config: dict) -> bool:
    """Whether a config.json holds the speculators peagle layout."""
    return isinstance(config, dict) and config.get("speculators_model_type") == "peagle"


def export_head(head, fmt: str, out: str | Path, base_model: str | None = None, dtype: str | None = None) -> Path:
    """Write a parallel drafter to the folder `out` (new or empty) in the speculators peagle layout. `dtype`: the
    draft's dtype its config records, as the EAGLE head's export takes it."""
    if fmt not in FORMATS:
        raise GorgonError(f"unknown format {fmt!r} for a parallel drafter: use {', '.join(FORMATS)}")
    if not isinstance(head, ParallelHead):
        raise GorgonError(f"the peagle layout holds a parallel drafter, not {type(head).__name__}: export it in a "
                          "format of its own method (gorgon export --help lists them)")
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise GorgonError(f"{out} exists and is not an empty folder: export into a new one (gorgon export --out, "
                          "with --overwrite to replace an earlier export there)")
    if head.target is None:
        raise GorgonError("the peagle layout includes the target's embedding: pass --target (or load the drafter "
                          "with target=...)")
    mask_id = mask_row(head)
    eagle_formats.export_head(as_eagle(head), "speculators", out, base_model, dtype)
    config = read_config(out / "config.json", "export")
    from safetensors.torch import load_file

    state = load_file(out / WEIGHTS_NAME)
    embed = state["embed_tokens.weight"].clone()
    embed[mask_id] = head.mask_embedding.detach().to("cpu", embed.dtype)
    state["embed_tokens.weight"] = embed
    state["mask_hidden"] = head.mask_hidden.detach().to("cpu", state["fc.weight"].dtype).reshape(1, 1, -1)
    saved = {k: v for k, v in config[eagle_formats.GORGON_KEY].items() if k not in ("depth", "topk")}
    config.update(speculators_model_type="peagle", architectures=["PEagleSpeculator"], mask_token_id=mask_id,
                  **{eagle_formats.GORGON_KEY: {**saved, "block_size": head.config.block_size}})
    config["speculators_config"]["algorithm"] = "peagle"
    write_weights(out, state, config, WEIGHTS_NAME)
    return out


def as_eagle(head: ParallelHead):
    """The drafter's EAGLE head with an EAGLE head's config, drafting `block_size` tokens a step: what the EAGLE
    export writes (its `speculative_tokens`, which vLLM drafts a step). A shallow copy: the weights are shared."""
    c = head.config
    view = copy.copy(head.eagle)
    view.config = EagleConfig(hidden_size=c.hidden_size, vocab_size=c.vocab_size, layer_config=c.layer_config,
                              feature_layers=list(c.feature_layers), draft_vocab_size=c.draft_vocab_size,
                              depth=c.block_size, nodes=c.nodes, accuracies=c.accuracies, target_name=c.target_name,
                              target_fingerprint=c.target_fingerprint)
    return view


def mask_row(head: ParallelHead) -> int:
    """The embedding row the mask positions read in the export (`mask_token_id`), as speculators' trainer picks it
    (module docstring); a token given up for it is named on stderr."""
    from transformers import AutoTokenizer

    source = getattr(head.target.config, "_name_or_path", "") or ""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source) if source else None
    except (OSError, ValueError) as err:
        tokenizer, source = None, f"{source} ({err.__class__.__name__})"
    if tokenizer is None:
        raise GorgonError(f"the peagle layout keeps the mask token in a row of the target's embedding, chosen by the "
                          f"target's tokenizer, which does not load from {source or 'where the target loaded'}: load "
                          "the target from a folder or hub id that has it")
    vocab = head.config.vocab_size
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id < vocab:
        return tokenizer.mask_token_id
    used = set(tokenizer.get_vocab().values())
    row = next((i for i in range(vocab) if i not in used), None)
    if row is not None:
        return row
    name, row = next(((name, getattr(tokenizer, f"{name}_token_id")) for name in ("pad", "eos", "unk")
                      if getattr(tokenizer, f"{name}_token_id", None) is not None), (None, None))
    if row is None:
        raise GorgonError(f"the peagle layout feeds the mask positions a row of the draft's embedding "
                          f"(mask_token_id), and this target's tokenizer has no mask, pad, eos or unk token and no "
                          f"row of its {vocab} without a token: use the drafter in gorgon's decoder")
    print(f"gorgon export: every row of the target's embedding is a token, so the mask positions read the row of its "
          f"{name} token {tokenizer.convert_ids_to_tokens(row)!r} (id {row}), as speculators does: in vLLM, drafts "
          "after that token in the context read the mask vector for it (the output does not change)", file=sys.stderr)
    return row


def import_head(folder: str | Path, target, device=None, dtype=None) -> ParallelHead:
    """A parallel drafter from a peagle folder, attached to `target` (needed: the mask token's embedding is told
    from the target's by its row). Another tool's folder loads only where it computes what this drafter does:
    one layer, no extra norms, and the target's embedding but for the mask token's row."""
    folder = Path(folder)
    where = folder / "config.json"
    config = read_config(where, "drafter")
    if not is_peagle(config):
        raise GorgonError(f"{where} is not the speculators peagle layout (no speculators_model_type: peagle): load "
                          "it with gorgon.heads.load_heads")
    if target is None:
        raise GorgonError("a peagle folder's mask token is told from the target's embedding: pass target=...")
    layer = config.get("transformer_layer_config")
    odd = [k for k in UNCOMPUTED if config.get(k)]
    if isinstance(layer, dict) and layer.get("num_hidden_layers", 1) != 1:
        odd.append(f"num_hidden_layers {layer['num_hidden_layers']}")
    if odd:
        raise GorgonError(f"{where} sets {', '.join(odd)}, and gorgon's parallel drafter computes one EAGLE-3 layer "
                          "without them: serve it with vLLM, or train a parallel drafter with gorgon")
    saved = dict(config.get(eagle_formats.GORGON_KEY) or {})
    block = saved.pop("block_size", None)
    with reading_weights(folder, WEIGHTS_NAME):
        fields, state = eagle_formats.import_head(folder, {**config, eagle_formats.GORGON_KEY: saved}, "speculators")
        mask_id, vocab = config.get("mask_token_id"), fields["vocab_size"]
        if not (isinstance(mask_id, int) and not isinstance(mask_id, bool) and 0 <= mask_id < vocab):
            raise GorgonError(f"{where} has mask_token_id = {mask_id!r}, which is not a row of its embedding (0 to "
                              f"{vocab - 1}): correct it, or re-export the drafter")
        embed = saved_tensor(folder, "embed_tokens.weight")
        if embed is None:
            raise GorgonError(f"{folder} has no embed_tokens.weight, whose row {mask_id} (mask_token_id) the mask "
                              "positions read: re-export the drafter")
        fields.pop("topk", None)
        depth = fields.pop("depth", None)  # speculative_tokens, where no gorgon entry saved the block
        fields["block_size"] = block if block is not None else depth or BLOCK_SIZE
        model = target.model if isinstance(target, Target) else target
        head = ParallelHead(ParallelConfig.from_dict(fields, str(where)),
                            getattr(model.config, "_attn_implementation", None) or "sdpa")
        head.eagle.load_state_dict({k: v for k, v in state.items() if k != "mask_hidden"})
        with torch.no_grad():
            head.mask_hidden.copy_(state["mask_hidden"].reshape(-1))
            head.mask_embedding.copy_(embed[mask_id])
    if head.token_map is not None and not is_draft_vocab(head.token_map, head.config.vocab_size):
        raise GorgonError(f"{folder}'s draft vocabulary (d2t) is not distinct token ids below "
                          f"{head.config.vocab_size} in increasing order: re-export the drafter")
    head = attach_to_target(head, target, device, dtype)  # another target is refused here, in one line
    embedding = model.get_input_embeddings().weight.detach().cpu()
    others = torch.arange(len(embedding)) != mask_id
    if embed.shape != embedding.shape or not torch.equal(embed[others], embedding[others].to(embed.dtype)):
        raise GorgonError(f"{folder}'s embed_tokens is not the target's (but for the mask token's row), and gorgon's "
                          "parallel drafter reads the target's embedding: serve it with vLLM, or re-export it from "
                          "gorgon with this target")
    return head


def saved_tensor(folder: Path, key: str) -> torch.Tensor | None:
    """One tensor of a folder's (perhaps sharded) safetensors files, or None where none holds it."""
    from safetensors import safe_open

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    return None
