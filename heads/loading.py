"""A heads folder, whichever drafting method wrote it: loaded with its target, and as a drafter.

Which method wrote a folder is read from its config.json by the registry (`gorgon.heads.methods.method_of`):
each method recognises its own layout and the engines' it imports.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import GorgonError
from .files import read_config
from .hub import CONFIG_NAME, resolve_heads_folder
from .methods import Method, method_holding
from .target import Target, check_config_fits, load_target, target_for_heads


def heads_method(folder: Path) -> Method:
    """The method that wrote a heads folder, refused in one line when it is not heads."""
    return read_heads_config(folder)[0]


def read_heads_config(folder: Path) -> tuple[Method, dict]:
    """A heads folder's config.json, read once, and the method that wrote it (`heads_method`)."""
    config = read_config(folder / CONFIG_NAME, "heads")  # a missing or unreadable one is its own one-line error
    found = method_holding(folder, config)
    if found is None:
        raise GorgonError(f"{folder}'s config.json is not one a drafting method wrote (keys: "
                          f"{', '.join(sorted(map(str, config))) or 'none'}): pass a folder gorgon's training or an "
                          "engine export wrote")
    if found.not_heads is not None:  # a folder of a method that does not draft as heads (a draft model)
        raise found.not_heads(folder)
    return found, config


def load_heads(heads: str | os.PathLike, target: str | os.PathLike | None = None, device: str = "auto",
               dtype: str | torch.dtype = "auto", quantize: str = "none",
               keep_float: bool = False) -> tuple[Target, torch.nn.Module]:
    """The target and the heads in a folder or hub repo, whichever method wrote them (with the method's adapter
    on the target, e.g. Medusa-2's LoRA, merged). `target` None: the one the heads were trained for.
    `quantize`, `keep_float`: as `load_target` takes them (heads trained on the full-precision target fit
    its quantized copy)."""
    folder = resolve_heads_folder(heads)  # fail before the slower target load
    method, config = read_heads_config(folder)
    target = target_for_heads(config, target)
    check_config_fits(config, target)
    loaded = load_target(target, device=device, dtype=dtype, adapter=method.adapter(folder), quantize=quantize,
                         keep_float=keep_float)
    return loaded, method.load(folder, loaded)


def load_heads_for(heads: str | os.PathLike, target: Target) -> torch.nn.Module:
    """Heads for a target already loaded (to compare two heads on one target): checked against it by
    fingerprint. Heads with an adapter are refused, since it would change the target itself."""
    folder = resolve_heads_folder(heads)
    method = heads_method(folder)
    adapter = method.adapter(folder)
    if adapter is not None:
        raise GorgonError(f"{heads} holds {method.title} with an adapter ({adapter.name}/) that changes the target: "
                          "compare them as --heads, or compare heads that leave the target as it is")
    return method.load(folder, target)


def loaded_method(heads: torch.nn.Module) -> Method:
    """The method of heads already loaded: the one whose folder's module class it is."""
    from .methods import methods

    for method in methods():
        if method.module is not None and isinstance(heads, method.module):
            return method
    raise GorgonError(f"{type(heads).__name__} is no drafting method's heads: load them with load_heads")


def drafter_for(heads: torch.nn.Module, tree=None, depth: int | None = None, topk: int | None = None):
    """The drafter for loaded heads. tree: rank paths (Medusa), a node count or 'auto' (sized from what was saved
    with them); a search's depth and top-k (None: those saved with it)."""
    return loaded_method(heads).drafter(heads, tree, depth, topk)


def chain_for(heads: torch.nn.Module, length: int | None = None):
    """The drafter for loaded heads that drafts one chain, the top candidate of each level, as engines verify;
    `length` levels (None: the heads' own depth)."""
    method = loaded_method(heads)
    if method.chain is None:
        raise GorgonError(f"{method.title} drafts no chain: time it without the chain baseline")
    return method.chain(heads, length)


def check_heads_options(folder: Path, name: str, depth: int | None, topk: int | None, draft_dtype: str = "auto",
                        level_cost: float | str | None = None) -> None:
    """The drafting options the heads in `folder` (given as `name`) take, read from its config.json so that a
    command line is refused before the target loads."""
    method = heads_method(folder)
    if method.check_options is not None:
        method.check_options(name, depth, topk, draft_dtype, level_cost)
