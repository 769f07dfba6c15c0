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


def test_workers_answering_in_turn_are_not_a_crash_a_replaced_one_is(monkeypatch):
    """fuzz.py --url against a 2-worker server: two pids take turns; only a worker started after the fuzzing
    began (gunicorn replaced one that died) is a crash."""
    answers = iter([101, 202, 101, 202, 303])
    monkeypatch.setattr(fuzz.Http, "health", lambda self: {"pid": next(answers), "ready": True})
    http = fuzz.Http("http://127.0.0.1:8000")
    started = {101: http.since - 100, 202: http.since - 50, 303: http.since + 10}
    monkeypatch.setattr(fuzz, "_started_ticks", lambda pid: started[pid])
    for _ in range(3):
        http.check_alive()  # 202, 101, 202: both were there before the fuzzing began
    with pytest.raises(fuzz.Failure, match="worker 303 started after the fuzzing began"):
        http.check_alive()


def test_a_real_process_start_time_is_read_from_proc():
    import os

    assert fuzz._started_ticks(os.getpid()) <= fuzz._now_ticks()
    assert fuzz._started_ticks(2**22 + 7) is None  # above pid_max: no such process
