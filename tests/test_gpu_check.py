"""scripts/gpu_check.sh, the one prepared run for a lent GPU, run here on the copying test device: the same
steps as on the GPU, so the script cannot rot between the sessions that are lent one."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args: str, out: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_the_gpu_check_passes_on_the_copying_device(tmp_path) -> None:
    """`gpu_check.sh --device copy --small` runs every step and passes, with its log, the tests' log and the
    report under $OUT, every check in the report held and every section present."""
    out = tmp_path / "out"
    res = _run("--device", "copy", "--small", out=out)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    log = (out / "gpu_check.log").read_text()
    for step in ("== 0. system", "== 1. dependencies", "== 2. tests", "== 3. bench/gpu_check.py", "== done"):
        assert step in log, step
    assert "io engine: " in log
    assert " passed" in (out / "pytest.log").read_text()
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["device"] == "copy" and not report["errors"]
    for section in ("transfers", "disk", "inference", "compressed", "training"):
        assert section in report, section
    assert report["checks"] and all(ok for _, ok in report["checks"]), report["checks"]
    assert report["copy_faults"] == []
    assert report["transfers"]["tiermem_h2d_gbps"] > 0 and report["disk"]["read_gbps"] > 0


def test_help_and_bad_options_run_nothing(tmp_path) -> None:
    """--help prints the usage and exits 0 before any step; an unknown device is refused naming the option."""
    res = _run("--help", out=tmp_path / "help", timeout=30)
    assert res.returncode == 0 and "--device copy" in res.stdout and "== 0. system" not in res.stdout
    res = _run("--device", "tpu", out=tmp_path / "bad", timeout=30)
    assert res.returncode == 2 and "--device tpu: expected cuda, cuda:N, copy or cpu" in res.stderr
