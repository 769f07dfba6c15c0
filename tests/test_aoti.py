"""webapp/aoti.py: a package's compiled library extracted once beside it, so every worker maps one file.

The extraction rules run on small stand-in archives (no compile); loading real packages, and that a warm
start runs from the extracted library, is in tests/test_engine.py (``test_a_warm_cache_starts_without_compiling``).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from webapp import aoti

MODEL_DIR = "pkg/data/aotinductor/model/"
ARCHIVE = {"pkg/archive_format": b"pt2", "pkg/archive_version": b"0", "pkg/.data/version": b"1",
           "pkg/byteorder": b"little", MODEL_DIR + "c1.wrapper.cpp": b"// source",
           MODEL_DIR + "c1.wrapper_metadata.json": b"{}", MODEL_DIR + "c2.kernel.cpp": b"// kernels",
           MODEL_DIR + "c2.kernel_metadata.json": b"{}"}


def package(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_the_library_is_extracted_once_beside_its_package(tmp_path):
    lib = os.urandom(3 << 20)  # bigger than one read of the copy loop
    pkg = package(tmp_path / "aoti-bf16-k.b1.pt2", {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": lib,
                                                    MODEL_DIR + "c1.wrapper.json": b'{"nodes": []}'})
    so = aoti.extract_library(pkg)
    assert so == tmp_path / "aoti-bf16-k.b1.so" and so.read_bytes() == lib
    assert (tmp_path / "aoti-bf16-k.b1.json").read_bytes() == b'{"nodes": []}'  # extern kernels (int8)
    assert so.stat().st_mtime_ns == pkg.stat().st_mtime_ns
    assert not list(tmp_path.glob("*.tmp"))
    inode = so.stat().st_ino
    assert aoti.extract_library(pkg) == so and so.stat().st_ino == inode  # later workers map the same file

    package(pkg, {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": b"rebuilt"})  # a package rebuilt in place
    os.utime(pkg, ns=(so.stat().st_mtime_ns + 10**9,) * 2)
    assert aoti.extract_library(pkg).read_bytes() == b"rebuilt"


@pytest.mark.parametrize("extra", [
    {"pkg/data/weights/weight_0": b"w"},  # weights stored outside the library
    {"pkg/data/constants/custom_obj_0": b"o"},  # a torchbind object
    {MODEL_DIR + "c3.wrapper.so": b"second"},  # two libraries
    {MODEL_DIR + "c1.cubin": b"gpu"},  # anything the extraction does not know
])
def test_a_package_that_needs_more_than_its_library_is_not_extracted(tmp_path, extra):
    pkg = package(tmp_path / "aoti-fp32-k.pt2", {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": b"lib", **extra})
    assert aoti.extract_library(pkg) is None
    assert not list(tmp_path.glob("*.so"))


def test_load_shared_falls_back_to_the_package_loader(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda p: loaded.append(p) or "package loader")
    not_plain = package(tmp_path / "a.pt2", {**ARCHIVE, "pkg/data/weights/w": b"w"})
    assert aoti.load_shared(not_plain) == "package loader"
    not_a_library = package(tmp_path / "b.pt2", {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": b"not ELF"})
    assert aoti.load_shared(not_a_library) == "package loader"  # extracted, but it does not load here
    assert loaded == [str(not_plain), str(not_a_library)]


def test_a_library_damaged_in_place_is_extracted_again(tmp_path, caplog):
    """Trusted while its modification time matched the package's, a library damaged in place (same size and time)
    answered batched requests wrongly, and one cut short killed every worker with SIGBUS as it started."""
    lib = os.urandom(1 << 20)
    pkg = package(tmp_path / "aoti-fp32-k.pt2", {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": lib})
    so = aoti.extract_library(pkg)
    stamp = so.stat().st_mtime_ns
    for damaged in (lib[:4096] + bytes(4096) + lib[8192:], lib[:len(lib) // 2], b""):
        so.write_bytes(damaged)
        os.utime(so, ns=(stamp, stamp))
        assert aoti.extract_library(pkg) == so and so.read_bytes() == lib
    assert "differs from its package" in caplog.text
    inode = so.stat().st_ino
    assert aoti.extract_library(pkg) == so and so.stat().st_ino == inode  # whole: left as it is


def test_a_package_damaged_itself_is_removed_and_built_again_elsewhere(tmp_path, monkeypatch):
    """A package whose own bytes fail its CRC is not loaded another way (torch's loader would map what it holds):
    it is removed and handed to ``build_elsewhere`` (the serving worker's compile child) like an absent one; it
    was rebuilt inside the serving worker, whose memory then held the compiler for its life."""
    lib = os.urandom(1 << 16)
    pkg = package(tmp_path / "aoti-fp32-k.pt2", {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": lib})
    raw = bytearray(pkg.read_bytes())
    at = bytes(raw).index(lib[:64])
    raw[at + 100:at + 200] = bytes(100)  # inside the member's data: its CRC no longer matches
    pkg.write_bytes(bytes(raw))
    with pytest.raises(zipfile.BadZipFile):
        aoti.extract_library(pkg)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda p: pytest.fail("loaded a damaged package"))
    with pytest.raises(zipfile.BadZipFile):
        aoti.load_shared(pkg)
    b1 = package(tmp_path / "aoti-fp32-k.b1.pt2", {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": lib})
    monkeypatch.setattr(aoti, "SharedLibrary", lambda so: f"runs {so.name}")
    asked = []

    def build_elsewhere(paths):
        asked.append([p.name for p in paths])
        package(pkg, {**ARCHIVE, MODEL_DIR + "c1.wrapper.so": lib})  # what the child builds

    monkeypatch.setattr(aoti, "_build", lambda *a: pytest.fail("built in the serving process"))
    runner = aoti.load_or_build_aoti(torch.nn.Identity(), input_size=8, path=pkg, build_elsewhere=build_elsewhere)
    assert asked == [[pkg.name]] and (runner.one, runner.many) == ("runs " + b1.with_suffix(".so").name,
                                                                   "runs " + pkg.with_suffix(".so").name)
