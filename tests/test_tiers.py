"""The fast tier stays fast: conftest.py fails a `-m "not slow"` run that holds an unmarked slow test."""

from pathlib import Path

import pytest

TESTS = '''
import time

import pytest


def test_quick():
    pass


def test_dawdles():
    time.sleep(0.2)


@pytest.mark.slow
def test_marked():
    time.sleep(0.2)
'''


@pytest.fixture
def suite(pytester, monkeypatch):
    """This suite's conftest.py over three tests: one quick, one unmarked over the limit, one marked slow."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    # hypothesis's plugin imports hypothesis at each run's end: seconds, as pytester forgets it after each run.
    pytester.makeini("[pytest]\naddopts = -p no:hypothesispytest\nmarkers =\n    slow: takes more than a few seconds\n")
    pytester.makepyfile(test_tiny=TESTS)
    monkeypatch.setenv("GORGON_FAST_TEST_LIMIT", "0.1")
    return pytester


def test_an_unmarked_slow_test_fails_the_fast_run(suite):
    result = suite.runpytest("-m", "not slow and not cuda")
    result.assert_outcomes(passed=2, deselected=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*unmarked tests over the fast tier's 0.1 s (GORGON_FAST_TEST_LIMIT)*",
                                 "test_tiny.py::test_dawdles took 0.[2-9] s",
                                 "mark it @pytest.mark.slow or make it faster"])
    result.stdout.no_fnmatch_line("*test_quick took*")


def test_only_a_run_that_leaves_slow_tests_out_is_timed(suite, monkeypatch):
    """The whole suite and a run of the slow tier have no limit; a higher GORGON_FAST_TEST_LIMIT lets one pass."""
    for argv in ([], ["-m", "slow"]):
        result = suite.runpytest(*argv)
        assert result.ret == pytest.ExitCode.OK, argv
        result.stdout.no_fnmatch_line("*fast tier*")
    monkeypatch.setenv("GORGON_FAST_TEST_LIMIT", "30")
    assert suite.runpytest("-m", "not slow").ret == pytest.ExitCode.OK
