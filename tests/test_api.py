"""The JSON API through Flask's test client: answers, statuses and error bodies."""

import io
import os
import time

import pytest
from PIL import Image

from conftest import DOG_BREEDS, png_bytes, shared_image, small_png
from webapp import imaging
from webapp.errors import Overloaded


def assert_error(resp, status, code):
    assert resp.status_code == status, resp.get_data(as_text=True)
    body = resp.get_json()
    assert body["error"]["status"] == status and body["error"]["code"] == code and body["error"]["message"]
    return body["error"]["message"]


def test_predict_multipart_shape(client):
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(small_png()), "red.png")})
    assert resp.status_code == 200
    body = resp.get_json()
    assert body["model"]["name"] == "resnet18_seeded" and body["model"]["untrained"] is True
    (result,) = body["results"]
    assert result["filename"] == "red.png" and len(result["predictions"]) == 3
    probs = [p["probability"] for p in result["predictions"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.0001
    for p in result["predictions"]:
        assert set(p) == {"label", "index", "probability"} and 0 <= p["index"] < 1000
    assert set(body["timing_ms"]) == {"decode", "queue", "inference", "total"}
    assert all(v >= 0 for v in body["timing_ms"].values())


@pytest.mark.parametrize("path, allowed", [("/api/v1/predict", {"POST", "OPTIONS"}),
                                           ("/", {"GET", "HEAD", "POST", "OPTIONS"}),
                                           ("/metrics", {"GET", "HEAD", "OPTIONS"})])
def test_options_says_allow_with_no_content(client, path, allowed):
    """Found by a fresh-user tryout: OPTIONS got Flask's 200 with an empty text/html body. RFC 9110 9.3.7: the
    answer is the Allow header; 204, nothing else."""
    resp = client.open(path, method="OPTIONS")
    assert resp.status_code == 204 and resp.data == b"" and "Content-Type" not in resp.headers
    assert set(resp.headers["Allow"].split(", ")) == allowed


@pytest.mark.parametrize("path", ["/api/v1//predict", "/api/v1/predict//", "/v2/models/resnet18_seeded//infer",
                                  "/v2/models//infer"])
def test_a_doubled_slash_is_a_404_not_a_redirect(client, path):
    """Found by a fresh-user tryout: Werkzeug answered "/api/v1//predict" with a 308 HTML redirect built from the
    Host header (undocumented), and "/v2/models//infer" with a 405; a path that is no route is a 404 in the API's
    shape (the protocol's under /v2)."""
    resp = client.post(path, data=small_png(), content_type="image/png")
    error = resp.get_json()["error"]
    assert resp.status_code == 404 and "Location" not in resp.headers
    assert error["code"] == "not_found" if isinstance(error, dict) else error.startswith("not_found: ")


@pytest.mark.parametrize("field", ["original_width", "original_bytes"])
def test_an_original_field_in_the_query_is_a_400(client, field):
    """Found by a fresh-user tryout: ``?original_width=4000`` was ignored without a word (it is a form field)."""
    resp = client.post(f"/api/v1/predict?{field}=4000", data={"file": (io.BytesIO(small_png()), "a.png")})
    error = resp.get_json()["error"]
    assert resp.status_code == 400 and error["code"] == "bad_request"
    assert error["message"].startswith(f"{field} is a multipart form field, not a query parameter")


def test_predict_raw_body_and_topk(client):
    resp = client.post("/api/v1/predict?topk=7", data=small_png(), content_type="image/png")
    assert resp.status_code == 200
    assert len(resp.get_json()["results"][0]["predictions"]) == 7


def test_a_raw_bodys_filename_is_upload_or_its_x_filename(client):
    """The README's promise: ``upload``, or the ``X-Filename`` header where one is sent."""
    plain = client.post("/api/v1/predict", data=small_png(), content_type="image/png")
    named = client.post("/api/v1/predict", data=small_png(), content_type="image/png",
                        headers={"X-Filename": "eagle.jpg"})
    assert plain.get_json()["results"][0]["filename"] == "upload"
    assert named.get_json()["results"][0]["filename"] == "eagle.jpg"


def test_several_files_keep_their_order_and_names(client):
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    files = [(io.BytesIO(small_png(c)), f"{i}.png") for i, c in enumerate(colors)]
    resp = client.post("/api/v1/predict", data={"file": files})
    assert resp.status_code == 200
    results = resp.get_json()["results"]
    assert [r["filename"] for r in results] == ["0.png", "1.png", "2.png"]
    singles = [client.post("/api/v1/predict", data=small_png(c), content_type="image/png").get_json()
               for c in colors]
    for r, single in zip(results, singles):  # batched answers equal one-by-one answers
        assert [p["index"] for p in r["predictions"]] == [p["index"] for p in single["results"][0]["predictions"]]


def test_a_request_whose_photos_cannot_be_read_names_each_of_them(client):
    """8 photos, 2 of them cut short: the 400 named only the first, and the mended request was refused again for the
    second (tryout32). Every such photo is named, in request order; the status and code are the first one's."""
    good, jpeg = small_png(), shared_image("dog.jpg").read_bytes()
    files = [(io.BytesIO(good), "a.png"), (io.BytesIO(jpeg[:5000]), "cut.jpg"), (io.BytesIO(good), "b.png"),
             (io.BytesIO(b"just some text"), "notes.jpg"), (io.BytesIO(good), "c.png")]
    message = assert_error(client.post("/api/v1/predict", data={"file": files}), 400, "undecodable_image")
    one = assert_error(client.post("/api/v1/predict", data=jpeg[:5000], content_type="image/jpeg",
                                   headers={"X-Filename": "cut.jpg"}), 400, "undecodable_image")
    other = assert_error(client.post("/api/v1/predict", data=b"just some text", content_type="image/jpeg",
                                     headers={"X-Filename": "notes.jpg"}), 415, "unsupported_media_type")
    assert message == f"2 of the 5 photos cannot be used: (1) {one}; (2) {other}"
    # the other way round: the first one's status and code
    files = [(io.BytesIO(b"just some text"), "notes.jpg"), (io.BytesIO(jpeg[:5000]), "cut.jpg")]
    assert "cut.jpg" in assert_error(client.post("/api/v1/predict", data={"file": files}), 415, "unsupported_media_type")
    # one alone is said as before, and so is a request whose other photos are fine
    files = [(io.BytesIO(good), "a.png"), (io.BytesIO(jpeg[:5000]), "cut.jpg")]
    assert assert_error(client.post("/api/v1/predict", data={"file": files}), 400, "undecodable_image") == one


@pytest.mark.parametrize("topk", ["0", "11", "abc", "-1", "2.5", "%203x", "3_0", "\u0663", "\uff13", "%2B3", "9" * 5000,
                                  "-" + "9" * 5000, "0" * 5000 + "11"])
def test_bad_topk_is_400(client, topk):
    resp = client.post(f"/api/v1/predict?topk={topk}", data=small_png(), content_type="image/png")
    assert "topk" in assert_error(resp, 400, "bad_request")


@pytest.mark.parametrize("topk, said", [("0", "got 0"), ("-1", "got -1"), ("1000000", "got 1000000"),
                                        ("abc", "got 'abc'"), ("9" * 50, "got " + "9" * 40 + "...")])
def test_a_bad_topk_is_quoted_only_where_it_is_not_a_number(client, topk, said):
    """0 and -1 were said bare, 1000000 quoted (tryout13): a number is said as one, anything else quoted."""
    resp = client.post(f"/api/v1/predict?topk={topk}", data=small_png(), content_type="image/png")
    assert assert_error(resp, 400, "bad_request") == f"topk must be an integer from 1 to 10, {said}"


def test_whitespace_around_a_number_field_is_dropped(client):
    """curl -F 'topk=<k.txt' (the way the 400 for a file part says to send a field from a file) sends the file's
    final newline: "5\n" was a 400, while original_format's spaces were already dropped."""
    photo = (io.BytesIO(small_png()), "a.png")
    resp = client.post("/api/v1/predict", data={"file": photo, "topk": "5\n"})
    assert resp.status_code == 200 and len(resp.get_json()["results"][0]["predictions"]) == 5
    assert len(client.post("/api/v1/predict?topk=%202%20", data=small_png(), content_type="image/png")
               .get_json()["results"][0]["predictions"]) == 2
    fields = {"original_width": " 4032\n", "original_height": "3024\r\n", "original_format": "JPEG\n",
              "original_bytes": "\t3000000"}
    body = client.post("/api/v1/predict", data={"file": (io.BytesIO(small_png()), "b.png"), **fields}).get_json()
    assert (body["results"][0]["width"], body["results"][0]["height"], body["results"][0]["bytes"]) == \
        (4032, 3024, 3000000)


def test_no_file_part_is_400(client):
    resp = client.post("/api/v1/predict", data={"image": (io.BytesIO(small_png()), "x.png")})
    assert "'file'" in assert_error(resp, 400, "no_file")


def test_empty_file_part_is_400(client):
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(b""), "")})
    assert_error(resp, 400, "no_file")
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(b""), "empty.jpg")})
    assert "empty" in assert_error(resp, 400, "no_file")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_post_with_no_body_is_400_no_file(client, content_type):
    """`curl -X POST .../predict`: nothing was sent, so no photo (400 no_file), not an unsupported type (415)."""
    headers = {"Content-Type": content_type} if content_type else {}
    resp = client.post("/api/v1/predict", headers=headers)
    assert assert_error(resp, 400, "no_file") == ("no image: the request has no body; send the photo as multipart "
                                                  "field 'file', or as the raw body with Content-Type image/*")
    resp = client.post("/api/v1/predict", headers=headers, environ_overrides={"CONTENT_LENGTH": ""})
    assert_error(resp, 400, "no_file")  # no Content-Length and not chunked: no body either


def test_not_an_image_is_415(client):
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(b"%PDF-1.7\n..."), "doc.jpg")},
                       content_type="multipart/form-data")
    assert "PDF" in assert_error(resp, 415, "unsupported_media_type")
    resp = client.post("/api/v1/predict", data=b"just some text", content_type="image/jpeg")
    assert_error(resp, 415, "unsupported_media_type")


def test_wrong_raw_content_type_is_415(client):
    resp = client.post("/api/v1/predict", data=small_png(), content_type="text/plain")
    assert "Content-Type text/plain" in assert_error(resp, 415, "unsupported_media_type")


def test_truncated_image_is_400(client):
    data = shared_image("dog.jpg").read_bytes()
    resp = client.post("/api/v1/predict", data=data[: len(data) // 2], content_type="image/jpeg")
    assert_error(resp, 400, "undecodable_image")


def test_one_bad_file_fails_the_request_and_names_it(client):
    files = [(io.BytesIO(small_png()), "good.png"), (io.BytesIO(b"nope"), "bad.png")]
    resp = client.post("/api/v1/predict", data={"file": files})
    assert "bad.png" in assert_error(resp, 415, "unsupported_media_type")


@pytest.fixture(scope="module")
def small_limits_app(make_module_app):
    return make_module_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=2, MAX_UPLOAD_BYTES=4096,
                           MAX_FILES=2, MAX_PIXELS=10_000)


def test_too_large_is_413(small_limits_app):
    client = small_limits_app.test_client()
    big = png_bytes(Image.effect_noise((64, 64), 100).convert("RGB"))
    assert len(big) > 4096
    resp = client.post("/api/v1/predict", data=big, content_type="image/png")
    said = assert_error(resp, 413, "too_large")
    assert said.startswith(f"the upload is {len(big):,} bytes; the limit is 4,096 (CLASSIFIER_MAX_UPLOAD_BYTES): ")
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(big), "big.png")})
    assert "; the limit is 4,096 (" in assert_error(resp, 413, "too_large")  # the whole form's bytes
    files = [(io.BytesIO(small_png(size=(8, 8))), f"{i}.png") for i in range(3)]
    assert "limit is 2" in assert_error(client.post("/api/v1/predict", data={"file": files}), 413, "too_large")
    resp = client.post("/api/v1/predict", data=small_png(size=(200, 60)), content_type="image/png")
    assert "pixels" in assert_error(resp, 413, "too_large")


def test_queue_full_is_429_with_retry_after(app, client, monkeypatch):
    batcher = app.extensions["classifier"].batcher

    def full(tensors, gone=None, coming=None, timeout=None):
        raise Overloaded("server busy", headers={"Retry-After": "3"})

    monkeypatch.setattr(batcher, "submit", full)
    resp = client.post("/api/v1/predict", data=small_png(), content_type="image/png")
    assert_error(resp, 429, "overloaded")
    assert resp.headers["Retry-After"] == "3"


def test_timeout_is_504(app, client, monkeypatch):
    batcher = app.extensions["classifier"].batcher
    monkeypatch.setattr(batcher, "request_timeout", 0.0)
    resp = client.post("/api/v1/predict", data=small_png(), content_type="image/png")
    assert_error(resp, 504, "timeout")


def test_inference_failure_is_500_without_traceback(app, client, monkeypatch):
    batcher = app.extensions["classifier"].batcher

    def broken(batch):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(batcher, "predict", broken)
    resp = client.post("/api/v1/predict", data=small_png(), content_type="image/png")
    message = assert_error(resp, 500, "inference_failed")
    assert "secret" not in resp.get_data(as_text=True) and "Traceback" not in message
    monkeypatch.undo()
    assert client.post("/api/v1/predict", data=small_png(), content_type="image/png").status_code == 200


def test_not_ready_is_503(app, client, monkeypatch):
    clf = app.extensions["classifier"]
    monkeypatch.setattr(clf, "_ready", False)
    resp = client.post("/api/v1/predict", data=small_png(), content_type="image/png")
    assert_error(resp, 503, "not_ready")
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.get_json()["ready"] is False
    assert client.get("/healthz").status_code == 200  # alive, just not ready


def test_healthz_and_readyz(client):
    health = client.get("/healthz").get_json()
    assert health["ready"] is True and health["pid"] > 0 and health["cores"] and health["intra_op_threads"] >= 1
    assert health["model"]["name"] == "resnet18_seeded" and health["precision"] == "fp32"
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.get_json()["ready"] is True


def test_unknown_route_and_method_are_json(client):
    assert_error(client.get("/api/v1/nope"), 404, "not_found")
    assert_error(client.get("/api/v1/predict"), 405, "method_not_allowed")


def test_a_405_says_which_methods_the_route_takes(client):
    """RFC 9110 15.5.6: a 405 carries ``Allow``; the message names the methods in words too."""
    resp = client.get("/api/v1/predict")
    assert resp.status_code == 405 and "POST" in resp.headers["Allow"].split(", ")
    message = resp.get_json()["error"]["message"]
    assert message == "GET is not allowed on /api/v1/predict; it takes POST", message


def test_real_model_names_the_photos(offline_client):
    """The offline real-weight model through the API: the shared photos get their expected labels."""
    expect = {"dog.jpg": set(DOG_BREEDS), "eagle.jpg": {21, 22}, "giraffe.jpg": {340}}
    files = [(shared_image(name).open("rb"), name) for name in expect]
    body = offline_client.post("/api/v1/predict", data={"file": files}).get_json()
    assert body["model"]["name"] == "efficientnet_lite0" and body["model"]["fallback"] is False
    for result in body["results"]:
        top3 = {p["index"] for p in result["predictions"]}
        assert top3 & expect[result["filename"]], (result["filename"], result["predictions"])


@pytest.mark.parametrize("name, size", [("dog.jpg", (768, 576)), ("phone-12mp.jpg", (4032, 3024)),
                                        ("phone-12mp-exif-rotated.jpg", (4032, 3024))])
def test_reported_size_is_the_upright_photo_not_the_fast_decode(client, name, size):
    resp = client.post("/api/v1/predict", data=shared_image(name).read_bytes(), content_type="image/jpeg")
    result = resp.get_json()["results"][0]
    assert (result["width"], result["height"]) == size


def test_models_lists_every_model_and_marks_the_serving_one(client):
    body = client.get("/api/v1/models").get_json()
    assert body["requested"] == body["serving"] == "resnet18_seeded"
    models = {m["name"]: m for m in body["models"]}
    assert list(models) == ["resnet18", "efficientnet_lite0", "resnet18_seeded"]
    assert [m["name"] for m in body["models"] if m["serving"]] == ["resnet18_seeded"]
    for m in models.values():
        assert m["categories"] == 1000 and m["input_size"] == 224 and m["precision"] == "fp32"
        assert m["title"] and m["description"]
    serving = models["resnet18_seeded"]
    assert serving["weights"] == "random, seed 0" and serving["untrained"] is True and serving["fallback"] is False
    assert "untrained" in serving["note"] and serving["compiled"] is False
    assert "weights" not in models["resnet18"] and "weights" not in models["efficientnet_lite0"]


def test_models_names_the_fallback(tmp_path, monkeypatch, make_app):
    """No ResNet-18 weights anywhere: the list says resnet18 was asked for and the offline model serves."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty hub cache
    app = make_app(MODEL="resnet18", DOWNLOAD=False, COMPILE=False, MAX_BATCH_SIZE=1, PRECISION="fp32")
    body = app.test_client().get("/api/v1/models").get_json()
    assert body["requested"] == "resnet18" and body["serving"] == "efficientnet_lite0"
    models = {m["name"]: m for m in body["models"]}
    assert models["resnet18"]["serving"] is False and models["efficientnet_lite0"]["serving"] is True
    lite = models["efficientnet_lite0"]
    assert lite["fallback"] is True and "ResNet-18 weights not found" in lite["note"]
    assert lite["weights"] == "efficientnet-lite0-57934424.pth" and lite["untrained"] is False
    # What clients read names no folder of the server: not the hub cache of the note, not the precision record's
    # (cache folder) in /healthz's reason, not where the weights are (tmp_path holds them all here).
    client = app.test_client()
    answer = client.post("/api/v1/predict", data=small_png(), content_type="image/png")
    assert answer.status_code == 200 and "$TORCH_HOME/hub/checkpoints" in answer.get_json()["model"]["note"]
    for text in [answer.get_data(as_text=True), *(client.get(u).get_data(as_text=True)
                                                  for u in ("/api/v1/models", "/healthz", "/readyz", "/"))]:
        assert str(tmp_path) not in text and "/root/" not in text and os.path.expanduser("~/") not in text, text


def test_openapi_document_is_served(client):
    resp = client.get("/openapi.json")
    assert resp.status_code == 200 and resp.mimetype == "application/json"
    doc = resp.get_json()
    assert doc["openapi"].startswith("3.") and "/api/v1/predict" in doc["paths"]
    assert resp.headers["X-Request-ID"]


def test_uploads_never_touch_the_disk(client, monkeypatch):
    """Werkzeug spools file parts over 500 KB to temporary files by default; ours stay in memory."""
    import tempfile

    import werkzeug.formparser

    def no_disk(*args, **kwargs):
        raise AssertionError("an upload was about to be written to a temporary file")

    for module in (tempfile, werkzeug.formparser):  # the parser holds its own references
        for name in ("SpooledTemporaryFile", "TemporaryFile", "NamedTemporaryFile"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, no_disk)
    big = shared_image("kite.jpg").read_bytes()  # 1.4 MB: well over Werkzeug's 500 KB spooling threshold
    assert len(big) > 1_000_000
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(big), "kite.jpg")})
    assert resp.status_code == 200, resp.get_data(as_text=True)


def test_topk_also_as_a_multipart_form_field(client):
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(small_png()), "x.png"), "topk": "5"})
    assert resp.status_code == 200 and len(resp.get_json()["results"][0]["predictions"]) == 5
    resp = client.post("/api/v1/predict", data={"file": (io.BytesIO(small_png()), "x.png"), "topk": "abc"})
    assert_error(resp, 400, "bad_request")


@pytest.mark.parametrize("path", ["/api/v1/predict", "/"])
def test_not_ready_and_overloaded_are_answered_before_the_body_is_read(app, client, monkeypatch, path):
    from webapp import api, errors, ui

    def never(*args, **kwargs):
        raise AssertionError("the body was read before the refusal")

    monkeypatch.setattr(api, "read_uploads", never)
    monkeypatch.setattr(ui, "read_uploads", never)
    clf = app.extensions["classifier"]
    for refusal, status in ((errors.Overloaded("full", headers={"Retry-After": "2"}), 429),
                            (errors.NotReady("warming", headers={"Retry-After": "5"}), 503)):
        def admit(n=1, refusal=refusal):
            raise refusal

        monkeypatch.setattr(clf, "admit", admit)
        resp = client.post(path, data={"file": (io.BytesIO(small_png()), "x.png"), "topk": "3"},
                           headers={"Accept": "application/json"})
        assert resp.status_code == status and resp.headers["Retry-After"] in ("2", "5")


def test_topk_the_query_wins_over_the_form_and_empty_means_the_default(client):
    """What the README says of ``topk``: query over form field, first of repeated values, empty = TOP_K (3)."""
    from conftest import encode
    from PIL import Image

    photo = encode(Image.new("RGB", (64, 48), (200, 120, 40)), "JPEG", quality=90)

    def labels(url, **form):
        resp = client.post(url, data={"file": (io.BytesIO(photo), "p.jpg"), **form}, content_type="multipart/form-data")
        assert resp.status_code == 200, resp.get_json()
        return len(resp.get_json()["results"][0]["predictions"])

    assert labels("/api/v1/predict?topk=2", topk="5") == 2
    assert labels("/api/v1/predict", topk="5") == 5
    assert labels("/api/v1/predict?topk=4&topk=9") == 4
    assert labels("/api/v1/predict?topk=") == 3
    assert labels("/api/v1/predict", topk="") == 3


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_decode_past_the_request_timeout_says_so(make_app, monkeypatch, fmt):
    """A 504 that came while its photos were still being decoded said "the server is overloaded": wrong for one
    slow-to-decode photo on an idle server. It says what was still going on, and both possible causes; a slow
    lossless format only where the request has one (small JPEGs were told of "large PNG, TIFF or WebP images")."""
    prepare = imaging.prepare

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return prepare(*args, **kwargs)

    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, PRECISION="fp32", REQUEST_TIMEOUT_S=0.1)
    monkeypatch.setattr(imaging, "prepare", slow)
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, fmt)
    resp = app.test_client().post("/api/v1/predict", data=buf.getvalue(), content_type=f"image/{fmt.lower()}")
    msg = assert_error(resp, 504, "timeout")
    assert "still being decoded" in msg and "CLASSIFIER_REQUEST_TIMEOUT_S" in msg and "fewer or smaller" in msg
    if fmt == "PNG":
        assert "the server is busy, or its PNG images are slow to decode" in msg, msg
    else:
        assert "slow to decode" not in msg and "PNG" not in msg and "the server is busy: try again later" in msg, msg


@pytest.mark.parametrize("how", ["raw", "multipart"])
def test_original_fields_in_the_query_string_are_refused_not_ignored(client, how):
    """``?original_width=4032&...`` beside a raw body was ignored without a word: the answer described the copy
    sent, while the client believed it described the original."""
    query = "original_width=4032&original_height=3024&original_format=JPEG&original_bytes=3000000"
    if how == "raw":
        resp = client.post(f"/api/v1/predict?{query}", data=small_png(), content_type="image/png")
    else:
        resp = client.post(f"/api/v1/predict?{query}", data={"file": (io.BytesIO(small_png()), "a.png")})
    msg = assert_error(resp, 400, "bad_request")
    assert "original_width" in msg and "query" in msg and "multipart form field" in msg


def test_more_photos_than_the_queue_holds_is_413_not_a_429_for_ever(make_app):
    """A request's images are queued together: 3 photos with QUEUE_SIZE=2 got "429 server busy: 0 images queued
    (limit 2); try again in 1 s" on an idle server, every time (tryout18). It can never be served: 413, saying
    how many to send; 2 photos are answered."""
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=2, PRECISION="fp32", QUEUE_SIZE=2)
    client = app.test_client()

    def photos(n):
        return {"file": [(io.BytesIO(small_png()), f"p{i}.png") for i in range(n)]}

    msg = assert_error(client.post("/api/v1/predict", data=photos(3)), 413, "too_large")
    assert msg == ("3 photos in one request, and this server queues at most 2 images (CLASSIFIER_QUEUE_SIZE): send "
                   "at most 2 per request"), msg
    assert client.post("/api/v1/predict", data=photos(2)).status_code == 200
