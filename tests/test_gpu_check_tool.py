"""scripts/gpu-check's report: its closing counts come from pytest's own JUnit report (a test
that passes, one that fails, one that errors in a fixture, one skipped), and it refuses to report
a pass where no Python sees a GPU."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = runpy.run_path(str(ROOT / "scripts" / "gpu-check"), run_name="gpu_check")

CASES = '''
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture")

def test_passes():
    pass

def test_fails():
    assert False

def test_errors(broken):
    pass

@pytest.mark.skip(reason="here")
def test_skipped():
    pass
'''


def test_the_counts_are_pytests_own(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_cases.py"),
                    f"--junitxml={junit}"], cwd=tmp_path, capture_output=True)
    passed, failed, skipped, bad = TOOL["counts"](junit)
    assert (passed, failed, skipped) == (1, 2, 1)
    assert sorted(name.rsplit("::", 1)[1] for name in bad) == ["test_errors", "test_fails"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible here")
def test_without_a_gpu_it_reports_nothing_passed_and_fails():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == "gpu-check: 0 passed, 0 failed"
