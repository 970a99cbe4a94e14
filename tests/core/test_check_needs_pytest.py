"""``lmcache-platform check`` without pytest: exit 2 with the install command, no false FAIL."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["pytest"] = None  # as in a fresh venv that has core but not its [check] extra
from lmcache_platform._cli import main
sys.exit(main(["check", "cpu"]))
"""


def test_check_without_pytest_says_how_to_install_it() -> None:
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'pip install "lmcache-platform[check]"' in proc.stderr
    assert "the conformance suite runs on pytest, which is not installed" in proc.stderr
    assert "FAIL" not in proc.stdout + proc.stderr
