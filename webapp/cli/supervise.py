"""``serve --cluster`` with a local Ray: the driver runs in a session of its own; this process passes it the signals.

Why. ``ray.init()`` puts the Ray it starts (GCS, raylet, dashboard, monitors) in the driver's
process group, so a SIGTERM to the command's group (``timeout(1)``, ``kill -TERM -PGID``, process
managers that stop a group) would reach them along with the command and take Ray down before Serve
drains: the stop then hung for a minute. In a session of its own the driver and its Ray get no group
signal; this small foreground process (it imports neither Ray nor torch) takes SIGINT, SIGTERM and
SIGHUP and passes them on, and the driver drains and shuts its Ray down (webapp/cluster/stopping.py).
The driver also stops when this process dies (it watches its parent), and this process SIGKILLs the
driver if it is still there ``hard_stop_s`` after the first stop signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from .common import err

# In the driver's environment: this pid. ``serve --cluster`` seeing it runs the driver itself.
DRIVER_ENV = "PHOTO_CLASSIFIER_CLUSTER_SUPERVISOR"
# The longest model-replica graceful shutdown is REQUEST_TIMEOUT_S, the HTTP replicas' 10 s more;
# then 5 s for Serve's controller and 15 s to shut Ray down and end what is left (stopping.AFTER_DRAIN_S).
STOP_MARGIN_S = 30.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_timeout_s(request_timeout_s: float) -> float:
    """Seconds from SIGINT/SIGTERM to the exit of ``serve --cluster``, at most: ``REQUEST_TIMEOUT_S`` + 30."""
    return request_timeout_s + STOP_MARGIN_S


def exit_status(returncode: int) -> int:
    """A child's ``Popen.returncode`` as a shell reports it: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def supervise(cmd: list[str], env: dict, *, hard_stop_s: float) -> int:
    """Run ``cmd`` in a new session, pass it this process's stop signals, and return its exit status.

    SIGINT and SIGTERM are passed on as they are, SIGHUP as SIGTERM (a closed terminal stops the
    service; one ignored here, under ``nohup``, stays ignored). ``env`` gets ``DRIVER_ENV``.
    ``hard_stop_s``: seconds after the first stop signal past which the child is SIGKILLed (its own
    bound failed). Returns the child's exit status (``exit_status``: 137 after that SIGKILL).
    """
    child = subprocess.Popen(cmd, env={**env, DRIVER_ENV: str(os.getpid())}, start_new_session=True)
    first_signal: list[float] = []

    def forward(signum: int, _frame) -> None:
        first_signal.append(time.monotonic())
        try:
            child.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)
        except ProcessLookupError:  # it has just exited
            pass

    for sig in _FORWARDED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, forward)
    while True:
        try:
            return exit_status(child.wait(timeout=0.5))
        except subprocess.TimeoutExpired:
            pass
        if first_signal and time.monotonic() > first_signal[0] + hard_stop_s:
            err(f"error: serve --cluster did not stop within {hard_stop_s:.0f} s; killing it")
            child.kill()
            return exit_status(child.wait())
