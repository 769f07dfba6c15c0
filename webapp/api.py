"""The JSON API: ``POST /api/v1/predict``, ``GET /api/v1/models``, ``GET /healthz`` (liveness),
``GET /readyz`` (readiness) and ``GET /openapi.json`` (the OpenAPI 3 document of all of them)."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from .headers import check_headers
from .uploads import read_uploads, request_topk

bp = Blueprint("api", __name__)


def _classifier():
    return current_app.extensions["classifier"]


@bp.post("/api/v1/predict")
def predict():
    """Classify the uploaded image(s); answer ``{"model", "results", "timing_ms"}`` (see README)."""
    clf = _classifier()
    check_headers(request)  # what the headers decide (411, 415, 400) is answered as such, never as a 429
    clf.admit(request.environ)  # not ready, or too late to answer in time: answered before the body is read
    topk = request_topk(request, clf.settings.TOP_K)
    uploads = read_uploads(request, max_files=clf.settings.MAX_FILES)
    return jsonify(clf.classify(uploads, topk=topk))


@bp.get("/api/v1/models")
def models():
    """Every model ``CLASSIFIER_MODEL`` can name, with categories, input size and precision; the serving
    one marked ``serving: true`` with its weights and fallback note. Describes specs, builds nothing."""
    from . import catalog

    clf = _classifier()
    serving = clf.describe() if clf.model is not None else None
    entries = []
    for m in catalog.MODELS:
        entry = {"name": m.name, "title": m.title, "description": m.description,
                 "categories": m.categories, "input_size": m.input_size, "send_short_side": m.send_short_side,
                 "send_resample": m.send_resample,
                 "precision": serving.get("precision", clf.settings.PRECISION) if serving else clf.settings.PRECISION,
                 "serving": False}
        if serving is not None and serving["name"] == m.name:
            entry.update({k: serving[k] for k in ("title", "categories", "input_size", "precision", "weights",
                                                  "untrained", "fallback", "compiled", "note") if k in serving})
            entry["serving"] = True
        entries.append(entry)
    return jsonify({"requested": clf.settings.MODEL, "serving": serving["name"] if serving else None,
                    "models": entries})


@bp.get("/healthz")
def healthz():
    """200 while the worker process is alive, with its pid, cores, threads, model and precision."""
    return jsonify(_classifier().health())


@bp.get("/readyz")
def readyz():
    """200 once warm-up and self-test passed and the inference thread runs; else 503 with the reason."""
    clf = _classifier()
    body = {"ready": clf.ready, "state": clf.status, "model": clf.describe(), "self_test": clf.self_test}
    return jsonify(body), 200 if clf.ready else 503


@bp.get("/openapi.json")
def openapi():
    """The OpenAPI 3 document of this server's API (its limits and options as configured)."""
    spec = current_app.extensions.get("openapi")
    if spec is None:
        from .openapi import build_spec

        spec = current_app.extensions["openapi"] = build_spec(current_app.extensions["settings"])
    return jsonify(spec)
