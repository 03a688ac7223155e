"""The code type-checks: mypy reports nothing on zoo/ and recipes/ (strict, configured in pyproject.toml's
[tool.mypy]) nor on bench/ and tests/ (a looser setting, tests/mypy-loose.ini: scripts and tests, mostly without
annotations, over third-party packages typed loosely or not at all).

CI runs only pytest, so the type check is a test. Each check starts from an empty cache (about 20 s, most of it
reading torch's annotations), so a stale cache can never hide an error; `mypy` at the repository root runs the
first, `mypy --config-file tests/mypy-loose.ini` the second.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mypy(config: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed; install the test extra: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(cache)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_zoo_and_recipes_type_check(tmp_path):
    result = mypy(ROOT / "pyproject.toml", tmp_path / "mypy_cache")
    assert result.returncode == 0, (
        f"mypy reports type errors in zoo/ or recipes/ (reproduce with `mypy` at the repository root):\n"
        f"{result.stdout}{result.stderr}"
    )


def test_bench_and_tests_type_check_loosely(tmp_path):
    result = mypy(ROOT / "tests" / "mypy-loose.ini", tmp_path / "mypy_cache")
    assert result.returncode == 0, (
        f"mypy reports type errors in bench/ or tests/ (reproduce with `mypy --config-file tests/mypy-loose.ini` "
        f"at the repository root):\n{result.stdout}{result.stderr}"
    )
