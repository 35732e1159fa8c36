"""The rule that keeps `-m "not slow"` fast (tests/conftest.py), on small test files that
pytester runs in this process: a test without the `slow` marker that starts a process or
asks for a server fails, naming what it tried; one that runs `git` does not."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "tests.conftest")


def _run(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makeini('[pytest]\nmarkers =\n    slow: real processes\n')
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_inprocess(*PLUGIN, "-q", "-p", "no:cacheprovider")


def test_a_fast_test_that_starts_a_process_fails_naming_it(pytester):
    res = _run(pytester, """
import subprocess, sys

def test_starts_python():
    subprocess.run([sys.executable, "-c", "pass"])
""")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*is not marked slow*it started*'-c', 'pass'*"])


def test_a_fast_test_fails_even_where_its_code_swallows_the_refusal(pytester):
    res = _run(pytester, """
import subprocess, sys

def test_catches_everything():
    try:
        subprocess.Popen([sys.executable, "-c", "pass"])
    except Exception:
        pass
""")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*is not marked slow*"])


def test_a_fast_test_that_asks_for_a_server_fails_before_it_starts(pytester):
    res = _run(pytester, """
def test_wants_s3(moto_server):
    pass
""")
    res.assert_outcomes(errors=1)
    res.stdout.re_match_lines([r".*asks for \['moto_server'\]"])


def test_a_fast_test_may_ask_git_for_the_code_version(pytester):
    res = _run(pytester, """
import subprocess

def test_git():
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
""")
    res.assert_outcomes(passed=1)
