"""zoo/ type-checks: mypy, configured in pyproject.toml ([tool.mypy]), reports nothing.

CI runs only pytest, so the type check is a test. It starts from an empty cache (about 20 s, most of it reading
torch's annotations), so a stale cache can never hide an error; `mypy` at the repository root runs the same check.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_zoo_type_checks(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed; install the test extra: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / "mypy_cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, (
        f"mypy reports type errors in zoo/ (reproduce with `mypy` at the repository root):\n"
        f"{result.stdout}{result.stderr}"
    )
