"""The parallel drafter's export to the speculators library's `peagle` layout, which vLLM serves as EAGLE-3 with
parallel drafting (gorgon.heads.methods.parallel.formats): the keys, shapes and config fields the loaders read,
import back with identical drafts, `gorgon export` with the command it prints, and bad input."""

import json

import pytest
import torch
from helpers import tiny_chat_target, tiny_model, tiny_tokenizer
from safetensors.torch import load_file

from gorgon.heads import EagleHead, GorgonError, load_target
from gorgon.heads.cli import main as gorgon
from gorgon.heads.methods import by_name, method_of
from gorgon.heads.methods.parallel import ParallelDrafter, ParallelHead
from gorgon.heads.methods.parallel.formats import export_head, import_head

H, KV, FFN, V = 32, 16, 64, 128  # tiny_chat_target: hidden 32, 2 key-value heads of 8, MLP 64, vocabulary 128
MASK = len(tiny_tokenizer())     # the first embedding row its tokenizer has no token for: the mask token's


def loader_keys(layer: str, draft: int) -> dict:
    """The weights and shapes the loaders read from a peagle folder, as their source reads them:
    speculators src/speculators/models/eagle3/core.py (`fc`, `layers.0.*` with q/k/v over 2H and `hidden_norm`,
    `norm`, `lm_head`, `embed_tokens`, `d2t`, `t2d`) and models/peagle/core.py (`mask_hidden`, (1, 1, 3H));
    vLLM model_executor/models/llama_eagle3.py, `Eagle3LlamaForCausalLM.load_weights` (`mask_hidden` viewed as
    (1, 3H); `embed_tokens`, kept as the draft's own where it differs from the target's; `t2d` skipped)."""
    keys = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (draft, H), "embed_tokens.weight": (V, H),
            "mask_hidden": (1, 1, 3 * H), f"{layer}.input_layernorm.weight": (H,), f"{layer}.hidden_norm.weight": (H,),
            f"{layer}.post_attention_layernorm.weight": (H,), f"{layer}.self_attn.q_proj.weight": (H, 2 * H),
            f"{layer}.self_attn.k_proj.weight": (KV, 2 * H), f"{layer}.self_attn.v_proj.weight": (KV, 2 * H),
            f"{layer}.self_attn.o_proj.weight": (H, H), f"{layer}.mlp.gate_proj.weight": (FFN, H),
            f"{layer}.mlp.up_proj.weight": (FFN, H), f"{layer}.mlp.down_proj.weight": (H, FFN)}
    if draft < V:
        keys.update({"d2t": (draft,), "t2d": (V,)})
    return keys


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny chat targets (folders with a tokenizer of 101 tokens over a 128-row embedding) by family."""
    folder = tmp_path_factory.mktemp("targets")
    return {arch: tiny_chat_target(folder, arch, layers=4) for arch in ("llama", "qwen3")}


def drafter_for(target, block_size=3, draft_tokens=None):
    torch.manual_seed(0)
    head = ParallelHead.for_target(target.model, block_size, None, draft_tokens, "tiny/target", target.fingerprint)
    with torch.no_grad():  # not the starting point: every weight matters below
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.set_trees([[0.6, 0.1], [0.4, 0.1], [0.3, 0.1]][:block_size], {"cpu": 5, "cuda": 9})
    return head


def blocks(head, seeds=(0, 1), tokens=MASK):
    """The drafter's block logits over a few random contexts (features, `tokens` ids and root)."""
    out = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        features = torch.randn(5 + seed, 3 * H, generator=g)
        context = torch.randint(0, tokens, (5 + seed,), generator=g)
        out.append(ParallelDrafter(head).block(torch.randint(0, tokens, (), generator=g), features, context))
    return out


@pytest.mark.parametrize(("arch", "draft"), [("llama", 64), ("qwen3", V)])
def test_export_key_names_shapes_config_and_import_with_identical_drafts(tmp_path, targets, arch, draft):
    target = load_target(str(targets[arch]), device="cpu")
    head = drafter_for(target, draft_tokens=torch.arange(0, V, 2) if draft < V else None)
    out = export_head(head, "peagle", tmp_path / "peagle", "tiny/target")
    state, config = load_file(out / "model.safetensors"), json.loads((out / "config.json").read_text())
    expected = loader_keys("layers.0", draft)
    if arch == "qwen3":  # q/k norms over each head: vLLM's Qwen3 EAGLE-3 layer holds them
        expected.update({f"layers.0.self_attn.{p}_norm.weight": (8,) for p in "qk"})
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    if draft < V:
        assert state["d2t"].dtype == torch.int64 and torch.equal(torch.arange(draft) + state["d2t"], head.token_map)
    # The mask positions' inputs: mask_hidden, and the target's embedding with the mask vector in row MASK.
    assert torch.equal(state["mask_hidden"].reshape(-1), head.mask_hidden.detach())
    embedding = target.model.get_input_embeddings().weight.detach()
    assert torch.equal(state["embed_tokens.weight"][MASK], head.mask_embedding.detach())
    others = torch.arange(V) != MASK
    assert torch.equal(state["embed_tokens.weight"][others], embedding[others])
    # The fields the loaders read: speculators models/peagle/config.py (speculators_model_type, architectures,
    # mask_token_id); vLLM transformers_utils/configs/speculators/algos.py `update_peagle` (mask_token_id as
    # pard_token, draft_vocab_size, norm_before_residual, eagle_aux_hidden_state_layer_ids, the layer's
    # model_type: llama or qwen3) and base.py (speculative_tokens of the default proposal method).
    assert config["speculators_model_type"] == "peagle" and config["architectures"] == ["PEagleSpeculator"]
    assert config["mask_token_id"] == MASK and config["draft_vocab_size"] == draft
    assert config["norm_before_residual"] is False and config["target_hidden_size"] == H
    assert config["eagle_aux_hidden_state_layer_ids"] == list(head.feature_layers) == [1, 2, 3]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == arch and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    spec = config["speculators_config"]
    assert spec["algorithm"] == "peagle" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3  # the block: vLLM drafts that many a step
    assert spec["verifier"]["name_or_path"] == str(targets[arch].resolve())  # its target's folder: loads offline
    assert config["gorgon"]["block_size"] == 3 and "depth" not in config["gorgon"]

    back = import_head(out, target)
    assert back.config.block_size == 3 and back.config.draft_vocab_size == head.config.draft_vocab_size
    assert back.accuracies == head.accuracies and back.saved_nodes("cpu") == 5
    assert back.config.target_fingerprint == target.fingerprint
    assert all(torch.equal(a, b) for a, b in zip(blocks(back), blocks(head)))
    again = export_head(back, "peagle", tmp_path / "again", "tiny/target")  # exports again as it was exported
    assert json.loads((again / "config.json").read_text()) == config
    state_again = load_file(again / "model.safetensors")
    assert state_again.keys() == state.keys() and all(torch.equal(state[k], state_again[k]) for k in state)
    method = by_name("parallel")  # the registry loads such a folder too, and tells it from a draft model's
    assert method.holds(out, config) and all(torch.equal(a, b) for a, b in
                                             zip(blocks(method.load(out, target)), blocks(head)))
    assert method_of(out) is method


def test_gorgon_export_writes_it_and_prints_vllms_command(tmp_path, targets, capsys):
    target = load_target(str(targets["llama"]), device="cpu")
    drafter_for(target, block_size=2).save_pretrained(tmp_path / "p")
    out = tmp_path / "out"
    assert gorgon(["export", "--heads", str(tmp_path / "p"), "--target", str(targets["llama"]), "--format", "peagle",
                   "--out", str(out), "--base-model", "tiny/target"]) == 0
    printed = capsys.readouterr().out
    spec = json.loads(printed.split("--speculative-config '")[1].split("'")[0])
    # vLLM's detection has no peagle branch (vllm/config/speculative.py): the command names the method, and
    # parallel drafting, as base.py sets them for a peagle folder served as the model itself.
    assert spec == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 2, "parallel_drafting": True}
    assert printed.count("vllm serve tiny/target ") == 1 and (out / ".gorgon-export").is_file()
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "peagle"


def test_bad_input_is_one_line(tmp_path, targets, capsys):
    target = load_target(str(targets["llama"]), device="cpu")
    head = drafter_for(target)
    out = export_head(head, "peagle", tmp_path / "out", "tiny/target")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    small = tiny_model("llama", vocab=64, layers=4)  # every row a token of its tokenizer (101 tokens)
    small.save_pretrained(tmp_path / "small")
    tiny_tokenizer().save_pretrained(tmp_path / "small")
    bare = tiny_model("llama", vocab=V, layers=4)  # loaded from no folder: no tokenizer to ask
    for folder, edit in [("more-layers", lambda c, s: c["transformer_layer_config"].update(num_hidden_layers=2)),
                         ("own-embedding", lambda c, s: s["embed_tokens.weight"][3].add_(1.0)),
                         ("bad-mask", lambda c, s: c.update(mask_token_id=V))]:
        config, state = json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")
        edit(config, state)
        from gorgon.heads.files import write_weights
        write_weights(tmp_path / folder, state, config)
    head.save_pretrained(tmp_path / "own")
    for make, message in [
        (lambda: export_head(EagleHead.for_target(target.model), "peagle", tmp_path / "x"),
         "^the peagle layout holds a parallel drafter, not EagleHead: export it in a format of its own method"),
        (lambda: export_head(head, "eagle3", tmp_path / "x"), "^unknown format 'eagle3' for a parallel drafter: "
                                                             "use peagle$"),
        (lambda: export_head(head, "peagle", tmp_path / "full"), "exists and is not an empty folder: export into a "
                                                                 "new one"),
        (lambda: export_head(ParallelHead.for_target(bare), "peagle", tmp_path / "x"),
         "chosen by the target's tokenizer, which does not load from where the target loaded"),
        (lambda: import_head(tmp_path / "own", target), "is not the speculators peagle layout"),
        (lambda: import_head(out, None), "^a peagle folder's mask token is told from the target's embedding: pass"),
        (lambda: import_head(tmp_path / "more-layers", target), "sets num_hidden_layers 2, and gorgon's parallel "
                                                                "drafter computes one EAGLE-3 layer"),
        (lambda: import_head(tmp_path / "own-embedding", target), "embed_tokens is not the target's"),
        (lambda: import_head(tmp_path / "bad-mask", target), "has mask_token_id = 128, which is not a row of its "
                                                             "embedding \\(0 to 127\\)"),
        (lambda: import_head(out, tiny_model("llama", vocab=64, layers=4)), "of a vocabulary of 128, but the target "
                                                                            "has 64"),
    ]:
        with pytest.raises(GorgonError, match=message) as err:
            make()
        assert "\n" not in str(err.value)
    assert not (tmp_path / "x").exists()
    # through the command: a refused export leaves no --out behind
    refused = tmp_path / "refused"
    drafter_for(target).save_pretrained(tmp_path / "d")
    assert gorgon(["export", "--heads", str(tmp_path / "d"), "--target", str(tmp_path / "small"), "--format",
                   "peagle", "--out", str(refused)]) == 2
    assert "pass the target they were trained for" in capsys.readouterr().err and not refused.exists()


def test_a_target_whose_every_row_is_a_token_gives_up_its_pad_token_as_speculators_does(tmp_path, capsys):
    """No free row: the mask vector goes into the pad token's row (speculators' trainer's fallback), said on
    stderr; the folder imports back with identical drafts (gorgon embeds tokens from the target)."""
    small = tiny_model("llama", vocab=64, layers=4)  # every row a token of its tokenizer (101 tokens)
    small.save_pretrained(tmp_path / "small")
    tiny_tokenizer().save_pretrained(tmp_path / "small")
    target = load_target(str(tmp_path / "small"), device="cpu")
    head = ParallelHead.for_target(target.model, 3, None, None, "tiny/target", target.fingerprint)
    out = export_head(head, "peagle", tmp_path / "out", "tiny/target")
    pad = tiny_tokenizer().pad_token_id
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == pad
    assert f"the mask positions read the row of its pad token {tiny_tokenizer().convert_ids_to_tokens(pad)!r} " \
           f"(id {pad}), as speculators does" in capsys.readouterr().err
    assert torch.equal(load_file(out / "model.safetensors")["embed_tokens.weight"][pad], head.mask_embedding)
    assert all(torch.equal(a, b) for a, b in zip(blocks(import_head(out, target), tokens=64),
                                                   blocks(head, tokens=64)))
