"""The rule that keeps `-m "not slow"` fast (tests/conftest.py), on a small test file that
pytester runs in this process."""

from __future__ import annotations

pytest_plugins = ["pytester"]

INNER = '''
import subprocess, sys

def test_starts_python():
    subprocess.run([sys.executable, "-c", "pass"])

def test_swallows_the_refusal():
    try:
        subprocess.Popen([sys.executable, "-c", "pass"])
    except Exception:
        pass

def test_wants_s3(moto_server):
    pass

def test_asks_git():
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
'''


def test_a_fast_test_fails_when_it_starts_a_process_or_asks_for_a_server_git_excepted(
        pytester):
    pytester.makeini("[pytest]\nmarkers =\n    slow: real processes\n")
    pytester.makepyfile(test_inner=INNER)
    res = pytester.runpytest_inprocess("-p", "tests.conftest", "-q", "-rfE",
                                       "-p", "no:cacheprovider")
    res.assert_outcomes(failed=2, errors=1, passed=1)
    out = res.stdout.str()
    for name in ("test_starts_python", "test_swallows_the_refusal"):
        assert f"FAILED test_inner.py::{name}" in out
    assert "it started ['" in out and "'-c', 'pass']" in out
    assert "ERROR test_inner.py::test_wants_s3" in out
    assert "it asks for ['moto_server']" in out
    assert "is not marked slow" in out
