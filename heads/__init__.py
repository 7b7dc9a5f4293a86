"""Targets and Medusa heads: loading, fingerprints, the heads module and its checkpoint format."""

from .errors import GorgonError
from .model import HeadsConfig, MedusaHeads, forward_with_heads
from .target import Target, fingerprint, load_target

__all__ = ["GorgonError", "HeadsConfig", "MedusaHeads", "Target", "fingerprint", "forward_with_heads", "load_target"]
