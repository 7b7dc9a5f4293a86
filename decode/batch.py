"""Speculative decoding of several requests at once: each row drafts its own tree, one target forward verifies all.

A server answers many requests together, and a batch changes what speculation is worth: the target's forward
over B rows already does B tokens' work, so candidates add to a product that is no longer nearly free, and
rows accept at their own rates. So each step decides from measurements, per row and for the batch:

- A row drafts only while its drafts pay for their drafting: its recent tokens gained per drafted step, at what
  a token costs in a plain batched step (`verify_costs` at this batch size over the rows), must outweigh the
  time its drafting took (timed as it runs: the step's drafting rows draft together where their drafter can,
  an EAGLE head one forward a level for all of them, each charged an equal share). A row that stops drafting
  takes plain steps (its tree is the root alone) and tries again every few steps.
- The batch verifies every row's best candidates up to one width: the width whose expected tokens over all rows
  (1 + the sum of each row's candidates' chances) per millisecond of a forward at that width is the highest.
  Where drafts cannot pay (many rows on a CPU), that is 1: a plain batched step.
- Both rest on estimates, so the batch also measures what its drafted steps give against its plain ones, with
  everything a step does (`Pace`), and stops drafting altogether while drafted steps lose.

Each row keeps what one-row decoding keeps (a fresh drafter of its own, `Drafter.fresh`; its context, root,
features and stop) and its own length in one KV cache: a row's entries sit at the cache's front, the rest up to
the longest row is room its mask hides (`gorgon.decode.verify.verify_batch`). Prompts are prefilled one by one,
as `generate` prefills a single prompt, then stacked; a finished row leaves the batch. Acceptance is the one-row
decoder's, row by row, so each row's output is what its own `speculative_generate` gives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gorgon.heads.cache import growing_cache, keep_rows, stacked_cache, with_cache
from gorgon.heads.drafter import scored_paths_of_rows
from gorgon.heads.errors import GorgonError
from gorgon.heads.target import Target, context_length, lm_logits
from gorgon.heads.tree import best_first, host_to_device, interpolate_cost, tree_from_token_paths

from .acceptance import Sampling, accept_greedy, accept_sampled, accept_typical, target_probs
from .argmax import target_argmax
from .attention import decoding_attention
from .calibrate import verify_costs
from .generate import (
    GenerationResult,
    StopRule,
    check_decoding,
    check_generate_kwargs,
    check_input_ids,
    check_prompt,
    chosen_sampling,
    default_new_tokens,
    next_token,
    speculative_generate,
    without_padding,
)
from .tau import CountingDrafter
from .verify import check_verifies_trees, features, keep_paths, verify_batch

# Plain steps after which a row that stopped drafting drafts again, to see whether it pays now: doubled after each
# try that did not pay (on many rows a try's drafting is what a row costs), back to the first after one that did.
RETRY, MOST_RETRY = 4, 64
MEMORY = 0.25  # weight of the newest step in a row's running averages


@dataclass
class BatchResult:
    """What one batched call produced (`rows`, in the prompts' order) and how it drafted: per target forward after
    the prefill, the tree width the batch verified (`widths`) and how many of its rows drafted (`drafting`)."""

    rows: list[GenerationResult]
    widths: list[int] = field(default_factory=list)
    drafting: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Row:
    """One request's decoding state."""

    drafter: object
    stop: StopRule
    context: torch.Tensor      # the tokens in its cache; root follows them
    features: torch.Tensor     # the target's features at the tokens accepted since its drafter last proposed
    root: torch.Tensor
    result: GenerationResult
    keep: int | None = None    # where its output ends, once known
    gain: float = 1.0          # tokens a drafted step added beyond a plain step's one (running average)
    draft_ms: float = 0.0      # its drafter's time a step (running average)
    idle: int = 0              # plain steps since it last drafted
    retry: int = RETRY         # plain steps before it tries drafting again

    def drafts(self, token_ms: float | None) -> bool:
        """Whether this step's drafts are likely to pay for their drafting (`token_ms`: what a token costs in a
        plain step of this batch; None: always draft)."""
        return token_ms is None or self.idle >= self.retry or self.pays(token_ms)

    def pays(self, token_ms: float) -> bool:
        return self.gain * token_ms >= self.draft_ms

    def drafted(self, emitted: int, token_ms: float | None) -> None:
        """After a step it drafted for, which emitted `emitted` tokens: its running gain, and when it tries again
        should that make it stop."""
        self.gain += MEMORY * (emitted - 1 - self.gain)
        if token_ms is not None:
            self.retry = RETRY if self.pays(token_ms) else min(2 * self.retry, MOST_RETRY)

    def candidates(self, scored: list[tuple[list[int], float]], ms: float) -> list[tuple[list[int], float]]:
        """Its drafter's candidates `scored` (which took `ms` of drafting), best first with parents before
        children, each with its chance. A candidate whose next token the output has no room for is left out (as
        one row does)."""
        self.draft_ms += MEMORY * (ms - self.draft_ms)
        self.idle = 0
        room = self.stop.max_new_tokens - len(self.result.tokens) - 1
        chance = {tuple(path): p for path, p in scored if len(path) <= room}
        return [(list(path), chance[path]) for path in best_first(chance, len(chance))]


def drafted_candidates(rows: list[Row], drafting: list[bool]) -> list[list[tuple[list[int], float]]]:
    """Each row's candidates, none for a row that does not draft this step: the drafting rows draft together
    (`scored_paths_of_rows`), and each is charged an equal share of the time."""
    chosen = [row for row, drafts in zip(rows, drafting) if drafts]
    for row, drafts in zip(rows, drafting):
        row.idle += not drafts
    if not chosen:
        return [[] for _ in rows]
    start = time.perf_counter()
    scored = iter(scored_paths_of_rows([row.drafter for row in chosen], [row.root for row in chosen],
                                       [row.features for row in chosen], [row.context for row in chosen]))
    ms = (time.perf_counter() - start) * 1000 / len(chosen)
    return [row.candidates(next(scored), ms) if drafts else [] for row, drafts in zip(rows, drafting)]


def batch_width(chances: list[list[float]], costs: dict[int, float] | None) -> int:
    """The nodes each row's tree gets (root included): the count whose expected tokens over all rows, 1 + the sum
    of each row's first candidates' chances, per unit of a forward's measured time at that width is the
    highest (ties to the narrower). Without costs, every candidate drafted."""
    most = 1 + max((len(c) for c in chances), default=0)
    if costs is None:
        return most
    best, best_rate = 1, 0.0
    for width in range(1, most + 1):
        expected = sum(1 + sum(c[:width - 1]) for c in chances)
        rate = expected / interpolate_cost(costs, width)
        if rate > best_rate:
            best, best_rate = width, rate
    return best


class Pace:
    """Whether the batch drafts at all this step: what its drafted steps have given, in tokens a second for each
    row, against its plain steps', both measured as it decodes (running averages). The per-row and per-width
    choices above come from estimates (draft chances, verify costs timed apart); this measures what they add up
    to with everything a step does, so a batch whose drafts do not pay takes plain steps, trying drafts again
    after RETRY plain steps, doubling to MOST_RETRY while they lose. Off (always drafting) without costs."""

    def __init__(self, on: bool):
        self.on, self.rate, self.wait, self.plain = on, {True: None, False: None}, RETRY, 0

    def drafts(self) -> bool:
        drafted, plain = self.rate[True], self.rate[False]
        if not self.on or drafted is None:
            return True   # drafts first,
        if plain is None:
            return False  # then a plain step, to compare
        return drafted >= plain or self.plain >= self.wait

    def record(self, drafted: bool, tokens: int, seconds: float, rows: int) -> None:
        rate, before = tokens / max(seconds, 1e-9) / rows, self.rate[drafted]
        self.rate[drafted] = rate if before is None else before + MEMORY * (rate - before)
        if drafted:
            self.plain = 0
            plain = self.rate[False]
            self.wait = RETRY if plain is None or self.rate[True] >= plain else min(2 * self.wait, MOST_RETRY)
        else:
            self.plain += 1


class BatchCosts:
    """Verify costs at each batch size a call meets (rows leave as they finish): measured once per machine
    (`gorgon.decode.calibrate.verify_costs`) at the starting size and the powers of two below it, each size
    using the smallest measured one at least as large. "measure" times them; a dict of dicts gives them
    ({batch: {nodes: ms}}); None sizes nothing: every row drafts and verifies its whole tree."""

    def __init__(self, model, batch: int, costs):
        if costs == "measure":
            sizes = sorted({batch} | {2 ** k for k in range(batch.bit_length()) if 2 ** k < batch})
            costs = {b: verify_costs(model, b) for b in sizes}
        self.costs = costs

    def at(self, batch: int) -> dict[int, float] | None:
        if self.costs is None:
            return None
        return self.costs[min((b for b in self.costs if b >= batch), default=max(self.costs))]


def check_batch(model, input_ids, attention_mask) -> None:
    """A (B, n) tensor of token ids with B >= 1, and a mask of its shape."""
    if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 and input_ids.shape[0] == 0:
        raise GorgonError("the batch is empty: give at least one prompt (input_ids of shape (B, n), B >= 1)")
    check_input_ids(model, input_ids, rows="many")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise GorgonError(f"attention_mask has shape {shape} but input_ids {tuple(input_ids.shape)}: pass the mask "
                          "the tokenizer gave with them (tokenizer(texts, padding=True, return_tensors='pt'))")


def check_batch_drafter(drafter) -> None:
    """Each row needs a drafter of its own and candidates ranked by chance; a self-speculation draft writes the
    target's own cache, which a batch's rows share."""
    if hasattr(drafter, "attach_cache"):
        raise GorgonError("self-speculation drafts in the target's own cache, which decodes one row at a time: "
                          "call speculative_generate for each prompt, or draft with a head")
    if not (callable(getattr(drafter, "fresh", None)) and callable(getattr(drafter, "scored_paths", None))):
        raise GorgonError(f"{type(drafter).__name__} cannot draft for a batch (it needs fresh() and "
                          "scored_paths(), as gorgon's drafters have): call speculative_generate for each prompt")


@torch.inference_mode()
def speculative_generate_batch(model, drafter, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                               max_new_tokens: int | None = None, sampling: Sampling | None = None,
                               acceptance: str = "exact", eos_token_id="default", stop_strings=(), tokenizer=None,
                               generator: torch.Generator | None = None, costs="measure", pace: Pace | None = None,
                               **generate_kwargs) -> BatchResult:
    """`speculative_generate` for a batch of prompts, `input_ids` (B, n) left-padded as a tokenizer pads them for
    `generate` (with their `attention_mask`): each row's output is its own `speculative_generate`'s. `drafter`
    is copied fresh for every row (`Drafter.fresh`). `costs`: what sizes the drafts (`BatchCosts`): "measure"
    (the default) times verify costs on this machine once and keeps them; None drafts every row's whole tree.
    `pace`: what drafted steps have given against plain ones (`Pace(on=True)`); a serving loop passes the same
    one to every call, so a call goes on from what the earlier ones measured instead of trying drafts afresh;
    None starts a new one. A batch of one is `speculative_generate`."""
    check_generate_kwargs(generate_kwargs)
    if isinstance(model, Target):
        model = model.model
    check_batch(model, input_ids, attention_mask)
    if input_ids.shape[0] == 1:  # the one-row decoder, its proposals counted
        counting = CountingDrafter(drafter)
        one = speculative_generate(model, counting, input_ids, max_new_tokens, sampling, acceptance, eos_token_id,
                                   stop_strings, tokenizer, generator, attention_mask=attention_mask)
        return BatchResult(rows=[one], widths=counting.nodes, drafting=[1] * len(counting.nodes), seconds=one.seconds)
    config = getattr(model, "generation_config", None)
    sampling = chosen_sampling(config, sampling, acceptance)
    check_batch_drafter(drafter)
    prompts = [without_padding(model, input_ids[b:b + 1], None if attention_mask is None else attention_mask[b:b + 1])
               for b in range(input_ids.shape[0])]
    if max_new_tokens is None:
        max_new_tokens = default_new_tokens(config, input_ids.shape[-1])
    for prompt in prompts:
        check_prompt(prompt, max_new_tokens, context_length(model))
    check_decoding(model, drafter, input_ids, generator)
    if eos_token_id == "default":
        eos_token_id = getattr(config, "eos_token_id", None)
    stop_strings = stop_strings or getattr(config, "stop_strings", None)
    layers = drafter.feature_layers
    sizing = BatchCosts(model, len(prompts), costs)
    pace = pace if pace is not None else Pace(on=costs is not None)

    with decoding_attention(input_ids.device):
        check_verifies_trees(model)
        start = time.perf_counter()
        rows, caches = [], []
        decoder = model.get_decoder()
        for prompt in prompts:  # each prefilled alone: exactly generate's prefill of one prompt
            caches.append(growing_cache())
            out = decoder(input_ids=prompt, **with_cache(decoder, caches[-1]), use_cache=True,
                          output_hidden_states=layers is not None)
            root = next_token(model, out.last_hidden_state[0, -1], sampling, generator)
            result = GenerationResult(tokens=[int(root)], target_forwards=1, accepted=[1])
            row = Row(drafter.fresh(), StopRule(max_new_tokens, eos_token_id, stop_strings, tokenizer), prompt[0],
                      features(out, layers), root, result)
            row.keep = row.stop.cut(result.tokens, 0)
            rows.append(row)
        lengths = [p.shape[1] for p in prompts]
        cache = stacked_cache(caches, lengths)
        del caches
        batch = BatchResult(rows=[row.result for row in rows])
        live = rows
        while True:
            still = [k for k, row in enumerate(live) if row.keep is None]
            if len(still) < len(live):  # finished rows leave the batch
                for row in live:
                    if row.keep is not None:
                        row.result.seconds = time.perf_counter() - start
                if not still:
                    break
                live, lengths = [live[k] for k in still], [lengths[k] for k in still]
                keep_rows(cache, still, max(lengths))
            costs_now = sizing.at(len(live))
            token_ms = costs_now[1] / len(live) if costs_now else None
            step_start = time.perf_counter()
            drafts = pace.drafts()
            drafting = [drafts and row.drafts(token_ms) for row in live]
            scored = drafted_candidates(live, drafting)
            width = batch_width([[p for _, p in s] for s in scored], costs_now)
            proposals = [tree_from_token_paths(row.root, [path for path, _ in s[:width - 1]])
                         for row, s in zip(live, scored)]
            past = cache.get_seq_length()
            out = verify_batch(model, cache, lengths, [t for t, _ in proposals], [tree for _, tree in proposals],
                               hidden_states=layers is not None)
            hidden = out.last_hidden_state
            if sampling.greedy:
                best = target_argmax(model, torch.cat([hidden[r, :tree.size] for r, (_, tree) in enumerate(proposals)]))
                best = best.split([tree.size for _, tree in proposals])
            paths = []
            for r, (row, (tokens, tree)) in enumerate(zip(live, proposals)):
                if sampling.greedy:
                    path, emitted = accept_greedy(tree, tokens, best[r])
                else:
                    accept = accept_typical if acceptance == "typical" else accept_sampled
                    path, emitted = accept(tree, tokens, target_probs(lm_logits(model, hidden[r, :tree.size]),
                                                                      sampling), generator)
                paths.append(path)
                nodes = host_to_device(torch.tensor(path), tokens.device)
                row.context = torch.cat([row.context, tokens[nodes]])
                new = features(out, layers, r)[nodes]
                row.features = new if drafting[r] else torch.cat([row.features, new])
                if drafting[r]:
                    row.drafted(len(emitted), token_ms)
                before = len(row.result.tokens)
                row.result.tokens.extend(emitted)
                row.keep = row.stop.cut(row.result.tokens, before)
                row.result.target_forwards += 1
                row.result.accepted.append(len(emitted))
                row.root = host_to_device(torch.tensor(emitted[-1]), tokens.device)
            keep_paths(cache, past, lengths, paths)
            lengths = [length + len(path) for length, path in zip(lengths, paths)]
            pace.record(any(drafting), sum(map(len, paths)), time.perf_counter() - step_start, len(live))
            batch.widths.append(width)
            batch.drafting.append(sum(drafting))
    for row in rows:  # the tokens a row's last step emitted past its end are not kept
        row.result.accepted[-1] -= len(row.result.tokens) - row.keep
        del row.result.tokens[row.keep:]
    batch.seconds = time.perf_counter() - start
    return batch
