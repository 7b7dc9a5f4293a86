"""The target's greedy token at each verified node, screened on a bfloat16 copy of its output layer.

Why: greedy verification needs only the argmax of each node's logits, yet a float32 output layer
is the largest single read of a CPU step (the embedded target's 49,152 x 576 layer is 113 MB, about
an eighth of a step). A bfloat16 copy is half the bytes. Its logits are not the float32 ones, so
they only screen: each logit's error is bounded, the tokens that could still be the float32 argmax
are kept (usually a handful), and only those are computed again in float32 from the real weights.

The bound: rounding the weight and the input to bfloat16 changes each product w_i * h_i by at most
2^-7 of its size (2^-8 each), and float32 accumulation over n terms adds at most n * 2^-24 of the
sum of sizes, in the copy's sum as in the reference's. So |bf16 logit - float32 logit| <= eps *
sum_i |w_i||h_i| <= eps * ||w|| * ||h|| (Cauchy-Schwarz), and eps is taken at twice that for margin.
A token is dropped only when its upper bound is below the bfloat16 favourite's lower bound, which
the float32 winner's logit reaches, so the argmax over the kept tokens, computed in float32 in
vocabulary order, is the argmax over all of them.

On the CPU fast path only (`gorgon.decode.kernels`), where oneDNN runs bfloat16 on this CPU
(detected); a model whose output layer has a bias or soft-caps its logits keeps the full product.
"""

from __future__ import annotations

import contextlib

import torch

from gorgon.heads.target import lm_logits, logit_softcap

from .onednn import pack, packed_linear

_ATTR = "_gorgon_bf16_screen"


class _Screen:
    """A bfloat16 copy of the output layer and its rows' norms, made at the first greedy step (a model
    that never verifies greedily never holds it) and remade whenever the float32 weight is not the one
    it was made from (another tensor, an in-place update)."""

    def __init__(self, packed: bool):
        self.packed, self.key = packed, None

    def refresh(self, weight: torch.Tensor) -> None:
        key = (weight.data_ptr(), weight._version)
        if key == self.key:
            return
        w = weight.detach()
        self.copy = w.to(torch.bfloat16)
        if self.packed:
            self.copy = pack(self.copy)
        self.row_norms = w.norm(dim=1)
        n = w.shape[1]
        self.eps = 2 * (2 ** -7 + 2 ** -16 + 2 * n * 2 ** -24)
        self.key = key

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(torch.bfloat16)
        if self.packed:
            return packed_linear(x, self.copy).float()
        return torch.nn.functional.linear(x, self.copy).float()


def _output_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    get = getattr(model, "get_output_embeddings", None)
    layer = get() if get is not None else None
    return layer if isinstance(layer, torch.nn.Linear) else None


def use_bf16_screen(model: torch.nn.Module, on: bool, packed: bool = True) -> bool:
    """Screen the greedy argmax on a bfloat16 copy of the output layer (on), or stop (off); returns whether
    it was on. `packed`: the copy prepacked for oneDNN (the fast path); False runs torch's own bfloat16
    product (slower, for checking the bound on any CPU). A layer with a bias or soft-capped logits is
    left on the full product."""
    head = _output_layer(model)
    if head is None:
        return False
    was_on = _ATTR in head.__dict__
    head.__dict__.pop(_ATTR, None)
    if on and head.weight.dtype == torch.float32 and head.bias is None and not logit_softcap(model):
        head.__dict__[_ATTR] = _Screen(packed)
    return was_on


@contextlib.contextmanager
def full_argmax(model: torch.nn.Module):
    """Run the block on the full float32 product, then put the same screen back with its copy, so the
    bench's stock baseline, run between timed speculative runs, costs the next run no new copy."""
    head = _output_layer(model)
    screen = head.__dict__.pop(_ATTR, None) if head is not None else None
    try:
        yield
    finally:
        if screen is not None:
            head.__dict__[_ATTR] = screen


def target_argmax(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's greedy token after each row of `hidden` (its last hidden states), exactly the argmax
    of its float32 logits (the first on a tie, as `generate`)."""
    head = _output_layer(model)
    screen = head.__dict__.get(_ATTR) if head is not None else None
    if screen is None or hidden.device.type != "cpu" or torch.is_grad_enabled():
        return lm_logits(model, hidden).argmax(dim=-1)
    screen.refresh(head.weight)
    rows = hidden.reshape(-1, hidden.shape[-1])
    approx = screen.logits(rows)                                                   # (T, V)
    scale = screen.eps * rows.norm(dim=-1, keepdim=True)                            # bound = scale * ||w||
    favourite = approx.argmax(dim=-1, keepdim=True)
    floor = approx.gather(-1, favourite) - scale * screen.row_norms[favourite]  # the float32 winner reaches it
    may_win = torch.addcmul(approx, scale, screen.row_norms) >= floor                # (T, V): a handful
    ids = may_win.any(dim=0).nonzero()[:, 0]                                        # ascending: ties as argmax
    kept = may_win[:, ids]
    # NaN logits keep nothing, and a flat distribution (random tokens: hundreds kept per row) keeps so
    # many that gathering their rows would cost more than the full product, which then answers.
    if not kept.any(dim=-1).all() or ids.numel() > approx.shape[-1] // 8:
        return lm_logits(model, hidden).argmax(dim=-1)
    exact = lm_logits(model, rows, ids).masked_fill(~kept, float("-inf"))
    return ids[exact.argmax(dim=-1)].reshape(hidden.shape[:-1])


def argmax_in_use(model: torch.nn.Module) -> str:
    """How greedy verification finds the target's token, for reports: "bf16 screen" or "full"."""
    head = _output_layer(model)
    return "bf16 screen" if head is not None and _ATTR in head.__dict__ else "full"
