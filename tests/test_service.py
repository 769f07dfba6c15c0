"""Start-up (golden self-test) and encode."""

import pytest
import torch
from PIL import Image, ImageChops, ImageStat

from conftest import shared_image
from webapp import assets, service, settings
from webapp.errors import StartupError
from webapp.service import Classifier, encode


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
    monkeypatch.setattr(service, "GOLDEN", not_a_dog)
    clf = Classifier(settings.load(environ={}, overrides={"MODEL": "efficientnet_lite0", "COMPILE": False,
                                                          "MAX_BATCH_SIZE": 1}))
    with pytest.raises(StartupError, match="self-test failed"):
        clf.start()
    assert not clf.ready and clf.status == "self-test failed"


def test_self_test_is_skipped_for_untrained_weights(app):
    assert app.extensions["classifier"].self_test == {"skipped": "untrained weights"}


def test_encode_top_k():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    out = encode(logits, ["a", "b", "c", "d"], topk=3)
    assert [p["label"] for p in out] == ["b", "d", "c"] and [p["index"] for p in out] == [1, 3, 2]
    assert abs(sum(p["probability"] for p in out) - float(torch.softmax(logits, 0)[1:].sum())) < 1e-5
    assert len(encode(logits, list("abcd"), topk=10)) == 4


def test_auto_keeps_bf16_only_if_the_startup_measurement_says_it_pays_off(monkeypatch):
    from webapp import engine

    monkeypatch.setattr(engine, "native_bf16", lambda: True)  # oneDNN claims native bf16...
    monkeypatch.setattr(service, "bf16_pays_off", lambda module, batch: (False, "measured bf16 0.90x fp32"))
    clf = Classifier(settings.load(environ={}, overrides={"MODEL": "resnet18_seeded", "COMPILE": False,
                                                          "MAX_BATCH_SIZE": 1}))
    clf.start()
    try:
        health = clf.health()
        assert health["precision"] == "fp32"  # ...but it did not pay off here: fp32, and it says why
        assert "claims native bf16" in health["precision_reason"] and "0.90x" in health["precision_reason"]
    finally:
        clf.stop()


def test_bf16_measurement_reports_speed_and_fidelity():
    import torchvision

    from webapp.engine import bf16_pays_off

    torch.manual_seed(0)
    ok, reason = bf16_pays_off(torchvision.models.resnet18().eval(), torch.randn(2, 3, 224, 224), runs=1)
    assert isinstance(ok, bool) and "x fp32" in reason and "logit error" in reason and "top-1" in reason
