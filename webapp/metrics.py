"""Prometheus metrics at ``GET /metrics`` (``CLASSIFIER_METRICS``; off: the route does not exist, 404).

Under gunicorn every worker is a process of its own, so the metrics use prometheus-client's
multiprocess mode: ``gunicorn.conf.py`` gives the master a fresh ``PROMETHEUS_MULTIPROC_DIR``
before the workers fork, each worker writes its values to its own files there, and a scrape
(answered by whichever worker gets it) adds up the files of all of them; ``child_exit`` marks
a dead worker's live gauges gone. Without that variable (tests, ``flask run``) each app has a
plain registry of its own. prometheus-client picks the mode when it is first imported, from the
environment: this module only reads which one it got.

Recorded here, in the request's greenlet, never on the inference thread (the batcher knows
nothing of Prometheus):

- ``classifier_http_requests_total`` and ``classifier_http_request_duration_seconds``, by
  ``endpoint`` (the route, e.g. ``/api/v1/predict``, a 405 under the route it asked; ``unmatched``
  for a path no route has, so the label's values stay the routes; ``(unparsed)`` for a request gunicorn
  refused before routing, counted only), ``method`` (``other`` for a method HTTP does not define, likewise)
  and ``status``;
- per classified image: ``classifier_queue_wait_seconds``, ``classifier_batch_size`` (the size of
  the batch the image ran in) and ``classifier_inference_seconds`` (that batch's forward pass).
  From the batcher's ``Result`` of each image, which the classifier reports to ``on_outcomes``
  (``contract.ClassifierLike``) for every view, API and page alike;
- gauges, sampled at the end of each request and at each scrape: ``classifier_queue_depth``
  (images waiting, summed over live workers), ``classifier_worker_ready`` (1 per ready worker;
  a ``pid`` label per worker under gunicorn), ``classifier_model_info`` (1, the labels say
  which model, weights, precision, fallback);
- ``classifier_rechecked_images_total``: images whose close call (int8's or bf16's top two under
  ``INT8_RECHECK_PTS`` / ``BF16_RECHECK_PTS`` points apart) ran again in fp32 and were answered from its
  logits; with ``classifier_batch_size_count`` (images classified) it gives the share fp32 answers, which
  sets what int8 or bf16 saves. Counted by the engine on the inference thread (``Engine.rechecked``),
  carried over here at each sample.
"""

from __future__ import annotations

import os
import time
from typing import Iterable

from flask import Flask, Response, current_app, g, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INFERENCE_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)


def multiprocess_mode() -> bool:
    """True when prometheus-client writes values to ``PROMETHEUS_MULTIPROC_DIR`` (set before its import)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


MASTER_ENDPOINT = "(master)"  # the endpoint label of gunicorn's master's own answers (webapp/responder.py)
UNPARSED_ENDPOINT = "(unparsed)"  # that of requests gunicorn refused before routing (webapp/refusals.py)


def http_metrics(registry: CollectorRegistry) -> tuple[Counter, Histogram]:
    """The requests counter (labels endpoint, method, status and ``code``: the error table's code, empty for an
    answer that is not an error) and latency histogram (endpoint, method, status): each worker's (``Metrics``),
    and gunicorn's master's for what it answers while no worker is ready or it stops (``MASTER_ENDPOINT``;
    only these two, so the master never shows up as a worker in the gauges). ``code`` tells the two 429s
    (``overloaded``, ``rate_limited``) and the 400s apart; it takes the table's ~25 values at most."""
    labels = ("endpoint", "method", "status")
    return (Counter("classifier_http_requests", "HTTP requests answered, by route, method, status and error code "
                    f"(empty: not an error; endpoint {MASTER_ENDPOINT}: gunicorn's master's own answers while no "
                    "worker is ready or it stops).", (*labels, "code"), registry=registry),
            Histogram("classifier_http_request_duration_seconds",
                      "Seconds from the request's first hook to its response, by route, method and status.",
                      labels, buckets=LATENCY_BUCKETS, registry=registry))


class Metrics:
    """The metrics of one app; ``app.extensions["metrics"]``."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests, self.latency = http_metrics(r)
        self.queue_wait = Histogram("classifier_queue_wait_seconds",
                                    "Seconds each classified image waited in its worker's queue for a batch.",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.batch_size = Histogram("classifier_batch_size",
                                    "Size of the batch each classified image ran in (one observation per image).",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.inference = Histogram("classifier_inference_seconds",
                                   "Forward-pass seconds of the batch each classified image ran in (one observation "
                                   "per image).", buckets=INFERENCE_BUCKETS, registry=r)
        self.queue_depth = Gauge("classifier_queue_depth", "Images waiting for a batch, summed over live workers "
                                 "(sampled at the end of each request and at each scrape).",
                                 multiprocess_mode="livesum", registry=r)
        self.worker_ready = Gauge("classifier_worker_ready", "1 for a worker that is warmed up, self-tested and "
                                  "serving, else 0 (one sample per live worker, label pid, under gunicorn).",
                                  multiprocess_mode="liveall", registry=r)
        self.model_info = Gauge("classifier_model_info", "The model the workers serve (value 1; the labels say which).",
                                ("model", "requested", "title", "weights", "precision", "compiled", "fallback",
                                 "untrained"), multiprocess_mode="livemax", registry=r)
        self.rechecked = Counter("classifier_rechecked_images", "Images whose close call (int8's or bf16's top two "
                                 "under CLASSIFIER_*_RECHECK_PTS points apart) ran again in fp32 and got its answer.",
                                 registry=r)
        self._model_labels: dict | None = None
        self._rechecked_seen = 0  # the engine's count already added to the counter

    # -- recording ---------------------------------------------------------------------------
    def observe_request(self, endpoint: str, method: str, status: int, seconds: float | None, code: str = "") -> None:
        labels = (endpoint, method, str(status))
        self.requests.labels(*labels, code).inc()
        if seconds is not None:
            self.latency.labels(*labels).observe(seconds)

    def observe_results(self, results: Iterable) -> None:
        """One observation per image from batcher ``Result``s (``queue_ms``, ``inference_ms``, ``batch_size``)."""
        for res in results:
            self.queue_wait.observe(res.queue_ms / 1e3)
            self.inference.observe(res.inference_ms / 1e3)
            self.batch_size.observe(res.batch_size)

    def sample(self, classifier, *, model: bool = True) -> None:
        """Set the gauges from ``classifier`` (this worker's): queue depth, readiness and, with ``model``
        (or until it is known), model info."""
        self.queue_depth.set(classifier.queue_depth)
        self.worker_ready.set(1 if classifier.ready else 0)
        # read once: the inference thread may count on meanwhile; what it adds is carried at the next sample
        count = getattr(getattr(classifier, "engine", None), "rechecked", 0)  # (a remote classifier has no engine)
        if count > self._rechecked_seen:
            self.rechecked.inc(count - self._rechecked_seen)
            self._rechecked_seen = count
        if (model or self._model_labels is None) and classifier.model is not None and "precision" in classifier.describe():
            d = classifier.describe()
            weights = str(d.get("weights", ""))
            labels = {"model": d["name"], "requested": classifier.settings.MODEL, "title": d.get("title", ""),
                      "weights": os.path.basename(weights) or weights, "precision": str(d.get("precision", "")),
                      "compiled": str(d.get("compiled", "")).lower(), "fallback": str(d.get("fallback", False)).lower(),
                      "untrained": str(d.get("untrained", False)).lower()}
            if labels != self._model_labels:
                if self._model_labels is not None:
                    self.model_info.labels(**self._model_labels).set(0)
                self.model_info.labels(**labels).set(1)
                self._model_labels = labels

    # -- exposition --------------------------------------------------------------------------
    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The scrape body and its content type (Prometheus text, or OpenMetrics if ``accept`` asks)."""
        registry = self.registry
        if multiprocess_mode():
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        try:
            encoder, content_type = choose_encoder(accept or "")
        except Exception:  # prometheus-client chokes on some Accept values (version=banana): plain text
            encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
        return encoder(registry), content_type


# HTTP's methods (RFC 9110 and PATCH): any other a client makes up is counted as "other", so that no client
# can add label values (series) to the metrics without bound.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def method_label(method: str) -> str:
    """The ``method`` label of a request: its method if HTTP defines it (``METHODS``), else ``other``."""
    return method if method in METHODS else "other"


def endpoint_label() -> str:
    """The ``endpoint`` label of this request: its route's rule (``/api/v1/predict``); for a method the
    route does not take (405) the same route, found again with one of its methods; ``unmatched`` for a
    path no route has (404), so a scanner's random paths never add label values."""
    if request.url_rule is not None:
        return request.url_rule.rule
    exc = request.routing_exception
    if isinstance(exc, MethodNotAllowed) and exc.valid_methods:
        try:
            rule, _ = current_app.url_map.bind_to_environ(request.environ).match(
                method=sorted(exc.valid_methods)[0], return_rule=True)
            return rule.rule
        except HTTPException:
            pass
    return "unmatched"


def init_metrics(app: Flask, settings) -> Metrics | None:
    """Install the metrics on ``app`` if ``METRICS`` is on: the hooks and ``GET /metrics``."""
    if not settings.METRICS:
        return None
    from .logs import request_started

    metrics = Metrics()
    app.extensions["metrics"] = metrics
    classifier = app.extensions["classifier"]
    classifier.on_outcomes = metrics.observe_results  # exact per-image values, from every view (API and page)
    from . import refusals  # requests gunicorn refused before the app saw them (a header it cannot parse, 414, 431)

    refusals.on_refusal[:] = [lambda method, status, code: metrics.observe_request(
        UNPARSED_ENDPOINT, method_label(method or ""), status, None, code)]

    @app.after_request
    def count_request(resp):
        try:
            start = request_started()
            metrics.observe_request(endpoint_label(), method_label(request.method), resp.status_code,
                                    None if start is None else time.perf_counter() - start, g.get("error_code", ""))
            metrics.sample(classifier, model=False)
        except Exception:  # never fail a request over a metric
            app.logger.exception("cannot record the request's metrics")
        return resp

    def scrape():
        metrics.sample(current_app.extensions["classifier"])
        body, content_type = metrics.exposition(request.headers.get("Accept"))
        return Response(body, content_type=content_type, headers={"Cache-Control": "no-store"})

    app.add_url_rule("/metrics", "metrics", scrape, methods=["GET"])
    return metrics

