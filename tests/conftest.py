"""Shared fixtures: ``app``/``client`` (seeded ResNet-18, eager: fast), ``offline_app``/``offline_client``
(the real-weight offline model, eager), ``make_app``/``make_module_app`` (an app with your settings, stopped
at teardown), and the shared photos in ``../shared/images``; helpers every test file may import.

Markers (pytest.ini): every test is of one kind. ``server`` (starts a real gunicorn or another subprocess
server), ``cli`` (runs ``python -m webapp ...`` in a child process: seconds each where it imports torch),
``cluster`` (Ray), ``browser`` (Chromium) and ``slow`` (in-process, but compiles or
quantizes a model: minutes on a small box) are set by the test module (``pytestmark``) or the test; a
test with none of them is ``unit`` (``pytest_collection_modifyitems`` below adds the mark). The fast
subset is ``python -m pytest -m unit``; a plain ``python -m pytest`` runs every kind.

``extended`` is not a kind but a tier, set beside a test's kind (any but ``unit``): the
expensive checks of rare paths (more precisions, more signals, repeated runs of a once-seen race, refusals
of rare inputs that cost a server or a command's start) that would push the plain run past ~10 minutes on 2 cores. The plain run skips them, saying how to run them:
``python -m pytest -m extended`` (CI runs that as its own step, so every test still runs in CI).
"""

from __future__ import annotations

import io
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED_IMAGES = ROOT.parent / "shared" / "images"


def shared_image(name: str) -> Path:
    """Path of a shared photo; skips the test (with the reason) when ../shared/images is absent."""
    path = SHARED_IMAGES / name
    if not path.is_file():
        pytest.skip(f"{path} is absent (the shared photos live in ../shared/images)")
    return path


KINDS = ("unit", "slow", "server", "cli", "cluster", "browser", "kit")  # registered in pytest.ini (so is extended: a tier)


def pytest_collection_modifyitems(config, items):
    """Give each test its kind: ``unit`` where none of the others is set; two kinds on one test is an error.

    ``kit`` tests (tests/test_kit.py: builds and installs the multi-GB air-gapped kit) run only when
    the ``-m`` expression names ``kit``; ``extended`` tests only when it names ``extended``; in every
    other run they are skipped, saying how to run them. ``extended`` on a test with no expensive kind
    is an error: ``unit`` stays the fast in-process subset, and a quick test has no reason to leave the plain run.
    """
    markexpr = config.getoption("markexpr", "") or ""
    kit_asked, extended_asked = "kit" in markexpr, "extended" in markexpr
    for item in items:
        kinds = {m.name for m in item.iter_markers() if m.name in KINDS}
        extended = item.get_closest_marker("extended") is not None
        if not kinds:
            if extended:
                raise pytest.UsageError(f"{item.nodeid} is marked extended but has no kind (slow, server, cli, cluster, browser)")
            item.add_marker(pytest.mark.unit)
        elif len(kinds) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {sorted(kinds)}: one kind per test")
        elif kinds == {"kit"} and not kit_asked:
            item.add_marker(pytest.mark.skip(reason="builds and installs the ~3 GB air-gapped kit (minutes): "
                                                    "run it with `python -m pytest -m kit`"))
        elif extended and not extended_asked:
            item.add_marker(pytest.mark.skip(reason="an extended check of a rare path, out of the plain run: "
                                                    "run it with `python -m pytest -m extended`"))


# ImageNet class indices 151..268: the dog breeds (the shared dog.jpg's top-1 is one of them).
DOG_BREEDS = frozenset(range(151, 269))


def encode(img: Image.Image, fmt: str, **save) -> bytes:
    """Encode a PIL image in ``fmt`` (``"PNG"``, ``"JPEG"``, ...) with Pillow's ``save`` options."""
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return buf.getvalue()


def png_bytes(img: Image.Image, **save) -> bytes:
    """Encode a PIL image as PNG bytes (tests make their own small fixtures)."""
    return encode(img, "PNG", **save)


def small_png(color=(200, 30, 30), size=(64, 48)) -> bytes:
    """A solid-colour RGB PNG: cheap to send and to decode."""
    return png_bytes(Image.new("RGB", size, color))


class AppMaker:
    """``make(**overrides)`` builds ``create_app(overrides)`` with ``TESTING`` on; ``stop()`` stops each
    classifier it made (newest first). Also a context manager that stops them on exit."""

    def __init__(self):
        self.made = []

    def __call__(self, **overrides):
        from webapp import create_app

        app = create_app(overrides)
        app.config["TESTING"] = True
        self.made.append(app)
        return app

    def stop(self) -> None:
        while self.made:
            self.made.pop().extensions["classifier"].stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture
def make_app():
    """``make_app(MODEL=..., COMPILE=False, ...)``: an app for this test; what it made is stopped after it."""
    with AppMaker() as make:
        yield make


@pytest.fixture(scope="module")
def make_module_app():
    """``make_app`` for module-scoped fixtures: what it made is stopped after the module's last test."""
    with AppMaker() as make:
        yield make


@pytest.fixture(scope="session")
def app():
    """Seeded untrained ResNet-18, eager, small batches: for view and error tests."""
    with AppMaker() as make:
        yield make(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=4, PRECISION="fp32")


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(scope="session")
def offline_app():
    """The offline EfficientNet-Lite0 with real ImageNet weights, eager: for real predictions."""
    with AppMaker() as make:
        yield make(MODEL="efficientnet_lite0", COMPILE=False, MAX_BATCH_SIZE=4, PRECISION="fp32")


@pytest.fixture
def offline_client(offline_app):
    return offline_app.test_client()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk (length, type, payload, CRC)."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def inflating_chunk(kind: bytes) -> bytes:
    """A chunk of ``kind`` whose compressed payload inflates to 2 MiB (Pillow's MAX_TEXT_CHUNK is 1 MiB)."""
    bomb = zlib.compress(b"a" * (2 * 2**20))
    payload = {b"zTXt": b"Comment\x00\x00", b"iTXt": b"Comment\x00\x01\x00\x00\x00",
               b"iCCP": b"profile\x00\x00"}[kind] + bomb
    return png_chunk(kind, payload)


def jpeg_with_scans(data: bytes, extra: int) -> bytes:
    """A progressive JPEG ``data`` with its last scan (SOS segment and entropy-coded data) repeated ``extra`` more
    times before EOI: a file of ``extra`` more scans, each another pass over the whole image for a decoder."""
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * extra + data[-2:]


def jpeg_with_segments(data: bytes, extra: int) -> bytes:
    """A JPEG ``data`` with ``extra`` empty COM segments (``FF FE 00 02``) after its SOI: a valid file."""
    return data[:2] + b"\xff\xfe\x00\x02" * extra + data[2:]


def png_with_chunks(data: bytes, extra: int) -> bytes:
    """A PNG ``data`` with ``extra`` empty private ancillary chunks (``prVt``, CRC right) before IEND: a valid file."""
    return data[:-12] + png_chunk(b"prVt", b"") * extra + data[-12:]


def png_declaring(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR is patched to declare ``width`` x ``height`` (CRC fixed): no pixel data for it."""
    data = bytearray(png_bytes(Image.new("RGB", (1, 1), (10, 20, 30))))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.fixture
def read_only_view(tmp_path):
    """``(folder, view)``: a folder, and a read-only bind mount of it (both paths), unmounted after the test."""
    folder, view = tmp_path / "warm", tmp_path / "read-only"
    folder.mkdir()
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(folder), str(view)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here (root and the right to mount needed): {mounted.stderr.strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True, text=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {ro.stderr.strip()}")
        yield folder, view
    finally:
        subprocess.run(["umount", str(view)], capture_output=True)


class Clock:
    """A fake ``time.monotonic`` (s) that moves only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
