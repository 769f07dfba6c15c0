"""A helper command run to an end, bounded in time: past its time, its whole process tree stops, and nothing
it wrote to its temporary folder is left behind.

Why: a worker builds its AOTInductor packages in a child (``python -m webapp warm``, ``startup.build_in_child``),
and that child runs the C++ compiler (``g++`` -> ``cc1plus`` -> ``as``), each its own process.
``subprocess.run(timeout=...)`` kills only the child: the compilers it started were reparented and ran on,
after the start had failed and the server had exited, writing their ``cc*.s`` files into ``TMPDIR`` (seen in a
CI run: one left in the test's temporary folder). So the tree is frozen first (``SIGSTOP``, repeated until no
new process appears, so nothing forks while it is counted), then asked to end (``SIGTERM``: gcc's driver deletes
its temporary files on it) and, after ``GRACE_S``, killed. The child also gets a ``TMPDIR`` of its own, removed
when it has ended, so whatever a killed compiler could not delete goes too. A worker stopped while it starts
leaves with ``os._exit``, which runs no cleanup: ``stop_all`` ends whatever runs below it first (the other
worker of a failed cold start had just started its own compile child, which ran on).

A parent that is SIGKILLed (the OOM killer, gunicorn's timeout kill of a worker) runs nothing at all: its child
would compile on for a minute, reparented. So the child asks the kernel for ``SIGTERM`` when its parent dies
(``prctl(PR_SET_PDEATHSIG)``, ``bounded_child``), and on it ends its own tree and removes its ``TMPDIR``. A gunicorn
worker asks the same of its master (``gunicorn.conf.py``'s ``post_fork``): a master SIGKILLed while its workers
compiled left them compiling on for ~45 s; now each stops as on the master's own SIGTERM.

Linux only (``/proc``, ``prctl``), as the service is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from .concurrency import blocking_sleep

PARENT_ENV = "WEBAPP_BOUNDED_PARENT"  # run_bounded's pid, in its child's environment (read by bounded_child)
TEMP_PREFIX = "classifier-child-"  # of the private TMPDIR run_bounded makes for its child
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
GRACE_S = 3.0  # seconds the stopped tree has to end on SIGTERM before SIGKILL (gcc removes its files in ms)
_TEMPS: set[str] = set()  # the TMPDIR folders of the run_bounded calls under way (for stop_all)


def _state(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of process ``pid`` from ``/proc/<pid>/stat`` (state ``Z``: a zombie, it has ended);
    None where it is gone or cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name may hold spaces and ')': the fields follow its last ')'
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...), read from ``/proc/*/stat``;
    ``[]`` where there are none or ``/proc`` cannot be read."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (found := _state(int(entry.name))) and found[0] != "Z":
            parents.setdefault(found[1], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # gone (ProcessLookupError), or the pid is now another user's process
            pass


def _running(pid: int) -> bool:
    """Neither gone nor a zombie (a zombie has ended; its parent, gone or not ours, reaps it)."""
    found = _state(pid)
    return found is not None and found[0] != "Z"


def _end(scan: Callable[[], list[int]], grace_s: float) -> None:
    """End the processes ``scan()`` lists: frozen (``SIGSTOP``, rescanning until no new one appears, so none starts
    another while they are counted), then ``SIGTERM`` (``SIGCONT``: a stopped process acts on it only once it runs
    again), then ``SIGKILL`` to those still running (``_running``) after ``grace_s`` seconds, waited for until gone."""
    tree = scan()
    for _ in range(10):  # each round freezes what it finds; a tree that still grows after 10 is killed as it is
        _signal(tree, signal.SIGSTOP)
        grown = [pid for pid in scan() if pid not in tree]
        if not grown:
            break
        tree += grown
    _signal(tree, signal.SIGTERM)
    _signal(tree, signal.SIGCONT)
    for signum in (signal.SIGKILL, None):
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(pid) for pid in tree):
            blocking_sleep(0.02)  # not gevent's: stop_all may run in the hub (a signal handler's), which cannot yield
        if signum:
            _signal(tree, signum)


def stop_tree(proc: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """End ``proc`` and every process below it (``_end``), and reap ``proc``."""
    _end(lambda: [proc.pid] + descendants(proc.pid), grace_s)  # proc too: ended once a zombie
    proc.wait()


def run_bounded(cmd: list[str], *, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` with ``env`` and a private ``TMPDIR`` (a new folder in ``env``'s), its stdout and stderr captured
    as text.

    :returns: the finished process (any exit status; the caller judges it).
    :raises subprocess.TimeoutExpired: it ran past ``timeout_s`` seconds; by then its whole process tree has ended
        (``stop_tree``) and its ``TMPDIR`` is removed.
    :raises OSError: it could not be started.
    """
    parent = env.get("TMPDIR") or None  # under the folder the child would have used (else Python's default)
    temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent)
    _TEMPS.add(temp)  # before the fork: a stop_all while Popen waits for the exec still finds the folder
    try:
        proc = subprocess.Popen(cmd, env={**env, "TMPDIR": temp, PARENT_ENV: str(os.getpid())},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:  # past its time, or this process is being stopped (SystemExit): no orphans
            stop_tree(proc)
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()  # not read to their end: a process that left the tree may still hold them open
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    finally:
        # Removed before it leaves _TEMPS: a stop_all (then os._exit) at any moment finds every folder still there
        # (discarded first, a folder the exiting process had no time to remove was left: a test caught it 1 in 5).
        shutil.rmtree(temp, ignore_errors=True)
        _TEMPS.discard(temp)


def stop_all(grace_s: float = GRACE_S) -> None:
    """End every process below this one (``_end``) and remove the ``TMPDIR`` folders of the ``run_bounded`` calls
    under way: for a process about to leave with ``os._exit`` (a gunicorn worker stopped while it starts,
    ``worker.leave_before_ready``), which runs no ``finally`` of the call waiting on its child. Without it the
    other workers of a failed cold start, each waiting on or starting its compile child, left that child (and its
    compilers) running after the server had exited. Every descendant, not only the children ``run_bounded``
    knows: one stopped while ``Popen`` still waits for the exec is not known yet, and a compile in the process
    itself has inductor's compile workers."""
    _end(lambda: descendants(os.getpid()), grace_s)
    for temp in list(_TEMPS):
        shutil.rmtree(temp, ignore_errors=True)
        _TEMPS.discard(temp)


def signal_on_parent_death(parent: int, signum: int = signal.SIGTERM) -> bool:
    """Have the kernel send this process ``signum`` when its parent (pid ``parent``) dies, however it dies (SIGKILL
    included: ``prctl(PR_SET_PDEATHSIG)``, kept across exec). Precisely: when the parent's thread that forked this
    process ends; the callers' parents fork from a thread that lives as long as the child (gunicorn's master's
    main thread; ``run_bounded``'s caller, which waits on it). A parent already gone (died before this call) gets
    ``signum`` sent now. False where it cannot be asked (not Linux, no libc): nothing changes then."""
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # died between our fork and the prctl: no signal will come
        os.kill(os.getpid(), signum)
    return True


def bounded_child() -> bool:
    """In a command ``run_bounded`` started (``PARENT_ENV`` set; else nothing and False): if the parent dies, even
    SIGKILLed, this process ends its whole tree (``stop_all``), removes its private ``TMPDIR`` and exits 143; so it
    does on any SIGTERM (``stop_tree``'s too). Call it first thing (``python -m webapp warm`` does)."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit():
        return False
    temp = os.environ.get("TMPDIR", "")

    def leave(signum, _frame):
        try:
            stop_all()  # the compilers and inductor's compile workers below this process
            if Path(temp).name.startswith(TEMP_PREFIX):  # run_bounded's, which its dead parent cannot remove
                shutil.rmtree(temp, ignore_errors=True)
        finally:
            os._exit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    return signal_on_parent_death(int(parent))
