
import json
import re

import pytest
import torch
from helpers import VOCAB, assert_feature_cache_is_exact, saved_heads, tiny_chat_target, tiny_model

from gorgon.heads import EagleHead, GorgonError, MedusaConfig, MedusaHeads, Target, fingerprint
from gorgon.heads.cli import main as gorgon
from gorgon.heads.methods.medusa.objective import MedusaObjective
from gorgon.heads.target import legacy_fingerprint


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shared", [True, False])
def test_save_load_round_trip_gives_identical_logits(tmp_path, arch, shared):
    model = tiny_model(arch)
    heads = MedusaHeads.for_target(model, num_heads=3, num_layers=2, shared_lm_head=shared,
                                   target_name=arch, target_fingerprint=fingerprint(model))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    heads.trees = {"cpu": [[0], [0, 0]]}
    heads.save_pretrained(tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["config.json", "model.safetensors", "trees.json"]
    loaded = MedusaHeads.from_pretrained(tmp_path, target=model)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(loaded(hidden), heads(hidden), rtol=0, atol=0)
    assert loaded.trees == heads.trees and loaded.config == heads.config
    # distinct modules per layer and per head
    assert len({id(b) for head in heads.blocks for b in head}) == 6
    fresh = MedusaHeads.for_target(model, num_heads=2)  # no trees: the folder's old ones must not pass for its
    fresh.save_pretrained(tmp_path)
    assert MedusaHeads.from_pretrained(tmp_path, target=model).trees == fresh.trees


def test_untrained_heads_start_from_the_target_prediction():
    """Zero-initialised blocks plus the target's lm_head: a head's logits are a function of the
    target's own hidden state, so per-head lm_heads start equal to the shared one."""
    model = tiny_model("llama")
    shared = MedusaHeads.for_target(model, num_heads=2)
    own = MedusaHeads.for_target(model, num_heads=2, shared_lm_head=False)
    own.load_state_dict({**own.state_dict(), **shared.state_dict()})
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(own(hidden), shared(hidden))


def test_the_objective_runs_the_target_once():
    """Medusa-1 with the KL loss: the target's logits (the teacher) come from the same forward as the heads' input."""
    model = tiny_model("llama")
    heads = MedusaHeads.for_target(model, num_heads=4)
    ids = torch.randint(0, VOCAB, (2, 7))
    objective = MedusaObjective(model, heads, loss="kl")  # measures the target's logit scale once (logit_scale)
    calls = []
    handle = model.get_decoder().register_forward_hook(lambda *a: calls.append(1))
    loss, stats, hidden = objective(ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    handle.remove()
    assert len(calls) == 1
    torch.testing.assert_close(model.lm_head(hidden), model(ids).logits)
    assert hidden.shape == (2, 7, 32) and heads(hidden).shape == (4, 2, 7, VOCAB)
    assert torch.isfinite(loss) and sorted(stats) == [0, 1, 2, 3]


def test_the_feature_cache_skips_the_frozen_target_and_keeps_the_loss():
    """Medusa-1 reads the frozen target's hidden states back for conversations it has seen."""
    model = tiny_model("llama")
    heads = MedusaHeads.for_target(model, num_heads=3)
    assert_feature_cache_is_exact(model, lambda cache: MedusaObjective(model, heads, loss="kl", cache=cache),
                                  [p for p in heads.parameters() if p.requires_grad])


def test_fingerprint_ignores_dtype_but_not_weights(tmp_path):
    model = tiny_model("llama")
    fp = fingerprint(model)
    for dtype in (torch.bfloat16, torch.float16):
        assert fingerprint(tiny_model("llama").to(dtype)) == fp
    assert fingerprint(tiny_model("llama", seed=1)) != fp
    # The earlier fingerprint rounded to bf16, which an fp16 copy does not reproduce at ties: fp32-trained
    # heads were refused on an fp16 target. They load now.
    assert legacy_fingerprint(tiny_model("llama").half()) != legacy_fingerprint(model)
    MedusaHeads.for_target(model, target_fingerprint=fp).save_pretrained(tmp_path)
    MedusaHeads.from_pretrained(tmp_path, target=Target(tiny_model("llama").half(), tokenizer=None, name="fp16"))


def test_heads_that_recorded_the_earlier_fingerprint_still_load(tmp_path):
    model = tiny_model("llama")
    MedusaHeads.for_target(model, target_fingerprint=legacy_fingerprint(model)).save_pretrained(tmp_path)
    MedusaHeads.from_pretrained(tmp_path, target=Target(model, tokenizer=None, name="a"))
    with pytest.raises(GorgonError, match="fingerprint"):
        MedusaHeads.from_pretrained(tmp_path, target=Target(tiny_model("llama", seed=1), tokenizer=None, name="b"))


def test_heads_refuse_another_target(tmp_path):
    model = tiny_model("llama")
    heads = MedusaHeads.for_target(model, target_name="a", target_fingerprint=fingerprint(model))
    heads.save_pretrained(tmp_path)
    other = tiny_model("llama", seed=1)
    with pytest.raises(GorgonError, match="fingerprint"):
        MedusaHeads.from_pretrained(tmp_path, target=Target(other, tokenizer=None, name="other"))
    wide = tiny_model("llama", vocab=VOCAB * 2)
    with pytest.raises(GorgonError, match="vocabulary"):
        MedusaHeads.from_pretrained(tmp_path, target=wide)
    import transformers as tf
    narrow = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(GorgonError, match="hidden size 32"):
        MedusaHeads.from_pretrained(tmp_path, target=narrow)


def test_heads_for_another_targets_shapes_fail_before_its_weights_load(tmp_path):
    """From the two config.json files: shown by a target folder that holds a config and no weights (which would
    fail to load). Medusa heads and an EAGLE head, by hidden size and by vocabulary."""
    from gorgon.heads import load_heads

    model = tiny_model("llama")
    MedusaHeads.for_target(model, target_name="tiny").save_pretrained(tmp_path / "medusa")
    EagleHead.for_target(model, target_name="tiny").save_pretrained(tmp_path / "eagle")
    fix = r"pass the target they were trained for \(--target tiny\), or heads trained for this one"
    for name, change, message in [("wide", {"vocab_size": VOCAB * 2}, rf"these heads were trained for tiny, of a "
                                                                     rf"vocabulary of {VOCAB}, but the target has "
                                                                     rf"{VOCAB * 2}: {fix}"),
                                  ("narrow", {"hidden_size": 16}, rf"these heads were trained for tiny, of hidden size "
                                                                  rf"32, but the target has 16: {fix}")]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**model.config.to_dict(), **change}))
        for heads in ("medusa", "eagle"):
            with pytest.raises(GorgonError, match=message):
                load_heads(tmp_path / heads, str(folder), device="cpu")


def test_bad_checkpoints(tmp_path):
    with pytest.raises(GorgonError, match="no heads at"):
        MedusaHeads.from_pretrained(tmp_path / "missing" / "deeper")
    with pytest.raises(GorgonError, match="has no config.json"):
        MedusaHeads.from_pretrained(tmp_path)
    model = tiny_model("llama")
    MedusaHeads.for_target(model).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_head": 3}))
    with pytest.raises(GorgonError, match="unknown key 'num_head'.*num_heads"):
        MedusaHeads.from_pretrained(tmp_path)
    # Another method's folder was "unknown key 'layer_config'" (or 'num_heads'): it says what loads it.
    EagleHead.for_target(model).save_pretrained(tmp_path / "eagle")
    with pytest.raises(GorgonError, match=r"eagle/config.json is not a gorgon Medusa heads config \(it has "
                                          r"'layer_config', 'feature_layers', 'depth', ...\): gorgon.heads.load_heads "
                                          "loads any method's heads$"):
        MedusaHeads.from_pretrained(tmp_path / "eagle")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(GorgonError, match=r"config.json is not a gorgon EAGLE head's config \(it has "
                                          r"'num_heads', 'num_layers', 'shared_lm_head'\)"):
        EagleHead.from_pretrained(tmp_path)
    for key, value, kind in [("num_heads", "3", "int"), ("shared_lm_head", 1, "bool"), ("hidden_size", True, "int"),
                             ("draft_vocab_size", 8.0, "int | None")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(GorgonError, match=rf"config.json has {key} = {value!r}, which is not {kind}: correct it"):
            MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")  # not UTF-8: one line, as for an EAGLE head
    with pytest.raises(GorgonError, match=r"cannot read .*config.json \(UnicodeDecodeError\): re-save or re-download"):
        MedusaHeads.from_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    with pytest.raises(GorgonError) as wrong_shape:
        MedusaHeads.from_pretrained(tmp_path)
    assert "\n" not in str(wrong_shape.value) and re.search(
        r"do not match its config.json \(size mismatch for blocks\.0\.0\.\w+\.weight: copying a param with shape "
        r"torch.Size\(\[\d+, \d+\]\) from checkpoint, the shape in current model is torch.Size", str(wrong_shape.value))
    (tmp_path / "model.safetensors").write_bytes(weights)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(GorgonError, match="corrupt"):
        MedusaHeads.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(GorgonError, match="no model.safetensors"):
        MedusaHeads.from_pretrained(tmp_path)
    with pytest.raises(GorgonError, match="lacks hidden_size"):
        MedusaConfig.from_dict({"vocab_size": 3})


def test_hub_id_goes_through_the_hub_client(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(GorgonError, match="no heads 'someone/heads': no local folder by that name, and the local hub "
                                          r"cache \(HF_HUB_OFFLINE is set\)"):
        MedusaHeads.from_pretrained("someone/heads")


def test_draft_vocabulary_restricts_drafts_and_survives_save_load(tmp_path):
    model = tiny_model("llama")
    for shared in (True, False):
        heads = MedusaHeads.for_target(model, num_heads=3, shared_lm_head=shared)
        with torch.no_grad():
            for p in heads.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        vocab = torch.tensor([3, 9, 17, 20, 33, 41, 50, 63])
        heads.set_draft_vocab(vocab)
        hidden = torch.randn(5, 32)
        top = heads.draft_topk(hidden, 3)
        assert top.shape == (3, 5, 3) and torch.isin(top, vocab).all()
        full = heads(hidden)[..., vocab]                       # the same ranking, restricted by hand
        assert torch.equal(top, vocab[full.topk(3, dim=-1).indices])
        heads.save_pretrained(tmp_path / str(shared))
        back = MedusaHeads.from_pretrained(tmp_path / str(shared), target=model)
        assert back.config.draft_vocab_size == 8 and torch.equal(back.draft_topk(hidden, 3), top)
        # A training step (or a load) changes the LM head after drafting: drafts follow the new weights.
        with torch.no_grad():
            for k in range(3):
                back.lm_head_weight(k).add_(torch.randn_like(back.lm_head_weight(k)))
        expected = vocab[back(hidden)[..., vocab].topk(3, dim=-1).indices]
        assert torch.equal(back.draft_topk(hidden, 3), expected) and not torch.equal(expected, top)


def test_a_draft_vocabulary_lists_each_token_once():
    """A repeated id would be proposed twice among siblings; an id past the vocabulary indexes nothing."""
    heads = MedusaHeads.for_target(tiny_model("llama"))
    for ids in ([1, 1, 2], [0, VOCAB], [-1, 3], []):
        with pytest.raises(GorgonError, match=rf"a draft vocabulary lists token ids from 0 to {VOCAB - 1}, each once"):
            heads.set_draft_vocab(torch.tensor(ids, dtype=torch.long))
    heads.set_draft_vocab(torch.tensor([5, 2, 9]))
    assert heads.token_map.tolist() == [2, 5, 9]


def test_heads_load_onto_the_target_they_record(tmp_path, capsys):
    """As PEFT loads an adapter's base model: without --target, the target the heads were trained for, said on
    stderr (it was the embedded SmolLM2, so heads for any other target failed with a shape error)."""
    from helpers import tiny_chat_target

    from gorgon.heads import load_heads
    from gorgon.heads.cli import main as gorgon

    target = tiny_chat_target(tmp_path)
    model = tiny_model("llama", vocab=128)  # its shapes
    MedusaHeads.for_target(model, target_name=str(target)).save_pretrained(tmp_path / "heads")
    loaded, _ = load_heads(tmp_path / "heads", device="cpu")
    assert loaded.name == str(target)
    said = capsys.readouterr().err
    assert f"gorgon: target {target}, which the heads were trained for (--target chooses another)" in said
    MedusaHeads.for_target(model, target_name=str(tmp_path / "gone")).save_pretrained(tmp_path / "elsewhere")
    assert gorgon(["generate", "--heads", str(tmp_path / "elsewhere"), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"these heads were trained for the target at {tmp_path / 'gone'}, "
                                                    "which is not on this machine: pass --target (that model, from the "
                                                    "Hub or a copy)")


def test_medusa_losses_and_rank_counts_pair_each_head_with_its_token():
    """Oracle heads whose output at position t is the teacher's at t + k + 1 (kl) or a one-hot of the token at
    t + k + 2 (ce, rank counts): the KL is zero, every label is the top-1 and every rank count is rank 0. A
    teacher or label read one position off (mutations of each survived the suite) breaks it."""
    from types import SimpleNamespace

    from gorgon.heads.methods.medusa.objective import medusa_loss, rank_counts

    batch, length, vocab, num_heads = 2, 10, 13, 3
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    teacher = torch.randn(batch, length, vocab, generator=torch.Generator().manual_seed(1))
    hidden = torch.stack(torch.meshgrid(torch.arange(batch), torch.arange(length), indexing="ij"), -1).float()
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[:, 4:] = True  # the assistant's tokens

    def heads(output):
        return SimpleNamespace(config=SimpleNamespace(num_heads=num_heads, vocab_size=vocab), token_map=None,
                               head=output, draft_topk=lambda h, r: [output(k, h).topk(r).indices
                                                                      for k in range(num_heads)])

    def at(x, shift):  # (rank_counts runs every head on one head's rows: past the end, any row will do)
        return x[:, 0].long(), (x[:, 1].long() + shift).clamp(max=length - 1)

    kl, stats = medusa_loss(heads(lambda k, x: teacher[at(x, k + 1)]), hidden, ids, mask, loss="kl",
                            target_logits=teacher)
    assert kl.item() == pytest.approx(0.0, abs=1e-5)
    one_hot = heads(lambda k, x: torch.nn.functional.one_hot(ids[at(x, k + 2)], vocab).float() * 20)
    ce, stats = medusa_loss(one_hot, hidden, ids, mask)
    assert all(stats[k]["top1"] == stats[k]["count"] == batch * (length - 4) for k in range(num_heads))
    counts = rank_counts(one_hot, hidden, ids, mask, max_rank=3)
    assert counts[:, 0].tolist() == counts[:, -1].tolist() == [batch * (length - 4)] * num_heads


def test_a_model_passed_as_heads_says_so(tmp_path, capsys):
    """A draft model (or the target) given as --heads was "unknown key 'architectures' in config.json"."""
    target = tiny_chat_target(tmp_path)
    capsys.readouterr()
    assert gorgon(["generate", "--heads", str(target), "--target", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err.strip() == (f"gorgon generate: error: {target} holds a model (LlamaForCausalLM), "
                                               "not heads: a draft model goes to generate and bench as --draft "
                                               "(engines load its folder as it is, with no export), a target as "
                                               "--target")


def test_a_folder_that_is_not_a_model_says_what_it_holds(tmp_path, capsys):
    """Heads passed as the target, a model without its tokenizer, an empty folder: each named for what it is."""
    heads = saved_heads(tmp_path)
    no_tokenizer = tmp_path / "weights-only"
    tiny_model().save_pretrained(no_tokenizer)
    (tmp_path / "empty").mkdir()
    cases = {heads: "it holds draft heads; pass it as --heads", no_tokenizer: "has no tokenizer transformers can load",
             tmp_path / "empty": "it has no readable config.json"}
    capsys.readouterr()
    for folder, expected in cases.items():
        assert gorgon(["generate", "--target", str(folder), "--context-draft", "--prompt", "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert expected in err[-1] and not any("Traceback" in line or "no local folder" in line for line in err), err


def test_heads_are_not_saved_over_another_model(tmp_path):
    """save_pretrained into a transformers model's folder replaced its config.json and model.safetensors (and
    Medusa heads without trees removed a trees.json there): refused; heads saved before are saved over."""
    model = tiny_model()
    folder, file = tmp_path / "model", tmp_path / "notes.txt"
    model.save_pretrained(folder)
    (folder / "trees.json").write_text("mine")
    file.write_text("mine")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for heads in (MedusaHeads.for_target(model), EagleHead.for_target(model)):
        with pytest.raises(GorgonError, match=f"^{re.escape(str(folder))} holds another model's config.json, which "
                                              "saving heads there would replace: save them into a new or empty"):
            heads.save_pretrained(folder)
        with pytest.raises(GorgonError, match="is a file, not a folder: save the heads into a new or empty folder"):
            heads.save_pretrained(file)
        heads.save_pretrained(tmp_path / "heads")
        heads.save_pretrained(tmp_path / "heads")  # its own folder: saved over
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before and file.read_text() == "mine"
    (folder / "config.json").unlink()
    with pytest.raises(GorgonError, match="holds another model's model.safetensors"):
        MedusaHeads.for_target(model).save_pretrained(folder)
