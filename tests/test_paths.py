"""paths.not_a_file: what is at a path that is not a file to read, in words (not "does not exist" for a link)."""

import os

from webapp.paths import not_a_file


def test_each_kind_of_not_a_file_is_said_as_what_it_is(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    os.symlink(tmp_path / "gone.pth", tmp_path / "dangling")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    os.mkfifo(tmp_path / "fifo")
    assert not_a_file(tmp_path / "file") == ""
    assert not_a_file(tmp_path / "missing") == "does not exist"
    assert not_a_file(tmp_path) == "is a folder, not a file"
    assert not_a_file(tmp_path / "dangling") == f"is a link to {tmp_path / 'gone.pth'}, which does not exist"
    assert not_a_file(tmp_path / "loop") == "is a link that loops (Too many levels of symbolic links)"
    assert not_a_file(tmp_path / "loop" / "x") == "goes through a link that loops"
    assert not_a_file(tmp_path / "fifo") == "is not a regular file (a FIFO or device)"
    assert not_a_file(tmp_path / "file" / "x") == "does not exist (a part of its path is a file, not a folder)"
    assert not_a_file(tmp_path / ("a" * 300)) == "cannot be looked at: File name too long"
    assert not_a_file("nul\0byte") == "does not exist"

