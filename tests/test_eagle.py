"""EAGLE heads (EAGLE-3's layout, EAGLE-2's dynamic trees): exact decoding, the drafter's own
cache, save/load, the engines' layouts, training under accelerate, bad input."""

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import (
    QUESTIONS,
    ROOT,
    VOCAB,
    assert_feature_cache_is_exact,
    env,
    key_value_copies,
    reference,
    tiny_chat_target,
    tiny_family,
    tiny_model,
    toy_data,
)
from safetensors.torch import load_file, save_file

from gorgon.decode import Sampling, speculative_generate
from gorgon.decode.kernels import draft_dtype, fast_kernels_unavailable, use_cpu_kernels
from gorgon.heads import EagleConfig, EagleDrafter, EagleHead, GorgonError, Target, fingerprint, load_target
from gorgon.heads.methods.eagle.formats import check_exportable_layers, export_head
from gorgon.heads.methods.eagle.model import default_feature_layers
from gorgon.train.data import DataSettings, make_dataset

FAMILIES = ["llama", "qwen2"]
LAYOUTS = [*FAMILIES, "qwen3"]  # the engines' EAGLE-3 layers: Llama (Qwen2 with biases) and Qwen3


def head_for(model, vocab=VOCAB, draft=None, seed=0, **settings):
    torch.manual_seed(seed)
    head = EagleHead.for_target(model, draft_tokens=draft, **settings)
    with torch.no_grad():  # not the starting point: every weight matters in the checks below
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


def draft_logits(head):
    """The head's logits over 5 positions of fixed random features and tokens, drafting causally."""
    generator = torch.Generator().manual_seed(0)
    width = len(head.feature_layers) * head.config.hidden_size
    features = torch.randn(1, 5, width, generator=generator)
    tokens = torch.randint(0, VOCAB, (1, 5), generator=generator)
    mask = torch.zeros(1, 1, 5, 5).masked_fill_(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        rope = head.rope(torch.arange(5)[None], features.dtype)
        return head.logits(head.layer(head.fc(features), tokens, rope, mask))


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_equals_generate_with_dynamic_trees(arch):
    model = tiny_model(arch, vocab=8, layers=4)  # a small vocabulary: drafts are often right, so paths go deep
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    head = head_for(model, seed=1)  # random heads differ in how deep their drafts get accepted: this one's go deep
    accepted = []
    for nodes, depth, topk in [(8, 3, 2), (16, 5, 4), (40, 3, 8), (40, 3, None), (2, 1, 1)]:  # None: widened
        drafter = EagleDrafter(head, nodes=nodes, depth=depth, topk=topk)
        for seed in range(3):
            ids = torch.randint(0, 8, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
            result = speculative_generate(model, drafter, ids, max_new_tokens=30)
            assert result.tokens == reference(model, ids, 30)
            accepted += result.accepted
    assert max(accepted) >= 3  # drafted paths two deep were accepted, not only bonus tokens


def test_the_cache_goes_by_the_keyword_this_transformers_takes():
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name goes in 5.40): the decoder,
    the verify forward and the head's attention pass it by the name each module takes, so no call warns."""
    import warnings

    model = tiny_model("llama", layers=4)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        result = speculative_generate(model, EagleDrafter(head_for(model)), ids, max_new_tokens=8)
    assert result.tokens == reference(model, ids, 8)


def test_a_bfloat16_head_on_a_float32_target_keeps_greedy_output_exact():
    """The head may draft in bfloat16 (cheaper on a CPU); the target's verification keeps the output exact."""
    model = tiny_model("llama", vocab=8, layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    head = head_for(model).to(torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16 and head.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(head.rotary.inv_freq, head_for(model).rotary.inv_freq)  # frequencies never rounded
    use_cpu_kernels(head, "fast")  # oneDNN where this CPU runs bfloat16, else a warning and stock kernels
    drafter = EagleDrafter(head, nodes=8, depth=3, topk=2)
    accepted = []
    for seed in range(3):
        ids = torch.randint(0, 8, (1, 6), generator=torch.Generator().manual_seed(seed))
        result = speculative_generate(model, drafter, ids, max_new_tokens=30)
        assert result.tokens == reference(model, ids, 30)
        accepted += result.accepted
    assert max(accepted) >= 2  # some drafts were accepted, not only bonus tokens


def test_stopping_the_expansion_early_leaves_the_tree_unchanged(monkeypatch):
    """Levels are skipped once no deeper node could enter the tree; the trees must be those of the full search."""
    import gorgon.heads.search as module

    model = tiny_model("llama", vocab=8, layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    head = head_for(model)
    levels = {"pruned": 0, "full": 0}
    layer = head.layer

    def counted(*args, **kwargs):
        levels[mode] += 1
        return layer(*args, **kwargs)

    monkeypatch.setattr(head, "layer", counted)
    trees = {}
    for mode, grow in [("pruned", module.can_grow), ("full", lambda *args: None)]:
        monkeypatch.setattr(module, "can_grow", grow)
        trees[mode] = []
        for nodes, depth, topk in [(4, 6, 2), (8, 5, 3), (6, 4, 4)]:
            for seed in range(6):
                ids = torch.randint(0, 8, (1, 6), generator=torch.Generator().manual_seed(seed))
                with torch.no_grad():
                    out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
                features = torch.cat([out.hidden_states[i][0] for i in head.feature_layers], -1)
                tokens, tree = EagleDrafter(head, nodes=nodes, depth=depth, topk=topk).propose(
                    ids[0, -1], features[:-1], ids[0, :-1])
                trees[mode].append((tokens.tolist(), tree.paths))
    assert trees["pruned"] == trees["full"]
    assert levels["pruned"] < levels["full"]  # and some levels were skipped


def test_a_level_that_cannot_pay_is_not_drafted(monkeypatch):
    """The head's search stops as a draft model's does once its frontier's chances sum below a level's cost
    (`can_grow`), with output still exact; the cost is measured as a positive number of target steps."""
    from gorgon.decode.calibrate import drafted_level_cost

    model = tiny_model("llama", vocab=8, layers=4)
    head = head_for(model, seed=1)
    assert 0 < drafted_level_cost(EagleDrafter(head, nodes=8, depth=4, topk=3), model, repeat=2) < float("inf")
    calls, layer = [], head.layer
    monkeypatch.setattr(head, "layer", lambda *args, **kwargs: calls.append(1) or layer(*args, **kwargs))
    ids = torch.randint(0, 8, (7,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0, :-1] for i in head.feature_layers], -1)  # ids[-1] is the root
    for topk in (1, 3):
        # the first level's chances (the root's likeliest children): the whole tree at depth 1
        first = sum(chance for _, chance in EagleDrafter(head, nodes=1 + topk, depth=1, topk=topk).scored_paths(
            ids[-1], features, ids[:-1]))
        # free levels: all 4; just below the first level's chances: a second; just above: none past the first
        for cost, shallowest, deepest in [(0.0, 4, 4), (first - 1e-4, 2, 4), (first + 1e-4, 1, 1)]:
            drafter = EagleDrafter(head, nodes=1 + 4 * topk, depth=4, topk=topk, level_cost=cost)
            calls.clear()
            paths = drafter.scored_paths(ids[-1], features, ids[:-1])
            depth = max(len(path) for path, _ in paths)
            assert shallowest <= depth <= deepest and len(calls) == depth, (topk, cost)  # the intake, then levels
            result = speculative_generate(model, drafter, ids[None], max_new_tokens=20)
            assert result.tokens == reference(model, ids[None], 20)
    with pytest.raises(GorgonError, match="a draft level's cost is a finite number of target steps >= 0, not -1"):
        EagleDrafter(head, nodes=8, level_cost=-1)


def test_each_candidate_scores_what_the_head_gives_its_path_drafted_alone():
    """A candidate's confidence is the product of the head's probabilities along its path, drafted one token at
    a time with no cache: the search's parents, features, positions and masks must reproduce it. Greedy output
    is exact whatever tree is proposed, so the decoding tests cannot see a wrong tree, only a slower one."""
    from gorgon.heads.masks import additive_mask

    model = tiny_model("llama", vocab=8, layers=4)
    head = head_for(model)
    ids = torch.randint(0, 8, (7,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids[None], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i][0, :-1] for i in head.feature_layers], -1)  # ids[-1] is the root
        for nodes, depth, topk in [(12, 4, 3), (8, 5, 2)]:
            scored = EagleDrafter(head, nodes=nodes, depth=depth, topk=topk).scored_paths(ids[-1], features, ids[:-1])
            chances = [chance for _, chance in scored]
            assert len(scored) == nodes - 1 and chances == sorted(chances, reverse=True)
            assert max(len(path) for path, _ in scored) >= 3
            for path, chance in scored:
                fed, tokens, expected = head.fc(features), ids[1:], 1.0
                for token in path:  # each position: a feature and the token after it, causally
                    n = fed.shape[0]
                    mask = additive_mask(torch.ones(n, n, dtype=torch.bool).tril(), fed.dtype)[None, None]
                    rope = head.rope(torch.arange(n)[None], fed.dtype)
                    last = head.layer(fed[None], tokens[None], rope, mask)[0, -1:]
                    expected *= head.logits(last)[0].softmax(-1)[token].item()
                    fed, tokens = torch.cat([fed, last]), torch.cat([tokens, torch.tensor([token])])
                assert chance == pytest.approx(expected, rel=1e-4), path


def test_the_default_search_widens_to_fill_a_large_tree():
    """Without an asked-for top-k, a tree larger than the saved depth x top-k candidates (a GPU's) gets a
    wider search that fills it; a tree the saved search already fills keeps it."""
    model = tiny_model("llama", layers=4)
    head = head_for(model, depth=3, topk=2)
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids[None], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i][0, :-1] for i in head.feature_layers], -1)
        wide, asked, small = (EagleDrafter(head, nodes=40), EagleDrafter(head, nodes=40, topk=2),
                              EagleDrafter(head, nodes=6))
        assert (wide.topk, asked.topk, small.topk) == (13, 2, 2)
        assert len(wide.scored_paths(ids[-1], features, ids[:-1])) == 39  # 3 levels of 13 fill the 39 candidates
        assert len(asked.scored_paths(ids[-1], features, ids[:-1])) == 6  # 3 levels of 2: most of the tree empty


def test_draft_dtype_follows_the_target_unless_the_cpu_runs_bfloat16():
    model = tiny_model("llama")
    fast_bf16 = fast_kernels_unavailable(torch.bfloat16) is None
    assert draft_dtype(model, "fast") == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert draft_dtype(model, "stock") == torch.float32
    assert draft_dtype(model, "fast", "float32") == torch.float32
    assert draft_dtype(model.to(torch.bfloat16), "stock", "auto") == torch.bfloat16
    with pytest.raises(GorgonError, match="--draft-dtype"):
        draft_dtype(model, "fast", "float16")


def test_the_drafters_cache_follows_the_accepted_tokens():
    """Proposing after a few steps gives what a fresh drafter gives from the whole context at once."""
    model = tiny_model("llama", layers=4)
    head = head_for(model)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0] for i in head.feature_layers], -1)
    stepwise = EagleDrafter(head, nodes=10, depth=3, topk=3)
    root = torch.tensor(7)
    for cut in (6, 9, 12):  # the prompt, then two steps that accepted 3 tokens each
        tokens, tree = stepwise.propose(ids[0, cut] if cut < 12 else root, features[:cut][-(3 if cut > 6 else 6):],
                                        ids[0, :cut])
    assert stepwise.cache.get_seq_length() == 12
    fresh_tokens, fresh_tree = EagleDrafter(head, nodes=10, depth=3, topk=3).propose(root, features, ids[0])
    assert torch.equal(tokens, fresh_tokens) and tree.paths == fresh_tree.paths
    again, again_tree = stepwise.propose(root, features[-3:], ids[0])  # the same step proposed twice (profiling)
    assert torch.equal(again, tokens) and again_tree.paths == tree.paths and stepwise.cache.get_seq_length() == 12
    with pytest.raises(GorgonError, match="holds 12 tokens of context but was given features for the last 1 of 14"):
        stepwise.propose(root, features[-1:], torch.cat([ids[0], ids[0, :2]]))


def test_the_heads_norms_run_fused_where_the_formula_is_llamas():
    """The head's RMS norms run on torch's fused rms_norm (one operator, not eight) where that computes the
    norm's own formula: Llama's (so Qwen2's and Qwen3's), not Gemma's 1 + weight, even under Llama's
    attribute names. The drafts come out the same."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from gorgon.heads.methods.eagle.formats import computes_rms_norm

    class OnePlusWeight(LlamaRMSNorm):  # Gemma's formula, Llama's attributes: only the probe tells them apart
        def forward(self, x):
            return torch.nn.functional.rms_norm(x, self.weight.shape, eps=self.variance_epsilon) * (1 + self.weight)

    assert computes_rms_norm(LlamaRMSNorm(16))
    assert not any(computes_rms_norm(norm) for norm in (OnePlusWeight(16), GemmaRMSNorm(16), torch.nn.LayerNorm(16)))
    llama, gemma_like = LlamaRMSNorm(16), OnePlusWeight(16)
    with torch.device("meta"):  # another default device (a head built under `with torch.device("cuda")`) failed
        assert computes_rms_norm(llama) and not computes_rms_norm(gemma_like)
    for arch in LAYOUTS:
        head = head_for(tiny_model(arch, layers=4))
        assert head.fused_norms
        fused = draft_logits(head)
        head.fused_norms = False
        torch.testing.assert_close(fused, draft_logits(head))


def test_on_the_fast_path_the_heads_levels_share_key_value_heads(monkeypatch):
    """The CPU fast path puts the head's own layer on the tree attention too: a drafted level attends as
    a masked forward over several tokens, where transformers' SDPA would copy every key/value head of
    the head's cache per query head. The same tree comes out; stock kernels switch it back."""
    from gorgon.decode.attention import NAME, attention_config

    model = tiny_model("llama", layers=4)  # 4 query heads over 2 key/value heads
    head = head_for(model)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.get_decoder()(input_ids=ids[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i][0, :-1] for i in head.feature_layers], -1)

    def drafted():
        return EagleDrafter(head, nodes=10, depth=3, topk=3).scored_paths(ids[-1], features, ids[:-1])

    copies = key_value_copies(monkeypatch)
    reference = drafted()
    assert copies and attention_config(head)._attn_implementation == "sdpa"
    if fast_kernels_unavailable(torch.float32):
        pytest.skip("oneDNN's prepacked kernels do not run on this torch build")
    use_cpu_kernels(head, "fast")
    assert attention_config(head)._attn_implementation == NAME
    copies.clear()
    fast = drafted()
    assert [path for path, _ in fast] == [path for path, _ in reference] and not copies
    assert [chance for _, chance in fast] == pytest.approx([chance for _, chance in reference], rel=1e-4)
    use_cpu_kernels(head, "stock")
    assert attention_config(head)._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", LAYOUTS)
def test_save_load_round_trip_drafts_the_same(tmp_path, arch):
    model = tiny_model(arch, layers=4)
    model.config._name_or_path = "/home/someone/.cache/target"  # where it was loaded from: not saved
    head = head_for(model, draft=torch.arange(0, VOCAB, 2))
    head.set_trees([[0.5, 0.1]], {"cpu": 6, "cuda": 12})
    head.save_pretrained(tmp_path)
    assert "/home/someone" not in (tmp_path / "config.json").read_text()
    loaded = EagleHead.from_pretrained(tmp_path, target=model)
    assert loaded.saved_nodes("cpu") == 6 and loaded.accuracies == [[0.5, 0.1]]
    saved, back = head.state_dict(), loaded.state_dict()
    assert saved.keys() == back.keys() and all(torch.equal(saved[k], back[k]) for k in saved)
    torch.testing.assert_close(draft_logits(loaded), draft_logits(head), rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (1, 10))
    result = [speculative_generate(model, EagleDrafter(h), ids, max_new_tokens=12) for h in (head, loaded)]
    assert result[0].tokens == result[1].tokens and result[0].accepted == result[1].accepted


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_a_head_over_the_whole_vocabulary_exports_without_a_token_map(tmp_path, fmt):
    """vLLM has no parameter for d2t when the draft vocabulary is the target's, and fails on one."""
    model = tiny_model("llama", layers=6)
    head = EagleHead.for_target(model, feature_layers=[1, 3, 5], target_name="tiny")
    out = export_head(head, fmt, tmp_path / fmt)
    state, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    assert "d2t" not in state and "t2d" not in state
    assert config["draft_vocab_size"] == VOCAB and state["lm_head.weight"].shape == (VOCAB, 32)
    back = EagleHead.from_pretrained(out, target=model)
    assert back.token_map is None and back.config.draft_vocab_size is None
    torch.testing.assert_close(back.lm_head.weight, head.lm_head.weight)


@pytest.mark.parametrize("arch", LAYOUTS)
@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_key_names_shapes_and_import_with_identical_drafts(tmp_path, arch, fmt, capsys):
    model = tiny_model(arch, layers=6)
    model.config.dtype = torch.bfloat16  # as a target loaded from a bfloat16 checkpoint says
    head = head_for(model, draft=torch.arange(0, VOCAB, 2))
    assert head.feature_layers == (1, 3, 5)  # default_feature_layers(6)
    out = export_head(head, fmt, tmp_path / fmt, "tiny/target")
    # SGLang's EAGLE-3 loader drops q/k/v biases without a word: the export says so.
    assert ("SGLang's EAGLE-3 loader builds its attention without biases" in capsys.readouterr().err) == (
        fmt == "eagle3" and head.midlayer.self_attn.q_proj.bias is not None)
    state, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    H, kv = 32, 2 * 8  # hidden 32; 2 key-value heads of 8
    layer = "midlayer" if fmt == "eagle3" else "layers.0"
    expected = {"fc.weight": (H, 3 * H), f"{layer}.input_layernorm.weight": (H,),
                f"{layer}.hidden_norm.weight": (H,), f"{layer}.post_attention_layernorm.weight": (H,),
                f"{layer}.self_attn.q_proj.weight": (H, 2 * H), f"{layer}.self_attn.k_proj.weight": (kv, 2 * H),
                f"{layer}.self_attn.v_proj.weight": (kv, 2 * H), f"{layer}.self_attn.o_proj.weight": (H, H),
                f"{layer}.mlp.gate_proj.weight": (64, H), f"{layer}.mlp.up_proj.weight": (64, H),
                f"{layer}.mlp.down_proj.weight": (H, 64), "norm.weight": (H,), "lm_head.weight": (VOCAB // 2, H),
                "d2t": (VOCAB // 2,), "t2d": (VOCAB,)}
    if arch == "qwen2":  # q/k/v biases: exported as Llama's attention_bias, which covers o_proj too
        expected.update({f"{layer}.self_attn.{p}_proj.bias": (n,) for p, n in
                         [("q", H), ("k", kv), ("v", kv), ("o", H)]})
    if arch == "qwen3":  # q/k norms over each head: vLLM's Qwen3 EAGLE-3 layer holds them
        expected.update({f"{layer}.self_attn.{p}_norm.weight": (8,) for p in "qk"})
    if fmt == "speculators":
        expected["embed_tokens.weight"] = (VOCAB, H)
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 32
    assert torch.equal(torch.arange(32) + state["d2t"], torch.arange(0, VOCAB, 2))  # target = draft + d2t
    assert config["draft_vocab_size"] == 32 and config["norm_before_residual"] is False
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    layer_config = config if fmt == "eagle3" else config["transformer_layer_config"]
    assert layer_config["dtype"] == "bfloat16"  # the target's
    assert layer_config["rope_theta"] == model.config.rope_parameters["rope_theta"]  # SGLang reads it there
    model_type = "qwen3" if arch == "qwen3" else "llama"
    assert (config if fmt == "eagle3" else config["transformer_layer_config"])["model_type"] == model_type
    if fmt == "eagle3":
        architecture = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}[model_type]
        assert config["architectures"] == [architecture] and config["target_hidden_size"] == H
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]  # SGLang adds one
        assert config["num_hidden_layers"] == 1 and config["vocab_size"] == VOCAB
    else:
        assert config["speculators_model_type"] == "eagle3"
        assert config["transformer_layer_config"]["hidden_size"] == H
        spec = config["speculators_config"]
        assert spec["default_proposal_method"] == spec["proposal_methods"][0]["proposal_type"] == "greedy"
        assert spec["verifier"]["name_or_path"] == "tiny/target"
    back = EagleHead.from_pretrained(out, target=model)
    torch.testing.assert_close(draft_logits(back), draft_logits(head))
    assert torch.equal(back.token_map, head.token_map)


@pytest.mark.parametrize("arch", LAYOUTS)
@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_an_imported_head_exports_again_as_it_was_exported(tmp_path, arch, fmt):
    """Import used to keep the draft's one layer as the target's layer count, and the export refused the layers."""
    model = tiny_model(arch, layers=6)
    head = head_for(model, draft=torch.arange(0, VOCAB, 2), feature_layers=[1, 3, 5], target_name="tiny/target")
    first = export_head(head, fmt, tmp_path / "first")
    back = EagleHead.from_pretrained(first, target=model)
    second = export_head(back, fmt, tmp_path / "second")
    assert json.loads((second / "config.json").read_text()) == json.loads((first / "config.json").read_text())
    before, after = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(draft_logits(EagleHead.from_pretrained(second, target=model)), draft_logits(back))
    torch.testing.assert_close(draft_logits(back), draft_logits(head))


def test_an_eagle3_folder_naming_its_layers_as_sglang_does_reads_the_same_layers(tmp_path):
    """SGLang's `eagle_config` ids count one below vLLM's top-level ones: a folder with only them reads the same."""
    model = tiny_model("llama", layers=6)
    out = export_head(EagleHead.for_target(model, feature_layers=[1, 3, 5]), "eagle3", tmp_path)
    config = json.loads((out / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (out / "config.json").write_text(json.dumps(config))
    assert EagleHead.from_pretrained(out, target=model).feature_layers == (1, 3, 5)


def saved_settings(config):
    return {k: getattr(config, k) for k in ("target_fingerprint", "depth", "topk", "nodes", "accuracies")}


def test_an_imported_head_keeps_its_fingerprint_and_search_settings(tmp_path):
    """They travel in config.json's `gorgon` entry; a folder written elsewhere has none and gets the defaults."""
    model = tiny_model("llama", layers=6)
    head = EagleHead.for_target(model, feature_layers=[1, 2, 4], target_name="tiny", depth=3, topk=4,
                                target_fingerprint=fingerprint(model))
    head.set_trees([[0.5, 0.25], [0.4, 0.2]], {"cpu": 6, "cuda": 20})
    other = Target(tiny_model("llama", layers=6, seed=1), tokenizer=None, name="other")
    for fmt in ("eagle3", "speculators"):
        out = export_head(head, fmt, tmp_path / fmt)
        back = EagleHead.from_pretrained(out, target=Target(model, tokenizer=None, name="tiny"))
        assert saved_settings(back.config) == saved_settings(head.config)
        assert back.config.target_name == "tiny" and back.config.layer_config["num_hidden_layers"] == 6
        with pytest.raises(GorgonError, match="fingerprint"):
            EagleHead.from_pretrained(out, target=other)
        config = json.loads((out / "config.json").read_text())
        del config["gorgon"]
        (out / "config.json").write_text(json.dumps(config))
        foreign = EagleHead.from_pretrained(out, target=other)  # checked by shape only
        # the defaults, but the depth a speculators config proposes (speculative_tokens)
        depth = 3 if fmt == "speculators" else EagleConfig.depth
        defaults = EagleConfig(hidden_size=32, vocab_size=VOCAB, layer_config={}, feature_layers=[1, 2, 4], depth=depth)
        assert saved_settings(foreign.config) == saved_settings(defaults)
        assert foreign.config.layer_config["num_hidden_layers"] == 5  # the fewest layers that have a layer 4 to read
        export_head(foreign, fmt, tmp_path / f"{fmt}-again")


def test_a_head_refuses_a_target_too_shallow_for_its_layers(tmp_path):
    """A head without a fingerprint is checked by shape: reading layer 6 of 4 used to fail mid-decode."""
    head = EagleHead.for_target(tiny_model("llama", layers=6), feature_layers=[1, 3, 6])
    head.save_pretrained(tmp_path)
    message = r"reads the target's hidden states \[1, 3, 6\] and this target has 4 layers \(hidden states 0 to 4\)"
    with pytest.raises(GorgonError, match=message):
        EagleHead.from_pretrained(tmp_path, target=tiny_model("llama", layers=4))
    with pytest.raises(GorgonError, match="this target has 5 layers"):
        head.attach(tiny_model("llama", layers=5))
    deep_enough = tiny_model("llama", layers=6, seed=1)
    assert EagleHead.from_pretrained(tmp_path, target=deep_enough).target is deep_enough


def test_a_hand_edited_or_foreign_config_is_one_line(tmp_path):
    """A missing field or an unknown model_type was a TypeError, KeyError or transformers' list of every model."""
    model = tiny_model("llama", layers=6)
    head = EagleHead.for_target(model, feature_layers=[1, 3, 5])
    head.save_pretrained(tmp_path / "gorgon")
    for fmt in ("eagle3", "speculators"):
        export_head(head, fmt, tmp_path / fmt)

    def drop(key, within=None):
        return lambda config: (config[within] if within else config).pop(key)

    def rename(within=None):
        return lambda config: (config[within] if within else config).update(model_type="llamax")

    def retype(key, value, within=None):
        return lambda config: (config[within] if within else config).update({key: value})

    layer = "transformer_layer_config"
    for n, (layout, edit, message) in enumerate([
            ("gorgon", drop("hidden_size"), r"config.json lacks hidden_size: it is not a gorgon"),
            ("gorgon", drop("rms_norm_eps", "layer_config"), r"config.json's layer_config lacks rms_norm_eps"),
            ("gorgon", rename("layer_config"), r"config.json's layer_config has model_type 'llamax', which"),
            ("eagle3", drop("vocab_size"), r"config.json lacks vocab_size: copy them from the target's"),
            ("eagle3", drop("model_type"), r"config.json lacks model_type"),
            ("eagle3", rename(), r"config.json has model_type 'llamax', which transformers .* does not know"),
            ("speculators", drop(layer), r"config.json lacks transformer_layer_config"),
            ("speculators", drop("hidden_size", layer), r"config.json's transformer_layer_config lacks hidden_size"),
            ("speculators", rename(layer), r"config.json's transformer_layer_config has model_type 'llamax'"),
            ("gorgon", retype("hidden_size", "32"), r"config.json has hidden_size = '32', which is not int: correct"),
            ("gorgon", retype("feature_layers", [1, "3", 5]), r"has feature_layers = \[1, '3', 5\], which is not list"),
            ("gorgon", retype("nodes", 8), r"config.json has nodes = 8, which is not dict"),
            ("eagle3", retype("vocab_size", 64.0), r"config.json has vocab_size = 64.0, which is not int"),
            ("speculators", retype("hidden_size", "32", layer), r"has hidden_size = '32', which is not int")]):
        config = json.loads((tmp_path / layout / "config.json").read_text())
        edit(config)
        edited = tmp_path / f"edited-{n}"
        edited.mkdir()
        (edited / "config.json").write_text(json.dumps(config))
        for weights in (tmp_path / layout).glob("*.safetensors"):
            (edited / weights.name).write_bytes(weights.read_bytes())
        with pytest.raises(GorgonError, match=message):
            EagleHead.from_pretrained(edited, target=model)
    (edited / "config.json").write_text("{")
    with pytest.raises(GorgonError, match=r"cannot read .*config.json \(JSONDecodeError\)"):
        EagleHead.from_pretrained(edited)


def test_default_feature_layers_are_three_valid_layers_for_any_depth():
    """Below 7 layers EAGLE-3's (2, L // 2, L - 3) repeat: 6 layers gave 2 ([2, 3]), 5 layers 1, 1 layer the
    embeddings (0)."""
    for count in range(1, 9):
        layers = default_feature_layers(count)
        assert len(layers) == 3 and layers == sorted(layers) and all(1 <= i <= count for i in layers), count
        assert len(set(layers)) == 3 or count < 3, count
        if count >= 4:  # ones the engines read: the export takes them
            check_exportable_layers(EagleConfig(hidden_size=32, vocab_size=VOCAB, feature_layers=layers,
                                                layer_config={"num_hidden_layers": count}))
        if count >= 7:
            assert layers == [2, count // 2, count - 3]  # the engines' own choice
        head = EagleHead.for_target(tiny_model("llama", layers=count))
        assert head.feature_layers == tuple(layers) and head.fc.weight.shape == (32, 3 * 32)


def test_a_head_for_a_target_under_an_unmerged_adapter_starts_from_its_base_layer():
    """for_target failed with an AttributeError on a PEFT model (its layers hold `base_layer` modules)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", layers=4)
    plain = EagleHead.for_target(model).state_dict()
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    head = EagleHead.for_target(adapted)
    assert head.state_dict().keys() == plain.keys()
    assert all(torch.equal(value, plain[key]) for key, value in head.state_dict().items())
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    expected = adapted.generate(ids, do_sample=False, max_new_tokens=12)[0, 8:].tolist()
    assert speculative_generate(adapted, EagleDrafter(head), ids, 12, Sampling(), eos_token_id=None).tokens == expected


def test_bad_input_is_one_line(tmp_path):
    model = tiny_model("llama", layers=4)
    head = EagleHead.for_target(model, target_name="a", target_fingerprint=fingerprint(model))
    head.save_pretrained(tmp_path / "h")
    other = tiny_model("llama", layers=4, seed=1)
    with pytest.raises(GorgonError, match="fingerprint"):
        EagleHead.from_pretrained(tmp_path / "h", target=Target(other, tokenizer=None, name="other"))
    with pytest.raises(GorgonError, match="a draft vocabulary of 65 tokens does not fit the target's 64"):
        EagleHead.for_target(model, draft_tokens=torch.arange(65))
    for bad in ([3, 3, 5], [1, 64]):  # a repeated id, an id past the vocabulary
        with pytest.raises(GorgonError, match="draft_tokens must be distinct token ids below the target's 64"):
            EagleHead.for_target(model, draft_tokens=torch.tensor(bad))
    # A foreign EAGLE-3 folder whose d2t repeats a token or leaves the vocabulary (it failed mid-decode or proposed
    # a token twice among siblings) is refused where it loads.
    out = export_head(EagleHead.for_target(model, draft_tokens=torch.arange(0, 64, 2)), "eagle3", tmp_path / "d2t")
    state = load_file(out / "model.safetensors")
    state["d2t"][1] -= 2  # draft id 1 now maps to target id 0, as draft id 0 does
    save_file(state, out / "model.safetensors")
    with pytest.raises(GorgonError, match=r"d2t\) is not distinct token ids below 64 in increasing order"):
        EagleHead.from_pretrained(out, target=model)
    with pytest.raises(GorgonError, match="the draft depth must be a whole number >= 1"):
        EagleDrafter(head, depth=0)
    with pytest.raises(GorgonError, match="a tree needs 2 .* to 256 nodes, not 1"):
        EagleDrafter(head, nodes=1)
    with pytest.raises(GorgonError, match="feature_layers must lie between 1 and 4"):
        EagleHead.for_target(model, feature_layers=[0, 9])
    with pytest.raises(GorgonError, match="mixes exactly 3 target layers"):
        export_head(EagleHead.for_target(model, feature_layers=[4]), "eagle3", tmp_path / "x")
    for layers in ([3, 1, 2], [1, 1, 2], [1, 2, 4]):  # engines sort them and never read the normed last state
        with pytest.raises(GorgonError, match=rf"in increasing order, below the last \(4.*reads \{layers}"):
            export_head(EagleHead.for_target(model, feature_layers=layers), "eagle3", tmp_path / "x")
    sinks = EagleHead.for_target(tiny_model("llama", layers=4), feature_layers=[1, 2, 3])
    sinks.midlayer.self_attn.register_parameter("sinks", torch.nn.Parameter(torch.zeros(4)))  # as gpt-oss has
    with pytest.raises(GorgonError, match=r"neither a Llama nor a Qwen3 layer \(beside a Llama layer's weights: "
                                          r"midlayer.self_attn.sinks\)"):
        export_head(sinks, "speculators", tmp_path / "x")
    assert not (tmp_path / "x").exists()  # refused before anything was written
    with pytest.raises(GorgonError, match="Llama-shaped"):
        EagleHead.for_target(tiny_model("gemma2", layers=4))
    # Families built otherwise failed inside transformers or torch (no `layers`, a LayerNorm without rms_norm_eps,
    # a layer called otherwise: attention that wants position_ids, an MLP that returns a tuple; a last layer unlike
    # the shell's), when the head was made or when it first drafted
    for family, extra, refusal in [
            ("gpt2", {}, "which gpt2 is not: use Medusa heads"), ("olmo", {}, "which olmo is not"),
            ("mamba", {}, "which mamba is not"),
            ("ministral3", {}, "which ministral3 is not"),
            ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8), "which gpt_oss is not"),
            ("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
             "the target's last decoder layer has no mlp.gate_proj.weight as a dense Llama-shaped layer has")]:
        with pytest.raises(GorgonError, match=re.escape(refusal)):
            EagleHead.for_target(tiny_family(family, **extra))
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = GemmaForCausalLM(GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))
    with pytest.raises(GorgonError, match=r"scale by 1 \+ weight \(a Gemma-style layer\)"):
        export_head(EagleHead.for_target(gemma, feature_layers=[1, 2, 3]), "eagle3", tmp_path / "x")


@pytest.mark.slow
def test_cli_draft_depth_and_topk_shape_the_search(tmp_path, capsys):
    import argparse

    from gorgon.decode.options import DecodeSettings, add_model_arguments, load_drafter
    from gorgon.heads import MedusaHeads
    from gorgon.heads.cli import main as gorgon

    target_path = tiny_chat_target(tmp_path)
    target = load_target(str(target_path), device="cpu")
    EagleHead.for_target(target.model, target_fingerprint=target.fingerprint, depth=3, topk=2).save_pretrained(
        tmp_path / "eagle")
    MedusaHeads.for_target(target.model, target_fingerprint=target.fingerprint).save_pretrained(tmp_path / "medusa")
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    common = ["--target", str(target_path), "--max-new-tokens", "4"]

    def search(*argv, tree="auto"):
        args = parser.parse_args(["--heads", str(tmp_path / "eagle"), *argv] + common)
        drafter = load_drafter(DecodeSettings.from_args(args, tree=tree))[1]
        return drafter.depth, drafter.topk

    assert search() == (3, 3)  # the saved top-k 2 widened: 3 levels of 3 fill the saved 8-node tree's 7 candidates
    assert search(tree=4) == (3, 2)  # a smaller tree keeps the saved top-k
    assert search("--draft-depth", "5", "--draft-topk", "4") == (5, 4)
    assert search("--draft-topk", "2", tree=64) == (3, 2)  # an asked-for top-k is never widened
    questions, out = tmp_path / "q.jsonl", tmp_path / "bench.json"
    questions.write_text(json.dumps(QUESTIONS[0]) + "\n")
    assert gorgon(["bench", "--heads", str(tmp_path / "eagle"), "--draft-depth", "2", "--questions", str(questions),
                   "--baselines", "generate", "--out", str(out)] + common) == 0
    report = json.loads(out.read_text())  # by default a level's cost is timed here and stops the search
    assert re.fullmatch(r"built per step \(depth 2, top-k 4, no deeper once chances sum below \d\.\d\d\)",
                        report["tree"]) and report["identical"] == 1
    assert "a drafted level costs" in capsys.readouterr().err
    assert gorgon(["bench", "--heads", str(tmp_path / "eagle"), "--draft-depth", "2", "--draft-level-cost", "0",
                   "--questions", str(questions), "--baselines", "generate", "--out", str(out), "--overwrite"]
                  + common) == 0
    assert json.loads(out.read_text())["tree"] == "built per step (depth 2, top-k 4)"
    assert "a drafted level costs" not in capsys.readouterr().err
    medusa = ["generate", "--heads", str(tmp_path / "medusa"), "--prompt", "x"]
    assert gorgon(medusa + ["--draft-depth", "2"] + common) == 2
    assert capsys.readouterr().err.strip().endswith("--draft-depth and --draft-topk shape an EAGLE head's "
                                                    "search; Medusa heads draft one level per head: choose their "
                                                    "tree with --tree")
    nowhere = ["--target", str(tmp_path / "nowhere")]  # refused from the heads' config, before a target loads
    assert gorgon(medusa + ["--draft-level-cost", "0.1"] + nowhere) == 2
    assert capsys.readouterr().err.strip().endswith("medusa draft every level in one forward: --draft-level-cost "
                                                    "has nothing to stop (it applies to --draft and EAGLE "
                                                    "heads)")
    assert gorgon(medusa + ["--draft-dtype", "bfloat16"] + nowhere) == 2  # ignored before
    assert capsys.readouterr().err.strip().endswith("medusa keep the target's dtype (they read its hidden states): "
                                                    "drop --draft-dtype, which sets an EAGLE head's or a "
                                                    "--draft model's")
    assert gorgon(medusa + ["--draft-tokens", "3"] + common) == 2  # ignored before
    assert capsys.readouterr().err.strip().endswith("--draft-tokens sets a --draft model's levels per step: it needs "
                                                    "--draft (an EAGLE head's are --draft-depth)")
    assert gorgon(["generate", "--context-draft", "--draft-topk", "2", "--prompt", "x"] + common) == 2
    assert capsys.readouterr().err.strip().endswith("--draft-topk shapes a search: it needs --heads or --draft")


@pytest.mark.slow
def test_accelerate_launch_trains_an_eagle_head_that_decodes_exactly(tmp_path):
    """Self-distillation as users run it: the target answers prompts, the head learns from its answers."""
    target_path = tiny_chat_target(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count from {i}"}) + "\n" for i in range(48)))
    data = str(make_dataset(DataSettings(prompts=str(prompts), target=str(target_path), max_new_tokens=24,
                                         batch_size=16), tmp_path / "data", progress=False))
    out = tmp_path / "eagle"
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
         str(ROOT / "train/heads.py"), "--arch", "eagle", "--data", data, "--target", str(target_path),
         "--out", str(out), "--max-steps", "120", "--batch-size", "8", "--learning-rate", "0.01", "--log-every", "20",
         "--save-every", "40", "--ttt-steps", "2", "--hidden-weight", "0.1", "--draft-vocab-size", "100",
         "--feature-layers", "1,2,2",
         "--report-to", "none"], env=env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["arch"] == "eagle" and len(metrics["top1"]) == 2 and metrics["top1"][0] > 0.3
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: gorgon\npipeline_tag: text-generation\ntags:\n- eagle")
    target = load_target(str(target_path), device="cpu")
    head = EagleHead.from_pretrained(out, target=target)
    assert head.config.draft_vocab_size == 100 and head.accuracies == metrics["rank_accuracy"]
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "count from 3"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    assert head.config.nodes == {"cpu": 8, "cuda": 48}  # the EAGLE head's default tree sizes
    result = speculative_generate(target.model, EagleDrafter(head, nodes=16), ids, max_new_tokens=40)
    assert result.tokens == reference(target.model, ids, 40)
    assert result.tau > 1.5  # the head learned the target's own answers: it drafts them (a 16-node tree)
    gorgon = [sys.executable, "-m", "gorgon.heads.cli"]
    gen = subprocess.run(gorgon + ["generate", "--heads", str(out), "--target", str(target_path), "--raw",
                                   "--prompt", "count from 3", "--max-new-tokens", "12", "--stats"],
                         env=env(), capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0 and "tau" in gen.stderr, gen.stderr[-2000:]
    exported = subprocess.run(gorgon + ["export", "--heads", str(out), "--target", str(target_path), "--format",
                                        "eagle3", "--out", str(tmp_path / "e3")], env=env(), capture_output=True,
                              text=True, timeout=300)
    # Layers 1, 2, 2 of a 2-layer target: the engines would read other features than the head learned from.
    assert exported.returncode == 2 and exported.stderr.strip().splitlines()[-1].endswith(
        "and this head reads [1, 2, 2]: train with such feature_layers (the default) to export")
    assert not (tmp_path / "e3").exists()  # refused in one line, nothing left behind
    wrong = subprocess.run(gorgon + ["export", "--heads", str(out), "--target", str(target_path), "--format", "vllm",
                                     "--out", str(tmp_path / "v")], env=env(), capture_output=True, text=True,
                           timeout=300)
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines()[-1].endswith(
        "holds an EAGLE head, which export as eagle3 or speculators, not vllm")


def test_bad_training_settings_are_one_line():
    from gorgon.train.heads import HeadsTrainConfig

    for settings, message in [({"arch": "eagel"}, "arch must be one of medusa, eagle, parallel, self_spec, not "
                                                  "'eagel'"),
                              ({"arch": "eagle", "ttt_steps": 0}, "ttt_steps must be at least 1"),
                              ({"arch": "eagle", "mode": "medusa2"}, "mode is a key of arch: medusa .*, not of arch: "
                                                                   "eagle"),
                              ({"arch": "eagle", "draft_depth": 0}, "the draft depth must be a whole number >= 1"),
                              ({"train_conversations": 0}, "train_conversations must be at least 1"),
                              ({"loss_tokens": "prompts"}, "loss_tokens must be one of answers, all"),
                              ({"mode": "medusa2", "cache_features": True}, "cache_features keeps a frozen target's"),
                              ({"arch": "eagle", "feature_noise": -0.1}, "feature_noise is the width of the noise"),
                              ({"feature_noise": 0.1}, "feature_noise is a key of arch: eagle .*, not of arch: medusa"),
                              ({"arch": "eagle", "dropout": 1.0}, "dropout is the share of an EAGLE"),
                              ({"dropout": 0.1}, "dropout is a key of arch: eagle .*, not of arch: medusa"),
                              ({"train_lm_head": False}, "train_lm_head is a key of arch: eagle"),
                              ({"loss_tokens": "all"}, "loss_tokens: all trains on the prompts' positions")]:
        with pytest.raises(GorgonError, match=message):
            HeadsTrainConfig(data="x", out="y", **settings).check()


def test_optimisation_settings_out_of_range_are_one_line():
    """Both training scripts: such settings trained before (a negative learning rate diverged; no held-out
    data reported top-1 0 and chose trees from nothing) or failed later blaming the data."""
    from gorgon.train.draft import DraftTrainConfig
    from gorgon.train.heads import HeadsTrainConfig

    for settings, message in [({"learning_rate": -1}, r"learning_rate must be above 0, not -1"),
                              ({"warmup_steps": -5}, r"warmup_steps must be at least 0, not -5"),
                              ({"epochs": 0}, r"epochs must be above 0 \(a fraction trains on part of the data\)"),
                              ({"eval_fraction": 0}, r"eval_fraction is the share .* not 0$"),
                              ({"eval_fraction": 1.5}, r"between 0 and 1 \(default 0.05\), not 1.5"),
                              ({"max_length": 0}, r"max_length is the most tokens .* not 0$")]:
        for config in (HeadsTrainConfig, DraftTrainConfig):
            with pytest.raises(GorgonError, match=message):
                config(data="x", out="y", **settings).check()
    with pytest.raises(GorgonError, match="backbone_learning_rate must be above 0"):
        HeadsTrainConfig(data="x", out="y", backbone_learning_rate=0).check()


@pytest.mark.slow
def test_loss_tokens_all_trains_on_every_position_and_evaluates_on_answers(tmp_path, monkeypatch):
    """Also: the head is in training mode (feature noise and dropout on) for training steps only, and the
    recipe's dropout reaches the objective."""
    from gorgon.heads.methods.eagle.objective import EagleObjective
    from gorgon.train.heads import HeadsTrainConfig, train

    seen = {"train": [], "eval": []}
    forward = EagleObjective.forward

    def recording(self, input_ids, attention_mask, loss_mask, train_backbone=False):
        seen["train" if torch.is_grad_enabled() else "eval"].append(
            (int(loss_mask.sum()), int(attention_mask.sum()), self.heads.training, self.dropout))
        return forward(self, input_ids, attention_mask, loss_mask, train_backbone)

    monkeypatch.setattr(EagleObjective, "forward", recording)
    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl")
    train(HeadsTrainConfig(data=data, out=str(tmp_path / "h"), target=str(target_path), arch="eagle",
                           loss_tokens="all", max_steps=2, batch_size=4, report_to="none", save_every=0,
                           feature_noise=0.1, dropout=0.1))
    assert seen["train"] and all(masked == tokens and training for masked, tokens, training, _ in seen["train"])
    assert seen["eval"] and all(0 < masked < tokens and not training for masked, tokens, training, _ in seen["eval"])
    assert {dropout for *_, dropout in seen["train"] + seen["eval"]} == {0.1}
    # The card names the layers the head reads (the defaults here; it wrote "layers EAGLE-3's low, ...").
    card = (tmp_path / "h" / "README.md").read_text()
    assert "the target's hidden states at layers 1, 2, 2 and" in card
    # Without cpu_tree_size/gpu_tree_size the head keeps its own default tree sizes (it got Medusa's 16 and 64)
    assert EagleHead.from_pretrained(tmp_path / "h").config.nodes == {"cpu": 8, "cuda": 48}
    assert "the CPU tree (8 nodes)" in card


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_with_dropout_equals_the_uninterrupted_run(tmp_path):
    """Dropout and feature noise draw from torch's global generator, which the checkpoint saves: the resumed
    run must draw the same noise (the loaders draw their seeds elsewhere). As a kill leaves it: the
    uninterrupted run's checkpoint at step 3 of 6, copied into a run folder of its own, then resumed."""
    import shutil

    from gorgon.train.heads import HeadsTrainConfig, train
    from gorgon.train.run_folder import RUN_MARKER

    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl")  # 46 train conversations: 12 batches of 4 an epoch
    settings = dict(data=data, target=str(target_path), arch="eagle", max_steps=6, batch_size=4, report_to="none",
                    save_every=3, dropout=0.3, feature_noise=0.2)
    whole = train(HeadsTrainConfig(out=str(tmp_path / "whole"), **settings))
    killed = tmp_path / "killed"
    shutil.copytree(whole / "checkpoints" / "step-3", killed / "checkpoints" / "step-3")
    (killed / RUN_MARKER).write_text("")
    train(HeadsTrainConfig(out=str(killed), resume=True, **settings))
    a, b = load_file(whole / "model.safetensors"), load_file(killed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_train_lm_head_false_keeps_the_targets_rows(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig, train

    target_path = tiny_chat_target(tmp_path)
    rows = load_target(str(target_path)).model.lm_head.weight
    for trained in (True, False):
        out = tmp_path / f"h-{trained}"
        train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(out), target=str(target_path),
                               arch="eagle", max_steps=2, batch_size=4, report_to="none", save_every=0,
                               train_lm_head=trained))
        state = load_file(out / "model.safetensors")
        assert torch.equal(state["lm_head.weight"], rows) is not trained
        assert not torch.equal(state["fc.weight"][:, -rows.shape[1]:], torch.eye(rows.shape[1]))


@pytest.mark.parametrize("setting", [{"noise": 0.5}, {"dropout": 0.5}])
def test_feature_noise_and_dropout_perturb_training_steps_only(setting):
    from gorgon.heads.methods.eagle.objective import EagleObjective

    model = tiny_model("llama", layers=4)
    head = head_for(model)
    ids = torch.randint(0, VOCAB, (2, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    clean = EagleObjective(model, head, steps=2, hidden_weight=0.5)(**batch)[0]
    noisy = EagleObjective(model, head, steps=2, hidden_weight=0.5, **setting)
    assert head.training and not torch.isclose(noisy(**batch)[0], clean)
    head.eval()
    assert torch.equal(noisy(**batch)[0], clean)


def test_feature_noise_is_the_same_share_of_every_layers_scale():
    from gorgon.heads.methods.eagle.objective import with_noise

    torch.manual_seed(0)
    scales = torch.tensor([1.0, 10.0, 100.0])  # three layers of very different size, as a real target's
    features = (torch.randn(4, 50, 3, 64) * scales[:, None]).flatten(-2)
    noise = (with_noise(features, 0.1, layers=3) - features).unflatten(-1, (3, 64))
    rms = features.unflatten(-1, (3, 64)).pow(2).mean(-1, keepdim=True).sqrt()
    share = noise / rms
    assert share.abs().max() <= 0.1 + 1e-6
    assert torch.allclose(share.std((0, 1, 3)), torch.full((3,), 0.1 / 3 ** 0.5), rtol=0.05)  # uniform's std


def test_the_feature_cache_skips_the_target_and_keeps_the_loss():
    """The EAGLE head reads the target's features, last hidden state and choices back."""
    from gorgon.heads.methods.eagle.objective import EagleObjective

    model = tiny_model("llama", layers=4)
    head = head_for(model, draft=torch.arange(0, VOCAB, 2))
    assert_feature_cache_is_exact(model, lambda cache: EagleObjective(model, head, steps=2, cache=cache),
                                  [head.fc.weight])


def test_the_training_time_test_sees_what_drafting_sees():
    """Step 1 of the unrolled objective at position p gives the logits the head gives when it drafts
    that chain: the context from the target's features in its cache, then its own first draft."""
    from transformers import DynamicCache

    from gorgon.heads.masks import additive_mask
    from gorgon.heads.methods.eagle.objective import EagleObjective

    model = tiny_model("llama", layers=4)
    head = head_for(model)
    ids = torch.randint(0, VOCAB, (1, 12))
    ones = torch.ones_like(ids)
    with torch.no_grad():
        _, _, ranks = EagleObjective(model, head, steps=3)(ids, ones, ones.bool())
        out = model.get_decoder()(input_ids=ids, output_hidden_states=True)
        mixed = head.fc(torch.cat([out.hidden_states[i] for i in head.feature_layers], -1))
        for p in (0, 4, 7):  # step 2 has a label up to p = 12 - 2 - 2 - 1
            cache, fed = DynamicCache(), mixed[:, :p + 1]
            allowed = torch.ones(p + 1, p + 1, dtype=torch.bool).tril()
            for j in range(3):  # the root from the context, then two drafts along the data's chain
                n = fed.shape[1]
                positions = torch.arange(p + j - n + 1, p + j + 1)[None]
                fed = head.layer(fed, ids[:, p + j + 2 - n:p + j + 2], head.rope(positions, fed.dtype),
                                 additive_mask(allowed, fed.dtype)[None, None], cache)[:, -1:]
                torch.testing.assert_close(head.logits(fed[0, -1]), ranks[j][0][p])
                allowed = torch.ones(1, p + j + 2, dtype=torch.bool)


def test_the_objective_pairs_each_draft_with_the_teachers_distribution_for_its_token(monkeypatch):
    """An oracle head whose outputs carry their position (b, p) and whose logits are the teacher's at that
    position: every unrolled step's loss is then the teacher's own entropy over exactly the positions the
    assistant mask allows, its top-1 the whole count, and EAGLE-1's regression zero. A step's teacher, labels,
    mask or regression target read one position off (mutations of each survived the suite) breaks it."""
    from types import SimpleNamespace

    from gorgon.heads.methods.eagle.objective import EagleObjective

    batch, length, vocab = 2, 9, 11
    teacher = torch.randn(batch, length, vocab, generator=torch.Generator().manual_seed(0)) * 3
    code = torch.stack(torch.meshgrid(torch.arange(batch), torch.arange(length), indexing="ij"), -1).float()
    fc = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        fc.weight.copy_(torch.eye(2))
    oracle = SimpleNamespace(
        fc=fc, training=False, token_map=None, feature_layers=[0], config=SimpleNamespace(vocab_size=vocab),
        rope=lambda positions, dtype: None,
        layer=lambda fed, tokens, rope, mask, cache, dropout: fed + torch.tensor([0.0, 1.0]),  # the next position
        logits=lambda x: teacher[x[:, 0].long(), x[:, 1].long()])  # position p + 1 + j: the teacher of token p+2+j
    objective = EagleObjective(tiny_model("llama"), oracle, steps=2, hidden_weight=1.0)
    monkeypatch.setattr(objective, "target_outputs", lambda ids, mask: (code, teacher, teacher.argmax(-1)))
    ids = torch.zeros(batch, length, dtype=torch.long)

    def entropy(rows):
        return -(rows.softmax(-1) * rows.log_softmax(-1)).sum(-1).mean().item()

    everywhere = torch.ones(batch, length, dtype=torch.bool)
    _, stats, _ = objective(ids, torch.ones_like(ids), everywhere)
    for j in (0, 1):  # step j drafts token p + 2 + j from position p: teachers at 1 + j .. length - 2
        assert stats[j]["count"] == batch * (length - 2 - j) == stats[j]["top1"]
        assert stats[j]["loss"] == pytest.approx(entropy(teacher[:, 1 + j:length - 1]), abs=1e-5)
    one = torch.zeros(batch, length, dtype=torch.bool)
    one[:, 6] = True  # one assistant token: drafted at p = 4 (step 0) and p = 3 (step 1), teacher at 5 both
    _, stats, _ = objective(ids, torch.ones_like(ids), one)
    for j in (0, 1):
        assert stats[j]["count"] == batch == stats[j]["top1"]
        assert stats[j]["loss"] == pytest.approx(entropy(teacher[:, 5]), abs=1e-5)


def test_a_speculators_export_names_a_verifier_that_loads_offline(tmp_path, capsys, monkeypatch):
    """The verifier was the embedded target's Hub id, which speculators' from_pretrained and `vllm serve <export>`
    load, and fail on offline, though the target loaded from a local folder: it is that folder now, with the Hub
    id kept in base_model_name_or_path; a --base-model naming another model stays the verifier (to publish)."""
    from gorgon.heads.target import EMBEDDED_HUB_ID, EMBEDDED_NAME

    folder = tiny_chat_target(tmp_path, layers=6)
    head = EagleHead.for_target(load_target(str(folder), device="cpu").model, target_name=EMBEDDED_NAME)

    def verifier(base):
        out = export_head(head, "speculators", tmp_path / "out" / base.replace("/", "-"), base)
        config = json.loads((out / "config.json").read_text())
        return config["speculators_config"]["verifier"]["name_or_path"], config["base_model_name_or_path"]

    assert verifier(EMBEDDED_HUB_ID) == (str(folder.resolve()), EMBEDDED_HUB_ID)
    assert f"the speculators verifier is {folder.resolve()}, where the target loaded from" in capsys.readouterr().err
    assert verifier("someone/published") == ("someone/published", "someone/published")
    monkeypatch.chdir(tmp_path)  # a relative --target: the verifier loads from any folder
    assert verifier(folder.name) == (str(folder.resolve()), folder.name)


def test_the_serve_command_names_the_method_whatever_the_folder_is_called(tmp_path):
    """vLLM takes the method of a draft folder given without one from its path ("eagle3" in it), and loads any
    other as a plain draft model, which fails: the printed command names it for either layout."""
    from gorgon.heads.methods.eagle.method import serve

    head = EagleHead.for_target(tiny_model("llama", layers=6), depth=3)
    for fmt in ("eagle3", "speculators"):
        command = serve(fmt, tmp_path / "draft", "org/target", head)
        assert command.startswith("vllm serve org/target --speculative-config "), fmt
        assert json.loads(command.split("--speculative-config ")[1].strip("'")) == {
            "method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}


def test_a_folder_without_layer_ids_reads_the_layers_the_engines_read(tmp_path):
    """`speculators convert` writes null eagle_aux_hidden_state_layer_ids, which vLLM and speculators read as
    [2, L // 2, L - 3] of the target's L layers: it was refused as naming no layers."""
    folder = tiny_chat_target(tmp_path, layers=8)
    model = load_target(str(folder), device="cpu").model
    head = EagleHead.for_target(model)
    assert head.feature_layers == (2, 4, 5)  # the engines' default for 8 layers
    for fmt in ("speculators", "eagle3"):
        out = export_head(head, fmt, tmp_path / fmt, str(folder))
        config = json.loads((out / "config.json").read_text())
        config.update(eagle_aux_hidden_state_layer_ids=None, eagle_config=None)
        del config["gorgon"]  # as written elsewhere: the target's layers are counted in its config
        (out / "config.json").write_text(json.dumps(config))
        back = EagleHead.from_pretrained(out, target=model)
        assert back.feature_layers == (2, 4, 5) and back.config.layer_config["num_hidden_layers"] == 8, fmt
        torch.testing.assert_close(draft_logits(back), draft_logits(head))
    config.pop("base_model_name_or_path")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(GorgonError, match="names neither the target layers it reads nor its target: add eagle_aux"):
        EagleHead.from_pretrained(out, target=model)


@pytest.mark.parametrize("level_cost", [0.0, 0.5])
def test_rows_drafted_together_get_the_trees_each_drafts_alone(level_cost):
    """A batch's rows draft in one head forward a level (`scored_paths_together`): each row's candidates and
    chances must be those its own `scored_paths` gives, step after step, whatever the other rows hold: rows of
    other lengths, one taking in its whole prompt while the others take in a token or two, and (with a level
    cost) rows whose search stops at other depths. Its own cache must end as drafting alone leaves it."""
    model = tiny_model("llama", vocab=8, layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # confident drafts: deep trees, chances well apart
    head = head_for(model)
    drafter = EagleDrafter(head, nodes=8, depth=4, topk=3, level_cost=level_cost)
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 8, (n,), generator=generator) for n in (19, 11, 27)]
    with torch.no_grad():
        states = [model.get_decoder()(input_ids=t[None], output_hidden_states=True).hidden_states for t in texts]
    feats = [torch.cat([s[i][0] for i in head.feature_layers], -1) for s in states]
    alone, together = [drafter.fresh() for _ in texts], [drafter.fresh() for _ in texts]
    depths = set()
    # Each step row r's context grows to `ends[r]`; row 2 starts late, taking in its whole prompt at step 2.
    for ends in [(8, 5, None), (9, 7, None), (11, 8, 20), (14, 9, 21), (16, 10, 24)]:
        rows = [r for r, end in enumerate(ends) if end is not None]
        args = []
        for r in rows:
            before = alone[r].committed
            args.append((texts[r][ends[r]], feats[r][before:ends[r]], texts[r][:ends[r]]))
        own = [alone[r].scored_paths(*a) for r, a in zip(rows, args)]
        got = EagleDrafter.scored_paths_together([together[r] for r in rows], *map(list, zip(*args)))
        for mine, theirs in zip(got, own):
            assert [path for path, _ in mine] == [path for path, _ in theirs]
            assert [p for _, p in mine] == pytest.approx([p for _, p in theirs], rel=1e-4)
            depths.add(max(len(path) for path, _ in mine))
        for r in rows:
            assert together[r].committed == alone[r].committed
            for name in ("keys", "values"):
                assert torch.allclose(getattr(together[r].cache.layers[0], name),
                                      getattr(alone[r].cache.layers[0], name), atol=1e-5)
    assert len(depths) > 1 or level_cost == 0.0  # with a level cost, rows stopped at other depths
