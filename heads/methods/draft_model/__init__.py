"""A draft model: a small causal LM with the target's tokenizer, distilled from the target with trl's GKD.

model.py: the student (a same-family sibling or the target cut to its first layers), its saving
and its draft vocabulary (the output layer cut to the most frequent answer tokens); drafter.py:
the draft as a drafter (a greedy chain or a tree, with its own KV cache); objective.py: GKD's
batches and the held-out agreement with the target.
"""

from . import method  # noqa: F401  (registers the method with gorgon.heads.methods)
from .drafter import DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftModelDrafter
from .model import cut_to_draft_vocab, load_draft, load_draft_vocab

__all__ = ["DRAFT_TOKENS", "MAX_DRAFT_TOKENS", "DraftModelDrafter", "cut_to_draft_vocab", "load_draft",
           "load_draft_vocab"]
