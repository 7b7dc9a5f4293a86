"""The parallel drafter on the registry: its recipe keys, training objective, loading, drafting and export (the
speculators library's `peagle` layout, which vLLM serves as EAGLE-3 with parallel drafting: formats.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...errors import GorgonError
from ...files import config_or_none
from .. import Method, Recipe, register, setting, vllm_serve
from . import formats
from .card import parallel_card
from .model import ARCH, BLOCK_SIZE, NODES, ParallelHead, check_block_size


@dataclasses.dataclass
class ParallelRecipe(Recipe):
    """The recipe keys of `arch: parallel`."""

    block_size: int = setting(BLOCK_SIZE, "parallel: drafts per forward (k): the first position, then k - 1 learned "
                                          "mask positions")
    feature_layers: list[int] | None = setting(None, "eagle, parallel: the target's hidden_states read, e.g. "
                                                     "2,15,27; None: EAGLE-3's low, middle and high layer")
    start_from: str | None = setting(None, "parallel: a trained EAGLE head's folder whose layers it starts "
                                           "from (its feature layers and draft vocabulary too); None: the target's")

    def __post_init__(self):
        check_block_size(self.block_size)

    def check_with(self, shared) -> None:
        if self.start_from and (self.feature_layers or shared.draft_vocab_size):
            raise GorgonError("start_from keeps the EAGLE head's feature layers and draft vocabulary: drop "
                              "feature_layers and draft_vocab_size, or start_from")

    def check_target(self, config) -> None:
        from ..eagle.model import check_feature_layers

        if self.feature_layers:
            check_feature_layers(self.feature_layers, config.num_hidden_layers)

    @property
    def rows(self) -> int:
        return self.block_size

    @property
    def label(self) -> str:
        return f"parallel (blocks of {self.block_size})"


def objective(recipe: ParallelRecipe, shared, target, draft_tokens):
    """A parallel drafter for the target (from a trained EAGLE head's layers where `start_from` names one)
    and its loss."""
    from ...feature_cache import FeatureCache
    from ..eagle.model import EagleHead
    from .objective import ParallelObjective

    if recipe.start_from:
        head = ParallelHead.from_eagle(EagleHead.from_pretrained(recipe.start_from, target=target), recipe.block_size)
    else:
        head = ParallelHead.for_target(target.model, recipe.block_size, recipe.feature_layers, draft_tokens,
                                       target.name, target.fingerprint)
    head = head.float()
    for mask in (head.mask_hidden, head.mask_embedding):  # a block of one has no mask position to train (DDP
        mask.requires_grad_(recipe.block_size > 1)        # refuses a trained parameter that gets no gradient)
    return ParallelObjective(target.model, head, shared.head_decay,
                             FeatureCache() if shared.cache_features else None)


def holds(folder: Path, config: dict) -> bool:
    """gorgon's own drafter (`"arch": "parallel"`), or the speculators peagle layout."""
    return isinstance(config, dict) and (config.get("arch") == ARCH or formats.is_peagle(config))


def load(folder: Path, target):
    """gorgon's own folder, or an export imported back (its mask token's row is told from the target's)."""
    if formats.is_peagle(config_or_none(folder)):
        return formats.import_head(folder, target)
    return ParallelHead.from_pretrained(folder, target=target)


def drafter(head, tree, depth, topk):
    from .drafter import ParallelDrafter

    check_options(None, depth, topk)
    return ParallelDrafter(head, tree)


def chain(head, length=None):
    from .drafter import ParallelDrafter

    return ParallelDrafter(head, [[0] * n for n in range(1, (length or head.config.block_size) + 1)])


def check_options(name, depth=None, topk=None, draft_dtype="auto", level_cost=None) -> None:
    """A block is drafted in one forward from a fixed tree: no search to shape or stop."""
    if depth is not None or topk is not None:
        raise GorgonError("--draft-depth and --draft-topk shape an EAGLE head's search; a parallel drafter "
                          "drafts its whole block in one forward: choose its tree with --tree")
    if level_cost not in (None, "auto"):
        raise GorgonError(f"the parallel drafter in {name} drafts its block in one forward: --draft-level-cost has "
                          "nothing to stop (it applies to --draft and EAGLE heads)")


def serve(fmt: str, out: Path, base_model: str, head, schedule=None) -> str:
    """vLLM's command for the export, drafting the whole block a step. It names the method and parallel drafting:
    given a draft folder alone, vLLM takes its method from the path and has no branch for peagle
    (vllm/config/speculative.py), and builds it as a plain draft model, which fails."""
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": head.config.block_size,
            "parallel_drafting": True}
    return vllm_serve(base_model, spec, schedule)


METHOD = register(Method(
    name=ARCH, title="a parallel drafter", holds=holds, load=load, module=ParallelHead,
    drafter=drafter, chain=chain, check_options=check_options,
    export=formats.export_head, export_formats=formats.FORMATS,
    export_help="'peagle' (the speculators library's P-EAGLE layout, which vLLM serves as EAGLE-3 with parallel "
                "drafting)",
    serve=serve, card=parallel_card, rows=lambda k: f"position {k}",
    recipe=ParallelRecipe, objective=objective, nodes=NODES,
))
