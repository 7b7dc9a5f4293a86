"""Self-speculation on the registry: its recipe keys, training objective, loading and drafting. No engine serves
it from a folder (docs/design.md, "Self-speculation"), so it has no export."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...errors import GorgonError
from .. import Method, SearchRecipe, register, setting
from .card import self_spec_card
from .model import ADAPTER_SIZE, ARCH, NODES, EarlyExit, check_adapter_size, check_exit_layer


@dataclasses.dataclass
class SelfSpecRecipe(SearchRecipe):
    """The recipe keys of `arch: self_spec`."""

    exit_layer: int = setting(4, "self_spec: the target's first layers that draft (N; scripts/exit_sweep.py "
                                 "measures agreement and cost per N)")
    adapter_size: int = setting(ADAPTER_SIZE, "self_spec: the width of the exit's gated MLP")

    def __post_init__(self):
        check_adapter_size(self.adapter_size)

    def check_target(self, config) -> None:
        check_exit_layer(self.exit_layer, config.num_hidden_layers)

    @property
    def rows(self) -> int:
        return 1

    @property
    def label(self) -> str:
        return f"self_spec (exit after layer {self.exit_layer})"


def objective(recipe: SelfSpecRecipe, shared, target, draft_tokens):
    """An exit at the recipe's layer of the target, and its loss."""
    from ...feature_cache import FeatureCache
    from ...layers import check_splits
    from .objective import SelfSpecObjective

    check_splits(target.model, recipe.exit_layer)
    exit_ = EarlyExit.for_target(target.model, recipe.exit_layer, recipe.adapter_size, draft_tokens, target.name,
                                 target.fingerprint, depth=recipe.draft_depth, topk=recipe.draft_topk).float()
    return SelfSpecObjective(target.model, exit_, shared.head_decay,
                             FeatureCache() if shared.cache_features else None)


def holds(folder: Path, config: dict) -> bool:
    return isinstance(config, dict) and config.get("arch") == ARCH


def drafter(exit_, tree, depth, topk):
    from .drafter import SelfSpecDrafter

    if isinstance(tree, list):
        raise GorgonError("a self-speculation exit builds its tree each step: pass --tree N (nodes per step) or "
                          "auto, not a list of rank paths")
    return SelfSpecDrafter(exit_, nodes=tree if isinstance(tree, int) else None, depth=depth, topk=topk)


def chain(exit_, length=None):
    from .drafter import SelfSpecDrafter

    depth = length or exit_.config.depth
    return SelfSpecDrafter(exit_, nodes=depth + 1, depth=depth, topk=1)


METHOD = register(Method(
    name=ARCH, title="a self-speculation exit", holds=holds,
    load=lambda folder, target: EarlyExit.from_pretrained(folder, target=target), module=EarlyExit,
    drafter=drafter, chain=chain, card=self_spec_card, rows=lambda k: "exit",
    recipe=SelfSpecRecipe, objective=objective, nodes=NODES,
))
