"""`gorgon export`: write a drafter in the layout a serving engine loads."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from .eagle import EagleHead
from .eagle import formats as eagle_formats
from .errors import GorgonError
from .files import atomic_write_text, check_output
from .loading import load_heads
from .medusa import formats as medusa_formats

EXPORT_MARKER = ".gorgon-export"  # written into an export folder once it is complete: only such a folder is replaced


def is_export(folder: Path) -> bool:
    """A folder `gorgon export` wrote (its marker), not merely one in an engine's layout: a downloaded
    checkpoint with the user's own files beside it is never replaced."""
    return (folder / EXPORT_MARKER).is_file()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gorgon export", description="Export heads for a serving engine. Medusa heads: "
                                "'vllm' (vLLM's Medusa model) or 'medusa' (FasterDecoding Medusa, which TGI and "
                                "TensorRT-LLM read). A feature-level head: 'eagle3' (vLLM's and SGLang's EAGLE-3) or "
                                "'speculators' (the speculators library's format, which vLLM reads).")
    p.add_argument("--heads", required=True, help="heads folder or hub id")
    p.add_argument("--format", required=True, choices=medusa_formats.FORMATS + eagle_formats.FORMATS,
                   help="the serving engine's layout: vllm or medusa for Medusa heads, eagle3 or speculators for a "
                        "feature-level head")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--target", default=None, help="the target (default: the embedded SmolLM2); its lm_head is "
                   "written out when the heads share it")
    p.add_argument("--base-model", default=None, help="base_model_name_or_path to record (default: the target name)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    if Path(args.heads).is_dir() and out.exists() and out.resolve() == Path(args.heads).resolve():
        raise GorgonError(f"--out {out} is the heads folder itself: choose another folder for the export")
    replace = check_output(out, is_export, args.overwrite)
    target, heads = load_heads(args.heads, args.target, device="cpu", dtype="float32")
    eagle = isinstance(heads, EagleHead)
    if (args.format in eagle_formats.FORMATS) != eagle:
        kind, formats = ("a feature-level head", eagle_formats.FORMATS) if eagle else \
            ("Medusa heads", medusa_formats.FORMATS)
        raise GorgonError(f"{args.heads} holds {kind}, which export as {' or '.join(formats)}, not {args.format}")
    if replace:
        shutil.rmtree(out)  # an earlier export, perhaps in the other format: none of its files may linger
    write = eagle_formats.export_head if eagle else medusa_formats.export_heads
    out = write(heads, args.format, out, args.base_model or target.name)
    atomic_write_text(out / EXPORT_MARKER, "")
    print(f"gorgon export: wrote {args.format} heads to {out}")
    return 0
