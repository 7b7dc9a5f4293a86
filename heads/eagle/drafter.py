"""The feature-level head as a drafter: a tree ranked by draft confidence, built anew each step (EAGLE-2).

Each step the head first takes in what the target accepted: the target's features at those
tokens, each paired with the token after it, go into the head's own KV cache (causal, like the
target's). From the last of them it drafts the first level: its `topk` most likely tokens. Each
further level expands the `topk` best nodes so far (by the product of draft probabilities along
their path) with their own `topk` children, for `depth` levels; the best `nodes - 1` nodes overall
become the tree (a child is never likelier than its parent, so they form one). Drafted levels are
cached only for the step and cut off after it: the cache holds the target's real features alone.

The tree's tokens are deterministic given the context, so the decoder's acceptance stays exact
under sampling (each candidate is a point-mass proposal).
"""

from __future__ import annotations

import torch

from ..errors import GorgonError
from ..target import crop_cache
from ..tree import build_tree
from .model import EagleHead, check_search


class EagleDrafter:
    def __init__(self, head: EagleHead, nodes: int | None = None, depth: int | None = None, topk: int | None = None):
        device_type = next(head.parameters()).device.type
        self.head = head
        self.nodes = nodes if nodes is not None else head.saved_tree(device_type)
        self.depth = depth if depth is not None else head.config.depth
        self.topk = topk if topk is not None else head.config.topk
        check_search(self.depth, self.topk, self.nodes)
        self.feature_layers = head.feature_layers
        self.cache, self.committed = None, 0

    @property
    def max_nodes(self) -> int:
        return self.nodes

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        dtype = self.head.fc.weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]

    @torch.no_grad()
    def propose(self, root: torch.Tensor, features: torch.Tensor, context: torch.Tensor):
        from transformers import DynamicCache

        head, device = self.head, root.device
        n, m = context.numel(), features.shape[0]
        start = n - m  # the cache must hold the context before the new features
        if self.cache is None or start == 0 or self.committed < start:
            if start != 0:
                raise GorgonError(f"the drafter holds {self.committed} tokens of context but was given features for "
                                  f"the last {m} of {n}: pass the features of every token accepted since its last "
                                  "call (the whole prompt at the first)")
            self.cache = DynamicCache()  # a new prompt
        crop_cache(self.cache, start)  # proposing again on the same context recommits its last tokens
        # 1. Take in the accepted tokens: the feature at p with the token at p + 1 (the root after the last).
        tokens = torch.cat([context[start + 1:], root.reshape(1)])
        positions = torch.arange(start, n, device=device)
        allowed = torch.ones(n - start, n, dtype=torch.bool, device=device)
        allowed[:, start:] = torch.ones(n - start, n - start, dtype=torch.bool, device=device).tril()
        out = head.layer(head.fc(features.to(head.fc.weight.dtype))[None], tokens[None], positions[None],
                         self._mask(allowed), self.cache)[0]
        self.committed = n
        # 2. Expand level by level from the last output. Node lists: parent node (-1: the root), draft token,
        #    log-probability of the path, and the output feature its children are drafted from.
        logp = head.logits(out[-1:]).float().log_softmax(-1)[0]
        score, token = logp.topk(min(self.topk, logp.numel()))
        token = head.to_target_ids(token)  # nodes hold target ids: the head embeds them as the target does
        parents = [-1] * score.numel()
        frontier = torch.arange(score.numel(), device=device)           # node ids to expand next
        frontier_feature = out[-1:].expand(score.numel(), -1)           # the feature each frontier node reads
        fed = []                                                         # cache slot of each expanded node
        node_tokens, node_scores = token, score
        for level in range(1, self.depth):
            k = frontier.numel()
            # A fed node sees the committed context, its expanded ancestors, and itself.
            seen = torch.zeros(k, n + len(fed) + k, dtype=torch.bool, device=device)
            seen[:, :n] = True
            for i, node in enumerate(frontier.tolist()):
                a = parents[node]
                while a >= 0:
                    seen[i, fed.index(a) + n] = True
                    a = parents[a]
                seen[i, n + len(fed) + i] = True
            fed += frontier.tolist()
            positions = torch.full((k,), n + level - 1, device=device)
            out = head.layer(frontier_feature[None], node_tokens[frontier][None], positions[None],
                             self._mask(seen), self.cache)[0]
            child = head.logits(out).float().log_softmax(-1)                              # (k, V_draft)
            best, ids = child.topk(min(self.topk, child.shape[-1]), dim=-1)
            total = (node_scores[frontier][:, None] + best).flatten()
            keep = total.topk(min(self.topk, total.numel())).indices
            new = len(parents) + torch.arange(keep.numel(), device=device)
            parents += frontier[keep // best.shape[1]].tolist()
            node_tokens = torch.cat([node_tokens, head.to_target_ids(ids.flatten()[keep])])
            node_scores = torch.cat([node_scores, total[keep]])
            frontier, frontier_feature = new, out[keep // best.shape[1]]
        crop_cache(self.cache, self.committed)
        # 3. The best nodes, parents before children (ties go to the shallower node), as a tree.
        depth_of = [0] * len(parents)
        for i, p in enumerate(parents):
            depth_of[i] = 1 if p < 0 else depth_of[p] + 1
        order = sorted(range(len(parents)), key=lambda i: (-float(node_scores[i]), depth_of[i]))
        chosen, paths = set(), {}
        for i in order:
            if len(chosen) >= self.nodes - 1:
                break
            if parents[i] < 0 or parents[i] in chosen:
                chosen.add(i)
        kids: dict[int, list[int]] = {}
        for i in sorted(chosen, key=lambda i: (-float(node_scores[i]), i)):
            kids.setdefault(parents[i], []).append(i)
        stack = [(-1, ())]
        while stack:
            node, path = stack.pop()
            for rank, kid in enumerate(kids.get(node, [])):
                paths[kid] = path + (rank,)
                stack.append((kid, paths[kid]))
        tree = build_tree([list(p) for p in paths.values()]).to(device)
        by_path = {p: node_tokens[i] for i, p in paths.items()}
        return torch.stack([root.reshape(())] + [by_path[p] for p in tree.paths]), tree
