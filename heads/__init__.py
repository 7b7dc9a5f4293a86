"""Targets and the drafting methods that speed them up.

The core every stage uses: loading a target and its fingerprint (target.py), one-line errors
(errors.py), atomic files (files.py), the Hub (hub.py), candidate trees (tree.py), the drafter
interface (drafter.py) and model cards (card.py). Each drafting method keeps its model, drafter
and training objective in its own subpackage: medusa/ (Medusa heads), draft_model/ (a small
distilled causal LM).
"""

from .draft_model import DraftModelDrafter
from .drafter import Drafter
from .errors import GorgonError
from .medusa import HeadsConfig, HeadsDrafter, MedusaHeads, load_with_heads
from .target import Target, fingerprint, load_target
from .tree import Tree, build_tree, default_tree, tree_from_accuracies

__all__ = ["DraftModelDrafter", "Drafter", "GorgonError", "HeadsConfig", "HeadsDrafter", "MedusaHeads", "Target",
           "Tree", "build_tree", "default_tree", "fingerprint", "load_target", "load_with_heads",
           "tree_from_accuracies"]
