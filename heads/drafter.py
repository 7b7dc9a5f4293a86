"""The drafter interface: what every drafting method gives the decoder.

A drafter has a `tree` (the shape of what it proposes) and `propose(root, hidden, context)`,
which returns one token per tree node, the root first. Verification and acceptance are
written once, in `gorgon.decode`, for every drafter; each method (gorgon.heads.medusa,
gorgon.heads.draft_model) implements this and nothing of the decoder.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .tree import Tree


class Drafter(Protocol):
    tree: Tree

    def propose(self, root: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Tokens for every tree node. root: the next token (scalar); hidden: the target's
        last hidden state at the last accepted token (H,); context: all tokens so far (n,)."""
