"""The two oneDNN operations the CPU fast path is built on, in one place: reorder a weight once for
oneDNN, then multiply by it (the ops torch's inductor emits for CPU linears under freezing), and the
probe that says whether this torch build and CPU run them for a dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN picks its weight layout for an expected row count; 4 measured best for 1-16 rows
# (a hint of 1 made two rows cost 1.4x one row).
PACK_ROWS_HINT = 4


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) reordered for oneDNN's linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, with the weight as `pack` returned it."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [], "")


def fast_kernels_unavailable(dtype: torch.dtype) -> str | None:
    """Why the fast path cannot run with this dtype on this torch build and CPU, or None if it can."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        for op in ("_reorder_linear_weight", "_linear_pointwise"):
            getattr(torch.ops.mkldnn, op)
    except (AttributeError, RuntimeError):
        return "this torch build lacks torch.ops.mkldnn._linear_pointwise"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no bf16 instructions for oneDNN"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} is not packed (float32 and bfloat16 are)"
    # A probe with the real ops: a build can expose them and still refuse to run them.
    try:
        w, x = torch.randn(8, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
        got = torch.ops.mkldnn._linear_pointwise(x, pack(w), None, "none", [], "")
    except RuntimeError as err:
        return f"oneDNN's linear failed a probe ({str(err).splitlines()[0]})"
    if not torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2):
        return "oneDNN's linear gave wrong results in a probe"
    return None
