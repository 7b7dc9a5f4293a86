"""Self-speculation (gorgon.heads.methods.self_spec): drafts from the target's own first layers equal a truncated
forward, the one cache after acceptance equals a full forward's, exact greedy and sampled decoding with trees
(alone and merged with context drafts), training through train/heads.py, its folder, bad input."""

import json

import pytest
import torch
from helpers import VOCAB, import_families, reference, tiny_chat_target, tiny_model, toy_data

from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.acceptance import accept_greedy
from gorgon.decode.verify import accepted_rows, keep_path, verify
from gorgon.heads import GorgonError, drafter_for, load_target
from gorgon.heads.cache import growing_cache, with_cache
from gorgon.heads.methods import method_of
from gorgon.heads.methods.context.drafter import ContextDrafter, MergedDrafter
from gorgon.heads.methods.self_spec import EarlyExit, SelfSpecDrafter

FAMILIES = ["llama", "qwen2"]


@pytest.fixture(autouse=True, scope="module")
def families_imported():
    import_families(FAMILIES)


def exit_for(model, n=2, seed=0):
    torch.manual_seed(seed)
    exit_ = EarlyExit.for_target(model, n, adapter_size=16)
    with torch.no_grad():  # not the starting point (a zero output layer): the adapter must count in the checks
        exit_.down_proj.weight.normal_(0, 0.3)
    return exit_


def later_layers_idle(model, n=2):
    """The target with layers n and on reduced to the identity: a plain early exit at n then drafts exactly what
    the target decodes, so every draft is accepted and deep trees are exercised."""
    with torch.no_grad():
        for layer in model.get_decoder().layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def prefilled(model, ids):
    """The target's cache after the prompt, its greedy next token (the first step's root) and its features."""
    cache = growing_cache()
    decoder = model.get_decoder()
    with torch.no_grad():
        out = decoder(input_ids=ids, **with_cache(decoder, cache), use_cache=True)
        return cache, model.lm_head(out.last_hidden_state[0, -1]).argmax(), out.last_hidden_state[0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_drafts_from_the_shared_layers_equal_a_truncated_forward(arch):
    model = tiny_model(arch, layers=4)
    exit_ = exit_for(model)
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    cache, root, _ = prefilled(model, ids)
    drafter = SelfSpecDrafter(exit_, nodes=6, depth=3, topk=2)
    drafter.attach_cache(cache)
    with torch.no_grad():
        drafter.scored_paths(root, None, ids[0])
        drafted = drafter.drafted
        assert drafted.past_len == 7 and drafted.paths[0] == () and len(drafted.paths) == drafted.hidden.shape[0]
        for path, hidden in zip(drafted.paths, drafted.hidden):
            tokens = torch.cat([ids[0], root.reshape(1), torch.tensor(path, dtype=torch.long)])[None]
            plain = model.get_decoder()(input_ids=tokens, output_hidden_states=True).hidden_states[2][0, -1]
            torch.testing.assert_close(hidden, plain, atol=1e-5, rtol=1e-5)
    assert cache.layers[0].keys.shape[-2] == 7 + len(drafted.paths)  # the draft wrote the first layers ...
    assert cache.layers[2].keys.shape[-2] == 7                          # ... and left the later ones


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_one_cache_after_acceptance_equals_a_full_forwards(arch):
    model = later_layers_idle(tiny_model(arch, layers=4))
    exit_ = EarlyExit.for_target(model, 2, adapter_size=16)  # drafts what the target decodes: deep paths accepted
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    cache, root, fresh = prefilled(model, ids)
    drafter = MergedDrafter(SelfSpecDrafter(exit_, nodes=5, depth=3, topk=2), ContextDrafter())
    drafter.attach_cache(cache)
    context = ids[0]
    with torch.no_grad():
        for _ in range(3):
            past = cache.get_seq_length()
            tokens, tree = drafter.propose(root, fresh, context)
            out = verify(model, cache, tokens, tree, drafted=drafter.drafted)
            path, emitted = accept_greedy(tree, tokens, model.lm_head(out.last_hidden_state[0]).argmax(-1))
            keep_path(cache, past, accepted_rows(path, tokens.device))
            context = torch.cat([context, tokens[list(path)]])
            fresh = out.last_hidden_state[0, list(path)]
            root = torch.tensor(emitted[-1])
        assert len(context) > 6 + 3  # drafts were accepted
        full = growing_cache()
        model.get_decoder()(input_ids=context[None], **with_cache(model.get_decoder(), full), use_cache=True)
    for ours, theirs in zip(cache.layers, full.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_equals_generate_with_trees_alone_and_merged(arch):
    for idle in (False, True):
        model = tiny_model(arch, layers=4)
        if idle:
            later_layers_idle(model)
        exit_ = exit_for(model) if not idle else EarlyExit.for_target(model, 2, adapter_size=16)
        for drafter in [SelfSpecDrafter(exit_, nodes=2, depth=1, topk=1),
                        SelfSpecDrafter(exit_, nodes=7, depth=3, topk=3),
                        MergedDrafter(SelfSpecDrafter(exit_, nodes=5, depth=4, topk=2), ContextDrafter())]:
            for seed in range(2):
                ids = torch.randint(0, VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
                result = speculative_generate(model, drafter, ids, max_new_tokens=30)
                assert result.tokens == reference(model, ids, 30)
                assert 0 < result.reused_rows <= result.verified_rows  # the root is always drafted
                if idle and drafter.max_nodes > 2:
                    assert max(result.accepted) >= 3  # paths two deep were accepted, not only bonus tokens


@pytest.mark.slow
def test_sampling_with_self_speculation_is_exact():
    """Each candidate of the tree is a point-mass proposal fixed by the context."""
    from test_sampling import chi_square_p, exact_distribution, sample_counts

    model = later_layers_idle(tiny_model("llama", vocab=8, seed=3, layers=4))
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    exit_ = exit_for(model)
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, accepted = sample_counts(model, prompt, s, SelfSpecDrafter(exit_, nodes=5, depth=2, topk=2))
    assert max(accepted) >= 2  # drafted candidates were accepted, not only bonus tokens
    assert chi_square_p(exact_distribution(model, prompt, s), counts) > 1e-3


def test_its_folder_loads_on_its_target_and_refuses_another(tmp_path):
    model = tiny_model("llama", layers=4)
    exit_ = exit_for(model)
    exit_.save_pretrained(tmp_path / "x")
    config = json.loads((tmp_path / "x" / "config.json").read_text())
    assert config["arch"] == "self_spec" and config["exit_layer"] == 2
    assert method_of(tmp_path / "x").name == "self_spec"
    loaded = EarlyExit.from_pretrained(tmp_path / "x", target=model)
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(loaded.logits(hidden), exit_.logits(hidden))
    for other, message in [(tiny_model("llama", vocab=32, layers=4), "of a vocabulary of 64, but the target has 32"),
                           (tiny_model("llama", layers=6), "trained for a target of 4 layers, and this one has 6")]:
        with pytest.raises(GorgonError, match=message):
            EarlyExit.from_pretrained(tmp_path / "x", target=other)


def test_bad_input_is_one_line():
    from gorgon.train.heads import HeadsTrainConfig

    model = tiny_model("llama", layers=4)
    exit_ = exit_for(model)
    gemma3_exit = EarlyExit.for_target(tiny_model("gemma3", layers=4), 2)  # two rotary embeddings, by layer type
    for make, message in [
        (lambda: EarlyExit.for_target(model, 4), "exit_layer must be a whole number from 1 to 3 .* not 4"),
        (lambda: EarlyExit.for_target(model, 0), "exit_layer must be a whole number from 1 to 3"),
        (lambda: EarlyExit.for_target(model, 2, adapter_size=0), "adapter_size is the width of the exit's MLP"),
        (lambda: drafter_for(exit_, [[0], [1]]), "builds its tree each step: pass --tree N"),
        (lambda: SelfSpecDrafter(exit_).check_target(tiny_model("llama", layers=4)), "drafts with the target it was "
                                                                                      "loaded on"),
        (lambda: HeadsTrainConfig(data="x", out="y", arch="self_spec", adapter_size=0).check(), "^adapter_size is"),
        (lambda: SelfSpecDrafter(gemma3_exit).check_target(gemma3_exit.target), "gemma3_text's forward cannot be "
                                                                                "run a span of layers at a time"),
    ]:
        with pytest.raises(GorgonError, match=message):
            make()


def test_an_exit_layer_past_the_targets_is_refused_before_training(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig, train

    target_path = tiny_chat_target(tmp_path)
    with pytest.raises(GorgonError, match="exit_layer must be a whole number from 1 to 1 .* not 5"):
        train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(tmp_path / "x"), target=str(target_path),
                               arch="self_spec", exit_layer=5, max_steps=1, report_to="none"))


@pytest.mark.slow
def test_training_through_the_heads_trainer_gives_an_exit_that_decodes_exactly(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig, train

    target_path = tiny_chat_target(tmp_path, layers=4)
    out = tmp_path / "x"
    train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(out), target=str(target_path),
                           arch="self_spec", exit_layer=2, adapter_size=16, max_steps=3, batch_size=4,
                           report_to="none", save_every=0, draft_vocab_size=100, draft_depth=3, draft_topk=2))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["arch"] == "self_spec" and len(metrics["top1"]) == 1
    assert "self-speculation exit" in (out / "README.md").read_text()
    assert method_of(out).name == "self_spec"
    target = load_target(str(target_path), device="cpu")
    exit_ = EarlyExit.from_pretrained(out, target=target)
    assert exit_.config.draft_vocab_size == 100 and exit_.config.depth == 3
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "count from 3"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    result = speculative_generate(target.model, drafter_for(exit_, "auto"), ids, max_new_tokens=24)
    assert result.tokens == reference(target.model, ids, 24)
    from gorgon.heads.cli import main as gorgon

    common = ["generate", "--heads", str(out), "--target", str(target_path), "--raw", "--prompt", "count from 3",
              "--max-new-tokens", "12", "--stats"]
    assert gorgon(common) == 0 and gorgon(common + ["--context-draft"]) == 0
