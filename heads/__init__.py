"""Targets and the drafting methods that speed them up.

The core every stage uses: loading a target and its fingerprint (target.py), KV caches (cache.py),
tree attention masks (masks.py), candidate trees (tree.py), the drafter interface (drafter.py), the
tree search two methods share (search.py), draft vocabularies (vocab.py), the frozen target's outputs
kept across epochs (feature_cache.py); one-line errors (errors.py), atomic files (files.py), the Hub
(hub.py); publishing: model cards (card.py), exports (export.py), pushes (push.py); loading any heads
folder (loading.py). The drafting methods live in methods/, one folder each, registered once
(methods/__init__.py): medusa/ (Medusa heads), eagle/ (an EAGLE head, EAGLE-3's layout),
draft_model/ (a small distilled causal LM), context/ (prompt lookup, and merging it into another tree).
"""

import importlib
from typing import TYPE_CHECKING

# Each name and the module it lives in, imported on first use: the `gorgon` command (heads/cli.py) starts,
# handles Ctrl-C and prints its help before torch loads.
_EXPORTS = {
    "ContextDrafter": ".methods.context", "MergedDrafter": ".methods.context",
    "DRAFT_TOKENS": ".methods.draft_model", "MAX_DRAFT_TOKENS": ".methods.draft_model",
    "DraftModelDrafter": ".methods.draft_model",
    "load_draft": ".methods.draft_model",
    "Drafter": ".drafter",
    "EagleConfig": ".methods.eagle", "EagleDrafter": ".methods.eagle", "EagleHead": ".methods.eagle",
    "GorgonError": ".errors",
    "drafter_for": ".loading", "load_heads": ".loading", "load_heads_for": ".loading",
    "MedusaDrafter": ".methods.medusa", "MedusaConfig": ".methods.medusa", "MedusaHeads": ".methods.medusa",
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
    from .drafter import Drafter
    from .errors import GorgonError
    from .loading import drafter_for, load_heads, load_heads_for
    from .methods.context import ContextDrafter, MergedDrafter
    from .methods.draft_model import DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftModelDrafter, load_draft
    from .methods.eagle import EagleConfig, EagleDrafter, EagleHead
    from .methods.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
    from .target import Target, fingerprint, load_target
    from .tree import Tree, build_tree, tree_from_accuracies
