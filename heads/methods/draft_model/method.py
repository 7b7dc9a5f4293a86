"""A distilled draft model on the registry: how its folder is told apart, the files it writes, its card.

It trains through `train/draft.py` (trl's GKD), not `train/heads.py`, and decodes through `--draft`;
engines load its folder as it is, so it has no export.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import GorgonError
from ...files import is_model_config
from .. import Method, register
from .card import draft_card
from .model import DRAFT_VOCAB_NAME

# What its save writes beside the weights and a user might keep in a heads folder too: removed by --overwrite
# only where the folder holds a draft model.
TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def not_heads(folder: Path) -> GorgonError:
    """A model's folder passed where heads go: said as such, not as an unknown key of a heads config."""
    from ...files import read_config

    architectures = read_config(folder / "config.json")["architectures"]
    return GorgonError(f"{folder} holds a model ({', '.join(map(str, architectures))}), not heads: a draft model "
                      "goes to generate and bench as --draft (engines load its folder as it is, with no export), a "
                      "target as --target")


def holds(folder, config) -> bool:
    """A transformers model's folder; a speculators export (a draft for its verifier, which names its type) is
    the method's that imports it."""
    return is_model_config(config) and "speculators_model_type" not in config


METHOD = register(Method(
    name="draft_model", title="a draft model", holds=holds,
    not_heads=not_heads, files=(DRAFT_VOCAB_NAME,), model_files=TOKENIZER_FILES,
    card=lambda folder, ref, recipe, metrics, hub: draft_card(ref, recipe, metrics, hub),
))
