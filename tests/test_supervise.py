"""webapp/cli/supervise.py: the foreground process of ``serve --cluster`` with a local Ray.

The supervisor runs as a real subprocess here (it installs signal handlers, which must not
replace pytest's), started in a session of its own as a service manager or a shell would start
it; its child is a small Python script that writes down the signals it gets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from serving import as_a_terminal_job
from webapp.cli.supervise import DRIVER_ENV, exit_status, stop_timeout_s

# The driver's stand-in: writes its session, its parent and DRIVER_ENV, then each signal it gets, to
# argv[1]; exits with argv[2] on SIGINT/SIGTERM ("ignore": keeps running, "exit:N": exits N at once).
CHILD = """
import os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
def note(line):
    with open(out, "a") as f:
        f.write(line + "\\n")
def on(signum, _):
    note(signal.Signals(signum).name)
    if mode != "ignore":
        sys.exit(int(mode))
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, on)
note(f"sid={os.getsid(0)} ppid={os.getppid()} env={os.environ.get('%s')}")
while True:
    time.sleep(0.05)
""" % DRIVER_ENV

SUPERVISOR = """
import sys
from webapp.cli.supervise import supervise
sys.exit(supervise([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], dict(__import__("os").environ),
                   hard_stop_s=float(sys.argv[4])))
"""


def start(tmp_path, mode: str, hard_stop_s: float = 30.0) -> tuple[subprocess.Popen, object]:
    """The supervisor (in a session of its own) over a CHILD in ``mode``; returns it once the child is up."""
    out = tmp_path / "child.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(DRIVER_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, CHILD, str(out), mode, str(hard_stop_s)], cwd=ROOT,
                            env=env, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_a_terminal_job)  # SIGINT, SIGHUP as a terminal has them
    deadline = time.monotonic() + 30
    while not (out.exists() and out.read_text().endswith("\n")):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the child did not start"
        time.sleep(0.05)
    return proc, out


def test_the_child_runs_in_its_own_session_and_knows_its_supervisor(tmp_path):
    proc, out = start(tmp_path, "0")
    try:
        fields = dict(item.split("=") for item in out.read_text().splitlines()[0].split())
        assert fields["ppid"] == fields["env"] == str(proc.pid)
        assert int(fields["sid"]) != os.getsid(proc.pid)  # another session: a signal to the group misses it
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("sent, received", [("SIGTERM", "SIGTERM"), ("SIGINT", "SIGINT"), ("SIGHUP", "SIGTERM")])
def test_a_signal_to_the_group_reaches_the_child_once_as_a_stop(tmp_path, sent, received):
    proc, out = start(tmp_path, "0")
    os.killpg(proc.pid, getattr(signal, sent))  # the supervisor's whole group, as timeout(1) or Ctrl-C sends it
    assert proc.wait(30) == 0, proc.stderr.read()
    assert out.read_text().splitlines()[1:] == [received]


def test_the_childs_exit_status_is_the_commands(tmp_path):
    proc, _ = start(tmp_path, "3")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 3
    out = tmp_path / "child.txt"
    quick = subprocess.run([sys.executable, "-c", SUPERVISOR, CHILD, str(out), "exit:5", "30"], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert quick.returncode == 5  # it ended on its own: no signal needed


def test_a_child_that_does_not_stop_is_killed_after_the_hard_bound(tmp_path):
    proc, out = start(tmp_path, "ignore", hard_stop_s=1.0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGKILL
    assert "did not stop within 1 s; killing it" in proc.stderr.read()
    assert out.read_text().splitlines()[1:] == ["SIGTERM"]


def test_exit_status_and_the_stop_bound():
    assert exit_status(0) == 0 and exit_status(1) == 1 and exit_status(-signal.SIGKILL) == 137
    assert stop_timeout_s(30.0) == 60.0 and stop_timeout_s(10.0) == 40.0
