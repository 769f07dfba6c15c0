"""Shared fixtures: ``app``/``client`` (seeded ResNet-18, eager: fast), ``offline_app``/``offline_client``
(the real-weight offline model, eager), and the shared photos in ``../shared/images``."""

from __future__ import annotations

import io
import struct
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


def png_bytes(img: Image.Image, **save) -> bytes:
    """Encode a PIL image as PNG bytes (tests make their own small fixtures)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", **save)
    return buf.getvalue()


def _make_app(config):
    from webapp import create_app

    app = create_app(config)
    app.config["TESTING"] = True
    return app


@pytest.fixture(scope="session")
def app():
    """Seeded untrained ResNet-18, eager, small batches: for view and error tests."""
    app = _make_app({"MODEL": "resnet18_seeded", "COMPILE": False, "MAX_BATCH_SIZE": 4, "PRECISION": "fp32"})
    yield app
    app.extensions["classifier"].stop()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture(scope="session")
def offline_app():
    """The offline EfficientNet-Lite0 with real ImageNet weights, eager: for real predictions."""
    app = _make_app({"MODEL": "efficientnet_lite0", "COMPILE": False, "MAX_BATCH_SIZE": 4, "PRECISION": "fp32"})
    yield app
    app.extensions["classifier"].stop()


@pytest.fixture
def offline_client(offline_app):
    return offline_app.test_client()


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk (length, type, payload, CRC)."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_declaring(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose IHDR is patched to declare ``width`` x ``height`` (CRC fixed): no pixel data for it."""
    data = bytearray(png_bytes(Image.new("RGB", (1, 1), (10, 20, 30))))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)
