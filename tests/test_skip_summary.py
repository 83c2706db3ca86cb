"""tests/skip_summary.py: the default run sums skips up by reason, one line each (issue 39)."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

CASES = '''
import pytest

@pytest.mark.parametrize("i", range(4))
def test_needs_torch(i):
    pytest.skip("torch cannot be imported")

@pytest.mark.skip(reason="not on this platform")
def test_other():
    pass

def test_fails():
    assert 1 == 2
'''


def _run(tmp_path, *flags):
    (tmp_path / "test_cases.py").write_text(CASES)
    env = dict(os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "skip_summary", "-p", "no:cacheprovider",
                           *flags, "test_cases.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    return done.stdout


def test_skips_are_summed_up_by_reason_and_failures_still_listed(tmp_path):
    out = _run(tmp_path, "-rfExX")
    assert "5 skipped, by reason" in out
    assert "    4 skipped: torch cannot be imported  (e.g. test_cases.py:" in out
    assert "    1 skipped: not on this platform  (e.g. test_cases.py:" in out
    assert "SKIPPED [" not in out  # no per-test skip lines
    assert "FAILED test_cases.py::test_fails" in out


def test_asking_for_skips_lists_each_and_no_summary(tmp_path):
    out = _run(tmp_path, "-rs")
    assert "SKIPPED [4] test_cases.py" in out or out.count("SKIPPED [1] test_cases.py") == 5
    assert "by reason" not in out


def test_the_default_options_sum_skips_up():
    import tomllib

    with open(os.path.join(TESTS, os.pardir, "pyproject.toml"), "rb") as f:
        addopts = tomllib.load(f)["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-rfExX" in addopts.split() and "-ra" not in addopts.split()
