"""``serve --cluster`` stopping the Ray it started (webapp/cluster/stopping.py, webapp/cli/supervise.py).

Each test starts ``python -m webapp serve --cluster`` without ``RAY_ADDRESS``, so the command starts
its own Ray on this host, in a session of its own as a service manager starts a service. Once it
has answered a request and holds more in flight, it gets its stop signal: SIGTERM to the command
alone, SIGTERM or SIGINT (Ctrl-C) to its process group (``timeout(1)``, ``kill -TERM -PGID``), or
SIGTERM to every process of the service (systemd's default ``KillMode=control-group``). Each time it
must exit 0 within ``stop_timeout_s`` (REQUEST_TIMEOUT_S + 30 s), leave no process running in its
sessions (the command's, and the driver's with its Ray) and log no sign of the old hang. Where the
signal did not reach Ray's own processes, the requests in flight are answered too.

A separate module from test_cluster.py, so that its Ray instance is gone before these start theirs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import ROOT, shared_image
from serving import as_a_terminal_job, free_port
from webapp.cli.supervise import stop_timeout_s

pytestmark = pytest.mark.cluster

ray = pytest.importorskip("ray", reason="the Ray path needs requirements-cluster.txt")
pytest.importorskip("a2wsgi", reason="the Ray path needs requirements-cluster.txt")
# After Ray: Ray ships psutil and puts it on sys.path (webapp/cluster/stopping.py). test_cluster: its settings and helpers.
import psutil  # isort: skip
from test_cluster import COMMON, READY_TIMEOUT_S, _env, _four_names, _post, _post_four  # isort: skip

# One model replica (the command's own Ray has this host's CPUs, 2 on the project's box), info logs
# (the "serving on" line says the deployment is done), and a request timeout that a burst of BURST
# requests of 4 photos meets on one replica of a loaded 2-core host (8 of them at 10 s got a 504).
# The burst sends 12 MP phone photos: 4 requests of 4 small photos (dog.jpg) were all answered
# within the 0.4 s before the signal once in CI, leaving nothing in flight to drain (4 x 3.2 MB: the
# default upload limit, not COMMON's 4 MiB).
LOCAL = {**COMMON, "CLUSTER_REPLICAS": 1, "CLUSTER_MAX_ONGOING_REQUESTS": 4, "CLUSTER_MAX_QUEUED_REQUESTS": 8,
         "REQUEST_TIMEOUT_S": 20, "LOG_LEVEL": "info",
         "MAX_UPLOAD_BYTES": 32 << 20}
BURST = 4
BOUND_S = stop_timeout_s(LOCAL["REQUEST_TIMEOUT_S"])
# What the stop printed while it hung (the driver retrying a GCS that was gone), and the supervisor's last resort.
HANG_SIGNS = ("Failed to push error to driver", "Failed to connect to GCS", "did not stop within")


class LocalServe:
    """``serve --cluster`` with its own Ray: ``proc`` (the command), ``driver``, ``url``, ``log_path``."""

    def __init__(self, tmp_path):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tmp_path / "serve.log"
        self._log = open(self.log_path, "wb")
        # SIGINT as a terminal's foreground job has it: a script's `cmd &` leaves it ignored, the command keeps
        # it ignored, and the SIGINT case waited out its 80 s (a CI run started that way).
        self.proc = subprocess.Popen([sys.executable, "-m", "webapp", "serve", "--cluster"], cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=as_a_terminal_job, env=_env({**LOCAL, "BIND": f"127.0.0.1:{port}"}))
        self.sessions = {self.proc.pid}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while b"webapp.cluster.deploy: serving on" not in self.log_path.read_bytes():
            if self.proc.poll() is not None:
                pytest.fail(f"serve --cluster exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"serve --cluster not serving in {READY_TIMEOUT_S} s:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        (driver,) = psutil.Process(self.proc.pid).children()
        self.driver = driver
        self.sessions.add(os.getsid(driver.pid))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def running(self) -> list[str]:
        """``"name (pid)"`` of every process of the command's and the driver's sessions that still runs."""
        found = []
        for p in psutil.process_iter(["name", "status"]):
            try:
                if os.getsid(p.pid) in self.sessions and p.info["status"] != psutil.STATUS_ZOMBIE:
                    found.append(f"{p.info['name']} ({p.pid})")
            except OSError:  # gone meanwhile
                pass
        return found

    def every_process(self) -> list[psutil.Process]:
        """The command and everything under it: what systemd's control-group kill reaches."""
        top = psutil.Process(self.proc.pid)
        return [top, *top.children(recursive=True)]

    def close(self) -> None:
        """After a failure: SIGKILL whatever is left, so no test leaves a Ray behind."""
        for _ in range(3):
            for name in self.running():
                try:
                    os.kill(int(name.rsplit("(", 1)[1].rstrip(")")), signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.5)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()


@pytest.fixture
def local_serve(tmp_path):
    server = LocalServe(tmp_path)
    try:
        yield server
    finally:
        server.close()


def _said(r) -> str:
    """A burst answer in a few words, for a failure message."""
    return f"{r.status_code} {r.text[:200]}" if isinstance(r, requests.Response) else repr(r)


# Each case starts its own Ray (~30 s on 2 cores, 35 s with the stop): all four run with `-m extended` (CI
# runs that step too), to keep the plain run near 10 minutes on 2 cores; test_cluster.py's SIGTERM test
# (the command alone, requests in flight) stays in the plain run.
@pytest.mark.parametrize("sig, target", [
    pytest.param("SIGTERM", "the command", id="SIGTERM-command", marks=pytest.mark.extended),
    pytest.param("SIGTERM", "its group", id="SIGTERM-group", marks=pytest.mark.extended),
    pytest.param("SIGINT", "its group", id="SIGINT-group", marks=pytest.mark.extended),
    pytest.param("SIGTERM", "every process", id="SIGTERM-every-process", marks=pytest.mark.extended)])
def test_stop_is_bounded_and_leaves_nothing_running(local_serve, sig, target):
    phone = shared_image("phone-12mp.jpg").read_bytes()
    assert _post(local_serve.url, "phone-12mp.jpg", phone).status_code == 200  # serving: one request answered

    def one(i: int):
        try:
            return _post_four(local_serve.url, i, phone)
        except requests.RequestException as exc:  # the proxy itself was stopped: an answer of sorts
            return exc

    with ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(one, i) for i in range(BURST)]
        time.sleep(0.4)
        assert not all(f.done() for f in futures), ("the burst ended before the signal: nothing in flight: "
                                                    f"{[_said(f.result()) for f in futures]}")
        signum = getattr(signal, sig)
        started = time.monotonic()
        if target == "the command":
            local_serve.proc.send_signal(signum)
        elif target == "its group":
            os.killpg(local_serve.proc.pid, signum)
        else:
            for p in local_serve.every_process():
                try:
                    p.send_signal(signum)
                except psutil.Error:
                    pass
        try:
            code = local_serve.proc.wait(BOUND_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve --cluster still running {BOUND_S + 30:.0f} s after {sig}:\n{local_serve.log()[-4000:]}")
        took = time.monotonic() - started
        answers = [f.result() for f in futures]
    print(f"{sig} to {target}: exit {code} in {took:.1f} s (bound {BOUND_S:.0f} s); in flight: "
          f"{[getattr(r, 'status_code', type(r).__name__) for r in answers]}")
    log = local_serve.log()
    assert code == 0, f"exit status {code} after {sig} to {target}:\n{log[-4000:]}"
    assert took < BOUND_S, f"stopped in {took:.1f} s, over the {BOUND_S:.0f} s bound:\n{log[-4000:]}"
    time.sleep(1.0)  # a process that outlived the command would still be here now
    assert local_serve.running() == [], log[-4000:]
    assert not [sign for sign in HANG_SIGNS if sign in log], log[-4000:]
    assert "stopping: answering the requests in flight" in log
    if target != "every process":  # Ray was not signalled: it drained, every request has its own answer
        assert [getattr(r, "status_code", repr(r)) for r in answers] == [200] * BURST, log[-4000:]
        for i, r in enumerate(answers):
            assert [x["filename"] for x in r.json()["results"]] == _four_names(i)
        assert "were not all answered" not in log


@pytest.mark.extended  # orphaned Ray processes, rare (~7 s): with `-m extended`
def test_orphans_are_adopted_and_ended(tmp_path):
    """``LocalRay``: a grandchild whose parent exits (a worker whose raylet died) is found and ended."""
    script = """
import json, subprocess, sys
from webapp.cluster.stopping import LocalRay, psutil
assert LocalRay.adopt_orphans()
# The child starts a grandchild that ignores SIGTERM, prints its pid and exits: the grandchild is orphaned.
child = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen([sys.executable, "
                        "'-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], "
                        "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"], capture_output=True, text=True,
                       check=True)
orphan = int(child.stdout)
found = [p.pid for p in LocalRay([]).leftovers()]
ended = LocalRay([]).end_leftovers(grace_s=0.5)
print(json.dumps({"orphan": orphan, "found": found, "ended": ended, "after": psutil.pid_exists(orphan)}))
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=_env({}))
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["found"] == [result["orphan"]]  # re-parented to us, so found
    assert len(result["ended"]) == 1 and f"({result['orphan']})" in result["ended"][0]
    assert result["after"] is False  # SIGKILLed after the grace (it ignored SIGTERM) and collected


@pytest.mark.extended  # a rare path's check (~8 s: a Python with Ray imported): with `-m extended`
def test_a_drain_given_up_cannot_start_a_new_ray(tmp_path):
    """``shut_down``: the drain's thread, left running when the drain is given up, makes its Serve call after
    ``ray.shutdown``; Serve's ``_connect`` then calls ``ray.init()``, which must refuse rather than start a new
    local Ray mid-stop (seen in CI: the command killed after 60.6 s against a 50 s bound). Without Ray running:
    the drain is a stand-in that waits for ``ray.shutdown`` and then connects as ``serve.delete`` does."""
    script = """
import json, threading, time
from webapp.cluster import stopping
from webapp.cluster.stopping import ray
from ray.serve import context

shut, outcome = threading.Event(), {}
real_shutdown = ray.shutdown
def shutdown(**kw):
    shut.set()
    real_shutdown(**kw)
def delete(app_name):  # the abandoned drain: its next Serve call comes after ray.shutdown
    shut.wait(30)
    try:
        context._connect()
        outcome["error"] = None
    except Exception as exc:
        outcome["error"] = str(exc)
    outcome["initialized"] = ray.is_initialized()
ray.shutdown = shutdown
stopping.wait_for_ingress = lambda *a, **k: True
stopping.serve.delete = delete
t0 = time.monotonic()
done = stopping.shut_down("app", local=None, deadline=time.monotonic() + stopping.AFTER_DRAIN_S + 0.5)
took = time.monotonic() - t0
for _ in range(300):
    if "initialized" in outcome:
        break
    time.sleep(0.1)
print(json.dumps({"done": done, "took": took, **outcome}))
if ray.is_initialized():
    real_shutdown()
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env=_env({}))
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["done"] is True and result["took"] < 5.0, result  # the drain given up after its 0.5 s
    assert result["initialized"] is False, result  # no new Ray
    assert "ray.init refused: this command is stopping" in result["error"], result
    assert "Started a local Ray instance" not in run.stderr, run.stderr[-3000:]
