"""What a verify forward costs on this machine, measured once and cached: the input to the tree's size.

A tree pays when the tokens it adds per step outweigh what verifying it costs, and that cost
depends on the hardware, the kernels, the dtype and the thread count, not only the model. So
the cost of a forward over 1 to 16 tokens on a CPU (1, 2, 4, ... 64 on a GPU; the greedy choice
over them included, on a cache of 256) is timed here in a few seconds and kept in the gorgon
cache under a key of everything it depends on.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import NamedTuple

import torch

from gorgon.heads.cache import crop_cache, growing_cache, with_cache
from gorgon.heads.files import atomic_write_text
from gorgon.heads.native import cpuinfo
from gorgon.heads.quantize import quantization
from gorgon.heads.target import cache_dir
from gorgon.heads.tree import build_tree, root_only_tree

from .argmax import argmax_in_use, target_argmax
from .attention import decoding_attention
from .kernels import kernels_in_use, stock_rows
from .verify import verify, verify_batch

# A CPU's cost steps with the token count rather than growing with it: oneDNN multiplies in blocks of
# rows (on an AMD EPYC with AVX-512, one thread: 3 to 6 tokens 0.93x one, 2 tokens 1.15x, 7 tokens
# 1.11x), which a line between powers of two misses, so every size to 16 is timed. A GPU's cost grows
# slowly and smoothly with the count: powers of two suffice.
CPU_SIZES = tuple(range(1, 17))
CUDA_SIZES = (1, 2, 4, 8, 16, 32, 64)
# A batch of rows multiplies every size: on a CPU each row's few nodes already fill the blocks, and wider
# trees stop paying before 8 (`gorgon.decode.batch`); beyond, the cost is extrapolated in proportion.
CPU_BATCH_SIZES = (1, 2, 3, 4, 6, 8)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """The vector and matrix extensions this CPU reports (Linux), which decide which kernels are fast."""
    flags = cpuinfo("flags").split()
    return [f for f in CPU_FLAGS if f in flags]


def cpu_name() -> str:
    return cpuinfo("model name") or platform.processor() or platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, repeat: int, reset=lambda: None, device: torch.device = torch.device("cpu")) -> float:
    """Median wall time of fn() over `repeat` runs after one warm-up, calling reset() after each."""
    times = []
    for _ in range(repeat + 1):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1000)
        reset()
    return statistics.median(times[1:])


def measured_sizes(device: torch.device, batch: int = 1) -> tuple[int, ...]:
    """The token counts (per row) whose verify cost is timed on this kind of device."""
    if device.type == "cuda":
        return CUDA_SIZES
    return CPU_SIZES if batch == 1 else CPU_BATCH_SIZES


TIMED_CONTEXT = 256  # cached positions before the timed tokens: a short conversation's


@torch.inference_mode()
def measure_verify_costs(model, sizes=None, context: int = TIMED_CONTEXT, repeat: int = 20,
                         batch: int = 1) -> dict[int, float]:
    """Milliseconds of one target forward over n tree tokens plus its greedy choice at each, for each n:
    the median of `repeat` rounds that each time every size once, so a machine that slows or speeds up
    meanwhile shifts every size alike, not the sizes timed during the change alone. `batch`: rows verified
    together, each with its own n nodes (`gorgon.decode.batch`).

    The tree for n is a chain (position ids 1..n): for the cost only the token count matters.
    """
    device = model.device
    sizes = sizes or measured_sizes(device, batch)
    prompt = torch.randint(0, model.config.get_text_config().vocab_size, (batch, context), device=device)
    cache = growing_cache()
    decoder = model.get_decoder()
    decoder(input_ids=prompt, **with_cache(decoder, cache), use_cache=True)
    chains = {n: build_tree([[0] * d for d in range(1, n)]).to(device) if n > 1 else root_only_tree(device)
              for n in sizes}

    def step(n: int):
        tokens = prompt[0, :n]
        if batch > 1:  # as a batch decodes: every row after its own context, under a mask
            out = verify_batch(model, cache, [context] * batch, [tokens] * batch, [chains[n]] * batch)
        elif n == 1:  # a plain decoding step
            out = decoder(input_ids=tokens[None], **with_cache(decoder, cache), use_cache=True)
        else:
            out = verify(model, cache, tokens, chains[n])
        target_argmax(model, out.last_hidden_state)

    times = {n: [] for n in sizes}
    with decoding_attention(device):  # the attention decoding runs on
        for round in range(repeat + 1):  # the first round warms up
            for n in sizes:
                sync(device)
                start = time.perf_counter()
                step(n)
                sync(device)
                if round:
                    times[n].append((time.perf_counter() - start) * 1000)
                crop_cache(cache, context)
    return {n: statistics.median(t) for n, t in times.items()}


@torch.inference_mode()
def drafted_level_cost(drafter, target_model, repeat: int = 20) -> float:
    """One level of a drafter's search (its `level_trial`: a level of `topk` rows on a cache of TIMED_CONTEXT)
    in plain target steps: `level_cost`."""
    level, reset = drafter.level_trial(TIMED_CONTEXT)
    return level_cost(level, reset, target_model, repeat)


def level_cost(level, reset, target_model, repeat: int = 20) -> float:
    """A drafted level's time (`level()`, after which `reset()` restores the drafter's cache) in plain target
    steps (`verify_costs`' one-token cost): what a level must bring in expected tokens to pay. Timed anew
    each time (a fraction of a second), not cached: the drafter is whatever the user passes. The plain step is
    the cached verify costs' where they were measured, else timed alone (all sizes take tens of seconds)."""
    with decoding_attention(target_model.device):
        ms = median_ms(level, repeat, reset, target_model.device)
    step = (cached_verify_costs(calibration_entry(target_model))
            or measure_verify_costs(target_model, sizes=(1,), repeat=repeat))[1]
    return ms / step


def machine_setup(model) -> dict:
    """The machine and the kernels a model decodes on: what its speed depends on besides the model (a bench
    report records it; verify costs are cached under it)."""
    device = model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"device": f"{device.type} ({name})", "dtype": str(model.dtype).replace("torch.", ""),
            "quantize": quantization(model),
            "kernels": kernels_in_use(model) if device.type == "cpu" else "cuda", "stock_rows": stock_rows(model),
            "attention": getattr(model.config, "_attn_implementation", None), "greedy_argmax": argmax_in_use(model),
            "cpu_flags": cpu_flags(), "threads": torch.get_num_threads()}


def calibration_key(model, batch: int = 1) -> dict:
    """Everything a verify cost depends on (the batch's rows where more than one); gorgon's own version too, as a
    release can change its kernels and the layers' calls (joining w4a8 siblings cut a step by 12%)."""
    cfg = model.config.get_text_config()
    key = {**machine_setup(model), "torch": torch.__version__, "gorgon": version("gorgon"),
           "sizes": list(measured_sizes(model.device, batch)),
           "model": {k: getattr(cfg, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "vocab_size")}}
    return key if batch == 1 else {**key, "batch": batch}


# Costs timed on a busy machine, by calibration key digest: this process uses them, no later one does.
_NOT_CACHED: dict[str, dict[int, float]] = {}


def calibration_entry(model, batch: int = 1) -> tuple[dict, str, Path]:
    """The model's calibration key, its digest, and the cache file its verify costs are kept in."""
    key = calibration_key(model, batch)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return key, digest, cache_dir() / "calibration" / f"{digest}.json"


def cached_verify_costs(entry: tuple[dict, str, Path]) -> dict[int, float] | None:
    """The verify costs measured before under a model's `calibration_entry` (by this process on a busy
    machine, else from the cache), or None."""
    _, digest, path = entry
    if digest in _NOT_CACHED:
        return _NOT_CACHED[digest]
    try:
        return {int(n): float(ms) for n, ms in json.loads(path.read_text())["costs_ms"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or a damaged entry
        return None


def verify_costs(model, batch: int = 1) -> dict[int, float]:
    """Measured verify costs for this model on this machine (for `batch` rows verified together, each with the
    same node count), from the cache when they were measured before."""
    key, digest, path = entry = calibration_entry(model, batch)  # the key reads the machine: once a call
    cached = cached_verify_costs(entry)
    if cached is not None:
        return cached
    sizes = measured_sizes(model.device, batch)
    rows = f" in each of {batch} rows" if batch > 1 else ""
    print(f"gorgon: timing target forwards of {sizes[0]} to {sizes[-1]} tokens{rows} on this machine, to size the "
          "tree (once, then kept; a fixed --tree N, and --tree-budget N with --context-draft, need none)",
          file=sys.stderr)
    start = time.perf_counter()
    costs = measure_verify_costs(model, repeat=max(5, 20 // batch), batch=batch)
    print(f"gorgon: timed in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    others = busy_cores()
    if others > BUSY_LIMIT:  # a busy machine's costs would size every later run's tree wrongly
        print(f"gorgon: other work kept about {others:.1f} of {os.cpu_count()} cores busy while verify costs were "
              "timed: this run sizes its trees from them, but they are not cached; time them on a quiet machine",
              file=sys.stderr)
        _NOT_CACHED[digest] = costs
        return costs
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "costs_ms": costs}, indent=1) + "\n")
    return costs


# Cores that other work may keep busy before a timing beside it is taken to be off (`busy_cores`).
BUSY_LIMIT = 0.5


class CpuReading(NamedTuple):
    """What `busy_cores` measures from: wall seconds, seconds all cores were busy (None where the system does not
    say), and this process's CPU seconds."""

    wall: float
    busy: float | None
    own: float


def cpu_reading() -> CpuReading:
    """The clocks now. Busy is every core's time less idle and I/O wait, from Linux's /proc/stat; time the hypervisor
    gave other machines counts as busy (this one waited)."""
    try:  # the first line: cpu user nice system idle iowait irq softirq steal ...
        ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        busy = None
    own = os.times()
    return CpuReading(time.perf_counter(), busy, own.user + own.system)


def busy_cores(since: CpuReading | None = None) -> float:
    """Cores that work besides this process's kept busy: since `since` (a `cpu_reading()`), every core's busy time
    less this process's; without one, over the last minute, the load average less torch's thread count. 0 where
    the system gives neither. A timing beside another job is off: on a CPU by many times for two OpenMP threads
    beside another process, and a small target on a GPU is bound by the host."""
    if since is not None:
        now = cpu_reading()
        if since.busy is None or now.busy is None:
            return 0.0
        return max(0.0, (now.busy - since.busy - (now.own - since.own)) / max(now.wall - since.wall, 1e-9))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return max(0.0, load - torch.get_num_threads())
