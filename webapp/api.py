"""The JSON API: ``POST /api/v1/predict``, ``GET /healthz`` (liveness) and ``GET /readyz`` (readiness)."""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from .uploads import parse_topk, read_uploads

bp = Blueprint("api", __name__)


def _classifier():
    return current_app.extensions["classifier"]


@bp.post("/api/v1/predict")
def predict():
    """Classify the uploaded image(s); answer ``{"model", "results", "timing_ms"}`` (see README)."""
    clf = _classifier()
    topk = parse_topk(request.args.get("topk"), clf.settings.TOP_K)
    uploads = read_uploads(request, max_files=clf.settings.MAX_FILES)
    return jsonify(clf.classify(uploads, topk=topk))


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
