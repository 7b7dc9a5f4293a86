"""A heads folder, whichever drafting method wrote it: loaded with its target, and as a drafter.

config.json says which: `"arch": "eagle"` (or an EAGLE-3 or speculators layout) is a feature-level
head; anything else is Medusa heads (gorgon's own, vLLM's or FasterDecoding's layout).
"""

from __future__ import annotations

import os

import torch

from .eagle import EagleDrafter, EagleHead
from .eagle.formats import foreign_format
from .eagle.model import ARCH
from .errors import GorgonError
from .files import config_or_none, read_config
from .hub import CONFIG_NAME, resolve_heads_folder
from .medusa import HeadsDrafter, MedusaHeads
from .medusa.model import ADAPTER_DIR, check_not_a_model
from .target import Target, check_config_fits, load_target, target_for_heads


def is_eagle(folder) -> bool:
    """Whether a heads folder holds a feature-level head."""
    config = config_or_none(folder)
    return config is not None and (config.get("arch") == ARCH or foreign_format(config) is not None)


def load_heads(heads: str | os.PathLike, target: str | os.PathLike | None = None, device: str = "auto",
               dtype: str | torch.dtype = "auto") -> tuple[Target, object]:
    """The target and the heads in a folder or hub repo, whichever method wrote them (a Medusa-2 folder's LoRA
    adapter merged into the target). `target` None: the one the heads were trained for (`target_for_heads`)."""
    folder = resolve_heads_folder(heads)  # fail before the slower target load
    feature_level = is_eagle(folder)
    config = read_config(folder / CONFIG_NAME, "head" if feature_level else "heads")
    if not feature_level:
        check_not_a_model(folder, config)
    target = target_for_heads(config, target)
    check_config_fits(config, target)
    adapter = folder / ADAPTER_DIR if (folder / ADAPTER_DIR).is_dir() and not feature_level else None
    loaded = load_target(target, device=device, dtype=dtype, adapter=adapter)
    return loaded, (EagleHead if feature_level else MedusaHeads).from_pretrained(folder, target=loaded)


def load_heads_for(heads: str | os.PathLike, target: Target):
    """Heads for a target already loaded (to compare two heads on one target): checked against it by
    fingerprint. A Medusa-2 folder is refused, since its adapter would change the target itself."""
    folder = resolve_heads_folder(heads)
    if is_eagle(folder):
        return EagleHead.from_pretrained(folder, target=target)
    if (folder / ADAPTER_DIR).is_dir():
        raise GorgonError(f"{heads} holds Medusa-2 heads, whose LoRA adapter changes the target: compare them as "
                          "--heads, or compare Medusa-1 or feature-level heads")
    return MedusaHeads.from_pretrained(folder, target=target)


def drafter_for(heads, tree=None, depth: int | None = None, topk: int | None = None):
    """The drafter for loaded heads. tree: Medusa's rank paths, node count or 'auto'; for a feature-level
    head a node count per step or 'auto' (the count saved for this device), and its search's depth and
    top-k (None: those saved with it)."""
    if isinstance(heads, EagleHead):
        if isinstance(tree, list):
            raise GorgonError("a feature-level head builds its tree each step: pass --tree N (nodes per step) "
                              "or auto, not a list of rank paths")
        drafter = EagleDrafter(heads, nodes=tree if isinstance(tree, int) else None, depth=depth, topk=topk)
        if depth is not None and depth >= drafter.nodes:  # a given depth: the saved one is cut to any tree chosen
            raise GorgonError(f"--draft-depth {depth} cannot be reached in a {drafter.nodes}-node tree (the root and "
                              f"one candidate per level): pass --draft-depth from 1 to {drafter.nodes - 1}, or more "
                              "nodes (--tree)")
        return drafter
    check_search_options(False, depth, topk)
    return HeadsDrafter(heads, tree)


def check_search_options(feature_level: bool, depth: int | None, topk: int | None) -> None:
    """A search's depth and top-k shape a feature-level head's tree; Medusa heads have no search."""
    if not feature_level and (depth is not None or topk is not None):
        raise GorgonError("--draft-depth and --draft-topk shape a feature-level head's search; Medusa heads "
                          "draft one level per head: choose their tree with --tree")


def check_heads_options(folder, name: str, depth: int | None, topk: int | None, draft_dtype: str = "auto",
                        level_cost: float | str | None = None) -> None:
    """The drafting options the heads in `folder` (given as `name`) take, read from its config.json so that a
    command line is refused before the target loads: a search's depth and top-k, a dtype of its own and a
    level cost shape a feature-level head (or a --draft model); Medusa heads take none of them."""
    feature_level = is_eagle(folder)
    check_search_options(feature_level, depth, topk)
    if feature_level:
        return
    if draft_dtype != "auto":
        raise GorgonError(f"the heads in {name} keep the target's dtype (they read its hidden states): drop "
                          "--draft-dtype, which sets a feature-level head's or a --draft model's")
    if level_cost not in (None, "auto"):
        raise GorgonError(f"the heads in {name} draft every level in one forward: --draft-level-cost has nothing "
                          "to stop (it applies to --draft and feature-level heads)")
