"""The OpenAPI document (``GET /openapi.json``) matches what the app really does.

1. schemathesis generates requests from the document, valid and invalid (bounded: 25 examples per
   operation and mode, plus its coverage phase), sends them to the app through WSGI and checks each
   answer: no 5xx, a documented status, the documented content type, a body that fits the schema.
2. Every error the README's table lists is provoked on purpose and its answer checked against the
   document the same way (random data rarely fills a queue or times out).
"""

from __future__ import annotations

import io
import json
import re

import pytest
import schemathesis
from PIL import Image
from schemathesis import GenerationMode, checks

from conftest import ROOT, encode, png_bytes, small_png
from webapp import settings as settings_mod
from webapp.errors import Overloaded
from webapp.openapi import ERRORS, build_spec

CONFIG = {"MODEL": "resnet18_seeded", "COMPILE": False, "PRECISION": "fp32", "MAX_BATCH_SIZE": 4, "MAX_FILES": 4}
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance]

# The document for CONFIG, built without the app (schemathesis needs it at collection);
# test_served_document_is_the_one_checked shows the app serves exactly this.
SCHEMA = schemathesis.openapi.from_dict(build_spec(settings_mod.load(overrides=CONFIG)))
SCHEMA.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=25,
                                deterministic=True, database="none")


@pytest.fixture(scope="module")
def st_app(make_module_app):
    return make_module_app(**CONFIG)


def test_served_document_is_the_one_checked(st_app):
    resp = st_app.test_client().get("/openapi.json")
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    served = resp.get_json()
    assert served == json.loads(json.dumps(build_spec(settings_mod.load(overrides=CONFIG))))
    assert served["openapi"].startswith("3.")
    # and the Open Inference Protocol's /v2 paths (tests/test_v2_codec.py checks those)
    assert {p for p in served["paths"] if not p.startswith("/v2")} == {"/api/v1/predict", "/api/v1/models", "/healthz", "/readyz", "/metrics",
                                    "/openapi.json"}
    predict = served["paths"]["/api/v1/predict"]["post"]
    assert set(predict["responses"]) == {"200", "400", "405", "408", "411", "413", "414", "415", "417", "429", "431",
                                         "500", "501", "503", "504"}
    body = predict["requestBody"]["content"]
    assert body["multipart/form-data"]["schema"]["properties"]["file"]["items"]["format"] == "binary"
    assert body["multipart/form-data"]["schema"]["properties"]["file"]["maxItems"] == CONFIG["MAX_FILES"]
    assert "image/*" in body
    (topk,) = [p for p in predict["parameters"] if p.get("name") == "topk"]
    assert (topk["schema"]["minimum"], topk["schema"]["maximum"]) == (1, 10)


@pytest.mark.parametrize("config", [{}, {"API_TOKEN": "x", "RATE_LIMIT": "5/second"}, {"METRICS": False}])
def test_document_is_valid_openapi_3_0(config):
    """Against the OpenAPI 3.0 meta-schema (the one schemathesis ships)."""
    import jsonschema_rs
    from schemathesis.specs.openapi.definitions import OPENAPI_30

    doc = json.loads(json.dumps(build_spec(settings_mod.load(overrides=config))))
    errors = [str(e).splitlines()[0] for e in jsonschema_rs.validator_for(OPENAPI_30).iter_errors(doc)]
    assert not errors, errors


def test_readme_error_table_is_in_the_document():
    """Each (status, code) row of the README's "Limits and errors" table is documented, and no other."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Limits and errors", 1)[1].split("\n## ", 1)[0]
    rows = {(int(s), c) for s, c in re.findall(r"^\| (\d{3}) \| `(\w+)` \|", table, re.M)}
    assert len(rows) >= 11
    documented = {(s, c) for s, (codes, _) in ERRORS.items() for c in codes}
    assert rows <= documented, rows - documented
    # Beyond the table: routing errors, and the catch-all 500 of an unexpected exception.
    assert documented - rows <= {(404, "not_found"), (405, "method_not_allowed"), (500, "internal_error"),
                                 (400, "bad_request")}


@SCHEMA.parametrize()
def test_app_conforms_to_its_document(case, st_app):
    case.call_and_validate(app=st_app, checks=CHECKS)


# ------------------------------------------------------------------------------------ errors on purpose
def truncated_jpeg() -> bytes:
    return encode(Image.effect_noise((256, 256), 80).convert("RGB"), "JPEG", quality=90)[:2000]


def conforms(schema, path: str, method: str, resp, status: int, code: str | None = None) -> None:
    """``resp`` has ``status``, which the document lists for the operation, and a body that fits it."""
    assert resp.status_code == status, resp.get_data(as_text=True)[:500]
    operation = schema[path][method]
    assert str(status) in operation.definition.raw["responses"], f"{status} is not documented for {method} {path}"
    assert resp.mimetype == "application/json"
    operation.validate_response(resp)  # raises on a body that does not fit
    if code is not None:
        assert resp.get_json()["error"]["code"] == code


def schema_of(app):
    return schemathesis.openapi.from_dict(app.test_client().get("/openapi.json").get_json())


def test_provoked_errors_fit_the_document(app, client, monkeypatch):
    schema = schema_of(app)
    clf = app.extensions["classifier"]
    post = lambda **kw: client.post("/api/v1/predict", **kw)  # noqa: E731
    raw = dict(data=small_png(), content_type="image/png")

    conforms(schema, "/api/v1/predict", "POST", post(**raw), 200)
    files = [(io.BytesIO(small_png(c)), f"{i}.png") for i, c in enumerate([(9, 9, 9), (200, 0, 0)])]
    conforms(schema, "/api/v1/predict", "POST", post(data={"file": files}), 200)
    conforms(schema, "/api/v1/predict", "POST", post(data={"image": (io.BytesIO(small_png()), "x.png")}), 400,
             "no_file")
    conforms(schema, "/api/v1/predict", "POST", post(data=truncated_jpeg(), content_type="image/jpeg"), 400,
             "undecodable_image")
    conforms(schema, "/api/v1/predict", "POST", client.post("/api/v1/predict?topk=11", **raw), 400, "bad_request")
    many = [(io.BytesIO(small_png(size=(4, 4))), f"{i}.png") for i in range(clf.settings.MAX_FILES + 1)]
    conforms(schema, "/api/v1/predict", "POST", post(data={"file": many}), 413, "too_large")
    conforms(schema, "/api/v1/predict", "POST", post(data=b"%PDF-1.7\n", content_type="image/jpeg"), 415,
             "unsupported_media_type")
    conforms(schema, "/api/v1/predict", "POST", post(data=small_png(), content_type="text/plain"), 415,
             "unsupported_media_type")

    def full(tensors, gone=None, coming=None, timeout=None):
        raise Overloaded("server busy", headers={"Retry-After": "3"})

    with monkeypatch.context() as m:
        m.setattr(clf.batcher, "submit", full)
        resp = post(**raw)
        conforms(schema, "/api/v1/predict", "POST", resp, 429, "overloaded")
        assert resp.headers["Retry-After"] == "3"
    with monkeypatch.context() as m:
        m.setattr(clf.batcher, "request_timeout", 0.0)
        conforms(schema, "/api/v1/predict", "POST", post(**raw), 504, "timeout")
    with monkeypatch.context() as m:
        m.setattr(clf.batcher, "predict", lambda batch: 1 / 0)
        conforms(schema, "/api/v1/predict", "POST", post(**raw), 500, "inference_failed")
    with monkeypatch.context() as m:
        m.setattr(clf, "classify", lambda *a, **k: {}["unexpected"])
        conforms(schema, "/api/v1/predict", "POST", post(**raw), 500, "internal_error")
    with monkeypatch.context() as m:
        m.setattr(clf, "_ready", False)
        resp = post(**raw)
        conforms(schema, "/api/v1/predict", "POST", resp, 503, "not_ready")
        assert int(resp.headers["Retry-After"]) >= 1
        conforms(schema, "/readyz", "GET", client.get("/readyz"), 503)
        conforms(schema, "/healthz", "GET", client.get("/healthz"), 200)
    conforms(schema, "/api/v1/predict", "POST", post(**raw), 200)  # and back to normal


@pytest.fixture(scope="module")
def guarded_app(make_module_app):
    return make_module_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN="t0ken",
                           RATE_LIMIT="3/minute", MAX_UPLOAD_BYTES=4096)


def test_token_limits_and_rate_limit_fit_the_document(guarded_app):
    schema = schema_of(guarded_app)
    client = guarded_app.test_client()
    doc = client.get("/openapi.json").get_json()["paths"]["/api/v1/predict"]["post"]
    assert doc["security"] == [{"bearerAuth": []}] and "401" in doc["responses"]
    auth = {"Authorization": "Bearer t0ken"}
    png = small_png(size=(16, 16))
    conforms(schema, "/api/v1/predict", "POST",
             client.post("/api/v1/predict", data=png, content_type="image/png"), 401, "unauthorized")
    conforms(schema, "/api/v1/predict", "POST",
             client.post("/api/v1/predict", data=png, content_type="image/png", headers=auth), 200)
    big = png_bytes(Image.effect_noise((64, 64), 100).convert("RGB"))
    assert len(big) > 4096
    conforms(schema, "/api/v1/predict", "POST",  # Werkzeug's own 413, from Content-Length
             client.post("/api/v1/predict", data=big, content_type="image/png", headers=auth), 413, "too_large")
    statuses = [client.post("/api/v1/predict", data=png, content_type="image/png", headers=auth) for _ in range(3)]
    assert [r.status_code for r in statuses][-1] == 429
    conforms(schema, "/api/v1/predict", "POST", statuses[-1], 429, "rate_limited")


def test_models_and_probes_fit_the_document(client, app):
    schema = schema_of(app)
    conforms(schema, "/api/v1/models", "GET", client.get("/api/v1/models"), 200)
    conforms(schema, "/healthz", "GET", client.get("/healthz"), 200)
    conforms(schema, "/readyz", "GET", client.get("/readyz"), 200)


def test_a_wrong_method_on_predict_fits_the_documents_405(client, app):
    """The README's 405 example, ``GET /api/v1/predict``: not an operation of the document (a client generator
    would make a method of it), but its answer is the documented 405 response: the Error body, and Allow."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT7

    doc = json.loads(json.dumps(build_spec(app.extensions["settings"])))
    assert set(doc["paths"]["/api/v1/predict"]) == {"post"}
    assert doc["paths"]["/api/v1/predict"]["post"]["responses"]["405"] == {"$ref": "#/components/responses/E405"}
    e405 = doc["components"]["responses"]["E405"]
    resp = client.get("/api/v1/predict")
    assert resp.status_code == 405 and resp.headers["Allow"] == "OPTIONS, POST" and "Allow" in e405["headers"]
    registry = Registry().with_resource("urn:doc", Resource.from_contents(doc, default_specification=DRAFT7))
    schema = json.loads(json.dumps(e405["content"]["application/json"]["schema"]).replace('"#/', '"urn:doc#/'))
    jsonschema.Draft7Validator(schema, registry=registry).validate(resp.get_json())  # Error, code and status 405
    assert resp.get_json()["error"]["code"] == "method_not_allowed"


def test_every_field_of_the_model_an_answer_describes_is_documented(client, app):
    """``model`` in every answer (predict, /healthz, /readyz) carries ``backend``, as the README says: the
    document names each of its fields, and the value answered is one it allows."""
    model = json.loads(json.dumps(build_spec(app.extensions["settings"])))["components"]["schemas"]["Model"]
    answer = client.post("/api/v1/predict", data=small_png(), content_type="image/png").get_json()["model"]
    for described in (answer, client.get("/healthz").get_json()["model"], client.get("/readyz").get_json()["model"]):
        assert set(described) <= set(model["properties"]), set(described) - set(model["properties"])
    assert answer["backend"] in model["properties"]["backend"]["enum"]
    assert set(model["properties"]["backend"]["enum"]) == {"aoti", "inductor", "eager"}


def test_the_masters_answer_while_starting_fits_every_operation(app):
    """Found by a fresh-user tryout: while no worker is ready, gunicorn's master answers every route 503
    ``not_ready`` with Retry-After (webapp/responder.py), which the document listed for predict only. Its very
    bytes, for each operation of the document; /v2's in the protocol's shape (its readiness operations documented
    a 503 as ``{"ready": false}`` only, which a client made from the document refused: tryout30)."""
    from werkzeug.test import EnvironBuilder, TestResponse

    from webapp import responder

    schema = schema_of(app)
    paths = json.loads(json.dumps(build_spec(app.extensions["settings"])))["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            concrete = path.replace("{name}", "classifier").replace("{version}", "1")
            head, _, body = responder.response(path=concrete).partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            resp = TestResponse([body], int(lines[0].split()[1]),
                                [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:]],
                                EnvironBuilder(path=concrete, method=method.upper()).get_request())
            if path.startswith("/v2"):
                conforms(schema, path, method.upper(), resp, 503)
                assert resp.get_json()["error"].startswith("not_ready: ") and resp.headers["Retry-After"], path
                continue
            conforms(schema, path, method.upper(), resp, 503, "not_ready")
            documented = operation["responses"]["503"]
            if "$ref" in documented:  # the error table's 503: with Retry-After, as the master sends it
                assert documented["$ref"] == "#/components/responses/E503" and resp.headers["Retry-After"]
    # /v2's too: each lists its 503 (model metadata did not, and a starting server answers it there: tryout17)
    assert [p for p, ops in paths.items() if p.startswith("/v2") for op in ops.values()
            if "503" not in op["responses"]] == []


def test_every_operation_that_reads_a_body_documents_its_408_and_its_token():
    """Found by a fresh-user tryout: a stalled /v2 upload is answered 408 body_timeout, as on /api/v1/predict,
    but the /v2 infer operations did not list it, and the bearer scheme's words left them out too."""
    doc = build_spec(settings_mod.load(overrides={**CONFIG, "API_TOKEN": "x"}))
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert {"/api/v1/predict", "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"} <= set(posts)
    for path, op in posts.items():
        assert "408" in op["responses"] and "401" in op["responses"], path
        assert op["security"] == [{"bearerAuth": []}], path
    words = doc["components"]["securitySchemes"]["bearerAuth"]["description"]
    assert "POST /api/v1/*" in words and "POST /v2/models/{name}[/versions/{version}]/infer" in words


@pytest.mark.parametrize("field, raw", [
    ("original_format", "JPEG"), ("original_format", "jpeg"), ("original_format", " WebP "), ("original_format", "heic"),
    ("original_format", "JPG"), ("original_format", "x"), ("original_format", "JPEG2000"),
    ("original_width", "1"), ("original_width", "65535"), ("original_width", "0"), ("original_width", "65536"),
    ("original_width", "-3"), ("original_bytes", str(2 ** 40)), ("original_bytes", str(2 ** 40 + 1))])
def test_the_documented_original_fields_take_what_the_server_takes(field, raw):
    """Found reviewing the document: it typed the widths as integers and the format as an upper-case enum while
    the server takes "" (all four empty: a part sent as it is) and any case, so a client validating its request
    against the document refused what the page itself sends. Each value: the document's item schema and
    ``uploads.read_originals`` agree (the other three fields valid)."""
    import jsonschema
    from werkzeug.datastructures import MultiDict

    from webapp.errors import BadRequest
    from webapp.uploads import read_originals

    props = build_spec(settings_mod.load())["paths"]["/api/v1/predict"]["post"]["requestBody"]["content"][
        "multipart/form-data"]["schema"]["properties"]
    form = {"original_width": "640", "original_height": "480", "original_format": "PNG", "original_bytes": "1000",
            field: raw}
    try:
        read_originals(MultiDict(form), 1)
        served = True
    except BadRequest:
        served = False
    value = int(raw) if raw.lstrip("-").isdigit() else raw  # as a multipart text value is typed by its schema
    assert jsonschema.Draft4Validator(props[field]["items"]).is_valid(value) == served, (field, raw, served)
    # and the four empty values of a part sent as it is, which the server reads as "not a copy"
    empty = MultiDict({f: "" for f in form})
    assert read_originals(empty, 1) == [None]
    assert all(jsonschema.Draft4Validator(props[f]["items"]).is_valid("") for f in form)


def test_the_topk_form_field_is_documented_as_the_server_reads_it(client, app):
    """Found by a fresh-user tryout: the server reads ``topk`` from a multipart body (the page's form sends it; the
    query parameter wins), but the document's multipart schema did not name it."""
    doc = build_spec(app.extensions["settings"])
    post = doc["paths"]["/api/v1/predict"]["post"]
    form = post["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]["topk"]
    (query,) = [p for p in post["parameters"] if p.get("name") == "topk"]
    assert {k: form[k] for k in ("type", "minimum", "maximum")} == {"type": "integer", "minimum": 1, "maximum": 10}
    assert query["schema"]["maximum"] == form["maximum"]
    data = {"file": (io.BytesIO(small_png()), "a.png"), "topk": "5"}
    answer = client.post("/api/v1/predict", data=data, content_type="multipart/form-data").get_json()
    assert len(answer["results"][0]["predictions"]) == 5
    data = {"file": (io.BytesIO(small_png()), "a.png"), "topk": "5"}
    answer = client.post("/api/v1/predict?topk=2", data=data, content_type="multipart/form-data").get_json()
    assert len(answer["results"][0]["predictions"]) == 2  # the query parameter wins


def test_the_document_lists_the_rate_limit_headers_and_the_starting_503_everywhere_they_come():
    """Found by a tryout: with CLASSIFIER_RATE_LIMIT set, /v2 infer's 200 and every error answer of a classify
    request carry X-RateLimit-*, which the document named only on /api/v1/predict's 200; and GET /v2 and
    /v2/health/live answered 503 while the server starts (the master's answer to every path), undocumented; the
    master answers liveness 200 while starting now (tryout19), but 503 still while it stops."""
    limited = json.loads(json.dumps(build_spec(settings_mod.load(overrides={"RATE_LIMIT": "5/second"}))))
    plain = json.loads(json.dumps(build_spec(settings_mod.load(overrides={}))))
    names = {"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}
    infer = limited["paths"]["/v2/models/{name}/infer"]["post"]["responses"]["200"]
    assert names <= set(infer["headers"])
    for key in ("E429", "E400", "E413", "V2E429", "V2E400"):
        assert names <= set(limited["components"]["responses"][key]["headers"]), key
        assert not names & set(plain["components"]["responses"][key]["headers"]), key
    assert not names & set(limited["components"]["responses"]["E401"]["headers"])  # a 401 counts against no one
    for path in ("/v2", "/v2/health/live"):
        assert "503" in plain["paths"][path]["get"]["responses"], path


def test_every_v2_operation_lists_what_gunicorn_refuses_before_the_app():
    """Found by a user: gunicorn answers 414, 417 and 431 (and 400, 501) on any path before the app sees the
    request, in the protocol's shape under /v2 (webapp/worker.py), and no /v2 operation listed them. The statuses
    gunicorn's own ``Worker.handle_error`` can send, read from its source (a gunicorn upgrade that adds one fails
    here), are on every /v2 operation, each in the protocol's error shape; tests/test_v2.py provokes each of them
    on a real server. Its 403s (PROXY protocol, TLS) come before a request line, and its 500 needs a SCRIPT_NAME."""
    import inspect

    from gunicorn.workers.base import Worker

    from webapp import v2_openapi

    sent = {int(s) for s in re.findall(r"status_int = (\d+)", inspect.getsource(Worker.handle_error))}
    assert sent - {403, 500} == {400, *v2_openapi.REFUSED_BY_GUNICORN}, sent
    doc = json.loads(json.dumps(build_spec(settings_mod.load(overrides={**CONFIG, "API_TOKEN": "x"}))))
    operations = [(path, method, op) for path, ops in doc["paths"].items() if path.startswith("/v2")
                  for method, op in ops.items()]
    assert len(operations) == 9
    for path, method, op in operations:
        for status in (400, 405, *v2_openapi.REFUSED_BY_GUNICORN):
            assert op["responses"].get(str(status)) == {"$ref": f"#/components/responses/V2E{status}"}, \
                (method, path, status)
    for status in v2_openapi.REFUSED_BY_GUNICORN:
        response = doc["components"]["responses"][f"V2E{status}"]
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/V2Error"}
        assert "`http_error`" in response["description"] and "X-Request-ID" in response["headers"]


def test_every_operation_lists_what_gunicorn_refuses_before_the_app_in_its_own_shape():
    """Found reviewing the /v2 fix above: gunicorn refuses the same requests on every path, in the API's error shape
    outside /v2 (webapp/worker.py, ``errors.error_body``), and the other operations listed none of 414, 417, 431,
    501 (the GETs not even 400). In each configuration every operation lists ``BEFORE_THE_APP``'s statuses, each a
    response of its own error shape (``E``: the API's, with code ``http_error`` and the status; ``V2E``: the
    protocol's); tests/test_v2.py provokes each on every operation of a real server."""
    from webapp import v2_openapi

    assert v2_openapi.BEFORE_THE_APP == (400, *v2_openapi.REFUSED_BY_GUNICORN)
    for overrides in ({**CONFIG, "API_TOKEN": "x", "RATE_LIMIT": "5/second"}, {"METRICS": False}):
        doc = json.loads(json.dumps(build_spec(settings_mod.load(overrides=overrides))))
        assert ("/metrics" in doc["paths"]) == ("METRICS" not in overrides)
        for path, operations in doc["paths"].items():
            prefix = "V2E" if path.startswith("/v2") else "E"
            for method, op in operations.items():
                for status in v2_openapi.BEFORE_THE_APP:
                    assert op["responses"].get(str(status)) == {"$ref": f"#/components/responses/{prefix}{status}"}, \
                        (method, path, status)
                assert list(op["responses"]) == sorted(op["responses"]), (method, path)
        for status in v2_openapi.REFUSED_BY_GUNICORN:
            response = doc["components"]["responses"][f"E{status}"]
            schema = response["content"]["application/json"]["schema"]
            assert schema["allOf"] == [{"$ref": "#/components/schemas/Error"}]
            assert schema["properties"]["error"]["properties"] == {"code": {"enum": ["http_error"]},
                                                                   "status": {"enum": [status]}}
            assert "`http_error`" in response["description"] and "X-Request-ID" in response["headers"]


def test_a_queue_smaller_than_max_files_is_the_documents_limit():
    """With ``QUEUE_SIZE`` 2, a request of 3 photos is a 413 (``TooLarge.queue``) however long it waits; the
    documents said 16 (tryout19). Both APIs' documents give the lesser of the two, in their schemas and words."""
    spec = build_spec(settings_mod.load(overrides={**CONFIG, "MAX_FILES": 16, "QUEUE_SIZE": 2}))
    predict = spec["paths"]["/api/v1/predict"]["post"]
    form = predict["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    assert form["file"]["maxItems"] == 2 and form["original_width"]["maxItems"] == 2
    assert "At most 2 files" in predict["description"]
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]
    assert "At most 2 photos" in json.dumps(infer)
    assert "16" not in re.findall(r"At most (\d+)", json.dumps(spec))


def test_the_masters_liveness_answers_fit_the_documents():
    """While no worker is ready, gunicorn's master answers /healthz and /v2/health/live 200 itself
    (``responder.live_response``): each body fits its path's 200 schema in the document."""
    import jsonschema

    from webapp import responder

    spec = build_spec(settings_mod.load(overrides=CONFIG))
    for path in responder.LIVE_PATHS:
        raw = responder.live_response(path)
        assert raw.startswith(b"HTTP/1.1 200 ")
        body = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        schema = spec["paths"][path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        jsonschema.validate(body, {**schema, "components": spec["components"]})
    with pytest.raises(jsonschema.ValidationError):  # a worker's shape is not taken for the master's, nor the reverse
        jsonschema.validate({"status": "starting", "ready": False}, {**spec["paths"]["/healthz"]["get"]["responses"][
            "200"]["content"]["application/json"]["schema"], "components": spec["components"]})


def test_the_topk_query_parameter_has_no_default_so_a_generated_clients_form_field_is_read():
    """The query parameter ``topk`` had ``default: 3``: a client generated from the document (openapi-python-client)
    sent ``?topk=3`` on every call, and the query wins over the form, so its form ``topk=5`` answered 3 labels
    (tryout30). The server's default is the form field's now; ``classify --server`` reads it there, or from the
    query parameter's default in an older server's document."""
    from webapp import settings
    from webapp.cli.uploading import published_topk

    spec = build_spec(settings.load({"CLASSIFIER_TOP_K": "4"}))
    op = spec["paths"]["/api/v1/predict"]["post"]
    query = next(p for p in op["parameters"] if p.get("name") == "topk")
    assert "default" not in query["schema"] and "(default 4)" in query["description"]
    assert op["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]["topk"]["default"] == 4
    assert published_topk(spec) == 4
    older = json.loads(json.dumps(spec))
    del older["paths"]["/api/v1/predict"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"][
        "properties"]["topk"]["default"]
    next(p for p in older["paths"]["/api/v1/predict"]["post"]["parameters"] if p.get("name") == "topk")[
        "schema"]["default"] = 6
    assert published_topk(older) == 6 and published_topk({}) is None
