"""webapp/sdnotify.py: systemd's notify socket taken from the environment at start, and datagrams sent to it,
a path or an abstract name (``@...``, as systemd gives it). Over a real gunicorn: tests/test_lifecycle.py."""

from __future__ import annotations

import os
import socket

import pytest

from webapp import sdnotify

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("abstract", [False, True])
def test_the_socket_is_taken_from_the_environment_and_sent_to(tmp_path, monkeypatch, abstract):
    name = f"@photo-classifier-test-{os.getpid()}" if abstract else str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind("\0" + name[1:] if abstract else name)
        systemd.settimeout(2)
        monkeypatch.setattr(sdnotify, "_notify_socket", None)
        monkeypatch.setenv("NOTIFY_SOCKET", name)
        sdnotify.take_notify_socket()
        assert "NOTIFY_SOCKET" not in os.environ  # neither gunicorn's early READY=1 nor a worker gets it
        sdnotify.take_notify_socket()  # a SIGHUP reads gunicorn.conf.py again: the socket is kept
        assert sdnotify.notify_systemd("READY=1\nSTATUS=serving") is True
        assert systemd.recv(100) == b"READY=1\nSTATUS=serving"
    assert sdnotify.notify_systemd("READY=1") is False  # gone: not an error, nothing to tell
    monkeypatch.setattr(sdnotify, "_notify_socket", None)
    assert sdnotify.notify_systemd("READY=1") is False  # not under systemd
