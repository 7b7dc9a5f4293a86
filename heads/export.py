"""`gorgon export`: write a drafter in the layout a serving engine loads."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from .command import ArgumentParser, user_path
from .drafter import dtype_name
from .errors import GorgonError
from .files import atomic_write_text
from .hub import is_hub_id, resolve_heads_folder
from .loading import heads_method, load_heads
from .methods import methods
from .outputs import check_output, full_disk_is_one_line, move_into_place, staging
from .target import EMBEDDED_HUB_ID, hub_name, resolve_dtype

EXPORT_MARKER = ".gorgon-export"  # written into a complete export: the files it wrote, which --overwrite replaces


def is_export(folder: Path) -> bool:
    """A folder `gorgon export` wrote (its marker), not merely one in an engine's layout: a downloaded
    checkpoint with the user's own files beside it is never replaced."""
    return (folder / EXPORT_MARKER).is_file()


def parser() -> argparse.ArgumentParser:
    exporting = [m for m in methods() if m.export is not None]
    p = ArgumentParser(prog="gorgon export", description="Export heads for a serving engine. " + " ".join(
        f"{m.title[0].upper() + m.title[1:]}: {m.export_help}." for m in exporting))
    p.add_argument("--heads", type=user_path, required=True, help="heads folder or hub id")
    p.add_argument("--format", required=True, choices=[f for m in exporting for f in m.export_formats],
                   help="the serving engine's layout: " + ", ".join(
                       f"{' or '.join(m.export_formats)} for {m.title}" for m in exporting))
    p.add_argument("--out", type=user_path, required=True, help="output folder")
    p.add_argument("--target", type=user_path, default=None,
                   help="the target (default: the one the heads' config.json records, "
                   "else the embedded SmolLM2); its lm_head is written out when the heads share it")
    p.add_argument("--base-model", default=None,
                   help="the target's name to record, which engines load (default: the target's; the embedded "
                        f"target's is {EMBEDDED_HUB_ID})")
    p.add_argument("--dtype", default=None, type=dtype_option,
                   help="the dtype the target loads in for the export and the weights are written in: float32 "
                        "(default, as trained; auto is the same here, on the CPU), bfloat16 (bf16: what engines "
                        "serve in, half the memory and the files) or float16 (fp16). An EAGLE head's config "
                        "records it as the draft's dtype, which SGLang runs the draft in and needs equal to the "
                        "served target's (default: the target's when the head trained)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the files of an earlier export at --out (other files there stay)")
    return p


def dtype_option(text: str) -> str:
    """--dtype: any name `resolve_dtype` takes (bf16, fp16 ... as the other commands do), checked as it is parsed."""
    try:
        resolve_dtype(text)
    except GorgonError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = Path(os.path.abspath(args.out))  # `.` has no name to stage the export beside it under
    if Path(args.heads).is_dir() and out.exists() and out.resolve() == Path(args.heads).resolve():
        raise GorgonError(f"--out {out} is the heads folder itself: choose another folder for the export")
    replace = check_output(out, is_export, args.overwrite)
    folder = resolve_heads_folder(args.heads)
    method = heads_method(folder)  # read from its config.json: a wrong --format fails before the target loads
    if args.format not in method.export_formats:
        exports = f"which export as {' or '.join(method.export_formats)}" if method.export_formats else \
            "which no engine format holds"
        raise GorgonError(f"{args.heads} holds {method.title}, {exports}, not {args.format}")
    target, heads = load_heads(folder, args.target, device="cpu", dtype=args.dtype or "float32")
    base_model = args.base_model or hub_name(target.name)  # what an engine loads as the target
    with staging(out, "exporting") as staged, full_disk_is_one_line(out):  # safetensors': a SafetensorError
        method.export(heads, args.format, staged, base_model, args.dtype and dtype_name(heads))
        written = sorted(str(f.relative_to(staged)) for f in staged.rglob("*") if f.is_file())
        atomic_write_text(staged / EXPORT_MARKER, json.dumps(written))
        if replace:
            replace_export(staged, out, written)
        else:
            move_into_place(staged, out, EXPORT_MARKER)
    print(f"gorgon export: wrote {args.format} heads to {out}")
    schedule = measured_schedule(folder)
    print(f"gorgon export: next, serve them: {method.serve(args.format, out, base_model, heads, schedule)}")
    if schedule:
        print(f"gorgon export: the draft length per batch size is the one `gorgon bench --batch-sizes` measured "
              f"({folder / 'metrics.json'}); vLLM takes it in its speculative config, SGLang, TensorRT-LLM, TGI and "
              "llama.cpp have no such setting", file=sys.stderr)
    if not is_hub_id(base_model):
        print(f"gorgon export: the export names its target by the local path {base_model}: an engine elsewhere "
              "needs a name it can load (--base-model user/name)", file=sys.stderr)
    for note in method.export_notes(folder):
        print(f"gorgon export: {note}", file=sys.stderr)
    return 0


def measured_schedule(folder: Path) -> list | None:
    """The draft length per batch size that `gorgon bench --batch-sizes --update-card` kept in the folder's
    metrics.json (vLLM's `num_speculative_tokens_per_batch_size`), or None."""
    try:
        return json.loads((folder / "metrics.json").read_text())["batch_bench"]["schedule"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def replace_export(staged: Path, out: Path, written: list[str]) -> None:
    """Put a new export's files (in `staged`) in place of the earlier export's at `out`, and remove the earlier
    ones the new export does not write (it may be in the other format); any other file there is the user's (a
    README, a serving config) and stays. The marker lists both until the swap is done, so a killed swap is
    replaced again by the next --overwrite."""
    try:
        earlier = json.loads((out / EXPORT_MARKER).read_text())
    except ValueError:  # an older gorgon's empty marker: which files there are the export's is not known
        raise GorgonError(f"--out {out} holds an export by an older gorgon, whose {EXPORT_MARKER} does not list its "
                          "files: remove the folder (after moving away any file of yours), or choose another --out"
                          ) from None
    clashes = [name for name in written if (out / name).exists() and name not in earlier]
    if clashes:
        raise GorgonError(f"--out {out} holds {clashes[0]}, which the earlier export did not write: move it away or "
                          "choose another --out")
    atomic_write_text(out / EXPORT_MARKER, json.dumps(sorted({*earlier, *written})))
    for name in written:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged / name, out / name)
    for name in set(earlier) - set(written):
        (out / name).unlink(missing_ok=True)
    os.replace(staged / EXPORT_MARKER, out / EXPORT_MARKER)
    shutil.rmtree(staged)
