"""Start, watch and stop real servers on free localhost ports: the one launcher of bench/ and tests/.

``Gunicorn`` runs any server command as a subprocess with its output in a log file, polls
``/healthz`` until enough worker pids said ready, and stops it with SIGTERM (SIGKILL after a
timeout). ``start_ours`` starts our service exactly as deployed (``gunicorn -c gunicorn.conf.py
wsgi:app``, or another app module) with ``CLASSIFIER_*`` settings; ``start_ray`` starts
``python -m webapp serve --cluster`` on a local Ray. The baseline server has its own starter in
``bench/baseline_app.py``. ``tests/serving.py``'s ``Server`` is a thin subclass of ``Gunicorn``.

Only the standard library is imported here: no torch, no requests.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT

READY_TIMEOUT_S = 900
# gunicorn's default control socket is one path per user, and several gunicorns (ours, the
# baseline, other people's tests) run at once on this machine: benchmarks start without it.
NO_CONTROL_SOCKET = "--no-control-socket"


class NotReady(RuntimeError):
    """A server exited, or not all its workers said ready in time; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_settings(pairs: list[str]) -> dict[str, str]:
    """``--set NAME=VALUE`` arguments as ``{NAME: VALUE}``; a ``CLASSIFIER_`` prefix is dropped, NAME upper-cased.

    :raises SystemExit: an argument without ``=``.
    """
    out = {}
    for p in pairs:
        name, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"--set {p!r}: expected NAME=VALUE")
        out[name.upper().removeprefix("CLASSIFIER_")] = value
    return out


def classifier_env(settings: dict | None = None, env: dict | None = None, *, drop: tuple[str, ...] = ()) -> dict:
    """This process's environment without its ``CLASSIFIER_*`` variables (and ``drop`` prefixes), plus
    ``env``, plus ``settings`` as ``CLASSIFIER_<NAME>=str(value)``: only ``settings`` configure the server."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CLASSIFIER_", *drop))}
    return {**base, **(env or {}), **{f"CLASSIFIER_{k}": str(v) for k, v in (settings or {}).items()}}


def http_json(port: int, path: str, *, body: bytes | None = None, headers: dict | None = None,
              timeout: float = 3.0) -> tuple[int, dict | list | None]:
    """GET ``path`` (POST where ``body`` is given) on 127.0.0.1:``port`` over a fresh connection, closed after.

    Returns (HTTP status, the JSON answer or None where it is not JSON); ``timeout`` in s.
    :raises OSError, http.client.HTTPException: no answer.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET" if body is None else "POST", path, body=body, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, None
    finally:
        conn.close()


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (gunicorn: its workers; a local Ray: GCS, raylet, replicas...)."""
    def children(p: int) -> list[int]:
        try:
            return [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            return []

    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def rss_mb(pid: int, default: float | None = None) -> float | None:
    """Resident memory of a process in MB (``VmRSS`` of ``/proc/<pid>/status``); ``default`` if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return default


class Gunicorn:
    """A server master started as a subprocess (stdout and stderr to ``log_path``) on ``127.0.0.1:port``.

    ``proc`` is the ``subprocess.Popen``; ``log`` the open log file; ``started`` its
    ``time.monotonic()`` at launch; ``ready_at`` maps each worker pid seen ready to the seconds from
    launch until first seen so; ``health`` maps it to its last ``/healthz`` answer. ``session``:
    start it in a process group of its own, as a terminal would (``os.killpg`` then reaches all of it: Ctrl-C).
    """

    def __init__(self, name: str, argv: list[str], *, env: dict, port: int, log_path: Path, session: bool = False):
        self.name, self.port, self.log_path = name, port, Path(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.log_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=session)
        self.ready_at: dict[int, float] = {}
        self.health: dict[int, dict] = {}

    def output(self) -> str:
        """The whole log so far (flushed first)."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, workers: int, timeout: float = READY_TIMEOUT_S, poll: float = 0.1) -> dict[int, dict]:
        """Poll ``/healthz`` every ``poll`` s until ``workers`` distinct worker pids said ready; return their health by pid.

        :raises NotReady: the server exited, or not all workers were ready within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NotReady(f"{self.name}: gunicorn exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                # a fresh connection each time, so successive polls can land on different workers
                status, health = http_json(self.port, "/healthz", headers={"Connection": "close"})
                if status == 200 and health and health.get("ready"):
                    pid = health["pid"]
                    self.ready_at.setdefault(pid, time.monotonic() - self.started)
                    self.health[pid] = health
                    if len(self.health) >= workers:
                        return self.health
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(poll)
        raise NotReady(f"{self.name}: {len(self.health)}/{workers} workers ready after {timeout:g} s:\n"
                       f"{self.output()[-3000:]}")

    def worker_pids(self) -> list[int]:
        """Pids of every process below the master (its workers, and theirs)."""
        return descendants(self.proc.pid)

    def pids(self) -> list[int]:
        """The master's pid, then its ``worker_pids()``: whose CPU counts as the server's."""
        return [self.proc.pid, *self.worker_pids()]

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM the master, wait (SIGKILL after ``timeout`` s), close the log; return its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode

    def log_problems(self) -> list[str]:
        """Lines of the log that look wrong (tracebacks, criticals, errors, worker timeouts and exits)."""
        keys = ("Traceback", "[CRITICAL]", "WORKER TIMEOUT", "Worker (pid", "[ERROR]")
        return [line for line in self.output().splitlines() if any(k in line for k in keys)]


def ours_command(*, settings: dict | None = None, env: dict | None = None, args=(), app: str = "wsgi:app",
                 control_socket: bool = False) -> tuple[list[str], dict, int]:
    """(argv, environment, port) of our real server, ``gunicorn -c gunicorn.conf.py [--no-control-socket] *args app``.

    The port is a free one. ``settings`` become ``CLASSIFIER_*`` variables (this process's own are
    dropped) and ``CLASSIFIER_BIND`` the port; ``env`` adds others (``LD_PRELOAD``,
    ``TORCHINDUCTOR_CACHE_DIR``...). ``control_socket=False`` (benchmarks) adds ``--no-control-socket``;
    True leaves that to ``args``.
    """
    port = free_port()
    full = classifier_env({**(settings or {}), "BIND": f"127.0.0.1:{port}"}, env)
    flags = () if control_socket else (NO_CONTROL_SOCKET,)
    return [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", *flags, *args, app], full, port


def start_ours(log_path: Path, *, settings: dict | None = None, env: dict | None = None, args=(),
               app: str = "wsgi:app", control_socket: bool = False, name: str = "ours") -> Gunicorn:
    """Our real server (see ``ours_command``) started on a free port; ``wait_ready(workers)`` next."""
    argv, full, port = ours_command(settings=settings, env=env, args=args, app=app, control_socket=control_socket)
    return Gunicorn(name, argv, env=full, port=port, log_path=log_path)


def ours_plan(settings: dict):
    """The CPU plan (``webapp.cpu.Plan``: workers, threads, cores) gunicorn.conf.py derives from these settings."""
    from webapp import cpu

    return cpu.plan(cpu.usable_cores(), workers=int(settings.get("WORKERS", 0) or 0),
                    threads=int(settings.get("THREADS", 0) or 0))


def ray_available() -> bool:
    """Whether ``ray`` and ``a2wsgi`` (what ``serve --cluster`` needs) are installed."""
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("a2wsgi") is not None


def start_ray(log_path: Path, *, settings: dict, replicas: int, threads: int) -> Gunicorn:
    """``python -m webapp serve --cluster`` (a local Ray: no ``RAY_ADDRESS``) with ours' settings, on a free port.

    ``replicas`` model replicas of ``threads`` intra-op threads each (as many CPUs reserved).
    Ready once ``/healthz`` has shown every replica ready (its ``pid`` is the replica's).
    """
    port = free_port()
    values = {**settings, "CLUSTER_REPLICAS": replicas, "THREADS": threads, "BIND": f"127.0.0.1:{port}"}
    env = classifier_env(values, drop=("RAY_ADDRESS",))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return Gunicorn("ray", [sys.executable, "-m", "webapp", "serve", "--cluster"], env=env, port=port,
                    log_path=log_path)
