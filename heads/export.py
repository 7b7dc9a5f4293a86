"""`gorgon export`: write a drafter in the layout a serving engine loads."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .errors import GorgonError
from .files import check_output
from .medusa.formats import FORMATS, export_heads, foreign_format
from .medusa.model import load_with_heads


def is_export(folder: Path) -> bool:
    """A folder `gorgon export` wrote: a config.json in one of the foreign formats."""
    try:
        return foreign_format(folder, json.loads((folder / "config.json").read_text(encoding="utf-8"))) is not None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gorgon export", description="Export heads for a serving engine: 'vllm' (vLLM's "
                                "Medusa model) or 'medusa' (FasterDecoding Medusa, which TGI and TensorRT-LLM read).")
    p.add_argument("--heads", required=True, help="heads folder or hub id")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--target", default=None, help="the target (default: the embedded SmolLM2); its lm_head is "
                   "written out when the heads share it")
    p.add_argument("--base-model", default=None, help="base_model_name_or_path to record (default: the target name)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    if Path(args.heads).is_dir() and out.exists() and out.resolve() == Path(args.heads).resolve():
        raise GorgonError(f"--out {out} is the heads folder itself: choose another folder for the export")
    replace = check_output(out, is_export, args.overwrite)
    target, heads = load_with_heads(args.heads, args.target, device="cpu", dtype="float32")
    if replace:
        shutil.rmtree(out)  # an earlier export, perhaps in the other format: none of its files may linger
    out = export_heads(heads, args.format, out, args.base_model or target.name)
    print(f"gorgon export: wrote {args.format} heads to {out}")
    return 0
