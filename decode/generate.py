"""The speculative generation loop: propose a tree, verify it in one forward, accept, compact the cache.

State between steps: the KV cache holds every accepted token except the newest one (`root`),
whose value the target already chose; `fresh` are the target's features (hidden states) at the
tokens accepted by the last step, which the drafter reads. One step then emits the accepted
candidates plus one bonus token from the target itself, so each target forward yields at least
one token.
"""

from __future__ import annotations

import copy
import numbers
import time
import warnings
from dataclasses import dataclass, field

import torch

from gorgon.heads.cache import growing_cache, with_cache
from gorgon.heads.drafter import Drafter
from gorgon.heads.errors import GorgonError
from gorgon.heads.quantize import quantization
from gorgon.heads.target import Target, context_length, fits_context, lm_logits
from gorgon.heads.tree import cut_tree, host_to_device

from .acceptance import Sampling, accept_greedy, accept_sampled, accept_typical, target_probs
from .argmax import target_argmax
from .attention import decoding_attention, rows_alone
from .verify import accepted_rows, check_verifies_trees, features, keep_path, verify

ACCEPTANCE_RULES = ("exact", "typical")


@dataclass
class GenerationResult:
    """What one call produced and what it cost."""

    tokens: list[int]                                   # the new tokens, prompt excluded
    target_forwards: int                                # prefill included
    accepted: list[int] = field(default_factory=list)   # tokens emitted by each target forward
    seconds: float = 0.0
    verified_rows: int = 0   # tree nodes verified (counted where a self-speculation draft shares the cache)
    reused_rows: int = 0     # of those, nodes whose first layers verification took from the draft

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (the bonus token included)."""
        return len(self.tokens) / max(1, self.target_forwards)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def check_stop_strings(strings: list[str]) -> None:
    """An empty stop string matches at once (`gorgon generate --stop ''` or `stop_strings=[""]`)."""
    if "" in strings:
        raise GorgonError("an empty stop string (--stop '') would end the output at its first token: drop it, or "
                          "give the text to stop at")


class StopRule:
    """Decides where output ends, as `generate` does: after an EOS token, after the token that completes
    a stop string, or at max_new_tokens, whichever comes first. (A stop string is looked for in the new
    text only: `generate` also ends on one that begins in the prompt.)"""

    def __init__(self, max_new_tokens: int, eos_token_id=None, stop_strings=(), tokenizer=None):
        strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings or ()
        if not isinstance(strings, (list, tuple, set)) or not all(isinstance(s, str) for s in strings):
            raise GorgonError(f"stop_strings must be text (a string or a list of them), not {stop_strings!r}")
        self.stop_strings = list(strings)
        check_stop_strings(self.stop_strings)
        if self.stop_strings and tokenizer is None:
            raise GorgonError("stop strings (given, or in the model's generation_config) need the tokenizer: pass "
                              "tokenizer=...")
        self.max_new_tokens = max_new_tokens
        if isinstance(eos_token_id, torch.Tensor):
            eos_token_id = eos_token_id.flatten().tolist()
        eos = eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]
        if not all(e is None or (isinstance(e, numbers.Integral) and not isinstance(e, bool)) for e in eos):
            raise GorgonError(f"eos_token_id must be token ids, not {eos_token_id!r}: a token's id is "
                              "tokenizer.convert_tokens_to_ids(token)")
        self.eos = {int(e) for e in eos if e is not None}
        self.tokenizer = tokenizer

    def cut(self, tokens: list[int], start: int) -> int | None:
        """Given all new tokens and where this step's began, the length to keep if output ends here."""
        for i in range(start, len(tokens)):
            if tokens[i] in self.eos or i + 1 >= self.max_new_tokens or self._completes_stop_string(tokens, i):
                return i + 1
        return None

    def _completes_stop_string(self, tokens: list[int], i: int) -> bool:
        if not self.stop_strings:
            return False
        # A character split over byte-level tokens decodes as U+FFFD until its last byte: without those,
        # `before` ends where the completed text may first differ from it.
        before = self.tokenizer.decode(tokens[:i]).rstrip("\ufffd")
        text = self.tokenizer.decode(tokens[: i + 1])
        return any(s in text and text.rfind(s) + len(s) > len(before) for s in self.stop_strings)


# generation_config keys that do not change which tokens `generate` picks (ids, caching, output format, beam
# scoring, assisted decoding's own settings) or that gorgon applies itself (EOS, stop strings, length; when
# sampling, temperature, top-k and top-p come from `Sampling`). Any other key set to other than its default is
# a setting gorgon does not apply: a list of those to allow, so that a setting a later transformers adds is
# named too, not skipped in silence.
APPLIED_OR_NEUTRAL = {
    "eos_token_id", "max_length", "max_new_tokens", "stop_strings", "pad_token_id", "bos_token_id",
    "decoder_start_token_id", "do_sample", "temperature", "top_k", "top_p", "use_cache", "cache_implementation",
    "cache_config", "max_cache_len", "compile_config", "disable_compile", "low_memory", "prefill_chunk_size",
    "continuous_batching_config", "return_dict_in_generate", "output_attentions", "output_hidden_states",
    "output_scores", "output_logits", "remove_invalid_values", "renormalize_logits", "transformers_version",
    "_from_model_config", "early_stopping", "length_penalty", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
    "assistant_early_exit", "prompt_lookup_num_tokens", "max_matching_ngram_size", "speculation_type"}
# "Off" for the keys transformers' defaults leave at None although None would not switch them off in `generate`.
OFF = {"min_new_tokens": 0}


def neutral_value(key: str):
    """A generation setting's value when it changes nothing: transformers' default, else None."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    return OFF.get(key, defaults.get(key))


def generation_settings_not_applied(model) -> list[str]:
    """The settings of the model's generation_config that `generate` would apply and gorgon does not
    (a repetition penalty, beam search, suppressed tokens, ...), sorted."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return []
    return sorted(key for key, value in config.to_dict().items()
                  if key not in APPLIED_OR_NEUTRAL and value is not None and value != neutral_value(key))


def generation_config_as_applied(model):
    """A copy of the model's generation_config with the settings gorgon does not apply set to their neutral
    values, for the bench's baseline. (Those whose neutral value is None stay: `generate` fills a None
    from the model's own config.)"""
    config = copy.deepcopy(model.generation_config)
    for key in generation_settings_not_applied(model):
        if neutral_value(key) is not None:
            setattr(config, key, neutral_value(key))
    return config


def check_input_ids(model, input_ids: torch.Tensor, rows: str = "one") -> None:
    """A tensor of one row (`rows` "one") or of several ("many") of the model's token ids, on its device: what
    the padding is read from."""
    shape = "(1, n)" if rows == "one" else "(B, n)"
    if not isinstance(input_ids, torch.Tensor):
        raise GorgonError(f"input_ids must be a tensor of shape {shape} (tokenizer(text, return_tensors='pt')"
                          f"['input_ids']), not a {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise GorgonError(f"input_ids must be token ids (an integer tensor), not {input_ids.dtype}: "
                          "tokenizer(text, return_tensors='pt')['input_ids'] gives them")
    if input_ids.ndim != 2 or (rows == "one" and input_ids.shape[0] != 1):
        raise GorgonError(f"input_ids must have shape {shape}, got {tuple(input_ids.shape)}: "
                          + ("speculative_generate decodes one sequence; speculative_generate_batch decodes several"
                             if rows == "one" else "one row of token ids per prompt"))
    embeddings = model.get_input_embeddings().weight
    if input_ids.device != embeddings.device:
        raise GorgonError(f"input_ids are on {input_ids.device} but the model's embeddings on {embeddings.device}: "
                          f"move the prompt there (input_ids.to('{embeddings.device}'))")
    vocab = embeddings.shape[0]
    outside = input_ids[(input_ids < 0) | (input_ids >= vocab)]
    if outside.numel():
        raise GorgonError(f"input_ids holds {int(outside[0])}, which is no token of the model's vocabulary (0 to "
                          f"{vocab - 1}): encode the prompt with the target's own tokenizer")


def check_prompt(input_ids: torch.Tensor, max_new_tokens: int, context: int | None) -> None:
    """The prompt without its padding: not empty, and room in the context for the reply."""
    if input_ids.shape[1] == 0:
        raise GorgonError("the prompt is empty: give at least one token (a chat template adds some)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
        raise GorgonError(f"max_new_tokens must be a whole number of at least 1, got {max_new_tokens!r}")
    if not fits_context(context, input_ids.shape[1], max_new_tokens):
        raise GorgonError(f"the prompt ({input_ids.shape[1]} tokens) plus max_new_tokens ({max_new_tokens}) exceeds "
                          f"the target's context of {context}: shorten the prompt or lower max_new_tokens")


def without_padding(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The prompt without its left padding, which `generate` masks out: the positions `attention_mask` leaves
    out, or, without one, leading pad tokens (as `generate` infers the mask from pad_token_id when it is not
    an EOS token). Padding inside the prompt is refused: one row decodes unpadded."""
    if attention_mask is None:
        config = getattr(model, "generation_config", None)
        pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        if not isinstance(pad, int) or pad in eos or not bool((input_ids == pad).any()):
            return input_ids
        attention_mask = input_ids != pad
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise GorgonError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}")
    keep = attention_mask[0].bool()
    first = int(keep.int().argmax())
    if not bool(keep[first:].all()):
        raise GorgonError("the prompt has padding (or masked tokens) after its start: only left padding is taken "
                          "off; pass the row without padding")
    return input_ids[:, first:] if bool(keep.any()) else input_ids[:, :0]


def stream_to(streamer, input_ids: torch.Tensor):
    """The step-by-step feed and the end of a streamer: a callable takes each step's new tokens (a list); a
    transformers streamer (TextStreamer, TextIteratorStreamer: put/end) is fed as `generate` feeds it, the
    prompt first."""
    if streamer is None:
        return None, None
    if not (hasattr(streamer, "put") and hasattr(streamer, "end")):
        return streamer, None
    streamer.put(input_ids.cpu())

    def put(tokens: list[int]) -> None:
        if tokens:
            streamer.put(torch.tensor(tokens))

    return put, streamer.end


# `generate` arguments a transformers user passes, and what says the same here.
LIKE_GENERATE = {
    **dict.fromkeys(("do_sample", "temperature", "top_k", "top_p"),
                    "sampling=Sampling.like_generate(model, temperature, top_k, top_p)"),
    "max_length": "max_new_tokens", "generation_config": "the settings as arguments (it reads model.generation_config)",
    "pad_token_id": "attention_mask (or set model.generation_config.pad_token_id)",
    "num_return_sequences": "one call per sequence (it decodes one row)",
}


def check_generate_kwargs(kwargs: dict) -> None:
    """Keywords beyond speculative_generate's own: a `generate` argument names its counterpart here, any
    other is Python's TypeError."""
    for key in kwargs:
        if key in LIKE_GENERATE:
            raise GorgonError(f"speculative_generate takes no {key} (a generate argument): pass {LIKE_GENERATE[key]}")
        raise TypeError(f"speculative_generate() got an unexpected keyword argument {key!r}")


def default_new_tokens(config, prompt_length: int) -> int:
    """The new tokens `generate` would allow with no max_new_tokens given: the generation_config's
    max_new_tokens, else what a max_length it sets leaves after the prompt (padding included, as `generate`
    counts it). Where it sets neither, 256: transformers' own default max_length of 20 tokens would end most
    answers within a sentence."""
    if getattr(config, "max_new_tokens", None):
        return config.max_new_tokens
    max_length = getattr(config, "max_length", None)
    if max_length is None or max_length == neutral_value("max_length"):  # unset, or transformers' default
        return 256
    if max_length <= prompt_length:
        raise GorgonError(f"the target's generation_config sets max_length {max_length}, which the prompt's "
                          f"{prompt_length} tokens already reach: pass max_new_tokens")
    return max_length - prompt_length


def chosen_sampling(config, sampling: Sampling | None, acceptance: str) -> Sampling:
    """The sampling settings a call decodes with, checked with its acceptance rule: None is greedy, named
    where the target's generation_config samples (as `generate` would)."""
    if sampling is None:
        if getattr(config, "do_sample", False):
            warnings.warn("gorgon: the target's generation_config samples (do_sample=True), as `generate` does by "
                          "default; this decodes greedily: pass sampling=Sampling.like_generate(model, temperature) "
                          "to sample", stacklevel=3)
        sampling = Sampling()
    if not isinstance(sampling, Sampling):
        raise GorgonError(f"sampling must be a Sampling (Sampling(0.7), or Sampling.like_generate(model, 0.7)), not "
                          f"a {type(sampling).__name__}")
    if acceptance not in ACCEPTANCE_RULES:
        raise GorgonError(f"unknown acceptance {acceptance!r}: use one of {', '.join(ACCEPTANCE_RULES)}")
    if acceptance == "typical" and sampling.greedy:
        raise GorgonError("typical acceptance (--acceptance typical) needs a temperature > 0 (--temperature): with "
                          "temperature 0 decoding is exact greedy")
    return sampling


def check_decoding(model, drafter, input_ids: torch.Tensor, generator: torch.Generator | None) -> None:
    """Before the prefill: a drafter that fits the model, an attention that takes a tree mask, a generator on
    the model's device; the generation_config settings that `generate` would apply and this does not are
    named in a warning."""
    if not callable(getattr(drafter, "propose", None)):
        raise GorgonError(f"drafter must be a drafter, not a {type(drafter).__name__}: wrap loaded heads as "
                          "gorgon.heads.drafter_for(heads)")
    if hasattr(drafter, "check_target"):  # one built for a model of other shapes would fail inside torch
        drafter.check_target(model)
    attention = getattr(model.config, "_attn_implementation", None) or ""
    if "flash" in attention:
        raise GorgonError(f"the target runs {attention}, which takes no tree mask: load it with "
                          "attn_implementation='sdpa' (or 'eager') to verify trees")
    if generator is not None and not same_device(generator.device, input_ids.device):
        raise GorgonError(f"the generator is on {generator.device} but the model on {input_ids.device}: create it "
                          f"with torch.Generator(device='{input_ids.device}')")
    ignored = generation_settings_not_applied(model)
    if ignored:
        warnings.warn(f"gorgon: the target's generation_config sets {', '.join(ignored)}, which speculative decoding "
                      f"does not apply: the output is generate's without {'it' if len(ignored) == 1 else 'them'}",
                      stacklevel=3)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether a generator on `a` can draw for tensors on `b`: the same type, and the same index where both
    name one (a generator on cuda:0 failed inside torch for a model on cuda:1)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def next_token(model, hidden: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token after a prefill, from its last hidden state: its greedy choice, or a sample."""
    if sampling.greedy:
        return target_argmax(model, hidden)
    return torch.multinomial(target_probs(lm_logits(model, hidden), sampling), 1, generator=generator)[0]


@torch.inference_mode()
def speculative_generate(model, drafter: Drafter, input_ids: torch.Tensor, max_new_tokens: int | None = None,
                         sampling: Sampling | None = None, acceptance: str = "exact", eos_token_id="default",
                         stop_strings=(), tokenizer=None, generator: torch.Generator | None = None,
                         streamer=None, attention_mask: torch.Tensor | None = None,
                         **generate_kwargs) -> GenerationResult:
    """Generate up to `max_new_tokens` after `input_ids` (1, n) with the drafter's tree. `model`: a
    transformers causal LM, or the `Target` that `load_target` and `load_heads` return.

    max_new_tokens: None takes the model's generation_config's, else what its max_length leaves after the
    prompt where it sets one (as `generate` stops there), else 256. sampling: None is greedy (a
    generation_config that samples is named in a warning: `Sampling.like_generate(model, T)` samples as
    `generate` would). acceptance: "exact" (greedy when sampling.temperature == 0, else lossless rejection
    sampling) or "typical" (Medusa's typical acceptance: LOSSY, faster on hard text).
    eos_token_id: "default" takes the model's generation config, like `generate`; so do stop_strings when
    none are given. Other generation_config settings that would change `generate`'s output are named in a
    warning (`generation_settings_not_applied`). attention_mask (or, without it, leading pad tokens) takes
    left padding off, as `generate` masks it. streamer: a callable given each step's new tokens, or a
    transformers streamer (TextStreamer, TextIteratorStreamer). `generate`'s own arguments (temperature,
    max_length, ...) are refused, each naming what says the same here.
    """
    check_generate_kwargs(generate_kwargs)
    if isinstance(model, Target):  # as load_target and load_heads return it
        model = model.model
    config = getattr(model, "generation_config", None)
    sampling = chosen_sampling(config, sampling, acceptance)
    check_input_ids(model, input_ids)
    if max_new_tokens is None:
        max_new_tokens = default_new_tokens(config, input_ids.shape[-1])
    input_ids = without_padding(model, input_ids, attention_mask)
    check_prompt(input_ids, max_new_tokens, context_length(model))
    check_decoding(model, drafter, input_ids, generator)
    if eos_token_id == "default":
        eos_token_id = getattr(config, "eos_token_id", None)
    stop_strings = stop_strings or getattr(config, "stop_strings", None)  # as `generate` takes them
    stop = StopRule(max_new_tokens, eos_token_id, stop_strings, tokenizer)
    layers = drafter.feature_layers
    feed, end = stream_to(streamer, input_ids)

    with decoding_attention(input_ids.device):  # on CUDA, attention without per-shape setup
        check_verifies_trees(model)  # once per model: a family whose forward cannot verify trees is refused
        start = time.perf_counter()  # after that one-time probe, which --stats' tokens/s once included
        cache = growing_cache()
        decoder = model.get_decoder()
        out = decoder(input_ids=input_ids, **with_cache(decoder, cache), use_cache=True,
                      output_hidden_states=layers is not None)
        fresh = features(out, layers)
        root = next_token(model, out.last_hidden_state[0, -1], sampling, generator)
        shares_cache = hasattr(drafter, "attach_cache")  # self-speculation: the draft writes the target's cache
        if shares_cache:
            drafter.attach_cache(cache)
        context = input_ids[0]                  # tokens in the cache; root follows them
        new = [int(root)]
        result = GenerationResult(tokens=new, target_forwards=1, accepted=[1])
        keep = stop.cut(new, 0)
        if feed:
            feed(new[:keep])
        while keep is None:
            past_len = cache.get_seq_length()
            with rows_alone(shares_cache and quantization(model) != "none"):  # its entries stay in the cache
                tokens, tree = drafter.propose(root, fresh, context)
            # A node at depth d would be the output's (len(new) + d)-th token, and the target's token after it the
            # next: a node whose next token the output has no room for need not be verified (the token at the
            # output's last place comes as the bonus), and near the context's end its position may lie past it.
            tokens, tree = cut_tree(tokens, tree, max_new_tokens - len(new) - 1)
            out = verify(model, cache, tokens, tree, hidden_states=layers is not None,
                         drafted=drafter.drafted if shares_cache else None)
            if shares_cache:
                result.reused_rows += out.reused_rows
                result.verified_rows += tree.size
            hidden = out.last_hidden_state[0]
            if sampling.greedy:
                path, emitted = accept_greedy(tree, tokens, target_argmax(model, hidden))
            else:
                accept = accept_typical if acceptance == "typical" else accept_sampled
                path, emitted = accept(tree, tokens, target_probs(lm_logits(model, hidden), sampling), generator)
            nodes = accepted_rows(path, tokens.device)
            keep_path(cache, past_len, nodes)
            context = torch.cat([context, tokens[nodes]])
            before = len(new)
            new.extend(emitted)
            keep = stop.cut(new, before)
            result.target_forwards += 1
            result.accepted.append(len(emitted))
            if feed:
                feed(new[before:keep])
            fresh = features(out, layers)[nodes]
            root = host_to_device(torch.tensor(emitted[-1]), tokens.device)
    result.accepted[-1] -= len(new) - keep  # the tokens the last step emitted past the end are not kept
    del new[keep:]
    result.seconds = time.perf_counter() - start
    if end:
        end()
    return result
