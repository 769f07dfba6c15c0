"""Deploying on Ray: the Serve application (``build_app``, the ``import_path`` of deploy/ray-serve.yaml),
joining or starting Ray, and ``serve --cluster``'s foreground loop."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import ray
from ray import serve

from .config import load_values, replica_settings, startup_failure
from .ingress import Ingress
from .replica import ModelReplica

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "classifier"
# Shipped to the cluster as the job's working_dir (Ray also skips what .gitignore lists).
WORKING_DIR_EXCLUDES = [".git", ".venv", "bench/results", "tests", "**/__pycache__"]


def build_app(args: dict):
    """The Ray Serve application builder: ``import_path: webapp.cluster:build_app`` in a Serve config.

    ``args``: the config's ``args``, setting names without the prefix (``{"MODEL":
    "efficientnet_lite0", "CLUSTER_REPLICAS": 2}``), over the ``CLASSIFIER_*`` variables where
    the application is built (a ``runtime_env``'s ``env_vars`` included).

    :raises SettingsError: a bad setting.
    """
    return application(replica_settings(args))


def application(values: dict):
    """HTTP replicas in front of model replicas, with options from ``values`` (``replica_settings``)."""
    s = load_values(values)
    model_options: dict = {
        "ray_actor_options": {"num_cpus": values["THREADS"]},
        "max_ongoing_requests": s.CLUSTER_MAX_ONGOING_REQUESTS,
        "max_queued_requests": s.CLUSTER_MAX_QUEUED_REQUESTS,
        "graceful_shutdown_timeout_s": s.REQUEST_TIMEOUT_S,
    }
    if s.CLUSTER_REPLICAS:
        model_options["num_replicas"] = s.CLUSTER_REPLICAS
        most = s.CLUSTER_REPLICAS
    else:  # a replica counts as busy once a full batch is in flight
        model_options["autoscaling_config"] = {"min_replicas": s.CLUSTER_MIN_REPLICAS,
                                               "max_replicas": s.CLUSTER_MAX_REPLICAS,
                                               "target_ongoing_requests": s.MAX_BATCH_SIZE}
        most = s.CLUSTER_MAX_REPLICAS
    if s.CLUSTER_MAX_ONGOING_REQUESTS < s.MAX_BATCH_SIZE:
        log.warning("CLASSIFIER_CLUSTER_MAX_ONGOING_REQUESTS=%d is below CLASSIFIER_MAX_BATCH_SIZE=%d: batches "
                    "cannot fill", s.CLUSTER_MAX_ONGOING_REQUESTS, s.MAX_BATCH_SIZE)
    model = ModelReplica.options(**model_options).bind(values)
    # Every request the model replicas may hold or queue for this HTTP replica has a thread to wait
    # in, and as many again answer the overflow at once with the JSON 429 (not the proxy's text one).
    capacity = 2 * (most * s.CLUSTER_MAX_ONGOING_REQUESTS + s.CLUSTER_MAX_QUEUED_REQUESTS)
    return Ingress.options(
        num_replicas=s.CLUSTER_INGRESS_REPLICAS, ray_actor_options={"num_cpus": 0},
        # The proxy's queue also holds a burst's requests for the moment before each is routed:
        # as deep as the HTTP replicas' threads, so only a real overflow gets the proxy's 429.
        max_ongoing_requests=capacity, max_queued_requests=capacity * s.CLUSTER_INGRESS_REPLICAS,
        backpressure_config={"status_code": 429, "retry_after_s": 1},
        graceful_shutdown_timeout_s=s.REQUEST_TIMEOUT_S + 10,  # SIGTERM: answer what is in flight
    ).bind(model, values, capacity)


def connect(address: str | None = None, *, log_to_driver: bool = True) -> bool:
    """``ray.init``: join ``address`` (or ``$RAY_ADDRESS``), else start a local Ray on this host.

    The project's code travels as the job's ``working_dir``, so nodes need only its requirements.
    Returns True when a cluster was joined, False when a local one was started.

    :raises ConnectionError: nothing accepts a TCP connection at the address within 5 s.
    """
    target = address or os.environ.get("RAY_ADDRESS")
    joined = bool(target)
    if joined and target != "auto":  # Ray itself retries an address where nothing listens for minutes
        host, _, port = target.split("://", 1)[-1].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise ConnectionError(f"no Ray cluster answers at {target} (--address / RAY_ADDRESS): {exc}") from None
    if not ray.is_initialized():  # "local": a new Ray even where `ray start` left one this would join
        ray.init(address=address or (None if joined else "local"), log_to_driver=log_to_driver,
                 runtime_env={"working_dir": str(ROOT), "excludes": WORKING_DIR_EXCLUDES})
    return joined


def serve_forever(values: dict, *, address: str | None, host: str, port: int, stop_timeout_s: float,
                  parent: int | None = None) -> bool:
    """Deploy the application as ``classifier`` at ``/`` and keep it until SIGINT or SIGTERM.

    On a cluster that was joined only the application is deleted at the end; a local Ray started
    here is shut down with it, and nothing it ran is left running (``stopping.shut_down``).
    ``stop_timeout_s``: from the signal to the return, at most (s). ``parent``: the pid of the
    process that runs this one in a session of its own (``webapp/cli/supervise.py``); its death
    stops this one as a signal would. Returns False when Ray could not be shut down in time (the
    caller should exit at once: Ray's exit hooks would wait on it again).

    :raises StartupError: the model replicas cannot start (the replica's message).
    :raises RuntimeError: the deployment failed otherwise.
    """
    import signal
    import time

    from .stopping import LocalRay, shut_down

    joined = connect(address)
    local = None
    if not joined:  # workers orphaned by a raylet that dies come to us, to be ended
        LocalRay.adopt_orphans()
        local = LocalRay.started_here()
    # After ray.init, which installs its own fatal-signal handler in this process: ours must win. It only
    # appends: a lock taken in a handler (Event.set) deadlocks when the signal lands while this thread holds it.
    signals: list[float] = []  # when each came (time.monotonic()): the stop's deadline counts from the first
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _signum, _frame: signals.append(time.monotonic()))
    stopped_at = None
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(application(values), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:  # the deployment failed: say why in one line if a replica said it
            status = serve.status().applications.get(APP_NAME)
            messages = [d.message for d in status.deployments.values()] if status else []
            raise startup_failure("\n".join([*messages, str(exc)])) or exc from None
        if not signals:
            log.info("serving on http://%s:%d (Ray Serve application %r); Ctrl-C stops it", host, port, APP_NAME)
        while not signals:
            if parent is not None and os.getppid() != parent:
                log.warning("the command that started this one is gone: stopping")
                break
            if local is not None:
                local.watch()
            time.sleep(0.2)
        stopped_at = signals[0] if signals else time.monotonic()
        log.info("stopping: answering the requests in flight, then removing %r (%.0f s at most)", APP_NAME,
                 stop_timeout_s)
    finally:
        if stopped_at is None:  # start-up failed or was interrupted
            stopped_at = time.monotonic()
        clean = shut_down(APP_NAME, local=local, deadline=stopped_at + stop_timeout_s)
    return clean
