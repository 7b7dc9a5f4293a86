"""A draft model: a small causal LM with the target's tokenizer, distilled from the target with trl's GKD.

model.py: the student (a same-family sibling or the target cut to its first layers) and its
saving; drafter.py: the draft as a drafter (a greedy chain with its own KV cache);
objective.py: GKD's batches and the held-out agreement with the target.
"""

from .drafter import DraftModelDrafter

__all__ = ["DraftModelDrafter"]
