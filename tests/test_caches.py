"""The cache folder (webapp/caches.py): made as a start-up makes it, or refused in one line naming the setting."""

import os
import re
from pathlib import Path

import pytest

from webapp import caches, settings
from webapp.settings import SettingsError


def test_the_folder_and_its_parents_are_made(tmp_path):
    folder = tmp_path / "a" / "b" / "cache"
    assert caches.make_cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": str(folder)})) == folder
    assert folder.is_dir()
    assert caches.make_cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": str(folder)})) == folder  # there: fine


def test_empty_means_the_default_under_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert caches.make_cache_dir(settings.load({})) == tmp_path / ".cache" / "photo-classifier"
    monkeypatch.setenv("HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(SettingsError) as err:
        caches.make_cache_dir(settings.load({}))
    assert str(err.value) == (f"CLASSIFIER_CACHE_DIR (empty: the default {tmp_path}/file/.cache/photo-classifier) "
                              f"cannot be created: Not a directory")


@pytest.mark.parametrize("where, why", [("/proc/nope", "No such file or directory"),
                                        ("a-file", "it exists and is not a folder"),
                                        ("a-file/sub", "Not a directory"),
                                        ("a" * 300, "File name too long"),  # pathlib's exists() raises for it
                                        (f"{'b' * 300}/sub", "File name too long")])
def test_a_folder_that_cannot_be_made_names_the_setting_and_the_reason(tmp_path, where, why):
    (tmp_path / "a-file").write_text("x")
    folder = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(SettingsError) as err:
        caches.make_cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": folder}))
    assert str(err.value) == f"CLASSIFIER_CACHE_DIR={folder} cannot be created: {why}"


@pytest.mark.parametrize("read_only, why", [(False, "Permission denied"), (True, "Read-only file system")])
def test_a_folder_that_cannot_be_written_is_refused_saying_why(tmp_path, monkeypatch, read_only, why):
    """Not writable: for this user (permission denied), or on a read-only mount, which said "Permission denied"
    too (tryout15). Told by the mount's flag. (Faked: root writes in any folder; tests/test_records.py mounts.)"""
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(os, "statvfs", lambda path: type("Vfs", (), {"f_flag": os.ST_RDONLY if read_only else 0}))
    values = settings.load({"CLASSIFIER_CACHE_DIR": str(folder)})
    with pytest.raises(SettingsError, match=f"^CLASSIFIER_CACHE_DIR={folder} cannot be written: {why} \\(warm "
                                            f"writes the compiled model and the precision record there\\)$"):
        caches.make_cache_dir(values)  # warm's way: it is there to write
    # A server's and classify's way: a warm cache shipped read-only is used as it is (it was refused: tryout15).
    assert caches.make_cache_dir(values, read_only_ok=True) == folder and caches.unwritable(folder) == why


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no sysfs here")
def test_a_folder_that_passes_the_access_check_but_refuses_writes_is_unwritable(tmp_path):
    """root passes ``os.access`` for every folder; sysfs (and NFS's root squash, an ACL) still refuse: CACHE_DIR=
    /sys/kernel passed the start's checks and every worker's compile then failed (tryout34). A folder is made and
    removed there to be sure; none is left behind in a writable one."""
    assert caches.unwritable(Path("/sys/kernel")) in ("Operation not permitted", "Permission denied",
                                                      "Read-only file system")
    assert caches.unwritable(tmp_path) is None and list(tmp_path.iterdir()) == []
    (tmp_path / "afile").write_text("x")
    assert caches.folder_problem(tmp_path / "afile") == "it exists and is not a folder"
    assert caches.folder_problem(tmp_path / "new" / "deeper") is None and (tmp_path / "new" / "deeper").is_dir()


def test_start_up_makes_it_the_same_way(tmp_path):
    from webapp import startup

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(SettingsError, match="cannot be created"):
        startup.use_cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": str(tmp_path / "a-file")}))
    assert caches.cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": "~/x"})) == Path.home() / "x"


def test_a_tilde_of_no_known_user_is_left_as_the_shell_leaves_it():
    """pathlib's expanduser() raises RuntimeError for it (a traceback wherever a path setting was read)."""
    assert caches.cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": "~no-such-user-here/c"})) == Path(
        "~no-such-user-here/c")
    assert caches.cache_dir(settings.load({"CLASSIFIER_CACHE_DIR": "~/c"})) == Path.home() / "c"


def test_a_full_disk_is_named_with_what_each_folder_has_free(tmp_path, monkeypatch):
    """"No space left on device" names no disk; the cache folder and TMPDIR often are on different ones."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    values = {"CACHE_DIR": str(tmp_path / "cache")}
    caches.make_cache_dir(values)
    reason = "compiling failed: InductorError: OSError: [Errno 28] No space left on device (...)"
    said = caches.where_space_ran_out(reason, values)
    assert said.startswith(reason + "; ")
    assert re.search(rf"CLASSIFIER_CACHE_DIR {re.escape(str(tmp_path / 'cache'))} has [\d,]+ MB free", said), said
    assert re.search(rf"TMPDIR {re.escape(str(tmp_path / 'tmp'))} has [\d,]+ MB free", said), said
    assert caches.where_space_ran_out("self-test failed: ...", values) == "self-test failed: ..."


@pytest.mark.parametrize("there", ["file", "fifo"])
def test_a_kernel_folder_that_is_not_a_folder_is_refused_before_listening(tmp_path, there):
    """An ``inductor`` file in the cache folder failed every worker's compile after the port was open (tryout15)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if there == "file":
        (cache / "inductor").write_text("not a folder")
    else:
        os.mkfifo(cache / "inductor")
    with pytest.raises(SettingsError, match=r"/inductor \(where compiled kernels go\) is not a folder: remove it"):
        caches.make_cache_dir({"CACHE_DIR": str(cache)})
    (cache / "inductor").unlink()
    assert caches.make_cache_dir({"CACHE_DIR": str(cache)}) == cache  # absent: fine (the start makes it)
    (cache / "inductor").mkdir()
    assert caches.make_cache_dir({"CACHE_DIR": str(cache)}) == cache
