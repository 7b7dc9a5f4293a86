"""A draft model: a small causal LM with the target's tokenizer, here built or loaded and saved.

It starts from a smaller model of the target's family or, when the target has none, from a copy
of the target cut to its first layers (embedding, those layers, final norm, LM head).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
from pathlib import Path

import torch

from ..errors import GorgonError
from ..files import follow_umask
from ..target import check_same_tokenizer, check_vocab, load_causal_lm


def truncated_copy(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target cut to its first `num_layers` decoder layers, keeping its embedding, final norm
    and LM head: a draft that starts out speaking the target's vocabulary and style."""
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise GorgonError(f"student_layers must be between 1 and {total - 1} (the target has {total} layers), "
                          f"not {num_layers}")
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
    check_vocab(draft.config.get_text_config().vocab_size, target_model.config.get_text_config().vocab_size,
                "the draft model")


def save_draft(student, tokenizer, out: Path, state_dict: dict | None = None) -> None:
    """save_pretrained into a temporary folder, then each file renamed into place. `state_dict`:
    the weights to write instead of the model's own (gathered whole from shards)."""
    tmp = out / ".draft.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    student.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    follow_umask(tmp)
    for path in tmp.iterdir():
        os.replace(path, out / path.name)
    tmp.rmdir()
