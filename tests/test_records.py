"""A warm cache folder shipped read-only (a container image's read-only root, a read-only mount), over a real
gunicorn: the server uses what it holds, the precision record included (``webapp/records.py``), instead of
refusing the folder (exit 2: tryout15). The record's own rules are unit-tested in tests/test_startup.py.

The read-only folder is a real read-only bind mount of a folder a first server warmed: root, and the right to
mount (skipped, saying why, elsewhere)."""

from __future__ import annotations

import subprocess

import pytest
import requests

from conftest import small_png
from serving import Server


@pytest.mark.server
@pytest.mark.extended  # two server starts and a mount, a deployment's rare path: with `-m extended`
def test_a_warm_cache_on_a_read_only_mount_is_used_as_it_is(read_only_view, tmp_path):
    folder, view = read_only_view
    settings = dict(MODEL="resnet18_seeded", COMPILE=0, WORKERS=1, THREADS=1, MAX_BATCH_SIZE=1, PRECISION="auto")
    warm = Server(tmp_path / "warm.log", CACHE_DIR=folder, **settings)  # decides auto's precision, records it
    try:
        warm.wait_ready(1)
    finally:
        warm.stop_cleanly()
    (record,) = [p.name for p in folder.iterdir() if p.name.startswith("precision-") and p.suffix == ".json"]
    with pytest.raises(OSError):  # (root's os.access says yes: the mount says no)
        (view / "probe").write_text("x")
    srv = Server(tmp_path / "served.log", CACHE_DIR=view, **settings)
    try:
        (health,) = srv.wait_ready(1).values()
        resp = requests.post(srv.url + "/api/v1/predict", files={"file": ("a.png", small_png(), "image/png")},
                             timeout=60)
        assert resp.status_code == 200, resp.text
    finally:
        out = srv.stop_cleanly()
    assert f"CLASSIFIER_CACHE_DIR={view} cannot be written (Read-only file system): the compiled model and the " \
           f"precision record it holds are used" in out
    assert f"precision from the record {view / record} (read without its lock" in out
    assert "decided for this process only" not in out and record in health["precision_reason"]
