"""Workers that come after the server serves (``webapp/reloads.py``), over a real gunicorn: a reload (SIGHUP) or a
replacement of a dead worker that cannot start leaves the workers that serve up, and says why (a reload on a full
cache disk took the whole server down: tryout15). The start-up failure is planted with ``tests/faulty_wsgi.py``'s
``FAULTY_FAIL_START`` file; the first start's failure still stops the server (tests/test_lifecycle.py)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from conftest import ROOT
from serving import Server

TESTS = ROOT / "tests"
REASON = "the cache disk is full (planted by the test)"


def serving(srv: Server) -> set[int]:
    """The pids of the workers that answer /healthz now (several probes: the kernel spreads connections)."""
    pids = set()
    for _ in range(12):
        with urllib.request.urlopen(srv.url + "/healthz", timeout=10) as resp:
            pids.add(json.load(resp)["pid"])
    return pids


def wait_for(what, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return found


def faulty_server(tmp_path, workers: int) -> Server:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
           "FAULTY_FAIL_START": str(tmp_path / "fail")}
    return Server(tmp_path / "server.log", app="faulty_wsgi:app", env=env, MODEL="resnet18_seeded", COMPILE=0,
                  WORKERS=workers, THREADS=1, MAX_BATCH_SIZE=1, CACHE_DIR=tmp_path / "cache")


@pytest.mark.server
@pytest.mark.extended  # a reload that cannot start, rare (~13 s): with `-m extended`
def test_a_reload_that_cannot_start_leaves_the_old_worker_serving(tmp_path):
    srv = faulty_server(tmp_path, workers=1)
    try:
        (old,) = srv.wait_ready(1)
        (tmp_path / "fail").write_text(REASON)
        os.kill(srv.proc.pid, signal.SIGHUP)
        wait_for(lambda: "the reload is given up" in srv.output())
        time.sleep(1)  # what the master does next: before, it stopped
        assert srv.proc.poll() is None, srv.output()[-3000:]
        assert serving(srv) == {old}
        (line,) = [ln for ln in srv.output().splitlines() if "the reload is given up" in ln]
        assert "[ERROR]" in line and REASON in line and "could not start" in line, line
        (tmp_path / "fail").unlink()  # mended: the next reload goes through
        os.kill(srv.proc.pid, signal.SIGHUP)
        wait_for(lambda: old not in serving(srv))  # (both serve until the new one is ready: webapp/reloads.py)
        assert srv.proc.poll() is None
    finally:
        srv.stop_cleanly()


@pytest.mark.server
@pytest.mark.extended  # a rare path (a worker dies, then its replacement cannot start), ~10 s: with `-m extended`
def test_a_replacement_that_cannot_start_is_not_forked_again_and_again(tmp_path):
    srv = faulty_server(tmp_path, workers=2)
    try:
        first = set(srv.wait_ready(2))
        (tmp_path / "fail").write_text(REASON)
        dead = min(first)
        os.kill(dead, signal.SIGKILL)  # the OOM killer, say: gunicorn forks a replacement, which cannot start
        wait_for(lambda: "serving with 1 of 2 workers" in srv.output())
        time.sleep(3)  # before, the server stopped; forking the failure again would show as more such lines
        assert srv.proc.poll() is None, srv.output()[-3000:]
        assert serving(srv) == first - {dead}
        lines = [ln for ln in srv.output().splitlines() if "could not start" in ln]
        assert len(lines) == 1 and REASON in lines[0] and "SIGHUP" in lines[0], lines
        (tmp_path / "fail").unlink()
        os.kill(srv.proc.pid, signal.SIGHUP)  # the count read again: two workers, both new
        wait_for(lambda: len(pids := serving(srv)) == 2 and not pids & first)
    finally:
        srv.stop_cleanly()
