"""`gorgon push`: upload a heads or draft folder to the Hugging Face Hub in one commit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .card import card_as_written, card_for_run
from .command import ArgumentParser, user_path
from .errors import GorgonError
from .files import read_config, reading_weights
from .hub import CONFIG_NAME, check_repo_id, upload_folder


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="gorgon push", description="Create the Hub repo if needed and upload a heads or draft "
                                "model folder (weights, config, trees, metrics, plot, model card) in one commit.")
    p.add_argument("--heads", type=user_path, required=True,
                   help="the folder to upload: heads, or a draft model, as training wrote it")
    p.add_argument("--repo-id", required=True, help="user/name on the Hub")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("--revision", default=None, help="branch to commit to (default: main)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    check_repo_id(args.repo_id, "--repo-id")  # before the Hub is asked
    folder = Path(args.heads)
    if not folder.exists():
        raise GorgonError(f"{folder} not found: pass the folder training wrote")
    if not folder.is_dir():
        raise GorgonError(f"{folder} is a file: pass the folder training wrote")
    if not (folder / CONFIG_NAME).is_file():
        raise GorgonError(f"{folder} is not a heads folder (no {CONFIG_NAME}): pass the folder training wrote")
    check_whole(folder)
    url = upload_folder(folder, args.repo_id, private=args.private, revision=args.revision,
                        replacing=card_for_the_repo(folder, args.repo_id))
    print(f"gorgon push: uploaded {folder} to {args.repo_id} ({url})")
    return 0


def check_whole(folder: Path) -> None:
    """Refuse a folder whose config.json or weights were cut short or edited into what no loader reads: the Hub
    would serve them to everyone who loads the repo. A weights file's header lists every tensor's bytes, so
    reading it finds a file cut short without reading the weights."""
    from safetensors import safe_open

    read_config(folder / CONFIG_NAME)
    for weights in sorted(folder.glob("*.safetensors")):
        with reading_weights(folder, weights.name), safe_open(weights, "pt"):
            pass


def card_for_the_repo(folder: Path, repo_id: str) -> dict[str, str] | None:
    """A training run's card names its folder in its commands; the repo gets it made again naming the repo. Only
    where README.md is the card as training (or `bench --update-card`) wrote it: a card the user edited goes up
    as it is, and the push says so."""
    card = card_for_run(folder, repo_id)
    if card is not None:
        return {"README.md": card}
    if (folder / "README.md").is_file() and (folder / "recipe.json").is_file():
        why = "was written by an earlier gorgon" if card_as_written(folder) is None else \
            "is not the card training wrote (edited?)"
        print(f"gorgon push: {folder / 'README.md'} {why}: it goes up as it is, naming what it names",
              file=sys.stderr)
    return None
