"""Continuous batching for `gorgon data`: finished rows leave the batch, waiting prompts take their place.

Why not transformers' own `generate_batch` (paged KV cache)? On the CPU it runs and is exact,
but it was about 25x slower than plain `generate` on a tiny model (5 prompts, 40 tokens:
14.4 s against 0.58 s, transformers 5.23, one thread): its scheduler and paged cache are built
for accelerators. This loop keeps the model's own forward and a transformers `Cache`; the only
thing it does to the cache is move whole rows: rows are dropped when they finish,
and newly prefilled rows are left-padded to the batch's width and appended. Padding is masked
and each row gets its own `position_ids`, so a row's logits are those of the prompt alone. Every
layer keeps every token (no sliding-window cache) and the model's mask applies the window
(tested on Mistral, Gemma 2 and Gemma 3).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from gorgon.heads.cache import growing_layer_class, with_cache


class BatchLayer(growing_layer_class()):
    """A growing cache layer (`gorgon.heads.cache.growing_layer_class`: a decoding step writes its tokens in
    place, where `DynamicLayer` concatenates, copying the whole cache every step, which for 32 rows is as much
    memory traffic as the weights: embedded target, 32 rows x 300 tokens, one thread: 275 -> 246 ms a step)
    whose batch rows the continuous batch replaces."""

    ROOM = 64  # spare time slots left after the rows a rebuild holds

    def replace_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> None:
        """Hold these rows ((heads, time, dim) keys and values each), left-padded with zeros to `width`.

        Row by row, so each kept row is copied once however rows are dropped, trimmed or added."""
        k0, v0 = rows[0]
        self._key_room = k0.new_empty(len(rows), k0.shape[0], width + self.ROOM, k0.shape[-1])
        self._value_room = v0.new_empty(len(rows), v0.shape[0], width + self.ROOM, v0.shape[-1])
        for j, (k, v) in enumerate(rows):
            pad = width - k.shape[-2]
            self._key_room[j, :, :pad], self._value_room[j, :, :pad] = 0, 0  # masked, but must not be NaN
            self._key_room[j, :, pad:width], self._value_room[j, :, pad:width] = k, v
        self.keys, self.values = self._key_room[..., :width, :], self._value_room[..., :width, :]


PREFILL_SLACK = 0.1


def _left_pad(t: torch.Tensor, width: int, dim: int, value=0) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([torch.full(shape, value, dtype=t.dtype, device=t.device), t], dim=dim)


def _rebuild(cache: Cache, keep: list[int], start: int, new: list[Cache], width: int) -> None:
    """The next batch's cache: rows `keep` of `cache` from column `start` on, then every row of
    the `new` caches, each left-padded to `width`. Rows that finished are dropped here rather than
    when they finish, so that dropping and admitting cost one copy of the cache, not several."""
    for i, layer in enumerate(cache.layers):
        rows = [(layer.keys[r, :, start:], layer.values[r, :, start:]) for r in keep]
        for c in new:
            rows += list(zip(c.layers[i].keys, c.layers[i].values))
        layer.replace_rows(rows, width)


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Split prompts (ascending length) into runs prefilled together, each padded by at most
    PREFILL_SLACK of its tokens: MT-Bench prompts in batches of 32 were 40% padding, and padding
    costs as much to prefill as a prompt token, while one prompt alone costs only 1.13x per token."""
    groups: list[list[int]] = []
    for j, n in enumerate(lengths):
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * n <= (1 + PREFILL_SLACK) * (sum(lengths[k] for k in g) + n):
            g.append(j)
        else:
            groups.append([j])
    return groups


def continuous_generate(model, prompts: list[list[int]], *, max_new_tokens: int, eos: set[int], pad: int,
                        batch_size: int, batch_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                        seeds: list[int] | None = None, on_done=None) -> list[list[int]]:
    """Completions (EOS dropped) for token-id prompts, in the given order.

    At most `batch_size` rows run at once, and at most `batch_tokens` cache slots (rows x width);
    whenever rows finish, waiting prompts (shortest first) are prefilled together and join.
    Sampling draws each prompt's tokens from its own generator, seeded by `seeds` (one per
    prompt), so an answer does not depend on which prompts shared its batch.
    `on_done(n_prompts, n_tokens)` is called after each step in which rows finished.
    """
    warpers = [TemperatureLogitsWarper(temperature)] + ([TopPLogitsWarper(top_p)] if top_p < 1 else []) \
        if temperature > 0 else []
    device = model.device
    if warpers and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("sampling needs one seed per prompt")
    generators = [torch.Generator(device).manual_seed(s) for s in seeds] if warpers else []
    waiting = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)  # pop() gives the shortest
    out: list[list[int]] = [[] for _ in prompts]
    rows: list[int] = []          # prompt index of each batch row
    cache = mask = None            # Cache and (rows, width) attention mask of the running batch
    stale = None                   # when rows finished: (cache rows still running, first column in use)
    next_tok = torch.empty(0, dtype=torch.long, device=device)
    while waiting or rows:
        admit = []
        while waiting and len(rows) + len(admit) < batch_size:
            width = max([len(prompts[i]) for i in admit + [waiting[-1]]] + [mask.shape[1] if rows else 0])
            if (rows or admit) and (len(rows) + len(admit) + 1) * (width + max_new_tokens) > batch_tokens:
                break
            admit.append(waiting.pop())
        if admit:
            caches, masks, logits = [], [], []
            for group in _length_groups([len(prompts[i]) for i in admit]):
                group_mask, group_cache, group_logits = _prefill(model, [prompts[admit[j]] for j in group], pad)
                caches.append(group_cache)
                masks.append(group_mask)
                logits.append(group_logits)
            first = _choose(torch.cat(logits).float(), warpers, [generators[i] for i in admit] if warpers else [])
            width = max(m.shape[1] for m in masks + ([mask] if rows else []))
            if rows:
                _rebuild(cache, *(stale or (range(len(rows)), 0)), caches, width)
            else:  # the first group starts the batch and the others join it
                cache = caches[0]
                if len(caches) > 1:
                    _rebuild(cache, range(len(masks[0])), 0, caches[1:], width)
            mask = torch.cat([_left_pad(m, width, 1) for m in ([mask] if rows else []) + masks])
            stale = None
            next_tok = torch.cat([next_tok, first])
            fresh = len(rows)  # only the new rows have a new token; the others wait for the next step
            rows += admit
        else:
            if stale:
                _rebuild(cache, *stale, [], mask.shape[1])
                stale = None
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=device)], dim=1)
            logits = model(next_tok[:, None], attention_mask=mask, position_ids=mask.sum(1, keepdim=True) - 1,
                           **with_cache(model, cache), use_cache=True).logits[:, -1]
            next_tok = _choose(logits.float(), warpers, [generators[i] for i in rows] if warpers else [])
            fresh = 0
        # next_tok holds each row's newest token, not yet in the cache
        finished = []
        for r, (i, t) in enumerate(zip(rows, next_tok.tolist())):
            if r < fresh:
                continue
            if t in eos:
                finished.append(r)
            else:
                out[i].append(t)
                if len(out[i]) >= max_new_tokens:
                    finished.append(r)
        if finished:
            keep = [r for r in range(len(rows)) if r not in set(finished)]
            if on_done:
                on_done(len(finished), sum(len(out[rows[r]]) for r in finished))
            rows = [rows[r] for r in keep]
            if rows:
                keep_t = torch.tensor(keep, device=device)
                mask, next_tok = mask[keep_t], next_tok[keep_t]
                start = int((mask.sum(0) > 0).nonzero()[0])  # columns that are padding in every row go
                mask = mask[:, start:]
                stale = (keep, start)
            else:
                cache = mask = None
                next_tok = next_tok[:0]
    return out


def _prefill(model, prompts: list[list[int]], pad: int):
    """Left-padded prompts through the model: their mask, their new cache and their last logits."""
    device, width = model.device, max(map(len, prompts))
    ids = torch.stack([_left_pad(torch.tensor(p, device=device), width, 0, pad) for p in prompts])
    mask = torch.stack([_left_pad(torch.ones(len(p), dtype=torch.long, device=device), width, 0) for p in prompts])
    cache = Cache(layer_class_to_replicate=BatchLayer)
    logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), **with_cache(model, cache),
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    return mask, cache, logits


def _choose(logits: torch.Tensor, warpers, generators: list[torch.Generator]) -> torch.Tensor:
    """Greedy, or one draw per row from that row's own generator."""
    if not warpers:
        return logits.argmax(-1)
    for w in warpers:
        logits = w(None, logits)
    probs = torch.softmax(logits, -1)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])
