"""Speculative decoding with a tree of candidates verified in one target forward.

Method-agnostic: it knows drafters only through the interface in `gorgon.heads.drafter`
(the methods themselves live in gorgon.heads). Importing this package pulls in torch and
transformers only (no trl, datasets, peft, wandb).
"""

from .acceptance import Sampling
from .batch import BatchResult, speculative_generate_batch
from .generate import GenerationResult, speculative_generate
from .options import DecodeSettings, from_options

__all__ = ["BatchResult", "DecodeSettings", "GenerationResult", "Sampling", "from_options", "speculative_generate",
           "speculative_generate_batch"]
