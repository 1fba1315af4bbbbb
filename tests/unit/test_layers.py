"""The package keeps the shape it is drawn in (docs/design.md): import-linter's layers contract in
pyproject.toml, checked on every run of the test command."""

import os
import subprocess
import sys

from tests.support import REPO


def test_each_folder_imports_only_the_folders_below_it():
    linter = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    proc = subprocess.run([linter], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout
