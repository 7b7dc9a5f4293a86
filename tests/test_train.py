"""Head training: a real `accelerate launch`, learning, Medusa-2's preserved outputs, kill and resume."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ROOT,
    another_live_process,
    env,
    kill_after_a_checkpoint,
    resume_equals_a_whole_run,
    snapshot,
    tiny_chat_target,
    toy_data,
)
from safetensors.torch import load_file

from gorgon.decode import speculative_generate
from gorgon.heads import GorgonError, MedusaHeads, drafter_for, load_heads, load_target
from gorgon.train.data import DataSettings, make_dataset
from gorgon.train.draft import DraftTrainConfig
from gorgon.train.draft import train as train_draft
from gorgon.train.heads import HeadsTrainConfig, train
from gorgon.train.recipe import load_recipe, parse_overrides, recipe_main
from gorgon.train.run_folder import MAY_CHANGE, latest_checkpoint, resume_settings


@pytest.mark.slow
def test_accelerate_launch_trains_a_few_steps(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl")
    out = tmp_path / "heads"
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
         str(ROOT / "train/heads.py"), "--data", data, "--target", str(target), "--out", str(out),
         "--max-steps", "4", "--batch-size", "4", "--log-every", "2", "--save-every", "2"],
        env={**env(), "WANDB_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ["config.json", "model.safetensors", "trees.json", "metrics.json", "head_accuracy.png", "README.md"]:
        assert (out / name).is_file(), name
    trees = json.loads((out / "trees.json").read_text())
    assert len(trees["cpu"]) == 15 and len(trees["cuda"]) == 63 and len(trees["accuracies"]) == 4
    assert re.search(r"^step 4: loss (\d+\.\d\d ){4}\| top-1 (0\.\d{3} ){4}\(drafts 1-4\) \| \d+ tok/s", run.stderr,
                     re.M), run.stderr[-2000:]
    assert "step 4" not in run.stdout and "gorgon train: saved heads to" in run.stdout  # stdout: the result
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb should log offline"
    logged = b"".join(f.read_bytes() for f in (tmp_path / "wandb").glob("offline-run-*/*.wandb"))
    assert b"train/loss_head1" in logged and b"loss_head0" not in logged  # numbered as the card and the log lines
    heads = MedusaHeads.from_pretrained(out, target=load_target(str(target), device="cpu"))
    assert heads.config.num_heads == 4 and heads.trees == trees


def eval_loss(heads, target, data):
    """Mean CE of each head on the toy data (teacher-forced)."""
    from gorgon.heads.methods.medusa.objective import medusa_loss
    from gorgon.train.examples import collate, load_examples

    ex = load_examples(data, target.tokenizer, 256)
    batch = collate(ex, target.tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = target.model.get_decoder()(input_ids=batch["input_ids"],
                                            attention_mask=batch["attention_mask"]).last_hidden_state
        _, stats = medusa_loss(heads, hidden, batch["input_ids"], batch["loss_mask"])
    return [s["loss"] for s in stats.values()]


@pytest.mark.slow
def test_loss_falls_on_a_learnable_toy_set(tmp_path):
    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl")
    out = train(HeadsTrainConfig(data=data, out=str(tmp_path / "h"), target=str(target_path), max_steps=60,
                                 batch_size=8, learning_rate=3e-2, warmup_steps=5, report_to="none", save_every=0,
                                 draft_vocab_size=30))
    target = load_target(str(target_path), device="cpu")
    fresh = MedusaHeads.for_target(target.model)
    trained = MedusaHeads.from_pretrained(out, target=target)
    fresh.set_draft_vocab(trained.token_map)  # the loss over 30 tokens, as the trained heads': lower by itself
    before, after = eval_loss(fresh, target, data), eval_loss(trained, target, data)
    assert all(a < 0.5 * b for a, b in zip(after, before)), (before, after)
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0.99 <= metrics["draft_vocab_coverage"] <= 1.0  # the toy answers use fewer than 30 characters
    assert trained.config.draft_vocab_size == 30 and trained.token_map.numel() == 30
    assert metrics["tree_nodes"] == {"cpu": 16, "cuda": 64}  # Medusa's default sizes
    assert [len(trained.saved_tree(device)) + 1 for device in ("cpu", "cuda")] == [16, 64]
    assert len(metrics["top1"]) == 4 and all(0 <= a <= b <= 1 for a, b in zip(metrics["top1"], metrics["top5"]))


def test_the_draft_vocabulary_is_the_answers_tokens_by_count_then_the_lowest_unused_ids():
    from gorgon.train.examples import frequent_tokens

    examples = [{"input_ids": [50, 7, 7, 9, 9, 40, 3], "loss_mask": [0, 1, 1, 1, 1, 1, 0]}]  # 50 and 3: prompt only
    tokens, coverage = frequent_tokens(examples, 6, vocab_size=64)
    # 7 and 9 twice (the tie to the lower id), 40 once, then the lowest ids no answer uses
    assert tokens.tolist() == [7, 9, 40, 0, 1, 2] and coverage == 1.0
    tokens, coverage = frequent_tokens(examples, 2, vocab_size=64)
    assert tokens.tolist() == [7, 9] and coverage == pytest.approx(0.8)


def medusa2(tmp_path, target_path, data, base_kl_weight, name):
    return train(HeadsTrainConfig(data=data, out=str(tmp_path / name), target=str(target_path), mode="medusa2",
                                  max_steps=30, batch_size=8, learning_rate=3e-3, backbone_learning_rate=3e-3,
                                  heads_warmup_steps=5, base_kl_weight=base_kl_weight, lora_r=4, lora_alpha=8,
                                  report_to="none", save_every=0))


def greedy_answers(model, tok, n=8):
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": f"count from {i}"}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(loss="kl", cache_features=True), dict(mode="medusa2", lora_r=4),
                                      dict(arch="eagle", cache_features=True, ttt_steps=2)],
                         ids=["medusa1", "medusa2", "eagle"])
def test_heads_train_in_float32_beside_a_bfloat16_target(tmp_path, settings, monkeypatch):
    """Without accelerate's autocast (plain `python train/heads.py`, or an accelerate config without mixed
    precision) the float32 heads read a bfloat16 target's features, cached ones in the second epoch too;
    then they load and draft beside it (greedy output equals generate's exactly in float32 only)."""
    from gorgon.heads.feature_cache import FeatureCache

    found, get = [], FeatureCache.get

    def recorded_get(self, *args):
        found.append(get(self, *args))
        return found[-1]

    monkeypatch.setattr(FeatureCache, "get", recorded_get)
    target_path = str(tiny_chat_target(tmp_path))
    out = train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=16), out=str(tmp_path / "h"),
                                 target=target_path, dtype="bfloat16", epochs=2, batch_size=8, report_to="none",
                                 save_every=0, **settings))
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4
    if settings.get("cache_features"):  # the second epoch's 2 batches, at least, read the target's outputs kept
        assert sum(f is not None for f in found) >= 2, found
    target, heads = load_heads(out, target_path, device="cpu", dtype="bfloat16")
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "count from 3"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    assert len(speculative_generate(target.model, drafter_for(heads), ids, max_new_tokens=8).tokens) == 8


@pytest.mark.slow
def test_medusa2_keeps_the_base_models_greedy_outputs(tmp_path):
    """Trained on the target's own answers (as Medusa-2 is), with the KL term dominating."""
    from gorgon.train.data import DataSettings, make_dataset

    target_path = tiny_chat_target(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count from {i}"}) + "\n" for i in range(48)))
    data = str(make_dataset(DataSettings(prompts=str(prompts), target=str(target_path), max_new_tokens=24,
                                         batch_size=16), tmp_path / "self-data", progress=False))
    base = load_target(str(target_path), device="cpu")
    expected = greedy_answers(base.model, base.tokenizer)
    out = medusa2(tmp_path, target_path, data, base_kl_weight=1000.0, name="kl")
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items()), "LoRA never trained"
    merged, heads = load_heads(out, str(target_path), device="cpu")
    assert merged.fingerprint == base.fingerprint and heads.config.num_heads == 4
    assert any(not torch.equal(a, b) for a, b in zip(base.model.parameters(), merged.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(greedy_answers(merged.model, base.tokenizer), expected))
    # Without the KL term the same training moves the base model's outputs: the test can fail.
    drifted, _ = load_heads(medusa2(tmp_path, target_path, data, base_kl_weight=0.0, name="nokl"),
                            str(target_path), device="cpu")
    assert not all(torch.equal(a, b) for a, b in zip(greedy_answers(drifted.model, base.tokenizer), expected))


@pytest.mark.slow
def test_every_epoch_trains_on_every_conversation_when_batches_do_not_divide_into_steps(tmp_path):
    """10 batches per epoch, 3 accumulated per step: accelerate steps after the 10th, so an epoch is 4 steps."""
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl")  # 48: 46 train (10 batches of 5), 2 held out
    out = train(HeadsTrainConfig(data=data, out=str(tmp_path / "h"), target=str(target), epochs=2, batch_size=5,
                                 grad_accum=3, report_to="none", save_every=0))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 8 and metrics["train_conversations"] == 46
    assert metrics["conversations_trained"] == 2 * 46


@pytest.mark.slow
def test_kill_and_resume_continues_exactly(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=64)
    common = [sys.executable, str(ROOT / "train/heads.py"), "--data", data, "--target", str(target),
              "--max-steps", "40", "--batch-size", "4", "--save-every", "5", "--log-every", "5",
              "--report-to", "none", "--keep-checkpoints", "2"]
    killed = tmp_path / "killed"
    kill_after_a_checkpoint(common + ["--out", str(killed)], killed / "checkpoints", "step-*", tmp_path)
    # A checkpoint only ever appears whole: each step-N folder was renamed into place complete.
    checkpoints = list((killed / "checkpoints").glob("step-*"))
    assert all((c / "gorgon_state.json").is_file() and (c / "optimizer.bin").is_file() for c in checkpoints)
    states = [json.loads((c / "gorgon_state.json").read_text()) for c in checkpoints]
    resume_equals_a_whole_run(common, killed, tmp_path / "whole", "resumed from")
    # The metrics cover the whole run, the part before the kill included.
    resumed, whole = (json.loads((folder / "metrics.json").read_text()) for folder in (killed, tmp_path / "whole"))
    assert [step for step, _ in resumed["loss_curve"]] == list(range(5, 41, 5))
    assert resumed["loss_curve"] == whole["loss_curve"]
    assert resumed["train_seconds"] > max(state["train_seconds"] for state in states) > 0


@pytest.mark.slow
def test_bad_config_keys_and_values(tmp_path):
    with pytest.raises(GorgonError, match="unknown key 'learning_rat' on the command line: did you mean learning_rate"):
        load_recipe(HeadsTrainConfig, None, parse_overrides(["--data", "x", "--out", "y", "--learning-rat", "1"]))
    with pytest.raises(GorgonError, match="^unknown key 'lr' on the command line: did you mean learning_rate, lora_r"):
        load_recipe(HeadsTrainConfig, None, parse_overrides(["--data", "x", "--out", "y", "--lr", "0.1"]))
    (tmp_path / "r.yaml").write_text("data: x\nout: y\nnum_head: 3\n")
    with pytest.raises(GorgonError, match=r"unknown key 'num_head' in .*r.yaml: did you mean num_heads"):
        load_recipe(HeadsTrainConfig, str(tmp_path / "r.yaml"), {})
    with pytest.raises(GorgonError, match="batch_size on the command line must be int"):
        load_recipe(HeadsTrainConfig, None, {"data": "x", "out": "y", "batch_size": "four"})
    with pytest.raises(GorgonError, match="missing setting data"):
        load_recipe(HeadsTrainConfig, None, {"out": "y"})
    with pytest.raises(GorgonError, match="not found"):
        load_recipe(HeadsTrainConfig, str(tmp_path / "nope.yaml"), {})
    cfg = load_recipe(HeadsTrainConfig, None, parse_overrides(["--data=x", "--out", "y", "--lora-target-modules",
                                                               "q_proj,v_proj", "--max-steps", "none"]))
    assert cfg.lora_target_modules == ["q_proj", "v_proj"] and cfg.max_steps is None
    with pytest.raises(GorgonError, match="out needs a value"):  # a bare flag is not the folder "true"
        load_recipe(HeadsTrainConfig, None, parse_overrides(["--data", "x", "--out", "--resume"]))
    (tmp_path / "blank.yaml").write_text("data: ~/x\nout:\n")
    with pytest.raises(GorgonError, match="out needs a value"):  # nor is a blank YAML value the folder "None"
        load_recipe(HeadsTrainConfig, str(tmp_path / "blank.yaml"), {})
    (tmp_path / "true.yaml").write_text("data: x\nout: y\nbatch_size: true\n")
    with pytest.raises(GorgonError, match=r"^batch_size in .*true.yaml must be int, got True$"):  # a YAML true: not 1
        load_recipe(HeadsTrainConfig, str(tmp_path / "true.yaml"), {})
    with pytest.raises(GorgonError, match="^batch_size on the command line must be int, got 'two'$"):
        load_recipe(HeadsTrainConfig, None, {"data": "x", "out": "y", "batch_size": "two"})
    (tmp_path / "home.yaml").write_text("data: ~/x\nout: y\n")
    cfg = load_recipe(HeadsTrainConfig, str(tmp_path / "home.yaml"), parse_overrides(["--resume"]))
    assert cfg.data == str(Path.home() / "x") and cfg.resume is True
    for bad in (["--log-every", "0"], ["--keep-checkpoints", "0"], ["--save-every", "-1"], ["--tree-topk", "0"]):
        with pytest.raises(GorgonError, match="must be at least"):
            load_recipe(HeadsTrainConfig, None, parse_overrides(["--data", "x", "--out", "y"] + bad)).check()
    run = subprocess.run([sys.executable, str(ROOT / "train/heads.py"), "--data", "x", "--out", "y",
                          "--mode", "medusa3"], env=env(), capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == \
        "train/heads.py: error: mode must be one of medusa1, medusa2, not 'medusa3'"


TREE_SIZES = "must be 2 (the root and one candidate) to 256 tree nodes"


@pytest.mark.parametrize("script, argv, message", [
    ("heads", ["--config"], "--config needs the path of a YAML recipe after it (gorgon's are in configs/heads and "
                            "configs/draft)"),
    ("draft", ["--config"], "--config needs the path of a YAML recipe after it (gorgon's are in configs/heads and "
                            "configs/draft)"),
    ("heads", ["--batch-size"], "batch_size needs a value: give it one (--batch-size VALUE, or batch_size: VALUE in "
                                "the YAML), or leave the key out for its default"),
    ("heads", ["--epochs", "inf"], "epochs must be a finite number, not inf"),
    ("draft", ["--epochs", "inf"], "epochs must be a finite number, not inf"),
    ("draft", ["--learning-rate", "inf"], "learning_rate must be a finite number, not inf"),
    ("heads", ["--mode", "medusa2", "--backbone-learning-rate", "inf"],
     "backbone_learning_rate must be a finite number, not inf"),
    ("heads", ["--max-grad-norm", "inf"], "max_grad_norm must be a finite number, not inf"),
    ("heads", ["--weight-decay", "-0.1"], "weight_decay must be at least 0, not -0.1"),
    ("heads", ["--head-decay", "0"], "head_decay must be above 0 (1 weighs every head alike), not 0.0"),
    ("heads", ["--mode", "medusa2", "--heads-warmup-steps", "-1"], "heads_warmup_steps must be at least 0, not -1"),
    ("heads", ["--mode", "medusa2", "--base-kl-weight", "-1"], "base_kl_weight must be at least 0, not -1.0"),
    ("heads", ["--arch", "eagle", "--hidden-weight", "-0.2"], "hidden_weight must be at least 0, not -0.2"),
    ("heads", ["--eval-every", "-1"], "eval_every must be at least 0 (0: only at the end), not -1"),
    ("heads", ["--config", "nowhere.yaml"], "config nowhere.yaml not found: pass the path of a YAML recipe "
                                            "(gorgon's are in configs/heads and configs/draft)"),
    ("draft", ["--config", "nowhere.yaml"], "config nowhere.yaml not found: pass the path of a YAML recipe "
                                            "(gorgon's are in configs/heads and configs/draft)"),
    ("heads", ["--cpu-tree-size", "1"], f"cpu_tree_size {TREE_SIZES}, not 1"),
    ("heads", ["--gpu-tree-size", "999"], f"gpu_tree_size {TREE_SIZES}, not 999"),
    ("heads", ["--arch", "eagle", "--gpu-tree-size", "999"], f"gpu_tree_size {TREE_SIZES}, not 999"),
    ("heads", ["--tree-topk", "40", "--draft-vocab-size", "30"],
     "tree_topk ranks tokens of the draft vocabulary: use at most draft_vocab_size (30), not 40"),
    ("heads", ["--mode", "medusa2", "--lora-r", "0"], "lora_r must be at least 1, not 0"),
    ("draft", ["--lora", "true", "--lora-r", "0"], "lora_r must be at least 1, not 0"),
    ("draft", ["--lora", "true", "--lora-alpha", "0"], "lora_alpha must be at least 1, not 0"),
    ("draft", ["--lora", "true", "--lora-dropout", "1"],
     "lora_dropout is a probability: use 0 or more and below 1, not 1.0"),
    ("draft", ["--lmbda", "1", "--temperature", "0"],
     "temperature must be above 0 with lmbda > 0: the draft samples its own answers at it (trl's GKD has no greedy "
     "answers), not 0.0"),
    ("draft", ["--max-new-tokens", "0"], "max_new_tokens must be at least 1 (the length of the draft's own answers "
                                         "with lmbda > 0), not 0"),
])
def test_bad_settings_are_one_line_before_any_work(tmp_path, script, argv, message):
    """Each stopped training with a traceback (or with an error after it); now the command line fails before the
    target loads (--target nowhere would be an error of its own) and leaves no --out."""
    config, run = {"heads": (HeadsTrainConfig, train), "draft": (DraftTrainConfig, train_draft)}[script]
    out = tmp_path / "o"
    with pytest.raises(GorgonError, match=f"^{re.escape(message)}$"):
        recipe_main(config, run, "", ["--data", "nowhere", "--target", "nowhere", "--out", str(out),
                                      "--report-to", "none"] + argv)
    assert not out.exists()


@pytest.mark.slow
def test_conversations_whose_answers_start_past_max_length_are_counted_or_named(tmp_path, capsys):
    """They were left out silently; when none was left, the error sent the user to regenerate the data."""
    import json as js

    target = str(tiny_chat_target(tmp_path))
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(js.dumps({"messages": [{"role": "user", "content": "word " * n},
                                                   {"role": "assistant", "content": "an answer " * 4}]}) + "\n"
                            for n in (2, 2, 2, 2, 2, 2, 60, 60)))
    common = dict(data=str(data), target=target, report_to="none", max_steps=1, save_every=0)
    train(HeadsTrainConfig(out=str(tmp_path / "o"), max_length=48, **common))
    said = capsys.readouterr().err  # logs go to stderr, the result to stdout
    assert ("gorgon train: conversations left out: 2 (their answers start past max_length 48 tokens; raise "
            "max_length to train on them)") in said
    # And a run shorter than its warmup (20 steps) says why its learning rate stays low.
    assert ("gorgon train: warmup_steps 20 is not shorter than the run (steps: 1): the learning rate never reaches "
            "learning_rate 0.001 (lower warmup_steps)") in said
    with pytest.raises(GorgonError, match=r"mixed.jsonl: no conversation has an answer within max_length 8 tokens "
                                          r"\(the prompts fill it\): raise max_length"):
        train(HeadsTrainConfig(out=str(tmp_path / "p"), max_length=8, **common))


def test_settings_that_count_the_targets_tokens_or_name_its_layers_fail_before_training(tmp_path):
    """Counts of the target's tokens or layers fail from its config.json, before its weights load (after --data
    is read): shown by a target folder with no weights. tree_topk failed in the held-out evaluation after
    training. A layer name LoRA cannot find (known once the model has loaded) stopped in peft with a traceback
    (or was left out if other names matched)."""
    target = str(tiny_chat_target(tmp_path))  # a vocabulary of 128, 2 layers
    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    shutil.copy(Path(target) / "config.json", no_weights)
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    common = dict(out=str(tmp_path / "o"), target=target, report_to="none")
    early = {**common, "target": str(no_weights)}
    layers = "its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    for run, cfg, message in [
            (train, HeadsTrainConfig(data=data, tree_topk=200, **early),
             "tree_topk must be at most the target's vocabulary of 128 tokens, not 200: lower it"),
            (train, HeadsTrainConfig(data=data, arch="eagle", draft_vocab_size=1000, **early),
             "draft_vocab_size must be at most the target's vocabulary of 128 tokens, not 1000: lower it, or set "
             "it to null to draft from every token"),
            (train, HeadsTrainConfig(data=data, arch="eagle", feature_layers=[1, 3], **early),
             "feature_layers must lie between 1 and 2 (the target's layers), not [1, 3]"),
            (train_draft, DraftTrainConfig(data=data, draft_vocab_size=1000, **early),
             "draft_vocab_size must be at most the target's vocabulary of 128 tokens, not 1000: lower it, or set it to "
             "null to draft from every token"),
            (train, HeadsTrainConfig(data=data, mode="medusa2", lora_target_modules=["q_proj", "v_prj"], **common),
             f"lora_target_modules: the target has no layer 'v_prj'; {layers}"),
            (train_draft, DraftTrainConfig(data=data, student_layers=1, lora=True,
                                           lora_target_modules=["foo_proj"], **common),
             f"lora_target_modules: the draft has no layer 'foo_proj'; {layers}")]:
        with pytest.raises(GorgonError, match=f"^{re.escape(message)}$"):
            run(cfg)


def test_a_folder_gorgon_did_not_write_is_refused_untouched(tmp_path):
    """Checkpoint-like folders in someone else's folder are neither resumed from nor cleaned up."""
    target = tiny_chat_target(tmp_path)
    out = tmp_path / "theirs"
    for name in ("step-3", "step-best"):
        (out / "checkpoints" / name).mkdir(parents=True)
        (out / "checkpoints" / name / "model.bin").write_text("weights")
    (out / "notes.txt").write_text("mine")
    for resume, refusal in ((False, "already holds files this command did not write"),
                            (True, "--resume: .* is not a gorgon training run's folder")):
        with pytest.raises(GorgonError, match=refusal):
            train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(out), target=str(target),
                                   report_to="none", resume=resume))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3", "step-best"]
    assert (out / "notes.txt").read_text() == "mine"


def test_empty_dataset_is_refused(tmp_path):
    target = tiny_chat_target(tmp_path)
    (tmp_path / "empty.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(GorgonError, match="no conversations with assistant answers"):
        train(HeadsTrainConfig(data=str(tmp_path / "empty.jsonl"), out=str(tmp_path / "o"), target=str(target),
                               report_to="none"))


@pytest.mark.slow
def test_resume_without_a_checkpoint_is_refused(tmp_path):
    """The rule both training scripts share (gorgon.train.run_folder.resume_point)."""
    from gorgon.train.draft import DraftTrainConfig
    from gorgon.train.draft import train as train_draft

    for run, cfg in [(train_draft, DraftTrainConfig(data="x", out=str(tmp_path / "d"), resume=True, report_to="none")),
                     (train, HeadsTrainConfig(data="x", out=str(tmp_path / "h"), resume=True, report_to="none"))]:
        with pytest.raises(GorgonError, match=r"^--resume: no complete checkpoint in .*checkpoints: run without "
                                              r"--resume to start$"):
            run(cfg)
    # A finished run shorter than save_every has none: "run without --resume" would be refused there too.
    short = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "short"),
                 target=str(tiny_chat_target(tmp_path)), max_steps=1, report_to="none")
    train(HeadsTrainConfig(**short))
    with pytest.raises(GorgonError, match=r"^--resume: .*short holds a finished run without a checkpoint to continue "
                                          r"from \(the run was shorter than save_every\): pass --overwrite true to "
                                          r"train it again, for longer$"):
        train(HeadsTrainConfig(**short, resume=True))


def first_checkpoint(tmp_path, **settings) -> HeadsTrainConfig:
    """A finished two-step run with a checkpoint at step 1; returns its recipe."""
    cfg = HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl"), out=str(tmp_path / "h"),
                           target=str(tiny_chat_target(tmp_path)), max_steps=2, batch_size=4, save_every=1,
                           report_to="none", **settings)
    train(cfg)
    assert (tmp_path / "h" / "checkpoints" / "step-1").is_dir()
    return cfg


@pytest.mark.slow
def test_a_resume_with_another_data_order_or_shape_is_refused(tmp_path, capsys):
    """A checkpoint's step stands for the batches its settings drew: other ones would silently train on
    some conversations twice and others never; another shape would not load. Other settings may change."""
    cfg = first_checkpoint(tmp_path)
    checkpoint = tmp_path / "h" / "checkpoints" / "step-1"
    other = tmp_path / "other.jsonl"
    other.write_text((tmp_path / "toy.jsonl").read_text())
    changes = [({"batch_size": 8}, "batch_size 4 -> 8"), ({"grad_accum": 2}, "grad_accum 1 -> 2"),
               ({"seed": 1}, "seed 0 -> 1"), ({"data": str(other)}, "data "),
               ({"train_conversations": 20}, "train_conversations None -> 20"),
               ({"eval_fraction": 0.1, "max_length": 64}, "eval_fraction 0.05 -> 0.1, max_length 1024 -> 64"),
               ({"target": str(tmp_path / "elsewhere")}, "target "), ({"num_heads": 2}, "num_heads 4 -> 2"),
               ({"num_layers": 2}, "num_layers 1 -> 2"), ({"draft_vocab_size": 32}, "draft_vocab_size None -> 32"),
               ({"lora_r": 8}, "lora_r 16 -> 8")]
    for change, named in changes:
        with pytest.raises(GorgonError, match=rf"^{re.escape(str(checkpoint))} was trained with other settings "
                                              rf"\({named}.*\): resume with the same ones, or train into a new "
                                              r"--out$"):
            train(dataclasses.replace(cfg, resume=True, **change))
    with pytest.raises(GorgonError, match=r"holds a finished run of Medusa heads, but this recipe trains an "
                                          r"EAGLE head: choose another --out"):
        train(dataclasses.replace(cfg, resume=True, arch="eagle"))
    state = checkpoint / "gorgon_state.json"
    recorded = json.loads(state.read_text())
    state.write_text(json.dumps({**recorded, "settings": {**recorded["settings"], "processes": 2}}))
    with pytest.raises(GorgonError, match=r"\(processes 2 -> 1\)"):
        train(dataclasses.replace(cfg, resume=True))
    state.write_text(json.dumps(recorded))
    out = train(dataclasses.replace(cfg, resume=True, max_steps=3, log_every=1, save_every=0, keep_checkpoints=1,
                                    eval_every=1, tree_topk=5))
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3
    said = "".join(capsys.readouterr())  # eval_every's figures went to wandb alone
    assert re.search(r"step 3: held-out loss \d+\.\d{3} \| top-1 \d\.\d{3} ", said), said[-1000:]
    assert re.search(r"; .*/h/checkpoints \(\d+ MiB\) lets --resume true train longer: remove it if that is not "
                     "needed", said)  # the checkpoints a finished run keeps (a draft model's: hundreds of MB)


@pytest.mark.slow
def test_a_resume_with_another_objective_or_optimiser_is_refused(tmp_path):
    """The optimizer and its schedule come back from the checkpoint, so a new learning rate was silently ignored,
    and a new loss silently trained the rest of the run on another objective; recipe.json then recorded settings
    only part of the run had. Both scripts record every setting but those a resume may change."""
    cfg = first_checkpoint(tmp_path)
    checkpoint = tmp_path / "h" / "checkpoints" / "step-1"
    for change, named in [({"learning_rate": 0.5}, "learning_rate 0.001 -> 0.5"), ({"loss": "kl"}, "loss ce -> kl"),
                          ({"warmup_steps": 0, "head_decay": 0.5}, "head_decay 0.8 -> 0.5, warmup_steps 20 -> 0")]:
        with pytest.raises(GorgonError, match=rf"^{re.escape(str(checkpoint))} was trained with other settings "
                                              rf"\({re.escape(named)}\): resume with the same ones"):
            train(dataclasses.replace(cfg, resume=True, **change))
    recorded = resume_settings(DraftTrainConfig(data="x", out="y"), 1)
    assert {"beta", "lmbda", "learning_rate", "student_layers"} <= recorded.keys()
    assert not {"out", "max_steps", "epochs", "save_every", "report_to", "push_to_hub"} & recorded.keys()
    fields = {f.name for config in (HeadsTrainConfig, DraftTrainConfig) for f in dataclasses.fields(config)}
    assert set(MAY_CHANGE) <= fields  # each names a setting of one script or the other


def test_the_newest_complete_checkpoint_is_resumed_and_those_cut_short_removed(tmp_path):
    """Newest by step number (step-10 after step-9); one whose last file is missing or half-written was cut short."""
    for step, state in [(5, "{}"), (9, "{}"), (10, "{}"), (11, None), (12, '{"step": 1')]:
        (tmp_path / f"step-{step}").mkdir()
        if state is not None:
            (tmp_path / f"step-{step}" / "state.json").write_text(state)
    (tmp_path / "step-best").mkdir()  # not a name gorgon writes
    assert latest_checkpoint(tmp_path, "step", "state.json") == tmp_path / "step-10"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-5", "step-9", "step-best"]


@pytest.mark.slow
def test_a_resume_on_other_data_at_the_same_path_is_refused(tmp_path):
    """Data regenerated or edited at its path would silently resume on other conversations: its contents'
    hash is recorded and checked. The same data resumes, and a checkpoint without the hash is not checked."""
    cfg = first_checkpoint(tmp_path)
    checkpoint = tmp_path / "h" / "checkpoints" / "step-1"
    data = Path(cfg.data)
    original = data.read_text()
    data.write_text(original.replace("count from 3", "count from 9", 1))
    message = (f"the training examples differ from those {checkpoint} was trained on (the data at {cfg.data}, "
               "or the target's tokenizer or chat template, changed): restore them, or train into a new --out")
    with pytest.raises(GorgonError, match=f"^{re.escape(message)}$"):
        train(dataclasses.replace(cfg, resume=True))
    data.write_text(original)
    out = train(dataclasses.replace(cfg, resume=True, max_steps=3, save_every=0))  # a finished run trains longer
    state = checkpoint / "gorgon_state.json"
    recorded = json.loads(state.read_text())
    assert json.loads((out / "metrics.json").read_text())["data_sha256"] == recorded["settings"].pop("data_sha256")
    state.write_text(json.dumps(recorded))  # as a version from before the hash wrote it
    data.write_text(original.replace("count from 3", "count from 9", 1))
    train(dataclasses.replace(cfg, resume=True, max_steps=4))


@pytest.mark.slow
def test_a_checkpoint_cut_short_while_being_written_is_removed_on_resume(tmp_path):
    """A kill during save_state leaves the temporary folder that would have been renamed into place."""
    cfg = first_checkpoint(tmp_path)
    checkpoints = tmp_path / "h" / "checkpoints"
    (checkpoints / ".step-7.tmp").mkdir()
    (checkpoints / ".step-7.tmp" / "optimizer.bin").write_text("half")
    (checkpoints / ".step-best.tmp").mkdir()  # not a name gorgon writes
    train(dataclasses.replace(cfg, resume=True, max_steps=3))
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-best.tmp", "step-1", "step-2"]


def test_a_malformed_hub_repo_id_is_refused_before_training(tmp_path):
    from gorgon.train.draft import DraftTrainConfig
    from gorgon.train.draft import train as train_draft

    for bad in ("someone/heads/v2", "someone/my heads", "https://huggingface.co/someone/heads"):
        for run, config in [(train, HeadsTrainConfig), (train_draft, DraftTrainConfig)]:
            with pytest.raises(GorgonError, match=rf"^push_to_hub {re.escape(repr(bad))} is not a Hub repo id: pass "
                                                  r"user/name \(or org/name\) of letters, digits, -, _ and \.$"):
                run(config(data="x", out=str(tmp_path / "o"), push_to_hub=bad, report_to="none"))
    assert not (tmp_path / "o").exists()
    for good in ("someone/tiny-heads", "tiny_heads.v2"):
        HeadsTrainConfig(data="x", out="o", push_to_hub=good).check()
    # A run that would end in an upload that cannot happen (offline here: the suite sets HF_HUB_OFFLINE) fails first.
    for run, config in [(train, HeadsTrainConfig), (train_draft, DraftTrainConfig)]:
        with pytest.raises(GorgonError, match=r"^push_to_hub uploads the result at the end, but HF_HUB_OFFLINE is "
                                              r"set: unset it, or drop push_to_hub and upload the result with `gorgon "
                                              r"push`"):
            run(config(data="x", out=str(tmp_path / "o"), push_to_hub="someone/heads", report_to="none"))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key", ["num_heads", "num_layers", "batch_size", "grad_accum"])
def test_a_count_below_one_is_named_with_its_value(key):
    with pytest.raises(GorgonError, match=f"^{key} must be at least 1, not 0$"):
        HeadsTrainConfig(data="x", out="y", **{key: 0}).check()


def test_wandb_logs_online_for_a_user_who_ran_wandb_login(monkeypatch, tmp_path):
    """Only WANDB_API_KEY counted as a key: a user logged in with `wandb login` (its key in the netrc file) was
    logged offline."""
    from gorgon.train.recipe import wandb_offline_without_key

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    for saved, mode in [("", "offline"), ("machine api.wandb.ai\n  login user\n  password abc123\n", None)]:
        netrc_file.write_text(saved)
        netrc_file.chmod(0o600)
        monkeypatch.delenv("WANDB_MODE", raising=False)
        wandb_offline_without_key("wandb")
        assert os.environ.get("WANDB_MODE") == mode


def test_the_training_plot_shows_the_loss_curve_beside_the_accuracies(tmp_path):
    """metrics.json held the loss curve, which no plot showed."""
    import matplotlib.pyplot as plt

    from gorgon.heads.card import plot_head_accuracy

    metrics = {"top1": [0.4, 0.2], "top5": [0.6, 0.4], "arch": "medusa"}
    plot_head_accuracy(metrics, tmp_path / "alone.png")
    plot_head_accuracy({**metrics, "loss_curve": [[10, [3.0, 4.0]], [20, [2.5, 3.5]]]}, tmp_path / "both.png")
    assert plt.imread(tmp_path / "both.png").shape[1] > 1.5 * plt.imread(tmp_path / "alone.png").shape[1]


def test_the_next_command_a_run_suggests_names_the_checkouts_files_from_anywhere(tmp_path, monkeypatch):
    """`gorgon train` ended with `gorgon bench ... --questions scripts/data/mt_bench.jsonl`, a path that only
    works from the repository's root."""
    from helpers import ROOT

    from gorgon.train.recipe import in_checkout

    monkeypatch.chdir(tmp_path)
    assert in_checkout("scripts/data/mt_bench.jsonl") == str(ROOT / "scripts/data/mt_bench.jsonl")
    assert in_checkout("configs/heads/none.yaml") == "configs/heads/none.yaml"  # not in the checkout: as given
    monkeypatch.chdir(ROOT)
    assert in_checkout("scripts/data/mt_bench.jsonl") == "scripts/data/mt_bench.jsonl"


@pytest.mark.slow
def test_training_over_a_finished_run_needs_overwrite_and_leaves_nothing_stale(tmp_path):
    target = str(tiny_chat_target(tmp_path))
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    cfg = dict(data=data, out=str(tmp_path / "run"), target=target, max_steps=1, report_to="none", save_every=0)
    out = train(HeadsTrainConfig(**cfg))
    (out / "bench.json").write_text('{"command": "gorgon bench --heads run --out run/bench.json"}')  # of the old heads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.savefig(out / "bench.png")  # its plot, as matplotlib writes one
    plt.close(fig)
    with pytest.raises(GorgonError, match="holds earlier gorgon output: pass --overwrite"):
        train(HeadsTrainConfig(**cfg))
    train(HeadsTrainConfig(**cfg, overwrite=True))
    assert (out / "model.safetensors").is_file() and not (out / "bench.json").exists()
    assert not (out / "bench.png").exists()


@pytest.mark.slow
def test_a_card_the_user_edited_is_not_written_over(tmp_path):
    """`gorgon bench --update-card` and training a finished run again (--resume to train longer, --overwrite)
    wrote their card over one the user had edited, with no word; `gorgon push` already kept it. Each is
    refused before the work, the card as it was."""
    from gorgon.heads.card import check_card_folder

    target = str(tiny_chat_target(tmp_path))
    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=target, max_steps=1,
               report_to="none", save_every=1)
    out = train(HeadsTrainConfig(**cfg))
    check_card_folder(out)  # the card as training wrote it
    card = (out / "README.md").read_text() + "\nMy notes.\n"
    (out / "README.md").write_text(card)
    edited = rf"^{re.escape(str(out / 'README.md'))} is not the card gorgon wrote \(edited\?\): "
    with pytest.raises(GorgonError, match=edited + "--update-card would write the new card over it"):
        check_card_folder(out)
    for again in (dict(resume=True, max_steps=2), dict(overwrite=True)):
        with pytest.raises(GorgonError, match=edited + "this run would write its own card over it"):
            train(HeadsTrainConfig(**{**cfg, **again}))
    assert (out / "README.md").read_text() == card


@pytest.mark.slow
def test_an_overwrite_that_fails_or_is_cut_short_keeps_the_earlier_heads(tmp_path, monkeypatch):
    """--overwrite removed a finished run's heads before training: a run that then failed (or was killed) left
    none. Now they stay until the new run writes its own; a save cut short keeps them aside until one ends."""
    import gorgon.heads.card
    import gorgon.train.heads
    from gorgon.train.run_folder import EARLIER

    target = str(tiny_chat_target(tmp_path))
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    cfg = dict(data=data, out=str(tmp_path / "run"), target=target, max_steps=1, report_to="none", save_every=0)
    out = train(HeadsTrainConfig(**cfg))
    (out / "bench.json").write_text('{"command": "gorgon bench --heads run --out run/bench.json"}')

    def files(folder):
        return {str(path): data for path, data in snapshot(folder).items() if path.name != ".gorgon-run"}

    earlier = files(out)

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(gorgon.train.heads, "train_steps", fails)
        with pytest.raises(RuntimeError):
            train(HeadsTrainConfig(**cfg, overwrite=True, learning_rate=0.5))
    kept = files(out)
    assert {k: v for k, v in kept.items() if k != "recipe.json"} == {k: v for k, v in earlier.items() if k in kept}
    assert "model.safetensors" in kept and "recipe.json" not in kept  # loadable, no longer marked finished
    with monkeypatch.context() as patch:  # the new heads written, then a kill before the card
        patch.setattr(gorgon.heads.card, "write_model_card", fails)
        with pytest.raises(RuntimeError):
            train(HeadsTrainConfig(**cfg, learning_rate=0.5))
    assert files(out / EARLIER)["model.safetensors"] == earlier["model.safetensors"]
    train(HeadsTrainConfig(**cfg, learning_rate=0.5))  # an unfinished run of gorgon's: started again
    final = files(out)
    assert not (out / EARLIER).exists() and "bench.json" not in final and "recipe.json" in final
    assert final["model.safetensors"] != earlier["model.safetensors"]


@pytest.mark.slow
def test_overwrite_refuses_a_file_of_the_users_inside_gorgons_output(tmp_path):
    """--overwrite replaced a run's folder or a dataset whole, notes or a serving config the user had put inside
    it included; now it is refused before any work, naming the file, and nothing is removed."""
    target = str(tiny_chat_target(tmp_path))
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    run = HeadsTrainConfig(data=data, out=str(tmp_path / "run"), target=target, max_steps=1, report_to="none",
                           save_every=0, overwrite=True)
    dataset = DataSettings(prompts=data, target=target, max_new_tokens=4)
    for make in (lambda: train(run), lambda: make_dataset(dataset, tmp_path / "data", progress=False, overwrite=True)):
        out = make()
        (out / "serving").mkdir()
        (out / "serving" / "NOTES.md").write_text("mine")
        before = snapshot(out)
        with pytest.raises(GorgonError, match=rf"^--out {re.escape(str(out))} holds serving, which gorgon did not "
                                              r"write: move it away, or choose another --out$"):
            make()
        assert snapshot(out) == before
        shutil.rmtree(out / "serving")
        make()
    # A tokenizer's files are a draft model's own, but not in a heads folder (they were removed with no word),
    # and a draft run's from the moment its config.json is written (a run cut short before metrics.json).
    (tmp_path / "run" / "tokenizer.json").write_text("mine")
    with pytest.raises(GorgonError, match="holds tokenizer.json, which gorgon did not write"):
        train(run)
    assert (tmp_path / "run" / "tokenizer.json").read_text() == "mine"
    from gorgon.train.run_folder import in_run_folder

    draft = tmp_path / "draft-run"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    assert in_run_folder(draft / "tokenizer.json") and not in_run_folder(tmp_path / "run" / "tokenizer.json")


@pytest.mark.slow
def test_training_step_counts(tmp_path):
    with pytest.raises(GorgonError, match="max_steps must be at least 0"):
        HeadsTrainConfig(data="x", out="y", max_steps=-1).check()
    target = str(tiny_chat_target(tmp_path))
    out = train(HeadsTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=target,
                                 max_steps=0, report_to="none"))
    assert json.loads((out / "metrics.json").read_text())["steps"] == 0


def test_training_data_is_checked_before_the_target_loads(tmp_path):
    """A bad --data fails first: an 8B target takes minutes to load. (The target here does not exist: the error
    is the data's, so it came first.)"""
    from gorgon.train.draft import DraftTrainConfig
    from gorgon.train.draft import train as train_draft

    (tmp_path / "empty.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    for data, says in [(tmp_path / "missing.jsonl", "missing.jsonl"), (tmp_path / "empty.jsonl", "no conversations "
                                                                        "with assistant answers to train on")]:
        for run, config in [(train, HeadsTrainConfig), (train_draft, DraftTrainConfig)]:
            with pytest.raises(GorgonError, match=re.escape(says)):
                run(config(data=str(data), out=str(tmp_path / "o"), target=str(tmp_path / "no-target"),
                           report_to="none"))


@pytest.mark.slow
def test_resume_on_a_finished_run_with_nothing_more_to_train_is_refused(tmp_path):
    """It retrained the steps after the last checkpoint and replaced the finished heads with a copy, and with a
    smaller max_steps with an earlier state. A rerun without --resume names the finished run. (Also: --out that is
    the --data path is named as that.)"""
    target = str(tiny_chat_target(tmp_path))
    with pytest.raises(GorgonError, match=r"^--out .*d is the --data path: choose another --out$"):
        train(HeadsTrainConfig(data=str(tmp_path / "d"), out=str(tmp_path / "d"), report_to="none"))
    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=target, max_steps=3,
               save_every=2, report_to="none")
    out = train(HeadsTrainConfig(**cfg))
    before = snapshot(out)
    for shorter in (3, 2):
        with pytest.raises(GorgonError, match=r"holds a finished run of 3 steps, and these settings train no longer: "
                                              r"there is nothing to resume \(raise epochs or max_steps"):
            train(HeadsTrainConfig(**{**cfg, "max_steps": shorter}, resume=True))
    with pytest.raises(GorgonError, match=r"holds a finished run: pass --overwrite true to train it again, --resume "
                                          r"true with more epochs or max_steps to train it longer"):
        train(HeadsTrainConfig(**cfg))
    assert snapshot(out) == before
    train(HeadsTrainConfig(**{**cfg, "max_steps": 4}, resume=True))  # longer: resumed from step 2
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_a_run_replacing_finished_output_keeps_its_lock_while_it_saves(tmp_path, monkeypatch):
    """Setting the finished run's files aside moved the live run's lock with them: from then until the end a
    second run was let into the folder (found by a helper pausing a 2-process run in its save)."""
    import gorgon.train.run_folder as run_folder
    from gorgon.train.run_folder import LOCK

    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=str(tiny_chat_target(
        tmp_path)), max_steps=1, report_to="none", save_every=0)
    train(HeadsTrainConfig(**cfg))
    set_aside = run_folder.set_aside_earlier_run
    locked = []
    monkeypatch.setattr(run_folder, "set_aside_earlier_run",
                        lambda out: (set_aside(out), locked.append((out / LOCK).is_file())))
    train(HeadsTrainConfig(**cfg, overwrite=True))
    assert locked == [True]


@pytest.mark.slow
def test_a_folder_another_live_run_is_writing_is_refused(tmp_path):
    """Killing `accelerate launch` alone leaves its training processes running: a second run into the same folder
    would write beside them. A lock naming a live process of this machine refuses it; a dead one's does not."""
    from gorgon.heads.files import host_name
    from gorgon.train.run_folder import LOCK, RUN_MARKER

    cfg = dict(data=toy_data(tmp_path / "toy.jsonl", n=8), out=str(tmp_path / "run"), target=str(tiny_chat_target(
        tmp_path)), max_steps=1, report_to="none", save_every=0)
    out = Path(cfg["out"])
    out.mkdir()
    (out / RUN_MARKER).write_text("")
    with another_live_process() as pid:
        (out / LOCK).write_text(f"{host_name()} {pid}\n")
        with pytest.raises(GorgonError, match=rf"run is being written by another training run \(process {pid}, "
                                              rf"still running\): wait for it to end, or stop it \(kill {pid}\)"):
            train(HeadsTrainConfig(**cfg))
    train(HeadsTrainConfig(**cfg))  # its process gone, the lock is stale
    assert (out / "recipe.json").is_file() and not (out / LOCK).exists()


def test_a_refused_run_leaves_the_folder_another_run_made_meanwhile(tmp_path):
    """Two runs started together into a new --out: the refused one removed the folder as its own empty output,
    the running one's marker and lock with it (it then ran unlocked)."""
    from gorgon.heads.outputs import take_lock
    from gorgon.train.run_folder import LOCK, RUN_MARKER, no_empty_output_left

    out, mine = tmp_path / "run", tmp_path / "mine"
    with pytest.raises(GorgonError), no_empty_output_left(out):
        take_lock(out / LOCK)  # as the other run, which made the folder after this one looked
        (out / RUN_MARKER).write_text("")
        raise GorgonError("is being written by another training run")
    assert (out / LOCK).is_file() and (out / RUN_MARKER).is_file()
    with pytest.raises(GorgonError), no_empty_output_left(mine):  # a run's own failure leaves nothing
        mine.mkdir()
        (mine / RUN_MARKER).write_text("")
        raise GorgonError("bad data")
    assert not mine.exists()


def test_ctrl_c_says_what_was_kept_and_how_to_go_on(tmp_path, capsys):
    """Ctrl-C ended training and data generation silently (after a half-drawn progress bar): a user learnt of
    --resume only from the refusal of a plain rerun. (The first newline ends the bar's line.)"""
    from gorgon.heads.outputs import take_lock
    from gorgon.train.data import shards_said_on_ctrl_c
    from gorgon.train.run_folder import LOCK, RUN_MARKER, lock_released_on_failure

    out = tmp_path / "run"
    (out / "checkpoints" / "step-20").mkdir(parents=True)
    (out / RUN_MARKER).write_text("")
    for kept, says in [(out / "checkpoints" / "step-20", f"{out / 'checkpoints' / 'step-20'} is kept: rerun the "
                                                         "command with --resume true to continue from it"),
                       (None, "no checkpoint was saved yet (save_every sets how often): a rerun starts over")]:
        with pytest.raises(KeyboardInterrupt), lock_released_on_failure(out, lambda kept=kept: kept):
            take_lock(out / LOCK)
            raise KeyboardInterrupt
        assert capsys.readouterr().err == f"\ngorgon: {says}\n" and not (out / LOCK).exists()
    # Stopped before it took the folder, which another run holds: that run's checkpoints are not looked
    # for (looking removes one cut short: the other run's, being written), and nothing is said of them.
    (out / LOCK).write_text("elsewhere 1 0\n")
    with pytest.raises(KeyboardInterrupt), lock_released_on_failure(out, lambda: pytest.fail("looked")):
        raise KeyboardInterrupt
    assert capsys.readouterr().err == "" and (out / LOCK).read_text() == "elsewhere 1 0\n"
    partial = tmp_path / "data.partial"
    partial.mkdir()
    with pytest.raises(KeyboardInterrupt), shards_said_on_ctrl_c(partial):
        (partial / "shard-00000.jsonl").write_text("{}\n")
        raise KeyboardInterrupt
    assert capsys.readouterr().err == (f"\ngorgon data: the 1 shard(s) finished so far are kept in {partial}: rerun "
                                       "the same command to go on from them\n")
