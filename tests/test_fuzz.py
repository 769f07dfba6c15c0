"""bench/fuzz.py judges the service, not itself: a failure there is a failure of the service."""

from __future__ import annotations

import warnings

import pytest

fuzz = pytest.importorskip("bench.fuzz", reason="bench/fuzz.py needs hypothesis (requirements-dev.txt)")

from webapp import imaging  # noqa: E402


def test_a_bare_tiff_header_is_a_documented_answer_not_a_failure():
    """``49 49 00 2a 00 00 00 01``: Pillow warns "Corrupt EXIF data", the service's filter silences it and
    answers with a documented error, as the server does (415)."""
    outcome = fuzz.check_decode(bytes.fromhex("4949002a00000001"))
    assert outcome in {"NotAnImage", "UndecodableImage"}


def test_a_warning_the_service_does_not_silence_is_still_a_failure(monkeypatch):
    real = imaging.decode

    def noisy(data, **kwargs):
        warnings.warn("something the operator should hear about", RuntimeWarning, stacklevel=1)
        return real(data, **kwargs)

    monkeypatch.setattr(imaging, "decode", noisy)
    with pytest.raises(fuzz.Failure, match="warnings escaped: RuntimeWarning: something the operator"):
        fuzz.check_decode(bytes.fromhex("4949002a00000001"))


def test_an_undocumented_exception_is_a_failure(monkeypatch):
    def broken(data, **kwargs):
        raise ValueError("a bug")

    monkeypatch.setattr(imaging, "decode", broken)
    with pytest.raises(fuzz.Failure, match="ValueError escaped decode/preprocess: a bug"):
        fuzz.check_decode(b"\xff\xd8\xff")
