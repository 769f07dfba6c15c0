"""gunicorn configuration: ``gunicorn -c gunicorn.conf.py wsgi:app``.

Every value comes from the settings table (``CLASSIFIER_*`` env vars, see README); gunicorn's
own command-line flags still override it (``-b``, ``-w``). The master imports torch and the
other libraries before it listens (``webapp/preload.py``: shared pages, no model, no thread pool); each
worker pins itself to its cores, then builds, compiles and warms up its own model after fork.
"""

import atexit
import gc
import os
import shutil
import sys
from pathlib import Path

from webapp import GUNICORN_ENV
from webapp import advice, balance, caches, catalog, cpu, lifecycle, listen, reloads, sdnotify, settings

lifecycle.hold_control_signals()  # a SIGHUP or SIGUSR1 before gunicorn's handlers exist is kept, not fatal
sdnotify.take_notify_socket()  # systemd's Type=notify: READY=1 once a worker serves, not as the master boots


def _settings() -> settings.Settings:
    """The settings, and the workers' cache folder made here as a worker would: one that cannot be is a setting's
    fault, said before listening, not each worker's "loading model failed" and exit 3. (One that cannot be
    written is used as it is: a warm cache shipped read-only; each worker says so.)"""
    s = settings.load()
    caches.make_cache_dir(s, read_only_ok=True)
    return s


_first_load = lifecycle.first_config_load()
try:  # a SIGHUP's re-read that fails keeps the settings read before (webapp/reloads.py): the master serves on
    _s = reloads.settings_read(_settings, _first_load)
except settings.SettingsError as exc:
    lifecycle.exit_now(lifecycle.EXIT_CONFIG, f"configuration error: {exc}")


def _check_flags() -> None:
    """A gunicorn flag with a value gunicorn refuses (``--timeout -5``, ``-w 0``) is a bad setting: one line and
    exit 2, as the exit table says (``lifecycle.gunicorn_flags_problem``, which ``serve --dry-run`` asks too; a
    flag it cannot parse at all, ``-w abc``, never gets here: argparse exits 2 before this file is read)."""
    if not os.path.basename(sys.argv[0]).startswith("gunicorn") and not sys.argv[0].endswith("gunicorn/__main__.py"):
        return  # not gunicorn's command line (a tool reading this file)
    problem, workers = lifecycle.gunicorn_flags_problem(sys.argv[1:])
    if problem:
        lifecycle.exit_now(lifecycle.EXIT_CONFIG, f"configuration error: {problem}")
    if workers is not None:
        _flags["workers"] = workers


_flags: dict = {}  # gunicorn flags given on its command line that this file must know of (-w)
_check_flags()

# Tells create_app to leave the model to post_worker_init (also right with --preload, where
# the app is imported in the master: the master must never start torch's thread pools).
os.environ[GUNICORN_ENV] = "1"

_plan = cpu.plan(cpu.usable_cores(), workers=_s.WORKERS, threads=_s.THREADS)
# As many workers as were asked for (gunicorn's -w wins over the plan) must fit in memory: too many would
# have the host swap until nothing answers, so that is a bad setting, said before anything starts (not on
# a SIGHUP's re-read, when the running workers hold some of that memory).
if _first_load and (
        _problem := cpu.memory_problem(_flags.get("workers", _plan.workers), cpu.available_mb())):
    lifecycle.exit_now(lifecycle.EXIT_CONFIG, f"configuration error: {_problem}")

# -- server socket -------------------------------------------------------------------------------
bind = [_s.BIND]
backlog = 2048
# gunicorn 27's control socket is one fixed path per user: two servers on one host (tests,
# blue/green) would delete each other's. Nothing here uses it.
control_socket_disable = True

# -- workers ---------------------------------------------------------------------------------------
# gevent: a request waiting for its batch costs a greenlet, not a thread; the forward pass runs
# on the batcher's real OS thread (webapp/batcher.py). webapp/worker.py: gunicorn's gevent worker
# with quick, quiet stops (Ctrl-C during start-up or while serving).
worker_class = "webapp.worker.Worker"
workers = _plan.workers
worker_connections = 1000
# Heartbeat timeout (s). During start-up a real thread keeps the heartbeat going for up to
# CLASSIFIER_STARTUP_TIMEOUT_S while the model compiles.
timeout = 60
# SIGTERM: stop accepting, let in-flight and queued requests finish for up to this many seconds.
graceful_timeout = 30
keepalive = 5
# A request line or header this large is not from a browser or a script of ours.
limit_request_line = 8190
limit_request_fields = 100

# -- logging ---------------------------------------------------------------------------------------
loglevel = _s.LOG_LEVEL
# CLASSIFIER_ACCESS_LOG: text is gunicorn's own line (with the request id at its end); json is one
# JSON object per request written by the app (webapp/logs.py) to stdout; off is none.
accesslog = "-" if _s.ACCESS_LOG == "text" else None
errorlog = "-"
access_log_format = '%(h)s %(t)s "%(r)s" %(s)s %(b)s %(M)sms %({x-request-id}o)s'
logger_class = "webapp.redact.AccessLogger"  # a token sent in the URL (?token=...) logged as [hidden]

# -- metrics ---------------------------------------------------------------------------------------
# prometheus-client's multiprocess mode: every worker writes its values to files in this folder and
# a scrape of /metrics adds them all up. Set here, in the master, before any worker forks (and before
# prometheus_client is imported anywhere: it picks its mode from the environment on import). A folder
# we make is ours: emptied at start, removed at exit; one given in the environment is emptied at start.
# (Which folder we made is kept in the environment: a SIGHUP re-reads this file.)
_MADE = "WEBAPP_METRICS_DIR_MADE"
if _s.METRICS and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # Removed at exit however the master exits, short of SIGKILL (on_exit below runs only after a normal stop); a
    # SIGKILLed master's folder goes at the next start (its pid in its name no longer runs).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ[_MADE] = lifecycle.own_temp_dir("classifier-metrics-")


def _clear_metrics_dir() -> str | None:
    """Start from zero: values left by an earlier run (same folder, reused pids) would be counted again. A folder
    that cannot be made or written is a setting's fault, one line and exit 2 (a file there was a traceback, a
    read-only one 149 lines of each worker's and exit 3: tryout34)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not (_s.METRICS and path):
        return None
    if why := caches.folder_problem(Path(path)):
        lifecycle.exit_now(lifecycle.EXIT_CONFIG, f"configuration error: PROMETHEUS_MULTIPROC_DIR={path} cannot be "
                           f"used: {why} (prometheus-client's multiprocess mode writes each worker's metrics there); "
                           f"point it at a folder this server can write, or unset it (the server then makes its "
                           f"own), or set {settings.PREFIX}METRICS=0")
    for name in os.listdir(path):
        if name.endswith(".db"):
            os.remove(os.path.join(path, name))
    return path


# -- hooks -----------------------------------------------------------------------------------------
def on_starting(server):
    """In the master, before it listens: one line and exit 5 if it cannot listen; the start-up channel."""
    if server.cfg.workers < 1:  # -w 0 from GUNICORN_CMD_ARGS (the command line's is refused as it is read)
        problem = lifecycle.no_workers_problem(server.cfg.workers)
        lifecycle.exit_now(lifecycle.EXIT_CONFIG, f"configuration error: {problem}")
    # gunicorn's -b (or GUNICORN_CMD_ARGS, serve -- -b) wins over the setting: said where one was set (over the
    # default, which nobody chose, it was a warning about nothing: tryout26)
    if server.cfg.bind != bind and settings.PREFIX + "BIND" in os.environ:
        server.log.warning("-b %s overrides %sBIND=%s (serve --bind)", " -b ".join(server.cfg.bind), settings.PREFIX,
                           _s.BIND)
    problem = listen.check_listen(server.cfg.address)
    if problem:
        server.log.error("%s", problem)
        if server.pidfile is not None:
            server.pidfile.unlink()
        lifecycle.exit_now(lifecycle.EXIT_LISTEN)
    lifecycle.master()  # the pipe the workers report on: made before the first fork
    lifecycle.guard_halt(server)
    from webapp import preload

    # Before the 503 responder's thread allocates: it got an arena of its own, which every worker inherited
    # (/healthz showed malloc_arenas 2 with the setting at 1; tryout14). Each worker sets it again as it forks.
    preload.limit_arenas(_s.MALLOC_ARENAS)
    metrics_dir = _clear_metrics_dir()
    if metrics_dir:
        server.log.info("/metrics counts all workers: PROMETHEUS_MULTIPROC_DIR=%s", metrics_dir)
    server.log.info("plan: %s", cpu.describe(_plan, cpu.usable_cores()))
    for said in advice.warnings(_s, _plan.threads, len(cpu.usable_cores())):  # allowed, but against this server
        server.log.warning("%s", said)
    if unused := catalog.unused_weights(_s):
        server.log.warning("%s", unused)
    if server.cfg.workers != _plan.workers:
        server.log.warning("-w %d overrides the plan's %d workers; slots wrap around the cores",
                           server.cfg.workers, _plan.workers)
    if _s.PRELOAD_LIBRARIES:
        _import_shared(server)
    if _s.IDLE_FIRST and not server.cfg.reuse_port:
        balance.install(2 * max(server.cfg.workers, len(_plan.slots)))  # a reload's old and new workers at once


def _import_shared(server):
    """The libraries every worker would import, imported once here and shared by all of them (#7).

    Before listening, not once the 503 responder runs: loading libtorch holds the GIL for up to a second
    on a busy box, and the responder's answers would wait for it. gunicorn's own signal handlers come
    only after ``on_starting``: a stop signal during these seconds ends the master at once, exit 0.
    """
    import signal

    from webapp import preload

    def stop(signum, _frame):
        server.log.info("stopped while starting (%s)", signal.Signals(signum).name)
        if server.pidfile is not None:
            server.pidfile.unlink()
        lifecycle.exit_now(0)  # SystemExit: the metrics folder's cleanup runs

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT)}
    try:
        done = preload.import_shared()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    server.log.info("master imported %s in %.1f s (shared by the workers: %.0f MB); threads %d -> %d",
                    ", ".join(done["seconds"]), sum(done["seconds"].values()),
                    sum(done["private_mb"].values()), done["threads_before"], done["threads_after"])
    if done["threads_after"] > done["threads_before"]:
        server.log.warning("importing the libraries started %d thread(s) in the master: forked workers "
                           "inherit none of them", done["threads_after"] - done["threads_before"])


def when_ready(server):
    """In the master, listening now: answer 503 on the port until a worker is ready, and from a stop signal
    until the master exits (webapp/responder.py). First, carry out the control signals (SIGHUP, SIGUSR1, ...)
    received while starting (webapp/lifecycle.py)."""
    from webapp.responder import Responder, master_answers

    lifecycle.replay_held_signals(server)
    reloads.keep_serving_through_reloads(server)
    _say_what_a_stop_cuts(server)
    sdnotify.tell_stops(server)
    state = lifecycle.master()
    where = ", ".join(f"unix:{a}" if isinstance(a, str) else f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}"
                      for a in server.cfg.address)  # for systemctl status: as a bind is written, not a repr
    state.on_ready = lambda: sdnotify.notify_systemd(f"READY=1\nSTATUS=serving on {where}")
    state.drain()  # a worker ready already (a reload): said at once
    if state.responder is None and server.LISTENERS:  # with reuse_port each worker listens on its own
        first = [id(lst) for lst in server.LISTENERS]
        state.responder = Responder(
            [lst.sock for lst in server.LISTENERS], wake_fd=state.read_fd, on_wake=state.drain,
            needed=lambda: not state.any_ready(),
            stopping=lambda: lifecycle.stopping(server),
            ended=lambda: bool(server.LISTENERS) and [id(lst) for lst in server.LISTENERS] != first,
            on_answer=master_answers(server.log, _s))
        state.responder.start()


def _say_what_a_stop_cuts(server):
    """A stop whose workers are still answering when its wait ends (graceful_timeout after SIGTERM: a slow upload,
    a long queue) kills them: say so, once, with the pids. It said nothing, and exited 0: a cut request looked like
    a clean stop (tryout14)."""
    import signal

    kill_workers = server.kill_workers

    def kill(sig):
        if sig == signal.SIGKILL and server.WORKERS:
            server.log.warning("%d worker(s) still answering requests when the stop's wait ended (graceful_timeout "
                               "%g s after SIGTERM): killed, cutting those requests (pids %s)", len(server.WORKERS),
                               server.cfg.graceful_timeout, ", ".join(map(str, sorted(server.WORKERS))))
        kill_workers(sig)

    server.kill_workers = kill


def pre_fork(server, worker):
    """In the master: give the new worker the plan slot (core set) that the fewest live workers hold.

    A replacement thus takes the cores its dead predecessor had; during a reload (SIGHUP), when
    old and new workers overlap, the new ones still spread over the cores evenly.
    """
    reloads.forked(worker)  # whether it comes after the server served: its failed start then stops nothing
    n = len(_plan.slots)
    held = [0] * n
    for w in server.WORKERS.values():
        if getattr(w, "slot", None) is not None:
            held[w.slot % n] += 1
    worker.slot = min(range(n), key=lambda i: (held[i], i))
    if held[worker.slot] and server.num_workers > max(n, server.cfg.workers):  # SIGTTIN past the plan (not a reload)
        server.log.warning("%d workers for the plan's %d core sets (SIGTTIN): the new one shares cores %s with "
                           "another, and each gets about half of them; SIGTTOU takes it back", server.num_workers, n,
                           cpu.core_ranges(_plan.slots[worker.slot]))
    worker.board_entry = balance.claim()  # its entry in the table of who is idle (None: no table)


def post_fork(server, worker):
    """In the worker, before the app loads: pin to the slot's cores (threads follow the pinning)."""
    import logging

    from webapp.worker import exit_on_stop_signals

    exit_on_stop_signals(server.log)  # until gunicorn installs the worker's own handlers
    # A master SIGKILLed (OOM killer, kill -9) runs no stop: its workers compiled on for ~45 s before gunicorn's
    # "Parent changed" check. The kernel's SIGTERM on its death stops them as the master's own SIGTERM would.
    from webapp import children

    children.signal_on_parent_death(server.pid)
    lifecycle.close_in_worker()

    # The service's own log lines go where gunicorn's error log goes.
    app_log = logging.getLogger("webapp")
    app_log.handlers = list(server.log.error_log.handlers)
    app_log.propagate = False
    from webapp.logs import configure_access_logger, install_request_id_filter

    install_request_id_filter(app_log)  # its lines written while serving a request end with its id
    from webapp.refusals import ClientFaultsAtInfo

    server.log.error_log.addFilter(ClientFaultsAtInfo(server.log.error_log))  # a client's bad request: not a warning
    if _s.ACCESS_LOG == "json":
        configure_access_logger(sys.stdout)  # where gunicorn's access log would go
    cores = _plan.slots[worker.slot % len(_plan.slots)]
    cpu.SERVER_CORES = cpu.usable_cores()  # for one-off start-up work its neighbours wait for (cpu.borrowed_cores)
    os.sched_setaffinity(0, cores)
    server.log.info("worker %d (slot %d) pinned to cores %s", worker.pid, worker.slot, cpu.core_ranges(cores))
    from webapp import preload

    preload.limit_arenas(_s.MALLOC_ARENAS)  # before any of its threads allocates (webapp/preload.py)
    balance.join(getattr(worker, "board_entry", None))  # not idle until it serves


def post_worker_init(worker):
    """Build, compile, warm up and self-test this worker's model before it takes requests.

    A failed start-up is reported to the master, which stops the server with that reason as its
    last line and exit status 3 (webapp/lifecycle.py); this worker exits quietly.
    """
    from webapp.errors import StartupError

    classifier = worker.wsgi.extensions["classifier"]

    def died(exc):  # inference thread died: stop this worker; gunicorn starts a fresh one
        worker.log.critical("inference thread died (%r); worker %d exits to be replaced", exc, worker.pid)
        worker.alive = False

    classifier.on_death = died
    try:
        classifier.start(heartbeat=worker.notify)
    except Exception as exc:  # noqa: BLE001  every start-up failure ends the same way: one line, exit 3
        if isinstance(exc, StartupError):
            reason = str(exc)
        elif isinstance(exc, settings.SettingsError):  # the cache folder, gone bad since the start: a reload's worker
            reason = f"configuration error: {exc}"
        else:  # a compile error and the like: its first line here, the whole traceback at debug level
            worker.log.debug("start-up failed", exc_info=True)
            reason = lifecycle.describe_failure(classifier.status, exc)
        reason = caches.where_space_ran_out(reason, _s)  # ENOSPC names no disk
        if lifecycle.report_failure(worker.pid, reason):
            # Out at once: the master now stops every worker, and one still tearing down torch when
            # its SIGTERM comes would die of it (a line of noise). Nothing of this worker needs saving.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        worker.log.error("cannot start: %s", reason)  # no master to tell: gunicorn's own way
        sys.exit(lifecycle.EXIT_STARTUP)
    metrics = worker.wsgi.extensions.get("metrics")
    if metrics is not None:  # this worker's gauges (ready, model) are in every scrape from now on
        metrics.sample(classifier)
    # What start-up made (torch, the model, the app) out of the cyclic GC's sight: a full collection
    # scanned it all and stopped the worker, its hub included, for 170-210 ms (measured on the 2-core
    # box: one per worker within 20 s of 12 MP uploads), the tail of both answers and refusals (#12).
    # Unfrozen at exit, so the interpreter's last collections see it again: left frozen, logging's
    # handler references were finalized after gevent's modules and printed "Exception ignored".
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    from webapp import preload

    preload.trim()  # the compile's freed heap back to the OS: ~40 MB less private per worker (#7)
    balance.serving()  # idle from now on, until requests with photos are in progress
    lifecycle.report_ready(worker.pid)


def pre_request(worker, req):
    """Leave ``100 Continue`` to the app (webapp/bodies.py sends it on the first read of the body), so a
    request that its headers already refuse (413 by Content-Length, 415, 401, 429, 503) never gets it.
    ``_expected_100_continue`` is gunicorn's own flag for this (gunicorn 27, http/message.py)."""
    worker.log.debug("%s %s", req.method, req.path)
    req._expected_100_continue = False


def worker_exit(server, worker):
    """Serve what is still queued, then stop the inference thread; a clean stop then leaves at once."""
    balance.serving(False)  # stopping: never taken for idle again
    wsgi = getattr(worker, "wsgi", None)
    if wsgi is not None:
        wsgi.extensions["classifier"].stop()
    lifecycle.leave_if_stopped_cleanly()  # no interpreter teardown of torch (1.4 s of CPU per stop)


def child_exit(server, worker):
    """In the master: a worker is gone; drop its live gauges (its counters stay in the totals). If its
    start-up failed, stop the server with the reason (raises gunicorn's HaltServer, exit 3), unless workers
    started before it serve on (webapp/reloads.py)."""
    if _s.METRICS and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
    balance.release(getattr(worker, "board_entry", None))
    reloads.failed_start(server, worker)


def on_exit(server):
    """In the master, last (its workers gone): answer what waits on the port and close it (webapp/responder.py:
    it refuses from now on); remove the metrics folder if it is the one we made; then leave with gunicorn's status,
    skipping the interpreter's teardown of torch (webapp/lifecycle.py)."""
    responder = lifecycle.master().responder
    if responder is not None:
        responder.finish()
    made = os.environ.get(_MADE)
    if made and made == os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        shutil.rmtree(made, ignore_errors=True)
    lifecycle.leave_master_now()
