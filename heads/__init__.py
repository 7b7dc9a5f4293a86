"""Targets and the drafting methods that speed them up.

The core every stage uses: loading a target and its fingerprint (target.py), KV caches (cache.py),
tree attention masks (masks.py), one-line errors (errors.py), atomic files (files.py), the Hub
(hub.py), candidate trees (tree.py), the drafter interface (drafter.py), the tree search two
methods share (search.py), draft vocabularies (vocab.py), model cards (card.py), loading any heads
folder (loading.py) and the frozen target's outputs kept across epochs (feature_cache.py). Each
drafting method keeps its model, drafter and training objective in its own subpackage: medusa/
(Medusa heads), eagle/ (a feature-level head, EAGLE-3's layout), draft_model/ (a small distilled
causal LM), context/ (prompt lookup, which needs no model, and merging it into another tree).
"""

from .context import ContextDrafter, MergedDrafter
from .draft_model import DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftModelDrafter, load_draft
from .drafter import Drafter
from .eagle import EagleConfig, EagleDrafter, EagleHead
from .errors import GorgonError
from .loading import drafter_for, load_heads, load_heads_for
from .medusa import HeadsDrafter, MedusaConfig, MedusaHeads, load_with_heads
from .target import Target, fingerprint, load_target
from .tree import Tree, build_tree, tree_from_accuracies

__all__ = ["DRAFT_TOKENS", "MAX_DRAFT_TOKENS", "ContextDrafter", "DraftModelDrafter", "Drafter", "EagleConfig",
           "EagleDrafter", "EagleHead", "GorgonError", "HeadsDrafter", "MedusaConfig", "MedusaHeads",
           "MergedDrafter", "Target", "Tree", "build_tree", "drafter_for", "fingerprint", "load_draft", "load_heads",
           "load_heads_for", "load_target", "load_with_heads", "tree_from_accuracies"]
