"""The code type-checks: mypy reports nothing on zoo/ and recipes/ (strict, configured in pyproject.toml's
[tool.mypy]) nor on bench/ and tests/ (a looser setting, tests/mypy-loose.ini: scripts and tests, mostly without
annotations, over third-party packages typed loosely or not at all).

CI runs only pytest, so the type check is a test. Each check starts from an empty cache (about 20 s, most of it
reading torch's annotations), so a stale cache can never hide an error. Both start when the session's tests are
collected (conftest), beside the tests before them, and their tests wait for them. `mypy` at the repository root
runs the first, `mypy --config-file tests/mypy-loose.ini` the second.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


CONFIGS = {"test_zoo_and_recipes_type_check": ROOT / "pyproject.toml",
           "test_bench_and_tests_type_check_loosely": ROOT / "tests" / "mypy-loose.ini"}
EARLY: dict[str, subprocess.Popen[str]] = {}  # test name -> its check, started by `start_early`
CACHE = Path(tempfile.gettempdir()) / f"zoo-mypy-{os.getpid()}"  # one empty cache per check, removed at the end


def mypy(config: Path, cache: Path) -> subprocess.Popen[str]:
    """Start mypy with `config` on an empty cache; `result` waits for it."""
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed; install the test extra: pip install -e '.[test]'")
    shutil.rmtree(cache, ignore_errors=True)
    return subprocess.Popen([sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir",
                             str(cache)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_early(items: list[pytest.Item]) -> None:
    """conftest calls this with this module's selected tests once the session's are collected: each selected check
    starts now, in a process of its own, so that it runs beside the tests that come before it (each reads torch's
    annotations on one core)."""
    for item in items:
        name = getattr(item, "originalname", None)
        if name in CONFIGS and name not in EARLY:
            EARLY[name] = mypy(CONFIGS[name], CACHE / name)


def stop_early() -> None:
    """conftest calls this when the session ends: a check not waited for is ended; the caches are removed."""
    while EARLY:
        proc = EARLY.popitem()[1]
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    shutil.rmtree(CACHE, ignore_errors=True)


def check(name: str) -> subprocess.Popen[str]:
    """The check of test `name`: the one started early, or (conftest's hook not run) one started now."""
    return EARLY.pop(name, None) or mypy(CONFIGS[name], CACHE / name)


def result(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """The check's exit code and what it printed."""
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"mypy still runs after 600 s: {proc.communicate()[0][-3000:]}")
    return proc.returncode, out


def test_zoo_and_recipes_type_check():
    code, out = result(check("test_zoo_and_recipes_type_check"))
    assert code == 0, (
        f"mypy reports type errors in zoo/ or recipes/ (reproduce with `mypy` at the repository root):\n{out}"
    )


def test_bench_and_tests_type_check_loosely():
    code, out = result(check("test_bench_and_tests_type_check_loosely"))
    assert code == 0, (
        f"mypy reports type errors in bench/ or tests/ (reproduce with `mypy --config-file tests/mypy-loose.ini` "
        f"at the repository root):\n{out}"
    )
