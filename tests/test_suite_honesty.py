"""The suite tells the truth about what it ran: a test missing its data is skipped with a reason, and under
PEFTLAB_REQUIRE_DATA=1 (CI) that skip is a failure, so missing data can never pass silently."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("require, code, word", [("0", 0, "1 skipped"), ("1", 1, "1 error")])
def test_a_missing_data_skip_fails_when_data_is_required(tmp_path, require, code, word):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_needs.py").write_text(
        "from conftest import needs_data\n\n@needs_data('no', 'such', 'file.tsv')\ndef test_x():\n    pass\n")
    env = {**os.environ, "PEFTLAB_REQUIRE_DATA": require, "PEFTLAB_DATA_DIR": str(tmp_path / "empty")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == code, proc.stdout[-2000:]
    assert word in proc.stdout and "file.tsv not found" in proc.stdout
