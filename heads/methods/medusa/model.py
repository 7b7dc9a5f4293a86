"""Medusa heads: K small residual MLPs on the target's last hidden state.

Head k, read at position t, predicts token t+k+2 (the target's own lm_head predicts t+1).
Each head is `num_layers` blocks of x + SiLU(Linear(x)) followed by an LM head, which by
default is the target's own (shared, not saved: SmolLM2's is 28M weights, Qwen2.5-7B's 545M).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...card import short_card
from ...errors import GorgonError, config_from_dict
from ...files import atomic_write_text, is_model_config, read_config, reading_weights, write_weights
from ...hub import CONFIG_NAME, PushToHubMixin, resolve_heads_folder
from ...outputs import check_heads_destination
from ...target import attach_to_target, check_fits, lm_logits
from ...tree import expected_accepted, tree_from_accuracies
from ...vocab import is_draft_vocab
from .formats import foreign_format, import_heads

WEIGHTS_NAME = "model.safetensors"
TREES_NAME = "trees.json"
ADAPTER_DIR = "adapter"  # Medusa-2: the target's LoRA adapter, saved beside the heads
# trees.json: the tree for each device type, and the measured accuracies that build trees of any size
TREE_DEVICES = ("cpu", "cuda")
NODES = {"cpu": 16, "cuda": 64}  # tree nodes per step by device type, unless training or the user chose others
ACCURACIES = "accuracies"


@dataclass
class MedusaConfig:
    """Everything needed to rebuild the heads and to check they fit a target."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True
    target_name: str | None = None
    target_fingerprint: str | None = None
    draft_vocab_size: int | None = None  # heads draft from this many frequent tokens (None: all)

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "MedusaConfig":
        return config_from_dict(cls, data, source, "a gorgon Medusa heads config")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(Wx + b). W starts at zero, so an untrained head passes the hidden state through."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(PushToHubMixin, nn.Module):
    """The K draft heads. Call `attach(target_model)` before use when the lm_head is shared."""

    # They read the target's hidden states and may share its lm_head: they keep the target's dtype.
    drafts_in_own_dtype = False

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)])
            for _ in range(config.num_heads)
        )
        self.lm_heads = None if config.shared_lm_head else nn.ModuleList(
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
        )
        object.__setattr__(self, "_target", None)  # not a submodule: never saved, moved or trained
        self.trees: dict[str, list] = {}
        # The draft vocabulary (as vLLM's token_map): token ids the heads propose from. Drafting
        # over the most frequent tokens only makes the heads' projection several times cheaper;
        # acceptance still checks every draft against the target, so output is unchanged.
        size = config.draft_vocab_size
        self.register_buffer("token_map", torch.zeros(size, dtype=torch.long) if size else None)
        object.__setattr__(self, "_draft_rows", (None, None))  # (what they were sliced from, the rows)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft from these token ids only (e.g. the most frequent in the training data)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).sort().values
        if not is_draft_vocab(ids, self.config.vocab_size):
            repeated = int(ids.numel() - ids.unique().numel())
            raise GorgonError(f"a draft vocabulary lists token ids from 0 to {self.config.vocab_size - 1}, each "
                              f"once: these {ids.numel()} ids have {repeated} repeated or lie outside")
        self.config.draft_vocab_size = int(ids.numel())
        self.token_map = ids.to(self.blocks[0][0].linear.weight.device)

    # -- the target ---------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target_model: nn.Module, num_heads: int = 4, num_layers: int = 1,
                   shared_lm_head: bool = True, target_name: str | None = None,
                   target_fingerprint: str | None = None) -> "MedusaHeads":
        """Fresh heads shaped for a target; per-head LM heads start as copies of the target's."""
        cfg = target_model.config.get_text_config()
        heads = cls(MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_heads=num_heads,
                                num_layers=num_layers, shared_lm_head=shared_lm_head,
                                target_name=target_name, target_fingerprint=target_fingerprint))
        lm_head = target_model.get_output_embeddings()
        heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        if heads.lm_heads is not None:
            for head in heads.lm_heads:
                head.weight.data.copy_(lm_head.weight.data)
        heads.attach(target_model)
        return heads

    def attach(self, target_model: nn.Module, fingerprints: tuple[str, ...] = ()) -> "MedusaHeads":
        """Check these heads fit `target_model` and bind its lm_head. Refuses another target."""
        check_fits(self.config, target_model.config.get_text_config(), fingerprints)
        object.__setattr__(self, "_target", target_model)
        return self

    # -- trees.json: decoding trees built from the heads' measured accuracies ----------------
    def set_trees(self, accuracies: list[list[float]], sizes: dict[str, int]) -> None:
        """Keep the measured per-head rank accuracies and the best tree of each device's size (`sizes`:
        device type -> nodes); the accuracies also build trees of other sizes later."""
        self.trees = {device: tree_from_accuracies(accuracies, size) for device, size in sizes.items()}
        self.trees[ACCURACIES] = accuracies

    @property
    def accuracies(self) -> list[list[float]] | None:
        """Per head, the measured chance that each rank is the right token (None when never measured)."""
        return self.trees.get(ACCURACIES)

    def level_accuracies(self, depth: int | None = None) -> list[list[float]]:
        """Held-out rank accuracies per drafted level (for choosing a tree size): head k's for level k, the
        first `depth` levels (default: every head's)."""
        return (self.accuracies or [])[: depth or self.config.num_heads]

    def saved_tree(self, device_type: str) -> list[list[int]] | None:
        """The tree saved for this device type (else the CPU one), or None."""
        return self.trees.get(device_type) or self.trees.get("cpu")

    def expected_tau(self, device_type: str) -> float:
        """Tokens per step the saved tree should give, from the measured accuracies (heads right independently)."""
        return expected_accepted(self.accuracies or [], self.saved_tree(device_type) or [])

    @property
    def target(self) -> nn.Module | None:
        """The target model these heads are attached to (its lm_head is theirs when shared)."""
        return self._target

    # -- compute ------------------------------------------------------------------------------
    def head(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of head k alone over its draft vocabulary (..., draft_vocab_size or V), the
        vocabulary it drafts from and trains on. Training computes heads one at a time to bound memory."""
        h = self.blocks[k](hidden)
        if self.lm_heads is not None:
            weight = self.lm_heads[k].weight
            return nn.functional.linear(h, weight if self.token_map is None else weight[self.token_map])
        if self._target is None:
            raise GorgonError("these heads share the target's lm_head: call heads.attach(target_model) first")
        return lm_logits(self._target, h, self.token_map)

    def lm_head_weight(self, k: int) -> torch.Tensor:
        """Head k's LM head weight (V, H): its own, or the target's when shared."""
        if self.lm_heads is not None:
            return self.lm_heads[k].weight
        if self._target is None:
            raise GorgonError("these heads share the target's lm_head: call heads.attach(target_model) first")
        return self._target.get_output_embeddings().weight

    @torch.no_grad()
    def draft_topk(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Each head's k most likely token ids (num_heads, ..., k), from the draft vocabulary."""
        if self.token_map is None:
            return self(hidden).topk(k, dim=-1).indices
        states = torch.stack([block(hidden) for block in self.blocks])         # (K, ..., H)
        weights = self.draft_rows().to(states.dtype)
        if weights.shape[0] == 1:
            logits = states @ weights[0].T
        else:
            logits = torch.einsum("k...h,kvh->k...v", states, weights)
        return self.token_map[logits.topk(k, dim=-1).indices]

    def draft_rows(self) -> torch.Tensor:
        """The LM head rows of the draft vocabulary (one per head, or one shared), sliced once and sliced
        again only when their source changed: other weights (a move, another target) or new values
        (a training step, a load: in-place writes bump a tensor's version; an inference tensor has none)."""
        sources = [self.lm_head_weight(k) for k in (range(self.config.num_heads) if self.lm_heads is not None else [0])]
        key = [(t.data_ptr(), t.device, None if t.is_inference() else t._version) for t in (*sources, self.token_map)]
        if self._draft_rows[0] != key:
            object.__setattr__(self, "_draft_rows", (key, torch.stack([w[self.token_map] for w in sources])))
        return self._draft_rows[1]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head logits for hidden states (..., H): shape (num_heads, ..., V)."""
        states = torch.stack([block(hidden) for block in self.blocks])
        if self.lm_heads is not None:
            return torch.stack([lm_head(h) for lm_head, h in zip(self.lm_heads, states)])
        if self._target is None:
            raise GorgonError("these heads share the target's lm_head: call heads.attach(target_model) first")
        # One product for all heads: the vocabulary projection reads its weights once, not K times.
        return lm_logits(self._target, states)

    # -- save / load / push -------------------------------------------------------------------
    def model_card(self, repo_id: str) -> str:
        """The card `push_to_hub` gives a repo without one."""
        return short_card(repo_id, self.config.target_name, "Medusa heads", "medusa")

    def save_pretrained(self, path: str | os.PathLike, state_dict: dict | None = None) -> None:
        """Write config.json, model.safetensors and trees.json (each atomically); a folder holding another
        model is refused. `state_dict`: the weights to write instead of the module's own (training gathers
        them whole from shards)."""
        path = Path(path)
        check_heads_destination(path, WEIGHTS_NAME)
        write_weights(path, state_dict or self.state_dict(), self.config.to_dict(), WEIGHTS_NAME)
        if self.trees:
            atomic_write_text(path / TREES_NAME, json.dumps(self.trees, indent=1) + "\n")
        else:  # the trees of heads saved here before would be read as these heads'
            (path / TREES_NAME).unlink(missing_ok=True)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, target=None, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None) -> "MedusaHeads":
        """Load heads from a folder or hub id; with `target` check and attach it (a `Target` is also
        checked by fingerprint; a bare model by shape only). Folders in vLLM's or FasterDecoding
        Medusa's format are read too (see `gorgon.heads.methods.medusa.formats`)."""
        from safetensors.torch import load_file

        folder = resolve_heads_folder(name_or_path)
        config_path = folder / CONFIG_NAME
        data = read_config(config_path)
        fmt = foreign_format(folder, data)
        with reading_weights(folder, WEIGHTS_NAME):
            if fmt:
                fields, state = import_heads(folder, data, fmt)
                heads = cls(MedusaConfig(**fields))
            else:
                check_not_a_model(folder, data)
                heads = cls(MedusaConfig.from_dict(data, source=str(config_path)))
                state = load_file(folder / WEIGHTS_NAME)
            heads.load_state_dict(state)
        if (folder / TREES_NAME).is_file():
            heads.trees = read_trees(folder / TREES_NAME)
        return attach_to_target(heads, target, device, dtype)


def check_not_a_model(folder: Path, data) -> None:
    """A model's folder (a draft model, the target) passed as heads: said as such, not as an unknown key of
    the heads' config."""
    if is_model_config(data) and foreign_format(folder, data) is None:
        raise GorgonError(f"{folder} holds a model ({', '.join(map(str, data['architectures']))}), not heads: a draft "
                          "model goes to generate and bench as --draft (engines load its folder as it is, with no "
                          "export), a target as --target")


def read_trees(path: Path) -> dict:
    """trees.json: {"cpu": paths, "cuda": paths, "accuracies": per-head rank accuracies}; a malformed one is an
    error naming the file (the paths themselves are checked when a tree is built from them)."""
    try:
        trees = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise GorgonError(f"{path} is not valid JSON ({err.__class__.__name__}): delete it to use the default tree, "
                          "or re-save the heads") from err
    shaped = isinstance(trees, dict) and set(trees) <= {*TREE_DEVICES, ACCURACIES} and all(
        isinstance(v, list) and all(isinstance(x, list) and all(isinstance(r, (int, float)) for r in x) for x in v)
        for v in trees.values())
    if not shaped:
        raise GorgonError(f"{path} must map {', '.join(map(repr, (*TREE_DEVICES, ACCURACIES)))} to lists of number "
                          "lists: delete it to use the default tree, or re-save the heads")
    return trees


