"""The method registry (gorgon.heads.methods): each drafting method is found by its folder's name, recognises
the folders it wrote (its own layout and the engines' it imports), and owns its recipe keys; the core reads
everything it needs of a method from there."""

import dataclasses
import json

import pytest
from helpers import tiny_model

from gorgon.heads import EagleHead, GorgonError, MedusaHeads
from gorgon.heads.methods import PACKAGES, loaded_files, method_of, methods, recorded_method
from gorgon.heads.methods.medusa import formats as medusa_formats


def test_every_package_registers_one_method_named_for_its_folder():
    assert [m.name for m in methods()] == list(PACKAGES)
    assert len({m.title for m in methods()}) == len(PACKAGES)  # messages tell them apart


def test_each_folder_is_recognised_as_the_method_that_wrote_it(tmp_path):
    model = tiny_model()
    MedusaHeads.for_target(model, shared_lm_head=False).save_pretrained(tmp_path / "medusa")
    medusa_formats.export_heads(MedusaHeads.from_pretrained(tmp_path / "medusa"), "vllm", tmp_path / "vllm")
    EagleHead.for_target(model).save_pretrained(tmp_path / "eagle")
    model.save_pretrained(tmp_path / "model")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(["not", "a", "mapping"]))
    found = {name: method_of(tmp_path / name) for name in ("medusa", "vllm", "eagle", "model", "other")}
    assert {name: m and m.name for name, m in found.items()} == {
        "medusa": "medusa", "vllm": "medusa", "eagle": "eagle", "model": "draft_model", "other": None}


def test_a_model_folder_given_as_heads_is_told_where_it_goes(tmp_path):
    from gorgon.heads.loading import heads_method

    tiny_model().save_pretrained(tmp_path / "model")
    with pytest.raises(GorgonError, match=r"holds a model \(LlamaForCausalLM\), not heads: a draft model goes to "
                                          "generate and bench as --draft"):
        heads_method(tmp_path / "model")


def test_a_runs_recorded_method_reads_older_metrics_too():
    assert recorded_method({"arch": "eagle"}).name == "eagle"
    assert recorded_method({"kind": "draft"}).name == "draft_model"  # a draft run of an older gorgon
    assert recorded_method({}).name == "medusa"  # heads runs recorded no arch before EAGLE heads


def test_downloads_fetch_every_methods_files():
    patterns = loaded_files()
    assert {"*.safetensors", "trees.json", "adapter/*", "medusa_lm_head.pt"} <= set(patterns)
    assert len(patterns) == len(set(patterns))


def test_the_recipe_holds_every_trained_methods_keys_and_refuses_another_methods():
    from gorgon.train.heads import HeadsTrainConfig

    keys = {f.name for f in dataclasses.fields(HeadsTrainConfig)}
    for m in methods():
        if m.recipe is not None:
            assert {f.name for f in dataclasses.fields(m.recipe)} <= keys
    HeadsTrainConfig(data="x", out="y", arch="eagle", ttt_steps=2).check()
    with pytest.raises(GorgonError, match="^ttt_steps is a key of arch: eagle .*, not of arch: medusa: remove it, or "
                                          "set arch: eagle$"):
        HeadsTrainConfig(data="x", out="y", ttt_steps=2).check()


def test_resuming_another_methods_finished_run_says_so(tmp_path):
    from gorgon.train.heads import HeadsTrainConfig
    from gorgon.train.run_folder import prepare_own_output

    out = tmp_path / "run"
    EagleHead.for_target(tiny_model()).save_pretrained(out)
    (out / "recipe.json").write_text(json.dumps({"arch": "eagle"}))  # a finished run's
    before = sorted(p.name for p in out.iterdir())
    cfg = HeadsTrainConfig(data=str(tmp_path / "data"), out=str(out), resume=True)
    with pytest.raises(GorgonError, match=f"^--out {out} holds a finished run of an EAGLE head, but this recipe "
                                          "trains Medusa heads: choose another --out"):
        prepare_own_output(out, lambda: None, cfg)
    assert sorted(p.name for p in out.iterdir()) == before


def test_methods_share_a_key_for_one_concept_and_others_refuse_it():
    """The target layers a head reads are one key for every method that reads them."""
    from gorgon.train.heads import HeadsTrainConfig

    for arch in ("eagle", "parallel"):
        cfg = HeadsTrainConfig(data="x", out="y", arch=arch, feature_layers=[1, 2])
        cfg.check()
        assert cfg.recipe().feature_layers == [1, 2]
    with pytest.raises(GorgonError, match="^feature_layers is a key of arch: eagle .*, not of arch: medusa"):
        HeadsTrainConfig(data="x", out="y", feature_layers=[1, 2]).check()
