"""Speculative decoding with a tree of candidates verified in one target forward.

Importing this package pulls in torch and transformers only (no trl, datasets, peft, wandb).
"""

from .acceptance import Sampling
from .drafters import Drafter, DraftModelDrafter, HeadsDrafter
from .generate import GenerationResult, speculative_generate
from .tree import Tree, build_tree, default_tree, tree_from_accuracies

__all__ = ["DraftModelDrafter", "Drafter", "GenerationResult", "HeadsDrafter", "Sampling", "Tree", "build_tree",
           "default_tree", "speculative_generate", "tree_from_accuracies"]
