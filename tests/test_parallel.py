"""The parallel drafter (gorgon.heads.methods.parallel): a block of k drafts in one forward that equals the same
computation position by position, exact greedy and sampled decoding, its cache, its folder on the registry,
training through train/heads.py, bad input."""

import json

import pytest
import torch
from helpers import VOCAB, import_families, reference, tiny_chat_target, tiny_model, toy_data

from gorgon.decode import Sampling, speculative_generate
from gorgon.heads import GorgonError, drafter_for, load_target
from gorgon.heads.masks import additive_mask
from gorgon.heads.methods import method_of
from gorgon.heads.methods.parallel import ParallelDrafter, ParallelHead

FAMILIES = ["llama", "qwen2"]


@pytest.fixture(autouse=True, scope="module")
def families_imported():
    import_families(FAMILIES)


def head_for(model, block_size=4, seed=0):
    torch.manual_seed(seed)
    head = ParallelHead.for_target(model, block_size)
    with torch.no_grad():  # not the starting point: every weight matters in the checks below
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


def pairs(head, n, seed=0):
    """Random target features (n, F) and the tokens of a context (n,), and a root token."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n, len(head.feature_layers) * head.config.hidden_size, generator=generator)
    context = torch.randint(0, VOCAB, (n,), generator=generator)
    return features, context, torch.randint(0, VOCAB, (), generator=generator)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_blocks_one_forward_equals_its_positions_drafted_one_by_one(arch):
    """The mask is causal: position j reads the context and positions 0 .. j - 1 only, so feeding the positions one
    at a time into a cache gives the same k outputs; and position 0 is the EAGLE head's first draft."""
    from gorgon.heads.cache import growing_cache

    model = tiny_model(arch, layers=4)
    head = head_for(model, block_size=4).eval()
    features, context, root = pairs(head, 7)
    block = ParallelDrafter(head).block(root, features, context)  # (4, V), one forward
    n, k = 7, 4
    tokens = torch.cat([context[1:], root.reshape(1)])
    fed, embedded = head.inputs(features[None], tokens[None], k - 1)
    cache, rows = growing_cache(), []
    with torch.no_grad():
        for i in range(n + k - 1):  # one position a forward, each seeing every key cached before it
            rope = head.rope(torch.tensor([[i]]), fed.dtype)
            out = head.layer(fed[:, i:i + 1], embedded[:, i:i + 1], rope, torch.zeros(1, 1, 1, i + 1), cache)
            rows.append(out[0, 0])
        one_by_one = head.logits(torch.stack(rows[n - 1:])).float().log_softmax(-1)
        eagle = head.eagle  # the EAGLE head's layer over the same context, causal
        causal = additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), fed.dtype)[None, None]
        first = eagle.logits(eagle.layer(eagle.fc(features[None]), tokens[None], eagle.rope(torch.arange(n)[None],
                                                                                            fed.dtype), causal))
    torch.testing.assert_close(block, one_by_one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block[0], first[0, -1].float().log_softmax(-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(block[1], block[2])  # the mask positions differ by where they sit


def test_the_drafters_cache_follows_the_accepted_tokens():
    """Every step's block, drafted from the cache the drafter keeps, equals a fresh drafter's on the whole context."""
    model = tiny_model("llama", vocab=8, layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    head = head_for(model, seed=1)
    drafter, seen = ParallelDrafter(head, tree=12), []
    block = drafter.block

    def recording(root, features, context):
        seen.append((root, context.clone(), block(root, features, context)))
        return seen[-1][2]

    drafter.block = recording
    ids = torch.randint(0, 8, (1, 6), generator=torch.Generator().manual_seed(0))
    result = speculative_generate(model, drafter, ids, max_new_tokens=20)
    assert max(result.accepted) >= 2 and len(seen) > 3
    layers = list(head.feature_layers)
    for root, context, drafted in seen:
        with torch.no_grad():
            states = model(context[None], output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0] for i in layers], dim=-1)
        torch.testing.assert_close(drafted, ParallelDrafter(head).block(root, features, context), rtol=1e-4, atol=1e-4)


def distilled(arch, steps=40):
    """A tiny target of 8 tokens and a drafter trained a few steps on its own greedy continuations (the objective
    train/heads.py runs), so that the mask positions draft something the target accepts."""
    from gorgon.heads.feature_cache import FeatureCache
    from gorgon.heads.methods.parallel.objective import ParallelObjective

    model = tiny_model(arch, vocab=8, layers=4)  # a small vocabulary: drafts are often right, so paths go deep
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    prompts = torch.randint(0, 8, (8, 4), generator=torch.Generator().manual_seed(0))
    ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=28, do_sample=False)
    head = head_for(model, seed=1)
    objective = ParallelObjective(model, head, cache=FeatureCache())  # the target runs once
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    ones = torch.ones_like(ids)
    for _ in range(steps):
        loss, stats, _ = objective(ids, ones, ones)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, head.eval(), stats


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_equals_generate_with_chains_and_trees(arch):
    model, head, stats = distilled(arch)
    assert stats[3]["top1"] > 0.5 * stats[3]["count"]  # the last mask position learnt the target's continuations
    accepted = []
    for tree in [None, 2, 8, 40, [[0], [1], [0, 0], [0, 0, 0]]]:  # None: the block's top-1 chain
        drafter = drafter_for(head, tree)
        for seed in range(2):
            ids = torch.randint(0, 8, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
            result = speculative_generate(model, drafter, ids, max_new_tokens=30)
            assert result.tokens == reference(model, ids, 30)
            accepted += result.accepted
    assert max(accepted) >= 3  # paths two deep were accepted, not only bonus tokens


@pytest.mark.slow
def test_sampling_with_a_parallel_drafter_is_exact():
    """Each candidate of the tree is a point-mass proposal, as a Medusa head's."""
    from test_sampling import chi_square_p, exact_distribution, sample_counts

    model = tiny_model("llama", vocab=8, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    torch.manual_seed(0)
    head = ParallelHead.for_target(model, block_size=2)
    s = Sampling(temperature=1.0)
    prompt = torch.tensor([[1, 5, 2]])
    counts, accepted = sample_counts(model, prompt, s, ParallelDrafter(head, tree=7))
    assert max(accepted) >= 2  # drafted candidates were accepted, not only bonus tokens
    assert chi_square_p(exact_distribution(model, prompt, s), counts) > 1e-3


@pytest.mark.parametrize("arch", FAMILIES)
def test_its_folder_is_its_methods_and_loads_to_draft_the_same(tmp_path, arch):
    model = tiny_model(arch, layers=4)
    head = head_for(model, block_size=3)
    head.save_pretrained(tmp_path / "p")
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["arch"] == "parallel" and config["block_size"] == 3
    assert method_of(tmp_path / "p").name == "parallel"
    loaded = ParallelHead.from_pretrained(tmp_path / "p", target=model)
    features, context, root = pairs(head, 5)
    assert torch.equal(ParallelDrafter(head).block(root, features, context),
                       ParallelDrafter(loaded).block(root, features, context))


def test_bad_input_is_one_line(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig

    model = tiny_model("llama", layers=4)
    head = head_for(model, block_size=2)
    head.save_pretrained(tmp_path / "p")
    for make, message in [
        (lambda: ParallelHead.for_target(model, block_size=0), "block_size is the number of drafts a forward makes: "
                                                               "use a whole number >= 1, not 0"),
        (lambda: HeadsTrainConfig(data="x", out="y", arch="parallel", block_size=0).check(), "^block_size is the"),
        (lambda: ParallelDrafter(head, tree=[[0], [0, 0], [0, 0, 0]]), "the tree is 3 deep but the drafter drafts a "
                                                                       "block of 2: use a tree at most 2 deep"),
        (lambda: ParallelDrafter(head, tree="wide"), "unknown tree 'wide'"),
        (lambda: drafter_for(head, None, depth=2), "--draft-depth and --draft-topk shape an EAGLE head's "
                                                   "search; a parallel drafter drafts its whole block in one forward"),
        (lambda: HeadsTrainConfig(data="x", out="y", arch="parallel", ttt_steps=2).check(),
         "ttt_steps is a key of arch: eagle"),
        (lambda: HeadsTrainConfig(data="x", out="y", arch="parallel", start_from="h", draft_vocab_size=20).check(),
         "start_from keeps the EAGLE head's feature layers and draft vocabulary"),
        (lambda: ParallelHead.from_pretrained(tmp_path / "p", target=tiny_model("llama", vocab=32, layers=4)),
         "of a vocabulary of 64, but the target has 32"),  # another target
    ]:
        with pytest.raises(GorgonError, match=message):
            make()


@pytest.mark.slow
def test_training_through_the_heads_trainer_gives_a_drafter_that_decodes_exactly(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig, train

    target_path = tiny_chat_target(tmp_path)
    out = tmp_path / "p"
    train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(out), target=str(target_path),
                           arch="parallel", block_size=3, max_steps=3, batch_size=4, report_to="none", save_every=0,
                           draft_vocab_size=100))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["arch"] == "parallel" and len(metrics["top1"]) == 3 and len(metrics["rank_accuracy"]) == 3
    assert "parallel draft head" in (out / "README.md").read_text()
    assert method_of(out).name == "parallel"
    target = load_target(str(target_path), device="cpu")
    head = ParallelHead.from_pretrained(out, target=target)
    assert head.accuracies == metrics["rank_accuracy"] and head.config.draft_vocab_size == 100
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "count from 3"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    result = speculative_generate(target.model, drafter_for(head, "auto"), ids, max_new_tokens=24)
    assert result.tokens == reference(target.model, ids, 24)
    from gorgon.heads.cli import main as gorgon

    common = ["generate", "--heads", str(out), "--target", str(target_path), "--raw", "--prompt", "count from 3",
              "--max-new-tokens", "12"]
    assert gorgon(common) == 0 and gorgon(common + ["--context-draft"]) == 0  # merged: its scored paths


@pytest.mark.slow
def test_start_from_a_feature_level_head_keeps_its_layers_and_first_draft(tmp_path):
    from gorgon.heads import EagleHead
    from gorgon.train.heads import HeadsTrainConfig, train

    target_path = tiny_chat_target(tmp_path)
    target = load_target(str(target_path), device="cpu")
    torch.manual_seed(0)
    eagle = EagleHead.for_target(target.model, target_name=target.name, target_fingerprint=target.fingerprint,
                                 draft_tokens=torch.arange(90))
    eagle.save_pretrained(tmp_path / "eagle")
    train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(tmp_path / "p"), target=str(target_path),
                           arch="parallel", start_from=str(tmp_path / "eagle"), max_steps=0, report_to="none",
                           save_every=0))
    head = ParallelHead.from_pretrained(tmp_path / "p", target=target)
    assert head.config.draft_vocab_size == 90
    assert all(torch.equal(v, eagle.state_dict()[k]) for k, v in head.eagle.state_dict().items())


def test_a_block_of_one_trains_no_mask_vectors(tmp_path):
    """Its only position is the EAGLE head's: the mask vectors get no gradient, so they are not trained
    (DDP would refuse them)."""
    from gorgon.heads.methods import by_name
    from gorgon.train.heads import HeadsTrainConfig

    model = tiny_model("llama", layers=4)
    target = type("Loaded", (), {"model": model, "name": "tiny", "fingerprint": None})()
    cfg = HeadsTrainConfig(data="x", out="y", arch="parallel", block_size=1)
    objective = by_name("parallel").objective(cfg.recipe(), cfg, target, None)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    loss, stats, _ = objective(ids, torch.ones_like(ids), torch.ones_like(ids))
    loss.backward()
    assert list(stats) == [0]
    trained = {name for name, p in objective.heads.named_parameters() if p.requires_grad}
    assert "mask_hidden" not in trained and all(objective.heads.get_parameter(n).grad is not None for n in trained)
