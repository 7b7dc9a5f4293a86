"""A parallel drafter (P-EAGLE / DFlash family): a block of k drafts in one forward.

model.py: the drafter (the target's features and the next token's embedding, then k - 1 learned mask
positions, through an EAGLE head's layer), its config and folder; drafter.py: the block as a
drafter with its own KV cache and a fixed tree of rank paths; objective.py: the training loss;
formats.py: the speculators `peagle` layout vLLM serves it from; method.py: its registration; card.py:
its model card.
"""

from . import method  # noqa: F401  (registers the method with gorgon.heads.methods)
from .drafter import ParallelDrafter
from .model import ParallelConfig, ParallelHead

__all__ = ["ParallelConfig", "ParallelDrafter", "ParallelHead"]
