"""Ray Serve HTTP replicas: this very Flask app (``create_app``) run by a2wsgi, over a ``RemoteClassifier``
that forwards each upload to a model replica. Routes, forms, JSON, errors, the token and the page
are therefore the same as under gunicorn."""

from __future__ import annotations

import logging
import math
import os
import time

from ray import serve

from ..concurrency import Primitives
from ..errors import InferenceTimeout, NotReady, Overloaded
from ..errors import from_dict as error_from_dict
from .config import load_values, replica_id

log = logging.getLogger(__name__)


class RemoteClassifier:
    """What the Flask app calls ``classifier`` on an HTTP replica: forwards to the model replicas.

    Implements ``contract.ClassifierLike``, what the views use. Runs on a2wsgi's real OS threads,
    where a blocking ``DeploymentHandle`` ``result()`` is allowed. ``/metrics`` is off on a cluster
    (Ray exports its own), so ``on_outcomes`` is never called and ``queue_depth`` is 0.
    """

    on_outcomes = None
    queue_depth = 0

    def __init__(self, handle, settings):
        self.handle = handle
        self.settings = settings
        self._model: dict | None = None
        self._health: tuple[float, dict | None, str] = (0.0, None, "starting")
        # Recent model call time, s: what Retry-After says. Updated from several threads without a
        # lock: a lost update only nudges an estimate.
        self.ewma_s = 0.0

    def classify(self, uploads: list, *, topk: int, keep_images: bool = False) -> dict:
        """Send one request's uploads to a model replica and return its answer (see ``ModelReplica.classify``).

        :raises ServiceError: the replica's error as its own class; ``Overloaded`` (429, with
            ``Retry-After``) when every replica is busy and this replica's queue is full;
            ``NotReady`` (503) when no replica can take it; ``InferenceTimeout`` (504).
        """
        from flask import g
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        t0 = time.monotonic()
        response = self.handle.classify.remote(uploads, topk, keep_images)
        try:
            reply = response.result(timeout_s=self.settings.REQUEST_TIMEOUT_S + 5)
        except BackPressureError:
            wait = max(1, math.ceil(self.ewma_s))
            raise Overloaded(f"server busy: every model replica is full and {self.settings.CLUSTER_MAX_QUEUED_REQUESTS} "
                             f"requests are queued; try again in {wait} s", headers={"Retry-After": str(wait)}) from None
        except TimeoutError:
            response.cancel()
            raise InferenceTimeout.after(self.settings.REQUEST_TIMEOUT_S, "cluster") from None
        except (DeploymentUnavailableError, RayActorError) as exc:
            log.warning("no model replica could answer: %r", exc)
            raise NotReady("no model replica could take the request (starting, failed or restarting); "
                           "try again shortly", headers={"Retry-After": "5"}) from None
        took = time.monotonic() - t0
        self.ewma_s = took if not self.ewma_s else 0.8 * self.ewma_s + 0.2 * took
        g.served_by = reply.get("served_by", "")
        if "error" in reply:
            raise error_from_dict(reply["error"], reply.get("headers"))
        self._model = reply["answer"]["model"]
        return reply["answer"]

    def _probe(self) -> tuple[dict | None, str]:
        """One model replica's health (cached 1 s), or None and why not."""
        now = time.monotonic()
        when, health, why = self._health
        if now - when < 1.0:
            return health, why
        try:
            health, why = self.handle.health.remote().result(timeout_s=5), "ready"
            self._model = health["model"]
        except Exception as exc:  # no replica yet, all failed, or busy past the timeout
            health, why = None, f"no model replica answered: {type(exc).__name__}"
        self._health = (now, health, why)
        return health, why

    def admit(self, environ=None, n: int = 1) -> None:
        """Refuse before the body is read while no model replica has answered yet (503, start-up).

        Once one has, a busy or slow health probe must not turn a burst into 503s (probes queue
        behind the requests of a full replica): from then on ``classify``'s own errors decide, and
        queue room is Ray's to judge (``Overloaded``). ``environ`` and ``n`` are taken for
        ``contract.ClassifierLike`` and not used (no time prediction on a cluster).

        :raises NotReady: no model replica has answered yet and none answers a health probe now.
        """
        if self._model is None and not self.ready:
            raise NotReady("no model replica could take the request (starting, failed or restarting); "
                           "try again shortly", headers={"Retry-After": "5"})

    @property
    def ready(self) -> bool:
        """True while at least one model replica answers."""
        return self._probe()[0] is not None

    @property
    def status(self) -> str:
        """``ready``, or why no model replica answers."""
        return self._probe()[1]

    @property
    def self_test(self) -> dict | None:
        """The self-test of the replica that last answered a health probe."""
        health = self._probe()[0]
        return health["self_test"] if health else None

    @property
    def model(self) -> dict | None:
        """The served model's description once a replica has given it, else None."""
        if self._model is None:
            self._probe()
        return self._model

    def describe(self) -> dict:
        """The answers' ``model`` object, as a model replica gives it."""
        return self.model or {"name": self.settings.MODEL, "note": self.status}

    def health(self) -> dict:
        """``/healthz``: one model replica's health, plus this HTTP replica's pid and id under ``ingress``."""
        health, why = self._probe()
        ingress = {"pid": os.getpid(), "replica": replica_id()}
        if health is None:
            return {"status": "ok", "ready": False, "state": why, "model": self.describe(), "ingress": ingress}
        return {**health, "ingress": ingress}


@serve.deployment(name="HTTP")
@serve.ingress()
class Ingress:
    """An HTTP replica: the Flask app (``create_app``) over a ``RemoteClassifier``, served by a2wsgi.

    ``capacity`` is the number of requests it works on at once (a2wsgi threads, each waiting for a
    model replica). ``/metrics`` is off here: Ray exports its own metrics per node.
    """

    def __init__(self, model, values: dict, capacity: int):
        self.settings = load_values({**values, "METRICS": False})
        self.remote = RemoteClassifier(model, self.settings)
        self.capacity = capacity
        self.counter = InFlight()

    def in_flight(self) -> int:
        """Requests this HTTP replica is working on now (``stopping.shut_down`` waits for 0 before removing
        the app: Ray Serve stops the model replicas alongside this one, and a request still reading its
        upload here when they went would wait for its 504)."""
        return self.counter.n

    def __serve_build_asgi_app__(self):
        from a2wsgi import WSGIMiddleware
        from flask import request
        from ray.exceptions import TaskCancelledError

        from .. import create_app

        app = create_app(dict(self.settings), classifier=self.remote)

        @app.errorhandler(TaskCancelledError)
        def client_gone(exc):  # the client hung up mid-request and Ray cancelled it: nothing to answer
            log.info("client went away during %s %s", request.method, request.path)
            return "", 499

        return WSGIMiddleware(behind_ray_proxy(app, self.counter), workers=self.capacity)


class InFlight:
    """A count of requests in progress (``n``), changed under a lock from a2wsgi's threads."""

    def __init__(self):
        self.n = 0
        self._lock = Primitives.for_this_process().make_lock()

    def add(self, k: int) -> None:
        """Count ``k`` (+1 or -1) more requests in progress."""
        with self._lock:
            self.n += k


def behind_ray_proxy(app, counter: InFlight | None = None):
    """Fit the Flask ``app`` to Ray's proxy and a2wsgi (wraps its ``wsgi_app``; returns ``app``).

    - a2wsgi's ``wsgi.input`` ends where the HTTP body ends, so a chunked upload (no
      Content-Length) may be read to its end: say so (``wsgi.input_terminated``), as gunicorn does,
      else Werkzeug reads such a body as empty.
    - Ray's proxy sets ``X-Request-ID`` on every answer itself (the client's id, or its own, the
      one in Ray's logs) and hands it to the app: the app's copy would be a second header.
    """
    inner = app.wsgi_app

    def wsgi(environ, start_response):
        environ["wsgi.input_terminated"] = True

        def start(status, headers, exc_info=None):
            return start_response(status, [(k, v) for k, v in headers if k.lower() != "x-request-id"], exc_info)

        if counter is None:
            return inner(environ, start)
        counter.add(1)
        try:  # the answer is made (and read from the model replica) inside this call: Flask buffers it
            return inner(environ, start)
        finally:
            counter.add(-1)

    app.wsgi_app = wsgi
    return app
