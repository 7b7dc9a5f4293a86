"""The EAGLE head on the registry: its recipe keys, training objective, loading, drafting and export."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...errors import GorgonError
from .. import Method, SearchRecipe, register, setting, vllm_serve
from . import formats
from .card import eagle_card
from .model import ARCH, NODES, EagleHead


@dataclasses.dataclass
class EagleRecipe(SearchRecipe):
    """The recipe keys of `arch: eagle`."""

    feature_layers: list[int] | None = setting(None, "eagle, parallel: the target's hidden_states read, e.g. "
                                                     "2,15,27; None: EAGLE-3's low, middle and high layer")
    ttt_steps: int = setting(1, "eagle: unrolled steps that feed the head its own outputs, as deeper drafts see "
                                "them (EAGLE-3's training-time test; 1: off)")
    hidden_weight: float = setting(0.0, "eagle: weight of EAGLE-1's regression onto the target's next feature")
    feature_noise: float = setting(0.0, "eagle: uniform noise in [-a, a] times each feature layer's scale (root "
                                        "mean square) on the target's features in training")
    dropout: float = setting(0.0, "eagle: the share of the head layer's attention and MLP outputs dropped while "
                                  "it trains (0.1 in the recipe; 0: off)")
    train_lm_head: bool = setting(True, "eagle: train the head's LM head (false: it keeps the target's rows)")

    def __post_init__(self):
        if self.ttt_steps < 1:
            raise GorgonError(f"ttt_steps must be at least 1 (1 is plain teacher forcing), not {self.ttt_steps}")
        if self.hidden_weight < 0:
            raise GorgonError(f"hidden_weight must be at least 0, not {self.hidden_weight}")
        if self.feature_noise < 0:
            raise GorgonError(f"feature_noise is the width of the noise on an EAGLE head's inputs: use 0 or "
                              f"more, not {self.feature_noise}")
        if not 0 <= self.dropout < 1:
            raise GorgonError(f"dropout is the share of an EAGLE head's layer outputs dropped in training: use "
                              f"0 (off) to below 1, not {self.dropout}")

    def check_target(self, config) -> None:
        from .model import check_feature_layers

        if self.feature_layers:
            check_feature_layers(self.feature_layers, config.num_hidden_layers)

    @property
    def rows(self) -> int:
        return self.ttt_steps

    @property
    def label(self) -> str:
        return "eagle"


def objective(recipe: EagleRecipe, shared, target, draft_tokens):
    """An EAGLE head for the target and its loss."""
    from ...feature_cache import FeatureCache
    from .objective import EagleObjective

    head = EagleHead.for_target(target.model, recipe.feature_layers, draft_tokens, target.name, target.fingerprint,
                                depth=recipe.draft_depth, topk=recipe.draft_topk).float()
    head.lm_head.requires_grad_(recipe.train_lm_head)
    cache = FeatureCache() if shared.cache_features else None
    return EagleObjective(target.model, head, recipe.ttt_steps, shared.head_decay, recipe.hidden_weight, cache,
                          recipe.feature_noise, recipe.dropout)


def holds(folder: Path, config: dict) -> bool:
    """gorgon's own head (`"arch": "eagle"`), or an EAGLE-3 or speculators layout."""
    return isinstance(config, dict) and (config.get("arch") == ARCH or formats.foreign_format(config) is not None)


def drafter(head, tree, depth, topk):
    from .drafter import EagleDrafter

    if isinstance(tree, list):
        raise GorgonError("an EAGLE head builds its tree each step: pass --tree N (nodes per step) "
                          "or auto, not a list of rank paths")
    drafter = EagleDrafter(head, nodes=tree if isinstance(tree, int) else None, depth=depth, topk=topk)
    if depth is not None and depth >= drafter.nodes:  # a given depth: the saved one is cut to any tree chosen
        raise GorgonError(f"--draft-depth {depth} cannot be reached in a {drafter.nodes}-node tree (the root and "
                          f"one candidate per level): pass --draft-depth from 1 to {drafter.nodes - 1}, or more "
                          "nodes (--tree)")
    return drafter


def chain(head, length=None):
    from .drafter import EagleDrafter

    depth = length or head.config.depth
    return EagleDrafter(head, nodes=depth + 1, depth=depth, topk=1)


def serve(fmt: str, out: Path, base_model: str, head, schedule=None) -> str:
    """The engine's command for an export in either layout, drafting the head's search depth a step (the measured
    `schedule` of draft lengths by batch size where there is one). It names the method: vLLM takes the method of a
    draft given without one from its path ("eagle3" in it, vllm/config/speculative.py) and loads any other folder
    as a plain draft model, which fails."""
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": head.config.depth}
    return vllm_serve(base_model, spec, schedule)


METHOD = register(Method(
    name="eagle", title="an EAGLE head", holds=holds,
    load=lambda folder, target: EagleHead.from_pretrained(folder, target=target), module=EagleHead,
    drafter=drafter, chain=chain,
    export=formats.export_head, export_formats=formats.FORMATS,
    export_help="'eagle3' (vLLM's and SGLang's EAGLE-3) or 'speculators' (the speculators library's format, which "
                "vLLM reads)",
    serve=serve, card=eagle_card, rows=lambda k: f"step {k}",
    recipe=EagleRecipe, objective=objective, nodes=NODES,
))
