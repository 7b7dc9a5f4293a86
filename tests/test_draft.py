"""Draft-model distillation: the truncated start, lower held-out KL, transformers interop, resume, bad input."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import (
    ROOT,
    env,
    kill_after_a_checkpoint,
    resume_equals_a_whole_run,
    tiny_chat_target,
    tiny_model,
    tiny_tokenizer,
    toy_data,
    weights,
)
from transformers import AutoModelForCausalLM

from gorgon.decode import speculative_generate
from gorgon.heads import DraftModelDrafter, GorgonError, load_target
from gorgon.heads.methods.draft_model import cut_to_draft_vocab, load_draft_vocab
from gorgon.heads.methods.draft_model.model import truncated_copy
from gorgon.heads.target import lm_logits
from gorgon.train.draft import DraftTrainConfig, read_indexed_cpu_locations, train
from gorgon.train.examples import collate, frequent_tokens, load_examples, split


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_truncated_copy_is_the_targets_first_layers(arch):
    target = tiny_model(arch, layers=4)
    student = truncated_copy(target, 2)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        middle = target(ids, output_hidden_states=True).hidden_states[2]  # the output of layer 2 of 4
        expected = lm_logits(target, target.model.norm(middle))
        assert torch.allclose(student(ids).logits, expected, atol=1e-5)
    assert student.config.num_hidden_layers == 2 and sum(p.numel() for p in student.parameters()) < sum(
        p.numel() for p in target.parameters())
    with pytest.raises(GorgonError, match="student_layers must be between 1 and 3"):
        truncated_copy(target, 4)


def held_out_kl(draft, target, examples, pad):
    """Mean KL(target || draft) over the assistant tokens of `examples`, written out plainly."""
    batch = collate(examples, pad)
    mask = batch.pop("loss_mask")[:, 1:]
    with torch.no_grad():
        p = target(**batch).logits[:, :-1][mask].log_softmax(-1)
        q = draft(**batch).logits[:, :-1][mask].log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.slow
def test_distillation_lowers_held_out_kl_and_the_draft_works_as_assistant_model(tmp_path):
    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=48)
    cfg = DraftTrainConfig(data=data, out=str(tmp_path / "draft"), target=str(target_path), student_layers=1,
                           max_steps=30, batch_size=8, learning_rate=1e-2, warmup_steps=3, eval_fraction=0.2,
                           report_to="none", save_every=0, draft_vocab_size=24)
    out = train(cfg)
    target = load_target(str(target_path), device="cpu")
    _, held_out = split(load_examples(data, target.tokenizer, cfg.max_length), cfg.eval_fraction, cfg.seed)
    start = truncated_copy(target.model, 1).eval()
    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    before = held_out_kl(start, target.model, held_out, target.tokenizer.pad_token_id)
    after = held_out_kl(draft, target.model, held_out, target.tokenizer.pad_token_id)
    assert after < 0.5 * before, (before, after)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["before"]["kl"] == pytest.approx(before, rel=1e-3)
    assert metrics["after"]["kl"] == pytest.approx(after, rel=1e-3)
    assert metrics["after"]["top1"] > metrics["before"]["top1"] and metrics["steps"] == 30
    card = (out / "README.md").read_text()
    assert "assistant_model=draft" in card and f"{after:.3f}" in card
    assert not (out / "checkpoints").exists()  # save_every 0: trl's empty folder was left behind

    # The distilled draft drops into transformers' own assisted generation, and into gorgon's decoder.
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "count from 3"}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    plain = target.model.generate(ids, do_sample=False, max_new_tokens=40)
    assisted = target.model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=40)
    assert torch.equal(assisted, plain)
    result = speculative_generate(target.model, DraftModelDrafter(draft, 3), ids, max_new_tokens=40)
    assert result.tokens == plain[0, ids.shape[1]:].tolist()
    # No tau bound: the untrained start (the target's first layer) reached 2.86 on this prompt and the draft
    # 1.90, since the toy answers are not this random target's own; the held-out KL above checks training.

    # Saved beside it: the 24 most frequent answer tokens, which the toy answers all fall in (this random target's
    # own answers need not: the toy data is not self-distilled, so only exactness is asserted with it).
    train_ex, _ = split(load_examples(data, target.tokenizer, cfg.max_length), cfg.eval_fraction, cfg.seed)
    token_map = load_draft_vocab(str(out), target.model.config.vocab_size)
    assert token_map.tolist() == sorted(frequent_tokens(train_ex, 24, target.model.config.vocab_size)[0].tolist())
    assert metrics["draft_vocab_size"] == 24 and metrics["draft_vocab_coverage"] == {"train": 1.0, "held_out": 1.0}
    assert "drafts from its 24 most frequent answer tokens (`draft_vocab.safetensors`), through an" in card
    assert "they are 100.0% of the training answers' tokens and 100.0% of the held-out ones" in card
    cut = cut_to_draft_vocab(AutoModelForCausalLM.from_pretrained(out).eval(), token_map)
    result = speculative_generate(target.model, DraftModelDrafter(cut, 3, token_map=token_map), ids, max_new_tokens=40)
    assert result.tokens == plain[0, ids.shape[1]:].tolist()
    # --overwrite replaces the run, its draft vocabulary too (refused as a file gorgon did not write)
    assert train(dataclasses.replace(cfg, max_steps=2, overwrite=True)) == out


def test_student_with_another_tokenizer_or_vocabulary_is_refused(tmp_path):
    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=8)
    other = tmp_path / "other"
    tok = tiny_tokenizer()
    tok.add_tokens(["<extra>"])
    tiny_model(vocab=128).save_pretrained(other)
    tok.save_pretrained(other)
    cfg = DraftTrainConfig(data=data, out=str(tmp_path / "d"), target=str(target_path), student=str(other),
                           report_to="none")
    with pytest.raises(GorgonError, match=r"student .*other's tokenizer differs from the target's \(1 tokens are "
                                          r"missing or have other ids, e.g. '<extra>'\)"):
        train(cfg)
    wider = tmp_path / "wider"
    tiny_model(vocab=130).save_pretrained(wider)
    tiny_tokenizer().save_pretrained(wider)
    cfg.student = str(wider)
    with pytest.raises(GorgonError, match="the draft model: a vocabulary of 130, but the target has 128"):
        train(cfg)
    cfg.student, cfg.draft_vocab_size = None, 129
    with pytest.raises(GorgonError, match="draft_vocab_size must be at most the target.s vocabulary of 128 tokens"):
        train(cfg)


@pytest.mark.slow
def test_kill_and_resume_continues_exactly(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=64)
    common = [sys.executable, str(ROOT / "train/draft.py"), "--data", data, "--target", str(target),
              "--student-layers", "1", "--max-steps", "40", "--batch-size", "4", "--save-every", "5",
              "--report-to", "none", "--learning-rate", "1e-2"]
    killed = tmp_path / "killed"
    # The trainer writes trainer_state.json last: a checkpoint with one is whole.
    kill_after_a_checkpoint(common + ["--out", str(killed)], killed / "checkpoints",
                            "checkpoint-*/trainer_state.json", tmp_path)
    (killed / "checkpoints" / "checkpoint-35").mkdir()  # one cut short: skipped and removed on resume
    resume_equals_a_whole_run(common, killed, tmp_path / "whole", "resuming from")


@pytest.mark.slow
def test_accelerate_launch_and_bad_settings(tmp_path):
    target = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=16)
    out = tmp_path / "draft"
    run = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs/accelerate/cpu.yaml"),
         str(ROOT / "train/draft.py"), "--data", data, "--target", str(target), "--out", str(out),
         "--student-layers", "1", "--max-steps", "3", "--log-every", "1"],
        env={**env(), "WANDB_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert list((tmp_path / "wandb").glob("offline-run-*")), "wandb should log offline"
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3
    for bad, message in [(["--beta", "2"], "beta must lie between 0 and 1, not 2.0"),
                         (["--student-layers", "9"], "student_layers must be between 1 and 1 (the target has 2 "
                                                     "layers), not 9"),
                         (["--draft-vocab-size", "0"], "draft_vocab_size must be at least 1 (or unset for the whole "
                                                       "vocabulary), not 0"),
                         (["--studnet", "x"], "unknown key 'studnet' on the command line: did you mean student, "
                                              "student_layers?")]:
        run = subprocess.run([sys.executable, str(ROOT / "train/draft.py"), "--data", data, "--target", str(target),
                              "--out", str(tmp_path / "bad"), "--report-to", "none"] + bad,
                             env=env(), capture_output=True, text=True)
        assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == f"train/draft.py: error: {message}"


@pytest.mark.slow
def test_lora_adapters_are_merged_into_a_plain_draft(tmp_path):
    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=16)
    out = train(DraftTrainConfig(data=data, out=str(tmp_path / "draft"), target=str(target_path), student_layers=1,
                                 lora=True, lora_r=4, max_steps=5, batch_size=4, learning_rate=1e-2,
                                 report_to="none", save_every=0))
    saved = weights(out)
    assert not [k for k in saved if "lora" in k]
    start = truncated_copy(load_target(str(target_path), device="cpu").model, 1).state_dict()
    assert saved.keys() <= start.keys()
    embed, q_proj = "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(saved[embed], start[embed]), "LoRA trains the adapters only"
    assert not torch.equal(saved[q_proj], start[q_proj]), "the merged adapters change the layer's weights"


@pytest.mark.slow
def test_on_policy_batches_answer_with_the_draft(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDTrainer

    answered = []
    original = GKDTrainer.generate_on_policy_outputs
    monkeypatch.setattr(GKDTrainer, "generate_on_policy_outputs", staticmethod(
        lambda *a: answered.append(a[1]["prompts"]) or original(*a)))
    target_path = tiny_chat_target(tmp_path)
    data = toy_data(tmp_path / "toy.jsonl", n=16)
    out = train(DraftTrainConfig(data=data, out=str(tmp_path / "draft"), target=str(target_path), student_layers=1,
                                 lmbda=1.0, max_new_tokens=6, max_steps=3, batch_size=4, report_to="none",
                                 save_every=0))
    assert len(answered) == 3 and all(len(prompts) == 4 for prompts in answered)
    tok = tiny_tokenizer()
    text = tok.decode(answered[0][0], skip_special_tokens=False).replace("<pad>", "")
    assert text.startswith("<|im_start|>user\ncount from") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3


def test_resume_reads_optimizer_state_saved_for_an_indexed_cpu(tmp_path):
    """transformers 5.17 resumes a multi-process CPU run with map_location "cpu:N", which torch alone
    refuses (the two-process resume in test_multiprocess.py fails there without this)."""
    torch.save({"exp_avg": torch.ones(2)}, tmp_path / "optimizer.pt")
    read_indexed_cpu_locations()
    state = torch.load(tmp_path / "optimizer.pt", map_location="cpu:1", weights_only=True)
    assert torch.equal(state["exp_avg"], torch.ones(2)) and state["exp_avg"].device.type == "cpu"


@pytest.mark.slow
def test_a_resume_with_another_data_order_is_refused(tmp_path, capsys):
    """The rule the heads follow (test_train.py), on the trainer's checkpoints; more steps may be added."""
    cfg = DraftTrainConfig(data=toy_data(tmp_path / "toy.jsonl", n=16), out=str(tmp_path / "draft"),
                           target=str(tiny_chat_target(tmp_path)), student_layers=1, max_steps=2, batch_size=4,
                           save_every=1, report_to="none")
    train(cfg)
    checkpoint = tmp_path / "draft" / "checkpoints" / "checkpoint-1"
    with pytest.raises(GorgonError, match=rf"^{re.escape(str(checkpoint))} was trained with other settings "
                                          r"\(batch_size 4 -> 2, seed 0 -> 1\): resume with the same ones, or train "
                                          r"into a new --out$"):
        train(dataclasses.replace(cfg, resume=True, batch_size=2, seed=1))
    with pytest.raises(GorgonError, match=r"\(student_layers 1 -> 2\)"):  # another shape would not load
        train(dataclasses.replace(cfg, resume=True, student_layers=2))
    capsys.readouterr()
    train(dataclasses.replace(cfg, resume=True, max_steps=3, log_every=1))
    assert json.loads((tmp_path / "draft" / "metrics.json").read_text())["steps"] == 3
    said = "".join(capsys.readouterr())  # the trainer's logs as lines, as train/heads.py writes its own
    assert re.search(r"trained 3 steps in \d+\.\d s", said) and "{'" not in said and "gorgon draft: 100%" in said


@pytest.mark.slow
def test_a_resume_on_other_data_at_the_same_path_is_refused(tmp_path):
    """The heads' check of the data's contents (test_train.py), on the trainer's checkpoints."""
    data = tmp_path / "toy.jsonl"
    cfg = DraftTrainConfig(data=toy_data(data, n=16), out=str(tmp_path / "draft"),
                           target=str(tiny_chat_target(tmp_path)), student_layers=1, max_steps=2, batch_size=4,
                           save_every=1, report_to="none")
    train(cfg)
    original = data.read_text()
    data.write_text(original.replace("count from 3", "count from 9", 1))
    checkpoint = tmp_path / "draft" / "checkpoints" / "checkpoint-1"
    message = (f"the training examples differ from those {checkpoint} was trained on (the data at {data}, "
               "or the target's tokenizer or chat template, changed): restore them, or train into a new --out")
    with pytest.raises(GorgonError, match=f"^{re.escape(message)}$"):
        train(dataclasses.replace(cfg, resume=True))
    data.write_text(original)
    train(dataclasses.replace(cfg, resume=True, max_steps=3))
    assert json.loads((tmp_path / "draft" / "metrics.json").read_text())["steps"] == 3
