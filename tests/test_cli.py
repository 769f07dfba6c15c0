"""The command line, ``python -m webapp``: mostly run as a real subprocess from the repo root.

classify runs the offline EfficientNet-Lite0 eager (``--no-compile``, fp32, batches of 4), so
each run starts in seconds; what only needs the parser or the settings table runs in-process.
"""

from __future__ import annotations

import csv
import hashlib
import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DOG_BREEDS, ROOT, SHARED_IMAGES
from serving import free_port
from webapp import cli, settings
from webapp.cli import files, options

PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
# Fast, deterministic classify runs: real weights, eager, fp32 on every CPU, small batches.
QUICK = ("--model", "efficientnet_lite0", "--no-compile", "--precision", "fp32", "--max-batch-size", "4")


def clean_env(**extra) -> dict[str, str]:
    """This process's environment without CLASSIFIER_* variables or proxies, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(settings.PREFIX) and k not in PROXY_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "webapp", *args], cwd=ROOT, env=env or clean_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def no_classifier_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith(settings.PREFIX)] + list(PROXY_VARS):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """A folder: a truncated JPEG, a text file (not an image name: skipped), a hidden file, a subfolder with a PNG."""
    if not (SHARED_IMAGES / "dog.jpg").is_file():
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    folder = tmp_path_factory.mktemp("photos")
    (folder / "broken.jpg").write_bytes((SHARED_IMAGES / "dog.jpg").read_bytes()[:3000])
    (folder / "notes.txt").write_text("not a photo")
    (folder / ".hidden.jpg").write_bytes(b"junk")
    (folder / "sub").mkdir()
    from PIL import Image

    Image.new("RGB", (64, 48), (200, 30, 30)).save(folder / "sub" / "red.png")
    return folder


def dog_breed_labels() -> set[str]:
    from webapp.models import IMAGENET_CATEGORIES

    return {IMAGENET_CATEGORIES[i] for i in DOG_BREEDS}


# -- no torch: parser, help, settings -------------------------------------------------------------------
def test_importing_the_cli_imports_no_torch():
    code = "import sys, webapp.cli; print(sorted(m for m in ('torch', 'torchvision') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.cli
def test_help_lists_every_setting_from_the_table():
    serve = run_cli("serve", "--help", env=clean_env(COLUMNS="200"))
    assert serve.returncode == 0, serve.stderr
    for s in settings.SETTINGS:
        if not set(s.commands) & set(settings.SERVERS):  # the Ray Data job's settings are classify's only
            assert s.env not in serve.stdout, s.name
            continue
        assert s.env in serve.stdout and options.option_name(s) in serve.stdout, s.name
        line = next(line for line in serve.stdout.splitlines() if s.env + " " in line)
        assert f"(default {options.default_text(s)}" in line
    assert "--no-compile" in serve.stdout and "--" in serve.stdout
    classify = run_cli("classify", "--help", env=clean_env(COLUMNS="200"))
    assert classify.returncode == 0, classify.stderr
    for s in settings.SETTINGS:
        offered = bool(set(s.commands) & {settings.CLASSIFY, settings.CLASSIFY_CLUSTER})
        assert (s.env in classify.stdout) == offered, s.name
    assert "--topk" in classify.stdout and "--format" in classify.stdout
    top = run_cli("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("serve", "classify", "weights", "info", "settings"))


def test_server_only_settings_exist():
    # The table's commands column decides which commands offer a setting: a misspelt command would drop it.
    assert all(s.commands and set(s.commands) <= set(settings.COMMANDS) for s in settings.SETTINGS)
    assert {s.name for s in settings.SETTINGS if set(s.commands) <= set(settings.SERVERS)} >= \
        {"BIND", "WORKERS", "API_TOKEN", "RATE_LIMIT", "METRICS", "MAX_FILES"}
    assert {s.name for s in settings.SETTINGS if s.name.startswith("CLUSTER_")} == \
        {s.name for s in settings.SETTINGS if not set(s.commands) & {settings.SERVE, settings.CLASSIFY}}
    assert settings.BY_NAME["API_TOKEN"].secret


@pytest.mark.cli
def test_serve_sets_the_variables_and_passes_the_rest_to_gunicorn():
    out = run_cli("serve", "--dry-run", "--model", "efficientnet_lite0", "--no-compile", "--workers", "2",
                  "--bind", "0.0.0.0:9001", "--api-token", "s3cret", "--", "--preload", "--timeout", "90",
                  env=clean_env(CLASSIFIER_TOP_K="5"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for expected in ("CLASSIFIER_MODEL=efficientnet_lite0", "CLASSIFIER_COMPILE=0", "CLASSIFIER_WORKERS=2",
                     "CLASSIFIER_BIND=0.0.0.0:9001", "CLASSIFIER_TOP_K=5"):
        assert expected in lines
    assert "s3cret" not in out.stdout, "the token must never be printed"
    # a comment, not CLASSIFIER_API_TOKEN='(set, hidden)', which pasted would set that as the token (tryout25)
    assert "# CLASSIFIER_API_TOKEN is set (hidden)" in lines and "(set, hidden)'" not in out.stdout
    assert lines[-1].endswith(f"gunicorn -c {ROOT / 'gunicorn.conf.py'} wsgi:app --preload --timeout 90")


@pytest.mark.cli
def test_serve_execs_gunicorn():
    # gunicorn's --version exits before loading the config or the app: proves the exec and the pass-through
    # cheaply (tests/test_server.py runs the real server from the same CLASSIFIER_* variables).
    out = run_cli("serve", "--workers", "3", "--", "--version")
    assert out.returncode == 0, out.stderr
    assert re.match(r"gunicorn \(version [0-9.]+\)", out.stdout + out.stderr), out.stdout + out.stderr


@pytest.mark.cli
def test_bad_values_are_usage_errors(no_classifier_env, monkeypatch, capsys):
    out = run_cli("serve", "--max-batch-size", "0")
    assert out.returncode == 2 and "--max-batch-size" in out.stderr and "1 to 256" in out.stderr
    out = run_cli("serve", "--dry-run", env=clean_env(CLASSIFIER_MAX_BATCH_SIZE="abc"))
    assert out.returncode == 2 and "CLASSIFIER_MAX_BATCH_SIZE='abc'" in out.stderr
    with pytest.raises(SystemExit) as exc:
        cli.main(["classify", "--format", "xml", "x.jpg"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["classify"])
    assert exc.value.code == 2
    monkeypatch.setenv("CLASSIFIER_TOP_KK", "3")  # a typo: refused, before any model is built
    assert cli.main(["classify", "x.jpg"]) == 2
    assert "unknown setting CLASSIFIER_TOP_KK" in capsys.readouterr().err


def test_dry_run_refuses_the_workers_a_real_start_refuses(no_classifier_env, monkeypatch, capsys):
    """The real start refuses more workers than memory holds (exit 2); --dry-run printed the command, exit 0
    (tryout13)."""
    from webapp import cpu

    monkeypatch.setattr(cpu, "available_mb", lambda: 4096)
    assert cli.main(["serve", "--dry-run", "--workers", "500"]) == 2
    assert "500 workers need at least" in capsys.readouterr().err
    assert cli.main(["serve", "--dry-run", "--workers", "2"]) == 0


@pytest.mark.parametrize("extra, says", [
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["-w", "abc"], "invalid int value: 'abc'"),
    (["-w", "0"], "gunicorn -w 0 starts no worker"),
    (["--timeout", "-5"], "gunicorn --timeout -5: Value must be positive"),
    (["-b", "127.0.0.1:99999"], "gunicorn -b 127.0.0.1:99999: port 99999 is not 1 to 65535; allowed: "),  # (a traceback)
    (["-b", "[::1:8000"], "gunicorn -b [::1:8000: '' is not a valid port number; allowed: "),
])
def test_dry_run_refuses_the_gunicorn_flags_a_real_start_refuses(extra, says, no_classifier_env, capsys):
    """``serve --dry-run -- --bogus-flag`` printed the command and exited 0; the real start exits 2 (tryout25)."""
    assert cli.main(["serve", "--dry-run", "--", *extra]) == 2
    out = capsys.readouterr()
    assert says in out.err and "wsgi:app" not in out.out


@pytest.mark.parametrize("bind", ["fd://3", "unix:/run/classifier.sock", "tcp://127.0.0.1:8000", "[::1]:8000"])
def test_the_gunicorn_bind_forms_are_taken_as_gunicorn_takes_them(bind):
    """A bad -b is refused as a start would be (tryout34), but not systemd's inherited fd://N or the other forms
    gunicorn reads (webapp/listen.py serves fd:// sockets)."""
    from webapp import lifecycle

    assert lifecycle.gunicorn_flags_problem(["-b", bind]) == (None, None)


def test_dry_run_refuses_a_cache_folder_the_start_refuses_and_makes_none(no_classifier_env, monkeypatch, tmp_path,
                                                                         capsys):
    """``serve --dry-run`` said exit 0 for a cache folder that the real start refuses (exit 2: tryout26); it asks
    the same question, without making any folder."""
    from webapp import caches

    (tmp_path / "file").write_text("x")
    for folder, said in [(tmp_path / "file", "it exists and is not a folder"),
                         (tmp_path / "file" / "sub", f"{tmp_path / 'file'} is not a folder")]:
        monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(folder))
        assert cli.main(["serve", "--dry-run"]) == 2
        assert capsys.readouterr().err == f"configuration error: CLASSIFIER_CACHE_DIR={folder} cannot be created: {said}\n"
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / "new" / "deeper"))
    assert cli.main(["serve", "--dry-run"]) == 0 and not (tmp_path / "new").exists()
    monkeypatch.setattr(caches, "unwritable", lambda path: "Permission denied")  # root writes anywhere
    assert cli.main(["serve", "--dry-run"]) == 2
    assert f"cannot be created: Permission denied (in {tmp_path})" in capsys.readouterr().err


def test_settings_flags_a_cache_folder_the_start_refuses(no_classifier_env, monkeypatch, tmp_path, capsys):
    """``settings`` said exit 0 for a cache folder every start refuses (``serve --dry-run`` and ``info`` asked;
    found in tryout26, left then): flagged as the start would say it, exit 2, nothing made."""
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / "file" / "sub"))
    assert cli.main(["settings"]) == 2
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"INVALID: CLASSIFIER_CACHE_DIR={tmp_path / 'file' / 'sub'} cannot be created: {tmp_path / 'file'} is not a "
        "folder; the service refuses to start with it")
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / "new" / "deeper"))
    assert cli.main(["settings"]) == 0 and not (tmp_path / "new").exists()


def test_dry_run_counts_gunicorn_w_against_memory(no_classifier_env, monkeypatch, capsys):
    """gunicorn's -w wins over the plan in the real start, so the memory check counts it in --dry-run too."""
    from webapp import cpu

    monkeypatch.setattr(cpu, "available_mb", lambda: 4096)
    assert cli.main(["serve", "--dry-run", "--", "-w", "500"]) == 2
    assert "500 workers need at least" in capsys.readouterr().err
    assert cli.main(["serve", "--dry-run", "--", "-w", "2", "--timeout", "90"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("wsgi:app -w 2 --timeout 90")


@pytest.mark.parametrize("command", [["settings"], ["serve", "--cluster", "--dry-run"], ["serve", "--dry-run"]])
def test_autoscaling_with_min_replicas_above_max_is_refused_by_every_command(command, no_classifier_env, monkeypatch,
                                                                             capsys):
    """The real ``serve --cluster`` refused it (exit 2) while ``settings`` and ``--dry-run`` said it was fine."""
    for key, value in {"CLUSTER_REPLICAS": "0", "CLUSTER_MIN_REPLICAS": "5", "CLUSTER_MAX_REPLICAS": "2"}.items():
        monkeypatch.setenv(f"CLASSIFIER_{key}", value)
    assert cli.main(command) == 2
    out = capsys.readouterr()
    assert "CLASSIFIER_CLUSTER_MIN_REPLICAS=5 is above CLASSIFIER_CLUSTER_MAX_REPLICAS=2" in out.out + out.err
    monkeypatch.setenv("CLASSIFIER_CLUSTER_REPLICAS", "3")  # a fixed count: the range is not used
    assert settings.load().CLUSTER_REPLICAS == 3


def test_settings_markdown_is_the_readme_table(no_classifier_env, capsys):
    assert cli.main(["settings", "--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown_table() + "\n"


def test_settings_shows_values_and_flags_bad_ones(no_classifier_env, monkeypatch, tmp_path, capsys):
    (tmp_path / "redis").mkdir()  # the redis:// storage needs its client package (requirements.txt leaves it out)
    (tmp_path / "redis" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CLASSIFIER_PRECISION", "fp32")
    monkeypatch.setenv("CLASSIFIER_API_TOKEN", "s3cret")
    monkeypatch.setenv("CLASSIFIER_RATE_LIMIT_STORAGE", "redis://:pw@cache:6379")
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out
    assert "CLASSIFIER_PRECISION = fp32  (from the environment; default auto)" in out
    assert "s3cret" not in out and ":pw@" not in out
    assert all(s.env in out for s in settings.SETTINGS)
    monkeypatch.setenv("CLASSIFIER_THREADS", "many")
    monkeypatch.setenv("CLASSIFIER_THREAD", "2")
    assert cli.main(["settings"]) == 2
    out = capsys.readouterr().out
    assert "CLASSIFIER_THREADS = many  (INVALID" in out and "CLASSIFIER_THREAD: UNKNOWN" in out


@pytest.mark.parametrize("environ, flagged", [
    ({"CLASSIFIER_RATE_LIMIT": "lots"}, "CLASSIFIER_RATE_LIMIT = lots  (INVALID: CLASSIFIER_RATE_LIMIT='lots' is not "
                                        "valid; allowed: empty (off), or Flask-Limiter notation"),
    ({"CLASSIFIER_RATE_LIMIT_STORAGE": "bogus://x"}, "CLASSIFIER_RATE_LIMIT_STORAGE = bogus://x  (INVALID: "),
    ({"CLASSIFIER_RATE_LIMIT_STORAGE": "redis://127.0.0.1:1"}, "not valid: redis:// needs the Python package 'redis'"),
    ({"CLASSIFIER_RATE_LIMIT": "5/minute", "CLASSIFIER_RATE_LIMIT_STORAGE": ""},
     "INVALID together: CLASSIFIER_RATE_LIMIT_STORAGE='' is not valid; allowed: "),
])
def test_settings_flags_a_rate_limit_the_server_would_refuse(environ, flagged, no_classifier_env, monkeypatch,
                                                             capsys):
    monkeypatch.setitem(sys.modules, "redis", None)  # not installed, whatever this machine has
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["settings"]) == 2
    assert flagged in capsys.readouterr().out


@pytest.mark.cli
@pytest.mark.parametrize("environ", [{"CLASSIFIER_RATE_LIMIT": "lots"},
                                     {"CLASSIFIER_RATE_LIMIT_STORAGE": "bogus://x"},
                                     {"CLASSIFIER_RATE_LIMIT": "5/minute", "CLASSIFIER_RATE_LIMIT_STORAGE": ""}])
def test_classify_refuses_a_bad_rate_limit_setting_in_one_line(environ):
    out = run_cli("classify", *QUICK, str(SHARED_IMAGES / "dog.jpg"), env=clean_env(**environ), timeout=60)
    assert out.returncode == 2, out.stderr
    name = next(iter(environ)) if len(environ) == 1 else "CLASSIFIER_RATE_LIMIT_STORAGE"
    assert out.stderr.startswith(f"configuration error: {name}=") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.cli
@pytest.mark.parametrize("where, why", [("/proc/nope", "cannot be created: No such file or directory"),
                                        ("a-file", "cannot be created: it exists and is not a folder"),
                                        ("a-file/sub", "cannot be created: Not a directory"),
                                        ("a" * 300, "cannot be created: File name too long")])
@pytest.mark.parametrize("how", ["option", "variable"])
def test_classify_with_a_cache_dir_that_cannot_be_made_is_one_line_and_exit_2(tmp_path, where, why, how):
    """Even --no-compile makes the cache folder (the precision record): pathlib's traceback and exit 1 before. The
    folder is named as the user gave it: ``--cache-dir`` was named CLASSIFIER_CACHE_DIR, never set."""
    (tmp_path / "a-file").write_text("not a folder")
    folder = where if where.startswith("/") else str(tmp_path / where)
    given = ("--cache-dir", folder) if how == "option" else ()
    env = clean_env(**({} if how == "option" else {"CLASSIFIER_CACHE_DIR": folder}))
    out = run_cli("classify", *QUICK, *given, str(SHARED_IMAGES / "dog.jpg"), env=env, timeout=60)
    assert out.returncode == 2, out.stderr
    named = "--cache-dir" if how == "option" else "CLASSIFIER_CACHE_DIR"
    assert out.stderr == f"configuration error: {named}={folder} {why}\n"


def test_classify_with_no_image_files_is_a_usage_error_before_loading_a_model(no_classifier_env, tmp_path, capsys):
    (tmp_path / "readme.txt").write_text("x")
    (tmp_path / "IMG_0001.HEIC").write_bytes(b"\x00\x00\x00\x18ftypheic")
    assert cli.main(["classify", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"{tmp_path / 'IMG_0001.HEIC'}: skipped: HEIC is not a format read here (JPEG, PNG, WebP, GIF, BMP, TIFF, "
        "AVIF or PPM); convert it to JPEG first",
        f"error: no image files in {tmp_path} (skipped in folders: 1 photo in a format not read here (named above), "
        "1 other file (--all-files tries them))"]


@pytest.mark.parametrize("cluster", [False, True])
def test_a_path_that_does_not_exist_is_a_usage_error_in_both_modes(no_classifier_env, tmp_path, capsys, cluster):
    (tmp_path / "a.png").write_bytes(b"")
    extra = ["--cluster", "--out", str(tmp_path / "out.parquet")] if cluster else []
    assert cli.main(["classify", *extra, str(tmp_path / "a.png"), str(tmp_path / "missing.jpg")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.jpg'}: no such file or directory\n"


@pytest.mark.parametrize("mode", [[], ["--cluster", "--out", "out.parquet"], ["--server", "http://127.0.0.1:9"]])
def test_paths_that_are_not_regular_files_are_each_the_error(no_classifier_env, tmp_path, capsys, mode):
    """``classify /dev/zero`` said "/dev/zero: not a regular file" and then "error: no image files in /dev/zero"
    (tryout25): where the given paths themselves cannot be had, their lines are the error, as a missing one's is;
    a folder among them still gets the summary. Nothing is sent or started: exit 2."""
    assert cli.main(["classify", *mode, "/dev/zero", "/dev/null"]) == 2
    assert capsys.readouterr().err == "error: /dev/zero: not a regular file\nerror: /dev/null: not a regular file\n"
    assert cli.main(["classify", *mode, "/dev/zero", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"/dev/zero: not a regular file\nerror: no image files in /dev/zero {tmp_path}\n"


LONG = "a" * 300  # a name part over 255 bytes: pathlib's exists()/is_file()/is_dir() raise ENAMETOOLONG for it


@pytest.mark.parametrize("mode", [[], ["--server", "http://127.0.0.1:9"], ["--cluster", "--out", "x.parquet"]])
def test_a_path_that_cannot_be_looked_at_is_a_usage_error_naming_the_os_reason(no_classifier_env, tmp_path, capsys,
                                                                              mode):
    """Said like a missing path, in one line (never pathlib's traceback), before any model or server is asked."""
    long = str(tmp_path / f"{LONG}.jpg")
    assert cli.main(["classify", *mode, long]) == 2
    assert capsys.readouterr().err == f"error: {long}: File name too long\n"


@pytest.mark.cli
def test_a_path_that_cannot_be_looked_at_in_the_real_cli_is_one_line(tmp_path):
    out = run_cli("classify", f"{LONG}.jpg")
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"error: {LONG}.jpg: File name too long\n")


def test_a_folders_entry_that_cannot_be_looked_at_is_an_error_row(tmp_path, monkeypatch):
    """EACCES on stat (a folder that may be listed but not searched; root searches any, so it is simulated)."""
    (tmp_path / "a.jpg").write_bytes(b"x")
    (tmp_path / "b.jpg").write_bytes(b"x")
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path).endswith("b.jpg"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    items, _ = files.collect_files([str(tmp_path)])
    assert items == [(str(tmp_path / "a.jpg"), tmp_path / "a.jpg", None),
                     (str(tmp_path / "b.jpg"), None, "Permission denied")]
    assert files.error_code("Permission denied") == "read_error"


def test_a_folder_that_cannot_be_listed_is_an_error_row_in_its_place(tmp_path, monkeypatch):
    """An unreadable sub-folder's row came after every file of the walk (tryout17): it sits where its files would
    have, after the files beside it and before the next folder's. (Monkeypatched: root reads a mode-000 folder.)"""
    for name in ("a.jpg", "b/x.jpg", "c.jpg", "d/y.jpg"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("/b"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    items, _ = files.collect_files([str(tmp_path)])
    assert items == [(str(tmp_path / "a.jpg"), tmp_path / "a.jpg", None),
                     (str(tmp_path / "c.jpg"), tmp_path / "c.jpg", None),
                     (str(tmp_path / "b"), None, "cannot read the folder: Permission denied"),
                     (str(tmp_path / "d" / "y.jpg"), tmp_path / "d" / "y.jpg", None)], items


@pytest.mark.parametrize("mode", [[], ["--server", "http://127.0.0.1:9"]])
def test_an_empty_path_is_a_usage_error_never_the_current_folder(no_classifier_env, monkeypatch, capsys, mode):
    """``classify "$DIR"`` with DIR unset: Path("") is ".", which would be walked recursively."""
    assert cli.main(["classify", *mode, ""]) == 2
    assert capsys.readouterr().err == ("error: an empty path (a shell variable that is not set?); give . for the "
                                       "current folder\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))  # from stdin (-): blank lines are skipped, as ever
    assert cli.main(["classify", *mode, "-"]) == 2
    assert capsys.readouterr().err == "error: no paths (stdin was empty)\n"


@pytest.mark.parametrize("argv, flag, hint", [
    (["weights", "verify", ""], "FILE", False),  # was "error: .: not a regular file", exit 1
    (["weights", "fetch", "--dest", ""], "--dest", True),  # was the current folder
    (["bundle", "--out", ""], "--out", False),
    (["bundle", "--out", "kit", "--requirements", ""], "--requirements", False),
    (["serve", "--cluster", "--address", "", "--dry-run"], "--address", False),  # was a local Ray, silently
    (["classify", "--cluster", "--address", " ", "--out", "x.parquet", "x.jpg"], "--address", False),
])
def test_an_empty_file_folder_or_address_argument_is_a_usage_error(argv, flag, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    what = "address" if flag == "--address" else "path"
    assert f"error: argument {flag}: an empty {what} (a shell variable that is not set?)" in err, err
    assert ("give . for the current folder" in err) == hint


def test_raw_and_heic_photos_in_folders_are_named_with_why(tmp_path):
    for name in ("a.jpg", "b.HEIC", "c.heif", "d.CR2", "e.dng", "notes.txt", ".hidden.heic"):
        (tmp_path / name).write_bytes(b"x")
    items, skipped = files.collect_files([str(tmp_path)])
    assert [shown for shown, _, _ in items] == [str(tmp_path / "a.jpg")]
    why = dict(skipped)
    assert set(why) == {str(tmp_path / n) for n in ("b.HEIC", "c.heif", "d.CR2", "e.dng", "notes.txt", ".hidden.heic")}
    assert why[str(tmp_path / "b.HEIC")].startswith("skipped: HEIC is not a format read here")
    assert why[str(tmp_path / "d.CR2")].startswith("skipped: RAW (Canon) is not a format read here")
    assert why[str(tmp_path / "e.dng")].startswith("skipped: RAW (DNG)")
    assert why[str(tmp_path / "notes.txt")] is None and why[str(tmp_path / ".hidden.heic")] is None


def test_a_file_is_read_up_to_the_limit_and_no_further(tmp_path):
    """read_limited (local and --server classify): a file over the limit by its size is refused unread; one whose
    size says less than it holds (a pipe here, a file growing between stat and read) is refused after limit + 1
    bytes, the writer left with the rest unread."""
    from webapp.errors import TooLarge

    exact = tmp_path / "ten.bin"
    exact.write_bytes(b"0123456789")
    assert files.read_limited(exact, 10) == b"0123456789"
    with pytest.raises(TooLarge, match=r"^the file is 10 bytes; the limit is 9 \(CLASSIFIER_MAX_UPLOAD_BYTES\)$"):
        files.read_limited(exact, 9)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    wrote: list = []

    def writer() -> None:
        try:
            with open(fifo, "wb") as f:
                for _ in range(64):  # 4 MiB, more than the pipe buffer holds
                    f.write(bytes(65536))
            wrote.append("all")
        except BrokenPipeError:
            wrote.append("cut off")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    with pytest.raises(TooLarge, match=r"^the file is larger than 1,000 bytes \(CLASSIFIER_MAX_UPLOAD_BYTES\)$"):
        files.read_limited(fifo, 1000)
    thread.join(10)
    assert wrote == ["cut off"]


def test_a_skipped_photo_is_told_every_format_the_decoder_reads():
    """The skip message's list is the decoder's own (webapp/imaging.py opens uploads as FORMATS only)."""
    from webapp import imaging

    why = files.why_skipped(Path("IMG_0001.HEIC"))
    listed = re.search(r"\((.*)\)", why).group(1)
    assert {name.upper() for name in re.split(r", | or ", listed)} == set(imaging.FORMATS), why
    assert listed == imaging.FORMAT_NAMES


def _odd_entries(folder: Path) -> dict[str, str]:
    """A broken link, a FIFO and a link to a device, each with a photo's name; a real photo; two text files."""
    folder.mkdir(exist_ok=True)
    (folder / "IMG_0001.jpg").symlink_to(folder / "nowhere")
    os.mkfifo(folder / "IMG_0002.jpg")
    (folder / "IMG_0003.jpg").symlink_to("/dev/zero")
    (folder / "dog.jpg").write_bytes((SHARED_IMAGES / "dog.jpg").read_bytes())
    (folder / "gone.txt").symlink_to(folder / "nowhere")
    (folder / "notes.txt").write_text("x")
    return {"IMG_0001.jpg": "no such file or directory (a broken link)", "IMG_0002.jpg": "not a regular file",
            "IMG_0003.jpg": "not a regular file"}


def test_a_folders_broken_links_fifos_and_devices_are_error_entries_not_skipped(tmp_path):
    """In a folder, an entry classify would take that cannot be read is an error, as on the command line;
    "skipped ... (--all-files tries them)" counts only what --all-files would really try."""
    if not (SHARED_IMAGES / "dog.jpg").is_file():
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    odd = _odd_entries(tmp_path / "f")
    items, skipped = files.collect_files([str(tmp_path / "f")])
    assert [(Path(shown).name, path, why) for shown, path, why in items] == [
        *((name, None, why) for name, why in odd.items()), ("dog.jpg", tmp_path / "f" / "dog.jpg", None)]
    assert skipped == [(str(tmp_path / "f" / "notes.txt"), None)]  # not the broken gone.txt
    assert files.skipped_note(skipped) == "; skipped in folders: 1 other file (--all-files tries them)"
    items, skipped = files.collect_files([str(tmp_path / "f")], all_files=True)
    assert {Path(shown).name: why for shown, _, why in items} == {
        **odd, "dog.jpg": None, "gone.txt": "no such file or directory (a broken link)", "notes.txt": None}
    assert skipped == []
    # the same words as each named on the command line
    for name, why in odd.items():
        assert files.collect_files([str(tmp_path / "f" / name)])[0] == [(str(tmp_path / "f" / name), None, why)]


@pytest.mark.cli
@pytest.mark.extended  # unreadable folder entries, rare (~7 s): with `-m extended`
def test_classify_reports_a_folders_unreadable_entries_and_never_opens_a_fifo(tmp_path):
    if not (SHARED_IMAGES / "dog.jpg").is_file():
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    odd = _odd_entries(tmp_path / "f")
    out = run_cli("classify", *QUICK, "-f", "json", str(tmp_path / "f"), timeout=120,  # a FIFO opened would hang
                  env=clean_env(CLASSIFIER_CACHE_DIR=tmp_path / "cache"))
    assert out.returncode == 1, out.stderr
    rows = {Path(r["path"]).name: r for r in json.loads(out.stdout)}
    assert set(rows) == {*odd, "dog.jpg"}
    assert rows["IMG_0001.jpg"]["error"] == {"code": "not_found", "message": odd["IMG_0001.jpg"]}
    for name in ("IMG_0002.jpg", "IMG_0003.jpg"):
        assert rows[name]["error"] == {"code": "not_a_file", "message": "not a regular file"}
    assert rows["dog.jpg"]["error"] is None and rows["dog.jpg"]["predictions"]
    assert "4 files: 1 classified, 3 failed" in out.stderr
    assert out.stderr.rstrip().endswith("skipped in folders: 1 other file (--all-files tries them)"), out.stderr


def test_paths_are_shown_as_given_never_resolved(tmp_path, monkeypatch):
    """One rule for the table, JSON, CSV and --cluster's rows: the path as given (a symlink stays itself)."""
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (real / "sub" / "x.png").write_bytes(b"x")
    (tmp_path / "link").symlink_to(real)
    (tmp_path / "one.png").symlink_to(real / "sub" / "x.png")
    items, _ = files.collect_files([str(tmp_path / "one.png")])
    assert items == [(str(tmp_path / "one.png"), tmp_path / "one.png", None)]
    items, _ = files.collect_files([f"{tmp_path}/link/"])
    assert [shown for shown, _, _ in items] == [str(tmp_path / "link" / "sub" / "x.png")]
    # never normalised: `classify .` named ./-x.png as -x.png, and ./../real as ../real (tryout30)
    (real / "-x.png").write_bytes(b"x")
    monkeypatch.chdir(real)
    for given, want in ((".", "./-x.png"), ("./../real", "./../real/-x.png"), ("sub//", "sub//x.png")):
        items, _ = files.collect_files([given])
        assert want in [shown for shown, _, _ in items], (given, items)


def test_symlinked_folders_in_a_folder_are_walked_and_a_loop_ends(tmp_path):
    """Found by a fresh-user tryout: a symlinked folder inside a walked folder was left out without a word (1 file
    of 3 classified, exit 0), while the same folder named on the command line was walked. It is walked, as its
    path; a link back to a folder above (a loop) is not followed again, and nothing is listed twice."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.png").write_bytes(b"x")
    walked = tmp_path / "walked"
    walked.mkdir()
    (walked / "b.png").write_bytes(b"x")
    (walked / "linked").symlink_to(data / "sub")  # a folder of photos kept elsewhere
    (walked / "linked" / "loop").symlink_to(walked)  # data/sub/loop -> walked: a loop through the link
    (walked / "self").symlink_to(".")  # a link to the folder itself
    (walked / "up").symlink_to("..")  # a link to the folder above the one given (tryout27: its tree was walked)
    (walked / "root").symlink_to("/")
    items, skipped = files.collect_files([str(walked)])
    assert [shown for shown, _, _ in items] == [str(walked / "b.png"), str(walked / "linked" / "a.png")]
    assert skipped == [] and all(error is None for _, _, error in items)
    items, _ = files.collect_files([str(walked / "linked")])  # given through a link: its target's parents count
    assert [shown for shown, _, _ in items] == [str(walked / "linked" / "a.png"), str(walked / "linked" / "loop" / "b.png")]


def test_a_photo_named_as_a_format_not_read_is_read_where_its_bytes_are_one(tmp_path):
    """Found by a fresh-user tryout: a JPEG saved as ``.heic`` was skipped in a folder by its name alone ("HEIC is
    not a format read here"), though named on the command line it was classified. Its first bytes decide."""
    (tmp_path / "jpeg.heic").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(100))
    (tmp_path / "real.heic").write_bytes(b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(100))
    (tmp_path / "empty.cr2").write_bytes(b"")
    items, skipped = files.collect_files([str(tmp_path)])
    assert [shown for shown, _, _ in items] == [str(tmp_path / "jpeg.heic")]
    assert [(shown, why.split(" is not")[0]) for shown, why in skipped] == [
        (str(tmp_path / "empty.cr2"), "skipped: RAW (Canon)"), (str(tmp_path / "real.heic"), "skipped: HEIC")]


def test_every_symlink_is_its_own_row_and_a_path_found_twice_is_one(tmp_path):
    """A dataset's class folders of symlinks into one pool: 45 links to 9 photos gave 9 rows, the other paths
    left out without a word (the files were de-duplicated by their resolved target)."""
    pool = tmp_path / "pool"
    pool.mkdir()
    for i in range(3):
        (pool / f"p{i}.png").write_bytes(b"x")
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        for i in range(3):
            (tmp_path / split / f"p{i}.png").symlink_to(pool / f"p{i}.png")
    items, _ = files.collect_files([str(tmp_path / "train"), str(tmp_path / "val"), str(pool / "p0.png")])
    assert [shown for shown, _, _ in items] == [str(tmp_path / s / f"p{i}.png") for s in ("train", "val")
                                                for i in range(3)] + [str(pool / "p0.png")]
    # the same path twice (a folder, then a file in it, then the folder again): one row
    items, _ = files.collect_files([str(pool), str(pool / "p1.png"), f"{pool}/"])
    assert [shown for shown, _, _ in items] == [str(pool / f"p{i}.png") for i in range(3)]


def test_cluster_rows_name_paths_as_local_classify_does(no_classifier_env, tmp_path, monkeypatch, capsys):
    """--cluster hands Ray absolute paths (symlinks kept) and maps each row back to the path as given."""
    pytest.importorskip("ray", reason="the Ray path needs requirements-cluster.txt")
    pytest.importorskip("a2wsgi", reason="the Ray path needs requirements-cluster.txt")
    from webapp import cluster

    real = tmp_path / "real"
    real.mkdir()
    (real / "x.png").write_bytes(b"x")
    (tmp_path / "link.png").symlink_to(real / "x.png")
    seen = {}

    def fake_job(values, sources, out, *, shown, console, **kwargs):
        seen.update(sources=sources, shown=shown)
        return {"files": 1, "failed": 0, "seconds": 1.0, "models": ["efficientnet_lite0"]}

    monkeypatch.setattr(cluster, "classify_to_parquet", fake_job)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["classify", "--cluster", "--model", "efficientnet_lite0", "--out", "o.parquet", "link.png"]) == 0
    assert seen["sources"] == [str(tmp_path / "link.png")]  # absolute, not resolved to real/x.png
    assert seen["shown"] == {str(tmp_path / "link.png"): "link.png"}
    err = capsys.readouterr().err
    assert "1 file: 1 classified by efficientnet_lite0, 0 failed" in err and "warning" not in err


def test_classify_reads_paths_from_stdin(photos, tmp_path, no_classifier_env, monkeypatch, capsys):
    """``find ... | python -m webapp classify -``: one path per line, blank lines ignored, beside other paths."""
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path))
    dog = SHARED_IMAGES / "dog.jpg"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{dog}\n\n{photos / 'sub' / 'red.png'}\n"))
    assert cli.main(["classify", *QUICK, "-q", "-f", "json", "-", str(SHARED_IMAGES / "eagle.jpg")]) == 0
    paths = [r["path"] for r in json.loads(capsys.readouterr().out)]
    assert paths == [str(dog), str(photos / "sub" / "red.png"), str(SHARED_IMAGES / "eagle.jpg")]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli.main(["classify", "-"]) == 2
    assert capsys.readouterr().err == "error: no paths (stdin was empty)\n"


@pytest.mark.cli
def test_classify_from_stdin_in_a_shell(photos, tmp_path):
    out = subprocess.run(f"ls {SHARED_IMAGES / 'dog.jpg'} | {sys.executable} -m webapp classify {' '.join(QUICK)} -q -",
                         shell=True, cwd=ROOT, env=clean_env(CLASSIFIER_CACHE_DIR=tmp_path), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].startswith(str(SHARED_IMAGES / "dog.jpg"))


# -- classify: the real engine ----------------------------------------------------------------------------
@pytest.mark.cli
def test_classify_table_reports_every_file_and_goes_on_past_a_broken_one(photos, tmp_path):
    out = run_cli("classify", *QUICK, str(SHARED_IMAGES), str(photos),
                  env=clean_env(CLASSIFIER_CACHE_DIR=tmp_path))
    assert out.returncode == 1, out.stderr  # one file failed
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    shared = sorted(p for p in SHARED_IMAGES.iterdir() if p.suffix.lower() in files.IMAGE_SUFFIXES)
    assert set(rows) == {str(p) for p in shared} | {str(photos / "broken.jpg"), str(photos / "sub" / "red.png")}
    assert "error:" in rows[str(photos / "broken.jpg")] and "undecodable_image" in rows[str(photos / "broken.jpg")]
    assert sum("error:" in line for line in rows.values()) == 1
    labels = re.findall(r"(\S.*?) \d+\.\d%", rows[str(SHARED_IMAGES / "dog.jpg")].split(None, 1)[1])
    assert len(labels) == 3 and set(labels) & dog_breed_labels(), labels
    # progress bar and summary on stderr, never on stdout
    assert "img/s" in out.stderr and "100%" in out.stderr
    assert "img/s" not in out.stdout and "\r" not in out.stdout
    assert f"{len(rows)} files: {len(rows) - 1} classified, 1 failed" in out.stderr


def test_local_classify_says_what_to_do_with_a_file_not_how_to_upload_it(tmp_path, no_classifier_env, monkeypatch,
                                                                          capsys):
    """tryout27: a base64 text file given to local classify was told "send the bytes themselves (curl
    --data-binary ...); base64 goes in a /v2 JSON request": an upload's advice, to someone with a file here."""
    import base64

    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path))
    dog = (SHARED_IMAGES / "dog.jpg").read_bytes()
    (tmp_path / "b64.jpg").write_bytes(base64.b64encode(dog))
    (tmp_path / "hex.jpg").write_bytes(dog.hex().encode())
    (tmp_path / "stripped.jpg").write_bytes(dog.replace(b"\r", b"").replace(b"\n", b""))  # as curl -d sends it
    code = cli.main(["classify", *QUICK, "--format", "json", *(str(tmp_path / n) for n in
                                                              ("b64.jpg", "hex.jpg", "stripped.jpg"))])
    errors = [r["error"] for r in json.loads(capsys.readouterr().out)]
    assert code == 1 and [e["code"] for e in errors] == ["unsupported_media_type", "unsupported_media_type",
                                                         "undecodable_image"], errors
    assert errors[0]["message"] == ("it is base64 text of a JPEG, not the JPEG's bytes: decode it to the photo's "
                                    "bytes first (base64 -d FILE > photo.jpg), then classify photo.jpg")
    assert "(xxd -r -p FILE > photo.jpg)" in errors[1]["message"]
    assert errors[2]["message"].endswith("; get the file again, copied as bytes (a binary transfer, not as text)")
    assert not any("curl -F" in e["message"] or "--data-binary" in e["message"] for e in errors), errors


def test_classify_json_in_process(photos, tmp_path, no_classifier_env, monkeypatch, capsys):
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path))
    dog = SHARED_IMAGES / "dog.jpg"
    code = cli.main(["classify", *QUICK, "--format", "json", "--topk", "5", str(dog), str(photos / "broken.jpg")])
    out = capsys.readouterr()
    assert code == 1, out.err
    results = json.loads(out.out)
    assert [r["path"] for r in results] == [str(dog), str(photos / "broken.jpg")]
    good, broken = results
    assert good["error"] is None and len(good["predictions"]) == 5 and good["model"] == "efficientnet_lite0"
    assert any(p["index"] in DOG_BREEDS for p in good["predictions"][:3])
    assert (good["width"], good["height"], good["format"]) == (768, 576, "JPEG")
    assert broken["error"]["code"] == "undecodable_image" and broken["predictions"] == []


def test_classify_csv_in_process(photos, tmp_path, no_classifier_env, monkeypatch, capsys):
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path))
    code = cli.main(["classify", *QUICK, "-f", "csv", "-k", "2", str(SHARED_IMAGES / "dog.jpg"),
                     str(photos / "broken.jpg")])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    rows = list(csv.DictReader(io.StringIO(captured.out)))
    assert list(rows[0]) == ["path", "rank", "label", "index", "probability", "error"]
    dog = [r for r in rows if r["path"].endswith("dog.jpg")]
    assert [r["rank"] for r in dog] == ["1", "2"] and all(r["error"] == "" for r in dog)
    assert int(dog[0]["index"]) in DOG_BREEDS and 0 < float(dog[0]["probability"]) <= 1
    (broken,) = [r for r in rows if r["path"].endswith("broken.jpg")]
    assert broken["error"] and broken["label"] == "" and broken["rank"] == ""
    assert "img/s" in captured.err


def test_quiet_leaves_per_file_errors_to_the_output_as_its_help_says(photos, tmp_path, no_classifier_env,
                                                                     monkeypatch, capsys):
    """-q: a broken photo is a row of stdout's output and nothing on stderr; the help says so (no "errors
    still go to stderr")."""
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path))
    code = cli.main(["classify", *QUICK, "-q", "-f", "csv", str(SHARED_IMAGES / "dog.jpg"), str(photos / "broken.jpg")])
    out = capsys.readouterr()
    assert code == 1 and out.err == ""
    (broken,) = [r for r in csv.DictReader(io.StringIO(out.out)) if r["path"].endswith("broken.jpg")]
    assert broken["error"].startswith("the JPEG data is incomplete") and "cut short" in broken["error"] and broken["label"] == ""
    assert broken["error"].endswith(" (undecodable_image)")  # its code, as the table and JSON give it
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit):
        cli.main(["classify", "--help"])
    (quiet,) = [line for line in capsys.readouterr().out.splitlines() if "--quiet" in line]
    assert "errors still go to stderr" not in quiet and "errors that stop the run still go to stderr" in quiet
    assert "A file that fails is a row of the output" in quiet


# -- weights ---------------------------------------------------------------------------------------------
def _named_by_its_hash(folder: Path, data: bytes, stem: str = "model") -> Path:
    path = folder / f"{stem}-{hashlib.sha256(data).hexdigest()[:8]}.pth"
    path.write_bytes(data)
    return path


def test_weights_verify(tmp_path, capsys, monkeypatch):
    good = _named_by_its_hash(tmp_path, os.urandom(4096))
    # Whole and as its name says, but not ResNet-18's file, the only one the service loads: it would refuse it
    # (tryout: this said OK, exit 0, and the server then refused the file as "damaged or not the expected file").
    assert cli.main(["weights", "verify", str(good)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"NOT RESNET-18 {good}") and "resnet18-f37072fd.pth" in out and "would refuse" in out
    assert cli.main(["weights", "verify", str(good), "--sha256", hashlib.sha256(good.read_bytes()).hexdigest()]) == 1
    capsys.readouterr()
    # Where it is the file the service loads (here: a URL naming its hash stands in for torchvision's), OK.
    monkeypatch.setattr("webapp.models.RESNET18_URL", f"https://download.example/{good.name}")
    assert cli.main(["weights", "verify", str(good)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {good}")
    tampered = tmp_path / "tampered" / good.name
    tampered.parent.mkdir()
    data = bytearray(good.read_bytes())
    data[100] ^= 1
    tampered.write_bytes(bytes(data))
    assert cli.main(["weights", "verify", str(tampered)]) == 1
    assert capsys.readouterr().out.startswith(f"MISMATCH {tampered}")
    unnamed = tmp_path / "resnet18.pth"
    unnamed.write_bytes(b"not resnet")
    assert cli.main(["weights", "verify", str(unnamed)]) == 1
    out = capsys.readouterr().out
    assert good.name[:-4] in out and "no sha256 prefix" in out
    assert cli.main(["weights", "verify", str(good), "--sha256", hashlib.sha256(good.read_bytes()).hexdigest()]) == 0
    assert "is the one (given with --sha256)" in capsys.readouterr().out  # not "X starts with X" (tryout13)
    with pytest.raises(SystemExit) as ei:  # two hex digits match one file in 256 by chance: a usage error
        cli.main(["weights", "verify", str(good), "--sha256", good.name[6:8]])
    assert ei.value.code == 2 and "give 8 to 64 hex digits" in capsys.readouterr().err
    assert cli.main(["weights", "verify", str(tmp_path / "absent.pth")]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'absent.pth'}: no such file\n"
    (tmp_path / "link.pth").symlink_to(tmp_path / "absent.pth")
    assert cli.main(["weights", "verify", str(tmp_path / "link.pth")]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'link.pth'}: is a link to {tmp_path / 'absent.pth'}, which " \
                                      "does not exist\n"
    assert cli.main(["weights", "verify", str(tmp_path / f"{LONG}.pth")]) == 1  # one line, no traceback
    assert capsys.readouterr().err == f"error: {tmp_path / LONG}.pth: File name too long\n"
    assert cli.main(["weights", "fetch", "--dest", str(tmp_path / LONG), "--url", "http://127.0.0.1:9/x.pth"]) == 1
    assert capsys.readouterr().err == f"error: --dest: {tmp_path / LONG}: File name too long\n"  # the folder named


@pytest.mark.parametrize("value", ["1e9", "0", "nan", "abc", "601"])
def test_weights_fetch_timeout_has_the_settings_range(value, tmp_path, no_classifier_env, capsys):
    """``--timeout 1e9`` was taken (tryout25): the option gives CLASSIFIER_DOWNLOAD_TIMEOUT_S's value, so it has
    that setting's range (0.1 to 600 s), a usage error before anything is fetched."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["weights", "fetch", "--dest", str(tmp_path / "w"), "--url", "http://127.0.0.1:9/x.pth",
                  "--timeout", value])
    assert exc.value.code == 2
    assert f"argument --timeout: --timeout={value!r} is" in capsys.readouterr().err
    assert "from 0.1 to 600" in settings.BY_NAME["DOWNLOAD_TIMEOUT_S"].rule()
    assert not (tmp_path / "w").exists()


def test_weights_fetch_without_network_fails_fast(tmp_path, no_classifier_env, capsys):
    url = f"http://127.0.0.1:{free_port()}/resnet18-f37072fd.pth"  # nothing listens there: refused at once
    start = time.monotonic()
    assert cli.main(["weights", "fetch", "--dest", str(tmp_path / "w"), "--url", url, "--timeout", "2"]) == 1
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert "cannot connect to 127.0.0.1" in err and "carry the file over" in err
    assert not (tmp_path / "w").exists()  # the folder it made for --dest is gone again: nothing left behind


@pytest.mark.parametrize("dest", ["a-file", "a-file/sub", "/dev/null"])
def test_weights_fetch_says_at_once_that_dest_is_not_a_folder(tmp_path, no_classifier_env, capsys, dest):
    """Found by a fresh-user tryout: a --dest that is a file (or has one on the way) was looked at only after
    the download, as "cannot write ...: File exists" and "No network here?"; offline, not at all. Now one line,
    the OS's reason, before any connection (nothing listens at the URL: a download would be refused)."""
    (tmp_path / "a-file").write_text("x")
    path = dest if dest.startswith("/") else str(tmp_path / dest)
    url = f"http://127.0.0.1:{free_port()}/resnet18-f37072fd.pth"
    assert cli.main(["weights", "fetch", "--dest", path, "--url", url, "--timeout", "2"]) == 1
    assert capsys.readouterr().err == f"error: --dest: {path}: Not a directory\n"


def test_weights_fetch_says_at_once_that_dest_is_read_only(read_only_view, tmp_path, no_classifier_env, capsys):
    """Found by a fresh-user tryout (tryout26): a --dest on a read-only mount was found only after the download
    (minutes on a slow link), as "cannot write". Now one line before any connection (nothing listens at the URL)."""
    _, view = read_only_view
    url = f"http://127.0.0.1:{free_port()}/resnet18-f37072fd.pth"
    for dest in (view, view / "sub"):
        assert cli.main(["weights", "fetch", "--dest", str(dest), "--url", url, "--timeout", "2"]) == 1
        assert capsys.readouterr().err == f"error: --dest: {dest}: Read-only file system\n"


@pytest.fixture
def file_server(tmp_path):
    """A local HTTP server for ``tmp_path/served``: a stand-in for download.pytorch.org."""
    root = tmp_path / "served"
    root.mkdir()
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_weights_fetch_downloads_checks_and_says_what_to_do(file_server, tmp_path, no_classifier_env, capsys):
    root, base = file_server
    good = _named_by_its_hash(root, os.urandom(50_000), "resnet18")
    dest = tmp_path / "carry"
    assert cli.main(["weights", "fetch", "--dest", str(dest), "--url", f"{base}/{good.name}"]) == 0
    out = capsys.readouterr().out
    assert (dest / good.name).read_bytes() == good.read_bytes()
    assert f"saved {dest / good.name}" in out and "CLASSIFIER_WEIGHTS" in out and "hub/checkpoints" in out
    assert cli.main(["weights", "fetch", "--dest", str(dest), "--url", f"{base}/{good.name}"]) == 0
    assert "already here" in capsys.readouterr().out
    # the server hands out a file that does not match its name: refused, nothing left behind
    liar = root / "resnet18-00000000.pth"
    liar.write_bytes(b"tampered")
    assert cli.main(["weights", "fetch", "--dest", str(dest), "--url", f"{base}/{liar.name}"]) == 1
    assert not (dest / liar.name).exists()
    assert "00000000" in capsys.readouterr().err


# -- info ------------------------------------------------------------------------------------------------
def test_info(no_classifier_env, capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert set(info) == {"cpu", "torch", "precision", "cores", "plan", "weights", "cache_dir", "compile"}
    assert {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"} <= set(info["cpu"]["flags"])
    assert info["torch"]["aten_cpu_capability"] and isinstance(info["torch"]["native_bf16"], bool)
    assert info["precision"]["chosen"] in ("fp32", "bf16") and info["precision"]["reason"]
    assert info["cores"]["usable"] == sorted(os.sched_getaffinity(0))
    assert info["plan"]["workers"] >= 1 and len(info["plan"]["slots"]) == info["plan"]["workers"]
    assert info["weights"]["hub"]["path"].endswith("checkpoints/resnet18-f37072fd.pth")
    assert info["weights"]["would_serve"]
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "precision" in text and "plan" in text and "hub cache" in text
    assert info["precision"]["recheck_pts"] == {"bf16": 1.0, "int8": 3.0}
    assert ("answered by fp32: bf16's with its top two under 1 point apart (CLASSIFIER_BF16_RECHECK_PTS), int8's "
            "with its top two under 3 points apart (CLASSIFIER_INT8_RECHECK_PTS)") in text


def test_info_says_a_plan_the_start_refuses(no_classifier_env, monkeypatch, capsys):
    """CLASSIFIER_WORKERS=1000 on a 24 GB host: the start refuses it (exit 2), and info printed the plan without a
    word (tryout26). It says what the start says."""
    from webapp import cpu

    monkeypatch.setattr(cpu, "available_mb", lambda: 4096)
    monkeypatch.setenv("CLASSIFIER_WORKERS", "500")
    assert cli.main(["info", "--json"]) == 0
    problem = json.loads(capsys.readouterr().out)["plan"]["problem"]
    assert problem == cpu.memory_problem(500, 4096) and problem.startswith("500 workers need at least")
    assert cli.main(["info"]) == 0
    assert f"  a start refuses it  {problem}" in capsys.readouterr().out
    monkeypatch.setenv("CLASSIFIER_WORKERS", "1")
    assert cli.main(["info"]) == 0 and "a start refuses it" not in capsys.readouterr().out


def test_info_names_path_settings_that_cannot_be_looked_at(no_classifier_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CLASSIFIER_WEIGHTS", str(tmp_path / f"{LONG}.pth"))
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / LONG))
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"{tmp_path / LONG}.pth (cannot be looked at: File name too long)" in text
    assert "nothing: CLASSIFIER_WEIGHTS cannot be looked at (File name too long), start-up fails" in text
    assert f"{tmp_path / LONG} (cannot be looked at: File name too long)" in text


def test_info_says_a_weights_setting_naming_a_folder_is_a_folder(no_classifier_env, monkeypatch, tmp_path, capsys):
    """It said "(absent)", which sent the user looking for a file that is there as a folder (tryout13)."""
    monkeypatch.setenv("CLASSIFIER_WEIGHTS", str(tmp_path))
    assert cli.main(["info"]) == 0
    assert f"{tmp_path} (a folder, not a weights file)" in capsys.readouterr().out
    monkeypatch.setenv("CLASSIFIER_WEIGHTS", str(tmp_path / "none.pth"))
    assert cli.main(["info"]) == 0
    assert f"{tmp_path / 'none.pth'} (absent)" in capsys.readouterr().out
    (tmp_path / "link.pth").symlink_to(tmp_path / "none.pth")  # a dangling link: not "absent" (tryout26)
    monkeypatch.setenv("CLASSIFIER_WEIGHTS", str(tmp_path / "link.pth"))
    assert cli.main(["info"]) == 0
    assert f"{tmp_path / 'link.pth'} (is a link to {tmp_path / 'none.pth'}, which does not exist)" \
        in capsys.readouterr().out


@pytest.mark.parametrize("model", ["efficientnet_lite0", "resnet18_seeded"])
def test_info_shows_no_resnet18_download_for_a_model_that_loads_none(no_classifier_env, monkeypatch, capsys, model):
    """With CLASSIFIER_MODEL=efficientnet_lite0 it showed the hub cache and 'download on, ...resnet18...', which
    that model never looks at (tryout13)."""
    monkeypatch.setenv("CLASSIFIER_MODEL", model)
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "resnet18-f37072fd" not in text and re.search(r"ResNet-18 weights +not used by this model", text)


def test_a_weights_setting_that_cannot_be_looked_at_stops_the_start_in_one_line(tmp_path):
    from webapp.errors import StartupError
    from webapp.models import resolve_resnet18_weights

    with pytest.raises(StartupError, match=f"^CLASSIFIER_WEIGHTS={tmp_path / LONG}.pth cannot be looked at: File "
                                           "name too long$"):
        resolve_resnet18_weights(settings.load({"CLASSIFIER_WEIGHTS": f"{tmp_path / LONG}.pth"}))


@pytest.mark.parametrize("how", ["option", "variable"])
def test_classify_names_a_missing_weights_file_as_the_user_gave_it(how, no_classifier_env, monkeypatch, tmp_path,
                                                                   capsys):
    """``classify --weights missing.pth`` said "CLASSIFIER_WEIGHTS=... or unset CLASSIFIER_WEIGHTS", a variable the
    user never set (found in tryout26's follow-up); the flag is named, and the advice is to leave it out."""
    missing = tmp_path / "missing.pth"
    given = ["--weights", str(missing)] if how == "option" else []
    if how == "variable":
        monkeypatch.setenv("CLASSIFIER_WEIGHTS", str(missing))
    assert cli.main(["classify", "--model", "resnet18", "--no-compile", *given, str(SHARED_IMAGES / "dog.jpg")]) == 2
    named, drop = ("--weights", "leave out") if how == "option" else ("CLASSIFIER_WEIGHTS", "unset")
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: cannot start the model: {named}={missing} does not exist. Put a copy of "
        f"https://download.pytorch.org/models/resnet18-f37072fd.pth there, or {drop} {named}.")


def test_info_says_what_the_offline_fallback_runs_at(no_classifier_env, monkeypatch, capsys):
    """Where auto picks bf16 for the CPU, the offline model (which the catalog keeps in fp32) is listed in fp32."""
    from webapp import catalog, engine

    real = engine.choose_precision
    monkeypatch.setattr(engine, "choose_precision",  # this CPU's auto answer, as on one with native bf16
                        lambda requested: ("bf16", "auto: native bf16 (test)") if requested == "auto" else real(requested))
    assert cli.main(["info", "--json"]) == 0
    by_model = json.loads(capsys.readouterr().out)["precision"]["by_model"]
    assert by_model[catalog.OFFLINE]["precision"] == "fp32"
    assert catalog.BY_NAME[catalog.OFFLINE].bf16_auto_off in by_model[catalog.OFFLINE]["reason"]
    assert by_model["resnet18"]["precision"] == "bf16"
    assert cli.main(["info"]) == 0
    assert f"  {catalog.OFFLINE}" in capsys.readouterr().out
    monkeypatch.setenv("CLASSIFIER_PRECISION", "fp32")  # nothing to say when the precision is set
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"]["by_model"] == {}


@pytest.mark.parametrize("user_dir", [False, True])
def test_info_shows_the_kernel_cache_the_service_uses(no_classifier_env, monkeypatch, tmp_path, capsys, user_dir):
    """``info``'s inductor folder is the one ``startup.use_cache_dir`` points torch at (not torch's /tmp default)."""
    from webapp import startup

    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / "cache"))
    if user_dir:  # the operator's own TORCHINDUCTOR_CACHE_DIR wins, in both
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    else:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert cli.main(["info", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["cache_dir"]
    expected = tmp_path / ("mine" if user_dir else "cache/inductor")
    assert shown["path"] == str(tmp_path / "cache") and shown["inductor"] == str(expected)
    startup.use_cache_dir(settings.load())  # what a worker does at start-up
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == shown["inductor"]
    assert cli.main(["info"]) == 0
    assert f"inductor kernels in {expected}" in capsys.readouterr().out


# -- classify's exit status: each row of common.CLASSIFY_EXIT_STATUS (the README's table) happens ----------------
def _damaged_weights(tmp_path: Path) -> Path:
    path = tmp_path / "resnet18-f37072fd.pth"
    path.write_bytes(b"not the weights")
    return path


@pytest.mark.parametrize("case, expected", [
    ("all classified", 0),
    ("one broken photo", 1),
    ("a bad option value", 2),
    ("a path that does not exist", 2),
    ("no image file in the paths", 2),
    ("--weights names a missing file", 2),
    ("--weights names a damaged file", 2),
])
def test_classify_exit_status_table(case, expected, photos, tmp_path, no_classifier_env, monkeypatch, capsys):
    from webapp.cli.common import CLASSIFY_EXIT_STATUS

    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    dog = str(SHARED_IMAGES / "dog.jpg")
    resnet = ("--model", "resnet18", "--no-compile", "--precision", "fp32", "--no-fallback")
    argv = {
        "all classified": [*QUICK, dog],
        "one broken photo": [*QUICK, dog, str(photos / "broken.jpg")],
        "a bad option value": ["--topk", "abc", dog],
        "a path that does not exist": [*QUICK, str(tmp_path / "missing.jpg")],
        "no image file in the paths": [*QUICK, str(tmp_path / "empty")],
        "--weights names a missing file": [*resnet, "--weights", str(tmp_path / "nope.pth"), dog],
        "--weights names a damaged file": [*resnet, "--weights", str(_damaged_weights(tmp_path)), dog],
    }[case]
    try:
        code = cli.main(["classify", "-q", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == expected, err
    assert code in CLASSIFY_EXIT_STATUS
    if case.startswith("--weights"):
        assert err.startswith("error: cannot start the model: ") and err.count("\n") == 1, err


@pytest.mark.parametrize("fmt, printed", [("json", "[]\n"), ("csv", "path,rank,label,index,probability,error\n")])
def test_ctrl_c_while_the_model_starts_still_prints_a_whole_empty_output(no_classifier_env, monkeypatch, capsys,
                                                                        fmt, printed):
    """Found by a fresh-user tryout: Ctrl-C while "starting the model" left standard output empty, where
    ``--format json`` promises a whole list however the run ends: it is ``[]``."""
    from webapp import service

    def interrupted(self, heartbeat=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(service.Classifier, "start", interrupted)
    assert cli.main(["classify", "-q", "-f", fmt, str(SHARED_IMAGES / "dog.jpg")]) == 130
    out = capsys.readouterr()
    assert out.out == printed and out.err == "interrupted\n", out


def test_classify_interrupted_exits_130(no_classifier_env, monkeypatch, capsys):
    from webapp.cli import classify

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(classify, "cmd_classify", interrupted)
    assert cli.main(["classify", "x.jpg"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("quiet", [False, True])
def test_classify_names_the_model_that_serves_and_warns_once(no_classifier_env, tmp_path, monkeypatch, capsys, quiet):
    """No ResNet-18 weights: the fallback warning once (a warning: -q keeps it), with the way to silence it;
    every line names the model that answers, never 'starting resnet18'."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # an empty hub cache
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["classify", "--no-compile", "--precision", "fp32", "--no-download", str(SHARED_IMAGES / "dog.jpg")]
    assert cli.main(argv + (["-q"] if quiet else [])) == 0
    err = capsys.readouterr().err
    assert err.count("ResNet-18 weights not found") == 1, err
    assert "CLASSIFIER_MODEL=efficientnet_lite0" in err and "resnet18" not in err.replace("resnet18-f37072fd", "")
    if not quiet:
        assert "starting the model (eager) ..." in err
        assert "model EfficientNet-Lite0 (offline), weights efficientnet-lite0-" in err and ") (" not in err


@pytest.mark.parametrize("fmt", ["json", "csv", "table"])
def test_output_is_valid_unicode_for_a_name_that_is_not_utf8(fmt):
    """Python keeps such a name's bytes as lone surrogates ("\\udce9"), which json writes as is: strict readers
    (serde_json, Go) refuse or mangle it (tryout); CSV wrote the raw byte, which a UTF-8 CSV reader refuses
    (tryout13). Its bytes are written \\xNN in every format; in the table a newline in a name is escaped too."""
    import io as _io

    from webapp.cli.output import ResultStream

    path = os.fsdecode(b"/photos/caf\xe9.jpg")
    out = _io.StringIO()
    results = [{"path": path, "predictions": [{"label": "tabby", "index": 281, "probability": 0.5}], "error": None},
               {"path": "/photos/two\nlines.jpg", "predictions": [], "error": {"code": "x", "message": "m"}}]
    stream = ResultStream(fmt, 3, [r["path"] for r in results], out)
    assert all(stream.put(i, r) for i, r in enumerate(results)) and stream.close()
    text = out.getvalue()
    text.encode("utf-8")  # no lone surrogate left: it would raise
    if fmt == "json":
        assert json.loads(text)[0]["path"] == "/photos/caf\\xe9.jpg"
    elif fmt == "csv":
        rows = list(csv.DictReader(_io.StringIO(text)))
        assert rows[0]["path"] == "/photos/caf\\xe9.jpg" and rows[1]["error"] == "m (x)"
    else:
        assert len(text.splitlines()) == 3 and "/photos/two\\nlines.jpg" in text and "caf\\xe9" in text


@pytest.mark.parametrize("fmt", ["json", "csv", "table"])
def test_a_byte_written_as_xnn_never_reads_as_another_files_name(fmt):
    """A file named with the byte FF and one named with the four characters ``\\xff`` were printed alike, each
    with its own answer (tryout30). Where a name gets such escapes, or holds one of its own, its backslashes are
    doubled: every name reads back to one file. A backslash in any other name stays as it is."""
    import io as _io

    from webapp.cli.output import ResultStream

    names = [os.fsdecode(b"bad\xffname.jpg"), "bad\\xffname.jpg", "two\nlines\\.jpg", "two\\nlines\\.jpg",
             "C:\\Users\\pic.jpg"]
    out = _io.StringIO()
    results = [{"path": n, "predictions": [{"label": "kite", "index": 21, "probability": 0.5}], "error": None}
               for n in names]
    stream = ResultStream(fmt, 3, names, out)
    assert all(stream.put(i, r) for i, r in enumerate(results)) and stream.close()
    text = out.getvalue()
    if fmt == "json":
        shown = [r["path"] for r in json.loads(text)]
    elif fmt == "csv":
        shown = [r["path"] for r in csv.DictReader(_io.StringIO(text))]
    else:
        shown = [line.split("  ")[0].rstrip() for line in text.splitlines()[1:]]
    newline = "two\\nlines" if fmt == "table" else "two\nlines"  # JSON and CSV hold the character itself
    assert shown == ["bad\\xffname.jpg", "bad\\\\xffname.jpg", newline + "\\\\.jpg", "two\\\\nlines\\\\.jpg",
                     "C:\\Users\\pic.jpg"], shown
    assert len(set(shown)) == len(names), shown


def test_csv_cells_a_spreadsheet_would_run_as_formulas_are_text():
    """Found by a fresh-user tryout: a file named ``=cmd().jpg`` was a CSV cell starting with ``=``, which a
    spreadsheet runs as a formula. Such cells get OWASP's leading ``'``; JSON keeps the name as it is."""
    import io as _io

    from webapp.cli.output import ResultStream

    names = ["=cmd().jpg", "+1.jpg", "-x.jpg", "@SUM(A1).jpg", "\tx.jpg", "plain=.jpg"]
    results = [{"path": n, "predictions": [{"label": "tabby", "index": 281, "probability": 0.5}], "error": None}
               for n in names] + [{"path": "=e.jpg", "predictions": [], "error": {"code": "x", "message": "-m"}}]
    for fmt in ("csv", "json"):
        out = _io.StringIO()
        stream = ResultStream(fmt, 3, [r["path"] for r in results], out)
        assert all(stream.put(i, r) for i, r in enumerate(results)) and stream.close()
        if fmt == "csv":
            rows = list(csv.DictReader(_io.StringIO(out.getvalue())))
            assert [r["path"] for r in rows] == ["'" + n for n in names[:-1]] + ["plain=.jpg", "'=e.jpg"]
            assert rows[-1]["error"] == "'-m (x)"
        else:
            assert [r["path"] for r in json.loads(out.getvalue())] == names + ["=e.jpg"]


def test_a_csv_cell_with_a_carriage_return_is_quoted():
    """Found by a fresh-user tryout: a file named "cr\\rret.jpg" was written unquoted (lines end in "\\n", so the
    csv module quoted "\\n" but not "\\r"), and csv and pandas read its row as two."""
    import io as _io

    from webapp.cli.output import ResultStream

    results = [{"path": "cr\rret.jpg", "predictions": [{"label": "tabby", "index": 281, "probability": 0.5}],
                "error": None},
               {"path": "e.jpg", "predictions": [], "error": {"code": "x", "message": "a\rb"}},
               {"path": "plain.jpg", "predictions": [{"label": "tabby", "index": 281, "probability": 0.5}], "error": None}]
    out = _io.StringIO()
    stream = ResultStream("csv", 3, [r["path"] for r in results], out)
    assert all(stream.put(i, r) for i, r in enumerate(results)) and stream.close()
    rows = list(csv.DictReader(_io.StringIO(out.getvalue(), newline="")))
    assert [(r["path"], r["rank"], r["error"]) for r in rows] == [("cr\rret.jpg", "1", ""), ("e.jpg", "", "a\rb (x)"),
                                                                   ("plain.jpg", "1", "")]
    assert out.getvalue().splitlines()[-1] == "plain.jpg,1,tabby,281,0.500000,"  # others quoted as before: minimal


@pytest.mark.cli
def test_a_name_the_outputs_encoding_cannot_hold_is_escaped_not_a_traceback(tmp_path):
    """Found by a fresh-user tryout: with an ASCII standard output (PYTHONIOENCODING=ascii, a C locale) a file named
    "émoji😀.jpg" ended the run in a UnicodeEncodeError traceback, exit 1. It is written escaped."""
    (tmp_path / "émoji😀.jpg").write_bytes(b"not a photo")
    out = run_cli("classify", str(tmp_path), "-q", env=clean_env(PYTHONIOENCODING="ascii", CLASSIFIER_COMPILE=0,
                                                                     CLASSIFIER_MODEL="resnet18_seeded"))
    assert "Traceback" not in out.stderr and out.returncode == 1, out.stderr  # 1: the file failed, as it does
    assert "\\xe9moji\\U0001f600.jpg" in out.stdout and "unsupported_media_type" in out.stdout, out.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_output_that_cannot_be_written_is_one_line_not_a_traceback():
    """``classify ... > /dev/full``: a traceback and exit 1, as if files had failed (tryout17). Now one line, and
    the caller exits 1 (EXIT_FAILED); nothing more is written at the interpreter's exit."""
    code = ("import sys; from webapp.cli.output import ResultStream; s = ResultStream('csv', 3, ['a.jpg']); "
            "ok = s.put(0, {'path': 'a.jpg', 'predictions': [], 'error': None}) or s.close(); "
            "sys.exit(0 if ok is False else 5)")
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "error: cannot write the results to standard output: No space left on device\n"


# -- stderr cannot drive the terminal; the folder search takes what the server reads; options out of place -------
def test_stderr_lines_escape_control_characters_in_file_names(tmp_path, no_classifier_env, capsys):
    """A file named with an ESC sequence (``bad<ESC>]0;pwned<BEL>.heic``: retitles the terminal) reached stderr raw,
    in the "skipped:" line and in "error: PATH: no such file" (tryout); the table escaped it already. Every line
    on stderr escapes C0 and C1 control characters and DEL, as the table does, logging's lines too."""
    import logging

    from webapp.cli import classify, common

    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "bad\x1b]0;pwned\x07.heic").write_bytes(b"x")
    assert cli.main(["classify", str(folder)]) == 2  # only a skipped HEIC: no image file
    said = capsys.readouterr().err
    assert f"{folder}/bad\\x1b]0;pwned\\x07.heic: skipped: HEIC" in said, said
    missing = "/tmp/nope\x1b[2J\x9b\x7f.jpg"
    assert cli.main(["classify", missing]) == 2
    said = capsys.readouterr().err
    assert said == "error: /tmp/nope\\x1b[2J\\x9b\\x7f.jpg: no such file or directory\n", said
    common.err("a\nb\udce9")  # a newline cannot forge a line either; a name's byte that is not UTF-8 is \xNN
    assert capsys.readouterr().err == "a\\nb\\xe9\n"
    stream = io.StringIO()
    restore = classify._setup_logging("warning", stream)
    try:
        logging.getLogger("webapp.test").warning("unexpected error on %s", "x\x1b[2J.jpg")
    finally:
        restore()
    assert stream.getvalue() == "WARNING webapp.test: unexpected error on x\\x1b[2J.jpg\n"
    for text in (said, stream.getvalue()):
        assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text)


def test_the_folder_search_takes_every_file_name_the_server_reads(tmp_path):
    """.mpo (read as JPEG), .apng (as PNG), .pjpeg, .pjp and .jfif files in a folder were skipped as "other files"
    (tryout). The names come from one table of the server's formats (contract.FORMATS), which holds every name
    Pillow gives those formats: it cannot drift from what the server opens."""
    from PIL import Image

    from webapp.contract import FORMATS

    names = ["a.mpo", "b.apng", "c.pjpeg", "d.pjp", "e.jfif", "f.PFM", "g.avifs", "h.jpg"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    items, skipped = files.collect_files([str(tmp_path)])
    assert [Path(shown).name for shown, _, _ in items] == names[:5] + ["f.PFM", "g.avifs", "h.jpg"] and not skipped
    assert set(files.FORMAT_SUFFIXES) == set(FORMATS)
    read = {ext for ext, fmt in Image.registered_extensions().items() if fmt in (*FORMATS, "MPO")}
    assert read <= files.IMAGE_SUFFIXES, sorted(read - files.IMAGE_SUFFIXES)


def test_no_scale_without_server_is_a_usage_error(tmp_path, no_classifier_env, capsys):
    """--no-scale alone did nothing, said nothing, while --out without --cluster is a usage error: so is it."""
    photo = tmp_path / "x.jpg"
    photo.write_bytes(b"x")
    assert cli.main(["classify", "--no-scale", str(photo)]) == 2
    assert capsys.readouterr().err == ("error: --no-scale goes with --server (it sends the files as they are "
                                       "instead of scaled down first)\n")
    assert cli.main(["classify", "--no-scale", "--cluster", "--out", str(tmp_path / "o.parquet"), str(photo)]) == 2
    assert "--no-scale goes with --server" in capsys.readouterr().err


def test_a_reader_that_leaves_is_exit_141_not_files_failed(no_classifier_env, monkeypatch, capsys):
    """``classify ... | head -1`` exited 1, which the exit table gives to "some files failed, each has its error
    line", with no line (tryout): a closed pipe is 141 (128 + SIGPIPE, as a shell reports it), in the table."""
    from webapp.cli import classify
    from webapp.cli.common import CLASSIFY_EXIT_STATUS, EXIT_PIPE

    def reader_left(args):
        raise BrokenPipeError

    monkeypatch.setattr(classify, "cmd_classify", reader_left)
    assert cli.main(["classify", "x.jpg"]) == EXIT_PIPE == 141
    assert capsys.readouterr().err == ""
    assert "head -1" in CLASSIFY_EXIT_STATUS[141] and "|" not in CLASSIFY_EXIT_STATUS[141]  # (a markdown cell)


@pytest.mark.cli
def test_serve_bind_onto_a_busy_port_names_bind(tmp_path):
    """``serve --bind`` onto a port in use said "choose another address with CLASSIFIER_BIND (or gunicorn's -b)",
    not naming the option given (tryout): with --bind, the line names --bind; the exit status is the listen
    check's own (5)."""
    import socket

    from webapp import lifecycle

    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for port in range(18430, 18450):
            try:
                busy.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        busy.listen()
        out = run_cli("serve", "--bind", f"127.0.0.1:{port}", "--workers", "1", env=clean_env(), timeout=60)
    assert out.returncode == lifecycle.EXIT_LISTEN, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot listen on 127.0.0.1:{port}: ") and last.endswith(
        "; choose another address with --bind (or CLASSIFIER_BIND, or gunicorn's -b)"), out.stderr[-2000:]


def test_info_says_whether_a_start_compiles_can_and_has_packages(no_classifier_env, monkeypatch, tmp_path, capsys):
    """``info`` never said whether the model would be compiled, whether it could be, or whether the cache held its
    packages, so an operator could not tell a start of seconds from one of a minute (tryout23)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("CLASSIFIER_CACHE_DIR", str(cache))
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compile"] == {"setting": True, "compiler_missing": None,
                                                              "packages": []}
    assert cli.main(["info"]) == 0
    assert "compile  " in (out := capsys.readouterr().out) and "no AOTInductor package in the cache folder yet" in out
    (cache / "aoti-fp32-0123456789abcdef.pt2").write_bytes(b"x")
    monkeypatch.setenv("CXX", "/bin/false")
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": ("/bin/false",)}):  # restored after (monkeypatch deleted the key)
        assert cli.main(["info", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["compile"]
    assert shown["packages"] == ["aoti-fp32-0123456789abcdef.pt2"]
    assert shown["compiler_missing"].startswith("no C++ compiler found (/bin/false")
    monkeypatch.setenv("CLASSIFIER_COMPILE", "0")
    assert cli.main(["info"]) == 0
    assert "off (CLASSIFIER_COMPILE=0): the model runs uncompiled (eager)" in capsys.readouterr().out
