"""Speculative sampling has exactly the target's distribution.

On a model with a vocabulary of 8, the exact probability of every 3-token continuation is
enumerated; samples from the speculative sampler must fit it by a chi-square test, and the
same test must reject a deliberately broken acceptance rule.
"""

import itertools

import pytest
import torch
from helpers import TargetRolloutDrafter, tiny_model
from scipy.stats import chisquare

import gorgon.decode.acceptance as acceptance
from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.acceptance import accept_typical, target_probs
from gorgon.heads import GorgonError
from gorgon.heads.tree import build_tree

V, N_NEW, SAMPLES = 8, 4, 3000
# Depth 2: after the prefill's token, one step verifies the whole tree (a node whose next token the output has
# no room for is not verified) and may emit the remaining 3 new tokens.
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.fixture(scope="module")
def peaky_model():
    model = tiny_model("llama", vocab=V, seed=3)
    with torch.no_grad():  # sharper distributions, so a few outcomes hold most of the mass
        model.lm_head.weight.mul_(40)
    return model


def exact_distribution(model, prompt, s: Sampling):
    """P(continuation) for all V**N_NEW continuations, from plain forwards."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=N_NEW)))
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        logits = model(full).logits[:, prompt.shape[1] - 1: -1]        # predictions for each new token
    probs = target_probs(logits, s).gather(2, seqs[..., None])[..., 0]
    return {tuple(seq.tolist()): float(p) for seq, p in zip(seqs, probs.prod(1))}


def sample_counts(model, prompt, s: Sampling, drafter=None):
    drafter = drafter or TargetRolloutDrafter(model, PATHS)
    gen = torch.Generator().manual_seed(1234)
    counts, accepted = {}, []
    for _ in range(SAMPLES):
        result = speculative_generate(model, drafter, prompt, max_new_tokens=N_NEW, sampling=s, generator=gen)
        key = tuple(result.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted.extend(result.accepted[1:])
    return counts, accepted


def chi_square_p(exact, counts):
    """Chi-square p-value, cells with expected count < 5 pooled into one."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for key, p in exact.items():
        e = p * SAMPLES
        if e >= 5:
            obs.append(counts.get(key, 0))
            exp.append(e)
        else:
            pool_o += counts.get(key, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    elif pool_o > 0:
        return 0.0  # an impossible continuation was sampled
    assert len(obs) >= 6, "too few cells for a meaningful test"
    scale = sum(obs) / sum(exp)  # the exact probabilities sum to 1 only up to rounding
    return chisquare(obs, [e * scale for e in exp]).pvalue


@pytest.mark.slow
@pytest.mark.parametrize("s", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5, top_p=0.9)])
def test_speculative_sampling_is_exact(peaky_model, s):
    prompt = torch.tensor([[1, 5, 2]])
    counts, accepted = sample_counts(peaky_model, prompt, s)
    assert max(accepted) >= 3  # tree candidates, not only bonus tokens, were accepted
    assert chi_square_p(exact_distribution(peaky_model, prompt, s), counts) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("topk", [1, 3])  # a chain, and a tree of the draft's likeliest continuations
def test_sampling_with_a_draft_model_is_exact(peaky_model, topk):
    from gorgon.heads import DraftModelDrafter

    draft = tiny_model("llama", vocab=V, seed=4)
    with torch.no_grad():
        draft.lm_head.weight.mul_(40)
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, _ = sample_counts(peaky_model, prompt, s, DraftModelDrafter(draft, k=2, topk=topk))
    assert chi_square_p(exact_distribution(peaky_model, prompt, s), counts) > 1e-3


@pytest.mark.slow
def test_a_broken_acceptance_rule_fails_the_test(peaky_model, monkeypatch):
    """Accepting each child with p(c) without renormalising after rejections skews the output."""
    monkeypatch.setattr(acceptance, "child_accept_chances", lambda child_p: child_p)
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, _ = sample_counts(peaky_model, prompt, s)
    assert chi_square_p(exact_distribution(peaky_model, prompt, s), counts) < 1e-6


@pytest.mark.parametrize("arch", ["granite", "cohere", "llama"])
def test_the_target_logits_are_its_forwards_also_where_it_scales_them(arch):
    """Granite divides its LM head's output by logits_scaling, Cohere multiplies it by logit_scale: gorgon's
    logits (decoder, then LM head) took neither, so it sampled from another temperature than the model's."""
    from gorgon.heads.target import lm_logits, logit_scale

    model = tiny_model(arch)
    ids = torch.tensor([[5, 7, 9, 11]])
    with torch.no_grad():
        assert torch.allclose(lm_logits(model, model.get_decoder()(ids).last_hidden_state), model(ids).logits,
                              atol=1e-6)
    assert logit_scale(model) == {"granite": 0.25, "cohere": 0.25, "llama": 1.0}[arch]


def test_logits_changed_otherwise_than_by_a_scale_are_refused():
    model = tiny_model("llama")
    forward = model.forward
    model.forward = lambda *a, **k: type(out := forward(*a, **k))(logits=out.logits ** 2)
    with pytest.raises(GorgonError, match="LlamaForCausalLM changes its logits after its LM head in a way gorgon "
                                          r"does not reproduce \(not a scale\)"):
        speculative_generate(model, TargetRolloutDrafter(model, PATHS), torch.tensor([[1, 2]]), max_new_tokens=2,
                             sampling=Sampling(temperature=1.0))


@pytest.mark.slow
def test_sampling_is_exact_where_the_forward_scales_the_logits():
    model = tiny_model("granite", vocab=V, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(160)  # four times the peaky model's: Granite divides by 4
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, _ = sample_counts(model, prompt, s)
    assert chi_square_p(exact_distribution(model, prompt, s), counts) > 1e-3


@pytest.mark.slow
def test_a_token_two_siblings_propose_keeps_its_probability():
    """A drafter may propose one token twice among siblings (a draft vocabulary listing an id twice did): the
    second try must not give it its chance again, or it comes out with about twice its probability."""
    tree = build_tree([[0], [1], [2]])
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).expand(tree.size, -1)
    gen = torch.Generator().manual_seed(0)
    for tokens in ([3, 2, 2, 1], [3, 2, 1, 2]):  # the repeat next to, and after another sibling
        counts = torch.zeros(4)
        for _ in range(4000):
            _, emitted = acceptance.accept_sampled(tree, torch.tensor(tokens), probs, gen)
            counts[emitted[0]] += 1
        assert chisquare(counts.tolist(), (probs[0] * 4000).tolist()).pvalue > 1e-3, (tokens, counts)


def test_a_chains_drafts_are_tried_independently_and_the_bonus_comes_from_the_last_accepted():
    """A chain root -> 1 -> 2, each draft with chance 0.5 under the target: reject the first (0.5), take the first
    and reject the second (0.25), take both (0.25), each ending with a bonus drawn where the path stopped. One
    draw shared by the depths took both drafts half the time; a bonus from the last node's parent is another
    outcome. (The chi-square tests on tiny models find these too, in the slow suite.)"""
    tree = build_tree([[0], [0, 0]])
    probs = torch.zeros(3, 8)
    probs[0, [1, 0]] = 0.5   # at the root: draft 1, or the residual's 0
    probs[1, [2, 3]] = 0.5   # after 1: draft 2, or the residual's 3
    probs[2, 7] = 1.0        # after 2: 7
    expected = {(0,): 0.5, (1, 3): 0.25, (1, 2, 7): 0.25}
    gen = torch.Generator().manual_seed(0)
    counts = dict.fromkeys(expected, 0)
    for _ in range(4000):
        _, emitted = acceptance.accept_sampled(tree, torch.tensor([5, 1, 2]), probs, gen)
        assert tuple(emitted) in counts, emitted
        counts[tuple(emitted)] += 1
    assert chisquare(list(counts.values()), [4000 * p for p in expected.values()]).pvalue > 1e-3, counts


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 10, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.5)])
def test_target_probs_match_transformers_warpers(temperature, top_k, top_p):
    from transformers import GenerationConfig
    from transformers.generation.utils import GenerationMixin

    logits = torch.randn(4, 50) * 3
    logits[3] = float("-inf")
    logits[3, :4] = 10.0  # four equal tokens, 0.25 each: top-p 0.5 lands exactly on a cumulative sum
    cfg = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p)
    processors = GenerationMixin._get_logits_processor(
        tiny_model("llama"), generation_config=cfg, input_ids_seq_length=1, encoder_input_ids=None,
        prefix_allowed_tokens_fn=None, logits_processor=[])
    theirs = processors(torch.zeros(4, 1, dtype=torch.long), logits.clone()).softmax(-1)
    mine = target_probs(logits, Sampling(temperature, top_k, top_p))
    torch.testing.assert_close(mine, theirs)


def test_top_p_drops_what_transformers_drops_ties_at_the_cut_included():
    """Top-p finds its cut on numpy's sorted values on a CPU (torch's sort cost 22 ms a step for a tree of 8
    rows of 49,152): the same tokens as transformers' warper, bit for bit, in rows whose cut splits equal
    values too, where the order torch's sort leaves them in decides (those rows go through it)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    import gorgon.decode.acceptance as acceptance

    torch.manual_seed(0)
    sorted_by_torch = []
    through_torch = acceptance.dropped_in_sorted_order

    def counted(rows, top_p):
        sorted_by_torch.append(rows.shape[0])
        return through_torch(rows, top_p)

    for trial in range(60):
        logits = torch.randn(6, 3000) * (1 + trial % 4)
        if trial % 2:
            logits = logits.round(decimals=1)  # many equal values, some of them at the cut
        logits[0, :1500] = float("-inf")  # top-k's masked tokens
        top_p = (0.3, 0.8, 0.9, 0.95)[trial % 4]
        theirs = TopPLogitsWarper(top_p)(torch.zeros(6, 1, dtype=torch.long), logits.clone()) == float("-inf")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(acceptance, "dropped_in_sorted_order", counted)
            mine = acceptance.top_p_dropped(logits, top_p)
        assert torch.equal(mine, theirs), trial
    assert 0 < sum(sorted_by_torch) < 60 * 6 / 2  # rows whose cut splits equal values (many, where values repeat)


@pytest.mark.slow
def test_sampling_with_a_feature_level_head_is_exact(peaky_model):
    """EAGLE-2's dynamic trees: the tree differs step to step, each candidate still a point-mass proposal."""
    from gorgon.heads import EagleDrafter, EagleHead

    torch.manual_seed(0)
    head = EagleHead.for_target(peaky_model)
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, accepted = sample_counts(peaky_model, prompt, s, EagleDrafter(head, nodes=7, depth=2, topk=3))
    assert max(accepted) >= 2  # drafted candidates were accepted, not only bonus tokens
    assert chi_square_p(exact_distribution(peaky_model, prompt, s), counts) > 1e-3


@pytest.mark.slow
def test_sampling_with_merged_heads_and_context_is_exact(peaky_model):
    """Candidates from lookup and from a drafter, merged in one tree, are point-mass proposals like a head's."""
    from gorgon.heads import ContextDrafter, MergedDrafter

    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2, 1, 5, 2, 1, 5]])  # repeats: lookup proposes 2, 1, 5, ...
    drafter = MergedDrafter(TargetRolloutDrafter(peaky_model, [[0], [1], [0, 0]]), ContextDrafter(2, 3, 2), budget=6)
    counts, accepted = sample_counts(peaky_model, prompt, s, drafter)
    assert max(accepted) >= 3
    assert chi_square_p(exact_distribution(peaky_model, prompt, s), counts) > 1e-3


def test_typical_acceptance_takes_likely_drafts_and_needs_a_temperature(peaky_model):
    """The lossy rule runs through the same loop: drafts the target finds likely pass it, deep."""
    prompt = torch.tensor([[1, 5, 2]])
    drafter = TargetRolloutDrafter(peaky_model, PATHS)
    out = speculative_generate(peaky_model, drafter, prompt, max_new_tokens=12, sampling=Sampling(temperature=1.0),
                               acceptance="typical", generator=torch.Generator().manual_seed(0))
    assert len(out.tokens) == 12 and max(out.accepted) >= 3
    with pytest.raises(GorgonError, match=r"typical acceptance \(--acceptance typical\) needs a temperature > 0"):
        speculative_generate(peaky_model, drafter, prompt, max_new_tokens=4, acceptance="typical")


def test_a_seeded_generator_alone_decides_the_samples(peaky_model):
    """Every draw, the first token's included, takes the generator: the global seed changes nothing."""
    prompt, drafter = torch.tensor([[1, 5, 2]]), TargetRolloutDrafter(peaky_model, PATHS)
    runs = []
    for seed in range(2):
        torch.manual_seed(seed)
        runs.append(speculative_generate(peaky_model, drafter, prompt, max_new_tokens=8, sampling=Sampling(1.5),
                                         generator=torch.Generator().manual_seed(7)).tokens)
    assert runs[0] == runs[1]


def test_typical_acceptance_judges_each_token_by_its_parents_distribution():
    """Medusa's rule on a hand-made tree: a token passes when its probability after its parent exceeds
    min(threshold, alpha * exp(-entropy)) of the parent's distribution; the deepest passing path wins,
    the better-ranked node on a tie, and the bonus is drawn at its end."""
    tree = build_tree([[0], [1], [0, 0]])         # root; 1 and 2 under it; 3 under 1
    tokens = torch.tensor([0, 1, 2, 3])
    probs = torch.full((4, 8), 1 / 8)
    probs[0] = 0.1 / 6
    probs[0, [1, 2]] = torch.tensor([0.5, 0.4])   # peaked: limit 0.09; tokens 1 and 2 pass
    probs[1] = 0.94 / 7
    probs[1, 3] = 0.06                            # flat: limit 0.3 * exp(-2.05) = 0.039; token 3 passes
    probs[3] = torch.eye(8)[7]                    # peaked (limit 0.09): token 3 would fail under it; the bonus is 7
    generator = torch.Generator().manual_seed(0)
    assert accept_typical(tree, tokens, probs, generator) == ((0, 1, 3), [1, 3, 7])
    probs[1, 3] = 0.01                            # now token 3 fails: nodes 1 and 2 tie at depth 1
    assert accept_typical(tree, tokens, probs, generator)[0] == (0, 1)


def test_sampling_like_generate_is_what_generate_would_sample_from():
    """`gorgon generate --temperature T` (and `Sampling.like_generate`) samples as `model.generate(do_sample=True,
    temperature=T)` does: a top-k or top-p not given is the model's generation_config's, else transformers'
    defaults (it sampled from the whole vocabulary, where generate keeps the top 50)."""
    from transformers import GenerationConfig

    model = tiny_model("llama")
    defaults = GenerationConfig._get_default_generation_params()
    expected = Sampling(0.7, defaults["top_k"], defaults["top_p"])
    assert Sampling.like_generate(model, 0.7) == expected == Sampling(0.7, 50)
    model.generation_config.top_k, model.generation_config.top_p = 20, 0.8  # as Qwen2.5-Instruct's config sets
    assert Sampling.like_generate(model, 0.7) == Sampling(0.7, 20, 0.8)
    assert Sampling.like_generate(model, 0.7, top_k=0, top_p=1.0) == Sampling(0.7, 0, 1.0)


def test_the_bonus_never_brings_back_a_rejected_child_however_little_mass_is_left():
    """Children holding all but 5e-4 of the mass, each rejected: the bonus comes from the rest alone. (Taking a
    residual below 1e-3 for empty, as a mutation did, drew from the whole distribution: no chi-square test
    sees an error that small.)"""
    tree = build_tree([[0], [1], [2]])
    tokens = torch.tensor([3, 0, 1, 2])  # the root (any token), then its children
    probs = torch.zeros(tree.size, 4)
    probs[0] = torch.tensor([0.5, 0.3, 0.1995, 0.0005])
    probs[1:] = 0.25
    original = acceptance.child_accept_chances
    try:
        acceptance.child_accept_chances = lambda child_p: torch.zeros_like(child_p)  # every child rejected
        bonuses = {acceptance.accept_sampled(tree, tokens, probs, torch.Generator().manual_seed(i))[1][-1]
                   for i in range(200)}
    finally:
        acceptance.child_accept_chances = original
    assert bonuses == {3}


def test_each_row_draws_from_its_own_probabilities_and_never_a_token_of_none(monkeypatch):
    """The bonus draw (`sample_rows`, for torch.multinomial's 7.6 ms over a tree's rows on a CPU): frequencies as
    the probabilities, and a token of probability 0 never drawn, whatever the uniform number is."""
    from scipy.stats import chisquare

    from gorgon.decode.acceptance import sample_rows

    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_rows(probs, generator) for _ in range(4000)])
    assert set(draws[:, 1].tolist()) == {2}
    counts = torch.bincount(draws[:, 0], minlength=6)
    assert counts[[0, 2, 5]].sum() == 0 and chisquare(counts[[1, 3, 4]], [800, 1200, 2000]).pvalue > 1e-3
    for u in (0.0, 1.0 - 2**-53):  # the ends of torch.rand's range
        monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u, dtype=torch.float64))
        assert sample_rows(probs).tolist() == ([1, 2] if u == 0 else [4, 2])
