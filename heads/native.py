"""gorgon's own CPU kernels (C++ beside the Python that calls them), built on first use for the CPU they run on.

torch's `cpp_extension` compiles each once with g++ (-O3 -march=native) into its extensions folder
($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions) and loads the build after that; the build's name carries
the CPU's flags, so a home folder shared by two kinds of machine keeps one build for each.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

from .errors import GorgonError


def cpuinfo(field: str) -> str:
    """A field of this CPU's /proc/cpuinfo ("flags", "model name"), "" where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(field)), "")


@functools.cache
def native(source: Path):
    """The built module of the C++ file `source` (its functions as Python callables); a build that fails (no g++)
    is a one-line GorgonError naming the kernel and the fix."""
    from torch.utils.cpp_extension import load

    flags = cpuinfo("flags") or platform.processor()
    name = f"gorgon_{source.stem}_{hashlib.sha1((flags + source.read_text()).encode()).hexdigest()[:10]}"
    try:
        return load(name=name, sources=[str(source)], extra_cflags=["-O3", "-march=native", "-ffp-contract=off"],
                    verbose=False)
    except Exception as err:  # the compiler's own message is long: its last line names the cause
        cause = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise GorgonError(f"gorgon's kernel {source.name} did not build here ({cause}): quantized targets need a "
                          "C++ compiler (g++, e.g. apt install g++)") from None
