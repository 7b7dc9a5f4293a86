"""CPU kernels for the target: every linear layer on weights prepacked once for oneDNN.

Why: a decode step reads every weight once, so on a CPU it is bound by memory bandwidth, and
verifying a few tree nodes in one forward should cost about one step. torch's default CPU
linear (MKL sgemm) does not behave that way: two rows can cost 1.5-2x one row. oneDNN's
linear on a weight reordered once for it (the ops torch's inductor emits for CPU linears under
freezing) stays nearly flat for a few rows. Where MKL is still the faster for the fewest rows (one
to three on an Intel Xeon with AMX), those stay on it: the crossover is timed at startup.

The switch is reversible and leaves the model as it was: `use_cpu_kernels(model, "fast")`
gives each `nn.Linear` an instance-level `forward` that calls the prepacked op (parameters,
state_dict and module names untouched) and puts attention over a tree on `gorgon.decode.attention`
(key/value heads shared, not copied, under a mask) and greedy verification's argmax on a
bfloat16 screen of the output layer where this CPU runs bfloat16 (`gorgon.decode.argmax`);
`"stock"` undoes all three (a quantized target keeps the attention: verifying it row by row is what keeps
its output its own, `gorgon.decode.attention.rows_alone`). Packed weights are kept
beside the module, so `stock_kernels(model)` can time plain `generate` on the unmodified path
in the same run. A layer falls back to `F.linear` whenever the fast op does not apply: off the
CPU, a dtype it was not packed for, autograd through the layer, or a weight changed since it
was packed (training, a LoRA merge), so no result is ever computed from a stale copy.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import types
import warnings

import torch
import torch.nn.functional as F

from gorgon.heads.errors import GorgonError
from gorgon.heads.quantize import float_weights, quantization
from gorgon.heads.target import resolve_dtype

from .argmax import full_argmax, use_bf16_screen
from .attention import use_tree_attention
from .onednn import fast_kernels_unavailable, pack, packed_linear

KERNELS = ("fast", "stock")
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "w4a8")
MAX_STOCK_ROWS = 8  # more rows always take oneDNN (the Intel Xeon with AMX: the stock kernel lost from 4)
_ATTR = "_gorgon_packed"


def use_cpu_kernels(model: torch.nn.Module, kernels: str = "fast", stock_rows: int | str = "measure") -> str:
    """Put the model's linear layers on the chosen kernels; returns what is in use, for reports.

    "fast" falls back to "stock" with a warning where it cannot run (other torch builds, CUDA,
    float16), so asking for it is always safe. `stock_rows`: products of at most this many rows
    stay on torch's stock kernel (`set_stock_rows`), "measure" (the default) times where oneDNN
    starts to win on this machine, for this model's shapes and dtype (`fastest_stock_rows`).
    """
    if kernels not in KERNELS:
        raise GorgonError(f"unknown --cpu-kernels {kernels!r}: use fast (oneDNN prepacked weights) or stock")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if kernels == "stock":
        for m in linears:
            m.__dict__.pop("forward", None)
            m.__dict__.pop(_ATTR, None)
        use_tree_attention(model, quantization(model) != "none")  # a quantized target's exactness needs it
        use_bf16_screen(model, False)
        return "stock"
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    reason = "the model is not on the CPU" if device.type != "cpu" else fast_kernels_unavailable(dtype)
    if reason:
        if device.type == "cpu":
            warnings.warn(f"gorgon: CPU fast kernels are off: {reason}; using torch's stock kernels", stacklevel=2)
        return use_cpu_kernels(model, "stock")
    for m in linears:
        _pack(m)
    use_tree_attention(model, True)
    use_bf16_screen(model, fast_kernels_unavailable(torch.bfloat16) is None)
    set_stock_rows(model, fastest_stock_rows(model) if stock_rows == "measure" else stock_rows)
    return kernels_in_use(model)


def draft_dtype(target_model: torch.nn.Module, kernels: str, choice: str = "auto") -> torch.dtype:
    """The dtype a drafter with weights of its own runs in. A draft only proposes (the target's
    verification decides every token), so it need not match the target: on a CPU a draft layer is
    bound by reading its weights, and bfloat16 halves the bytes. "auto": bfloat16 for a float32
    target on the CPU fast path where oneDNN runs bfloat16 on this CPU (detected, never assumed),
    float32 beside a w4a8 target (its linear layers then run w4a8 too: `draft_scheme`), else the target's own
    dtype."""
    if choice not in DRAFT_DTYPES:
        raise GorgonError(f"unknown --draft-dtype {choice!r}: use auto, float32, bfloat16 or w4a8")
    if draft_scheme(target_model, choice) == "w4a8":
        return torch.float32
    if choice != "auto":
        return resolve_dtype(choice)
    weight = next(target_model.parameters())
    if (weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels == "fast"
            and fast_kernels_unavailable(torch.bfloat16) is None):
        return torch.bfloat16
    return weight.dtype


def draft_scheme(target_model: torch.nn.Module, choice: str = "auto") -> str:
    """The quantized scheme a drafter's own linear layers run ("none": its dtype's products): w4a8 when asked, and
    by default beside a w4a8 target, whose kernel makes a drafted level about a third cheaper than bfloat16's here
    (the drafts change a little; the output does not)."""
    return "w4a8" if choice == "w4a8" or (choice == "auto" and quantization(target_model) == "w4a8") else "none"


def set_stock_rows(model: torch.nn.Module, rows: int) -> None:
    """Products of at most `rows` rows (tokens in the forward) take torch's stock kernel (MKL) on the fast
    path; larger ones oneDNN's. 0: oneDNN for all.

    Machines differ here: on one, oneDNN's one-row product was twice as fast as MKL's; on an Intel Xeon
    with AMX, MKL's was the faster up to 3 rows in float32 (a forward over 2 tokens 1.03x one token instead
    of 1.18x), oneDNN's from 4 and, in bfloat16, from one row: for small matrices oneDNN's fixed cost per
    call (tens of microseconds) outweighs its better use of memory bandwidth, until the rows add up.
    """
    if not (isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0):
        raise GorgonError(f"stock rows must be a whole number >= 0 (products of at most that many rows on torch's "
                          f"stock kernel), not {rows!r}")
    for m in model.modules():
        if _ATTR in m.__dict__:
            m.__dict__[_ATTR].stock_rows = rows


def stock_rows(model: torch.nn.Module) -> int | None:
    """Up to how many rows the fast path's products stay on torch's stock kernel; None when it is off."""
    packed = next((m.__dict__[_ATTR] for m in model.modules() if _ATTR in m.__dict__), None)
    return None if packed is None else packed.stock_rows


STOCK_ROWS_ROUNDS = 3  # timed rounds per row count: 3 chose the same as 5 (docstring below)


@torch.inference_mode()
def fastest_stock_rows(module: torch.nn.Module) -> int:
    """The row counts the stock kernel serves faster, timed on this machine: for 1, 2, ... rows, a product
    through every packed linear layer of the module (as a forward over that many tokens makes them), on
    each kernel, interleaved; the stock kernel keeps the counts before the first that oneDNN wins (its
    advantage grows with the rows), at most MAX_STOCK_ROWS. The answer depends on the dtype as well as the
    machine (`set_stock_rows`). About 1.5 s for the embedded target on the Intel Xeon (4 row counts; 3 rounds chose
    the same as 5, four times out of four)."""
    linears = [m for m in module.modules() if _ATTR in m.__dict__]
    for rows in range(1, MAX_STOCK_ROWS + 1):
        inputs = [torch.ones(rows, m.in_features, dtype=m.weight.dtype, device=m.weight.device) for m in linears]
        times = {"stock": [], "onednn": []}
        for _ in range(STOCK_ROWS_ROUNDS + 1):  # the first round warms up
            for kernel in times:
                set_stock_rows(module, rows if kernel == "stock" else 0)
                start = time.perf_counter()
                for linear, x in zip(linears, inputs):
                    linear(x)
                times[kernel].append(time.perf_counter() - start)
        if statistics.median(times["onednn"][1:]) < statistics.median(times["stock"][1:]):
            return rows - 1
    return MAX_STOCK_ROWS


def kernels_in_use(model: torch.nn.Module) -> str:
    """"fast" when the model's linear layers run on prepacked weights, else "stock"."""
    return "fast" if any(isinstance(m.__dict__.get("forward"), types.MethodType) and _ATTR in m.__dict__
                         for m in model.modules()) else "stock"


@contextlib.contextmanager
def stock_kernels(model: torch.nn.Module):
    """Run the block on torch's stock kernels and transformers' own attention (a quantized target on its kept
    float weights: stock full precision), then restore the fast path if it was on. The packed weights are
    kept, so switching back costs nothing."""
    saved = {m: m.__dict__.pop("forward") for m in model.modules() if "forward" in m.__dict__ and _ATTR in m.__dict__}
    tree_attention = use_tree_attention(model, False)
    try:
        with full_argmax(model), float_weights(model):
            yield
    finally:
        for m, forward in saved.items():
            m.forward = forward
        use_tree_attention(model, tree_attention)


class _PackedWeight:
    """A linear weight reordered for oneDNN, remade whenever the weight is not the one it was made from
    (another tensor, an in-place update): a result is never computed from a stale copy."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.key, self.tensor = dtype, None, None
        self.stock_rows = 0

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.tensor = pack(weight)
            self.key = key
        return self.tensor

    def __deepcopy__(self, memo) -> "_PackedWeight":
        twin = _PackedWeight(self.dtype)  # oneDNN tensors cannot be copied; the copy packs its own weight
        twin.stock_rows = self.stock_rows
        return twin


def _pack(linear: torch.nn.Linear) -> None:
    packed = linear.__dict__[_ATTR] = _PackedWeight(linear.weight.dtype)
    packed.get(linear.weight)
    linear.forward = types.MethodType(_packed_forward, linear)


def _packed_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed, w = linear.__dict__[_ATTR], linear.weight
    if (x.device.type != "cpu" or x.dtype != packed.dtype or w.dtype != packed.dtype
            or x.numel() <= packed.stock_rows * x.shape[-1]
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w, linear.bias)
    return packed_linear(x, packed.get(w), linear.bias)
