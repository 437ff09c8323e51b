"""The package stays lint-clean (ruff) and type-checks clean (mypy), as pyproject.toml configures them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_is_clean() -> None:
    """`ruff check` finds nothing in the package, tests and benchmarks."""
    res = _run("ruff", "check", "tiermem", "tests", "bench")
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_is_clean() -> None:
    """`mypy` (configured in pyproject.toml) finds no type errors in the package."""
    pytest.importorskip("mypy")
    res = _run("mypy")
    assert res.returncode == 0, res.stdout + res.stderr
