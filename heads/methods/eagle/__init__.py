"""Feature-level draft heads (EAGLE-3's architecture, EAGLE-2's dynamic trees).

model.py: the head (features of a few target layers + the next token's embedding -> one decoder
layer of the target's own architecture -> draft logits), its config and folder; drafter.py: the
head as a drafter with its own KV cache and a confidence-ranked tree per step; objective.py: the
training loss; formats.py: the EAGLE-3 layout vLLM and SGLang load, and the speculators format.
"""

from . import method  # noqa: F401  (registers the method with gorgon.heads.methods)
from .drafter import EagleDrafter
from .model import EagleConfig, EagleHead

__all__ = ["EagleConfig", "EagleDrafter", "EagleHead"]
