"""Start and stop the real gunicorn server from tests: ``Server(log_path, MODEL=..., ...)``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from conftest import ROOT

READY_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A gunicorn process started from the repo's own gunicorn.conf.py with ``CLASSIFIER_*`` settings."""

    def __init__(self, log_path: Path, *, args=(), app: str = "wsgi:app", env: dict | None = None, **settings):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith("CLASSIFIER_")}
        env = {**base, **(env or {}), **{f"CLASSIFIER_{k}": str(v) for k, v in settings.items()}}
        env["CLASSIFIER_BIND"] = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py", *args, app],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, workers: int) -> dict[int, dict]:
        """Poll /healthz until ``workers`` distinct worker pids report ready; return their health by pid."""
        seen: dict[int, dict] = {}
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"gunicorn exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                health = requests.get(self.url + "/healthz", timeout=5).json()
                if health["ready"]:
                    seen[health["pid"]] = health
                    if len(seen) >= workers:
                        return seen
            except requests.RequestException:
                pass
            time.sleep(0.2)
        pytest.fail(f"not ready within {READY_TIMEOUT_S} s:\n{self.output()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def stop_cleanly(self) -> str:
        """Stop (SIGTERM) and assert it exited 0 with no traceback in its log; return the log."""
        code = self.stop()
        out = self.output()
        assert code == 0, f"gunicorn exited with {code}:\n{out[-3000:]}"
        assert "Traceback" not in out, out[-5000:]
        return out


