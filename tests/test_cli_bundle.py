"""``python -m webapp bundle`` and the kit's install.sh, on a small kit (one wheel): the lock, the manifest,
the target, the tar, and install.sh's refusals (tampered wheel or weights file, a file slipped in, wrong
Python). The whole multi-GB kit, installed and serving with no network, is tests/test_kit.py (``-m kit``)."""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from webapp.cli import build_parser, bundle, kit

ROOT = Path(__file__).resolve().parents[1]
# Tests on a real (small) kit: pip download, install.sh, a venv: tens of seconds, so not in the `-m unit` subset;
# and an air-gapped install is a rare path, so they run with `-m extended` (CI's own step), not in the plain run.
def SMALL_KIT(test):
    return pytest.mark.extended(pytest.mark.slow(test))


def _fake_wheel(folder: Path, name: str, size: int = 10) -> Path:
    path = folder / name
    path.write_bytes(os.urandom(size))
    return path


def test_parse_wheel_reads_name_version_and_platform_tags(tmp_path):
    w = kit.parse_wheel(_fake_wheel(tmp_path, "zope_interface-8.7-cp311-cp311-manylinux1_x86_64.manylinux_2_17_x86_64.whl"))
    assert (w.name, w.version, w.platforms) == ("zope-interface", "8.7", ("manylinux1_x86_64", "manylinux_2_17_x86_64"))
    assert kit.parse_wheel(_fake_wheel(tmp_path, "nvidia_cublas-13.1.1.3-py3-none-manylinux_2_27_x86_64.whl")).cuda
    assert kit.parse_wheel(_fake_wheel(tmp_path, "triton-3.8.0-cp311-cp311-manylinux_2_28_x86_64.whl")).cuda
    assert not kit.parse_wheel(_fake_wheel(tmp_path, "torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl")).cuda
    with pytest.raises(ValueError, match="not a wheel file name"):
        kit.parse_wheel(_fake_wheel(tmp_path, "torch-2.14.1.tar.gz"))


def test_wheels_in_refuses_two_versions_of_one_project(tmp_path):
    _fake_wheel(tmp_path, "six-1.16.0-py2.py3-none-any.whl")
    _fake_wheel(tmp_path, "six-1.17.0-py2.py3-none-any.whl")
    with pytest.raises(ValueError, match="two wheels of six"):
        kit.wheels_in(tmp_path)


def test_target_needs_the_newest_glibc_any_wheel_needs(tmp_path):
    wheels = [kit.parse_wheel(_fake_wheel(tmp_path, n)) for n in (
        "a-1-py3-none-any.whl",
        "b-1-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",  # 2.17 (either tag)
        "c-1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",  # 2.27: its older tag suffices
        "d-1-cp311-cp311-manylinux1_x86_64.whl")]                            # 2.5
    assert kit.glibc_needed(wheels) == (2, 27)
    assert kit.machine_needed(wheels) == "x86_64"
    text = kit.target_text("3.11", wheels, "manylinux_2_28_x86_64")
    assert "\npython=3.11\nmachine=x86_64\nglibc=2.27\nplatform=manylinux_2_28_x86_64\n" in text
    assert kit.glibc_needed(wheels[:1]) is None and kit.machine_needed(wheels[:1]) is None
    arm = kit.parse_wheel(_fake_wheel(tmp_path, "e-1-cp311-cp311-manylinux_2_28_aarch64.whl"))
    with pytest.raises(ValueError, match="several architectures"):
        kit.machine_needed(wheels + [arm])


def test_pip_download_command_targets_another_python_and_platform():
    args = argparse.Namespace(python_version="3.12", platform="manylinux_2_28_x86_64", index_url="https://i/cpu",
                              extra_index_url=["https://pypi.org/simple"], requirements=Path("r.txt"))
    cmd = bundle.pip_download_command(args, Path("/k/wheels"))
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--only-binary=:all:" in cmd
    for flag, value in (("--python-version", "3.12"), ("--abi", "cp312"), ("--implementation", "cp"),
                        ("--platform", "manylinux_2_28_x86_64"), ("--index-url", "https://i/cpu"),
                        ("--extra-index-url", "https://pypi.org/simple"), ("--dest", "/k/wheels")):
        assert cmd[cmd.index(flag) + 1] == value
    host = bundle.pip_download_command(argparse.Namespace(python_version=None, platform=None, index_url=None,
                                                          extra_index_url=[], requirements=Path("r.txt")), Path("w"))
    assert not {"--platform", "--python-version", "--abi", "--index-url"} & set(host)  # pip's own host tags


@pytest.mark.parametrize("option", [["--python-version", "3"], ["--python-version", "py311"],
                                    ["--platform", "win_amd64"], ["--platform", "manylinux_2_28"]])
def test_bundle_options_refuse_a_malformed_target(option, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bundle", "--out", "k", *option])
    assert exc.value.code == 2 and option[1] in capsys.readouterr().err


def test_source_files_are_the_services_tracked_files():
    files = {str(f) for f in bundle.source_files()}
    assert {"wsgi.py", "gunicorn.conf.py", "requirements.txt", "webapp/__init__.py", "webapp/cli/bundle.py",
            "deploy/install.sh", "templates/index.html"} <= files
    assert not any(f.startswith(("tests/", "bench/", ".ci/")) or "__pycache__" in f for f in files)


def _bundle(out: Path, requirements: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webapp", "bundle", "--out", str(out), "--requirements",
                           str(requirements), *extra], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCH_HOME": str(out.parent / "no-torch-home")})


@pytest.fixture(scope="module")
def small_kit(tmp_path_factory):
    """A kit of two wheels (tqdm, and markupsafe: a manylinux2014 one), with its tar: built once for this module."""
    base = tmp_path_factory.mktemp("small")
    req = base / "req.txt"
    req.write_text("tqdm==4.70.1\nmarkupsafe==3.0.4\n")
    proc = _bundle(base / "kit", req, "--tar")
    assert proc.returncode == 0, proc.stderr
    return base / "kit", proc


@SMALL_KIT
def test_bundle_writes_a_hash_pinned_lock_and_a_manifest_sha256sum_checks(small_kit):
    out, proc = small_kit
    assert proc.stdout.split() == [str(out), f"{out}.tar"]
    wheels = sorted((out / "wheels").glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["markupsafe", "tqdm"]
    lock = [line for line in (out / "requirements.lock").read_text().splitlines() if not line.startswith("#")]
    assert lock == [f"markupsafe==3.0.4 --hash=sha256:{kit.sha256_file(wheels[0])}",
                    f"tqdm==4.70.1 --hash=sha256:{kit.sha256_file(wheels[1])}"]
    target = (out / "TARGET").read_text()
    assert f"python={sys.version_info[0]}.{sys.version_info[1]}\nmachine=x86_64\nglibc=2.17\n" in target
    check = subprocess.run(["sha256sum", "-c", "--strict", "MANIFEST.sha256"], cwd=out, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = {line.split("  ", 1)[1] for line in (out / "MANIFEST.sha256").read_text().splitlines()}
    assert {"install.sh", "Containerfile", ".dockerignore", "requirements.lock", "TARGET", "deploy/photo-classifier.service",
            "src/wsgi.py", "src/webapp/startup.py", f"wheels/{wheels[0].name}"} <= listed
    assert os.access(out / "install.sh", os.X_OK)
    # progress and the size summary on stderr
    assert "[1/5] downloading wheels" in proc.stderr and "2 wheels" in proc.stderr
    with tarfile.open(f"{out}.tar") as tar:
        names = tar.getnames()
    assert "kit/MANIFEST.sha256" in names and f"kit/wheels/{wheels[0].name}" in names


@SMALL_KIT
def test_bundle_refuses_a_folder_that_is_not_empty(small_kit, tmp_path):
    out, _ = small_kit
    proc = _bundle(out, tmp_path / "unused.txt")
    assert proc.returncode == 2 and "not an empty folder" in proc.stderr


@pytest.mark.cli
@pytest.mark.parametrize("name", ["a" * 300, "a-file/kit"])
@pytest.mark.extended  # bundle's refusals, rare (~6 s each): with `-m extended`
def test_bundle_refuses_an_out_that_cannot_be_looked_at_or_made_in_one_line(tmp_path, name):
    """A name part over 255 bytes (pathlib's exists() raises for it), a file on the way: the OS's reason."""
    (tmp_path / "a-file").write_text("x")
    proc = _bundle(tmp_path / name, tmp_path / "unused.txt")
    why = "File name too long" if name.startswith("a" * 9) else "Not a directory"
    assert (proc.returncode, proc.stderr) == (2, f"error: --out: {tmp_path / name}: {why}\n"), proc.stderr


@pytest.mark.cli
@pytest.mark.extended  # bundle's refusals, rare (~6 s each): with `-m extended`
@pytest.mark.parametrize("empty_folder", [False, True])
def test_a_failed_download_leaves_nothing_in_the_way_of_a_second_try(tmp_path, empty_folder):
    """Found by a fresh-user tryout: after pip failed, ``kit/wheels/`` was left, and the same command again was
    refused ("exists and is not an empty folder", exit 2). What the run made goes; an empty folder given stays."""
    req = tmp_path / "req.txt"
    req.write_text("no-such-project-will-ever-be-fetched==1\n")
    out = tmp_path / "kit"
    if empty_folder:
        out.mkdir()
    for _ in range(2):
        proc = _bundle(out, req, "--index-url", (tmp_path / "no-index").as_uri())
        assert proc.returncode == 1 and "error: pip download failed" in proc.stderr, proc.stderr
        assert (sorted(out.iterdir()) == []) if empty_folder else not out.exists()
    (tmp_path / "a-file").write_text("x")
    proc = _bundle(tmp_path / "a-file", req)
    assert proc.returncode == 2 and "exists and is not a folder" in proc.stderr, proc.stderr


@pytest.mark.cli
@pytest.mark.extended  # bundle's refusals, rare (~6 s each): with `-m extended`
def test_ctrl_c_during_the_download_leaves_nothing_in_the_way_of_a_second_try(tmp_path):
    """Found by a fresh-user tryout: a Ctrl-C while pip downloaded left ``kit/wheels/``, and the same command again
    was refused as "not an empty folder". Ctrl-C in a terminal reaches the whole process group (pip too): here an
    index that takes the connection and never answers holds pip until the SIGINT."""
    import signal
    import socket

    from serving import as_a_terminal_job
    from webapp.cli.common import EXIT_INTERRUPTED

    req, out = tmp_path / "req.txt", tmp_path / "kit"
    req.write_text("tqdm==4.70.1\n")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        proc = subprocess.Popen([sys.executable, "-m", "webapp", "bundle", "--out", str(out), "--requirements",
                                 str(req), "--index-url", url], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, "TORCH_HOME": str(tmp_path / "none")},
                                preexec_fn=as_a_terminal_job)  # SIGINT arrives ignored in a CI's background job
        try:
            lines = []
            while not any(line.startswith("[1/5]") for line in lines):
                lines.append(proc.stderr.readline())
                assert lines[-1] or proc.poll() is None, lines
            silent.settimeout(30)
            silent.accept()[0].close()  # pip has connected: the download is under way
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    rest = proc.stderr.read()
    assert code == EXIT_INTERRUPTED and "interrupted" in rest, rest
    assert not out.exists(), sorted(out.rglob("*"))


@pytest.mark.cli
@pytest.mark.parametrize("weights, words", [
    ("missing.pth", "does not exist. Put a copy of https://download.pytorch.org/models/"
                    "resnet18-f37072fd.pth there, or unset CLASSIFIER_WEIGHTS to bundle without it."),
    ("resnet18-f37072fd.pth", "sha256"),  # there, but not the file its name promises
])
@pytest.mark.extended  # bundle's refusals, rare (~6 s each): with `-m extended`
def test_bundle_judges_the_weights_before_downloading_anything(tmp_path, weights, words):
    """A CLASSIFIER_WEIGHTS that names no file (the service would refuse to start on it) or a damaged one fails
    the bundle at once, in one line, with no folder made: not after minutes of downloading wheels, and not as
    a kit without the ResNet-18 that was asked for."""
    (tmp_path / "resnet18-f37072fd.pth").write_bytes(b"not the weights")
    req = tmp_path / "req.txt"
    req.write_text("no-such-project-will-ever-be-fetched==1\n")  # a download would fail differently
    proc = subprocess.run([sys.executable, "-m", "webapp", "bundle", "--out", str(tmp_path / "kit"), "--requirements",
                           str(req)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCH_HOME": str(tmp_path / "no-torch-home"),
                               "CLASSIFIER_WEIGHTS": str(tmp_path / weights)})
    assert proc.returncode == 1 and words in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert not (tmp_path / "kit").exists()


def test_size_summary_names_the_biggest_wheels_and_the_cuda_share(tmp_path):
    (tmp_path / "wheels").mkdir()
    w = [kit.parse_wheel(_fake_wheel(tmp_path / "wheels", n, size)) for n, size in (
        ("torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", 3000),
        ("nvidia_cublas-13.1.1.3-py3-none-manylinux_2_27_x86_64.whl", 6000),
        ("tqdm-4.70.1-py3-none-any.whl", 1000))]
    text = kit.size_summary(tmp_path, w, biggest=2)
    assert "3 wheels 10.0 kB" in text and "nvidia_cublas" in text and "tqdm" not in text
    assert "(1 wheel: nvidia-*" in text and "6.0 kB, 60% of the wheels" in text


# -- install.sh's refusals, before anything is installed ------------------------------------------------


@pytest.fixture()
def kit_copy(small_kit, tmp_path):
    """A fresh copy of the small kit (each test tampers with its own)."""
    dest = tmp_path / "kit"
    shutil.copytree(small_kit[0], dest)
    return dest


def _install(kit_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(kit_dir / "install.sh"), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(kit_dir.parent), **(env or {})})


def _remanifest(kit_dir: Path) -> None:
    (kit_dir / kit.MANIFEST).write_text(kit.manifest_text(kit_dir))


@SMALL_KIT
def test_install_stops_on_a_tampered_wheel_naming_it(kit_copy):
    wheel = next((kit_copy / "wheels").glob("*.whl"))
    with open(wheel, "r+b") as fh:  # one byte changed, same size
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 1]))
    proc = _install(kit_copy, "--no-warm")
    assert proc.returncode == 1
    assert f"wheels/{wheel.name}" in proc.stderr and "does not match MANIFEST.sha256" in proc.stderr
    assert not (kit_copy / "venv").exists()  # nothing was installed


@SMALL_KIT
def test_install_stops_on_a_tampered_weights_file_naming_it(kit_copy):
    weights = kit_copy / "weights" / "resnet18-f37072fd.pth"
    weights.parent.mkdir()
    weights.write_bytes(b"not the weights")
    _remanifest(kit_copy)  # as if the kit had been made with it; then damaged on the way
    weights.write_bytes(b"not the weights!")
    proc = _install(kit_copy, "--no-warm")
    assert proc.returncode == 1 and "weights/resnet18-f37072fd.pth" in proc.stderr, proc.stderr
    assert not (kit_copy / "venv").exists()


@SMALL_KIT
@pytest.mark.parametrize("name", ["resnet18.pth", "resnet18-f3707.pth", "resnet18-F37072FD.pth"])
def test_install_stops_on_a_weights_file_without_a_sha256_prefix_in_its_name(kit_copy, name):
    """Its check compared the file's sha256 with the prefix in its name: none, and every sum passed (tryout26); the
    service looks for torchvision's name (resnet18-f37072fd.pth) in the hub, so it would not have found it either."""
    weights = kit_copy / "weights" / name
    weights.parent.mkdir()
    weights.write_bytes(b"not the weights")
    _remanifest(kit_copy)  # listed: the manifest check passes it
    proc = _install(kit_copy, "--no-warm")
    assert proc.returncode == 1 and f"weights file weights/{name} has no sha256 prefix in its name" in proc.stderr
    assert "Nothing was installed" in proc.stderr and not (kit_copy / "venv").exists()


@SMALL_KIT
def test_install_stops_on_a_file_slipped_into_wheels(kit_copy):
    shutil.copy(next((kit_copy / "wheels").glob("tqdm-*.whl")), kit_copy / "wheels" / "tqdm-9.9.9-py3-none-any.whl")
    proc = _install(kit_copy, "--no-warm")
    assert proc.returncode == 1 and "wheels/tqdm-9.9.9-py3-none-any.whl is not in MANIFEST.sha256" in proc.stderr


@SMALL_KIT
def test_install_refuses_the_wrong_python_naming_what_it_needs(kit_copy, tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\necho 3.9 cpython Linux x86_64 2.36\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    proc = _install(kit_copy, "--no-warm", "--python", str(fake))
    need = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert proc.returncode == 1, proc.stderr
    assert f"this kit needs CPython {need} on Linux x86_64 with glibc >= 2.17" in proc.stderr
    assert "is cpython 3.9" in proc.stderr
    old_glibc = tmp_path / "oldlibc"
    old_glibc.write_text(f"#!/bin/sh\necho {need} cpython Linux x86_64 2.12\n")
    old_glibc.chmod(0o755)
    proc = _install(kit_copy, "--no-warm", "--python", str(old_glibc))
    assert proc.returncode == 1 and "this host has glibc 2.12" in proc.stderr and "glibc >= " in proc.stderr


@SMALL_KIT
def test_install_checks_weights_against_their_name_and_installs_offline(kit_copy, tmp_path):
    """A listed weights file whose sha256 does not start with its name's prefix is refused; without it the
    one wheel installs with --no-index (pip's own configuration of this host is ignored)."""
    weights = kit_copy / "weights" / "resnet18-f37072fd.pth"
    weights.parent.mkdir()
    weights.write_bytes(b"garbage")
    _remanifest(kit_copy)
    proc = _install(kit_copy, "--no-warm")
    assert proc.returncode == 1 and "weights file weights/resnet18-f37072fd.pth is damaged" in proc.stderr
    shutil.rmtree(weights.parent)
    _remanifest(kit_copy)
    proc = _install(kit_copy, "--no-warm", "--prefix", str(tmp_path / "venv"),
                    env={"PIP_INDEX_URL": "http://127.0.0.1:9/simple"})  # an index would fail: none is used
    assert proc.returncode == 0, proc.stderr
    assert "no ResNet-18 weights in this kit" in proc.stderr
    assert f"{tmp_path / 'venv'}/bin/gunicorn -c gunicorn.conf.py wsgi:app" in proc.stdout
    assert subprocess.run([tmp_path / "venv/bin/python", "-c", "import markupsafe, tqdm"]).returncode == 0
