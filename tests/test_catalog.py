"""The model catalog (webapp/catalog.py) is the one home of each model's name, title and sizes:
what it says must be what the builders build, and every reader takes it from there."""

import sys

import pytest

from webapp import catalog, models, settings


@pytest.mark.parametrize("entry", catalog.MODELS, ids=lambda m: m.name)
def test_catalog_says_what_the_builder_builds(entry, tmp_path, monkeypatch):
    if entry.name == "resnet18":  # no real weights here: a ResNet-18 state dict stands in for the found file
        import torch
        import torchvision

        path = tmp_path / "resnet18-f37072fd.pth"
        torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
        monkeypatch.setattr(models, "resolve_resnet18_weights", lambda s: (path, []))
    built = models.BUILDERS[entry.name](settings.load(environ={}, overrides={"MODEL": entry.name, "DOWNLOAD": False}))
    assert built.name == entry.name and built.title == entry.title and built.fallback_reason is None
    assert built.preprocessing.crop == entry.input_size and built.preprocessing.resize == entry.resize_size
    assert len(built.categories) == entry.categories and built.untrained == entry.untrained
    # The filter a client must scale with to hand the server its own pixels (the page's static/resample.js)
    assert built.preprocessing.interpolation.value == entry.send_resample == "bilinear"


def test_resnet18_sizes_are_torchvisions_own():
    t = models.RESNET18_WEIGHTS.transforms()
    assert (catalog.entry("resnet18").input_size, catalog.entry("resnet18").resize_size) == \
        (t.crop_size[0], t.resize_size[0])


def test_every_catalog_name_has_a_builder_and_no_other():
    assert set(models.BUILDERS) == set(catalog.NAMES)
    assert catalog.DEFAULT in catalog.NAMES and catalog.OFFLINE in catalog.NAMES


def test_the_settings_table_reads_the_catalog():
    model = settings.BY_NAME["MODEL"]
    assert model.choices == catalog.NAMES and model.default == catalog.DEFAULT
    for m in catalog.MODELS:
        assert f"{m.name}: {m.summary}" in model.help


def test_unknown_model_names_the_known_ones():
    with pytest.raises(KeyError, match="resnet18, efficientnet_lite0, resnet18_seeded"):
        catalog.entry("resnet50")


def test_api_lists_the_catalog(client):
    body = client.get("/api/v1/models").get_json()
    assert [(m["name"], m["input_size"], m["categories"]) for m in body["models"]] == \
        [(m.name, m.input_size, m.categories) for m in catalog.MODELS]
    # The size worth sending (the page scales photos to it in the browser) and the filter to scale with:
    # the model's own resize, so that the copy is the image the server itself would make.
    assert [(m["send_short_side"], m["send_resample"]) for m in body["models"]] == \
        [(m.resize_size, "bilinear") for m in catalog.MODELS] == [(256, "bilinear")] * 3
    titles = {m["name"]: m["title"] for m in body["models"] if not m["serving"]}
    assert titles == {m.name: m.title for m in catalog.MODELS if m.name in titles}


def test_catalog_and_settings_import_no_torch():
    import subprocess

    code = "import sys, webapp.catalog, webapp.settings, webapp.errors; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("model", [m.name for m in catalog.MODELS])
def test_a_weights_file_another_model_does_not_read_is_said(model):
    """CLASSIFIER_WEIGHTS beside a model that brings its own weights was ignored without a word."""
    def load(**env):
        return settings.load(environ={"CLASSIFIER_MODEL": model, "CLASSIFIER_DOWNLOAD": "0", **env})

    assert catalog.unused_weights(load()) is None  # not set: nothing to say
    said = catalog.unused_weights(load(CLASSIFIER_WEIGHTS="/srv/w.pth"))
    if model == "resnet18":
        assert said is None
        return
    assert said == (f"CLASSIFIER_WEIGHTS=/srv/w.pth is not used: it is read for CLASSIFIER_MODEL=resnet18 only, and "
                    f"CLASSIFIER_MODEL={model} serves its own weights; unset CLASSIFIER_WEIGHTS, or set "
                    f"CLASSIFIER_MODEL=resnet18")
    assert said in models.explain_resolution(load(CLASSIFIER_WEIGHTS="/srv/w.pth"))["would_serve"]  # webapp info
    # classify's flags named as flags (they were named as the variables the user never set)
    flags = settings.load({}, {"MODEL": model, "WEIGHTS": "/srv/w.pth"}, {"MODEL": "--model", "WEIGHTS": "--weights"})
    assert catalog.unused_weights(flags) == (
        f"--weights=/srv/w.pth is not used: it is read for --model=resnet18 only, and --model={model} serves its own "
        f"weights; leave out --weights, or set --model=resnet18")


def test_outside_gunicorn_building_the_model_says_the_weights_are_not_used(monkeypatch, caplog):
    """The CLI (classify, warm) and Ray build the model themselves: ``load_model`` says it there, once; under gunicorn
    the master does (tests/test_lifecycle.py), so its workers do not repeat it."""
    import logging

    s = settings.load(environ={}, overrides={"MODEL": "efficientnet_lite0", "WEIGHTS": "/srv/w.pth"})
    monkeypatch.delenv(settings.GUNICORN_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="webapp"):
        models.load_model(s)
    assert [r.getMessage() for r in caplog.records] == [catalog.unused_weights(s)]
    caplog.clear()
    monkeypatch.setenv(settings.GUNICORN_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="webapp"):
        models.load_model(s)
    assert caplog.records == []
