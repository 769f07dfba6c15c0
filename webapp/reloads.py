"""Workers that come after the server serves: a reload (SIGHUP) and a replacement of a dead worker.

Both are workers forked while another one already answers. gunicorn's own way with them serves no one
well: it stops every old worker at once on a reload, while the new ones still load their model (clients got
``503 not_ready`` for the ~2 s that took); and a new worker that cannot start (the cache disk full, say) halts
the whole server, exit 3, although the workers started before it were serving (tryout15: a reload on a full
cache disk took the service down). Here:

- ``keep_serving_through_reloads``: old workers serve until every new one is ready, then go;
- ``failed_start``: a worker whose start-up failed stops the server (exit 3, its reason as the last line) only
  where it was forked before any worker served (the first start: an operator is watching, and systemd shows
  the failure) or nothing serves now. Otherwise the workers that serve go on, and the master logs an error with
  the reason: a reload is given up (the old workers stay; the reload's other new workers still starting are
  stopped, as they would likely fail the same way); a replacement is not forked again and again (each would
  fail the same way, for as long as a compile takes): the server serves with the workers it has, until a
  SIGHUP (the count read again) or a SIGTTIN.

Master side, torch- and Flask-free, as ``webapp.lifecycle``.
"""

from __future__ import annotations

import signal
import time

from .lifecycle import EXIT_STARTUP, master, stopping

RELOAD_WAIT_S = 900.0  # s: past it, old workers go even where new ones are not ready (each bounds its own start)
_settings = None  # the settings gunicorn.conf.py read last without an error (``settings_read``)


def settings_read(load, first: bool):
    """The settings for gunicorn.conf.py, ``load()``-ed (it raises ``SettingsError``). On the first read an error
    propagates (one line, exit 2: nothing serves yet). On a SIGHUP's re-read it must not stop the master: a cache
    folder replaced by a file, a calibration folder moved since the start, ended the whole server with exit 2,
    and under systemd (``RestartPreventExitStatus=2``) it stayed down (tryout26). The master then logs the error
    and goes on with the settings it read last; the reload's new workers meet the same error as they start, so
    the reload is given up and the workers serving now serve on (``failed_start``)."""
    global _settings
    from .settings import SettingsError

    try:
        _settings = load()
    except SettingsError as exc:
        if first or _settings is None:
            raise
        import logging

        logging.getLogger("gunicorn.error").error(
            "configuration error on reload: %s; the master keeps the settings it had, and the reload's new workers "
            "meet the error as they start (the workers serving now serve on)", exc)
    return _settings


def keep_serving_through_reloads(server) -> None:
    """In the master (``when_ready``): gunicorn's ``manage_workers`` stops the oldest workers beyond the count at
    once, so a SIGHUP (reload) stopped every old worker while the new ones were still loading their model; with
    one worker, clients got ``503 not_ready`` for the ~2 s that took (tryout14: 239 of 300). Here, where an old
    worker beyond the count is ready and a newer one is not yet, it waits (``RELOAD_WAIT_S`` at most) until every
    newer worker is ready, then stops the old ones: both serve meanwhile. gunicorn's reload already blocks its
    main loop until the old workers are gone (up to ``graceful_timeout``); this wait ends early at any signal but
    a worker's exit (SIGTERM...), which the loop then handles; a worker's exit is reaped here (a new worker that
    failed to start is then gone from the count). A reduction (SIGTTOU) goes at once as before."""
    if getattr(server, "_keeps_serving", False):
        return
    original = server.manage_workers
    signals = getattr(server, "SIG_QUEUE", None)

    def younger_not_ready() -> bool:
        excess = len(server.WORKERS) - server.num_workers
        if excess <= 0:
            return False
        state = master()
        state.drain()
        by_age = sorted(server.WORKERS.items(), key=lambda w: w[1].age)
        with state.lock:
            return any(pid in state.ready for pid, _ in by_age[:excess]) and \
                not all(pid in state.ready for pid, _ in by_age[excess:])

    def other_signal() -> bool:  # a worker's exit (SIGCHLD) is reaped here: one that failed to start must not
        if signals is None or signals.empty():  # count as a new worker, for which an old one would be stopped
            return False
        queued = []
        while not signals.empty():
            queued.append(signals.get_nowait())
        others = [sig for sig in queued if sig != signal.SIGCHLD]
        for sig in others:
            signals.put_nowait(sig)  # back, in order, for the main loop
        if len(others) < len(queued):
            server.reap_workers()
        return bool(others)

    def manage_workers():
        deadline = time.monotonic() + RELOAD_WAIT_S
        while younger_not_ready() and time.monotonic() < deadline and not other_signal():
            time.sleep(0.05)
        original()

    server.manage_workers, server._keeps_serving = manage_workers, True


def forked(worker) -> None:
    """In ``pre_fork`` (the master): note whether ``worker`` comes after the server served (a reload, a
    replacement) or belongs to the first start."""
    worker.after_serving = master().any_ready()


def failed_start(server, worker) -> None:
    """In ``child_exit`` (inside gunicorn's ``reap_workers``, which ``lifecycle.guard_halt`` wraps: that marks
    the server halting): if ``worker`` reported a failed start-up, stop the server with its reason, unless it
    came after the server served and other workers serve on (the module's docstring); then log the reason at
    error level and, where fewer workers are left than the count, lower the count to them, so gunicorn does not
    fork the same failure again.

    :raises HaltServer: the reason, with ``EXIT_STARTUP`` (gunicorn logs it as the last line).
    """
    from gunicorn.errors import HaltServer

    state = master()
    reason = state.forget(worker.pid)
    if reason is None or state.halting or stopping(server):
        return
    with state.lock:
        serving = [pid for pid in server.WORKERS if pid in state.ready]
    if not getattr(worker, "after_serving", False) or not serving:
        raise HaltServer(f"worker {worker.pid} could not start: {reason}", EXIT_STARTUP)
    left = len(server.WORKERS)
    if left >= server.num_workers:  # a reload: the old workers fill the count; its other new ones go too
        with state.lock:
            starting = [pid for pid, w in server.WORKERS.items()
                        if getattr(w, "after_serving", False) and pid not in state.ready]
        for pid in starting:
            server.kill_worker(pid, signal.SIGTERM)  # (a worker still starting stops at once)
        for _, w in sorted(server.WORKERS.items(), key=lambda item: item[1].age):  # the old workers are the current
            server.worker_age += 1  # generation now: gunicorn's reload waits (graceful_timeout, its main loop
            w.age = server.worker_age  # blocked) until every worker is younger than the reload
        then = "the reload is given up: the workers started before it serve on"
    else:  # a replacement of a worker that died
        then = (f"serving with {left} of {server.num_workers} workers; it is not started again (it would fail "
                f"the same way) until a SIGHUP reload or a SIGTTIN")
        server.num_workers = left
    server.log.error("worker %s could not start: %s; %s. Mend it, then reload (SIGHUP).", worker.pid,
                     reason.rstrip("."), then)  # a reason's own full stop made ".;" (tryout26)
