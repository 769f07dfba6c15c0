"""The Open Inference Protocol's routes (webapp/v2.py) in the OpenAPI document (``webapp/openapi.py`` merges them).

Their errors are the protocol's ``{"error": "<code>: <message>"}``, with the statuses and the
``when`` words of the error table (``errors_by_status``: ``openapi.ERRORS``, passed in so this
module does not import the one that imports it). What gunicorn refuses before the app, which every
operation of the document lists, /v2's and the others' alike, is here too (``REFUSED_BY_GUNICORN``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import v2_codec as codec
from . import v2_inputs
from .errors import OTHER_HTTP_CODE, Unauthorized

TAG = "open inference protocol"
_ID = {"$ref": "#/components/parameters/RequestId"}
_ID_HEADER = {"X-Request-ID": {"$ref": "#/components/headers/RequestId"}}
# Every path parameter is one URL segment; its values are the serving model's name or the alias.
_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
         "description": f"The serving model's name (see `GET /api/v1/models`), or `{codec.ALIAS}`; any other is 404."}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1},
            "description": f"`{codec.VERSION}`, the model's one version; any other is 404."}
_PARAMS = {"type": "object", "description": "Parameters: string, number or boolean values.",
           "additionalProperties": {"oneOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}]}}
_TENSOR_OUT = {
    "type": "object", "required": ["name", "datatype", "shape"],
    "properties": {"name": {"type": "string", "enum": list(codec.OUTPUTS)},
                   "datatype": {"type": "string", "enum": ["BYTES", "FP32", "INT64"]},
                   "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                   "parameters": _PARAMS,
                   "data": {"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "number"}]},
                            "description": "Row-major values (absent when the output is binary)."}},
}
_TENSOR_META = {"type": "object", "required": ["name", "datatype", "shape"],
                "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                               "shape": {"type": "array", "items": {"type": "integer", "minimum": -1}}}}

# A photo as a `data` element: a non-empty string (an empty one is a 0-byte file: 400 no_file).
_PHOTO = {"type": "string", "format": "byte", "minLength": 1}

SCHEMAS: dict[str, Any] = {
    # The protocol's nested form of row-major data (``data: [[...], [...]]``), which the codec reads flattened.
    "V2PhotoRows": {"type": "array", "minItems": 1,
                    "items": {"anyOf": [_PHOTO, {"$ref": "#/components/schemas/V2PhotoRows"}]}},
    "V2Error": {"type": "object", "required": ["error"], "additionalProperties": False,
                "properties": {"error": {"type": "string", "minLength": 1,
                                         "description": "`<code>: <message>`: the code of the README's table, then "
                                                        "what was wrong and what to do."}}},
    "V2ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"],
                         "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                        "extensions": {"type": "array", "items": {"type": "string",
                                                                                  "enum": list(codec.EXTENSIONS)}}}},
    "V2Live": {"type": "object", "required": ["live"], "properties": {"live": {"type": "boolean"}}},
    "V2Ready": {"type": "object", "required": ["ready"],
                "properties": {"ready": {"type": "boolean"}, "name": {"type": "string"}}},
    "V2ModelMetadata": {"type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
                        "properties": {"name": {"type": "string"},
                                       "versions": {"type": "array", "items": {"type": "string"}},
                                       "platform": {"type": "string"},
                                       "inputs": {"type": "array", "items": _TENSOR_META},
                                       "outputs": {"type": "array", "items": _TENSOR_META}}},
    "V2InferResponse": {"type": "object", "required": ["id", "model_name", "model_version", "outputs"],
                        "properties": {"id": {"type": "string", "description": "The request's `id`, else its "
                                                                               "`X-Request-ID`."},
                                       "model_name": {"type": "string"}, "model_version": {"type": "string"},
                                       "parameters": _PARAMS,
                                       "outputs": {"type": "array", "items": _TENSOR_OUT}}},
}


# On every 401, /v2's and the JSON API's (webapp/openapi.py) alike: errors.Unauthorized always sends it.
WWW_AUTHENTICATE = {"description": f"`{Unauthorized.CHALLENGE}`, with `error=\"invalid_token\"` added for a token "
                                   "that is not this server's (RFC 6750).",
                    "required": True, "schema": {"type": "string", "pattern": "^Bearer realm=\"classifier\""}}


# With CLASSIFIER_RATE_LIMIT set, every answer of a classify request (the page's, /api/v1/predict's, /v2 infer's:
# 200 and errors alike, but a 401) carries these (webapp/rate_limits.py); optional here, as other paths lack them.
RATE_LIMIT_HEADERS = {f"X-RateLimit-{k}": {"description": d, "schema": {"type": "string"}} for k, d in (
    ("Limit", "Requests allowed per window."), ("Remaining", "Requests left in this window."),
    ("Reset", "When the window resets (Unix time, s)."))}


# What gunicorn refuses itself, on any path, before the app sees the request (webapp/worker.py answers it in the
# protocol's shape under /v2, in the API's elsewhere, the page's path included): status -> when, for the statuses the
# error table has no row of (code http_error). Its 400 (a header it cannot parse, e.g. `Content-Length: abc`) is the
# table's bad_request. Its 403s (a PROXY protocol line from an address not allowed, a TLS error) come before any
# request line, so for no operation, and its 500 needs a SCRIPT_NAME this server does not set. tests/test_openapi.py
# reads gunicorn's own list. Every operation of the document lists them all (``refused_responses``, ``add_refusals``).
REFUSED_BY_GUNICORN = {
    414: "the request line (method, path and query) is longer than gunicorn's `limit_request_line`, 8190 bytes",
    417: "an `Expect` header other than `100-continue`",
    431: "more header fields than gunicorn's `limit_request_fields` (100), or one larger than 8190 bytes",
    501: "a `Transfer-Encoding` gunicorn does not know (it knows chunked, gzip, deflate and compress)",
}
# What gunicorn answers on any operation before the app sees the request: its 400 (the table's) and the others.
BEFORE_THE_APP = (400, *REFUSED_BY_GUNICORN)


def refused_responses(prefix: str, content: Callable[[int], dict]) -> dict:
    """``<prefix><status>``: the component response of each of ``REFUSED_BY_GUNICORN``'s statuses, its body
    ``content(status)`` (an OpenAPI ``content`` map: the error shape webapp/worker.py writes where the operations
    that refer to ``prefix`` are), with ``X-Request-ID``. ``prefix``: ``V2E`` for /v2's, ``E`` for the API's."""
    return {f"{prefix}{status}": {"description": f"{when[0].upper() + when[1:]}: `{OTHER_HTTP_CODE}`, answered by "
                                                 f"gunicorn before the app sees the request (`Connection: close`).",
                                  "headers": dict(_ID_HEADER), "content": content(status)}
            for status, when in REFUSED_BY_GUNICORN.items()}


def add_refusals(paths: dict, prefix: str) -> dict:
    """Add ``BEFORE_THE_APP``'s statuses to every operation of ``paths`` (an OpenAPI ``paths`` map, changed in place
    and returned) where absent, as references to the component responses ``<prefix><status>`` (``E``: the API's
    error shape, ``V2E``: the protocol's); each operation's responses end up in status order."""
    for operations in paths.values():
        for operation in operations.values():
            merged = {**{str(s): {"$ref": f"#/components/responses/{prefix}{s}"} for s in BEFORE_THE_APP},
                      **operation["responses"]}
            operation["responses"] = {status: merged[status] for status in sorted(merged)}
    return paths


def responses(errors_by_status: dict[int, tuple[tuple[str, ...], str]], *, rate_limited: bool = False) -> dict:
    """``V2E<status>``: each error status of the table in the protocol's shape, with its headers (``rate_limited``:
    the rate-limit headers, ``CLASSIFIER_RATE_LIMIT`` being set), and each of ``REFUSED_BY_GUNICORN``'s."""
    out = {}
    for status, (_codes, when) in errors_by_status.items():
        headers: dict[str, Any] = {**_ID_HEADER, **(RATE_LIMIT_HEADERS if rate_limited and status != 401 else {})}
        if status in (429, 503):
            headers["Retry-After"] = {"$ref": "#/components/headers/RetryAfter"}
        if status == 401:
            headers["WWW-Authenticate"] = WWW_AUTHENTICATE
        out[f"V2E{status}"] = {"description": when[0].upper() + when[1:] + ".", "headers": headers,
                               "content": {"application/json": {"schema": {"$ref": "#/components/schemas/V2Error"}}}}
    return {**out, **refused_responses("V2E", lambda _status: {
        "application/json": {"schema": {"$ref": "#/components/schemas/V2Error"}}})}


def _json(schema: str, description: str) -> dict:
    return {"description": description, "headers": _ID_HEADER,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


def _errors(*statuses: int) -> dict:
    """The responses of ``statuses`` and 405, by status, in order: every /v2 operation can answer 405, for a method
    its path does not take (e.g. `POST /v2`), and gunicorn's refusals (``add_refusals`` adds those to each)."""
    return {str(s): {"$ref": f"#/components/responses/V2E{s}"} for s in sorted({*statuses, 405})}


# /healthz's 200 from gunicorn's master while no worker is ready (webapp/responder.py's live_response): alive.
MASTER_LIVE = {"type": "object", "required": ["status", "ready", "answered_by"], "properties": {
    "status": {"type": "string", "enum": ["starting"]}, "ready": {"type": "boolean", "enum": [False]},
    "state": {"type": "string"}, "answered_by": {"type": "string", "enum": ["master"]}}}


def most_files(settings) -> int:
    """Photos one request may hold: ``MAX_FILES``, or fewer where a worker's queue (``QUEUE_SIZE``) holds fewer
    (more is a 413 however long one waits: tryout19 found the documents saying 16 with a queue of 2)."""
    return min(settings.MAX_FILES, settings.QUEUE_SIZE)


def _infer_request(settings) -> dict:
    photos = {"type": "array", "minItems": 1, "maxItems": most_files(settings),
              "items": {"anyOf": [_PHOTO, {"$ref": "#/components/schemas/V2PhotoRows"}]},
              "description": "One base64 string per photo (any format `/api/v1/predict` takes); nested arrays "
                             "(the protocol's row-major nesting) are read flattened, and their strings must "
                             "number as `shape` says."}
    content_type = {"type": "string", "example": "base64", "enum": list(v2_inputs.CONTENT_TYPES),
                    "description": "How `data` strings hold the photos: `base64`, or `str` (also `string`, `utf8`, "
                                   "`utf-8`: their UTF-8 bytes). Absent: base64 where the string is valid base64, "
                                   "else its UTF-8 bytes. Any other value (an MLServer codec's own, e.g. `np`; "
                                   "`Base64`) is a 400 naming the ones read. The input's wins over the request's."}
    image = {"type": "object", "required": ["name", "datatype", "shape"],
             "properties": {"name": {"type": "string", "enum": [codec.INPUT]},
                            "datatype": {"type": "string", "enum": ["BYTES"]},
                            "shape": {"type": "array", "minItems": 1, "maxItems": 1,
                                      "items": {"type": "integer", "minimum": 1, "maximum": most_files(settings)},
                                      "description": "`[N]`: N photos; N must equal the number of elements."},
                            "parameters": {"type": "object", "additionalProperties": False, "properties": {
                                "content_type": content_type,
                                "binary_data_size": {"type": "integer", "minimum": 0,
                                                     "description": f"Binary tensor data extension: the input's "
                                                                    f"bytes after the JSON header. Only with the "
                                                                    f"`{codec.HEADER}` header, which says where "
                                                                    f"that header ends: without it the request is "
                                                                    f"400 (a schema cannot require a header for a "
                                                                    f"body field)."}},
                                           "description": "Any other parameter is a 400 (not ignored)."},
                            "data": photos},
             # exactly one way to carry the photos, as the codec reads them (neither or both: 400 naming them)
             "oneOf": [{"required": ["data"]},
                       {"required": ["parameters"], "properties": {"parameters": {"required": ["binary_data_size"]}}}]}
    output = {"type": "object", "required": ["name"],
              "properties": {"name": {"type": "string", "enum": list(codec.OUTPUTS)},
                             "parameters": {"type": "object", "additionalProperties": False,
                                            "description": "Any other parameter (e.g. `topk`, a request parameter) "
                                                           "is a 400 (not ignored).", "properties": {
                                 "binary_data": {"type": "boolean"},
                                 "classification": {"type": "integer", "minimum": 1, "maximum": 1000,
                                                    "description": "Classification extension, on `probabilities` "
                                                                   "only: the top classes of the whole softmax as "
                                                                   "`<probability>:<index>:<label>` strings."}}}}}
    return {"type": "object", "required": ["inputs"],
            "properties": {"id": {"type": "string"},
                           "parameters": {"type": "object", "properties": {
                               "topk": {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 10},
                                                  {"type": "string", "pattern": r"^[ \t\r\n]*(0*([1-9]|10))?[ \t\r\n]*$"}],
                                        "description": f"Labels per photo (default {settings.TOP_K}): an integer "
                                                       f"from 1 to 10, or one as a string (as clients that send "
                                                       f"every parameter as a string do; \"\": the default; "
                                                       f"spaces around it dropped)."},
                               "binary_data_output": {"type": "boolean"},
                               "content_type": content_type}},
                           "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": image},
                           "outputs": {"type": "array", "items": output}}}


def paths(settings, *, token: bool) -> dict[str, Any]:
    """The ``/v2`` paths for a server running with ``settings`` (``token``: ``API_TOKEN`` is set)."""
    binary = {"type": "string", "format": "binary"}
    header = {"name": codec.HEADER, "in": "header", "required": False, "schema": {"type": "integer", "minimum": 1},
              "description": "Binary tensor data extension: the length in bytes of the JSON header that starts "
                             "the body; the input's bytes follow it."}
    answer = {"description": "The outputs asked for (all three when none is named): JSON, or, where any is "
                             f"binary, the JSON header then their bytes with `{codec.HEADER}`.",
              "headers": {**_ID_HEADER, codec.HEADER: {"schema": {"type": "integer", "minimum": 1}},
                          **(RATE_LIMIT_HEADERS if settings.RATE_LIMIT else {})},
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/V2InferResponse"}},
                          "application/octet-stream": {"schema": binary}}}
    limits = (f"At most {most_files(settings)} photos and {settings.MAX_UPLOAD_BYTES:,} bytes of them (decoded) per "
              f"request, {settings.MAX_PIXELS:,} pixels per photo and {settings.MAX_REQUEST_PIXELS:,} decoded per "
              f"request; the body may be up to "
              f"{codec.body_limit(settings.MAX_UPLOAD_BYTES):,} bytes (base64 adds a third).")
    infer = {
        "operationId": "v2Infer", "tags": [TAG], "summary": "Classify photos (Open Inference Protocol)",
        "description": "Input `image`: BYTES `[N]`, encoded photos, as JSON base64 strings or with the binary tensor "
                       "data extension (Triton's and KServe's clients). Outputs `labels` (BYTES), `probabilities` "
                       "(FP32), `indices` (INT64), each `[N, topk]`. Same decode, limits, batching and errors as "
                       "`/api/v1/predict`. " + limits,
        "parameters": [header, _ID],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _infer_request(settings)},
                                                      "application/octet-stream": {"schema": binary}}},
        "responses": {"200": answer, **_errors(400, *((401,) if token else ()), 404, 405, 408, 411, 413, 415, 429, 500,
                                                503, 504)},
        "security": [{"bearerAuth": []}] if token else [{}, {"bearerAuth": []}],
    }
    model = [_NAME]
    versioned = [_NAME, _VERSION]

    def get(op: str, summary: str, params: list, ok: dict, *errs: int) -> dict:
        return {"get": {"operationId": op, "tags": [TAG], "summary": summary, "parameters": [*params, _ID],
                        "responses": {"200": ok, **_errors(*errs)}}}

    ready = _json("V2Ready", "Ready: warmed up and self-tested (the `/readyz` rule).")
    # Not ready: a worker's `ready: false`, or, while no worker serves (starting, stopping), the master's `not_ready`
    # error with Retry-After, which a client made from the document refused as a V2Ready without `ready` (tryout30).
    not_ready = {"503": {"description": "Not ready: a worker's `{\"ready\": false}` (`V2Ready`); while no worker serves "
                                        "(starting, stopping) the master's `not_ready` (`V2Error`, with Retry-After).",
                         "headers": {**_ID_HEADER, "Retry-After": {"$ref": "#/components/headers/RetryAfter"}},
                         "content": {"application/json": {"schema": {"anyOf": [
                             {"$ref": "#/components/schemas/V2Ready"}, {"$ref": "#/components/schemas/V2Error"}]}}}}}
    meta = _json("V2ModelMetadata", "The model's versions, platform and tensors (`-1`: a variable dimension).")
    out = {
        "/v2": get("v2ServerMetadata", "Server metadata and the extensions supported", [],
                   _json("V2ServerMetadata", "Name, version, extensions."), 503),  # 503: the master, while starting
        "/v2/health/live": get("v2Live", "Liveness", [], _json("V2Live", "`{\"live\": true}`."), 503),
        "/v2/health/ready": get("v2Ready", "Readiness (as `/readyz`)", [], ready),
        "/v2/models/{name}": get("v2ModelMetadata", "Model metadata", model, meta, 404, 405, 503),  # 503: starting
        "/v2/models/{name}/versions/{version}": get("v2ModelVersionMetadata", "Model metadata", versioned, meta,
                                                    404, 405, 503),
        "/v2/models/{name}/ready": get("v2ModelReady", "Model readiness", model, ready, 404, 405),
        "/v2/models/{name}/versions/{version}/ready": get("v2ModelVersionReady", "Model readiness", versioned,
                                                          ready, 404, 405),
        "/v2/models/{name}/infer": {"post": infer},
        "/v2/models/{name}/versions/{version}/infer": {"post": {**infer, "operationId": "v2InferVersion",
                                                                "parameters": [_NAME, _VERSION, header, _ID]}},
    }
    for path in ("/v2/health/ready", "/v2/models/{name}/ready", "/v2/models/{name}/versions/{version}/ready"):
        out[path]["get"]["responses"].update(not_ready)
    out["/v2/models/{name}/infer"]["post"]["parameters"] = [_NAME, header, _ID]
    return add_refusals(out, "V2E")
