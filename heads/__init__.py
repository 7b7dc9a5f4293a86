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

import importlib
from typing import TYPE_CHECKING

# Each name and the module it lives in, imported on first use: the `gorgon` command (heads/cli.py) starts,
# handles Ctrl-C and prints its help before torch loads.
_EXPORTS = {
    "ContextDrafter": ".context", "MergedDrafter": ".context",
    "DRAFT_TOKENS": ".draft_model", "MAX_DRAFT_TOKENS": ".draft_model", "DraftModelDrafter": ".draft_model",
    "load_draft": ".draft_model",
    "Drafter": ".drafter",
    "EagleConfig": ".eagle", "EagleDrafter": ".eagle", "EagleHead": ".eagle",
    "GorgonError": ".errors",
    "drafter_for": ".loading", "load_heads": ".loading", "load_heads_for": ".loading",
    "MedusaDrafter": ".medusa", "MedusaConfig": ".medusa", "MedusaHeads": ".medusa",
    "Target": ".target", "fingerprint": ".target", "load_target": ".target",
    "Tree": ".tree", "build_tree": ".tree", "tree_from_accuracies": ".tree",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # found directly from now on
    return value


if TYPE_CHECKING:  # what editors and type checkers read
    from .context import ContextDrafter, MergedDrafter
    from .draft_model import DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftModelDrafter, load_draft
    from .drafter import Drafter
    from .eagle import EagleConfig, EagleDrafter, EagleHead
    from .errors import GorgonError
    from .loading import drafter_for, load_heads, load_heads_for
    from .medusa import MedusaDrafter, MedusaConfig, MedusaHeads
    from .target import Target, fingerprint, load_target
    from .tree import Tree, build_tree, tree_from_accuracies
