"""Self-speculation: the target's own first N layers draft, with one set of weights and one KV cache.

model.py: the trained exit (an adapter before the target's own norm and LM head) and its folder;
drafter.py: the tree grown by the target's first layers in the target's own cache; objective.py: the
exit's training loss; method.py: its registration; card.py: its model card. The span of the target's
layers that drafting and verification each run is `gorgon.heads.layers`.
"""

from . import method  # noqa: F401  (registers the method with gorgon.heads.methods)
from .drafter import SelfSpecDrafter
from .model import EarlyExit, SelfSpecConfig

__all__ = ["EarlyExit", "SelfSpecConfig", "SelfSpecDrafter"]
