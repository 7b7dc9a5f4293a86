"""Medusa heads (Medusa-1 and Medusa-2): K residual MLPs on the target's last hidden state.

model.py: the heads, their config and checkpoint folder; drafter.py: the heads as a drafter
(a fixed tree of top-k ranks); objective.py: the training loss; formats.py: vLLM's and
FasterDecoding Medusa's checkpoint layouts.
"""

from . import method  # noqa: F401  (registers the method with gorgon.heads.methods)
from .drafter import MedusaDrafter
from .model import MedusaConfig, MedusaHeads

__all__ = ["MedusaDrafter", "MedusaConfig", "MedusaHeads"]
