"""The OpenAPI 3 document of the JSON API, served at ``GET /openapi.json``.

Built from the settings, so the limits it states (files per request, upload bytes, the default
``topk``, whether a token is needed, whether ``/metrics`` exists) are the ones this server
enforces. ``tests/test_openapi.py`` runs schemathesis against the app with it: every status,
header and body the app answers must be the one written here.

Error codes by status come from the error table in ``webapp/errors.py``, as the README's "Limits and errors" table does.
"""

from __future__ import annotations

from typing import Any

from . import catalog, errors, v2_openapi
from .contract import ORIGINAL_FORMATS, Original

OPENAPI_VERSION = "3.0.3"
API_VERSION = "1.0.0"

# status -> (codes the app uses for it, when), derived from webapp/errors.py's table (the README's
# "Limits and errors" table comes from the same rows); tests/test_openapi.py checks each is reachable.
def _errors_by_status() -> dict[int, tuple[tuple[str, ...], str]]:
    by_status: dict[int, list] = {}
    for cls in errors.ERRORS:
        by_status.setdefault(cls.status, []).append(cls)
    return {status: (tuple(c.code for c in rows), "; ".join(f"{c.when} (`{c.code}`)" for c in rows))
            for status, rows in sorted(by_status.items())}


ERRORS: dict[int, tuple[tuple[str, ...], str]] = _errors_by_status()

_REQUEST_ID = {
    "description": "The request's id: the client's `X-Request-ID` if it is a token of 1..128 safe characters, "
                   "else a fresh uuid4 hex. It is in the JSON access log line of the request and in the server's "
                   "log lines about it.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 128},
}
_RETRY_AFTER = {"description": "Seconds to wait before trying again.", "schema": {"type": "string", "pattern": r"^\d+$"}}


def _error_response(status: int, rate_limited: bool) -> dict:
    codes, when = ERRORS[status]
    headers: dict[str, Any] = {"X-Request-ID": {"$ref": "#/components/headers/RequestId"},
                               **(v2_openapi.RATE_LIMIT_HEADERS if rate_limited and status != 401 else {})}
    if status in (429, 503):
        headers["Retry-After"] = {"$ref": "#/components/headers/RetryAfter"}
    if status == 401:
        headers["WWW-Authenticate"] = v2_openapi.WWW_AUTHENTICATE
    if status == 405:
        headers["Allow"] = {"description": "The methods this path takes, e.g. `OPTIONS, POST`.", "schema": _STR}
    return {"description": when[0].upper() + when[1:] + ".", "headers": headers, "content": _error_content(status, codes)}


def _error_content(status: int, codes=(errors.OTHER_HTTP_CODE,)) -> dict:
    """An error answer's body: ``Error`` with ``status`` and one of ``codes`` (gunicorn's refusals: ``http_error``)."""
    return {"application/json": {"schema": {"allOf": [{"$ref": "#/components/schemas/Error"}], "properties": {
        "error": {"properties": {"code": {"enum": list(codes)}, "status": {"enum": [status]}}}}}}}


def _json(schema_ref: str, description: str) -> dict:
    return {"description": description, "headers": {"X-Request-ID": {"$ref": "#/components/headers/RequestId"}},
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}}}


# While no worker is ready, gunicorn's master answers every request itself: 503 not_ready (webapp/responder.py).
_STARTING = {"503": {"$ref": "#/components/responses/E503"}}


def _get(op: str, summary: str, tag: str, responses: dict) -> dict:
    """A GET operation that takes only the ``X-Request-ID`` header; its 503 is the master's unless given."""
    return {"get": {"operationId": op, "parameters": [{"$ref": "#/components/parameters/RequestId"}],
                    "summary": summary, "tags": [tag], "responses": {**_STARTING, **responses}}}


_NUM = {"type": "number", "minimum": 0}
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": "string", "nullable": True}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {"error": {
            "type": "object",
            "required": ["code", "message", "status"],
            "additionalProperties": False,
            "properties": {
                "code": {"type": "string", "enum": sorted({errors.OTHER_HTTP_CODE, *(c for v in ERRORS.values() for c in v[0])}),
                         "description": f"Stable code (the README's table); `{errors.OTHER_HTTP_CODE}`: {errors.OTHER_HTTP_WHEN}."},
                "message": {"type": "string", "minLength": 1, "description": "What was wrong and what to do, for people."},
                "status": {"type": "integer", "description": "The HTTP status, repeated."},
                "request_id": {"type": "string", "description": "Reserved: the request's id (see `X-Request-ID`)."},
            },
        }},
    },
    "Model": {
        "type": "object",
        "description": "Which model answered. Before the model is loaded only `name` and `note` are present.",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "enum": list(catalog.NAMES)},
            "title": _STR,
            "weights": {"type": "string", "description": "Weights file (or `random, seed N`)."},
            "untrained": {"type": "boolean", "description": "Seeded random weights: labels are meaningless."},
            "fallback": {"type": "boolean", "description": "The offline model serves in place of ResNet-18."},
            "note": {**_NULLABLE_STR, "description": "Says in words why the answers are not from the model asked "
                                                     "for, or not trained."},
            "input_size": {"type": "integer", "minimum": 1},
            "categories": {"type": "integer", "minimum": 1},
            "precision": {"type": "string", "enum": ["fp32", "bf16", "int8"]},
            "compiled": {"type": "boolean"},
            "backend": {"type": "string", "enum": ["aoti", "inductor", "eager"], "description": "How it runs: `aoti` "
                        "compiled ahead of time (AOTInductor), `inductor` torch.compile, `eager` not compiled."},
        },
    },
    "Prediction": {
        "type": "object",
        "required": ["label", "index", "probability"],
        "additionalProperties": False,
        "properties": {
            "label": _STR,
            "index": {"type": "integer", "minimum": 0, "description": "ImageNet class index."},
            "probability": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
    "Result": {
        "type": "object",
        "required": ["filename", "width", "height", "format", "bytes", "batch_size", "predictions"],
        "additionalProperties": False,
        "properties": {
            "filename": {"type": "string", "description": "As the client sent it, its last path component (raw "
                                                          "bodies: `X-Filename`, else `upload`)."},
            "width": {"type": "integer", "minimum": 1, "description": "px, upright (EXIF orientation applied); the "
                                                                      "original's where the client scaled the photo."},
            "height": {"type": "integer", "minimum": 1, "description": "px, as `width`."},
            "format": {"type": "string", "description": "Pillow's name of the image format, e.g. `JPEG`; the "
                                                        "original's where the client scaled the photo."},
            "bytes": {"type": "integer", "minimum": 1, "description": "The file's size in bytes; the original's "
                                                                      "where the client scaled the photo."},
            "scaled_by_client": {
                "type": "object",
                "description": "Present where the upload carried `original_*` fields: the client scaled the photo "
                               "before sending it, `width`/`height`/`format`/`bytes` above are the original's as it "
                               "said, and these are what the server received and decoded.",
                "required": ["width", "height", "format", "bytes"],
                "additionalProperties": False,
                "properties": {"width": {"type": "integer", "minimum": 1}, "height": {"type": "integer", "minimum": 1},
                               "format": _STR, "bytes": {"type": "integer", "minimum": 1}},
            },
            "batch_size": {"type": "integer", "minimum": 1, "description": "Images in the forward pass this one ran in."},
            "predictions": {"type": "array", "minItems": 1, "maxItems": 10,
                            "items": {"$ref": "#/components/schemas/Prediction"},
                            "description": "Top-k by probability, highest first."},
        },
    },
    "PredictResponse": {
        "type": "object",
        "required": ["model", "results", "timing_ms"],
        "additionalProperties": False,
        "properties": {
            "model": {"$ref": "#/components/schemas/Model"},
            "results": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/Result"},
                        "description": "One per image, in the order sent."},
            "timing_ms": {
                "type": "object",
                "required": ["decode", "queue", "inference", "total"],
                "additionalProperties": False,
                "properties": {
                    "decode": {**_NUM, "description": "Decode + preprocess of all files."},
                    "queue": {**_NUM, "description": "The longest queue wait of the images."},
                    "inference": {**_NUM, "description": "The forward pass of the batch (the longest, if several)."},
                    "total": _NUM,
                },
            },
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "ready", "state", "pid", "cores", "intra_op_threads", "model", "queue_depth"],
        "properties": {
            "status": {"type": "string", "enum": ["ok"]},
            "ready": {"type": "boolean"},
            "state": _STR,
            "pid": {"type": "integer", "minimum": 1},
            "cores": {"type": "array", "items": _INT},
            "intra_op_threads": {"type": "integer", "minimum": 1},
            "model": {"$ref": "#/components/schemas/Model"},
            "precision": {**_NULLABLE_STR, "enum": ["fp32", "bf16", "int8", None]},
            "precision_reason": _STR,
            "self_test": {"type": "object", "nullable": True},
            "startup_s": {**_NUM, "nullable": True},
            "max_batch_size": {"type": "integer", "minimum": 1},
            "queue_depth": _INT,
            "coming": _INT,  # images being decoded for the queue: a forming batch waits for them
            "batches": _INT, "images": _INT, "rechecked": _INT,  # rechecked: of the images, those fp32 answered
        },
    },
    "Readiness": {
        "type": "object",
        "required": ["ready", "state", "model"],
        "properties": {
            "ready": {"type": "boolean"},
            "state": _STR,
            "model": {"$ref": "#/components/schemas/Model"},
            "self_test": {"type": "object", "nullable": True},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["requested", "serving", "models"],
        "additionalProperties": False,
        "properties": {
            "requested": {"type": "string", "enum": list(catalog.NAMES),
                          "description": "`CLASSIFIER_MODEL`: the model asked for."},
            "serving": {"type": "string", "nullable": True, "enum": [*catalog.NAMES, None],
                        "description": "The model this worker serves (null before it is loaded)."},
            "models": {"type": "array", "items": {"$ref": "#/components/schemas/ModelEntry"}},
        },
    },
    "ModelEntry": {
        "type": "object",
        "required": ["name", "title", "description", "categories", "input_size", "send_short_side",
                     "send_resample", "precision", "serving"],
        "properties": {
            "name": {"type": "string", "enum": list(catalog.NAMES)},
            "title": _STR,
            "description": _STR,
            "categories": {"type": "integer", "minimum": 1},
            "input_size": {"type": "integer", "minimum": 1},
            "send_short_side": {"type": "integer", "minimum": 1, "description": "px: the short side worth "
                                "sending (the size the model resizes to first). A copy scaled to it with `send_resample` "
                                "and sent lossless (PNG, WebP) with no EXIF is the image the server itself would make "
                                "from the photo: the same answer, far fewer bytes. The page does so in the browser."},
            "send_resample": {"type": "string", "enum": ["bilinear"], "description": "The filter for that: "
                              "Pillow's antialiased `Image.resize` filter of this name, which the server uses."},
            "precision": {"type": "string", "description": "The arithmetic it runs in on this server: the "
                                                           "serving engine's (`auto` resolved); `CLASSIFIER_PRECISION` "
                                                           "as set before a model is loaded."},
            "serving": {"type": "boolean"},
            "weights": {"type": "string", "description": "Serving model only: its weights file."},
            "untrained": {"type": "boolean"},
            "fallback": {"type": "boolean"},
            "compiled": {"type": "boolean"},
            "note": _NULLABLE_STR,
        },
    },
}


def _original_fields(max_files: int) -> dict:
    """The optional ``original_*`` multipart fields: what a client says of the photos it scaled before upload, as
    ``uploads.read_originals`` takes them (a number or "", all four "" for a part sent as is; a format in any case)."""
    said = ("Optional, with the other `original_*` fields (all four or none; all four empty for a part sent as it "
            "is), one value per `file` part in the same order: the file is a copy the client scaled down (e.g. to "
            "`send_short_side` of `GET /api/v1/models`, as the page does in the browser), and this describes its "
            "original. The result then reports the original's `width`, `height`, `format` and `bytes`, and "
            "`scaled_by_client`. A bad value is 400 `bad_request` naming the field, as is an original smaller than "
            "the copy or of another shape.")
    empty, side = {"type": "string", "maxLength": 0}, {"type": "integer", "minimum": 1, "maximum": Original.MAX_SIDE}
    any_case = "|".join("".join(f"[{c}{c.lower()}]" for c in name) for name in ORIGINAL_FORMATS)

    def field(items: dict, what: str) -> dict:
        return {"type": "array", "items": items, "minItems": 1, "maxItems": max_files, "description": f"{what}. {said}"}

    return {
        "original_width": field({"anyOf": [side, empty]}, "The original's width in px, upright (EXIF orientation applied)"),
        "original_height": field({"anyOf": [side, empty]}, "The original's height in px, upright"),
        "original_format": field({"type": "string", "pattern": rf"^\s*({any_case})?\s*$"},
                                 f"The original's format, one of {', '.join(ORIGINAL_FORMATS)} (case does not matter)"),
        "original_bytes": field({"anyOf": [{"type": "integer", "minimum": 1, "maximum": Original.MAX_BYTES}, empty]},
                                "The original's file size in bytes"),
    }


def build_spec(settings, *, metrics: bool | None = None) -> dict:
    """The OpenAPI document for a server running with ``settings`` (a fresh dict each call)."""
    metrics = settings.METRICS if metrics is None else metrics
    token = bool(settings.API_TOKEN)
    metrics_token = bool(settings.METRICS_TOKEN or settings.API_TOKEN)
    errors = tuple(sorted({400, 405, 408, 411, 413, 415, 429, 500, 503, 504} | ({401} if token else set())))
    most = v2_openapi.most_files(settings)
    image_body = {"type": "string", "format": "binary"}
    topk = {"type": "integer", "minimum": 1, "maximum": 10}  # the default on the form field only: tryout30
    predict = {
        "operationId": "predict", "x-max-upload-bytes": settings.MAX_UPLOAD_BYTES,  # read by classify --server
        "summary": "Classify one or several images",
        "description": (
            "Send the image(s) as multipart field `file` (repeat it for several), or one image as the raw body "
            f"with Content-Type `image/*`. All images succeed or the request fails with the first error. "
            f"At most {most} files and {settings.MAX_UPLOAD_BYTES:,} bytes per request, "
            f"{settings.MAX_PIXELS:,} pixels per image and {settings.MAX_REQUEST_PIXELS:,} pixels decoded per "
            f"request (a large JPEG counts at the reduced size it is decoded at)."),
        "tags": ["classify"],
        "parameters": [
            {"name": "topk", "in": "query", "required": False, "schema": topk,
             "description": f"Labels per image (default {settings.TOP_K}); a multipart body's `topk` field if absent."},
            {"$ref": "#/components/parameters/RequestId"},
            {"name": "X-Filename", "in": "header", "required": False,
             "description": "Raw bodies only: the name echoed as `filename` (first 255 characters; UTF-8, else Latin-1).",
             "schema": {"type": "string"}},
        ],
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
                    "file": {"type": "array", "items": image_body, "minItems": 1, "maxItems": most,
                             "description": "The image(s): one part per file."},
                    "topk": {**topk, "default": settings.TOP_K, "description": "Labels per image, as the page's "
                             "form sends it; the query parameter `topk` wins where both are given."},
                    **_original_fields(most)}}},
                "image/*": {"schema": image_body},
                "application/octet-stream": {"schema": image_body},
            },
        },
        "responses": {
            "200": {
                **_json("PredictResponse", "Top-k labels for every image."),
                **({"headers": {"X-Request-ID": {"$ref": "#/components/headers/RequestId"},
                                **v2_openapi.RATE_LIMIT_HEADERS}} if settings.RATE_LIMIT else {}),
            },
            **{str(status): {"$ref": f"#/components/responses/E{status}"} for status in errors},
        },
        "security": [{"bearerAuth": []}] if token else [{}, {"bearerAuth": []}],
    }
    paths: dict[str, Any] = {
        # A wrong method (GET...) is the POST's 405 with Allow (E405), not an operation of its own: client
        # generators would make a method of it.
        "/api/v1/predict": {"post": predict},
        "/api/v1/models": _get("listModels", "The models this server knows, and the one it serves", "classify", {
            "200": _json("ModelList", "Every model `CLASSIFIER_MODEL` can name; the serving one has `serving: true` "
                                      "with its weights and fallback note.")}),
        "/healthz": _get("healthz", "Liveness: this worker is alive", "operations", {
            "200": {**_json("Health", "Alive; with pid, pinned cores, threads, model, precision, self-test and queue "
                                      "depth (of the worker that answered); while none is ready, the master's "
                                      "`starting`."), "content": {"application/json": {"schema": {"anyOf": [
                {"$ref": "#/components/schemas/Health"}, v2_openapi.MASTER_LIVE]}}}}}),
        "/readyz": _get("readyz", "Readiness: warmed up and self-tested", "operations", {
            "200": _json("Readiness", "Ready to classify."),
            "503": {**_json("Readiness", "Not ready: warming up, self-test failed or shutting down (`Readiness`, "
                                         "`state` says which); or no worker started yet: the master's `not_ready` "
                                         "(`Error`, with Retry-After)."),
                    "content": {"application/json": {"schema": {"anyOf": [
                        {"$ref": "#/components/schemas/Readiness"}, {"$ref": "#/components/schemas/Error"}]}}}}}),
        "/openapi.json": _get("openapi", "This document", "operations", {"200": {
            "description": "OpenAPI 3 document.",
            "headers": {"X-Request-ID": {"$ref": "#/components/headers/RequestId"}},
            "content": {"application/json": {"schema": {"type": "object"}}}}}),
    }
    if metrics:
        paths["/metrics"] = {"get": {
            "operationId": "metrics",
            "parameters": [{"$ref": "#/components/parameters/RequestId"}],
            "summary": "Prometheus metrics, all gunicorn workers counted",
            "description": "Prometheus text format (OpenMetrics when asked for in `Accept`). Off with "
                           "`CLASSIFIER_METRICS=0` (404). Needs a bearer token when `CLASSIFIER_METRICS_TOKEN` or "
                           "`CLASSIFIER_API_TOKEN` is set.",
            "tags": ["operations"],
            **({"security": [{"bearerAuth": []}]} if metrics_token else {}),
            "responses": {**({"401": {"$ref": "#/components/responses/E401"}} if metrics_token else {}), **_STARTING,
                          "200": {
                "description": "Request counts and latency by endpoint and status, queue wait, batch size and "
                               "inference time histograms, queue depth, ready workers, model info.",
                "headers": {"X-Request-ID": {"$ref": "#/components/headers/RequestId"}},
                "content": {"text/plain": {"schema": {"type": "string"}},
                            "application/openmetrics-text": {"schema": {"type": "string"}}},
            }},
        }}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Photo classifier",
            "version": API_VERSION,
            "description": "Fast CPU image classification: top-k ImageNet labels for uploaded photos. Every error is "
                           "`{\"error\": {\"code\", \"message\", \"status\"}}`; every response carries "
                           "`X-Request-ID`.",
        },
        "tags": [{"name": "classify"}, {"name": "operations"}, {"name": v2_openapi.TAG}],
        # gunicorn's refusals before the app, in the API's error shape (webapp/worker.py); then /v2's, in the protocol's
        "paths": {**v2_openapi.add_refusals(paths, "E"), **v2_openapi.paths(settings, token=token)},
        "components": {
            "schemas": {**SCHEMAS, **v2_openapi.SCHEMAS},
            "responses": {**{f"E{status}": _error_response(status, bool(settings.RATE_LIMIT)) for status in ERRORS},
                          **v2_openapi.refused_responses("E", _error_content),
                          **v2_openapi.responses(ERRORS, rate_limited=bool(settings.RATE_LIMIT))},
            "headers": {"RequestId": _REQUEST_ID, "RetryAfter": _RETRY_AFTER},
            "parameters": {"RequestId": {
                "name": "X-Request-ID", "in": "header", "required": False,
                "description": "Your id for this request (1..128 of `A-Z a-z 0-9 . _ : + / = @ ~ -`), echoed in the "
                               "answer's `X-Request-ID` and written in the logs; anything else is replaced by a "
                               "fresh uuid4 hex.",
                "schema": {"type": "string"}}},
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "Needed on POST /api/v1/* and POST /v2/models/{name}[/versions/{version}]/infer when "
                               "`CLASSIFIER_API_TOKEN` is set, and on GET /metrics when `CLASSIFIER_METRICS_TOKEN` or it is set."}},
        },
    }
