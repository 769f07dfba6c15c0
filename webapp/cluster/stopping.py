"""How ``serve --cluster`` stops: by a deadline, with the Ray it started shut down and nothing left running.

``ray.init()`` without an address starts Ray's node processes on this host as children of the
command (GCS, raylet, dashboard, log and autoscaler monitors: Ray blocks SIGINT in them and ties
them to the command's life), and the raylet starts the workers (Serve's controller, proxy and
replicas) in process groups of their own. How a stop goes, by where the signal lands:

- On the command alone (``kill PID``, Ctrl-C): Serve drains (``serve.delete``: each replica answers
  what it holds, within its ``graceful_shutdown_timeout_s``), then ``ray.shutdown`` stops the node.
- On the command's process group (``timeout(1)``, ``kill -TERM -PGID``, process managers that stop a
  group): it would reach the node processes too, so ``serve --cluster`` runs this driver in a
  session of its own and passes the signal on (``webapp/cli/supervise.py``): the same as alone.
- On every process of the service (systemd's default ``KillMode=control-group`` signals the whole
  cgroup, sessions notwithstanding): Ray's processes are already on their way out, and waiting on
  Serve would hang (the driver retries the GCS for 60 s, logging ``Failed to push error to driver``,
  then aborts). ``LocalRay.stopping`` sees the node's processes exit, and the stop skips to
  ``ray.shutdown``; requests in flight are lost, as they would be with any server whose processes
  are all killed at once.

Whatever happened, the command then ends what is left of its process tree. It is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so workers orphaned by a raylet that died are re-parented to it and
found here, instead of running on under init.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time

# isort: off
import ray  # first: Ray ships psutil (ray/thirdparty_files) and puts it on sys.path when imported
import psutil
from ray import serve
# isort: on

from ..concurrency import call_with_timeout

log = logging.getLogger(__name__)

# Of a stop's time (``serve_forever``'s ``stop_timeout_s``), what the drain may not use: ray.shutdown
# (7 s measured on a loaded 2-core host after its processes were SIGTERMed) and ending leftovers.
AFTER_DRAIN_S = 15.0
LEFTOVER_GRACE_S = 3.0  # SIGTERM to SIGKILL for a process left in the tree (s)
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def alive(proc: psutil.Process) -> bool:
    """True while ``proc`` runs (a zombie has exited: only its exit status is left to collect)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LocalRay:
    """The Ray instance ``ray.init`` started on this host, seen from the command (the driver) that started it.

    ``node``: its node processes, this process's children (GCS, raylet, dashboard, monitors).
    """

    def __init__(self, node: list[psutil.Process]):
        self.node = node
        self._watched: list[psutil.Process] = node

    @staticmethod
    def adopt_orphans() -> bool:
        """Make this process a child subreaper, so that descendants whose parent dies are re-parented here.

        Call it while Ray's processes run (re-parenting happens when a parent dies). Returns False
        where the kernel has no such thing (not Linux):
        ``end_leftovers`` then finds only what is still under a living Ray process.
        """
        if not sys.platform.startswith("linux"):
            return False
        try:
            return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError):
            return False

    @classmethod
    def started_here(cls) -> LocalRay:
        """Right after ``ray.init`` started Ray here: its node processes are this process's only children."""
        return cls(psutil.Process().children())

    def watch(self) -> None:
        """Note which node processes run now; call it while serving, a few times a second.

        A signal to every process ends some node processes within milliseconds, before the stop could
        look: ``stopping`` compares with the last look before it. One that died long before (a crashed
        dashboard) is then no sign of a stop.
        """
        self._watched = [p for p in self.node if alive(p)]

    def stopping(self) -> bool:
        """True once a node process that ran at the last ``watch`` has exited: Ray is going down under us."""
        return any(not alive(p) for p in self._watched)

    def leftovers(self) -> list[psutil.Process]:
        """Every process still running in this process's tree (node processes, workers, adopted orphans)."""
        try:
            return [p for p in psutil.Process().children(recursive=True) if alive(p)]
        except psutil.Error:
            return []

    def end_leftovers(self, grace_s: float = LEFTOVER_GRACE_S) -> list[str]:
        """SIGTERM what is left in the tree, SIGKILL what is still there after ``grace_s`` s; collect exits.

        Returns ``"name (pid)"`` of each process found, for the log; ``[]`` when the tree was empty.
        """
        left = self.leftovers()
        names = []
        for p in left:
            try:
                names.append(f"{p.name()} ({p.pid})")
                p.terminate()
            except psutil.Error:
                pass
        _, still = psutil.wait_procs(left, timeout=grace_s)
        for p in still:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(still, timeout=1.0)
        for p in psutil.Process().children():  # adopted orphans that exited: collect them (no zombies)
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    p.wait(0)
            except psutil.Error:
                pass
        return names


def wait_for_ingress(app_name: str, *, until: float, give_up=None, poll_s: float = 0.2) -> bool:
    """Wait until the app's HTTP replica has no request in progress (``Ingress.in_flight``), at most until
    ``until`` (``time.monotonic()``) or ``give_up()``; True if it got there. Never raises: an app or replica
    that cannot be asked is taken as having nothing in flight."""
    t0, said = time.monotonic(), False
    try:
        handle = serve.get_app_handle(app_name)
        while time.monotonic() < until and not (give_up and give_up()):
            n = handle.in_flight.remote().result(timeout_s=max(0.1, min(2.0, until - time.monotonic())))
            if n == 0:
                if said:
                    log.info("stopping: the HTTP replicas finished in %.1f s", time.monotonic() - t0)
                return True
            if not said:
                log.info("stopping: %d requests in the HTTP replicas, letting them finish first", n)
                said = True
            time.sleep(poll_s)
    except Exception as exc:  # the controller or the replica is gone, or no such app: nothing to wait for
        log.info("stopping: not waiting for the HTTP replicas (%s)", exc)
        return True
    return False


def refuse_ray_init(why: str) -> None:
    """From now on ``ray.init`` in this process raises ``RuntimeError`` (naming ``why``) instead of starting a Ray.

    A stop that gives up its drain leaves the drain's thread running (``call_with_timeout``). Once
    ``ray.shutdown`` has run, that thread's next Serve call finds Ray not initialized, and Serve calls
    ``ray.init()`` (``ray.serve.context._connect``; Ray's auto-init of its public APIs does the same):
    a new local Ray started mid-stop, which the command could not then leave in time (seen in CI:
    killed after 60.6 s, against a 50 s bound). Both look ``ray.init`` up on the module at each call,
    so replacing it there reaches them; the thread's call then fails, and its error is dropped with it.
    """
    def refused(*args, **kwargs):
        raise RuntimeError(f"ray.init refused: {why}")

    ray.init = refused


def shut_down(app_name: str, *, local: LocalRay | None, deadline: float) -> bool:
    """Remove ``app_name`` (its replicas drain), then leave Ray; with ``local``, shut that Ray down.

    ``deadline``: ``time.monotonic()`` by which this returns. The drain gets all but ``AFTER_DRAIN_S``
    of it, and is given up early when ``local`` is going down under us (``LocalRay.stopping``).
    Afterwards ``ray.init`` refuses in this process (``refuse_ray_init``): the command is ending.
    Never raises: what went wrong is logged. Returns False only when ``ray.shutdown`` did not
    return in time (this process should then exit at once, without Ray's exit hooks, which would
    wait on it again).
    """
    give_up = local.stopping if local is not None else None

    def drain() -> None:
        # Serve stops every deployment of the app at once: the model replicas go as soon as they have nothing
        # on hand, while an HTTP replica may still be reading an upload it will then forward (seen on a 2-core
        # Zen 3: two of four 12 MP requests in flight waited for their 504). So the HTTP replicas finish first.
        wait_for_ingress(app_name, until=deadline - AFTER_DRAIN_S, give_up=give_up)
        serve.delete(app_name)  # replicas drain first (graceful_shutdown_timeout_s) ...
        if local is not None:
            serve.shutdown()  # ... then the proxy and controller go, with the Ray started here

    drained, why = False, "it took too long"
    if not (give_up and give_up()):
        try:
            drained, _ = call_with_timeout(drain, deadline - AFTER_DRAIN_S - time.monotonic(), give_up=give_up)
        except Exception as exc:  # Serve's controller died: nothing left to drain
            why = f"removing {app_name!r} failed: {exc}"
    if not drained:
        if local is not None and local.stopping():
            why = "Ray's own processes got the signal too (signal only the command, or its process group, to drain)"
        log.warning("requests in flight were not all answered: %s", why)
    refuse_ray_init("this command is stopping")  # before ray.shutdown: a drain given up runs on (see there)
    try:
        done, _ = call_with_timeout(lambda: ray.shutdown(wait_for_processes=local is not None),
                                    max(1.0, deadline - LEFTOVER_GRACE_S - 1.0 - time.monotonic()))
    except Exception as exc:
        log.warning("ray.shutdown failed: %s", exc)
        done = True  # it returned
    if not done:
        log.error("ray.shutdown did not return in time; ending Ray's processes")
    if local is not None:
        ended = local.end_leftovers(max(0.5, min(LEFTOVER_GRACE_S, deadline - 1.0 - time.monotonic())))
        if ended:
            log.info("ended %d processes Ray left running: %s", len(ended), ", ".join(ended))
    return done
