"""The Open Inference Protocol ("KServe v2") REST routes: Triton's, KServe's and MLServer's clients talk to us.

``GET /v2`` (server metadata and the extensions supported), ``GET /v2/health/live``,
``GET /v2/health/ready`` (the ``/readyz`` rule), ``GET /v2/models/{name}[/versions/{v}]`` (model
metadata), ``GET .../ready``, ``POST .../infer``. ``{name}`` is the serving model's name or the alias
``classifier``; ``{v}`` is ``1``; any other is 404. The tensors' format is ``webapp/v2_codec.py``'s.

HTTP only, as ``api.py``: inference goes through the same ``classifier.admit`` (before the body is
read) and ``classifier.classify`` as ``/api/v1/predict``, so decode, limits, batching, precision, errors and metrics are that path's;
the token and the rate limit cover ``infer`` as they cover ``predict`` (``webapp/access.py``).
Errors are the protocol's ``{"error": "<code>: <message>"}`` with the API's status and headers
(``Retry-After``), rendered by the one handler in ``webapp/errors.py`` for every path under ``/v2``.
"""

from __future__ import annotations

import zlib

from flask import Blueprint, Response, current_app, jsonify, request

from . import catalog
from . import v2_codec as codec
from .contract import Upload
from .errors import BadRequest, NotAnImage, NotFound, TooLarge, not_served
from .logs import current_request_id
from .headers import require_length, require_plain_transfer

bp = Blueprint("v2", __name__)

SERVER_NAME = "photo-classifier"
SERVER_VERSION = "1.0.0"
# Content-Encoding of a request body -> zlib's wbits for it (tritonclient's request_compression_algorithm).
_ENCODINGS = {"gzip": 31, "deflate": 15}


def _classifier():
    return current_app.extensions["classifier"]


def _serving(name: str, version: str | None) -> str:
    """The serving model's name if ``name`` (and ``version``) name it.

    :raises NotFound: another model or version (404).
    """
    serving = _classifier().describe()["name"]
    if name not in (serving, codec.ALIAS):
        raise NotFound(not_served(request.path) if name == "stats" else  # Triton's statistics: /v2/models/stats
                       f"unknown model {name[:80]!r}: this server serves {serving!r} (also as {codec.ALIAS!r})")
    if version is not None and version != codec.VERSION:
        raise NotFound(f"model {serving!r} has no version {version[:40]!r}; its one version is {codec.VERSION!r}")
    return serving


def _ready_body(body: dict):
    ready = _classifier().ready
    return jsonify({**body, "ready": ready}), 200 if ready else 503


@bp.get("/v2")
def server_metadata():
    """The server's name, version and the protocol extensions it supports."""
    return jsonify({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": list(codec.EXTENSIONS)})


@bp.get("/v2/health/live")
def live():
    """200 ``{"live": true}`` while the worker process is alive (as ``/healthz``)."""
    return jsonify({"live": True})


@bp.get("/v2/health/ready")
def ready():
    """200 ``{"ready": true}`` once warmed up and self-tested (as ``/readyz``), else 503 ``{"ready": false}``."""
    return _ready_body({})


@bp.get("/v2/models/<name>")
@bp.get("/v2/models/<name>/versions/<version>")
def model_metadata(name: str, version: str | None = None):
    """The model's versions, platform and tensors (``-1`` for variable dimensions)."""
    return jsonify(codec.model_metadata(_serving(name, version)))


@bp.get("/v2/models/<name>/ready")
@bp.get("/v2/models/<name>/versions/<version>/ready")
def model_ready(name: str, version: str | None = None):
    """200 ``{"name", "ready": true}`` when the model can classify now, else 503."""
    return _ready_body({"name": _serving(name, version)})


def _body(limit: int) -> bytes:
    """The request body (decompressed where ``Content-Encoding`` is gzip or deflate), at most ``limit`` bytes.

    :raises TooLarge: over ``limit`` (413; Werkzeug raises its own 413 when Content-Length says so).
    :raises NotAnImage: a ``Content-Encoding`` other than identity, gzip and deflate, or a transfer coding
        besides chunked (415).
    :raises BadRequest: a compressed body that does not decompress (400).
    :raises LengthRequired: HTTP/1.0 without Content-Length (411).
    """
    require_length(request)
    require_plain_transfer(request)
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("identity", "", *_ENCODINGS):
        raise NotAnImage(f"Content-Encoding {encoding[:40]} is not supported: send the body as it is, or gzip "
                         f"or deflate it")
    if request.content_length is not None and request.content_length > limit:  # answered before the body
        raise TooLarge(f"the request is {request.content_length:,} bytes; the limit is {limit:,} "
                       f"(CLASSIFIER_MAX_UPLOAD_BYTES, plus a third for base64)")
    request.max_content_length = limit
    data = request.get_data(cache=False)
    if request.content_length is None and len(data) >= limit:
        # Werkzeug stops reading a chunked body at the limit without saying so; one more byte tells.
        if request.environ["wsgi.input"].read(1):
            raise TooLarge(f"the request is larger than {limit:,} bytes (CLASSIFIER_MAX_UPLOAD_BYTES, plus a "
                           f"third for base64)")
    if encoding in _ENCODINGS:
        inflater = zlib.decompressobj(_ENCODINGS[encoding])
        try:
            data = inflater.decompress(data, limit + 1)  # bounded: a small bomb cannot fill memory
        except zlib.error as exc:
            raise BadRequest(f"the {encoding} body cannot be decompressed ({exc})") from None
        if len(data) > limit:
            raise TooLarge(f"the request decompresses to more than {limit:,} bytes (CLASSIFIER_MAX_UPLOAD_BYTES, "
                           f"plus a third for base64)")
        if not inflater.eof:
            raise BadRequest(f"the {encoding} body is cut short")
    return data


@bp.post("/v2/models/<name>/infer")
@bp.post("/v2/models/<name>/versions/<version>/infer")
def infer(name: str, version: str | None = None):
    """Classify the photos of input ``image``; answer the outputs asked for (see ``webapp/v2_codec.py``)."""
    serving = _serving(name, version)
    mimetype = request.mimetype
    if mimetype == "multipart/form-data" or mimetype.startswith("image/"):
        raise NotAnImage(f"Content-Type {mimetype} is not an inference request: send the protocol's JSON (photos "
                         f"as base64 strings) or its binary tensor data; or use /api/v1/predict for uploads")
    # The protocol's parameters go in the body; in the query they were ignored unsaid (?topk=5 answered 3 labels).
    # Other query parameters (a proxy's, a token's) are none of the protocol's and are left alone.
    asked = {name.lower().removesuffix("[]") for name in request.args}  # ?TOPK=5 and ?topk[]=5 too (tryout31)
    if misplaced := [p for p in (*codec.REQUEST_PARAMETERS, *codec.REQUEST_ELSEWHERE) if p.lower() in asked]:
        raise BadRequest(f"{misplaced[0]} is not read from the query string here: the protocol's parameters go in "
                         f"the request's JSON, e.g. {{\"parameters\": {{\"topk\": 5}}, \"inputs\": [...]}}")
    clf = _classifier()
    clf.admit(request.environ)  # not ready or too late: answered before the body is read, as /api/v1/predict
    s = clf.settings
    entry = catalog.BY_NAME.get(serving)
    req = codec.parse_request(_body(codec.body_limit(s.MAX_UPLOAD_BYTES)), request.headers.get(codec.HEADER),
                              default_topk=s.TOP_K, max_files=s.MAX_FILES, max_bytes=s.MAX_UPLOAD_BYTES,
                              categories=entry.categories if entry else 1000)
    uploads = [Upload(f"{codec.INPUT}[{i}]" + (" (not base64, so read as its UTF-8 text)" if isinstance(
        photo, codec.Text) else ""), photo) for i, photo in enumerate(req.photos)]
    answer = clf.classify(uploads, topk=req.ranks)
    body, headers = codec.encode_answer(req, [r["predictions"] for r in answer["results"]],
                                        model_name=answer["model"]["name"], request_id=current_request_id())
    return Response(body, status=200, headers=headers)
