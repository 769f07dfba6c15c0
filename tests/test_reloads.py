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
        (tmp_path / "fail").write_text(REASON + ".")  # a reason's full stop is not doubled: ".;" (tryout26)
        os.kill(srv.proc.pid, signal.SIGHUP)
        wait_for(lambda: "the reload is given up" in srv.output())
        time.sleep(1)  # what the master does next: before, it stopped
        assert srv.proc.poll() is None, srv.output()[-3000:]
        assert serving(srv) == {old}
        (line,) = [ln for ln in srv.output().splitlines() if "the reload is given up" in ln]
        assert "[ERROR]" in line and f"{REASON}; the reload is given up" in line and "could not start" in line, line
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


@pytest.mark.server
@pytest.mark.extended  # a reload whose settings went bad, rare (~20 s): with `-m extended`
def test_a_reload_whose_settings_went_bad_leaves_the_old_worker_serving(tmp_path):
    """Found by a fresh-user tryout (tryout26): a SIGHUP after the calibration folder had moved, or after the
    cache folder had become a file, ended the whole master with exit 2 (gunicorn.conf.py read the settings again
    and refused them as at a first start), and systemd's RestartPreventExitStatus=2 kept it down. The master
    now serves on with the settings it had; the new worker meets the error and the reload is given up."""
    from PIL import Image

    calib, cache = tmp_path / "calib", tmp_path / "cache"

    def cache_becomes_a_file():
        cache.rename(tmp_path / "cache.old")
        cache.write_text("x")

    def cache_mended():
        cache.unlink()
        (tmp_path / "cache.old").rename(cache)

    calib.mkdir()
    for i in range(2):
        Image.new("RGB", (64, 48), (40 * i, 90, 200)).save(calib / f"{i}.jpg")
    srv = Server(tmp_path / "server.log", MODEL="resnet18_seeded", COMPILE=0, PRECISION="fp32", WORKERS=1, THREADS=1,
                 MAX_BATCH_SIZE=1, CACHE_DIR=cache, CALIBRATION_DIR=calib)
    try:
        (old,) = srv.wait_ready(1)
        for n, (spoil, mend, said) in enumerate([
                (lambda: calib.rename(tmp_path / "moved"), lambda: (tmp_path / "moved").rename(calib),
                 "CLASSIFIER_CALIBRATION_DIR"),
                (cache_becomes_a_file, cache_mended, "CLASSIFIER_CACHE_DIR")], 1):
            spoil()
            os.kill(srv.proc.pid, signal.SIGHUP)
            wait_for(lambda: srv.output().count("the reload is given up") == n)
            time.sleep(1)  # what the master does next: before, it had exited 2 already
            assert srv.proc.poll() is None, srv.output()[-3000:]
            assert serving(srv) == {old}
            errors = [ln for ln in srv.output().splitlines() if "configuration error on reload" in ln]
            assert len(errors) == n and said in errors[-1] and "[ERROR]" in errors[-1], errors
            given_up = [ln for ln in srv.output().splitlines() if "the reload is given up" in ln]
            assert len(given_up) == n and said in given_up[-1] and "could not start: configuration error: " in \
                given_up[-1] and "traceback" not in given_up[-1], given_up
            mend()
        assert "Traceback" not in srv.output()
        os.kill(srv.proc.pid, signal.SIGHUP)  # mended: this one goes through
        wait_for(lambda: old not in serving(srv))
        assert srv.proc.poll() is None
    finally:
        srv.stop_cleanly()
