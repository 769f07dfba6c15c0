"""How the gunicorn server starts and stops: exit statuses, the workers' reports to the master, clean exits.

``gunicorn.conf.py``'s hooks call these; the master imports this module at config time, so it
imports neither torch nor Flask (nor gevent): the master must never start torch's thread pools.

What it provides, and why:

- **Exit statuses** (``EXIT_STATUSES``, the README's table): one per kind of failure, stable.
- **The start-up channel**: a pipe made in the master before the first fork. A worker writes one
  line to it when it is ready (``report_ready``) or when its start-up failed (``report_failure``,
  with the reason). The master learns which workers are ready (the ``webapp.responder`` answers
  503 on the port while none is) and stops the server on the first failure with one line naming
  it, unless workers started before it serve on (a reload, a replacement: ``webapp.reloads``).
  gunicorn's own way (a worker exits 3, the master raises ``HaltServer``) prints a chained
  ``HaltServer`` traceback and exits 1 when two workers fail at once: the master reaps the second
  while handling the first. So a failed worker reports here and exits 0; ``child_exit`` decides.
- **Cleanup** (``remove_at_exit``): the metrics folder the master made goes on every exit path.
- **Control signals while starting** (``hold_control_signals``, ``replay_held_signals``): gunicorn's
  handlers for SIGHUP (reload), SIGUSR1 (reopen logs: logrotate sends it), SIGUSR2 (re-exec), SIGTTIN and
  SIGTTOU (one worker more or less) come only once the master listens, after seconds of importing torch;
  before that each signal's default action ended the master (SIGHUP: status 129, no line) or suspended it.
  They are held from the first read of ``gunicorn.conf.py`` and carried out once gunicorn's handlers are
  in place (``when_ready``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable

EXIT_OK, EXIT_OTHER, EXIT_CONFIG, EXIT_STARTUP, EXIT_APP_LOAD, EXIT_LISTEN = 0, 1, 2, 3, 4, 5
# (status, meaning): the README's table of the server's exit statuses (tests/test_lifecycle.py checks it).
EXIT_STATUSES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "stopped: SIGTERM (drains requests in flight), SIGINT (Ctrl-C) or SIGQUIT"),
    (EXIT_OTHER, "any other failure of gunicorn itself (its own message says what)"),
    (EXIT_CONFIG, "a bad setting: a `CLASSIFIER_*` variable (`CLASSIFIER_BIND` included) or a gunicorn flag"),
    (EXIT_STARTUP, "a worker could not start: weights missing or damaged, self-test failed, compile failed (the "
                   "last line says which), or the app module could not be imported (gunicorn's traceback)"),
    (EXIT_APP_LOAD, "the app module has no such app (`wsgi:app`; gunicorn's own message)"),
    (EXIT_LISTEN, "cannot listen on the address: in use, not allowed (a port below 1024 without root or "
                  "CAP_NET_BIND_SERVICE), or not on this host"),
)

_MAX_REASON = 3500  # bytes: a report stays under PIPE_BUF (4096), so each one is written atomically


def markdown_table() -> str:
    """The README's table of exit statuses, from ``EXIT_STATUSES``."""
    return "\n".join(["| exit status | meaning |", "|---|---|", *(f"| {code} | {what} |" for code, what in EXIT_STATUSES)])


# -- the start-up channel ------------------------------------------------------------------------------
@dataclass
class Master:
    """The master's view of its workers' start-ups: who is ready, who failed and why.

    ``read_fd``/``write_fd`` are the pipe's ends (non-blocking, close-on-exec: no compiler
    subprocess inherits them). ``ready`` holds the pids of live ready workers; ``failures`` maps a
    pid to the reason its start-up failed; ``halting`` is set once the server stops on a failure.
    ``lock`` is a real lock: the responder thread and the master's main loop both read the pipe.
    """

    read_fd: int
    write_fd: int
    lock: object
    ready: set[int] = field(default_factory=set)
    failures: dict[int, str] = field(default_factory=dict)
    halting: bool = False
    responder: object | None = None
    on_ready: Callable[[], None] | None = None  # called each time the first worker is ready (none was before)

    def drain(self) -> None:
        """Read every report waiting in the pipe (never blocks) into ``ready`` and ``failures``."""
        with self.lock:
            before = bool(self.ready)
            data = b""
            while True:
                try:
                    chunk = os.read(self.read_fd, 65536)
                except (BlockingIOError, InterruptedError):
                    break
                if not chunk:
                    break
                data += chunk
            for line in data.decode("utf-8", "replace").splitlines():
                kind, _, rest = line.partition(" ")
                pid_text, _, reason = rest.partition(" ")
                if not pid_text.isdigit():
                    continue
                if kind == "ready":
                    self.ready.add(int(pid_text))
                elif kind == "failed":
                    self.failures[int(pid_text)] = json.loads(reason) if reason else "start-up failed"
            now = bool(self.ready)
        if now and not before and self.on_ready is not None:
            self.on_ready()

    def any_ready(self) -> bool:
        """Whether at least one live worker has reported ready."""
        with self.lock:
            return bool(self.ready)

    def forget(self, pid: int) -> str | None:
        """A worker exited: drop it from ``ready``; return why its start-up failed, if it reported that."""
        self.drain()
        with self.lock:
            self.ready.discard(pid)
            return self.failures.pop(pid, None)


_master: Master | None = None
_config_loads = 0


def first_config_load() -> bool:
    """True the first time ``gunicorn.conf.py`` runs in this process; False when a SIGHUP re-reads it, with
    its workers running (what the host has left then counts them against their own plan)."""
    global _config_loads
    _config_loads += 1
    return _config_loads == 1


def master() -> Master:
    """The one ``Master`` of this process, made on first use (in the master, before any fork).

    Kept in this module, not in gunicorn.conf.py: a SIGHUP re-reads that file, and the workers
    forked before it still write to this pipe.
    """
    global _master
    if _master is None:
        from .concurrency import Primitives

        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        _master = Master(read_fd=r, write_fd=w, lock=Primitives.for_this_process().make_lock())
    return _master


def _report(line: str) -> bool:
    """Write one report line to the master; False where there is no channel or the write failed."""
    if _master is None:
        return False
    data = line.encode("utf-8")
    try:
        return os.write(_master.write_fd, data) == len(data)
    except OSError:  # the master is gone, or the pipe is full (it never is: the master drains it)
        return False


def report_ready(pid: int) -> None:
    """In a worker: tell the master this worker serves now (the 503 responder steps aside)."""
    _report(f"ready {pid}\n")


def report_failure(pid: int, reason: str) -> bool:
    """In a worker whose start-up failed: hand the reason to the master, which stops the server with it.

    Returns False where the master could not be told (then the worker must exit
    ``EXIT_STARTUP`` itself, gunicorn's own way).
    """
    text = json.dumps(reason)
    if len(text) > _MAX_REASON:
        text = json.dumps(reason[: _MAX_REASON // 2] + " ...")
    return _report(f"failed {pid} {text}\n")


def describe_failure(phase: str, exc: BaseException) -> str:
    """One line for a start-up that raised something other than ``StartupError`` (a compile error...).

    ``phase`` is the worker's state when it failed (``loading model``, ``compiling``, ``loading compiled model``,
    ``warming up``, ``self-test``).
    The first line of the error, and where the rest is; compile errors run to pages.
    """
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    text = f"{phase} failed: {type(exc).__name__}" + (f": {first}" if first else "")
    if len(text) > 600:
        text = text[:600] + " ..."
    hint = "; CLASSIFIER_COMPILE=0 serves the model uncompiled" if "compil" in phase else ""  # or loading it
    return f"{text} (CLASSIFIER_LOG_LEVEL=debug logs the traceback{hint})"


# -- hooks' helpers, master side ---------------------------------------------------------------------------
def guard_halt(server) -> None:
    """Make gunicorn's stop keep the first reason it halts for, instead of crashing on a second one.

    gunicorn's ``halt()`` reaps the workers again; a second worker that failed to boot (exit 3 or 4)
    then raises ``HaltServer`` inside the handler of the first: a chained traceback, exit 1, and
    no ``on_exit`` (so nothing cleaned up). Once halting or stopping, later ``HaltServer``s of
    ``reap_workers`` are dropped; the status is the first one's.
    """
    from gunicorn.errors import HaltServer

    state = master()
    reap = server.reap_workers

    def reap_workers():
        try:
            reap()
        except HaltServer:
            if state.halting or stopping(server):
                return
            state.halting = True
            raise

    server.reap_workers = reap_workers


def stopping(server) -> bool:
    """Whether gunicorn's master is stopping: its ``stop()`` closes the listeners first.

    (With ``reuse_port`` the master holds no listeners at all, so that tells nothing there.)
    """
    return not server.LISTENERS and not server.cfg.reuse_port


def close_in_worker() -> None:
    """In a new worker (``post_fork``): close what only the master reads (the pipe's read end, the responder's sockets)."""
    if _master is None:
        return
    os.close(_master.read_fd)
    if _master.responder is not None:
        _master.responder.close_in_child()


def leave_if_stopped_cleanly() -> None:
    """In a worker's ``worker_exit`` hook, last: a worker that gunicorn is ending with ``SystemExit(0)`` (a
    stop signal or ``max_requests``; its requests drained, its inference thread stopped) flushes its logs and
    leaves with ``os._exit(0)``, skipping the interpreter's teardown of torch and of everything start-up froze
    out of the GC: 1.4 s of CPU per stop, measured with strace on the 2-core box from "Worker exiting" to
    the process's end, which a stop or a rolling restart waited for and the other workers paid for in CPU.
    Nothing in a worker needs its teardown: caches are renamed into place when complete, Prometheus's
    multiprocess files are shared memory (the master marks the worker dead), atexit hooks here are the
    master's. Any other exit (a failed start, an abort, an error) goes gunicorn's way with its status."""
    exc = sys.exc_info()[1]
    if not isinstance(exc, SystemExit) or exc.code not in (0, None):
        return
    _flush_and_exit(0)


def _flush_and_exit(status: int) -> None:
    """Flush every log handler (gunicorn's error log, the JSON access log) and stdout/stderr, then ``os._exit``."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)


def own_temp_dir(prefix: str) -> str:
    """A new folder ``<TMPDIR>/<prefix><pid>-<random>`` for this process, removed when it exits (``remove_at_exit``),
    after removing the folders of this prefix left by processes that died without a stop (SIGKILL: the OOM killer,
    ``kill -9``), each found by the pid in its name no longer running. A pid that runs again (reused) keeps its
    folder: only one that surely ended is removed, never another live server's."""
    parent = tempfile.gettempdir()
    for entry in os.scandir(parent):
        pid = entry.name[len(prefix):].partition("-")[0]
        if entry.name.startswith(prefix) and pid.isdigit() and entry.is_dir(follow_symlinks=False) and \
                not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(entry.path, ignore_errors=True)
    path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    remove_at_exit(path)
    return path


def remove_at_exit(path: str) -> None:
    """Remove folder ``path`` when this process exits, however it exits (short of SIGKILL).

    For the metrics folder the master makes at config time: gunicorn's ``on_exit`` runs only on
    a normal stop, not when it gives up binding or dies on a config error. Workers inherit the
    registration: only the process that registered removes it.
    """
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    _removals.append(remove)


_removals: list[Callable[[], None]] = []


def leave_master_now() -> None:
    """Last in the master's ``on_exit`` (its workers gone, its lines written): leave with gunicorn's status at
    once, skipping the teardown of the torch the master imported (``webapp/preload.py``): 0.4 s idle, ~1 s
    under load, measured from ``on_exit`` to the process's end on the 2-core box, which every stop and
    restart waited for. The status is gunicorn's: 0 for a stop (``halt`` runs in its handler of
    ``StopIteration``/``KeyboardInterrupt``), a ``HaltServer``'s own; any other path is left to gunicorn."""
    exc = sys.exc_info()[1]
    status = 0 if isinstance(exc, (StopIteration, KeyboardInterrupt)) else getattr(exc, "exit_status", None)
    if not isinstance(status, int):
        return
    for remove in _removals:
        remove()
    _flush_and_exit(status)


# gunicorn's control signals whose default action would end (or suspend) a master that is still starting
CONTROL_SIGNALS = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTIN, signal.SIGTTOU)
_held: list[int] | None = None  # signals received while starting, in order; None: not holding


def hold_control_signals() -> None:
    """At the first read of ``gunicorn.conf.py`` (the master, before gunicorn's own handlers): note each
    ``CONTROL_SIGNALS`` received from now on instead of dying of it (``replay_held_signals`` carries them
    out). A signal with a handler already (a SIGHUP re-read of the file: gunicorn's) is left alone. One ignored
    on the way in (``nohup``: SIGHUP) is held too, as gunicorn's handler takes it over once listening anyway."""
    global _held
    for sig in CONTROL_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.SIG_IGN):
            if _held is None:
                _held = []
            signal.signal(sig, lambda signum, _frame: _held.append(signum) if len(_held) < 8 else None)


def replay_held_signals(server) -> list[str]:
    """In ``when_ready`` (gunicorn's handlers installed): send each held signal again to this process,
    in order, for gunicorn to carry out as if it had come now; one line on ``server.log`` each. A repeated
    SIGHUP, SIGUSR1 or SIGUSR2 is sent once (a second reload of the same file does nothing more); each
    SIGTTIN and SIGTTOU counts. Returns their names."""
    global _held
    got, _held, held = list(_held or []), None, []
    for sig in got:
        if sig in (signal.SIGTTIN, signal.SIGTTOU) or sig not in held:
            held.append(sig)
    names = [signal.Signals(sig).name for sig in held]
    for sig, name in zip(held, names):
        server.log.info("%s received while starting: carried out now that the master is listening", name)
        os.kill(os.getpid(), sig)
    return names


def exit_now(status: int, line: str | None = None) -> None:
    """Print ``line`` (if any) to stderr and exit with ``status`` (the cleanup of ``remove_at_exit`` runs)."""
    if line:
        print(line, file=sys.stderr, flush=True)
    sys.exit(status)


def gunicorn_flags_problem(argv: list[str]) -> tuple[str | None, int | None]:
    """gunicorn's command-line arguments ``argv`` (after its program name) tried with gunicorn's own parser and
    validators, on a Config of their own: (the problem to exit 2 with, said as a configuration error, or None;
    the ``-w`` count given, or None). gunicorn applies its flags after reading gunicorn.conf.py and exits 1 on a
    value it refuses (``--timeout -5``); ``-w 0`` starts a master that never starts a worker (tryout25). ``serve --dry-run`` asks
    the same (it said exit 0 where the real start exits 2). A flag argparse cannot parse at all (``--bogus``,
    ``-w abc``) raises ``SystemExit(2)`` from argparse, with its usage line on stderr, as gunicorn itself does."""
    from gunicorn.config import Config

    from gunicorn.util import parse_address

    from .listen import BIND_RULE

    trial, workers = Config(prog="gunicorn"), None
    for name, value in vars(trial.parser().parse_args(argv)).items():
        if value is None or name == "args":
            continue
        try:
            trial.set(name.lower(), value)
        except Exception as exc:  # gunicorn's validators raise ValueError/TypeError with its own words
            flag = next((f for f in trial.settings[name].cli or () if f.startswith("--")), name)
            return f"gunicorn {flag} {value}: {exc}", None
        if name == "workers":
            workers = trial.workers
            if workers < 1:
                return no_workers_problem(workers), workers
        if name == "bind":  # gunicorn reads its forms (fd://N and tcp:// too) but not the port's range: -b
            for address in trial.bind:  # 127.0.0.1:99999 was an OverflowError traceback as it bound (tryout34)
                try:
                    parsed = parse_address(address)
                    if isinstance(parsed, tuple) and not 0 <= parsed[1] < 65536:
                        raise ValueError(f"port {parsed[1]} is not 1 to 65535")
                except (RuntimeError, ValueError) as exc:
                    return f"gunicorn -b {address}: {str(exc).rstrip('.')}; allowed: {BIND_RULE}, or fd://N", None
    return None, workers


def no_workers_problem(workers: int) -> str:
    """The problem with gunicorn's ``-w`` below 1 (said as a configuration error): a master that never starts a
    worker, every request 503 for ever (tryout25)."""
    return (f"gunicorn -w {workers} starts no worker, so nothing would ever answer; give -w 1 "
            f"or more, or leave -w out (the plan picks the count: CLASSIFIER_WORKERS=0)")
