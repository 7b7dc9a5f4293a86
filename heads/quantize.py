"""A quantized target: its decoder's linear layers on 4- or 8-bit weights, on torch's own CPU kernels.

Why: a decode step reads every weight once, so on a CPU it is bound by memory bandwidth; weights read at
4 bits instead of 32 make the step several times faster, and that quantized model is what people serve.

The schemes (`--quantize`):
- "int4": weight-only; groups of 32 weights along the input, each with a scale and a minimum, 16 levels
  between (llama.cpp's Q4_1 grid, so a Q4_1 GGUF such as the embedded target's requantizes onto its own
  codes); `torch.ops.aten._weight_int4pack_mm_for_cpu`.
- "int8": weight-only; one symmetric scale per output row; `torch.ops.aten._weight_int8pack_mm`.
- "w8a8": int8's weights times int8 activations, each input row scaled when it arrives (torchao's and
  llm-compressor's dynamic per-token W8A8); `torch._int_mm`, an exact int32 sum, so several rows cost
  little more than one where the weight-only kernels' cost grows with the rows.
- "w4a8": int4's grid (scales and minimums in float16, as a Q4_1 GGUF stores them) times int8 activations with
  a scale per block of 32 inputs (llama.cpp's Q4_1 x Q8_1 arithmetic); gorgon's own kernel (w4a8.cpp, built
  on first use), AVX512-VNNI where the CPU has it. The fastest scheme here at every row count.
The LM head takes the scheme too (int8 where the int4 kernel does not take its shape) and keeps its float
weight: in float32 it was a third of an int4 step; the int4 kernel reads it in 1.7 ms where the int8 one took
4.3 ms, and 2 rows cost it 1.25x one row where they cost the int8 one 1.3-2x. The weight-only kernels take
bfloat16 activations (in float32 they run a slow reference loop, 5-30x slower), so a layer rounds its input to
bfloat16 and returns float32: the rest of the model (norms, attention, the residual stream) stays in the
target's own dtype. Each output row depends only on its own input row (`row_invariance_problem`); with each
row's attention computed alone too (`gorgon.decode.attention.quantized_attention`), the speculative decoder's
greedy output equals the quantized target's own `generate`, token for token.

Why not a library's tensor subclass: torchao 0.18 has no CPU int4 layout left (its "opaque" format, which
called the same kernel, is gone), its int8 layout keeps float32 activations, the slow path, and its W8A8
(`Int8DynamicActivationInt8WeightConfig`, row-invariant too) took 650 us for one row of a 1,536 x 576 product
where `torch._int_mm` with its scaling takes about 80; these are the kernels torchao and gpt-fast call, used
directly. The embeddings and the LM head's float weight (tied
to them) stay, so the target's fingerprint, and heads trained on the full-precision target, fit the
quantized copy.

`keep_float=True` keeps every layer's float weight beside its quantized one (more memory), so a bench can
time stock full-precision `generate` in the same run (`float_weights`).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import GorgonError
from .native import native

SCHEMES = ("none", "int8", "int4", "w8a8", "w4a8")
GROUP_SIZE = 32  # weights per int4 scale and minimum, as in llama.cpp's Q4_1
_GPU_ONLY = {"fp8": "FP8", "nf4": "bitsandbytes NF4"}


def scheme_problem(scheme: str) -> str | None:
    """What is wrong with a scheme's name (one a user may expect but gorgon lacks, or a typo), or None."""
    if scheme in _GPU_ONLY:
        return (f"{scheme} ({_GPU_ONLY[scheme]}) is not built in gorgon yet: use int4 or int8 on the CPU, or load "
                "a checkpoint already quantized with it as --target")
    if scheme not in SCHEMES:
        return f"unknown scheme {scheme!r}: use one of {', '.join(SCHEMES)}"
    return None


def check_scheme(scheme: str, device: torch.device | str = "cpu") -> None:
    """Refuse a scheme this build, device or CPU cannot run, in one line naming what can."""
    problem = scheme_problem(scheme)
    if problem:
        raise GorgonError(f"--quantize {problem}")
    if scheme == "none":
        return
    if torch.device(device).type != "cpu":
        raise GorgonError(f"--quantize {scheme} runs on the CPU (torch's CPU kernels): use --device cpu, or on a "
                          "GPU load a checkpoint already quantized (its config's quantization_config is used as is)")
    problem = kernel_problem(scheme)
    if problem:
        raise GorgonError(f"--quantize {scheme} cannot run here: {problem}; use --quantize none")


@functools.cache
def kernel_problem(scheme: str) -> str | None:
    """Why this torch build cannot run the scheme's kernel (a probe against the dequantized product), or None;
    probed once a process (loading a target checks before and after its weights load)."""
    if scheme == "w4a8":
        op = "w4a8_linear"
        try:
            w4a8_kernel()
        except GorgonError as err:
            return str(err)
    else:
        op = {"int4": "_weight_int4pack_mm_for_cpu", "int8": "_weight_int8pack_mm", "w8a8": "_int_mm"}[scheme]
        if not hasattr(torch.ops.aten, op):
            return f"this torch build lacks torch.ops.aten.{op}"
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    try:
        layer = QUANTIZED[scheme](_linear(weight))
        got = layer(x)
    except RuntimeError as err:
        return f"{op} failed a probe ({str(err).splitlines()[0]})"
    want = F.linear(layer.rounded(x), layer.dequantized())
    if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
        return f"{op} gave wrong results in a probe"
    return None


def row_invariance_problem(scheme: str, rows: int = 16) -> str | None:
    """Why the scheme's kernel would make speculation differ from plain decoding (a row's result changing
    with the rows beside it), or None. Greedy exactness rests on this; the tests check it."""
    layer = QUANTIZED[scheme](_linear(torch.randn(96, 64, generator=torch.Generator().manual_seed(0))))
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    together = layer(x)
    for m in range(1, rows + 1):
        if not torch.equal(layer(x[:m]), together[:m]) or not torch.equal(layer(x[m - 1:m]), together[m - 1:m]):
            return f"{scheme} rows differ when computed {m} at a time"
    return None


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight
    return layer


class QuantizedLinear(torch.nn.Module):
    """What the quantized schemes share: the shape, a bias, the float weight when kept, and the switch to it."""

    scheme = ""

    def __init__(self, linear: torch.nn.Linear, keep_float: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight = linear.weight if keep_float else None  # a Parameter still (the LM head's is tied)
        self.use_float = False

    def rows_product(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The product for some output rows only (a draft vocabulary), each as the whole product computes it."""
        return self(x)[..., rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_float:
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() and x.requires_grad:  # the kernels have no backward: the same product, by hand
            return F.linear(self.rounded(x), self.dequantized().to(x.dtype), self.bias)
        y = self.product(x.reshape(-1, self.in_features)).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the kernel reads it (bfloat16 for the weight-only schemes), in x's dtype."""
        return x.to(torch.bfloat16).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class Int4Linear(QuantizedLinear):
    """4-bit codes q in 0..15 per group of GROUP_SIZE inputs: w = q * scale + minimum (Q4_1's grid)."""

    scheme = "int4"
    ROWS_MULTIPLE = 16  # torch's int4 packing takes output rows in multiples of 16, and interleaves them

    def __init__(self, linear: torch.nn.Linear, keep_float: bool = False):
        super().__init__(linear, keep_float)
        n, k = self.out_features, self.in_features
        groups = linear.weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(n, k)
        # torch's kernel reads w = (q - 8) * scale + zero, so its zero is the minimum moved up 8 steps.
        scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16))

    @classmethod
    def fits(cls, linear: torch.nn.Linear) -> bool:
        return linear.in_features % GROUP_SIZE == 0 and linear.out_features % cls.ROWS_MULTIPLE == 0

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE,
                                                          self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, in float32 (for checks, and a backward through the layer)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return self.product(eye).float().T.contiguous()


class Int8Linear(QuantizedLinear):
    """8-bit codes per output row with one symmetric scale: w = q * scale."""

    scheme = "int8"

    def __init__(self, linear: torch.nn.Linear, keep_float: bool = False):
        super().__init__(linear, keep_float)
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer("codes", (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(torch.bfloat16))

    @staticmethod
    def fits(linear: torch.nn.Linear) -> bool:
        return True

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    def rows_product(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Only those rows' codes are read (a draft vocabulary of 8,192 of 49,152 rows: a sixth)."""
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(torch.bfloat16),
                                               self.codes[rows], self.scales[rows])
        return y.to(x.dtype).reshape(*x.shape[:-1], rows.numel())


class W8A8Linear(Int8Linear):
    """int8 weights as "int8", times int8 activations: each input row gets its own scale when it arrives
    (dynamic, per token), and the product is `torch._int_mm`'s int32 sum (VNNI on the CPU). Integer sums
    are exact, so a row's result cannot depend on the rows beside it; several rows cost little more than one."""

    scheme = "w8a8"

    def __init__(self, linear: torch.nn.Linear, keep_float: bool = False):
        super().__init__(linear, keep_float)
        self.register_buffer("output_scales", self.scales.float() / 127)  # the weight's scale over the input's 127

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return self._times(x, self.codes, self.output_scales)

    def rows_product(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        y = self._times(x.reshape(-1, self.in_features), self.codes[rows], self.output_scales[rows])
        return y.to(x.dtype).reshape(*x.shape[:-1], rows.numel())

    @staticmethod
    def _times(x: torch.Tensor, codes: torch.Tensor, output_scales: torch.Tensor) -> torch.Tensor:
        # Few operations: at one row each costs about what the product does. |x| / max|x| <= 1, so no clamp.
        x_max = torch.linalg.vector_norm(x.float(), float("inf"), dim=-1, keepdim=True).clamp_min_(1e-30)
        x_codes = torch.div(x, x_max).mul_(127).round_().to(torch.int8)
        return torch.mul(torch._int_mm(x_codes, codes.T), x_max).mul_(output_scales)

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        """The input on its row's int8 grid; the gradient passes straight through the rounding."""
        x_max = x.detach().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        return x + ((x.detach() / x_max * 127).round() * x_max / 127 - x.detach())


class W4A8Linear(QuantizedLinear):
    """int4's grid (codes 0..15 per group of GROUP_SIZE inputs, w = q * scale + minimum, both in float16) times int8
    activations, each block of GROUP_SIZE inputs of a row with its own scale; integer sums per block, then one fused
    multiply-add per block in a fixed order (w4a8.cpp), so a row's result cannot depend on the rows beside it."""

    scheme = "w4a8"
    ROWS_MULTIPLE = 16  # the kernel computes 16 outputs at once

    def __init__(self, linear: torch.nn.Linear, keep_float: bool = False):
        super().__init__(linear, keep_float)
        n, k = self.out_features, self.in_features
        groups = linear.weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        low = groups.amin(-1)
        scale = ((groups.amax(-1) - low) / 15).half()
        minimum = low.half()
        # Codes against the float16 scale and minimum the kernel reads (the grid a Q4_1 GGUF's blocks are on).
        codes = ((groups - minimum.float()[..., None]) / scale.float().clamp(min=1e-30)[..., None])
        self.register_buffer("packed", self.pack(codes.round().clamp(0, 15).to(torch.uint8)))
        # (n / 16, k / 32, 16): each block's 16 outputs side by side, as the kernel loads them
        self.register_buffer("scales", scale.reshape(n // 16, 16, -1).transpose(1, 2).contiguous())
        self.register_buffer("minimums", minimum.reshape(n // 16, 16, -1).transpose(1, 2).contiguous())

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:
        """(n, k / 32, 32) codes into the kernel's layout (w4a8.cpp): per 16 outputs and block, 4 x 64 bytes, byte
        4c + r of part j holding output c's codes at inputs 4j + r (low nibble) and 4(j + 4) + r (high)."""
        n, blocks, _ = codes.shape
        quads = codes.reshape(n // 16, 16, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # group, block, quad, output, input
        return (quads[:, :, :4] | (quads[:, :, 4:] << 4)).reshape(n // 16, blocks, 4, 64).contiguous()

    @classmethod
    def fits(cls, linear: torch.nn.Linear) -> bool:
        return linear.in_features % GROUP_SIZE == 0 and linear.out_features % cls.ROWS_MULTIPLE == 0

    siblings: Siblings | None = None  # set by `join_siblings`

    def product(self, x: torch.Tensor, plain: bool = False) -> torch.Tensor:
        """`plain`: the kernel's plain loop instead of its vector path (the same bits; for the tests)."""
        if self.siblings is not None and not plain:
            return self.siblings.product(x, self)
        return w4a8_kernel().w4a8_linear(x.float(), self.packed, self.scales, self.minimums, plain)

    def dequantized(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        p = self.packed.reshape(n // 16, k // GROUP_SIZE, 4, 16, 4)
        quads = torch.cat([p & 15, p >> 4], dim=2)  # group, block, quad, output, input
        codes = quads.permute(0, 3, 1, 2, 4).reshape(n, k // GROUP_SIZE, GROUP_SIZE).float()
        scale, minimum = (t.transpose(1, 2).reshape(n, -1, 1).float() for t in (self.scales, self.minimums))
        return (codes * scale + minimum).reshape(n, k)

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        """The input on its blocks' int8 grids; the gradient passes straight through the rounding."""
        blocks = x.detach().float().unflatten(-1, (-1, GROUP_SIZE))
        most = blocks.abs().amax(dim=-1, keepdim=True)
        on_grid = ((blocks * (127 / most.clamp_min(1e-30))).round() * (most / 127)).flatten(-2).to(x.dtype)
        return x + (on_grid - x.detach())


@functools.cache
def w4a8_kernel():
    """w4a8.cpp, built for this CPU (`gorgon.heads.native`); kept, as a layer calls it on every product."""
    return native(Path(__file__).with_name("w4a8.cpp"))


# Linear layers a transformers block calls one after the other on the same input: an attention's q, k and v, an
# MLP's gate and up (Llama, Mistral, Qwen, Gemma and most others name them so).
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Siblings:
    """w4a8 layers that a block calls on one input, computed in one kernel call: the first layer called computes
    every sibling's outputs, the others take theirs. Why: a one-token step is mostly per-call work (the call
    itself, putting the input on its int8 grid), and a layer has seven calls. The kernel computes each group of 16
    outputs alone, so every output has the bits of its own layer's call. The layers' buffers become views of the
    joined ones (no second copy)."""

    def __init__(self, layers: list[W4A8Linear]):
        self.packed, self.scales, self.minimums = (torch.cat([getattr(m, name) for m in layers])
                                                   for name in ("packed", "scales", "minimums"))
        self.spans, start, group = {}, 0, W4A8Linear.ROWS_MULTIPLE
        for m in layers:
            end = start + m.out_features
            groups = slice(start // group, end // group)
            m.packed, m.scales, m.minimums = self.packed[groups], self.scales[groups], self.minimums[groups]
            self.spans[id(m)] = (start, end)
            m.siblings, start = self, end
        self.last = None  # (input, its version, joined output, the layers that have not taken theirs yet)

    def product(self, x: torch.Tensor, layer: W4A8Linear) -> torch.Tensor:
        last, version = self.last, version_of(x)
        if last is None or not same_tensor(last[0], x) or last[1] != version or id(layer) not in last[3]:
            y = w4a8_kernel().w4a8_linear(x.float(), self.packed, self.scales, self.minimums, False)
            last = self.last = (x, version, y, set(self.spans))
        last[3].discard(id(layer))
        if not last[3]:  # every sibling served: let go of the activations
            self.last = None
        start, end = self.spans[id(layer)]
        return last[2][:, start:end]


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b is a as another view object (reshaping makes a new one each call); `a` is held, so its memory
    cannot have gone to another tensor meanwhile."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def version_of(x: torch.Tensor) -> int | None:
    """How many times x was written in place (None for inference-mode tensors, which do not count)."""
    return None if x.is_inference() else x._version


def join_siblings(module: torch.nn.Module) -> None:
    """Join each block's sibling w4a8 layers (SIBLING_NAMES) into one kernel call (`Siblings`)."""
    for parent in module.modules():
        for names in SIBLING_NAMES:
            layers = [getattr(parent, name, None) for name in names]
            if all(isinstance(m, W4A8Linear) and m.siblings is None for m in layers) \
                    and len({m.in_features for m in layers}) == 1:
                Siblings(layers)


QUANTIZED = {"int4": Int4Linear, "int8": Int8Linear, "w8a8": W8A8Linear, "w4a8": W4A8Linear}


@torch.no_grad()
def quantize_model(model: torch.nn.Module, scheme: str, keep_float: bool = False) -> int:
    """Replace the model's linear layers by the scheme's quantized ones, in place; returns how many. The
    LM head keeps its float weight (tied to the embeddings, read by the fingerprint and by drafters) and
    takes int8 where the int4 kernel does not take its shape."""
    check_scheme(scheme, next(model.parameters()).device)
    if scheme == "none":
        return 0
    count = quantize_linears(model, scheme, keep_float, head=model.get_output_embeddings())
    model._gorgon_quantize = scheme
    return count


@torch.no_grad()
def quantize_linears(module: torch.nn.Module, scheme: str, keep_float: bool = False, head=None) -> int:
    """Replace the module's linear layers by the scheme's, in place (a drafter's too: `--draft-dtype w4a8`); returns
    how many. A layer whose shape the scheme's kernel does not take (int4, w4a8: inputs not a multiple of 32,
    outputs not of 16) stays, but `head` (a model's LM head) takes int8 then, and keeps its float weight."""
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if isinstance(child, torch.nn.Linear)]
    count = 0
    for parent, name, child in swaps:
        kind = QUANTIZED[scheme]
        if child is head and not kind.fits(child):
            kind = Int8Linear
        if kind.fits(child):
            setattr(parent, name, kind(child, keep_float or child is head))
            count += 1
    if scheme == "w4a8":
        join_siblings(module)
    return count


def quantization(model: torch.nn.Module) -> str:
    """The scheme a model was quantized with by `quantize_model`, else "none"."""
    return getattr(model, "_gorgon_quantize", "none")


@contextlib.contextmanager
def float_weights(model: torch.nn.Module):
    """Run the block on the kept float weights (stock full-precision products); nothing changes for a model
    that is not quantized. A quantized model loaded without `keep_float` is refused."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if any(m.weight is None for m in layers):
        raise GorgonError("this quantized target was loaded without its float weights: load it with "
                          "keep_float=True to time stock full-precision generate beside it")
    for m in layers:
        m.use_float = True
    try:
        yield
    finally:
        for m in layers:
            m.use_float = False


def float_parameter(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A parameter by name, also where a quantized layer holds it as codes (then its dequantized values): what a
    drafter copies from the target's layers to start from."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if isinstance(owner, QuantizedLinear) and leaf == "weight" and owner.weight is None:
        return owner.dequantized()
    return module.get_parameter(name)


def has_float_weights(model: torch.nn.Module) -> bool:
    """Whether `float_weights` can run this model: not quantized, or quantized with its float weights kept."""
    return all(m.weight is not None for m in model.modules() if isinstance(m, QuantizedLinear))
