"""The Open Inference Protocol (KServe v2) against a real gunicorn, spoken by clients no one here wrote:
Triton's ``tritonclient[http]`` and the ``kserve`` SDK's ``InferenceRESTClient``.

One server for the module: the offline EfficientNet-Lite0, eager, fp32, 1 worker, a 4 MB upload
limit (the shared 12 MP photos are 3.2 MB: they fit binary, their base64 does not fit 4 MB). For
every shared photo the top-3 each client gets equals ``/api/v1/predict``'s; bad inputs get the
protocol's ``{"error": "..."}`` with the API's status. The protocol's parsing on bytes alone, the
token, the rate limit and the OpenAPI document are in test_v2_codec.py (in-process).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re

import numpy as np
import pytest
import requests

from conftest import SHARED_IMAGES, png_declaring, shared_image, small_png
from serving import Server
from webapp.v2_codec import body_limit

pytestmark = pytest.mark.server

MAX_UPLOAD = 4_000_000
MAX_FILES = 12
PHOTOS = sorted(p.name for p in SHARED_IMAGES.glob("*.jpg")) if SHARED_IMAGES.is_dir() else []


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("v2") / "server.log", args=("--no-control-socket",),
                    MODEL="efficientnet_lite0", COMPILE=0, PRECISION="fp32", WORKERS=1, MAX_BATCH_SIZE=4,
                    MAX_UPLOAD_BYTES=MAX_UPLOAD, MAX_FILES=MAX_FILES)
    try:
        server.wait_ready(workers=1)
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop_cleanly()


@pytest.fixture(scope="module")
def triton(srv):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=srv.url.removeprefix("http://"), network_timeout=120)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(srv) -> dict[str, list[dict]]:
    """Each shared photo's top-3 from /api/v1/predict (raw body), by file name."""
    if not PHOTOS:
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    out = {}
    for name in PHOTOS:
        resp = requests.post(srv.url + "/api/v1/predict", data=(SHARED_IMAGES / name).read_bytes(),
                             headers={"Content-Type": "image/jpeg"}, timeout=120)
        assert resp.status_code == 200, resp.text
        out[name] = resp.json()["results"][0]["predictions"]
    return out


def photo_bytes(*names: str) -> np.ndarray:
    return np.array([(SHARED_IMAGES / n).read_bytes() for n in names], dtype=np.object_)


def triton_input(data: np.ndarray, *, binary: bool = True, datatype: str = "BYTES", shape=None):
    import tritonclient.http as httpclient

    inp = httpclient.InferInput("image", list(shape or data.shape), datatype)
    inp.set_data_from_numpy(data, binary_data=binary)
    return inp


def triton_outputs(*, binary: bool = True, class_count: int = 0):
    import tritonclient.http as httpclient

    outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("labels", "indices")]
    return outs + [httpclient.InferRequestedOutput("probabilities", binary_data=binary, class_count=class_count)]


def assert_top3(result, expected: list[dict], row: int = 0) -> None:
    """tritonclient's result (or kserve's outputs by name) row ``row`` equals /api/v1/predict's predictions."""
    labels = [b.decode() if isinstance(b, bytes) else b for b in result["labels"][row]]
    assert labels == [p["label"] for p in expected]
    assert [int(i) for i in result["indices"][row]] == [p["index"] for p in expected]
    # The same decode, model and batch size as /api/v1/predict: the same probabilities (FP32 of its 6 decimals).
    assert [float(p) for p in result["probabilities"][row]] == pytest.approx([p["probability"] for p in expected],
                                                                              abs=1e-6)


def as_dict(result) -> dict:
    return {n: result.as_numpy(n) for n in ("labels", "indices", "probabilities")}


def triton_error(call, status: str) -> str:
    """Run ``call``; it must raise tritonclient's error with ``status``; returns the server's error string."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == status, info.value
    return info.value.message()


# -- health and metadata ---------------------------------------------------------------------------------
def test_triton_health_and_metadata(srv, triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("classifier") and triton.is_model_ready("efficientnet_lite0", "1")
    assert not triton.is_model_ready("resnet18") and not triton.is_model_ready("classifier", "2")
    assert triton.get_server_metadata() == {"name": "photo-classifier", "version": "1.0.0",
                                            "extensions": ["binary_tensor_data", "classification"]}
    meta = triton.get_model_metadata("classifier")
    assert meta == {"name": "efficientnet_lite0", "versions": ["1"], "platform": "pytorch",
                    "inputs": [{"name": "image", "datatype": "BYTES", "shape": [-1]}],
                    "outputs": [{"name": "labels", "datatype": "BYTES", "shape": [-1, -1]},
                                {"name": "probabilities", "datatype": "FP32", "shape": [-1, -1]},
                                {"name": "indices", "datatype": "INT64", "shape": [-1, -1]}]}
    assert triton.get_model_metadata("efficientnet_lite0", "1") == meta
    assert "not_found: unknown model 'nope'" in triton_error(lambda: triton.get_model_metadata("nope"), "404")
    # Triton's own extensions, which tritonclient offers: a 404 that says so, not Flask's "check your spelling"
    for call in (lambda: triton.get_model_config("classifier"), triton.get_model_repository_index,
                 triton.get_inference_statistics):
        said = triton_error(call, "404")
        assert "not served here" in said and "Open Inference Protocol" in said and "spelling" not in said, said
    # The bodies KServe's client parses (Triton's ignores them).
    assert requests.get(srv.url + "/v2/health/live", timeout=10).json() == {"live": True}
    assert requests.get(srv.url + "/v2/health/ready", timeout=10).json() == {"ready": True}


# -- the same answers as /api/v1/predict -------------------------------------------------------------------
@pytest.mark.parametrize("name", PHOTOS)
def test_triton_binary_top3_equals_predict(triton, reference, name):
    """Triton's default: binary input (sent with no Content-Type), binary outputs."""
    result = triton.infer("classifier", [triton_input(photo_bytes(name))], outputs=triton_outputs(),
                          request_id=f"req-{name}")
    assert result.get_response()["id"] == f"req-{name}"
    assert result.get_response()["model_name"] == "efficientnet_lite0"
    assert result.as_numpy("labels").shape == (1, 3)
    assert result.as_numpy("probabilities").dtype == np.float32
    assert result.as_numpy("indices").dtype == np.int64
    assert_top3(as_dict(result), reference[name])


def test_triton_all_photos_in_one_request_no_outputs_named(triton, reference):
    """N photos in one tensor (batched together, as several files to /api/v1/predict); with no outputs
    named, tritonclient asks for all of them in binary."""
    small = [p for p in PHOTOS if not p.startswith("phone")]  # two 3.2 MB photos would pass the 4 MB limit
    result = triton.infer("efficientnet_lite0", [triton_input(photo_bytes(*small))], model_version="1")
    assert {o["name"] for o in result.get_response()["outputs"]} == {"labels", "probabilities", "indices"}
    got = as_dict(result)
    assert got["labels"].shape == (len(small), 3)
    for row, name in enumerate(small):
        labels = [b.decode() for b in got["labels"][row]]
        assert labels == [p["label"] for p in reference[name]], name
        # Batched with others: the same labels, probabilities within float noise of batch size 1.
        assert got["probabilities"][row].tolist() == pytest.approx([p["probability"] for p in reference[name]],
                                                                   abs=2e-4)


@pytest.mark.parametrize("name", PHOTOS[:3])
def test_triton_json_base64_top3_equals_predict(triton, reference, name):
    """JSON input: base64 strings (tritonclient cannot say content_type: the server sees base64), JSON outputs."""
    b64 = np.array([base64.b64encode((SHARED_IMAGES / name).read_bytes())], dtype=np.object_)
    result = triton.infer("classifier", [triton_input(b64, binary=False)], outputs=triton_outputs(binary=False))
    assert_top3(as_dict(result), reference[name])


@pytest.mark.parametrize("name", PHOTOS)
def test_triton_classification_extension(triton, reference, name):
    import tritonclient.http as httpclient

    out = httpclient.InferRequestedOutput("probabilities", binary_data=True, class_count=3)
    result = triton.infer("classifier", [triton_input(photo_bytes(name))], outputs=[out])
    got = [s.decode() for s in result.as_numpy("probabilities")[0]]
    assert got == [f"{p['probability']:f}:{p['index']}:{p['label']}" for p in reference[name]]


def test_the_readmes_tritonclient_example_prints_what_it_says(srv, capsys):
    """The README's tritonclient snippet, run as written against this server (its model and precision: the
    offline EfficientNet-Lite0, fp32): it prints the ranks its comment shows."""
    import re

    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\nimport numpy as np\nimport tritonclient.http")
    code = readme[start + len("```python"):readme.index("```", start + 9)]
    shown = re.findall(r"b'([0-9.]+):(\d+):([^']+)'", code.split("print(", 1)[1])
    assert len(shown) == 3, code
    code = code.replace('"localhost:8000"', repr(srv.url.removeprefix("http://"))).replace(
        '"../shared/images/dog.jpg"', repr(str(shared_image("dog.jpg"))))
    exec(compile(code, "README.md", "exec"), {})
    printed = re.findall(r"b'([0-9.]+):(\d+):([^']+)'", capsys.readouterr().out)
    assert [(i, label) for _, i, label in printed] == [(i, label) for _, i, label in shown]
    for (got, _, _), (want, _, _) in zip(printed, shown):
        assert float(got) == pytest.approx(float(want), abs=1e-5), (printed, shown)


def test_classification_ranks_the_whole_vector(triton, reference):
    """class_count beyond topk's 10: the full softmax ranked, highest first, summing to ~1."""
    import tritonclient.http as httpclient

    out = httpclient.InferRequestedOutput("probabilities", binary_data=False, class_count=1000)
    result = triton.infer("classifier", [triton_input(photo_bytes("dog.jpg"))], outputs=[out])
    # JSON outputs: tritonclient gives BYTES elements as str
    rows = [s.split(":", 2) for s in result.as_numpy("probabilities")[0]]
    assert len(rows) == 1000 and sorted(int(i) for _, i, _ in rows) == list(range(1000))
    probs = [float(p) for p, _, _ in rows]
    assert probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1.0, abs=1e-3)
    assert [r[2] for r in rows[:3]] == [p["label"] for p in reference["dog.jpg"]]


def test_topk_request_parameter(triton, reference):
    result = triton.infer("classifier", [triton_input(photo_bytes("eagle.jpg"))], outputs=triton_outputs(),
                          parameters={"topk": 5})
    assert result.as_numpy("labels").shape == (1, 5)
    assert [b.decode() for b in result.as_numpy("labels")[0][:3]] == [p["label"] for p in reference["eagle.jpg"]]


def test_a_request_parameter_the_server_does_not_read_is_refused_through_tritonclient(triton, reference):
    """A misspelt request parameter ("top_k") answered 3 labels without a word, where the same name on an output
    was a 400 (tryout27). tritonclient's own priority and timeout are taken (hints)."""
    dog = [triton_input(photo_bytes("dog.jpg"))]
    msg = triton_error(lambda: triton.infer("classifier", dog, outputs=triton_outputs(), parameters={"top_k": 5}),
                       "400")
    assert msg == ("bad_request: the request has parameter \"top_k\", which this server does not read there: it takes "
                   "topk, binary_data_output, content_type, priority, timeout; top_k is spelt \"topk\" here"), msg
    msg = triton_error(lambda: triton.infer("classifier", dog, sequence_id=7), "400")
    assert "\"sequence_id\"" in msg and "stateless" in msg, msg
    result = triton.infer("classifier", dog, outputs=triton_outputs(), priority=1, timeout=5_000_000)
    assert [b.decode() for b in result.as_numpy("labels")[0]] == [p["label"] for p in reference["dog.jpg"]]


def test_a_protocol_parameter_in_the_query_string_is_refused_through_tritonclient(triton, reference):
    """``/v2/.../infer?topk=5`` answered 3 labels without a word (the query was never read: found in tryout27's
    follow-up): a protocol parameter there is a 400 saying where it goes; a query parameter that is none of the
    protocol's (tritonclient's ``query_params`` carry a proxy's or gateway's) is left alone."""
    dog = [triton_input(photo_bytes("dog.jpg"))]
    for name in ("topk", "top_k", "binary_data_output", "TOPK", "Topk", "topk[]"):
        msg = triton_error(lambda: triton.infer("classifier", dog, outputs=triton_outputs(), query_params={name: 5}),
                           "400")
        said = name.lower().removesuffix("[]") if name != "top_k" else name
        assert msg == (f"bad_request: {said} is not read from the query string here: the protocol's parameters go in "
                       "the request's JSON, e.g. {\"parameters\": {\"topk\": 5}, \"inputs\": [...]}"), msg
    result = triton.infer("classifier", dog, outputs=triton_outputs(), query_params={"api-version": "2"})
    assert [b.decode() for b in result.as_numpy("labels")[0]] == [p["label"] for p in reference["dog.jpg"]]


def test_unpadded_and_url_safe_base64_are_read_over_http(srv, reference):
    """Go's RawStdEncoding and Rust's NO_PAD send base64 without '=', others the URL-safe alphabet: a 415 told such
    a client to "send base64 in a /v2 JSON request", which it did (tryout27). Both give the padded one's answer."""
    eagle = shared_image("eagle.jpg").read_bytes()
    want = [p["label"] for p in reference["eagle.jpg"]]
    std = base64.b64encode(eagle).decode()
    assert std.endswith("="), "eagle.jpg's length must need padding for this test to mean anything"
    for text in (std.rstrip("="), base64.urlsafe_b64encode(eagle).decode(), base64.urlsafe_b64encode(eagle).decode()
                 .rstrip("=")):
        for params in ({}, {"content_type": "base64"}):
            doc = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [text], "parameters": params}]}
            answer = post_infer(srv, doc)
            assert answer.status_code == 200, answer.text
            labels = next(o for o in answer.json()["outputs"] if o["name"] == "labels")["data"]
            assert labels == want, (labels, text[-4:], params)


def test_gzip_request_body(triton, reference):
    result = triton.infer("classifier", [triton_input(photo_bytes("giraffe.jpg"))], outputs=triton_outputs(),
                          request_compression_algorithm="gzip")
    assert_top3(as_dict(result), reference["giraffe.jpg"])


def test_kserve_rest_client(srv, reference):
    """KServe's SDK, v2 REST, binary input (Content-Type application/octet-stream), JSON outputs."""
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    async def run():
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120))
        try:
            assert await client.is_server_live(srv.url) is True
            assert await client.is_server_ready(srv.url) is True
            assert await client.is_model_ready(srv.url, "classifier") is True
            assert await client.is_model_ready(srv.url, "resnet18") is False
            answers = {}
            for name in PHOTOS:
                inp = InferInput("image", [1], "BYTES")
                inp.set_data_from_numpy(photo_bytes(name), binary_data=True)
                res = await client.infer(srv.url, InferRequest("classifier", [inp], request_id=name),
                                         model_name="classifier")
                assert res.id == name and res.model_name == "efficientnet_lite0"
                answers[name] = {o.name: o.as_numpy() for o in res.outputs}
            return answers
        finally:
            await client.close()

    for name, outputs in asyncio.run(run()).items():
        assert_top3(outputs, reference[name])


# -- bad inputs: the protocol's error shape, the API's status ------------------------------------------------
def post_infer(srv, body, **headers) -> requests.Response:
    kw = {"json": body} if isinstance(body, dict) else {"data": body}  # bytes, or a generator: sent chunked
    return requests.post(srv.url + "/v2/models/classifier/infer", headers=headers, timeout=120, **kw)


def assert_v2_error(resp: requests.Response, status: int, code: str) -> str:
    """The protocol's error body exactly: ``{"error": "<code>: <message>"}``; returns the message."""
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["Content-Type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    assert body["error"].startswith(f"{code}: "), body
    return body["error"].removeprefix(f"{code}: ")


def b64_request(*photos: bytes, content_type: str | None = "base64") -> dict:
    params = {"content_type": content_type} if content_type else {}
    return {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(photos)], "parameters": params,
                        "data": [base64.b64encode(p).decode() for p in photos]}]}


def test_bad_inputs_through_tritonclient(triton):
    dog = shared_image("dog.jpg").read_bytes()
    # An undecodable element fails the request, naming the element.
    msg = triton_error(lambda: triton.infer("classifier", [triton_input(np.array([small_png(), dog[:3000]],
                                                                                  dtype=np.object_))]), "400")
    assert msg.startswith("undecodable_image: image[1]: ")
    # Not an image format at all: 415, as /api/v1/predict.
    msg = triton_error(lambda: triton.infer("classifier", [triton_input(np.array([b"%PDF-1.7\n"], dtype=np.object_))]),
                       "415")
    assert msg.startswith("unsupported_media_type: image[0]: a PDF file")
    # An over-limit photo: too many pixels (read from the header), and too many bytes.
    msg = triton_error(lambda: triton.infer("classifier", [triton_input(np.array([png_declaring(20_000, 20_000)],
                                                                                  dtype=np.object_))]), "413")
    assert msg == "too_large: image[0]: the image is 400,000,000 pixels; the limit is 80,000,000 " \
                  "(CLASSIFIER_MAX_PIXELS)"
    big = np.array([dog + b"\0" * (MAX_UPLOAD + 1 - len(dog))], dtype=np.object_)
    msg = triton_error(lambda: triton.infer("classifier", [triton_input(big)]), "413")
    assert msg == f"too_large: the photos are {MAX_UPLOAD + 1:,} bytes; the limit is {MAX_UPLOAD:,} " \
                  f"(CLASSIFIER_MAX_UPLOAD_BYTES)"
    # A wrong datatype: decoded pixels instead of the photo's bytes.
    pixels = np.zeros((1, 3), dtype=np.float32)
    msg = triton_error(lambda: triton.infer("classifier", [triton_input(pixels, datatype="FP32")]), "400")
    assert msg.startswith('bad_request: input \'image\' is BYTES (encoded photos), not "FP32"')
    # A wrong shape: [1, 1] instead of [N].
    msg = triton_error(lambda: triton.infer("classifier", [triton_input(np.array([[dog]], dtype=np.object_))]),
                       "400")
    assert msg == "bad_request: input 'image' has shape [1, 1]; it takes [N], N photos"
    # Too many photos; an unknown model; an unknown output.
    many = np.array([small_png()] * (MAX_FILES + 1), dtype=np.object_)
    assert triton_error(lambda: triton.infer("classifier", [triton_input(many)]), "413") == \
        f"too_large: {MAX_FILES + 1} photos in one request; the limit is {MAX_FILES} (CLASSIFIER_MAX_FILES)"
    assert triton_error(lambda: triton.infer("resnet18", [triton_input(photo_bytes("dog.jpg"))]), "404") == \
        "not_found: unknown model 'resnet18': this server serves 'efficientnet_lite0' (also as 'classifier')"
    import tritonclient.http as httpclient

    msg = triton_error(lambda: triton.infer("classifier", [triton_input(photo_bytes("dog.jpg"))],
                                            outputs=[httpclient.InferRequestedOutput("logits")]), "400")
    assert msg == 'bad_request: unknown output "logits": this model answers labels, probabilities, indices'


def test_bad_inputs_through_kserve(srv):
    import httpx
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

    async def status_of(inp) -> tuple[int, dict]:
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120))
        try:
            with pytest.raises(httpx.HTTPStatusError) as info:
                await client.infer(srv.url, InferRequest("classifier", [inp]), model_name="classifier")
            return info.value.response.status_code, info.value.response.json()
        finally:
            await client.close()

    broken = InferInput("image", [1], "BYTES")
    broken.set_data_from_numpy(np.array([shared_image("dog.jpg").read_bytes()[:3000]], dtype=np.object_))
    status, body = asyncio.run(status_of(broken))
    assert status == 400 and set(body) == {"error"} and body["error"].startswith("undecodable_image: image[0]: ")
    floats = InferInput("image", [2], "FP32")
    floats.set_data_from_numpy(np.zeros(2, dtype=np.float32))
    status, body = asyncio.run(status_of(floats))
    assert status == 400 and body["error"].startswith("bad_request: input 'image' is BYTES")


def test_size_limits_apply_to_the_decoded_photos(srv, reference):
    """base64 adds a third: a 3.2 MB photo is a 4.3 MB body, over the 4 MB upload limit, and is answered;
    two of them are 6.4 MB of photos, over it, and are 413, however they are encoded."""
    phone = shared_image("phone-12mp.jpg").read_bytes()
    assert len(phone) < MAX_UPLOAD < len(base64.b64encode(phone))
    resp = post_infer(srv, b64_request(phone))
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["outputs"][0]["data"] == [p["label"] for p in reference["phone-12mp.jpg"]]
    over = phone + b"\0" * (MAX_UPLOAD + 1000 - len(phone))  # its base64 fits the body limit, it does not
    msg = assert_v2_error(post_infer(srv, b64_request(over, content_type=None)), 413, "too_large")
    assert msg == f"the photos are about {len(base64.b64encode(over)) // 4 * 3:,} bytes decoded; the limit is " \
                  f"{MAX_UPLOAD:,} (CLASSIFIER_MAX_UPLOAD_BYTES)"
    msg = assert_v2_error(post_infer(srv, b64_request(phone, phone)), 413, "too_large")
    assert msg.endswith(f"the limit is {body_limit(MAX_UPLOAD):,} (CLASSIFIER_MAX_UPLOAD_BYTES, plus a "
                        f"third for base64)"), msg
    # Sent chunked (no Content-Length), the same limit holds once it is passed.
    chunked = post_infer(srv, (b" " * 1_000_000 for _ in range(body_limit(MAX_UPLOAD) // 1_000_000 + 1)))
    assert assert_v2_error(chunked, 413, "too_large").startswith(f"the request is larger than "
                                                                 f"{body_limit(MAX_UPLOAD):,} bytes")
    # A body past what any allowed request needs is refused before it is read.
    assert_v2_error(post_infer(srv, b"{" + b" " * body_limit(MAX_UPLOAD) + b"}"), 413, "too_large")


def test_bad_requests_over_http(srv):
    dog = shared_image("dog.jpg").read_bytes()
    req = b64_request(dog)
    assert_v2_error(post_infer(srv, b"not json"), 400, "bad_request")
    assert_v2_error(post_infer(srv, {**req, "inputs": [{**req["inputs"][0], "shape": [2]}]}), 400, "bad_request")
    assert_v2_error(post_infer(srv, {**req, "inputs": [{**req["inputs"][0], "data": ["%%%"]}]}), 400, "bad_request")
    assert_v2_error(post_infer(srv, {**req, "parameters": {"topk": 11}}), 400, "bad_request")
    # Without content_type, an element that is not base64 is read as its UTF-8 text, and its 415 says so;
    # one that is base64 is not said to be text.
    text = {**req, "inputs": [{**req["inputs"][0], "parameters": {}, "shape": [2],
                               "data": [base64.b64encode(b"%PDF-1.7\n").decode(), "a photo of a cat, sitting."]}]}
    msg = assert_v2_error(post_infer(srv, text), 415, "unsupported_media_type")
    first, second = msg.removeprefix("2 of the 2 photos cannot be used: (1) ").split("; (2) ")  # each one named
    assert first.startswith("image[0]: a PDF file") and "text" not in first, msg
    assert second.startswith("image[1] (not base64, so read as its UTF-8 text): "), msg
    text["inputs"][0]["data"].reverse()
    msg = assert_v2_error(post_infer(srv, text), 415, "unsupported_media_type")
    assert msg.startswith("2 of the 2 photos cannot be used: (1) image[0] (not base64, so read as its UTF-8 text): "
                          "not an image format"), msg
    assert_v2_error(post_infer(srv, {**req, "inputs": [{**req["inputs"][0], "shape": [0], "data": []}]}), 400,
                    "no_file")
    assert_v2_error(post_infer(srv, dog, **{"Content-Type": "image/jpeg"}), 415, "unsupported_media_type")
    head = b'{"inputs":[{"name":"image","datatype":"BYTES","shape":[1],"parameters":{"binary_data_size":9}}]}'
    assert_v2_error(post_infer(srv, head + b"\x05\0\0\0abc", **{"Inference-Header-Content-Length": str(len(head))}),
                    400, "bad_request")
    assert_v2_error(requests.get(srv.url + "/v2/models/classifier/infer", timeout=10), 405, "method_not_allowed")
    assert_v2_error(requests.get(srv.url + "/v2/nothing", timeout=10), 404, "not_found")


def test_metrics_count_the_v2_routes(srv, triton):
    triton.infer("classifier", [triton_input(np.array([small_png()], dtype=np.object_))])
    triton.is_model_ready("classifier")
    text = requests.get(srv.url + "/metrics", timeout=10).text
    from prometheus_client.parser import text_string_to_metric_families

    counts = {(s.labels["endpoint"], s.labels["method"], s.labels["status"], s.labels["code"]): s.value
              for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "classifier_http_requests_total"}
    assert counts[("/v2/models/<name>/infer", "POST", "200", "")] >= 1
    assert counts[("/v2/models/<name>/ready", "GET", "200", "")] >= 1


# -- what the server does not read is said, not ignored (a user's tryout, 2026-12-05) ------------------------
def test_datatype_content_type_and_output_parameters_are_told_what_is_read(srv):
    """Over HTTP, in the protocol's shape: a datatype in lower case was told "not decoded pixels"; base64 strings
    declared ``"content_type": "str"`` a 415 saying to send the file's bytes with curl; an unknown content_type was
    taken as if absent; ``topk`` on an output was ignored (TOP_K labels came back)."""
    dog = shared_image("dog.jpg").read_bytes()
    req = b64_request(dog)
    tensor = req["inputs"][0]
    for wrong, right in (("bytes", "BYTES"), ("Bytes", "BYTES"), ("fp32", "FP32"), ("uint8", "UINT8")):
        msg = assert_v2_error(post_infer(srv, {"inputs": [{**tensor, "datatype": wrong}]}), 400, "bad_request")
        assert msg == f'input \'image\' datatype "{wrong}" is not a datatype; the protocol\'s names are upper case: ' \
                      f'"{right}"'
    msg = assert_v2_error(post_infer(srv, b64_request(dog, content_type="str")), 415, "unsupported_media_type")
    assert msg == 'element 0 of input \'image\' is base64 text of a JPEG, but content_type "str" takes each ' \
                  'string\'s own UTF-8 bytes as the photo: send "content_type": "base64" for base64 strings (or ' \
                  'leave content_type out)'
    msg = assert_v2_error(post_infer(srv, b64_request(dog, content_type="np")), 400, "bad_request")
    assert msg.startswith('input \'image\' content_type "np" is not one this server reads: it reads "base64"'), msg
    msg = assert_v2_error(post_infer(srv, {**req, "outputs": [{"name": "labels", "parameters": {"topk": 5}}]}),
                          400, "bad_request")
    assert msg.startswith("output 'labels' has parameter \"topk\", which this server does not read there: it takes "
                          "binary_data, classification; topk is a request parameter"), msg
    # Where they belong, they are read.
    ok = post_infer(srv, {**req, "parameters": {"topk": 5}, "outputs": [{"name": "labels"}]})
    assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"] == [1, 5], ok.text[:300]


def test_class_count_beside_the_other_outputs(triton, reference):
    """tritonclient's ``class_count`` (sent as the output's ``"classification"``) is honoured on 'probabilities'
    while 'labels' and 'indices' keep the request's ``topk``: one request, both answers."""
    import tritonclient.http as httpclient

    outputs = [httpclient.InferRequestedOutput("labels", binary_data=True),
               httpclient.InferRequestedOutput("probabilities", binary_data=True, class_count=7),
               httpclient.InferRequestedOutput("indices", binary_data=False)]
    assert outputs[1]._get_tensor()["parameters"] == {"classification": 7, "binary_data": True}  # what it sends
    result = triton.infer("classifier", [triton_input(photo_bytes("dog.jpg"))], outputs=outputs,
                          parameters={"topk": 2})
    assert result.as_numpy("labels").shape == (1, 2) and result.as_numpy("indices").shape == (1, 2)
    ranked = [s.decode().split(":", 2) for s in result.as_numpy("probabilities")[0]]
    assert len(ranked) == 7
    assert [(int(i), label) for _, i, label in ranked[:3]] == [(p["index"], p["label"]) for p in reference["dog.jpg"]]
    assert [b.decode() for b in result.as_numpy("labels")[0]] == [p["label"] for p in reference["dog.jpg"][:2]]


def _raw(srv, request: bytes) -> tuple[int, dict, bytes]:
    """Send ``request`` as it is on a new connection; the answer's status, headers (lower-case names), body."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(srv.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                re.search(rb"(?i)\r\ncontent-length: *(\d+)", data).group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, v in
                                      (line.split(":", 1) for line in lines[1:])}, body


# The /v2 operations of the document, each with a URL of it and its method.
V2_OPERATIONS = [("/v2", "/v2", "get"), ("/v2/health/live", "/v2/health/live", "get"),
                 ("/v2/health/ready", "/v2/health/ready", "get"),
                 ("/v2/models/{name}", "/v2/models/classifier", "get"),
                 ("/v2/models/{name}/versions/{version}", "/v2/models/classifier/versions/1", "get"),
                 ("/v2/models/{name}/ready", "/v2/models/classifier/ready", "get"),
                 ("/v2/models/{name}/versions/{version}/ready", "/v2/models/classifier/versions/1/ready", "get"),
                 ("/v2/models/{name}/infer", "/v2/models/classifier/infer", "post"),
                 ("/v2/models/{name}/versions/{version}/infer", "/v2/models/classifier/versions/1/infer", "post")]


def refused_by_gunicorn(method: str, url: str) -> dict[int, bytes]:
    """A request to ``url`` with ``method`` that gunicorn refuses before the app sees it, by the status it answers:
    a Content-Length it cannot parse (400), a request line over its 8190 bytes (414), an Expect it does not know
    (417), more than its 100 header fields (431), a Transfer-Encoding it does not know (501)."""
    line = f"{method.upper()} {url} HTTP/1.1\r\nHost: x\r\n"
    return {400: (line + "Content-Length: abc\r\n\r\n").encode(),
            414: f"{method.upper()} {url}?q={'a' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
            417: (line + "Expect: 200-ok\r\nContent-Length: 0\r\n\r\n").encode(),
            431: (line + "".join(f"X-Field-{i}: {i}\r\n" for i in range(101)) + "\r\n").encode(),
            501: (line + "Transfer-Encoding: foo\r\n\r\n").encode()}


def test_every_status_gunicorn_answers_on_v2_is_documented_for_each_operation(srv):
    """Found by a user: gunicorn refuses a request line over its limit (414), an Expect it does not know (417),
    too many headers (431), in the protocol's shape under /v2, and no operation listed them. Each refusal the
    server really sends, provoked on every /v2 operation: the document lists its status there, with the
    protocol's error body, and the body fits it; so does the 405 of a method the path does not take."""
    import jsonschema

    doc = requests.get(srv.url + "/openapi.json", timeout=10).json()
    error_schema = doc["components"]["schemas"]["V2Error"]
    assert {p for p in doc["paths"] if p.startswith("/v2")} == {p for p, _, _ in V2_OPERATIONS}
    for path, url, method in V2_OPERATIONS:
        answers = {status: _raw(srv, request) for status, request in refused_by_gunicorn(method, url).items()}
        wrong = "POST" if method == "get" else "GET"
        answers[405] = _raw(srv, f"{wrong} {url} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                                 .encode())
        responses = doc["paths"][path][method]["responses"]
        for status, (got, headers, body) in answers.items():
            assert got == status, (path, status, got, body[:200])
            assert headers["content-type"] == "application/json" and headers["x-request-id"], (path, status)
            error = json.loads(body)
            code = {400: "bad_request", 405: "method_not_allowed"}.get(status, "http_error")
            assert set(error) == {"error"} and error["error"].startswith(f"{code}: "), (path, status, error)
            assert str(status) in responses, f"{status} is not documented for {method.upper()} {path}"
            ref = responses[str(status)]["$ref"].rsplit("/", 1)[1]
            schema = doc["components"]["responses"][ref]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/V2Error"}, (path, status, schema)
            jsonschema.validate(error, error_schema)


def test_every_status_gunicorn_answers_before_the_app_is_documented_for_every_operation(srv):
    """Found reviewing the /v2 fix above: gunicorn refuses the same requests on every path, /api/v1's and the
    probes' too, in the API's ``{"error": {"code", "message", "status"}}`` there (webapp/worker.py), and those
    operations listed none of 414, 417, 431, 501 (the GETs not even 400). Each refusal, provoked on every operation
    of the served document (on this module's server: no other started): its status is listed there, the answer
    has the documented content type and ``X-Request-ID``, and its body fits the documented schema."""
    import jsonschema

    doc = requests.get(srv.url + "/openapi.json", timeout=10).json()
    operations = [(path, method) for path, ops in doc["paths"].items() for method in ops]
    assert {p for p, _ in operations} >= {"/api/v1/predict", "/api/v1/models", "/healthz", "/readyz", "/metrics",
                                         "/openapi.json", *(p for p, _, _ in V2_OPERATIONS)}
    for path, method in operations:
        url = path.format(name="classifier", version="1")
        for status, request in refused_by_gunicorn(method, url).items():
            got, headers, body = _raw(srv, request)
            assert got == status, (method, path, status, got, body[:200])
            documented = doc["paths"][path][method]["responses"].get(str(status))
            assert documented, f"{status} is not documented for {method.upper()} {path}"
            response = doc["components"]["responses"][documented["$ref"].rsplit("/", 1)[1]]
            assert headers["content-type"] in response["content"] and headers["x-request-id"], (path, status, headers)
            assert "X-Request-ID" in response["headers"], (path, status)
            schema = response["content"][headers["content-type"]]["schema"]
            jsonschema.validate(json.loads(body), {**schema, "components": doc["components"]})


@pytest.mark.parametrize("url, shown", [(b"/api/v1/predict?topk=\xe4\xb8\x89", "/api/v1/predict?topk=三"),
                                        (b"/v2/models/caf\xc3\xa9/ready", "/v2/models/café/ready"),
                                        (b"/api/v1/predict?x=\xff", "/api/v1/predict?x=\ufffd")])
def test_a_raw_non_ascii_byte_in_the_url_is_said_so(srv, url, shown):
    """Found by a fresh-user tryout: a raw UTF-8 byte in the URL (a hand-made client) got gunicorn's 400 with the
    line shown decoded as Latin-1 ("caf\u00c3\u00a9"). The 400 shows the line as sent and says to percent-encode."""
    status, headers, body = _raw(srv, b"GET " + url + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    message = json.loads(body)["error"]
    message = message["message"] if isinstance(message, dict) else message  # /v2: "code: message"
    assert status == 400 and "bad_request" in body.decode() and headers["x-request-id"]
    assert f"the request line is not ASCII ('GET {shown} HTTP/1.1')" in message and "%C3%A9" in message
