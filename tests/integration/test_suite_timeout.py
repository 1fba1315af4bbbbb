"""The suite's time limit (pyproject.toml, pytest-timeout) fails a hung test by name and lets the
run go on to its summary: a limit that ended the pytest process instead would lose every result
after it, and say nothing about which test hung."""

import os
import subprocess
import sys
import textwrap
from tests.support import REPO as _REPO

REPO = _REPO

HUNG_AND_PASSING = textwrap.dedent("""
    import time

    import pytest


    @pytest.mark.timeout(2)
    def test_hangs():
        time.sleep(60)


    def test_passes():
        assert True
""")


def test_a_hung_test_fails_by_name_and_the_run_reaches_its_summary(tmp_path):
    (tmp_path / "test_child.py").write_text(HUNG_AND_PASSING)
    # the repository's configuration (-c), so its timeout method is the one under test
    child = subprocess.run([sys.executable, "-m", "pytest", "-c", os.path.join(REPO, "pyproject.toml"),
                            "-p", "no:cacheprovider", "-q", str(tmp_path / "test_child.py")],
                           capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = child.stdout + child.stderr
    assert child.returncode == 1, out  # tests failed; not killed (negative) or ended early (other codes)
    assert "FAILED" in out and "test_hangs" in out and "Timeout" in out, out
    assert "1 failed, 1 passed" in out, out
