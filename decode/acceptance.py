"""Acceptance rules: which path of the verified tree to keep, and the target's next (bonus) token.

Each rule is a pure function of the tree, the node tokens and the target's outputs at each
node. Each computes on the device and reads back to the host once per step. Each returns
(path, emitted): the accepted node indices from the root, and the tokens this step emits
(the accepted candidates, then the bonus token the target chose after them).

- greedy: exact; the output equals `generate(do_sample=False)`.
- sample: exact; the output has the target's sampling distribution (rejection sampling
  over the children of each accepted node, SpecInfer-style multi-candidate).
- typical: Medusa's typical acceptance. LOSSY: it accepts plausible tokens the target might
  not have sampled, trading fidelity for speed. Only used when asked for by name.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from gorgon.heads.errors import GorgonError
from gorgon.heads.tree import Tree

# The smallest temperature above 0: float32 logits up to 1e8 divided by it stay finite (below 3.4e38); a smaller
# one made sampling's probabilities inf or nan. Sampling that cold is greedy in all but name.
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class Sampling:
    """How the target's logits become a distribution, in the order `generate` applies them."""

    temperature: float = 0.0     # 0 means greedy
    top_k: int = 0               # 0 means off
    top_p: float = 1.0           # 1 means off

    def __post_init__(self):
        """The one range check of the sampling settings, for the command line and Python alike."""
        if not (isinstance(self.temperature, numbers.Real) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise GorgonError(f"temperature must be a finite number >= 0 (0 is greedy), not {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise GorgonError(f"temperature {self.temperature!r} is too small: the logits divided by it overflow; "
                              f"pass 0 (greedy) or at least {MIN_TEMPERATURE:g}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise GorgonError(f"top-k must be a whole number >= 0 (0 is off), not {self.top_k!r}")
        if not (isinstance(self.top_p, numbers.Real) and 0 < self.top_p <= 1):
            raise GorgonError(f"top-p must be a number in (0, 1] (1 is off), not {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def like_generate(cls, model, temperature: float, top_k: int | None = None,
                      top_p: float | None = None) -> "Sampling":
        """What `model.generate(do_sample=True, temperature=...)` samples from: a top-k or top-p not given is
        the model's generation_config's, else transformers' defaults (top-k 50, top-p 1). `Sampling(t)` alone
        keeps the whole distribution (top-k off)."""
        config = getattr(model, "generation_config", None)

        def given_or_configured(value, key: str, default):
            configured = getattr(config, key, None) if value is None else value
            return default if configured is None else configured

        return cls(temperature, given_or_configured(top_k, "top_k", 50), given_or_configured(top_p, "top_p", 1.0))


def target_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Softmax of the logits after temperature, top-k then top-p: what `generate` samples from."""
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        logits = logits.masked_fill(top_p_dropped(logits, s.top_p), float("-inf"))
    return logits.softmax(dim=-1)


def top_p_dropped(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens top-p drops (True): the least likely, while their probabilities summed upward stay within
    1 - top_p; the most likely is always kept. As transformers' TopPLogitsWarper computes it: on the rows'
    values sorted ascending, the order among equal values as torch's sort leaves it.

    On a CPU, torch sorts a tree's rows in 22 ms a step (8 rows of 49,152, one thread), numpy in 1: the cut
    is found on numpy's sorted values (the same values, so the same sums), and only a row whose cut falls
    between equal values, where the order decides, is sorted by torch."""
    if logits.device.type != "cpu":
        return dropped_in_sorted_order(logits, top_p)
    rows = logits.reshape(-1, logits.shape[-1])
    values = torch.from_numpy(np.sort(rows.detach().numpy(), axis=-1))
    count = dropped_ascending(values, top_p).sum(dim=-1, keepdim=True)  # a prefix: the sums only grow
    last = values.gather(-1, (count - 1).clamp(min=0))  # the largest value dropped
    after = values.gather(-1, count.clamp(max=values.shape[-1] - 1))  # the smallest kept
    drop = (rows <= last) & (count > 0)
    for row in ((count > 0) & (last == after))[:, 0].nonzero()[:, 0].tolist():  # the cut splits equal values
        drop[row] = dropped_in_sorted_order(rows[row:row + 1], top_p)[0]
    return drop.reshape(logits.shape)


def dropped_in_sorted_order(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_dropped` through torch's own sort, as the warper does it."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    dropped = dropped_ascending(sorted_logits, top_p)
    return dropped.scatter(-1, order, dropped)


def dropped_ascending(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """On rows sorted ascending: the positions top-p drops, while the probabilities summed from the least
    likely stay within 1 - top_p; the most likely is always kept."""
    dropped = values.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    dropped[..., -1:] = False
    return dropped


def _walk(tree: Tree, chosen_child: list[int]) -> tuple[int, ...]:
    """Follow each node's chosen child (-1: none) from the root; returns the path of nodes."""
    node = 0
    while chosen_child[node] >= 0:
        node = chosen_child[node]
    return tree.path_to[node]


def accept_greedy(tree: Tree, tokens: torch.Tensor, best: torch.Tensor) -> tuple[tuple[int, ...], list[int]]:
    """The deepest path whose every token equals the target's argmax at its parent (`best`, (T,): the
    argmax of the target's logits at each node, `gorgon.decode.argmax.target_argmax`).

    Siblings hold distinct tokens, so at most one child per node matches and the matching
    nodes form a single chain from the root.
    """
    match = (tokens == best[tree.parent]) | (tree.depth == 0)  # the root always stands (no host scalar: no sync)
    ok = ~(tree.ancestors & ~match[None, :]).any(dim=1)
    last = torch.where(ok, tree.depth, -1).argmax()
    host = torch.cat([last.reshape(1), best]).tolist()             # the one read per step
    path = tree.path_to[host[0]]
    # Along an accepted path each node's token is its parent's argmax, so the emitted tokens
    # are the argmax at every path node: the candidates after the root, then the bonus.
    return path, [host[1 + n] for n in path]


def child_accept_chances(child_p: torch.Tensor) -> torch.Tensor:
    """Chance to accept each child given the earlier siblings were rejected.

    A child token c is a point-mass proposal, so speculative sampling accepts it with
    p(c) under the target distribution renormalised after removing the rejected siblings:
    p(c_i) / (1 - sum_{j<i} p(c_j)). Tried in order, child i is then taken with chance exactly
    p(c_i), and the residual (p without the children, renormalised) covers the rest.
    """
    earlier = child_p.cumsum(dim=-1) - child_p
    return (child_p / (1 - earlier).clamp(min=1e-12)).clamp(max=1.0)


def accept_sampled(tree: Tree, tokens: torch.Tensor, probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[tuple[int, ...], list[int]]:
    """Lossless multi-candidate rejection sampling over the tree.

    At each node on the way down, its children are tried in rank order with
    `child_accept_chances`; the first accepted child becomes the next node. When all are
    rejected the bonus token is drawn from the residual distribution. Every node's draws are
    made up front on the device, so the host reads once per step.
    """
    valid = tree.children >= 0
    child_nodes = tree.children.clamp(min=0)
    child_tokens = tokens[child_nodes]                              # (T, C)
    # A token an earlier sibling already proposed was removed from the target's distribution when that
    # sibling was rejected: trying it again would give it its chance twice (a drafter may repeat a token).
    earlier = torch.ones(child_tokens.shape[1], child_tokens.shape[1], dtype=torch.bool,
                         device=tokens.device).tril(-1)             # [i, j]: sibling j comes before i
    repeat = ((child_tokens[:, :, None] == child_tokens[:, None, :]) & valid[:, None, :] & earlier).any(-1)
    child_p = probs.gather(1, child_tokens) * (valid & ~repeat)     # (T, C)
    chances = child_accept_chances(child_p)
    u = torch.rand(child_p.shape, generator=generator, device=probs.device)
    accepted = (u < chances) & valid
    first = torch.where(accepted.any(1), accepted.float().argmax(1), -1)
    chosen = torch.where(first >= 0, child_nodes.gather(1, first.clamp(min=0)[:, None])[:, 0], -1)
    removed = torch.zeros_like(probs).scatter_add_(1, child_tokens, valid.to(probs.dtype))
    residual = probs.masked_fill(removed > 0, 0.0)
    empty = residual.sum(1, keepdim=True) <= 0                      # children held all the mass
    residual = torch.where(empty, probs, residual)
    bonus = sample_rows(residual, generator)
    host = torch.cat([chosen, bonus, tokens]).tolist()
    chosen, bonus, tokens = host[: tree.size], host[tree.size: 2 * tree.size], host[2 * tree.size:]
    path = _walk(tree, chosen)
    return path, [tokens[n] for n in path[1:]] + [bonus[path[-1]]]


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token drawn from each row of (unnormalised) probabilities, by the inverse of its cumulative sums (in
    float64): every row of a tree draws its bonus up front, and torch.multinomial took 7.6 ms for 8 rows of
    49,152 on a CPU (one thread), this 1.8. A token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=probs.device, dtype=torch.float64)
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # below the total
    return torch.searchsorted(cdf, point, right=True)[:, 0]  # the first token whose sum passes the point


def accept_typical(tree: Tree, tokens: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None = None,
                   threshold: float = 0.09, alpha: float = 0.3) -> tuple[tuple[int, ...], list[int]]:
    """LOSSY. Medusa's typical acceptance: a token passes when its probability under the target
    exceeds min(threshold, alpha * exp(-entropy)); the deepest passing path wins and the bonus
    is sampled at its end. The output is plausible but not distributed as the target's."""
    entropy = -(probs * probs.clamp(min=1e-12).log()).sum(-1)       # (T,)
    limit = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    p_tok = probs[tree.parent, tokens]
    passes = (p_tok > limit[tree.parent]) | (tree.depth == 0)
    ok = ~(tree.ancestors & ~passes[None, :]).any(dim=1)
    # Deepest first; among equals the lower node index (better ranks).
    score = torch.where(ok, tree.depth * tree.size - torch.arange(tree.size, device=probs.device), -1)
    last = score.argmax()
    bonus = torch.multinomial(probs[last.reshape(1)], 1, generator=generator)[0]  # a 0-d index would read `last`
    host = torch.cat([last.reshape(1), bonus, tokens]).tolist()
    path = tree.path_to[host[0]]
    return path, [host[2 + n] for n in path[1:]] + [host[1]]
