"""The Open Inference Protocol in-process: the codec on bytes alone (webapp/v2_codec.py), and the routes
(webapp/v2.py) through Flask's test client for what real clients rarely provoke: a full queue, not
ready, timeouts, the token, the rate limit, compressed bodies, and the OpenAPI document of it all.
Real clients against a real gunicorn are in test_v2.py.
"""

from __future__ import annotations

import base64
import gzip
import json
import struct
import zlib

import pytest
import schemathesis

from conftest import shared_image, small_png
from webapp import v2_codec as codec
from webapp import v2_inputs
from webapp.errors import BadRequest, NoFile, NotAnImage, Overloaded, TooLarge

LIMITS = dict(default_topk=3, max_files=4, max_bytes=10_000, categories=1000)
PNG = small_png()


def binary_request(photos: list[bytes], header: dict | None = None, *, extra: bytes = b"") -> tuple[bytes, str]:
    """A body as tritonclient sends it: the JSON header, then each element as <u32 LE length><bytes>."""
    data = b"".join(struct.pack("<I", len(p)) + p for p in photos) + extra
    doc = header or {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(photos)],
                                 "parameters": {"binary_data_size": len(data)}}]}
    head = json.dumps(doc).encode()
    return head + data, str(len(head))


def json_request(photos: list[bytes], **extra) -> bytes:
    doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(photos)],
                       "data": [base64.b64encode(p).decode() for p in photos]}], **extra}
    return json.dumps(doc).encode()


def refused(exc_type, body: bytes, header: str | None = None, **limits) -> str:
    with pytest.raises(exc_type) as info:
        codec.parse_request(body, header, **{**LIMITS, **limits})
    assert type(info.value) is exc_type
    return info.value.message


# -- reading ----------------------------------------------------------------------------------------------
def test_binary_request_gives_the_photos_in_order():
    photos = [PNG, b"x" * 300, b""]
    req = codec.parse_request(*binary_request(photos), **LIMITS)
    assert req.photos == photos and req.id is None and req.topk == 3
    assert [(w.name, w.binary, w.classification) for w in req.outputs] == [
        ("labels", False, 0), ("probabilities", False, 0), ("indices", False, 0)]


@pytest.mark.parametrize("text, content_type, expected", [
    (base64.b64encode(PNG).decode(), "base64", PNG),
    (base64.b64encode(PNG).decode(), None, PNG),
    ("data:image/png;base64," + base64.b64encode(PNG).decode(), None, PNG),
    ("\n".join([base64.b64encode(PNG).decode()[:40], base64.b64encode(PNG).decode()[40:]]), "base64", PNG),
    ("P1\n2 1\n0 1\n", None, b"P1\n2 1\n0 1\n"),  # not base64: its UTF-8 bytes (an ASCII PBM image)
    ("aGk=", "str", b"aGk="),
])
def test_json_elements(text, content_type, expected):
    assert codec.json_element(text, 0, content_type) == expected


@pytest.mark.parametrize("content_type", [None, "base64"])
def test_unpadded_or_url_safe_base64_of_a_photo_is_read(content_type):
    """Unpadded (Go's RawStdEncoding, Rust's NO_PAD) and URL-safe base64 of a photo decode to it (tryout27: a 415 or
    a 400 'Incorrect padding'); text that does not decode to a photo keeps its reading (UTF-8 text, or a 400)."""
    photo = next(PNG + b"\x00" * k for k in range(3) if (len(PNG) + k) % 3)  # a length that needs padding
    for text in (base64.b64encode(photo).decode().rstrip("="), base64.urlsafe_b64encode(photo).decode(),
                 base64.urlsafe_b64encode(photo).decode().rstrip("=")):
        assert codec.json_element(text, 0, content_type) == photo
    hex_text = photo.hex()[:len(photo.hex()) // 4 * 4 - 2]  # base64's alphabet, unpadded: not a photo, so text
    if content_type is None:
        assert codec.json_element(hex_text, 0, None) == hex_text.encode()
    else:
        with pytest.raises(BadRequest, match="not valid base64"):
            codec.json_element("iVBORw0+Gg-_", 0, content_type)  # '+' beside '-': one alphabet or the other


def test_a_binary_element_without_its_length_says_how_elements_are_framed():
    """A photo's bytes sent as binary tensor data without the 4-byte length before it (a hand-rolled client's slip)
    said only "element 0 says 3,774,863,615 bytes, 141,882 are left" (tryout27): now how an element is framed."""
    head = json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": len(PNG)}}]}).encode()
    msg = refused(BadRequest, head + PNG, str(len(head)))
    assert msg.endswith("are left; each BYTES element is a 4-byte little-endian length, then that many bytes "
                        "(b'\\x89PNG' read as one: a photo without it?)"), msg


def test_request_parameters_other_than_the_ones_read_are_400():
    body = json_request([PNG], parameters={"top_k": 5})
    assert refused(BadRequest, body) == ("the request has parameter \"top_k\", which this server does not read there: it "
                                         "takes topk, binary_data_output, content_type, priority, timeout; top_k is "
                                         "spelt \"topk\" here")
    assert "an output's parameter" in refused(BadRequest, json_request([PNG], parameters={"classification": 5}))
    req = codec.parse_request(json_request([PNG], parameters={"priority": 1, "timeout": 100, "topk": 4}), None, **LIMITS)
    assert req.topk == 4


def test_declared_base64_that_is_not_is_400():
    with pytest.raises(BadRequest, match=r"element 2 of input 'image' is not valid base64"):
        codec.json_element("not base64!", 2, "base64")


def test_json_request_with_parameters_and_outputs():
    body = json_request([PNG, PNG], id="r1", parameters={"topk": 5, "binary_data_output": True},
                        outputs=[{"name": "indices", "parameters": {"binary_data": False}},
                                 {"name": "probabilities", "parameters": {"classification": 20}}])
    req = codec.parse_request(body, None, **LIMITS)
    assert req.photos == [PNG, PNG] and req.id == "r1" and req.topk == 5 and req.ranks == 20
    assert [(w.name, w.binary, w.classification) for w in req.outputs] == [("indices", False, 0),
                                                                          ("probabilities", True, 20)]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("inputs"), "this model takes one input, 'image' (BYTES, shape [N]: N encoded photos); got no "
                                "'inputs' list"),
    (lambda d: d.update(inputs=d["inputs"][0]), "this model takes one input, 'image' (BYTES, shape [N]: N encoded "
                                                "photos); got 'inputs' as an object, not a list"),
    (lambda d: d.update(inputs=None), "this model takes one input, 'image' (BYTES, shape [N]: N encoded photos); "
                                      "got 'inputs' as null, not a list"),
    (lambda d: d.update(inputs=3), "this model takes one input, 'image' (BYTES, shape [N]: N encoded photos); "
                                   "got 'inputs' as a number, not a list"),
    (lambda d: d["inputs"].append(d["inputs"][0]), "this model takes one input, 'image' (BYTES, shape [N]: N encoded "
                                                   "photos); got 2 inputs"),
    (lambda d: d["inputs"][0].update(name="INPUT__0"), 'unknown input "INPUT__0": this model takes one input'),
    (lambda d: d["inputs"][0].update(datatype="UINT8"), "input 'image' is BYTES (encoded photos), not \"UINT8\""),
    (lambda d: d["inputs"][0].update(shape=[1, 1]), "input 'image' has shape [1, 1]; it takes [N], N photos"),
    (lambda d: d["inputs"][0].update(shape=[True]), "input 'image' has shape [true]; it takes [N], N photos"),
    (lambda d: d["inputs"][0].update(shape=[2]), "input 'image' has shape [2] but 1 data element(s)"),
    (lambda d: d["inputs"][0].update(data=[7]), "element 0 of input 'image' is a number: send each photo as a base64 "
                                                "string"),
    (lambda d: d["inputs"][0].pop("data"), "input 'image' has no data: send 'data'"),
    (lambda d: d["inputs"][0].update(data=[None]), "element 0 of input 'image' is null: send each photo"),  # not NoneType
    (lambda d: d["inputs"][0].update(data="aGk="), "input 'image': 'data' must be a list (one base64 string per "
                                                   "photo), got a string"),  # data was sent: not "has no data"
    (lambda d: d.update(id=5), "'id' must be a string, got 5"),
    (lambda d: d.update(id="a\ud800b"), "'id' must be text: it holds a lone UTF-16 surrogate (\"a\\ud800b\")"),
    (lambda d: d.update(parameters={"topk": 0}), "topk must be an integer from 1 to 10, got 0"),
    (lambda d: d.update(parameters={"topk": 2.0}), "topk must be an integer from 1 to 10, got 2.0"),
    (lambda d: d.update(parameters={"binary_data_output": "yes"}), 'binary_data_output must be true or false'),
    (lambda d: d.update(outputs=[{"name": ["labels"]}]), 'unknown output ["labels"]: this model answers labels, '
                                                         'probabilities, indices'),
    (lambda d: d.update(outputs=[{"name": "labels"}, {"name": "labels"}]), "output 'labels' is asked for twice"),
    (lambda d: d.update(outputs=[{"name": "labels", "parameters": {"classification": 3}}]),
     "classification applies to the 'probabilities' output, not 'labels'"),
    (lambda d: d.update(outputs=[{"name": "probabilities", "parameters": {"classification": 1001}}]),
     "output 'probabilities' classification must be an integer from 1 to 1000, got 1001"),
    (lambda d: d.update(outputs="labels"), "'outputs' must be a list, got a string"),
    (lambda d: d.update(parameters=[1]), "the request's parameters must be a JSON object, got a list"),
    (lambda d: d.update(parameters={"content_type": 5}), "the request's content_type must be a string such as "
                                                         '"base64" or "str", got 5'),
    (lambda d: d["inputs"][0].update(parameters={"content_type": ["base64"]}),
     "input 'image' content_type must be a string such as \"base64\" or \"str\", got [\"base64\"]"),
])
def test_malformed_requests_are_400_saying_what(mutate, message):
    doc = json.loads(json_request([PNG]))
    mutate(doc)
    assert refused(BadRequest, json.dumps(doc).encode()).startswith(message)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("where", ['{"parameters": {"topk": %s}, "inputs": []}', '{"id": "a", "x": [%s], "inputs": []}'])
def test_nan_and_infinity_are_not_json(constant, where):
    """Python's json reads them; RFC 8259 has no such values, so the request is not valid JSON (400), wherever they are."""
    message = refused(BadRequest, (where % constant).encode())
    assert message.startswith("the inference request is not valid JSON") and constant.lstrip("-") in message, message


def test_deep_nesting_is_400_not_a_crash():
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    # Valid JSON, nested deeper than Python's parser goes: said so, not "not valid JSON" (tryout21).
    assert refused(BadRequest, deep).startswith("the inference request nests its JSON arrays or objects deeper than")
    doc = json.loads(json_request([PNG]))
    doc["inputs"][0]["data"] = [[[[doc["inputs"][0]["data"][0]]]]]  # nested: flattened, row-major
    assert codec.parse_request(json.dumps(doc).encode(), None, **LIMITS).photos == [PNG]


@pytest.mark.parametrize("header", ["abc", "0", "-1", "99999999", " 1e3"])
def test_bad_header_length_is_400(header):
    body, _ = binary_request([PNG])
    assert refused(BadRequest, body, header).startswith(f"{codec.HEADER} must be the JSON header's length")


def test_binary_data_that_does_not_match_its_shape_is_400():
    data = struct.pack("<I", len(PNG)) + PNG + b"\1\0"  # then a cut length
    doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [2],
                       "parameters": {"binary_data_size": len(data)}}]}
    assert refused(BadRequest, *binary_request([], doc, extra=data)) == "input 'image': element 1 has a cut 4-byte " \
                                                                        "length"
    doc["inputs"][0]["shape"] = [1]
    assert refused(BadRequest, *binary_request([], doc, extra=data)) == "input 'image' has binary data past its 1 " \
                                                                        "element(s) (shape [1])"
    data = struct.pack("<I", 999) + b"abc"
    doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                       "parameters": {"binary_data_size": len(data)}}]}
    body, head = binary_request([], doc, extra=data)
    assert refused(BadRequest, body, head) == ("input 'image': element 0 says 999 bytes, 3 are left; each BYTES "
                                               "element is a 4-byte little-endian length, then that many bytes")
    doc["inputs"][0]["parameters"]["binary_data_size"] = 5
    body, head = binary_request([], doc, extra=data)
    assert refused(BadRequest, body, head).startswith("input 'image' binary_data_size is 5 bytes; 7 follow")
    doc["inputs"][0].update(shape=[2], parameters={"binary_data_size": 7})
    body, head = binary_request([], doc, extra=struct.pack("<I", 3) + b"abc")
    assert refused(BadRequest, body, head) == "input 'image' has shape [2] but its binary data holds 1 element(s)"
    body, _ = binary_request([PNG])
    assert refused(BadRequest, body, None).startswith("the body is a JSON header of")  # no header length: below


def test_limits_are_the_apis():
    assert refused(NoFile, json.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [0],
                                                   "data": []}]}).encode()) == "no image: input 'image' has shape [0]"
    assert refused(TooLarge, json_request([PNG] * 5)) == \
        "5 photos in one request; the limit is 4 (CLASSIFIER_MAX_FILES)"
    body, head = binary_request([b"x" * 6000, b"y" * 4001])
    assert refused(TooLarge, body, head) == "the photos are 10,001 bytes; the limit is 10,000 " \
                                            "(CLASSIFIER_MAX_UPLOAD_BYTES)"
    # base64 that must decode past the limit is refused before it is decoded
    assert refused(TooLarge, json_request([b"z" * 20_000])).startswith("the photos are about 20,001 bytes decoded")
    assert codec.body_limit(3) == 4 + codec.JSON_SLACK and codec.body_limit(30_000_000) == 40_000_000 + 65536


# -- answering ----------------------------------------------------------------------------------------------
PREDICTIONS = [[{"label": "kite", "index": 21, "probability": 0.5},
                {"label": "bald eagle", "index": 22, "probability": 0.25},
                {"label": "vulture", "index": 23, "probability": 0.125}],
               [{"label": "zebra", "index": 340, "probability": 0.75},
                {"label": "ostrich", "index": 9, "probability": 0.0625},
                {"label": "impala", "index": 352, "probability": 0.03125}]]


def test_json_answer():
    req = codec.InferRequest("r7", [PNG, PNG], 2, [codec.Wanted("labels", False), codec.Wanted("indices", False),
                                                   codec.Wanted("probabilities", False, 3)])
    body, headers = codec.encode_answer(req, PREDICTIONS, model_name="m", request_id="rid")
    assert headers == {"Content-Type": "application/json"}
    assert json.loads(body) == {"id": "r7", "model_name": "m", "model_version": "1", "outputs": [
        {"name": "labels", "datatype": "BYTES", "shape": [2, 2], "data": ["kite", "bald eagle", "zebra", "ostrich"]},
        {"name": "indices", "datatype": "INT64", "shape": [2, 2], "data": [21, 22, 340, 9]},
        {"name": "probabilities", "datatype": "BYTES", "shape": [2, 3],
         "data": ["0.500000:21:kite", "0.250000:22:bald eagle", "0.125000:23:vulture", "0.750000:340:zebra",
                  "0.062500:9:ostrich", "0.031250:352:impala"]}]}


def test_binary_answer_layout():
    req = codec.InferRequest(None, [PNG, PNG], 3, [codec.Wanted("labels", True), codec.Wanted("probabilities", True),
                                                   codec.Wanted("indices", False)])
    body, headers = codec.encode_answer(req, PREDICTIONS, model_name="m", request_id="rid")
    assert headers["Content-Type"] == "application/octet-stream"
    n = int(headers[codec.HEADER])
    doc, rest = json.loads(body[:n]), body[n:]
    assert doc["id"] == "rid"  # no id sent: the X-Request-ID
    labels, probs, indices = doc["outputs"]
    assert indices["data"] == [21, 22, 23, 340, 9, 352] and "parameters" not in indices
    size = labels["parameters"]["binary_data_size"]
    assert codec.bytes_elements(rest[:size], 6) == [b"kite", b"bald eagle", b"vulture", b"zebra", b"ostrich",
                                                    b"impala"]
    assert probs["parameters"]["binary_data_size"] == 24 == len(rest) - size
    assert struct.unpack("<6f", rest[size:]) == (0.5, 0.25, 0.125, 0.75, 0.0625, 0.03125)


# -- the routes, in-process ------------------------------------------------------------------------------------
INFER = "/v2/models/classifier/infer"


def v2_error(resp, status: int, code: str) -> str:
    assert resp.status_code == status, resp.get_data(as_text=True)[:300]
    body = resp.get_json()
    assert set(body) == {"error"} and body["error"].startswith(f"{code}: "), body
    return body["error"]


def test_busy_not_ready_and_failing_answer_in_the_protocols_shape(app, client, monkeypatch):
    clf = app.extensions["classifier"]
    ok = client.post(INFER, data=json_request([PNG]))
    assert ok.status_code == 200 and ok.headers["X-Request-ID"] == ok.get_json()["id"]

    def full(tensors, gone=None, coming=None, timeout=None):
        raise Overloaded("server busy", headers={"Retry-After": "3"})

    with monkeypatch.context() as m:
        m.setattr(clf.batcher, "submit", full)
        resp = client.post(INFER, data=json_request([PNG]))
        assert v2_error(resp, 429, "overloaded") == "overloaded: server busy" and resp.headers["Retry-After"] == "3"
    with monkeypatch.context() as m:
        m.setattr(clf.batcher, "request_timeout", 0.0)
        v2_error(client.post(INFER, data=json_request([PNG])), 504, "timeout")
    with monkeypatch.context() as m:
        m.setattr(clf.batcher, "predict", lambda batch: 1 / 0)
        v2_error(client.post(INFER, data=json_request([PNG])), 500, "inference_failed")
    with monkeypatch.context() as m:
        m.setattr(clf, "_ready", False)
        resp = client.post(INFER, data=json_request([PNG]))
        v2_error(resp, 503, "not_ready")
        assert resp.headers["Retry-After"] == "5"
        assert client.get("/v2/health/ready").status_code == 503
        assert client.get("/v2/health/ready").get_json() == {"ready": False}
        assert client.get("/v2/models/classifier/ready").get_json() == {"name": "resnet18_seeded", "ready": False}
        assert client.get("/v2/health/live").get_json() == {"live": True}


def test_compressed_bodies(client):
    assert client.post(INFER, data=gzip.compress(json_request([PNG])),
                       headers={"Content-Encoding": "gzip"}).status_code == 200
    assert client.post(INFER, data=zlib.compress(json_request([PNG])),
                       headers={"Content-Encoding": "deflate"}).status_code == 200
    v2_error(client.post(INFER, data=b"\x1f\x8bnot gzip", headers={"Content-Encoding": "gzip"}), 400, "bad_request")
    v2_error(client.post(INFER, data=gzip.compress(json_request([PNG]))[:-20], headers={"Content-Encoding": "gzip"}),
             400, "bad_request")
    v2_error(client.post(INFER, data=b"{}", headers={"Content-Encoding": "br"}), 415, "unsupported_media_type")
    # A small body that inflates past the limit (a zip bomb) stops at the limit.
    limit = codec.body_limit(client.application.extensions["settings"].MAX_UPLOAD_BYTES)
    bomb = gzip.compress(b" " * (limit + 10))
    assert len(bomb) < 100_000
    assert "decompresses to more than" in v2_error(client.post(INFER, data=bomb, headers={"Content-Encoding": "gzip"}),
                                                   413, "too_large")


def test_token_covers_infer_not_health(make_app):
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, PRECISION="fp32", API_TOKEN="s3cret")
    c = app.test_client()
    resp = c.post(INFER, data=json_request([PNG]))
    v2_error(resp, 401, "unauthorized")
    assert resp.headers["WWW-Authenticate"] == 'Bearer realm="classifier"'
    assert c.post(INFER, data=json_request([PNG]), headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert c.get("/v2/health/ready").status_code == 200 and c.get("/v2/models/classifier").status_code == 200


def test_rate_limit_covers_infer(make_app):
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, PRECISION="fp32", RATE_LIMIT="2/minute")
    c = app.test_client()
    assert [c.post(INFER, data=json_request([PNG])).status_code for _ in range(2)] == [200, 200]
    resp = c.post(INFER, data=json_request([PNG]))
    v2_error(resp, 429, "rate_limited")
    assert int(resp.headers["Retry-After"]) >= 1


# -- the OpenAPI document ------------------------------------------------------------------------------------
def test_document_covers_the_v2_routes(app, client):
    from webapp.openapi import build_spec

    spec = build_spec(app.extensions["settings"])
    assert {p for p in spec["paths"] if p.startswith("/v2")} == {
        "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/versions/{version}",
        "/v2/models/{name}/ready", "/v2/models/{name}/versions/{version}/ready", "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer"}
    routes = {r.rule.replace("<", "{").replace(">", "}") for r in app.url_map.iter_rules() if r.rule.startswith("/v2")}
    assert routes == {p for p in spec["paths"] if p.startswith("/v2")}
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").get_json())
    checks = [
        ("/v2/models/{name}/infer", "POST", client.post(INFER, data=json_request([PNG])), 200),
        ("/v2/models/{name}/infer", "POST", client.post(INFER, data=binary_request([PNG])[0],
                                                        headers={codec.HEADER: binary_request([PNG])[1]}), 200),
        ("/v2/models/{name}/infer", "POST", client.post(INFER, data=b"[]"), 400),
        ("/v2/models/{name}/infer", "POST", client.post(INFER, data=json_request([PNG] * 17)), 413),
        ("/v2/models/{name}/versions/{version}/infer", "POST",
         client.post("/v2/models/classifier/versions/2/infer", data=b"{}"), 404),
        ("/v2/models/{name}", "GET", client.get("/v2/models/classifier"), 200),
        ("/v2/models/{name}/versions/{version}/ready", "GET", client.get("/v2/models/x/versions/1/ready"), 404),
        ("/v2", "GET", client.get("/v2"), 200),
        ("/v2/health/live", "GET", client.get("/v2/health/live"), 200),
    ]
    for path, method, resp, status in checks:
        assert resp.status_code == status, (path, resp.get_data(as_text=True)[:300])
        schema[path][method].validate_response(resp)
    binary = json.loads(json_request([PNG], outputs=[{"name": "labels", "parameters": {"binary_data": True}}]))
    resp = client.post(INFER, json=binary)
    assert resp.mimetype == "application/octet-stream"
    schema["/v2/models/{name}/infer"]["POST"].validate_response(resp)


def test_binary_data_without_its_header_length_says_what_is_missing():
    """The binary extension's body sent without ``Inference-Header-Content-Length``: the JSON header parses,
    bytes follow it. The 400 names the missing header and the length to put in it, not a UTF-8 error."""
    body, header = binary_request([PNG])
    message = refused(BadRequest, body, None)
    assert message.startswith(f"the body is a JSON header of {int(header):,} bytes followed by") and \
        f"send the {codec.HEADER} header with the JSON header's length, {header}" in message, message
    assert codec.parse_request(body, header, **LIMITS).photos == [PNG]  # with it, the same body is fine
    assert refused(BadRequest, b'{"inputs": [}').startswith("the inference request is not valid JSON")


@pytest.mark.parametrize("path", ["dog.jpg", "png", "heic"])
def test_a_photo_posted_as_the_body_says_it_is_a_photo_not_bad_json(path):
    """A photo's bytes posted as the inference body (``Content-Type: application/octet-stream``, tryout19 with
    curl --data-binary): 415 naming the photo's format and the two ways to send it, not a UTF-8 decoding error.
    Other binary bytes: the 400 names the binary extension's header."""
    heic = b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(200)  # a format the server does not decode (tryout20)
    photo = PNG if path == "png" else heic if path == "heic" else shared_image(path).read_bytes()
    message = refused(NotAnImage, photo)
    fmt = {"png": "PNG", "heic": "HEIC"}.get(path, "JPEG")
    assert message.startswith(f"the body is {fmt} bytes, not an inference request") and codec.HEADER in message \
        and "/api/v1/predict" in message, message
    message = refused(BadRequest, b"\x00\xff" * 40)
    assert message.startswith("the inference request is not valid JSON") and codec.HEADER in message, message


@pytest.mark.parametrize("content_type, text, photo", [
    ("base64", base64.b64encode(PNG).decode(), PNG), ("str", "abc", b"abc"), ("string", "abc", b"abc"),
    ("utf8", "aGk=", b"aGk="), ("utf-8", "aGk=", b"aGk=")])
def test_the_documented_content_type_takes_every_value_the_codec_reads(app, content_type, text, photo):
    """Found reviewing the document: it allowed only "base64" and "str" while the codec reads "string", "utf8" and
    "utf-8" as str, so a client validating against the document refused requests the server answers. Both the
    request's and the input's ``parameters``. (Any other value is refused by both: the test after this one.)"""
    from webapp.openapi import build_spec

    spec = build_spec(app.extensions["settings"])
    request = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    request = json.loads(json.dumps(request).replace('"#/', '"urn:doc#/'))
    for where in ("request", "input"):
        doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [text]}]}
        (doc if where == "request" else doc["inputs"][0])["parameters"] = {"content_type": content_type}
        assert codec.parse_request(json.dumps(doc).encode(), None, **LIMITS).photos == [photo]
        _validator(spec, request).validate(doc)


def _validator(spec: dict, schema: dict):
    """A Draft 4 validator (OpenAPI 3.0's schema dialect) that resolves the document's ``#/components`` refs."""
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT4

    registry = Registry().with_resource("urn:doc", Resource.from_contents(spec, default_specification=DRAFT4))
    return jsonschema.Draft4Validator(schema, registry=registry)


def test_the_documented_input_carries_its_photos_one_way_as_the_codec_reads_it(app):
    """Found by a tryout: the document let an input have neither ``data`` nor ``parameters.binary_data_size``
    (and both), which the codec refuses with 400; a client validating against it learnt that from the server."""
    from webapp.openapi import build_spec

    spec = build_spec(app.extensions["settings"])
    request = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = _validator(spec, json.loads(json.dumps(request).replace('"#/', '"urn:doc#/')))
    text, element = base64.b64encode(PNG).decode(), struct.pack("<I", len(PNG)) + PNG  # BYTES: 4-byte length first
    binary = {"parameters": {"binary_data_size": len(element)}}
    cases = {"data": ({"data": [text]}, b""), "binary": (binary, element), "neither": ({}, b""),
             "both": ({"data": [text], **binary}, element)}
    for name, (carried, tail) in cases.items():
        doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], **carried}]}
        header = json.dumps(doc).encode()
        if name in ("data", "binary"):
            length = {"data": None, "binary": str(len(header))}[name]
            assert codec.parse_request(header + tail, length, **LIMITS).photos == [PNG]
            validator.validate(doc)
        else:
            with pytest.raises(BadRequest):
                codec.parse_request(header + tail, str(len(header)) if tail else None, **LIMITS)
            assert not validator.is_valid(doc), name


@pytest.mark.parametrize("params, nested, photo", [
    ({"topk": 3}, False, "png"), ({"topk": "3"}, False, "png"), ({"topk": "010"}, False, "png"),
    ({"topk": ""}, False, "png"), ({"topk": 0}, False, "png"), ({"topk": 11}, False, "png"), ({"topk": "11"}, False, "png"),
    ({"topk": " 3"}, False, "png"), ({"topk": "-3"}, False, "png"), ({"topk": True}, False, "png"),
    ({"topk": "abc"}, False, "png"), ({}, True, "png"), ({}, False, "empty"), ({}, True, "empty")])
def test_the_document_and_the_server_take_the_same_requests(app, client, params, nested, photo):
    """Found by a tryout: ``topk: "3"`` and nested ``data`` (the protocol's row-major nesting) were answered but
    forbidden by the document, and ``data: [""]`` was allowed by it but 400 (a 0-byte file). The server's answer
    (200, or 400) and the document's verdict agree for every such request."""
    from webapp.openapi import build_spec

    spec = build_spec(app.extensions["settings"])
    request = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = _validator(spec, json.loads(json.dumps(request).replace('"#/', '"urn:doc#/')))
    text = base64.b64encode(PNG).decode() if photo == "png" else ""
    doc = {"parameters": params, "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                             "data": [[text]] if nested else [text]}]}
    resp = client.post(f"/v2/models/{codec.ALIAS}/infer", json=doc)
    assert resp.status_code in (200, 400), resp.get_data(as_text=True)
    assert validator.is_valid(doc) == (resp.status_code == 200), (resp.status_code, resp.get_data(as_text=True))


# -- what the server does not read is said, not ignored (a user's tryout, 2026-12-05) --------------------------
def _with(datatype=None, input_params=None, outputs=None, request_params=None, data=None) -> bytes:
    doc = json.loads(json_request([PNG]))
    tensor = doc["inputs"][0]
    if datatype is not None:
        tensor["datatype"] = datatype
    if input_params is not None:
        tensor["parameters"] = input_params
    if data is not None:
        tensor["data"] = data
    if outputs is not None:
        doc["outputs"] = outputs
    if request_params is not None:
        doc["parameters"] = request_params
    return json.dumps(doc).encode()


@pytest.mark.parametrize("name", v2_inputs.DATATYPES)
def test_a_datatype_in_the_wrong_case_is_told_so(name):
    """``"datatype": "bytes"`` was told it was "not decoded pixels": every protocol name, in lower case and in
    mixed case, is told its name is upper case, with that name; the right name in upper case is read (BYTES) or
    told it is not BYTES (the others)."""
    for wrong in {name.lower(), name.capitalize()} - {name}:
        assert refused(BadRequest, _with(datatype=wrong)) == (
            f"input 'image' datatype {json.dumps(wrong)} is not a datatype; the protocol's names are upper case: "
            f"{json.dumps(name)}")
    if name == "BYTES":
        assert codec.parse_request(_with(datatype=name), None, **LIMITS).photos == [PNG]
    else:
        assert refused(BadRequest, _with(datatype=name)) == (
            f"input 'image' is BYTES (encoded photos), not {json.dumps(name)}; send the photo files' bytes, not "
            f"decoded pixels")


@pytest.mark.parametrize("datatype, message", [
    ("STRING", 'input \'image\' datatype "STRING" is not a datatype; the protocol\'s are BOOL, UINT8, UINT16, '
               'UINT32, UINT64, INT8, INT16, INT32, INT64, BF16, FP16, FP32, FP64, BYTES, and this input is "BYTES" '
               '(encoded photos)'),
    ("float32", 'input \'image\' datatype "float32" is not a datatype; the protocol\'s are BOOL,'),
    ("", 'input \'image\' datatype "" is not a datatype; the protocol\'s are BOOL,'),
    (5, 'input \'image\' datatype must be a string, "BYTES", got 5'),
])
def test_a_datatype_the_protocol_does_not_have_is_told_so(datatype, message):
    assert refused(BadRequest, _with(datatype=datatype)).startswith(message)
    doc = json.loads(json_request([PNG]))
    del doc["inputs"][0]["datatype"]
    assert refused(BadRequest, json.dumps(doc).encode()) == \
        "input 'image' has no datatype: it is \"BYTES\" (encoded photos)"


@pytest.mark.parametrize("value", ["np", "pd", "img", "Base64", "BASE64", "STR", "", "base-64"])
@pytest.mark.parametrize("where", ["input", "request"])
def test_a_content_type_the_server_does_not_read_is_400_naming_it_and_those_it_reads(app, value, where):
    """Any content_type but those read was taken as if absent (and "str" told base64 text of a photo to be sent
    as bytes): each is now a 400 naming the value and the ones read, lower case said where only the case is
    wrong; and the document refuses the same requests."""
    from webapp.openapi import build_spec

    body = _with(input_params={"content_type": value}) if where == "input" else \
        _with(request_params={"content_type": value})
    message = refused(BadRequest, body)
    what = "input 'image'" if where == "input" else "the request's"
    assert message.startswith(f"{what} content_type {json.dumps(value)} is not one this server reads"), message
    assert 'it reads "base64" (each string is base64 of a photo) and "str" (each string\'s own UTF-8 bytes are ' \
           'the photo; also "string", "utf8", "utf-8")' in message, message
    assert ("content types are lower case" in message) == (value.lower() in v2_inputs.CONTENT_TYPES), message
    spec = build_spec(app.extensions["settings"])
    request = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert not _validator(spec, json.loads(json.dumps(request).replace('"#/', '"urn:doc#/'))).is_valid(json.loads(body))


@pytest.mark.parametrize("content_type", v2_inputs.TEXT_TYPES)
@pytest.mark.parametrize("encode, what", [
    (lambda b: base64.b64encode(b).decode(), "base64 text of a PNG"),
    (lambda b: "data:image/png;base64," + base64.b64encode(b).decode(), "a data: URL of a PNG"),
    (lambda b: b.hex(), "hex text of a PNG")])
def test_base64_of_a_photo_declared_text_is_told_which_content_type_reads_it(content_type, encode, what):
    """``"content_type": "str"`` with base64 strings was a 415 telling a JSON client to send the file's bytes with
    curl: it now names the content_type that made it text and the one to send."""
    body = _with(input_params={"content_type": content_type}, data=[encode(PNG)])
    assert refused(NotAnImage, body) == (
        f"element 0 of input 'image' is {what}, but content_type {json.dumps(content_type)} takes each string's "
        f"own UTF-8 bytes as the photo: send \"content_type\": \"base64\" for base64 strings (or leave "
        f"content_type out)")
    assert codec.parse_request(_with(input_params={"content_type": "base64"}), None, **LIMITS).photos == [PNG]


@pytest.mark.parametrize("output, params, says", [
    ("labels", {"topk": 5}, '; topk is a request parameter ({"parameters": {"topk": 5}} beside "outputs"), for every '
                            'output; or ask \'probabilities\' for "classification": 5'),
    ("probabilities", {"top_k": 5, "binary_data": True}, "; top_k is a request parameter"),
    ("probabilities", {"class_count": 3}, '; class_count is tritonclient\'s name for "classification", the parameter '
                                          'it sends'),
    ("indices", {"shared_memory_region": "r", "shared_memory_byte_size": 80},
     "; this server has no shared memory extension"),
    ("labels", {"content_type": "str"}, "; content_type is an input's parameter"),
    ("labels", {"binary_data_output": True}, "; binary_data_output is a request parameter"),
    ("indices", {"whatever": 1}, ""),
])
def test_an_output_parameter_the_server_does_not_read_is_400_saying_where_it_goes(app, output, params, says):
    """``topk`` on an output was ignored without a word (the answer had TOP_K labels): every parameter an output
    does not take is a 400 naming it, what an output takes and, where known, where it goes; the document says
    the same (``additionalProperties: false``)."""
    from webapp.openapi import build_spec

    body = _with(outputs=[{"name": output, "parameters": params}])
    name = next(iter(params))
    message = refused(BadRequest, body)
    assert message.startswith(f"output '{output}' has parameter {json.dumps(name)}, which this server does not read "
                              f"there: it takes binary_data, classification{says}"), message
    spec = build_spec(app.extensions["settings"])
    request = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = _validator(spec, json.loads(json.dumps(request).replace('"#/', '"urn:doc#/')))
    assert not validator.is_valid(json.loads(body))
    # what real clients send on an output is read, and allowed by the document
    ok = _with(outputs=[{"name": "probabilities", "parameters": {"binary_data": True, "classification": 4}}])
    assert codec.parse_request(ok, None, **LIMITS).ranks == 4 and validator.is_valid(json.loads(ok))


@pytest.mark.parametrize("params, says", [
    ({"topk": 5}, '; topk is a request parameter ({"parameters": {"topk": 5}} beside "inputs")'),
    ({"classification": 3}, "; classification is a parameter of output 'probabilities'"),
    ({"shared_memory_region": "r"}, "; this server has no shared memory extension"),
    ({"content_type": "base64", "shape": [1]}, ""),
])
def test_an_input_parameter_the_server_does_not_read_is_400(params, says):
    name = next(n for n in params if n != "content_type")
    assert refused(BadRequest, _with(input_params=params)).startswith(
        f"input 'image' has parameter {json.dumps(name)}, which this server does not read there: it takes "
        f"content_type, binary_data_size{says}")


def test_the_document_says_binary_data_size_needs_its_header(app):
    """A schema cannot make a body field need a header: ``binary_data_size`` without ``Inference-Header-Content-
    Length`` fits the document and is a 400, so the field's description says so."""
    from webapp.openapi import build_spec

    spec = build_spec(app.extensions["settings"])
    request = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    field = request["properties"]["inputs"]["items"]["properties"]["parameters"]["properties"]["binary_data_size"]
    assert f"Only with the `{codec.HEADER}` header" in field["description"], field
    assert "without it the request is 400" in field["description"], field
    body, _ = binary_request([PNG])
    head = json.loads(body[:int(binary_request([PNG])[1])])
    assert _validator(spec, json.loads(json.dumps(request).replace('"#/', '"urn:doc#/'))).is_valid(head)
    refused(BadRequest, body, None)  # the same request, without the header
