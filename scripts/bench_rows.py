"""Does verifying extra tokens cost extra time on this machine? Times one weight matrix product
for 1, 2, 4 and 8 rows (tokens), the shape of a decoding step's products.

    OMP_NUM_THREADS=1 python scripts/bench_rows.py [--in 1536 --out 8960] [--device cpu] [--dtype float32]

Speculative decoding pays when a few rows cost about as much as one (memory-bound products, as
on GPUs); where time grows with the rows, a verify step of k tokens costs nearly k plain steps.
"""

import argparse
import time

import torch

from gorgon.heads.command import ArgumentParser, int_at_least, run_script
from gorgon.heads.target import resolve_device, resolve_dtype


def main():
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in", dest="n_in", type=int_at_least(1), default=1536,
                   help="input features (default 1536: Qwen2.5-1.5B's MLP)")
    p.add_argument("--out", dest="n_out", type=int_at_least(1), default=8960,
                   help="output features, the weight's rows (default 8960: Qwen2.5-1.5B's MLP)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--repeat", type=int_at_least(1), default=30, help="timed products per row count (default 30)")
    args = p.parse_args()
    device = resolve_device(args.device)
    weight = torch.randn(args.n_out, args.n_in, device=device, dtype=resolve_dtype(args.dtype, device))
    base = None
    print(f"{weight.dtype}, {device}, {torch.get_num_threads()} thread(s), weight {args.n_out}x{args.n_in}")
    for rows in (1, 2, 4, 8):
        x = torch.randn(rows, args.n_in, device=device, dtype=weight.dtype)
        torch.nn.functional.linear(x, weight)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.repeat):
            torch.nn.functional.linear(x, weight)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.repeat * 1000
        base = base or ms
        print(f"  {rows} row(s): {ms:8.3f} ms  {ms / base:5.2f}x one row")


if __name__ == "__main__":
    run_script(main, "scripts/bench_rows.py")
