"""The gunicorn worker class: gunicorn's gevent worker, with stops that are quick and quiet.

``gunicorn.conf.py`` names it (``worker_class``). Two things differ from ``GeventWorker``:

- **Before it is ready** (building, compiling, warming up: up to minutes, in the main thread, which
  does not yield to gevent's hub), gunicorn's handlers would only queue the stop for later, so a
  Ctrl-C waited for the compile to end or for the master to SIGKILL the worker after its graceful
  timeout. Here SIGINT, SIGQUIT or SIGTERM then ends the worker at once, with one line and exit 0:
  it holds no request yet, and nothing it was writing is read by anyone unless complete (caches
  are written to a temporary name and renamed).
- **Once serving**, a Ctrl-C in a terminal reaches every process of the group: the worker gets
  SIGINT itself and SIGQUIT from the master. gunicorn's gevent worker handles each by spawning a
  greenlet that raises ``SystemExit``; the second one ran during interpreter shutdown and printed
  a ``SystemExit: 0`` traceback. Here only the first stop signal counts.
"""

from __future__ import annotations

import os
import signal

from gunicorn.workers.ggevent import GeventWorker


class Worker(GeventWorker):
    """``GeventWorker`` that leaves at once when stopped before ready, and handles one quit only."""

    _quitting = False

    def handle_quit(self, sig, frame):
        """SIGINT / SIGQUIT: before ready, leave now; after, gunicorn's quick stop, once."""
        if not self.booted:
            leave_before_ready(self.log, sig)
        if self._quitting:
            return
        self._quitting = True
        super().handle_quit(sig, frame)

    def handle_exit(self, sig, frame):
        """SIGTERM: before ready, leave now (no request to drain); after, gunicorn's graceful stop."""
        if not self.booted:
            leave_before_ready(self.log, sig)
        super().handle_exit(sig, frame)


def leave_before_ready(log, sig: int) -> None:
    """One line on gunicorn's ``log``, exit 0, no cleanup hooks: the model was not serving yet
    (``os._exit``: the main thread may be deep inside a compile that would run on for a minute)."""
    try:
        log.info("worker %s stopped before it was ready (%s)", os.getpid(), signal.Signals(sig).name)
    finally:
        os._exit(0)


def exit_on_stop_signals(log) -> None:
    """In ``post_fork``, before gunicorn installs the worker's own handlers: a stop signal ends the new
    worker at once, as it does later during start-up (the master's inherited handlers would drop it)."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: leave_before_ready(log, signum))
