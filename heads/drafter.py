"""The drafter interface: what every drafting method gives the decoder.

Each step the decoder calls `propose(root, features, context)` and gets back one token per tree
node, the root first, and the candidate tree for that step. A static drafter (Medusa's
heads) returns the same tree every step; a dynamic one (EAGLE-2's confidence-ranked tree,
`gorgon.heads.search`, which an EAGLE head and a draft model grow) builds a new one.
Verification and acceptance are written once, in `gorgon.decode`, for every drafter; each
method implements this and nothing of the decoder.

A drafter whose tree can be merged with context drafts (`MergedDrafter`) also gives
`scored_paths(root, features, context)`: the same step's candidates as token paths under the
root, each with its estimated chance of being accepted, parents before children.

`features` are the target's hidden states at the tokens accepted since the last call (the whole
prompt at the first call): row i belongs to context[-len(features) + i]. They tell a drafter
what was accepted, so one with its own cache can follow. Which hidden states they are is the
drafter's `feature_layers`: None for the last (normed) one, else indices into the model's
`hidden_states` (0 the embeddings, i the output of layer i), concatenated.

A drafter with weights also gives `check_target(model)`, which refuses, in one line, a target of other
shapes than the one it was built for: the decoder calls it before the prefill. `settings()` says what a
benchmark report records of a drafter: its tree (`tree`: rank paths, or how it builds one each step), the
dtype of its weights (`draft_dtype`) and its context-draft settings (`context_draft`).

A drafter that grows its tree level by level (`gorgon.heads.search`: an EAGLE head, a draft model)
also has `depth` (its most levels a step), `level_cost` (a level's time in target steps, below which a
level's chances stop the search; 0 drafts every level) and `level_trial(context_length)`, which returns
two calls: `level()`, one level on a cache of that length, for `gorgon.decode.calibrate` to time, and
`reset()`, which cuts it off again. A `MergedDrafter` keeps the drafter it merges context drafts into as
`drafter`, for a bench row without them.

Every drafter but self-speculation's also gives `fresh()`: one with the same weights and settings and none of
the state it keeps between steps (a cache of its own, what it learned from the text), for each row of a batch
(`gorgon.decode.batch`); one that keeps nothing returns itself.
A drafter may also give `scored_paths_together(drafters, roots, features, contexts)`, a static method: the
`scored_paths` of the rows of a batch, each row a `fresh` twin of it, drafted together (`scored_paths_of_rows`).

A drafter that drafts with the target's own first layers (self-speculation, heads/methods/self_spec) has
`attach_cache(cache)`, which the decoder calls after the prefill with the target's KV cache, and `drafted`: what
its last proposal left in that cache's first layers (`gorgon.heads.layers.DraftedLayers`), which verification
reuses.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .errors import GorgonError
from .quantize import QuantizedLinear
from .tree import Tree


def dtype_name(module: torch.nn.Module) -> str:
    """The dtype of a drafter's weights, as a report names it ("float32"), or the quantized scheme its linear layers
    run ("w4a8": `--draft-dtype w4a8`)."""
    schemes = {m.scheme for m in module.modules() if isinstance(m, QuantizedLinear)}
    return schemes.pop() if len(schemes) == 1 else str(next(module.parameters()).dtype).replace("torch.", "")


def check_same_device(module: torch.nn.Module, model, what: str) -> None:
    """A drafter takes the target's hidden states and tokens where they are: on another device it failed inside
    torch at the first step ("Expected all tensors to be on the same device")."""
    mine, theirs = next(module.parameters()).device, model.get_input_embeddings().weight.device
    if mine != theirs:
        raise GorgonError(f"{what} is on {mine} but the target on {theirs}: move it to the target's device "
                          f"(.to({str(theirs)!r}))")


class Drafter(Protocol):
    feature_layers: tuple[int, ...] | None
    max_nodes: int  # the most tree nodes a step proposes, root included

    def propose(self, root: torch.Tensor, features: torch.Tensor,
                context: torch.Tensor) -> tuple[torch.Tensor, Tree]:
        """A token per node and the step's tree. root: the next token (scalar), not yet in the target's
        cache; features: (m, F) target hidden states of the last m tokens of `context`; context: every
        token in the target's cache (n,)."""


def scored_paths_of_rows(drafters: list, roots: list[torch.Tensor], features: list[torch.Tensor],
                         contexts: list[torch.Tensor]) -> list[list[tuple[list[int], float]]]:
    """Each row's `scored_paths`, for a batch's rows (`fresh` twins of one drafter): in one call where the drafter
    drafts rows together (`scored_paths_together`: an EAGLE head's one forward a level for every row), else row by
    row."""
    together = getattr(drafters[0], "scored_paths_together", None)
    if together is not None:
        return together(drafters, roots, features, contexts)
    return [d.scored_paths(r, f, c) for d, r, f, c in zip(drafters, roots, features, contexts)]
