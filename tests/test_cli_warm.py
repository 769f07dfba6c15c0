"""``python -m webapp warm``: the worker's start-up run once, at install time (a subprocess: it pins itself).

The compile caches it builds and finds again are checked end to end by tests/test_kit.py (``-m kit``);
here, without compiling: what it prints, and how it fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _warm(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLASSIFIER_")}
    return subprocess.run([sys.executable, "-m", "webapp", "warm", "--cache-dir", str(tmp_path / "cache"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**base, "TORCH_HOME": str(tmp_path / "torch"), **(env or {})})


@pytest.mark.cli
def test_warm_runs_the_workers_start_up_and_says_where_the_cache_is(tmp_path):
    proc = _warm(tmp_path, "--model", "efficientnet_lite0", "--precision", "fp32", "--no-compile",
                 "--max-batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model efficientnet_lite0, fp32" in out and "batch 1..2 warmed" in out
    assert "self-test: passed" in out
    assert f"compile is off (CLASSIFIER_COMPILE=0): nothing to cache but the precision record; cache {tmp_path / 'cache'}" in out
    # the layout of every usable core (gunicorn's plan), not of the one core set warm then pins itself to
    assert "warming up as gunicorn's worker 0 would start" in proc.stderr
    assert f"on {len(os.sched_getaffinity(0))} core" in proc.stderr
    assert (tmp_path / "cache").is_dir()


@pytest.mark.cli
@pytest.mark.extended  # warm's failures, rare (~6 s): with `-m extended`
def test_warm_fails_like_a_worker_start_naming_the_problem(tmp_path):
    proc = _warm(tmp_path, "--weights", str(tmp_path / "missing.pth"), "--no-compile")
    assert proc.returncode == 1 and f"CLASSIFIER_WEIGHTS={tmp_path / 'missing.pth'} does not exist" in proc.stderr
    proc = _warm(tmp_path, "--max-batch-size", "0")
    assert proc.returncode == 2 and "--max-batch-size" in proc.stderr


@pytest.mark.cli
@pytest.mark.extended  # warm's refusals, rare (~12 s): with `-m extended`
def test_warm_says_in_one_line_that_a_path_cannot_be_looked_at(tmp_path):
    """A name part over 255 bytes: pathlib's probes raise for it (a traceback before)."""
    long = tmp_path / ("a" * 300)
    proc = _warm(tmp_path, "--cache-dir", str(long), "--no-compile")
    assert (proc.returncode, proc.stderr) == (2, f"configuration error: CLASSIFIER_CACHE_DIR={long} cannot be "
                                                 f"created: File name too long\n")
    proc = _warm(tmp_path, "--weights", f"{long}.pth", "--no-compile")
    assert proc.returncode == 1 and proc.stderr.endswith(f"error: CLASSIFIER_WEIGHTS={long}.pth cannot be looked "
                                                         f"at: File name too long\n"), proc.stderr


@pytest.mark.cli
@pytest.mark.extended  # a host without a C++ compiler, rare (~25 s: the export runs first): with `-m extended`
def test_warm_without_a_compiler_says_so_in_one_line(tmp_path):
    """No g++: warm (and so deploy/install.sh) ended in a ~100-line InvalidCxxCompiler traceback (tryout23)."""
    proc = _warm(tmp_path, "--model", "resnet18_seeded", "--precision", "fp32", "--max-batch-size", "1",
                 env={"CXX": "/bin/false"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no C++ compiler found (/bin/false") and "CLASSIFIER_COMPILE=0" in last, last
