"""A draft model: a small causal LM with the target's tokenizer, here built or loaded and saved.

It starts from a smaller model of the target's family or, when the target has none, from a copy
of the target cut to its first layers (embedding, those layers, final norm, LM head).

A draft vocabulary (the most frequent answer tokens, saved beside the weights in
`draft_vocab.safetensors`) lets it draft through an output layer cut to those rows: on a small
draft the full output layer is most of each forward's cost (FR-Spec, Zhao et al. 2025, makes the
same cut; EAGLE-3's d2t/t2d is the EAGLE head's). Drafts only propose, so output is exact.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import torch

from ...errors import GorgonError
from ...files import follow_umask, new_temp, remove_stale_temps
from ...target import load_causal_lm
from ...vocab import is_draft_vocab

DRAFT_VOCAB_NAME = "draft_vocab.safetensors"


def check_student_layers(num_layers: int, total: int) -> None:
    """A draft cut from a target of `total` layers keeps at least one and fewer than all."""
    if not 1 <= num_layers < total:
        raise GorgonError(f"student_layers must be between 1 and {total - 1} (the target has {total} layers), "
                          f"not {num_layers}")


def truncated_copy(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target cut to its first `num_layers` decoder layers, keeping its embedding, final norm
    and LM head: a draft that starts out speaking the target's vocabulary and style."""
    check_student_layers(num_layers, model.config.num_hidden_layers)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    student = type(model)(config)
    layer = re.compile(r"\.layers\.(\d+)\.")
    state = {k: v for k, v in model.state_dict().items()
             if not (m := layer.search(k)) or int(m.group(1)) < num_layers}
    student.load_state_dict(state, strict=True)
    student.generation_config = copy.deepcopy(model.generation_config)
    return student


def load_student(target, student: str | None, student_layers: int) -> tuple[torch.nn.Module, str]:
    """The draft to start from, in fp32 on the target's device, and a phrase saying what it is: the model
    `student` (sharing the target's tokenizer), or else the target's first `student_layers` layers."""
    if student is None:
        model = truncated_copy(target.model, student_layers)
        what = f"the first {student_layers} of the target's {target.model.config.num_hidden_layers} layers"
    else:
        model, tokenizer = load_causal_lm(student, "student", dtype=torch.float32)
        check_same_tokenizer(target.tokenizer, tokenizer, f"student {student}")
        what = f"`{student}`"
    check_draft_vocab(model, target.model)
    return model.float().to(target.model.device), what


def check_draft_vocab(draft, target_model) -> None:
    """A draft's token ids must mean the target's tokens, and distillation compares whole distributions:
    the vocabulary sizes must agree."""
    mine, theirs = draft.config.get_text_config().vocab_size, target_model.config.get_text_config().vocab_size
    if mine != theirs:
        raise GorgonError(f"the draft model: a vocabulary of {mine}, but the target has {theirs}: use one made for "
                          "this target (the same tokenizer)")


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str) -> None:
    """Refuse a draft whose token ids mean other text than the target's: speculation compares ids,
    so a draft from another tokenizer would be verified against the wrong tokens."""
    mine, theirs = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    differ = sorted(tok for tok in mine.keys() | theirs.keys() if mine.get(tok) != theirs.get(tok))
    if differ:
        examples = ", ".join(repr(t) for t in differ[:3])
        raise GorgonError(f"{draft_name}'s tokenizer differs from the target's ({len(differ)} tokens are missing or "
                          f"have other ids, e.g. {examples}): use a draft from the target's own model family, or a "
                          "truncated copy of the target (student_layers)")


def save_draft(student, tokenizer, out: Path, state_dict: dict | None = None,
               token_map: torch.Tensor | None = None) -> None:
    """save_pretrained into a temporary folder, then each file renamed into place. `state_dict`:
    the weights to write instead of the model's own (gathered whole from shards); `token_map`: the
    draft vocabulary's token ids, saved as DRAFT_VOCAB_NAME."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out, ".draft-")
    tmp = new_temp(out, ".draft-", is_dir=True)
    student.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    if token_map is not None:
        save_file({"token_map": token_map.to(torch.long).sort().values.contiguous()}, tmp / DRAFT_VOCAB_NAME)
    follow_umask(tmp)
    for path in tmp.iterdir():
        os.replace(path, out / path.name)
    tmp.rmdir()


def load_draft_vocab(name_or_path: str, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary saved beside a draft (a folder or hub id; found the way transformers finds the
    draft's own files), as sorted token ids; None when it has none."""
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    path = cached_file(name_or_path, DRAFT_VOCAB_NAME, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False)
    if path is None:
        return None
    token_map = load_file(path).get("token_map")
    if token_map is None or not is_draft_vocab(token_map, vocab_size):
        raise GorgonError(f"{path} is not a draft vocabulary for a vocabulary of {vocab_size}: it must hold "
                          "`token_map`, increasing token ids below that size; delete it to draft from every token")
    return token_map


def load_draft(name_or_path: str, target) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """A trained draft model for a loaded `target` (a folder or hub id), in the target's dtype: checked against
    its tokenizer and vocabulary, and cut to its draft vocabulary when saved with one (returned too, as the
    target ids of its output rows; else None)."""
    # A folder of weights only has no tokenizer: the vocabulary size check is all there is to go on.
    draft, tokenizer = load_causal_lm(name_or_path, "draft model", dtype=target.model.dtype, tokenizer="optional")
    if tokenizer is not None:
        check_same_tokenizer(target.tokenizer, tokenizer, f"draft {name_or_path}")
    check_draft_vocab(draft, target.model)
    token_map = load_draft_vocab(name_or_path, draft.config.get_text_config().vocab_size)
    if token_map is not None:
        cut_to_draft_vocab(draft, token_map)
    return draft, token_map


def cut_to_draft_vocab(draft: torch.nn.Module, token_map: torch.Tensor) -> torch.nn.Module:
    """The draft with its output layer cut to the rows of `token_map` (a new layer: the input embedding
    it may be tied to stays whole), so its logits are over the draft vocabulary, in that order."""
    full = draft.get_output_embeddings()
    cut = torch.nn.Linear(full.in_features, len(token_map), bias=full.bias is not None,
                          device=full.weight.device, dtype=full.weight.dtype)
    with torch.no_grad():
        cut.weight.copy_(full.weight[token_map.to(full.weight.device)])
        if full.bias is not None:
            cut.bias.copy_(full.bias[token_map.to(full.weight.device)])
    draft.set_output_embeddings(cut)
    return draft
