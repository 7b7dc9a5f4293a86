"""The decoder's invariants: greedy output equals `generate`, and the cache after acceptance
equals the cache of a plain forward over the accepted tokens, on every architecture family."""

import copy
import importlib.util
import math
import re
import shutil

import pytest
import torch
from helpers import (
    ARCHS,
    VOCAB,
    OracleDrafter,
    reference,
    tiny_chat_target,
    tiny_family,
    tiny_model,
    tiny_tokenizer,
    toy_data,
)
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from gorgon.decode import speculative_generate
from gorgon.decode.acceptance import Sampling
from gorgon.decode.kernels import use_cpu_kernels
from gorgon.decode.options import read_tree
from gorgon.decode.verify import accepted_rows, check_verifies_trees, keep_path, verify
from gorgon.heads import DraftModelDrafter, EagleHead, GorgonError, MedusaDrafter, MedusaHeads, load_heads, load_target
from gorgon.heads.cache import crop_cache, growing_cache, with_cache
from gorgon.heads.cli import main as gorgon
from gorgon.heads.target import logit_scale, resolve_device
from gorgon.heads.tree import build_tree, tree_from_accuracies

PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]]


# torch's kernels; the fast path with oneDNN for every product; the fast path with products of up to 1 and 3
# rows on the stock kernel (MKL)
KERNEL_SETTINGS = [("stock", 0), ("fast", 0), ("fast", 1), ("fast", 3)]


@pytest.mark.parametrize("kernels,stock_rows", KERNEL_SETTINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_with_random_heads(arch, kernels, stock_rows):
    model = tiny_model(arch)
    use_cpu_kernels(model, kernels, stock_rows)
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=4), tree=PATHS)
    gen = torch.Generator().manual_seed(1)
    for _ in range(8):
        ids = torch.randint(0, VOCAB, (1, int(torch.randint(1, 16, (1,), generator=gen))), generator=gen)
        n = int(torch.randint(1, 30, (1,), generator=gen))
        result = speculative_generate(model, drafter, ids, max_new_tokens=n)
        assert result.tokens == reference(model, ids, n)
        assert result.target_forwards == len(result.accepted) and sum(result.accepted) >= len(result.tokens)


@pytest.mark.parametrize("kernels,stock_rows", KERNEL_SETTINGS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate_when_drafts_are_accepted(arch, kernels, stock_rows):
    """Drafts that are often right make every step accept a different branch and depth."""
    model = tiny_model(arch)
    use_cpu_kernels(model, kernels, stock_rows)
    gen = torch.Generator().manual_seed(2)
    taus = []
    for trial in range(6):
        ids = torch.randint(0, VOCAB, (1, int(torch.randint(2, 14, (1,), generator=gen))), generator=gen)
        n = int(torch.randint(10, 40, (1,), generator=gen))
        ref = reference(model, ids, n)
        drafter = OracleDrafter(ref, ids.shape[1], VOCAB, PATHS, seed=trial)
        result = speculative_generate(model, drafter, ids, max_new_tokens=n)
        assert result.tokens == ref
        taus.append(result.tau)
    assert sum(taus) / len(taus) > 2.0  # the oracle's right tokens were really accepted


# A sliding window of 2 is shorter than the tree (4 deep): nodes must not see their own early ancestors.
@pytest.mark.parametrize("arch, window", [(arch, 6) for arch in ARCHS] + [("mistral", 2), ("gemma3", 2)])
@pytest.mark.parametrize("new_cache", [DynamicCache, growing_cache])
def test_cache_after_acceptance_equals_plain_forward(arch, window, new_cache):
    model = tiny_model(arch, window=window)
    tree = build_tree(PATHS)
    prefix = torch.randint(0, VOCAB, (1, 9))
    tokens = torch.randint(0, VOCAB, (tree.size,))
    with torch.no_grad():
        for last in (0, 1, 3, 7, 10, tree.size - 1):  # 0 and 1: paths already in place (kept as a slice)
            cache = new_cache()
            model.get_decoder()(input_ids=prefix, **with_cache(model.get_decoder(), cache), use_cache=True)
            hidden = verify(model, cache, tokens, tree).last_hidden_state[0]
            path = tree.path_to[last]
            nodes = accepted_rows(path, "cpu")
            assert isinstance(nodes, slice) == (last in (0, 1))
            keep_path(cache, prefix.shape[1], nodes)
            plain = DynamicCache()
            out = model.get_decoder()(input_ids=torch.cat([prefix, tokens[nodes][None]], 1),
                                      **with_cache(model.get_decoder(), plain), use_cache=True)
            assert cache.get_seq_length() == plain.get_seq_length() == prefix.shape[1] + len(path)
            for mine, theirs in zip(cache.layers, plain.layers):
                torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
            # and the verify forward's hidden state at the path end equals the plain forward's
            torch.testing.assert_close(hidden[last], out.last_hidden_state[0, -1], atol=1e-5, rtol=1e-5)


def test_a_growing_cache_holds_what_a_dynamic_cache_holds_and_appends_in_place():
    decoder = tiny_model("llama").get_decoder()
    ids = torch.randint(0, VOCAB, (1, 420))
    outputs, buffers = {}, set()
    with torch.no_grad():
        for new_cache in (DynamicCache, growing_cache):
            cache, outputs[new_cache] = new_cache(), []
            decoder(input_ids=ids[:, :10], **with_cache(decoder, cache), use_cache=True)
            while (length := cache.get_seq_length()) < 400:  # five tokens verified, three kept, as decoding does
                out = decoder(input_ids=ids[:, length:length + 5], **with_cache(decoder, cache), use_cache=True)
                crop_cache(cache, length + 3)
                outputs[new_cache].append(out.last_hidden_state)
                if new_cache is growing_cache:
                    buffers.add(cache.layers[0].keys.data_ptr())
    assert all(torch.equal(a, b) for a, b in zip(outputs[DynamicCache], outputs[growing_cache], strict=True))
    assert len(buffers) == 2  # one buffer until its room (256 positions past the prompt) ran out, then one more


def test_heads_draft_from_the_last_accepted_token():
    """Greedy output is exact whatever the heads propose: drafting from another row would pass every test above."""
    heads = MedusaHeads.for_target(tiny_model("llama"), num_heads=3)
    drafter = MedusaDrafter(heads, tree=PATHS[:7])
    root, features, context = torch.tensor(5), torch.randn(4, 32), torch.randint(0, VOCAB, (9,))
    tokens = drafter.propose(root, features, context)[0]
    assert torch.equal(tokens, drafter.propose(root, features[-1:], context)[0])
    assert not torch.equal(tokens, drafter.propose(root, features[:1], context)[0])


@pytest.mark.parametrize("layers", [None, (1, 2)])
def test_the_drafter_gets_the_targets_features_at_every_token_accepted_since_its_last_call(layers):
    """The last hidden state, or the given layers' concatenated. Greedy output is exact whatever the drafter
    proposes, so features of other tokens, or in another order, would only make its drafts worse, unseen."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = reference(model, ids, 20)
    calls = []

    class Recording(OracleDrafter):
        feature_layers = layers

        def propose(self, root, features, context):
            calls.append((features, context))
            return super().propose(root, features, context)

    assert speculative_generate(model, Recording(ref, 6, VOCAB, PATHS), ids, max_new_tokens=20).tokens == ref
    assert calls[0][0].shape[0] == 6 and max(features.shape[0] for features, _ in calls[1:]) > 1
    with torch.no_grad():
        for features, context in calls:
            out = model.get_decoder()(input_ids=context[None], output_hidden_states=True)
            expected = out.last_hidden_state[0] if layers is None else torch.cat(
                [out.hidden_states[i][0] for i in layers], -1)
            torch.testing.assert_close(features, expected[-features.shape[0]:], atol=1e-5, rtol=1e-5)


class CountScalarReads(TorchDispatchMode):
    """Counts the operations that read one value back to the host (`int(t)`, `t.item()`, `bool(t)`): on a GPU
    each makes the host wait for the device. (`tolist`, the decoder's one read per step, is not counted.)"""

    READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func in self.READS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sampling,acceptance", [(Sampling(), "exact"), (Sampling(0.8, 20, 0.9), "exact"),
                                                 (Sampling(0.8), "typical")], ids=["greedy", "sampled", "typical"])
def test_verify_steps_read_no_single_values_from_the_device(sampling, acceptance):
    """Past the prefill's first token, a step reads the device once, through one `tolist`: a tree's depth or
    top-k is known on the host, and the root's mark is made on the device."""
    model = tiny_model("llama")
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=3), tree=tree)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    logit_scale(model)  # measured once per model, before its first decoding
    check_verifies_trees(model)  # probed once per model, likewise
    with CountScalarReads() as counter:
        result = speculative_generate(model, drafter, ids, max_new_tokens=30, sampling=sampling,
                                      acceptance=acceptance, generator=torch.Generator().manual_seed(0))
    assert result.target_forwards > 5
    assert counter.reads == 1  # the prefill's token


@pytest.mark.parametrize("family,refusal", [
    ("mpt", "mpt places each token by its order in the input (its forward takes no position_ids)"),
    ("bloom", "bloom places each token by its order in the input"),
    ("rwkv", "rwkv places each token by its order in the input"),
    ("gpt_neo", "gpt_neo's local attention layers mask keys by their order in the input, not by the tree"),
    ("openai-gpt", "openai-gpt cannot verify a tree of candidates in one forward (its forward left the KV cache "
                   "empty"),
    ("mamba", "layer types ['linear_attention'] are not supported by tree attention")])
def test_a_family_whose_forward_cannot_verify_trees_is_refused_in_one_line(family, refusal):
    """MPT's ALiBi and GPT-Neo's local layers place keys by their order in the input, not by the tree, and RWKV's
    forward drops the cache it is given: each decoded without a word, wrongly (their output differed from
    `generate`'s); Bloom, OpenAI-GPT and Mamba failed inside torch or transformers."""
    extra = {"gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=6),
             "rwkv": dict(attention_hidden_size=32)}.get(family, {})
    model = tiny_family(family, **extra)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(GorgonError, match=f"^{re.escape(refusal)}"):
        speculative_generate(model, MedusaDrafter(MedusaHeads.for_target(model)), ids, 8, eos_token_id=None)


def test_an_attention_that_ignores_the_tree_mask_is_refused_by_the_probe():
    """The probe's own check (a tree's nodes must get a plain forward's hidden states) refuses what passes
    the structural ones: here Llama on an attention function that drops the mask for plain causal order."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, **{**kwargs, "is_causal": True})

    AttentionInterface.register("gorgon_test_causal_only", causal_only)
    model = tiny_model("llama")
    model.set_attn_implementation("gorgon_test_causal_only")
    with pytest.raises(GorgonError, match=r"^llama cannot verify a tree of candidates in one forward \(its outputs "
                                          "for the tree's nodes differ from a plain forward's over the same tokens"):
        check_verifies_trees(model)


def test_the_timed_seconds_leave_out_the_one_time_tree_probe(monkeypatch):
    """`--stats`' tokens/s for a model's first output included the probe (two forwards of the target)."""
    import time

    import gorgon.decode.verify as verify_module

    def slow_probe(model, decoder):
        time.sleep(2.0)  # far longer than 4 tokens of a tiny model take
        return None

    monkeypatch.setattr(verify_module, "tree_probe_problem", slow_probe)
    model = tiny_model("llama")
    result = speculative_generate(model, MedusaDrafter(MedusaHeads.for_target(model, num_heads=2)),
                                  torch.ones(1, 4, dtype=torch.long), 4)
    assert model._gorgon_verifies_trees and 0 < result.seconds < 2.0


def test_stops_at_eos_and_never_overshoots():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = reference(model, ids, 40)
    eos = ref[17]                          # a token the greedy continuation reaches
    model.generation_config.eos_token_id = eos
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
    expected = expected[0, ids.shape[1]:].tolist()
    drafter = OracleDrafter(ref, ids.shape[1], VOCAB, PATHS)
    result = speculative_generate(model, drafter, ids, max_new_tokens=40)
    assert result.tokens == expected and result.tokens[-1] == eos and eos not in result.tokens[:-1]
    assert sum(result.accepted) == len(result.tokens)  # the last step's tokens after the EOS are not counted
    for n in (1, 2, 3, 7):
        assert len(speculative_generate(model, drafter, ids, max_new_tokens=n, eos_token_id=None).tokens) == n


def test_drafts_past_the_output_are_not_verified_so_a_full_context_is_fine(monkeypatch):
    """GPT-2's learned positions end at its context: nodes past the last token kept would index beyond it. No
    step verifies a node whose next token the output has no room for (one level deeper still fit the context,
    so only the depths verified show it)."""
    import itertools

    from transformers import GPT2Config, GPT2LMHeadModel

    import gorgon.decode.generate as generate

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32)).eval()
    ids = torch.randint(0, VOCAB, (1, 20))
    ref = reference(model, ids, 12)
    depths, verify = [], generate.verify
    monkeypatch.setattr(generate, "verify", lambda model, cache, tokens, tree, **kw: depths.append(
        int(tree.depth.max())) or verify(model, cache, tokens, tree, **kw))
    result = speculative_generate(model, OracleDrafter(ref, 20, VOCAB, PATHS), ids, max_new_tokens=12,
                                  eos_token_id=None)
    assert result.tokens == ref
    emitted_before = list(itertools.accumulate(result.accepted))  # before step i: the prefill's and i steps'
    assert depths and all(depth <= 12 - before - 1 for depth, before in zip(depths, emitted_before))
    assert max(depths) == max(len(p) for p in PATHS)  # the trees were cut at the end only


def test_sampled_verification_uses_the_targets_own_distribution(monkeypatch):
    """Every step's root node is judged by the distribution a plain forward gives after the tokens emitted so
    far, with the sampling settings as given (a verify temperature 1.5% off passed the chi-square tests)."""
    import gorgon.decode.generate as generate
    from gorgon.decode.acceptance import target_probs

    model = tiny_model("llama")
    s = Sampling(0.7, top_k=5, top_p=0.9)
    seen, accept = [], generate.accept_sampled
    monkeypatch.setattr(generate, "accept_sampled", lambda tree, tokens, probs, generator: seen.append(
        probs[0].clone()) or accept(tree, tokens, probs, generator))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2), tree=[[0], [1], [0, 0]])
    result = speculative_generate(model, drafter, ids, 12, sampling=s, eos_token_id=None,
                                  generator=torch.Generator().manual_seed(0))
    done = result.accepted[0]
    assert len(seen) == len(result.accepted) - 1  # each verify step's, none missed
    for step, probs in enumerate(seen):
        prefix = torch.cat([ids, torch.tensor([result.tokens[:done]])], 1)
        torch.testing.assert_close(probs, target_probs(model(prefix).logits[0, -1], s), atol=1e-5, rtol=1e-4)
        done += result.accepted[step + 1]


def test_a_stop_string_ends_the_output_as_in_generate():
    from helpers import tiny_tokenizer

    from gorgon.decode.generate import StopRule

    tokenizer = tiny_tokenizer()
    text = [tokenizer.convert_tokens_to_ids(c) for c in "abcd"]
    for stop in ("bc", ["bc"], ("x", "bc")):  # one string, as `generate` takes it, or several
        assert StopRule(100, None, stop, tokenizer).cut(text, 0) == 3


def test_a_stop_string_split_over_byte_level_tokens_ends_the_output_at_its_last_byte():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gorgon.decode.generate import StopRule

    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    text = tokenizer("a\u00f1b\U0001f600c", add_special_tokens=False).input_ids  # a, 2 bytes, b, 4 bytes, c
    assert len(text) == 9
    assert StopRule(100, None, ["\u00f1"], tokenizer).cut(text, 0) == 3
    assert StopRule(100, None, ["b\U0001f600"], tokenizer).cut(text, 0) == 8
    assert StopRule(100, None, ["\U0001f600c"], tokenizer).cut(text, 0) == 9


def test_stop_strings_in_the_generation_config_end_the_output_as_in_generate():
    from helpers import tiny_tokenizer

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = reference(model, ids, 20)
    tokenizer = tiny_tokenizer()
    stop = tokenizer.decode(ref[3:5])
    model.generation_config.stop_strings = [stop]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          tokenizer=tokenizer)[0, 5:].tolist()
    assert len(want) < 20 and want == ref[:len(want)]
    drafter = OracleDrafter(ref, 5, VOCAB, PATHS)
    assert speculative_generate(model, drafter, ids, max_new_tokens=20, tokenizer=tokenizer).tokens == want
    with pytest.raises(GorgonError, match="in the model's generation_config\\) need the tokenizer"):
        speculative_generate(model, drafter, ids, max_new_tokens=20)


def test_generation_config_settings_gorgon_does_not_apply_are_named_and_the_bench_baseline_skips_them():
    from gorgon.decode.bench import timed_generate
    from gorgon.decode.generate import generation_settings_not_applied

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 5))
    ref = reference(model, ids, 20)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.suppress_tokens = [ref[0]]
    assert generation_settings_not_applied(model) == ["repetition_penalty", "suppress_tokens"]
    named = {}
    for key, value in [("num_beams", 2), ("encoder_repetition_penalty", 1.5), ("guidance_scale", 1.5),
                       ("exponential_decay_length_penalty", (2, 3.0)), ("min_new_tokens", 3), ("max_time", 5.0),
                       ("num_assistant_tokens", 5), ("num_beams", 1), ("use_cache", False), ("max_length", 9)]:
        changed = copy.deepcopy(model)
        setattr(changed.generation_config, key, value)
        named[key, value] = key in generation_settings_not_applied(changed)
    assert named == {("num_beams", 2): True, ("encoder_repetition_penalty", 1.5): True, ("guidance_scale", 1.5): True,
                     ("exponential_decay_length_penalty", (2, 3.0)): True, ("min_new_tokens", 3): True,
                     ("max_time", 5.0): True, ("num_assistant_tokens", 5): False, ("num_beams", 1): False,
                     ("use_cache", False): False, ("max_length", 9): False}
    assert reference(model, ids, 20) != ref  # generate applies them, even greedy
    with pytest.warns(UserWarning, match="sets repetition_penalty, suppress_tokens, which speculative decoding"):
        result = speculative_generate(model, OracleDrafter(ref, 5, VOCAB, PATHS), ids, max_new_tokens=20)
    assert result.tokens == ref
    model.generation_config.suppress_tokens = None
    assert timed_generate(model, ids, 20, Sampling())[0] == ref  # the baseline decodes without the penalty
    assert model.generation_config.repetition_penalty == 1.3  # the model's own config is left as it was


def test_the_bench_baseline_gives_generate_its_settings_in_the_generation_config(monkeypatch):
    """transformers warns on generation settings passed beside a generation_config (and means to refuse them)."""
    from gorgon.decode.bench import timed_generate

    model, ids = tiny_model("llama"), torch.randint(0, VOCAB, (1, 5))
    ref, calls, generate = reference(model, ids, 9), [], model.generate

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    assert timed_generate(model, ids, 9, Sampling(), prompt_lookup_num_tokens=3)[0] == ref
    timed_generate(model, ids, 4, Sampling(temperature=0.7, top_k=5))
    model.generation_config.top_k = 50  # a model's own top-k, which the baseline must not take when top-k is off
    timed_generate(model, ids, 4, Sampling(temperature=0.7))
    timed_generate(model, ids, 4, Sampling(), assistant_model=tiny_model("llama"))
    assert [sorted(kwargs) for kwargs in calls] == [["attention_mask", "generation_config"]] * 3 + [
        ["assistant_model", "attention_mask", "generation_config"]]  # a model is no setting: passed on
    first, sampled, off = (calls[i]["generation_config"] for i in range(3))
    assert (first.max_new_tokens, first.do_sample, first.prompt_lookup_num_tokens) == (9, False, 3)
    assert (sampled.max_new_tokens, sampled.do_sample, sampled.temperature, sampled.top_k) == (4, True, 0.7, 5)
    assert off.top_k == 0  # off: generate fills a None from the model's generation_config, not a 0


def test_streamer_sees_exactly_the_output():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 4))
    ref = reference(model, ids, 25)
    seen = []
    result = speculative_generate(model, OracleDrafter(ref, 4, VOCAB, PATHS), ids, max_new_tokens=25,
                                  streamer=seen.extend)
    assert seen == result.tokens == ref


def test_bad_inputs():
    model = tiny_model("llama")
    heads = MedusaHeads.for_target(model, num_heads=2)
    with pytest.raises(GorgonError, match="2 heads"):
        MedusaDrafter(heads, tree=[[0], [0, 0], [0, 0, 0]])
    drafter = MedusaDrafter(heads, tree=[[0], [0, 0]])
    with pytest.raises(GorgonError, match="empty"):
        speculative_generate(model, drafter, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(GorgonError, match="context of 512"):
        speculative_generate(model, drafter, torch.zeros(1, 500, dtype=torch.long), max_new_tokens=20)
    with pytest.raises(GorgonError, match="unknown acceptance"):
        speculative_generate(model, drafter, torch.zeros(1, 3, dtype=torch.long), acceptance="fast")
    for bad in (2.5, True, 0):
        with pytest.raises(GorgonError, match="max_new_tokens must be a whole number of at least 1"):
            speculative_generate(model, drafter, torch.zeros(1, 3, dtype=torch.long), max_new_tokens=bad)
    with pytest.raises(GorgonError, match=r"input_ids must be a tensor of shape \(1, n\) .*not a list"):
        speculative_generate(model, drafter, [[1, 2, 3]])
    with pytest.raises(GorgonError, match=r"sampling must be a Sampling \(Sampling\(0.7\), or Sampling.like_generate"
                                          r"\(model, 0.7\)\), not a float"):
        speculative_generate(model, drafter, torch.zeros(1, 3, dtype=torch.long), sampling=0.7)
    with pytest.raises(GorgonError, match="only left padding is taken off"):
        speculative_generate(model, drafter, torch.ones(1, 3, dtype=torch.long),
                             attention_mask=torch.tensor([[1, 0, 1]]))
    with pytest.raises(GorgonError, match=r"heads are in torch.bfloat16 but the target's lm_head they share in "
                                          r"torch.float32: keep them in the target's dtype"):
        MedusaDrafter(MedusaHeads.for_target(model, num_heads=2).to(torch.bfloat16))
    with pytest.raises(GorgonError, match="move the prompt there"):
        speculative_generate(model, drafter, torch.zeros(1, 3, dtype=torch.long, device="meta"))
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(GorgonError, match="takes no tree mask: load it with attn_implementation='sdpa'"):
        speculative_generate(model, drafter, torch.zeros(1, 3, dtype=torch.long))
    other = tiny_model("qwen2", vocab=VOCAB + 1)
    with pytest.raises(GorgonError, match="vocabulary of 64"):
        heads.attach(other)


def test_greedy_is_exact_with_a_draft_vocabulary():
    model = tiny_model("qwen2")
    heads = MedusaHeads.for_target(model, num_heads=3)
    heads.set_draft_vocab(torch.arange(0, VOCAB, 3))
    drafter = MedusaDrafter(heads, tree=PATHS[:7])
    ids = torch.randint(0, VOCAB, (1, 6))
    assert speculative_generate(model, drafter, ids, max_new_tokens=30).tokens == reference(model, ids, 30)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("topk", [1, 3])  # a chain, and a tree of the draft's likeliest continuations
def test_a_draft_model_gives_exact_greedy_output(arch, topk):
    from gorgon.heads import DraftModelDrafter

    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(5)
    for draft, k in [(tiny_model(arch, seed=7), 3), (model, 4)]:   # another model, and the target itself
        drafter = DraftModelDrafter(draft, k=k, topk=topk)
        taus = []
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (1, int(torch.randint(2, 12, (1,), generator=gen))), generator=gen)
            result = speculative_generate(model, drafter, ids, max_new_tokens=25)
            assert result.tokens == reference(model, ids, 25)
            taus.append(result.tau)
        if draft is model and topk == 1:  # a perfect chain: every step accepts all k drafts plus the bonus
            assert min(taus) > 0.9 * 25 / (1 + 24 / (k + 1) + 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_draft_models_candidates_score_what_it_gives_each_path_drafted_alone(arch):
    """A candidate's confidence is the product of the draft's probabilities along its path, computed here with no
    cache: the search's masks, positions and sliding windows (gemma3's window is shorter than the text) must
    reproduce it, also on a second call that reuses the cache's prefix. Greedy output is exact whatever tree is
    proposed, so the decoding tests cannot see a wrong tree, only a slower one. With top-k 1: the greedy chain."""
    from gorgon.heads import DraftModelDrafter

    draft = tiny_model(arch, seed=7)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0))
    tree, chain = DraftModelDrafter(draft, k=4, topk=3, nodes=9), DraftModelDrafter(draft, k=4)
    with torch.no_grad():
        for end in (6, 12):  # the context before the root, then a longer one sharing its start
            scored = tree.scored_paths(ids[end - 1], None, ids[:end - 1])
            chances = [chance for _, chance in scored]
            assert len(scored) == 8 and chances == sorted(chances, reverse=True)
            assert max(len(path) for path, _ in scored) >= 3
            for path, chance in scored:
                expected, text = 1.0, ids[:end]
                for token in path:
                    expected *= draft(input_ids=text[None]).logits[0, -1].float().softmax(-1)[token].item()
                    text = torch.cat([text, torch.tensor([token])])
                assert chance == pytest.approx(expected, rel=1e-4), path
            greedy = draft.generate(ids[None, :end], max_new_tokens=4, do_sample=False)[0, end:].tolist()
            assert [path for path, _ in chain.scored_paths(ids[end - 1], None, ids[:end - 1])] == [
                greedy[:d] for d in range(1, 5)]


@pytest.mark.parametrize("topk", [1, 3])
def test_a_draft_cut_to_a_draft_vocabulary_drafts_its_best_tokens_there_and_stays_exact(topk):
    """The cut output layer's rows are the token map's tokens: the chain is the whole draft's greedy choice among
    them (computed here from the uncut draft), every candidate is one of them, and greedy output stays exact."""
    from gorgon.heads import DraftModelDrafter
    from gorgon.heads.methods.draft_model import cut_to_draft_vocab

    model, token_map = tiny_model("llama"), torch.arange(VOCAB - 1, 0, -3).sort().values
    whole = tiny_model("llama", seed=7)
    cut = cut_to_draft_vocab(tiny_model("llama", seed=7), token_map)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    drafter = DraftModelDrafter(cut, k=4, topk=topk, token_map=token_map)
    with torch.no_grad():
        scored = drafter.scored_paths(ids[0, -1], None, ids[0, :-1])
        text, chain = ids[0], []
        for _ in range(4):
            chain.append(int(token_map[whole(input_ids=text[None]).logits[0, -1, token_map].argmax()]))
            text = torch.cat([text, torch.tensor(chain[-1:])])
    assert all(set(path) <= set(token_map.tolist()) for path, _ in scored)
    if topk == 1:
        assert [path for path, _ in scored] == [chain[:d] for d in range(1, 5)]
    result = speculative_generate(model, drafter, ids, max_new_tokens=25)
    assert result.tokens == reference(model, ids, 25)


def test_a_level_that_cannot_pay_is_not_drafted():
    """A frontier's children are together no likelier than it: once its chances sum below a level's cost the
    search stops (can_grow), and a draft model drafts no deeper than that, with output still exact."""
    from gorgon.heads import DraftModelDrafter
    from gorgon.heads.search import can_grow

    chances = torch.tensor([0.3, 0.2]).log()
    assert can_grow(chances, torch.tensor([0.5, 0.3, 0.2]).log(), 8, level_cost=0.49)
    assert not can_grow(chances, torch.tensor([0.5, 0.3, 0.2]).log(), 8, level_cost=0.51)
    model = tiny_model("llama")
    draft = tiny_model("llama", seed=7)
    levels = []

    def counted(*args, **kwargs):
        levels.append(kwargs["input_ids"].shape[1])
        return forward(*args, **kwargs)

    forward, draft.forward = draft.forward, counted
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0))
    for topk in (1, 3):
        with torch.no_grad():  # the first level's chances (the root's likeliest children), as the drafter sums them
            first = float(draft(input_ids=ids[None]).logits[0, -1].softmax(-1).topk(topk).values.sum())
        # free levels: all 4; just below the first level's chances: a second; just above: none past the first
        for cost, shallowest, deepest in [(0.0, 4, 4), (first - 1e-4, 2, 4), (first + 1e-4, 1, 1)]:
            drafter = DraftModelDrafter(draft, k=4, topk=topk, nodes=1 + 4 * topk, level_cost=cost)
            levels.clear()
            with torch.no_grad():
                paths = drafter.scored_paths(ids[-1], None, ids[:-1])
            depth = max(len(path) for path, _ in paths)
            assert shallowest <= depth <= deepest and len(levels) == depth, (topk, cost)
            result = speculative_generate(model, drafter, ids[None], max_new_tokens=20)
            assert result.tokens == reference(model, ids[None], 20)
    with pytest.raises(GorgonError, match="a draft level's cost is a finite number of target steps >= 0, not -1"):
        DraftModelDrafter(draft, level_cost=-1)
    with pytest.raises(GorgonError, match="a draft level's cost is a finite number of target steps >= 0, not inf"):
        DraftModelDrafter(draft).level_cost = float("inf")  # as the options set it, once it is timed
    from gorgon.decode.calibrate import drafted_level_cost

    levels.clear()  # timed as a level runs: one forward over top-k new tokens (and the cache's prefill)
    assert 0 < drafted_level_cost(DraftModelDrafter(draft, k=4, topk=3), model, repeat=2) < float("inf")
    assert levels == [256] + [3] * 3


def test_a_draft_vocabulary_is_saved_loaded_and_checked(tmp_path):
    from helpers import tiny_tokenizer
    from safetensors.torch import save_file

    from gorgon.heads import DraftModelDrafter
    from gorgon.heads.methods.draft_model import cut_to_draft_vocab, load_draft_vocab
    from gorgon.heads.methods.draft_model.model import DRAFT_VOCAB_NAME, save_draft

    draft, token_map = tiny_model("llama"), torch.tensor([9, 2, 40, 5])
    save_draft(draft, tiny_tokenizer(), tmp_path, token_map=token_map)
    assert load_draft_vocab(str(tmp_path), VOCAB).tolist() == [2, 5, 9, 40]
    save_draft(draft, tiny_tokenizer(), tmp_path / "whole")
    assert load_draft_vocab(str(tmp_path / "whole"), VOCAB) is None  # a draft without one drafts from all tokens
    with pytest.raises(GorgonError, match="is not a draft vocabulary for a vocabulary of 40: it must hold"):
        load_draft_vocab(str(tmp_path), 40)  # token 40 is past a 40-token vocabulary
    save_file({"token_map": torch.tensor([3, 3, 7])}, tmp_path / DRAFT_VOCAB_NAME)
    with pytest.raises(GorgonError, match="increasing token ids below that size; delete it to draft from every"):
        load_draft_vocab(str(tmp_path), VOCAB)
    with pytest.raises(GorgonError, match="has 4 rows, not its vocabulary's 64: pass the token_map it was cut to"):
        DraftModelDrafter(cut_to_draft_vocab(tiny_model("llama"), token_map))
    with pytest.raises(GorgonError, match="has 64 rows but token_map names 4 tokens: cut it with cut_to_draft_vocab"):
        DraftModelDrafter(draft, token_map=token_map)
def test_attention_of_another_kind_is_refused_in_one_line():
    from transformers import LlamaConfig

    from gorgon.heads.masks import layer_masks

    config = LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(GorgonError, match=r"layer types \['chunked_attention'\] are not supported by tree attention"):
        layer_masks(config, torch.zeros(1, 1, 2, 2), torch.arange(2), lambda: torch.arange(2))


def test_a_draft_with_another_vocabulary_is_refused():
    from gorgon.heads import DraftModelDrafter

    with pytest.raises(GorgonError, match="the draft model: a vocabulary of 72, but the target has 64"):
        DraftModelDrafter(tiny_model("llama", vocab=VOCAB + 8)).check_target(tiny_model("llama"))


def test_the_api_takes_what_generate_takes():
    """Found by a helper calling the API as transformers users do: a left-padded row was decoded with its padding
    (generate masks it), generate's max_new_tokens and sampling in the generation_config were dropped without a
    word, a transformers streamer and an EOS tensor crashed, a prompt one token short of the context was refused,
    and `accepted` counted tokens cut off at the end."""
    import numpy as np
    from transformers.generation.streamers import BaseStreamer

    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2), tree=[[0], [1], [0, 0]])
    plain = speculative_generate(model, drafter, ids, max_new_tokens=12, eos_token_id=None).tokens
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    assert speculative_generate(model, drafter, padded, 12, attention_mask=mask, eos_token_id=None).tokens == plain
    model.generation_config.pad_token_id = 0  # as generate infers the mask from a pad token that is not EOS
    assert speculative_generate(model, drafter, padded, 12, eos_token_id=None).tokens == plain
    model.generation_config.max_length = 6 + 4  # as generate: what max_length leaves after the prompt
    assert len(speculative_generate(model, drafter, ids, eos_token_id=None).tokens) == 4
    assert len(model.generate(ids, eos_token_id=None, do_sample=False)[0]) == 6 + 4
    model.generation_config.max_length = 6
    with pytest.raises(GorgonError, match=r"^the target's generation_config sets max_length 6, which the prompt's 6 "
                                          "tokens already reach: pass max_new_tokens$"):
        speculative_generate(model, drafter, ids, eos_token_id=None)
    model.generation_config.max_new_tokens = 5  # before max_length, as in generate
    assert len(speculative_generate(model, drafter, ids, eos_token_id=None).tokens) == 5
    model.generation_config.do_sample = True
    with pytest.warns(UserWarning, match=r"generation_config samples \(do_sample=True\).*Sampling.like_generate"):
        speculative_generate(model, drafter, ids, 3)

    class Collect(BaseStreamer):
        def __init__(self):
            self.seen, self.ended = [], False

        def put(self, value):
            self.seen.append(value.tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    result = speculative_generate(model, drafter, ids, 12, Sampling(), eos_token_id=torch.tensor([plain[7], 63]),
                                  streamer=streamer)
    assert result.tokens == plain[:8] and streamer.ended
    assert streamer.seen[0] == ids.tolist() and sum(streamer.seen[1:], []) == plain[:8]
    assert sum(result.accepted) == len(result.tokens)  # the step past the EOS kept only what precedes it
    assert Sampling(np.float32(0.7), np.int64(5)).top_k == 5  # numpy numbers are numbers
    # The last new token is never fed back: a prompt of 511 and 2 new tokens fit a context of 512.
    assert len(speculative_generate(model, drafter, torch.ones(1, 511, dtype=torch.long), 2, Sampling(),
                                    eos_token_id=None).tokens) == 2


def test_a_drafter_for_a_model_of_other_shapes_is_refused_in_one_line():
    """It failed inside torch (a shape mismatch in a matmul, an index out of range) after the prefill."""
    from gorgon.heads import ContextDrafter, DraftModelDrafter, EagleDrafter, EagleHead, MergedDrafter

    model, wider = tiny_model("llama"), tiny_model("llama", vocab=VOCAB + 16)
    ids = torch.ones(1, 3, dtype=torch.long)
    for drafter in (MedusaDrafter(MedusaHeads.for_target(model)), EagleDrafter(EagleHead.for_target(model)),
                    MergedDrafter(MedusaDrafter(MedusaHeads.for_target(model)), ContextDrafter())):
        with pytest.raises(GorgonError, match=rf"of a vocabulary of {VOCAB}, but the target has {VOCAB + 16}"):
            speculative_generate(wider, drafter, ids, 4)
    with pytest.raises(GorgonError, match=rf"the draft model: a vocabulary of {VOCAB}, but the target has"):
        speculative_generate(wider, DraftModelDrafter(tiny_model("llama", seed=1)), ids, 4)


def test_from_options_builds_what_the_command_line_builds(tmp_path):
    """Python got the fast setting only through internals (an argparse namespace); from_options takes the
    options as keywords, with the command line's defaults and checks."""
    from helpers import tiny_chat_target
    from transformers import AutoModelForCausalLM

    from gorgon.decode import from_options
    from gorgon.heads import MergedDrafter

    target_dir = tiny_chat_target(tmp_path)
    MedusaHeads.for_target(AutoModelForCausalLM.from_pretrained(target_dir)).save_pretrained(tmp_path / "heads")
    options = dict(heads=tmp_path / "heads", target=target_dir, device="cpu", context_draft=True, tree_budget=6,
                   tree=[[0], [0, 0]])
    target, drafter = from_options(**options)
    assert isinstance(drafter, MergedDrafter) and drafter.drafter.tree.paths == ((0,), (0, 0))
    ids = torch.randint(1, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    assert speculative_generate(target, drafter, ids, 12, eos_token_id=None).tokens == \
        target.model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 6:].tolist()
    for bad, says in [(dict(contxt_draft=True), "^from_options takes no 'contxt_draft': did you mean context_draft"),
                      (dict(max_new_tokens=5), "^from_options takes no 'max_new_tokens'"),
                      (dict(context_ngram=0), "^argument --context-ngram: must be at least 1, not 0$"),
                      (dict(tree_budget=6, context_draft=False), "^--tree-budget sizes a merged tree: it needs "
                                                                 "--context-draft with --heads or --draft$")]:
        with pytest.raises(GorgonError, match=says):
            from_options(**{**options, **bad})


def test_generate_reads_messages_until_an_empty_line(tmp_path, monkeypatch, capsys):
    """--chat: each line is a message; at a terminal a banner says how it ends and a prompt marks the input."""
    import io

    from helpers import tiny_chat_target

    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path)
    args = ["generate", "--target", str(target), "--context-draft", "--max-new-tokens", "3", "--device", "cpu",
            "--chat"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nnot read\n"))
    assert gorgon(args) == 0
    out, err = capsys.readouterr()
    assert out.count("\n") == 1 and "type a message" not in err  # one reply; a pipe gets no banner

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal("hello\n"))
    assert gorgon(args) == 0
    err = capsys.readouterr().err
    assert "gorgon generate: type a message and press Enter; an empty line or Ctrl-D ends\n> " in err
    assert err.endswith("> ")  # asked again, then the end of the input ended it


def test_arguments_are_range_checked(tmp_path, capsys):
    for bad, match in [(dict(temperature=-1), "temperature"), (dict(temperature=math.nan), "temperature"),
                       (dict(temperature=1, top_k=-1), "top-k"), (dict(temperature=1, top_p=2), "top-p"),
                       (dict(temperature=1, top_k=1.5), "top-k")]:
        with pytest.raises(GorgonError, match=match):
            Sampling(**bad)
    with pytest.raises(GorgonError, match="unknown device 'tpu9'"):
        resolve_device("tpu9")
    if not torch.cuda.is_available():
        with pytest.raises(GorgonError, match="device 'cuda' is not available"):
            resolve_device("cuda")
    with pytest.raises(GorgonError, match="whole numbers >= 0.*not 1.5"):
        build_tree([[0], [1.5]])
    with pytest.raises(GorgonError, match="from 2 .* to 256, not 10000"):
        tree_from_accuracies([[0.5, 0.1]], 10000)
    heads = MedusaHeads.for_target(tiny_model(), num_heads=2)  # a vocabulary of 64
    with pytest.raises(GorgonError, match="asks for rank 64 but the heads draft from 64 tokens"):
        MedusaDrafter(heads, tree=[[0], [64]])
    with pytest.raises(GorgonError, match="1 to 64 tokens per step, not 100000"):
        DraftModelDrafter(tiny_model(), 100000)
    # On the command line the same checks fail at once, before any model is loaded.
    assert gorgon(["generate", "--heads", "nowhere", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert capsys.readouterr().err.strip() == ("gorgon generate: error: temperature must be a finite number >= 0 "
                                               "(0 is greedy), not -1.0")
    (tmp_path / "tree.json").write_text("[[0], [1]]")
    assert gorgon(["generate", "--draft", "nowhere", "--prompt", "hi", "--tree", str(tmp_path / "tree.json")]) == 2
    assert "--tree takes a node count with --draft, not rank paths" in capsys.readouterr().err
    assert gorgon(["generate", "--draft", "nowhere", "--prompt", "hi", "--draft-depth", "3"]) == 2
    assert "(a --draft model drafts --draft-tokens levels)" in capsys.readouterr().err
    assert gorgon(["generate", "--context-draft", "--prompt", "hi", "--draft-level-cost", "0.1"]) == 2
    assert "--draft-level-cost stops a search's levels: it needs --draft or --heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gorgon(["generate", "--draft", "x", "--prompt", "hi", "--draft-level-cost", "cheap"])
    assert "--draft-level-cost: expected auto or a number of target steps >= 0, not 'cheap'" in capsys.readouterr().err
    with pytest.raises(GorgonError, match="to 256 nodes, not 300"):
        DraftModelDrafter(tiny_model(), 4, topk=2, nodes=300)
    with pytest.raises(GorgonError, match="top-k must be a whole number >= 1, not 0"):
        DraftModelDrafter(tiny_model(), 4, topk=0)
    with pytest.raises(SystemExit):
        gorgon(["bench", "--heads", "x", "--questions", "q", "--limit", "0"])
    assert "--limit: must be at least 1, not 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gorgon(["generate", "--draft", "x", "--prompt", "hi", "--draft-tokens", "65"])
    assert "--draft-tokens: must be at most 64, not 65" in capsys.readouterr().err
    for bad in ("-3", "1", "300"):  # a node count (it was "tree file -3 not found"), checked before any model loads
        with pytest.raises(GorgonError, match=rf"^--tree {bad}: a tree needs 2 \(the root and one candidate\) to 256 "
                                              r"nodes$"):
            read_tree(bad)
    assert read_tree("8") == 8
    for argv, says in [(["--acceptance", "typical"], "typical acceptance (--acceptance typical) needs a temperature > "
                                                     "0 (--temperature)"),
                       (["--stop", ""], "an empty stop string (--stop '') would end the output at its first token"),
                       (["--system", "be brief", "--raw"], "--system goes through the chat template, which --raw "
                                                           "skips")]:
        # the target named does not exist: refused before it would load
        assert gorgon(["generate", "--target", str(tmp_path / "no-target"), "--context-draft", "--prompt", "hi",
                       *argv]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(GorgonError, match="from 2 .* to 256, not -3"):
        MedusaDrafter(heads, tree=-3)
    with pytest.raises(GorgonError, match=r"an empty stop string \(--stop ''\) would end the output at its first"):
        speculative_generate(tiny_model(), MedusaDrafter(heads), torch.tensor([[1, 2, 3]]), stop_strings=["", "."],
                             tokenizer=tiny_tokenizer())


def test_options_that_cannot_apply_are_refused_before_the_target_loads(tmp_path, capsys):
    """Each was refused only after the target had loaded (seconds here, minutes for a large target), or not at
    all (--top-p with greedy decoding did nothing). The target named here does not exist, so a refusal that
    came after its load would name it instead."""
    from helpers import QUESTIONS, questions_file

    heads, nowhere = tmp_path / "heads", str(tmp_path / "no-target")
    MedusaHeads.for_target(tiny_model()).save_pretrained(heads)
    questions = str(questions_file(tmp_path / "q.jsonl", QUESTIONS[:1]))
    medusa = ["--heads", str(heads), "--target", nowhere]
    bench = ["bench", "--questions", questions, "--target", nowhere]
    tiny, toy = tmp_path / "config-only", toy_data(tmp_path / "toy.jsonl", n=8)
    tiny.mkdir()  # a target whose config reads and whose weights do not load
    shutil.copy(tiny_chat_target(tmp_path) / "config.json", tiny)
    capsys.readouterr()
    cases = [
        (["generate", "--prompt", "hi", "--draft-depth", "3"] + medusa, "--draft-depth and --draft-topk shape an "
         "EAGLE head's search; Medusa heads draft one level per head: choose their tree with --tree"),
        (["generate", "--prompt", "hi", "--draft", str(tmp_path / "no-draft"), "--target", nowhere],
         f"no draft model at {tmp_path / 'no-draft'}: pass an existing folder or a hub id"),
        (["generate", "--prompt", "hi", "--context-draft", "--tree", "8", "--target", nowhere],
         "--tree sizes a --heads or --draft tree: --context-draft alone proposes what the context repeats"),
        (["generate", "--prompt", "hi", "--top-p", "0.9"] + medusa, "--top-p shapes sampling, and --temperature 0 "
         "decodes greedily: pass a --temperature above 0 too, or drop it"),
        (bench + ["--heads", str(heads), "--baselines", "no-context", "--out", str(tmp_path / "d" / "r.json")],
         "--baselines no-context times the --heads or --draft drafter without the context draft"),
        (bench + ["--heads", str(heads), "--assistant", str(tmp_path / "no-assistant"), "--top-k", "5"],
         f"no assistant model at {tmp_path / 'no-assistant'}"),
        (bench + ["--heads", str(heads), "--top-k", "5", "--top-p", "0.9"], "--top-k and --top-p shape sampling"),
        (["data", "--prompts", questions, "--target", nowhere, "--top-p", "0.9", "--out", str(tmp_path / "o")],
         "--top-p 0.9 samples, and --temperature 0 answers greedily"),
        (["draft", "--data", toy, "--target", str(tiny), "--out", str(tmp_path / "dr"), "--student-layers", "2"],
         "student_layers must be between 1 and 1 (the target has 2 layers), not 2"),
    ]
    if importlib.util.find_spec("vllm") is None:
        cases.append((["data", "--prompts", questions, "--target", nowhere, "--engine", "vllm", "--out",
                       str(tmp_path / "o")], "--engine vllm needs vLLM"))
    for argv, says in cases:
        assert gorgon(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, (argv, err)
    assert not (tmp_path / "d").exists()  # the refused bench's --out folder is not left behind
    # A bench that fails after taking its report's place leaves no folder it made either.
    assert gorgon(bench + ["--heads", str(heads), "--out", str(tmp_path / "e" / "f" / "r.json")]) == 2
    assert "no target at" in capsys.readouterr().err and not (tmp_path / "e").exists()


def test_the_python_api_takes_what_its_loaders_return_and_names_its_mistakes(tmp_path):
    """A `Target` where a model goes, loaded heads where a drafter goes, "bfloat16" or an absent device in
    from_pretrained, and Medusa heads in another dtype than the target failed inside torch or Python."""
    target = load_target(str(tiny_chat_target(tmp_path)), device="cpu")
    MedusaHeads.for_target(target.model).save_pretrained(tmp_path / "heads")
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    heads = MedusaHeads.from_pretrained(tmp_path / "heads", target=target)
    assert speculative_generate(target, MedusaDrafter(heads), ids, 6).tokens == \
        speculative_generate(target.model, MedusaDrafter(heads), ids, 6).tokens
    with pytest.raises(GorgonError, match="^drafter must be a drafter, not a MedusaHeads: wrap loaded heads as "
                                          r"gorgon.heads.drafter_for\(heads\)$"):
        speculative_generate(target, heads, ids, 6)
    with pytest.raises(GorgonError, match="^the target to load must be a folder, a hub id or None, not a Target: "
                                          "for heads onto a target loaded already, use gorgon.heads.load_heads_for"):
        load_heads(tmp_path / "heads", target=target)
    assert next(MedusaHeads.from_pretrained(tmp_path / "heads", dtype="bfloat16").parameters()).dtype == torch.bfloat16
    assert next(MedusaHeads.from_pretrained(tmp_path / "heads", target=target, dtype="auto").parameters()).dtype == \
        torch.float32
    if not torch.cuda.is_available():
        with pytest.raises(GorgonError, match="^device 'cuda' is not available on this machine: use cpu, or auto"):
            MedusaHeads.from_pretrained(tmp_path / "heads", device="cuda")
    with pytest.raises(GorgonError, match=r"^unknown tree 'trees.json': pass a list of rank paths \(a JSON file of "
                                          r"them: json.load it\), a node count or 'auto'$"):
        MedusaDrafter(heads, "trees.json")  # the command line reads such a file; Python is given the paths
    drafter = MedusaDrafter(MedusaHeads.from_pretrained(tmp_path / "heads"))
    with pytest.raises(GorgonError, match=r"^the heads are in torch.float32 on cpu but the target in torch.bfloat16 on "
                                          r"cpu: move them to the target's \(heads.to\('cpu', torch.bfloat16\)\)$"):
        speculative_generate(target.model.to(torch.bfloat16), drafter, ids, 6)


def test_a_generator_on_another_device_than_the_model_is_named():
    """A generator on cuda:0 passed the device type check for a model on cuda:1 and failed inside torch."""
    from types import SimpleNamespace

    from gorgon.decode.generate import same_device

    model = tiny_model("llama")
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2))
    elsewhere = SimpleNamespace(device=torch.device("cuda", 0))  # only its device is read before a draw
    with pytest.raises(GorgonError, match=r"^the generator is on cuda:0 but the model on cpu: create it with "
                                          r"torch.Generator\(device='cpu'\)$"):
        speculative_generate(model, drafter, torch.ones(1, 4, dtype=torch.long), 4, generator=elsewhere)
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert same_device(torch.device("cuda"), torch.device("cuda", 1)) and same_device(torch.device("cpu"),
                                                                                      torch.device("cpu"))


def test_python_arguments_of_the_wrong_kind_are_named(tmp_path):
    """Float ids, an EOS given as text, a number as stop strings and a string temperature failed inside torch or
    Python (or named only the value); a token map given as a list failed at .to()."""
    from gorgon.heads.methods.draft_model import cut_to_draft_vocab

    model = tiny_model()
    drafter = MedusaDrafter(MedusaHeads.for_target(model, num_heads=2), tree=[[0], [0, 0]])
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    for kwargs, says in [(dict(input_ids=ids.float()), r"^input_ids must be token ids \(an integer tensor\), not "
                                                       r"torch.float32: tokenizer\(text, return_tensors='pt'\)"),
                         (dict(eos_token_id="<|im_end|>"), r"^eos_token_id must be token ids, not '<\|im_end\|>': a "
                                                           r"token's id is tokenizer.convert_tokens_to_ids\(token\)$"),
                         (dict(stop_strings=123), r"^stop_strings must be text \(a string or a list of them\), not "
                                                  "123$")]:
        with pytest.raises(GorgonError, match=says):
            speculative_generate(model, drafter, **{"input_ids": ids, "max_new_tokens": 4, **kwargs})
    with pytest.raises(GorgonError, match=r"^temperature must be a finite number >= 0 \(0 is greedy\), not '0.7'$"):
        Sampling("0.7")
    with pytest.raises(GorgonError, match=r"^speculative_generate takes no temperature \(a generate argument\): pass "
                                          r"sampling=Sampling.like_generate\(model, temperature, top_k, top_p\)$"):
        speculative_generate(model, drafter, ids, 4, temperature=0.7)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'"):
        speculative_generate(model, drafter, ids, max_new_token=4)
    draft, token_map = tiny_model(), list(range(0, 64, 2))
    cut_to_draft_vocab(draft, torch.tensor(token_map))
    chain = DraftModelDrafter(draft, 3, token_map=token_map)
    assert speculative_generate(model, chain, ids, 6, eos_token_id=None).tokens == \
        model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)[0, 5:].tolist()


def test_a_drafter_on_another_device_than_the_target_is_named(tmp_path):
    """An EAGLE head or a draft model left on another device than the target passed the check and failed
    inside torch at the first step ("Expected all tensors to be on the same device"); Medusa heads were named.
    The meta device stands in for a GPU here."""
    from gorgon.heads import EagleDrafter

    model = tiny_model()
    ids = torch.randint(1, 50, (1, 5), generator=torch.Generator().manual_seed(0))
    head = EagleHead.for_target(model).to("meta")
    with pytest.raises(GorgonError, match=r"^the head is on meta but the target on cpu: move it to the target's "
                                          r"device \(.to\('cpu'\)\)$"):
        speculative_generate(model, EagleDrafter(head, nodes=4), ids, 6)
    draft = tiny_model(seed=1).to("meta")
    with pytest.raises(GorgonError, match=r"^the draft model is on meta but the target on cpu: move it"):
        speculative_generate(model, DraftModelDrafter(draft), ids, 6)
