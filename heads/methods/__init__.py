"""The drafting methods, each registered once from its own folder; the core finds them here.

A method's folder (methods/medusa/, methods/eagle/, ...) calls `register(Method(...))` in its method.py
with everything the core needs of it: which folders it wrote, how to load them and draft with them, its
export formats and model card, the files it writes, and, if it trains through `train/heads.py`, its
recipe keys and training objective. Loading, export, cards, Hub downloads, a run folder's files and
the trainer iterate `methods()` and never name a method: a new method is a folder plus one line in
`PACKAGES`.

The packages are imported when the registry is first asked (not when this module is), since each of
them builds on the core modules that ask.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from pathlib import Path

from ..errors import GorgonError
from ..files import config_or_none

# gorgon.heads.methods.<name>, one each
PACKAGES = ("medusa", "eagle", "draft_model", "context", "parallel", "self_spec")

_REGISTRY: dict[str, "Method"] = {}


def setting(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING):
    """A recipe key: its default (none: required) and the text `--help` prints beside it, as TRL's
    `field(metadata={"help": ...})`."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


class Recipe:
    """What the trainer asks of a method's recipe keys (a dataclass subclassing this, its own keys checked in
    __post_init__); the defaults suit a method that trains a drafter on a frozen target."""

    trains_target = False           # whether it trains adapters on the target too (then saved by `save_adapter`)
    find_unused_parameters = False  # whether some trained parameters sit out of some steps' loss (DDP must know)

    @property
    def rows(self) -> int:
        """How many accuracies a held-out evaluation measures: one per head or unrolled step."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """How the training run's header names what it trains."""
        raise NotImplementedError

    def check_with(self, shared) -> None:
        """Checks that read the shared keys (`shared`: the whole recipe) too."""

    def check_target(self, config) -> None:
        """Checks against the target's text config, before its weights load."""

    def save_adapter(self, out: Path, target, state: dict) -> None:
        """Where `trains_target`: write the target's trained adapters into the run folder `out`."""


DEPTH, TOPK = 5, 8  # a search's levels and top-k (`gorgon.heads.search`) when nothing chooses them: EAGLE-2's


@dataclasses.dataclass
class SearchRecipe(Recipe):
    """The keys of a method whose drafter grows its tree with `gorgon.heads.search` (eagle, self_spec)."""

    draft_depth: int = setting(DEPTH, "eagle, self_spec: tree levels drafted per step")
    draft_topk: int = setting(TOPK, "eagle, self_spec: tokens kept and expanded per level")

    def check_with(self, shared) -> None:
        from ..search import check_search  # imports torch: not when the registry is (`gorgon --help`)

        for nodes in shared.tree_sizes().values():
            check_search(self.draft_depth, self.draft_topk, nodes)


@dataclasses.dataclass(frozen=True)
class Method:
    """What one drafting method gives the core. Every callable is optional where the method has no such stage
    (context drafts have no folder, a draft model exports as itself)."""

    name: str                 # its folder's name: the recipe's `arch` value, metrics' "arch"
    title: str                # how messages name what its folder holds: "Medusa heads", "an EAGLE head"
    holds: Callable[[Path, dict], bool] | None = None  # (folder, its config.json): written by this method?
    load: Callable | None = None          # (folder, target) -> its module on the target (checked by fingerprint)
    module: type | None = None            # the class `load` returns
    not_heads: Callable | None = None     # (folder) -> the error for its folder given as heads, and where it goes
    drafter: Callable | None = None       # (module, tree, depth, topk) -> a Drafter
    chain: Callable | None = None         # (module, length or None) -> a Drafter of one chain: the top candidate
                                          # of each level, every level drafted, as engines verify (default
                                          # length: its own depth, heads or block)
    check_options: Callable | None = None  # (name, depth, topk, draft_dtype, level_cost): refuse what it lacks
    adapter: Callable[[Path], Path | None] = lambda folder: None  # a folder's change to the target itself
    files: tuple[str, ...] = ()           # what its folder holds besides config.json, README.md and weights
                                          # (a folder ends in /)
    model_files: tuple[str, ...] = ()     # files a user may keep elsewhere too: a run's only where it holds this
    export: Callable | None = None        # (module, fmt, staging, base_model, dtype): writes an engine's layout
    export_formats: tuple[str, ...] = ()
    export_help: str = ""                 # "'eagle3' (vLLM's and SGLang's EAGLE-3) or ..." for --help
    serve: Callable | None = None         # (fmt, out, base_model, module, schedule) -> the engine's command
    export_notes: Callable[[Path], list[str]] = lambda folder: []  # lines to print after an export
    card: Callable | None = None          # (folder, ref, recipe, metrics, hub) -> the model card's text
    rows: Callable[[int], str] = lambda k: f"draft {k}"  # what the k-th held-out accuracy measures (1-based)
    recipe: type | None = None            # its training keys: a dataclass subclassing `Recipe`
    objective: Callable | None = None     # (recipe, shared, target, draft_tokens) -> a loss module with `.heads`
    nodes: dict | None = None             # default tree nodes per step by device type ("cpu", "cuda")


def vllm_serve(base_model: str, spec: dict, schedule: list | None = None) -> str:
    """vLLM's command serving an export with its speculative config `spec`, and the draft length per batch size
    where `gorgon bench --batch-sizes` measured one (`num_speculative_tokens_per_batch_size`, in vLLM 0.32's
    vllm/config/speculative.py: inclusive batch-size ranges from 1, each with its draft tokens; vLLM caps each at
    num_speculative_tokens and keeps the last for larger batches). Each length is capped here at the command's
    num_speculative_tokens, so that the command says what vLLM will draft."""
    if schedule:
        most = spec["num_speculative_tokens"]
        spec = {**spec, "num_speculative_tokens_per_batch_size": [[lo, hi, min(k, most)] for lo, hi, k in schedule]}
    return f"vllm serve {base_model} --speculative-config '{json.dumps(spec)}'"


def register(method: Method) -> Method:
    """Add a method, named for its folder (once: a second of the same name is a mistake)."""
    if method.name not in PACKAGES:
        raise GorgonError(f"a drafting method is named for its folder: add {method.name!r} to PACKAGES")
    if method.name in _REGISTRY and _REGISTRY[method.name] is not method:
        raise GorgonError(f"two drafting methods are named {method.name!r}: rename one")
    _REGISTRY[method.name] = method
    return method


def methods() -> list[Method]:
    """Every registered method, in `PACKAGES` order (the order `method_of` asks them in)."""
    for package in PACKAGES:
        importlib.import_module(f"{__package__}.{package}")
    return sorted(_REGISTRY.values(), key=lambda m: PACKAGES.index(m.name))


def by_name(name: str) -> Method:
    """The method a recipe's `arch` names."""
    found = {m.name: m for m in methods()}
    if name not in found:
        raise GorgonError(f"arch must be one of {', '.join(m for m in found if found[m].recipe)}, not {name!r}")
    return found[name]


def trainable() -> list[Method]:
    """The methods `train/heads.py` trains (those with a recipe)."""
    return [m for m in methods() if m.recipe is not None]


def method_of(folder: Path) -> Method | None:
    """Which method wrote a folder, read from its config.json (each method knows its own layouts and the
    engines' it imports); None when none did."""
    config = config_or_none(folder)
    return None if config is None else method_holding(folder, config)


def method_holding(folder: Path, config) -> Method | None:
    """`method_of` for a config.json already read (`config`, as parsed)."""
    return next((m for m in methods() if m.holds is not None and m.holds(folder, config)), None)


def recorded_method(metrics: dict) -> Method:
    """The method a training run recorded in its metrics.json (`arch`); runs of older gorgons recorded a draft
    model as `kind: draft` and Medusa heads by nothing."""
    name = metrics.get("arch") or ("draft_model" if metrics.get("kind") == "draft" else "medusa")
    return {m.name: m for m in methods()}[name]


def loaded_files() -> list[str]:
    """The files a heads loader reads besides config.json (weights, and every method's `files`; a folder as
    name/*): a download fetches them, and an upload deletes an earlier push's that it does not replace in the
    same commit, so a stale one cannot change what loads. The repo's other files (the user's) stay."""
    own = (f"{f}*" if f.endswith("/") else f for m in methods() for f in m.files)
    return ["*.safetensors", "*.safetensors.index.json", *dict.fromkeys(own)]
