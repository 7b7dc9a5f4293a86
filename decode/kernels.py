"""CPU kernels for the target: every linear layer on weights prepacked once for oneDNN.

Why: a decode step reads every weight once, so on a CPU it is bound by memory bandwidth, and
verifying a few tree nodes in one forward should cost about one step. torch's default CPU
linear (MKL sgemm) does not behave that way: two rows can cost 1.5-2x one row. oneDNN's
linear on a weight reordered once for it (the ops torch's inductor emits for CPU linears under
freezing) stays nearly flat for a few rows and is faster for one row too.

The switch is reversible and leaves the model as it was: `use_cpu_kernels(model, "fast")`
gives each `nn.Linear` an instance-level `forward` that calls the prepacked op (parameters,
state_dict and module names untouched) and puts attention over a tree on `gorgon.decode.attention`
(key/value heads shared, not copied, under a mask) and greedy verification's argmax on a
bfloat16 screen of the output layer where this CPU runs bfloat16 (`gorgon.decode.argmax`);
`"stock"` undoes all three. Packed weights are kept
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
from gorgon.heads.target import resolve_dtype

from .argmax import full_argmax, use_bf16_screen
from .attention import use_tree_attention
from .onednn import fast_kernels_unavailable, pack, packed_linear

KERNELS = ("fast", "stock")
DRAFT_DTYPES = ("auto", "float32", "bfloat16")
ONE_ROW_KERNELS = ("onednn", "stock")
_ATTR = "_gorgon_packed"


def use_cpu_kernels(model: torch.nn.Module, kernels: str = "fast", one_row: str = "measure") -> str:
    """Put the model's linear layers on the chosen kernels; returns what is in use, for reports.

    "fast" falls back to "stock" with a warning where it cannot run (other torch builds, CUDA,
    float16), so asking for it is always safe. `one_row`: the kernel for one-row products,
    "measure" (the faster on this machine, timed in a fraction of a second), "onednn" or "stock".
    """
    if kernels not in KERNELS:
        raise GorgonError(f"unknown --cpu-kernels {kernels!r}: use fast (oneDNN prepacked weights) or stock")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if kernels == "stock":
        for m in linears:
            m.__dict__.pop("forward", None)
            m.__dict__.pop(_ATTR, None)
        use_tree_attention(model, False)
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
    set_one_row_kernel(model, fastest_one_row_kernel(model) if one_row == "measure" else one_row)
    return kernels_in_use(model)


def draft_dtype(target_model: torch.nn.Module, kernels: str, choice: str = "auto") -> torch.dtype:
    """The dtype a drafter with weights of its own runs in. A draft only proposes (the target's
    verification decides every token), so it need not match the target: on a CPU a draft layer is
    bound by reading its weights, and bfloat16 halves the bytes. "auto": bfloat16 for a float32
    target on the CPU fast path where oneDNN runs bfloat16 on this CPU (detected, never assumed),
    else the target's own dtype."""
    if choice not in DRAFT_DTYPES:
        raise GorgonError(f"unknown --draft-dtype {choice!r}: use auto, float32 or bfloat16")
    if choice != "auto":
        return resolve_dtype(choice)
    weight = next(target_model.parameters())
    if (weight.device.type == "cpu" and weight.dtype == torch.float32 and kernels == "fast"
            and fast_kernels_unavailable(torch.bfloat16) is None):
        return torch.bfloat16
    return weight.dtype


def set_one_row_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Which kernel a one-row product (a plain decoding step) takes on the fast path: "onednn" or "stock".

    Machines differ here: on one, oneDNN's one-row product was twice as fast as MKL's; on another,
    MKL's was slightly faster, because for small matrices oneDNN's fixed cost per call (tens of
    microseconds) outweighs its better use of memory bandwidth. Several rows are always oneDNN's.
    """
    if kernel not in ONE_ROW_KERNELS:
        raise GorgonError(f"unknown one-row kernel {kernel!r}: use one of {', '.join(ONE_ROW_KERNELS)}")
    for m in model.modules():
        if _ATTR in m.__dict__:
            m.__dict__[_ATTR].one_row_onednn = kernel == "onednn"


def one_row_kernel(model: torch.nn.Module) -> str | None:
    """The one-row kernel of the fast path ("onednn" or "stock"); None when the fast path is off."""
    packed = next((m.__dict__[_ATTR] for m in model.modules() if _ATTR in m.__dict__), None)
    return None if packed is None else ("onednn" if packed.one_row_onednn else "stock")


@torch.inference_mode()
def fastest_one_row_kernel(module: torch.nn.Module, repeat: int = 5) -> str:
    """Time a one-row product through every packed linear layer of the module, as a decoding step makes
    them, with each kernel, interleaved; the faster wins. The answer depends on the dtype as well as the
    machine: on an Intel Xeon with AMX, MKL's one-row product was the faster in float32 and oneDNN's in
    bfloat16 (1.3-1.8x; torch's stock bfloat16 product reorders the weight at every call), on every shape
    of the embedded target and its feature-level head."""
    linears = [m for m in module.modules() if _ATTR in m.__dict__]
    rows = [torch.ones(1, m.in_features, dtype=m.weight.dtype, device=m.weight.device) for m in linears]
    times = {kernel: [] for kernel in ONE_ROW_KERNELS}
    for _ in range(repeat + 1):  # the first round warms up
        for kernel in ONE_ROW_KERNELS:
            set_one_row_kernel(module, kernel)
            start = time.perf_counter()
            for linear, row in zip(linears, rows):
                linear(row)
            times[kernel].append(time.perf_counter() - start)
    return min(ONE_ROW_KERNELS, key=lambda k: statistics.median(times[k][1:]))


def kernels_in_use(model: torch.nn.Module) -> str:
    """"fast" when the model's linear layers run on prepacked weights, else "stock"."""
    return "fast" if any(isinstance(m.__dict__.get("forward"), types.MethodType) and _ATTR in m.__dict__
                         for m in model.modules()) else "stock"


@contextlib.contextmanager
def stock_kernels(model: torch.nn.Module):
    """Run the block on torch's stock kernels and transformers' own attention, then restore the fast
    path if it was on. The packed weights are kept, so switching back costs nothing."""
    saved = {m: m.__dict__.pop("forward") for m in model.modules() if "forward" in m.__dict__ and _ATTR in m.__dict__}
    tree_attention = use_tree_attention(model, False)
    try:
        with full_argmax(model):
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
        self.one_row_onednn = True

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.tensor = pack(weight)
            self.key = key
        return self.tensor

    def __deepcopy__(self, memo) -> "_PackedWeight":
        twin = _PackedWeight(self.dtype)  # oneDNN tensors cannot be copied; the copy packs its own weight
        twin.one_row_onednn = self.one_row_onednn
        return twin


def _pack(linear: torch.nn.Linear) -> None:
    packed = linear.__dict__[_ATTR] = _PackedWeight(linear.weight.dtype)
    packed.get(linear.weight)
    linear.forward = types.MethodType(_packed_forward, linear)


def _packed_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed, w = linear.__dict__[_ATTR], linear.weight
    if (x.device.type != "cpu" or x.dtype != packed.dtype or w.dtype != packed.dtype
            or (not packed.one_row_onednn and x.numel() == x.shape[-1])
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return F.linear(x, w, linear.bias)
    return packed_linear(x, packed.get(w), linear.bias)
