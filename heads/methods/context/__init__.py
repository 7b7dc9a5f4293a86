"""Drafting from the context (prompt lookup), alone or merged with another drafter's tree.

drafter.py: `lookup` (pure, over token lists), `ContextDrafter`, and `MergedDrafter`, which puts
two drafters' candidates under one root within a node budget. No model and no training objective.
"""

from . import method  # noqa: F401  (registers the method with gorgon.heads.methods)
from .drafter import ContextDrafter, MergedDrafter, lookup

__all__ = ["ContextDrafter", "MergedDrafter", "lookup"]
