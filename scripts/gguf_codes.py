"""How closely `--quantize int4` reproduces a Q4_1 GGUF (by default the embedded target's): for every Q4_1
tensor, its weights as the GGUF stores them (per block of 32: a float16 step d and minimum m, codes 0-15),
requantized as gorgon does, and compared code by code; and the largest difference between gorgon's
dequantized weights (scales and minimums in bfloat16, the kernel's format) and the GGUF's, in units of the
block's step.

    python scripts/gguf_codes.py [--gguf FILE]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from gorgon.heads.command import ArgumentParser, run_script, user_path
from gorgon.heads.errors import GorgonError
from gorgon.heads.quantize import GROUP_SIZE, Int4Linear
from gorgon.heads.target import embedded_gguf_path

BLOCK_BYTES = 20  # ggml's block_q4_1: float16 d, float16 m, 16 bytes of 4-bit codes (low nibbles first)


def q4_1_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps, minimums and codes (blocks x 32) of a Q4_1 tensor's raw bytes."""
    blocks = raw.view(np.uint8).reshape(-1, BLOCK_BYTES)
    step = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    low = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    nibbles = blocks[:, 4:]
    return step, low, np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.int32)


def compare(path: str) -> dict:
    from gguf import GGMLQuantizationType, GGUFReader

    same = total = tensors = 0
    worst = 0.0
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        step, low, codes = q4_1_blocks(np.asarray(tensor.data))
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        weight = torch.from_numpy(codes * step[:, None] + low[:, None]).reshape(rows, cols)
        linear = torch.nn.Linear(cols, rows, bias=False)
        linear.weight.data = weight
        layer = Int4Linear(linear)
        groups = weight.reshape(-1, GROUP_SIZE)
        lowest = groups.amin(-1, keepdim=True)
        ours = ((groups - lowest) / ((groups.amax(-1, keepdim=True) - lowest) / 15)).round().clamp(0, 15)
        same += int((ours.to(torch.int32) == torch.from_numpy(codes)).sum())
        total += codes.size
        steps = torch.from_numpy(step).repeat_interleave(GROUP_SIZE).reshape(rows, cols)
        worst = max(worst, float(((layer.dequantized() - weight).abs() / steps.clamp(min=1e-12)).max()))
        tensors += 1
    if not tensors:
        raise GorgonError(f"{path} holds no Q4_1 tensor: pass a Q4_1 GGUF")
    return {"q4_1_tensors": tensors, "codes_equal": same, "codes": total, "largest_difference_in_steps": worst}


def main() -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=user_path, default=None, help="a Q4_1 GGUF (default: the embedded target's)")
    args = p.parse_args()
    found = compare(str(args.gguf or embedded_gguf_path()))
    print(f"{found['q4_1_tensors']} Q4_1 tensors: {found['codes_equal']:,} of {found['codes']:,} codes equal "
          f"({found['codes_equal'] / found['codes']:.4%}); dequantized weights within "
          f"{found['largest_difference_in_steps']:.3f} of a block's step of the GGUF's")
    return 0


if __name__ == "__main__":
    run_script(main, "scripts/gguf_codes.py")
