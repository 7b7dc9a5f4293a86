"""A draft model as a drafter: a greedy chain of tokens, or a tree grown by the draft's confidence."""

from __future__ import annotations

import copy

import torch

from ...cache import crop_cache, growing_cache, with_cache
from ...drafter import check_same_device, dtype_name
from ...errors import GorgonError
from ...masks import layer_masks
from ...search import SearchDrafter, check_search, grow_tree, search_settings
from ...tree import MAX_TREE_NODES
from .model import check_draft_vocab

# A longer chain is all but never accepted whole, and each drafted level costs a draft forward.
MAX_DRAFT_TOKENS = 64
DRAFT_TOKENS = 4  # levels drafted per step unless chosen


class DraftModelDrafter(SearchDrafter):
    """A small causal LM with the target's tokenizer drafts `k` levels a step with its own KV cache: with
    `topk` 1 a greedy chain of k tokens (classic draft-then-verify); with a larger `topk`, a tree of the
    draft's likeliest continuations, each level one forward over its `topk` best nodes (EAGLE-2's search,
    `gorgon.heads.search`), the best `nodes - 1` kept (default: all it drafts). The target verifies the
    tree in one forward and the same acceptance rules apply, so output stays exact.

    Between steps the draft's cache is cut back to the longest prefix it shares with the accepted
    tokens, and only the new tokens are fed: the accepted drafts and the bonus. Drafted levels are
    cut off after each step.

    `token_map`: the target ids of the draft's output rows when its output layer was cut to a draft
    vocabulary (`cut_to_draft_vocab`); None when it outputs the whole vocabulary. `level_cost`:
    `SearchDrafter.level_cost` (an unsure draft then spends no forwards on levels the target would reject).
    """

    feature_layers = None  # unused: the draft reads tokens only

    def __init__(self, draft_model, k: int = DRAFT_TOKENS, topk: int = 1, nodes: int | None = None,
                 token_map: torch.Tensor | None = None, level_cost: float = 0.0):
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise GorgonError(f"a draft model proposes 1 to {MAX_DRAFT_TOKENS} tokens per step, not {k}")
        self.nodes = nodes if nodes is not None else min(1 + k * topk, MAX_TREE_NODES)
        check_search(k, topk, self.nodes)
        rows, vocab = draft_model.get_output_embeddings().out_features, draft_model.config.get_text_config().vocab_size
        if token_map is None and rows != vocab:
            raise GorgonError(f"the draft's output layer has {rows} rows, not its vocabulary's {vocab}: pass the "
                              "token_map it was cut to")
        if token_map is not None and rows != len(token_map):
            raise GorgonError(f"the draft's output layer has {rows} rows but token_map names {len(token_map)} "
                              "tokens: cut it with cut_to_draft_vocab(draft, token_map)")
        self.token_map = None if token_map is None else torch.as_tensor(token_map, device=draft_model.device)
        self.model, self.depth, self.topk, self.level_cost = draft_model, k, topk, level_cost
        self.cache = None
        self.seen = torch.empty(0, dtype=torch.long, device=draft_model.device)  # tokens in self.cache

    def fresh(self) -> "DraftModelDrafter":
        """The same draft and search with an empty cache of its own: one per row of a batch."""
        twin = copy.copy(self)
        twin.cache, twin.seen = None, self.seen[:0]
        return twin

    def check_target(self, target_model) -> None:
        """Refuse a draft whose vocabulary differs from the target's (its token ids would mean other text), or on
        another device than the target (it takes the target's tokens where they are)."""
        check_draft_vocab(self.model, target_model)
        check_same_device(self.model, target_model, "the draft model")

    def settings(self) -> dict:
        return {"tree": search_settings(self.depth, self.topk, self.level_cost), "draft_dtype": dtype_name(self.model)}

    @torch.no_grad()
    def scored_paths(self, root: torch.Tensor, features: torch.Tensor,
                     context: torch.Tensor) -> list[tuple[list[int], float]]:
        """The step's best `nodes - 1` candidates, best first, parents before children: each a token path
        under the root with the product of the draft's probabilities along it."""
        model = self.model
        context = torch.cat([context, root.reshape(1)])
        n = min(self.seen.numel(), context.numel() - 1)  # always feed at least the newest token
        same = int((self.seen[:n] == context[:n]).cumprod(0).sum()) if n else 0
        if self.cache is None or same == 0:
            self.cache, same = growing_cache(), 0
        crop_cache(self.cache, same)
        logits = model(input_ids=context[same:][None], **with_cache(model, self.cache), use_cache=True,
                       logits_to_keep=1).logits[0, -1]  # no LM head over a re-fed prompt
        self.seen, committed = context, context.numel()
        fed = []  # each drafted level's positions in the cache, after the committed ones

        def expand(level, parent, tokens, sees):
            positions = torch.full_like(tokens, committed + level - 1)  # the root sits at committed - 1
            fed.append(positions)
            mask = layer_masks(model.config, sees[None, None], positions,
                               lambda: torch.cat([torch.arange(committed, device=positions.device), *fed]))
            out = model(input_ids=tokens[None], attention_mask=mask, position_ids=positions[None],
                        **with_cache(model, self.cache), use_cache=True)
            return out.logits[0].float().log_softmax(-1)

        first = logits.float().log_softmax(-1)
        to_target = None if self.token_map is None else self.token_map.__getitem__
        paths = grow_tree(first, expand, committed, self.depth, self.topk, self.nodes, model.dtype, to_target,
                          self.level_cost)
        crop_cache(self.cache, committed)
        return paths

    def level_trial(self, context: int):
        """One level of this drafter's search to time (`gorgon.decode.calibrate.drafted_level_cost`): `level()` is a
        forward of the draft over `topk` new tokens after `context` cached ones, and their log-probabilities;
        `reset()` cuts them off the cache again."""
        model = self.model
        prompt = torch.randint(0, model.config.get_text_config().vocab_size, (1, context + self.topk),
                               device=model.device)
        cache = growing_cache()
        model(input_ids=prompt[:, :context], **with_cache(model, cache), use_cache=True)

        def level():
            out = model(input_ids=prompt[:, context:], **with_cache(model, cache), use_cache=True)
            out.logits.float().log_softmax(-1)

        return level, lambda: crop_cache(cache, context)
