"""Start-up (golden self-test) and encode."""

import time

import pytest
import torch
from PIL import Image, ImageChops, ImageStat

from conftest import shared_image, small_png
from webapp import assets, engine, settings, startup
from webapp.errors import StartupError
from webapp.models import encode
from webapp.service import Classifier


def test_golden_photo_is_the_one_make_golden_cuts(tmp_path):
    made = tmp_path / "dog.jpg"
    assets.make_golden(shared_image("dog.jpg"), made)
    a, b = Image.open(made).convert("RGB"), Image.open(assets.GOLDEN).convert("RGB")
    assert a.size == b.size == (224, 224)
    assert max(ImageStat.Stat(ImageChops.difference(a, b)).mean) < 1.0


def test_self_test_passes_on_real_weights(offline_app):
    clf = offline_app.extensions["classifier"]
    assert clf.ready and clf.self_test["passed"] is True
    assert any(label in clf.self_test["top3"] for label in ("malamute", "German shepherd", "Eskimo dog"))


def test_failed_self_test_never_reports_ready(tmp_path, monkeypatch):
    not_a_dog = tmp_path / "zebra.jpg"
    Image.open(shared_image("giraffe.jpg")).convert("RGB").save(not_a_dog)
    monkeypatch.setattr(startup, "GOLDEN", not_a_dog)
    clf = Classifier(settings.load(environ={}, overrides={"MODEL": "efficientnet_lite0", "COMPILE": False,
                                                          "MAX_BATCH_SIZE": 1}))
    with pytest.raises(StartupError, match="self-test failed"):
        clf.start()
    assert not clf.ready and clf.status == "self-test failed"


def test_a_tiny_request_timeout_bounds_requests_not_the_self_test(make_app, monkeypatch):
    """CLASSIFIER_REQUEST_TIMEOUT_S=0.01 (its documented minimum) failed every start: the self-test ran through the
    batcher under a client's deadline ("InferenceTimeout ... the server is overloaded", exit 3). Start-up has its
    own bound now; requests keep theirs (504)."""
    predict = engine.Engine.predict

    def slow(self, batch):
        time.sleep(0.05)  # past the request timeout on any machine
        return predict(self, batch)

    monkeypatch.setattr(engine.Engine, "predict", slow)
    app = make_app(MODEL="efficientnet_lite0", COMPILE=False, MAX_BATCH_SIZE=1, PRECISION="fp32",
                   REQUEST_TIMEOUT_S=0.01)
    clf = app.extensions["classifier"]
    assert clf.ready and clf.self_test["passed"] is True and clf.batcher.batches >= 1
    resp = app.test_client().post("/api/v1/predict", data=small_png(), content_type="image/png")
    assert resp.status_code == 504 and resp.get_json()["error"]["code"] == "timeout"


def test_self_test_is_skipped_for_untrained_weights(app):
    assert app.extensions["classifier"].self_test == {"skipped": "untrained weights"}


def test_encode_top_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    out = encode(logits, ["a", "b", "c", "d"], topk=3)
    assert [p["label"] for p in out] == ["b", "d", "c"] and [p["index"] for p in out] == [1, 3, 2]
    assert abs(sum(p["probability"] for p in out) - float(torch.softmax(logits, 0)[1:].sum())) < 1e-5
    assert len(encode(logits, list("abcd"), topk=10)) == 4


def test_auto_keeps_bf16_only_if_the_startup_measurement_says_it_pays_off(monkeypatch, tmp_path):
    from webapp import engine

    monkeypatch.setattr(engine, "native_bf16", lambda: True)  # oneDNN claims native bf16...
    monkeypatch.setattr(startup, "judge_bf16", lambda module, photos, **kw: (False, "measured bf16 0.90x fp32", {"speedup": 0.9}))
    # Its own cache folder: the decision is recorded there, and this one is scripted, not measured.
    clf = Classifier(settings.load(environ={}, overrides={"MODEL": "resnet18_seeded", "COMPILE": False,
                                                          "MAX_BATCH_SIZE": 1, "CACHE_DIR": str(tmp_path)}))
    clf.start()
    try:
        health = clf.health()
        assert health["precision"] == "fp32"  # ...but it did not pay off here: fp32, and it says why
        record, = tmp_path.glob("precision-*.json")
        assert health["precision_reason"].startswith(
            f"auto: oneDNN claims native bf16 but measured bf16 0.90x fp32, so fp32 (decided once for this host "
            f"and CPU: {record.name} in CLASSIFIER_CACHE_DIR, measured ")
    finally:
        clf.stop()


def test_photos_on_their_way_stop_counting_on_every_path(app):
    """A request's photos count as on their way to the batcher while they decode (a forming batch waits
    for them); a count left behind by any path would bring the idle wait back for every later request."""
    import socket

    from conftest import small_png
    from webapp.contract import Upload
    from webapp.errors import ClientGone, ServiceError

    clf = app.extensions["classifier"]
    good = Upload("ok.png", small_png())
    with pytest.raises(ServiceError):  # the second photo does not decode: the first stops counting too
        clf.classify([good, Upload("bad.png", b"not an image")], topk=1)
    assert clf.batcher.coming_images == 0
    ours, theirs = socket.socketpair()
    theirs.close()  # the client hung up before its photo was decoded
    try:
        clf.admit({"CONTENT_LENGTH": str(len(good.data)), "gunicorn.socket": ours})
        with pytest.raises(ClientGone):
            clf.classify([good], topk=1)
    finally:
        ours.close()
    assert clf.batcher.coming_images == 0
    answer = clf.classify([good, good], topk=1)  # and the ordinary path: counted, then queued
    assert clf.batcher.coming_images == 0 and clf.health()["coming"] == 0
    assert [r["batch_size"] for r in answer["results"]] == [2, 2]


@pytest.mark.parametrize("idle_s", [0.05, 0])
def test_an_idle_worker_hands_freed_memory_back_after_trim_idle_s(monkeypatch, idle_s):
    from webapp import preload

    trims = []
    monkeypatch.setattr(preload, "trim", lambda: trims.append(1) or True)
    clf = Classifier(settings.load(environ={}, overrides={"MODEL": "resnet18_seeded", "COMPILE": False, "PRECISION": "fp32",
                                                          "MAX_BATCH_SIZE": 1, "TRIM_IDLE_S": idle_s}))
    clf.start()
    try:
        deadline = time.monotonic() + 5
        while idle_s and not trims and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert len(trims) == (1 if idle_s else 0)  # once per idle spell; 0: never
    finally:
        clf.stop()
