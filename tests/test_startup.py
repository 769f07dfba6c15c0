"""``auto`` precision decided once per host and CPU (webapp/records.py ``recorded_precision``).

Unit tests drive the record with a scripted decision; the server test checks that the two workers
of one real gunicorn, and a second start, serve one precision for one reason, from one record.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
import requests

from conftest import small_png
from serving import Server
from webapp import records, startup

KEY = {"torch": "2.14.1", "model": "m", "weights": "w.pth", "threads": 1, "cpu": "x", "capability": "AVX512",
       "onednn_max_cpu_isa": "", "native_bf16": True}


class Decider:
    """A scripted ``auto`` decision that counts its calls (each one is a measurement of about a second)."""

    def __init__(self, answer=("bf16", "auto: measured bf16 2.00x fp32"), delay: float = 0.0):
        self.answer, self.delay, self.calls = answer, delay, 0

    def __call__(self):
        self.calls += 1
        time.sleep(self.delay)
        return self.answer


def test_decided_once_then_read_from_the_record(tmp_path):
    decide = Decider()
    first = records.recorded_precision(tmp_path, KEY, decide)
    second = records.recorded_precision(tmp_path, KEY, decide)
    path = records.precision_record_path(tmp_path, KEY)
    record = json.loads(path.read_text())
    assert decide.calls == 1
    assert first == second == ("bf16", f"auto: measured bf16 2.00x fp32 (decided once for this host and CPU: "
                                       f"{path.name} in CLASSIFIER_CACHE_DIR, measured {record['measured_at']})")
    assert record["key"] == KEY and record["precision"] == "bf16" and record["reason"] == decide.answer[1]
    assert isinstance(record["measured_by_pid"], int)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # written whole, then renamed


@pytest.mark.parametrize("field, value", [("torch", "2.15.0"), ("model", "other"), ("weights", "v2.pth"),
                                          ("threads", 2), ("capability", "AVX2"), ("onednn_max_cpu_isa", "AVX2")])
def test_a_changed_key_measures_again(tmp_path, field, value):
    decide = Decider()
    records.recorded_precision(tmp_path, KEY, decide)
    changed = {**KEY, field: value}
    records.recorded_precision(tmp_path, changed, Decider(("fp32", "auto: measured bf16 0.90x fp32, so fp32")))
    assert records.precision_record_path(tmp_path, changed) != records.precision_record_path(tmp_path, KEY)
    assert records.recorded_precision(tmp_path, KEY, decide)[0] == "bf16"  # each key keeps its own record
    assert records.recorded_precision(tmp_path, changed, decide)[0] == "fp32"
    assert decide.calls == 1


def test_a_damaged_record_is_measured_again(tmp_path):
    path = records.precision_record_path(tmp_path, KEY)
    path.write_text('{"key": ')
    decide = Decider()
    assert records.recorded_precision(tmp_path, KEY, decide)[0] == "bf16"
    assert decide.calls == 1 and json.loads(path.read_text())["precision"] == "bf16"


def test_workers_starting_together_wait_for_one_measurement(tmp_path):
    decide = Decider(delay=0.3)
    results = []
    threads = [threading.Thread(target=lambda: results.append(records.recorded_precision(tmp_path, KEY, decide)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert decide.calls == 1 and len(results) == 4 and len(set(results)) == 1


SLOW_HERE = ("fp32", "auto: oneDNN claims native bf16 but bf16 kernels 0.62x fp32, so fp32",
             {"faithful": True, "native_speedup": 0.62, "provisional": True})


@pytest.fixture
def under_gunicorn(monkeypatch):
    """This process as a gunicorn worker: its start is its parent's (alive for the test)."""
    from webapp.settings import GUNICORN_ENV

    monkeypatch.setenv(GUNICORN_ENV, "1")
    return records.this_start()


def _record(path, slow_starts):
    path.write_text(json.dumps({"key": KEY, "precision": "fp32", "reason": "r", "measured_at": "t",
                                "measured_by_pid": 1, "figures": {"provisional": True}, "slow_starts": slow_starts}))


def test_a_provisional_decision_holds_for_its_start_only(tmp_path, monkeypatch, under_gunicorn):
    """Native bf16 measured slow (a neighbour on the core, most often) is this start's decision, not the host's:
    its workers and their replacements read it; a later start measures again, and this machine's ended starts'
    files go (their count carried); another machine's or container's are not judged from here."""
    main = records.precision_record_path(tmp_path, KEY)
    ours = records.provisional_path(main, under_gunicorn)
    ns = records._namespace()
    assert under_gunicorn == f"{ns}-{os.getppid()}-{records._started(os.getppid())}"
    ended = records.provisional_path(main, f"{ns}-999999999-5")  # no such pid: that start has ended
    _record(ended, 1)
    boot = ns.split("-")[0]
    elsewhere = records.provisional_path(main, f"{boot}-ffffffff-1-5")  # another container's master (pid 1): left
    _record(elsewhere, 1)
    slow = Decider(SLOW_HERE)
    first = records.recorded_precision(tmp_path, KEY, slow)
    assert records.recorded_precision(tmp_path, KEY, slow) == first and slow.calls == 1  # this start: read
    assert first[0] == "fp32" and first[1].startswith(
        f"{SLOW_HERE[1]} (decided for this server start only: slow native bf16 is most often a loaded core, so the "
        f"next start (not a reload) measures again; {ours.name} in CLASSIFIER_CACHE_DIR, measured ")
    assert not main.exists() and not ended.exists() and elsewhere.exists()
    assert {k: json.loads(ours.read_text())[k] for k in ("start", "slow_starts")} == {"start": under_gunicorn,
                                                                                     "slow_starts": 2}
    # Another start, later, alone on its core: measures again, and records for the host.
    monkeypatch.setattr(records, "this_start", lambda: f"{ns}-1-1")
    fast = Decider()
    assert records.recorded_precision(tmp_path, KEY, fast)[0] == "bf16" and fast.calls == 1
    assert json.loads(main.read_text())["start"] is None
    assert ours.exists()  # this process's start is alive: its replacement workers must still read its fp32
    monkeypatch.undo()
    monkeypatch.setenv("WEBAPP_GUNICORN_CONF", "1")
    assert records.recorded_precision(tmp_path, KEY, fast) == first and fast.calls == 1


def test_slow_at_three_starts_in_a_row_is_the_hosts(tmp_path, under_gunicorn):
    """A CPU whose bf16 really is slow would be measured (2-4 s) at every start: the third start in a row that
    measures it slow records it for the host, and says how to measure again."""
    main = records.precision_record_path(tmp_path, KEY)
    _record(records.provisional_path(main, f"{records._namespace()}-999999999-5"), 2)
    precision, reason = records.recorded_precision(tmp_path, KEY, Decider(SLOW_HERE))
    record = json.loads(main.read_text())
    assert precision == "fp32" and record["start"] is None and record["slow_starts"] == 3
    assert reason == (f"{SLOW_HERE[1]} (decided once for this host and CPU: {main.name} in CLASSIFIER_CACHE_DIR, "
                      f"measured {record['measured_at']}; bf16 measured slow at 3 server starts in a row: if the "
                      f"host was busy then, delete the file to measure again)")
    assert list(tmp_path.glob("*.start-*")) == []


def test_outside_gunicorn_a_provisional_decision_is_the_hosts(tmp_path, monkeypatch):
    """``python -m webapp warm`` (an install's), the CLI, a Ray replica: no server start to hold it, so the host's,
    and a shipped read-only cache still has one record for every worker."""
    from webapp.settings import GUNICORN_ENV

    monkeypatch.delenv(GUNICORN_ENV, raising=False)
    assert records.this_start() is None
    precision, reason = records.recorded_precision(tmp_path, KEY, Decider(SLOW_HERE))
    assert precision == "fp32" and "decided once for this host and CPU" in reason
    assert reason.endswith("; bf16 measured slow: if the host was busy then, delete the file to measure again)")
    assert [p.name for p in tmp_path.glob("precision-*.json")] == [records.precision_record_path(tmp_path, KEY).name]


def test_the_cli_beside_a_live_server_does_not_record_its_slow_bf16_for_the_host(tmp_path, monkeypatch):
    """``classify`` or ``warm`` run while a server of this machine is up (its start measured bf16 slow and holds a
    provisional fp32) measures beside that server's load: recorded for the host, its slow verdict kept every later
    start on fp32. It decides for itself only; with no live server beside it, it records for the host as before."""
    from webapp.settings import GUNICORN_ENV

    monkeypatch.delenv(GUNICORN_ENV, raising=False)
    main = records.precision_record_path(tmp_path, KEY)
    ns = records._namespace()
    live = records.provisional_path(main, f"{ns}-{os.getpid()}-{records._started(os.getpid())}")
    _record(live, 1)
    precision, reason = records.recorded_precision(tmp_path, KEY, Decider(SLOW_HERE))
    assert precision == "fp32" and not main.exists() and live.exists()
    assert reason.endswith(f"(decided for this process only: a server start beside it, {live.name}, loads the "
                           "cores, so slow bf16 is not recorded for the host)")
    live.unlink()
    _record(records.provisional_path(main, f"{ns}-999999999-5"), 1)  # a server that has stopped: nothing beside
    assert "decided once for this host and CPU" in records.recorded_precision(tmp_path, KEY, Decider(SLOW_HERE))[1]
    assert main.exists()


def test_a_read_only_cache_reads_a_starts_provisional_record_rather_than_each_worker_deciding(tmp_path, monkeypatch,
                                                                                            under_gunicorn):
    import errno

    from filelock import FileLock

    main = records.precision_record_path(tmp_path, KEY)
    _record(records.provisional_path(main, f"{records._namespace()}-999999999-5"), 1)  # the start that warmed it

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", f"{self.lock_file}")

    monkeypatch.setattr(FileLock, "acquire", read_only)
    decide = Decider()
    precision, reason = records.recorded_precision(tmp_path, KEY, decide)
    assert precision == "fp32" and decide.calls == 0
    # Not "the next start measures again": nothing is measured or written in a read-only cache (review finding).
    assert "read from the read-only cache" in reason and "next start (not a reload) measures" not in reason, reason


def test_a_start_is_the_gunicorn_masters_for_its_workers(tmp_path):
    """A worker's start is its master's (a child of this process, told it runs under gunicorn, names this one,
    with this machine's boot and pid namespace); any other process has none."""
    import subprocess
    import sys

    from webapp.settings import GUNICORN_ENV

    code = "from webapp.records import this_start; print(this_start())"
    env = {k: v for k, v in os.environ.items() if k != GUNICORN_ENV}
    worker = subprocess.run([sys.executable, "-c", code], env={**env, GUNICORN_ENV: "1"}, capture_output=True,
                            text=True, check=True).stdout.strip()
    alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    assert worker == f"{records._namespace()}-{os.getpid()}-{records._started(os.getpid())}" and alone == "None"
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{8}", records._namespace()) and records._started(os.getpid()).isdigit()


def test_containers_run_with_rm_still_reach_the_host_record_and_their_files_go_at_the_next_boot(tmp_path,
                                                                                              monkeypatch):
    """Each ``podman run --rm`` (the Containerfile's) is a new pid namespace, its master pid 1: only ended starts of
    this namespace were counted, so the count stayed at 1 and every start measured (2-4 s) and left a file. Any
    start's count is carried now, and a start of another boot has ended for certain."""
    from webapp.settings import GUNICORN_ENV

    monkeypatch.setenv(GUNICORN_ENV, "1")
    main = records.precision_record_path(tmp_path, KEY)
    boot = records._namespace().split("-")[0]
    for i, ns in enumerate(("aaaaaaaa", "bbbbbbbb", "cccccccc")):
        monkeypatch.setattr(records, "_namespace", lambda ns=ns: f"{boot}-{ns}")
        monkeypatch.setattr(records, "this_start", lambda ns=ns: f"{boot}-{ns}-1-{100 + i}")
        slow = Decider(SLOW_HERE)
        records.recorded_precision(tmp_path, KEY, slow)
        assert slow.calls == 1
    record = json.loads(main.read_text())
    assert record["slow_starts"] == 3 and record["start"] is None and record["precision"] == "fp32"
    assert list(tmp_path.glob("*.start-*")) == []  # the host's fp32 now: every start's fp32 file went
    _record(records.provisional_path(main, f"{boot}-eeeeeeee-1-5"), 1)  # a container's, of this boot: left
    monkeypatch.setattr(records, "_namespace", lambda: "ffffffff-dddddddd")  # the next boot
    monkeypatch.setattr(records, "this_start", lambda: "ffffffff-dddddddd-1-100")
    first_rules = records.provisional_path(main, "0123abcd-7-7")
    _record(first_rules, 1)
    assert records.recorded_precision(tmp_path, KEY, Decider())[0] == "fp32"  # the host's record: read
    assert list(tmp_path.glob("*.start-*")) == []


def test_a_start_whose_time_cannot_be_read_keeps_its_file(tmp_path, monkeypatch, under_gunicorn):
    """Without a readable start time the name says 0; the start was then judged ended by its own later workers
    (their reading "" is not "0"), its file deleted, and each worker measured in turn. A start time of 0 is judged
    by the pid alone, and a start's own file is never among the ended."""
    monkeypatch.setattr(records, "_started", lambda pid: "")
    start = records.this_start()
    assert start.endswith(f"-{os.getppid()}-0")
    monkeypatch.setattr(records, "this_start", lambda: start)
    main = records.precision_record_path(tmp_path, KEY)
    ns = records._namespace()
    alive, gone = (records.provisional_path(main, f"{ns}-{pid}-0") for pid in (os.getpid(), 999999999))
    _record(alive, 1)
    _record(gone, 1)
    slow = Decider(SLOW_HERE)
    answers = [records.recorded_precision(tmp_path, KEY, slow) for _ in range(3)]  # three workers of this start
    assert slow.calls == 1 and len(set(answers)) == 1
    assert records.provisional_path(main, start).exists() and alive.exists() and not gone.exists()


def test_an_unusable_cache_decides_alone_and_says_so(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    decide = Decider()
    precision, reason = records.recorded_precision(not_a_folder, KEY, decide)
    assert precision == "bf16" and decide.calls == 1
    assert reason.startswith("auto: measured bf16 2.00x fp32 (decided by this process only: the record ")


def test_a_record_in_a_cache_that_cannot_be_written_is_read_without_its_lock(tmp_path, monkeypatch):
    """A warm cache shipped read-only: its lock file cannot be made, and its record was not used: each worker
    measured alone, and said the record was unusable (tryout15). A record is renamed in whole: read as it is."""
    import errno

    from filelock import FileLock

    records.recorded_precision(tmp_path, KEY, Decider())  # the record, made where the cache was warmed

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", f"{self.lock_file}")

    monkeypatch.setattr(FileLock, "acquire", read_only)
    decide = Decider(("fp32", "auto: measured here"))
    precision, reason = records.recorded_precision(tmp_path, KEY, decide)
    assert (precision, decide.calls) == ("bf16", 0)
    assert reason.startswith("auto: measured bf16 2.00x fp32 (decided once for this host and CPU: precision-")
    other = {**KEY, "threads": 3}  # no record for this key: measured alone, as before
    assert records.recorded_precision(tmp_path, other, decide) == (
        "fp32", f"auto: measured here (decided by this process only: the record "
                f"{records.precision_record_path(tmp_path, other).name} was unusable)")


def test_the_key_names_the_cpu_as_this_process_runs_it(monkeypatch):
    from webapp.models import load_model
    from webapp.settings import load

    model = load_model(load(environ={}, overrides={"MODEL": "resnet18_seeded"}))
    key = startup.precision_key(model, threads=2)
    assert key["model"] == "resnet18_seeded" and key["weights"] == model.weights and key["threads"] == 2
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert startup.precision_key(model, threads=2) != key


@pytest.mark.server
def test_two_workers_one_precision_and_a_second_start_reuses_it(tmp_path):
    cache = tmp_path / "cache"
    settings = {"MODEL": "efficientnet_lite0", "COMPILE": 0, "WORKERS": 2, "THREADS": 1, "MAX_BATCH_SIZE": 2,
                "CACHE_DIR": cache}  # PRECISION: auto, the default
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    answers, pids = [], []
    for run in ("first", "second"):
        srv = Server(tmp_path / f"{run}.log", env=env, **settings)
        health = srv.wait_ready(workers=2)
        srv.stop_cleanly()
        answers.append({(h["precision"], h["precision_reason"]) for h in health.values()})
        pids.append(set(health))
        records = sorted(cache.glob("precision-*.json"))
        assert len(records) == 1, records
        if run == "first":
            recorded = records[0].read_text()
    assert len(answers[0]) == 1, answers[0]  # both workers: one precision, one reason
    assert answers[1] == answers[0]  # the second start read the same record...
    assert records[0].read_text() == recorded  # ...and measured nothing
    (precision, reason), = answers[0]
    record = json.loads(recorded)
    assert precision == record["precision"] and reason.startswith(record["reason"])
    assert f"decided once for this host and CPU: {records[0].name} in CLASSIFIER_CACHE_DIR," in reason
    assert record["measured_by_pid"] in pids[0]  # one worker of the first start measured, for all


def test_auto_is_judged_on_the_calibration_photos_and_the_record_keeps_the_figures(monkeypatch, tmp_path):
    """The judgement sees every calibration photo (not one golden photo) and its figures land in the record."""
    from webapp import assets, engine, imaging
    from webapp.models import load_model
    from webapp.settings import load

    seen = []

    def judge(module, photos, **kw):
        seen.append(tuple(photos.shape))
        return False, "measured on 28 calibration photos: bf16 1.40x fp32, top-1 agreement 96.4%", {"top1_agree": 0.964}

    monkeypatch.setattr(engine, "native_bf16", lambda: True)
    monkeypatch.setattr(startup, "judge_bf16", judge)
    settings = load(environ={}, overrides={"MODEL": "resnet18_seeded"})
    model = load_model(settings)
    transform = imaging.build_transform(model.preprocessing)
    precision, reason = startup.choose_engine_precision(settings, model, transform, cache=tmp_path, threads=1)
    assert seen == [(len(assets.calibration_files()), 3, 224, 224)] and precision == "fp32"
    assert reason.startswith("auto: oneDNN claims native bf16 but measured on 28 calibration photos: bf16 1.40x fp32, "
                             "top-1 agreement 96.4%, so fp32 (decided once for this host and CPU: ")
    record, = (json.loads(p.read_text()) for p in tmp_path.glob("precision-*.json"))
    assert record["figures"] == {"top1_agree": 0.964} and record["precision"] == "fp32"
    assert record["key"]["bf16_policy"] == list(startup.keep_fp32_for("resnet18_seeded")) == ["head"]  # the model's own
    assert record["key"]["photos"] == startup.photos_id(assets.calibration_files())
    # Other judged photos (CALIBRATION_DIR) are another key: judged again.
    own = tmp_path / "own"
    own.mkdir()
    (own / "a.jpg").write_bytes(assets.GOLDEN.read_bytes())
    other = load(environ={}, overrides={"MODEL": "resnet18_seeded", "CALIBRATION_DIR": str(own)})
    startup.choose_engine_precision(other, model, transform, cache=tmp_path, threads=1)
    assert seen[-1] == (1, 3, 224, 224) and len(list(tmp_path.glob("precision-*.json"))) == 2


def test_auto_judges_bf16_with_the_rechecks_it_would_be_served_with(monkeypatch, tmp_path):
    """``auto`` judges bf16 as a bf16 server answers (its close calls by fp32, ``CLASSIFIER_BF16_RECHECK_PTS``):
    trained weights pass those points to the judgement, untrained ones 0 (they get no rechecks), and the points
    are part of the record's key, so another setting is judged again."""
    import dataclasses

    from webapp import engine, imaging
    from webapp.models import load_model
    from webapp.settings import load

    given = []
    monkeypatch.setattr(engine, "native_bf16", lambda: True)
    monkeypatch.setattr(startup, "judge_bf16", lambda module, photos, **kw: (
        given.append(kw["recheck_pts"]) or (True, "measured", {"faithful": True})))
    seeded = load_model(load(environ={}, overrides={"MODEL": "resnet18_seeded"}))
    trained = dataclasses.replace(seeded, untrained=False)
    transform = imaging.build_transform(seeded.preprocessing)
    for model, pts in [(seeded, 0.5), (trained, 0.5), (trained, 0.5), (trained, 2.0)]:
        settings = load(environ={}, overrides={"MODEL": "resnet18_seeded", "BF16_RECHECK_PTS": pts})
        assert startup.choose_engine_precision(settings, model, transform, cache=tmp_path, threads=1)[0] == "bf16"
    assert given == [0.0, 0.5, 2.0]  # the third start read the second's record
    keys = sorted(json.loads(p.read_text())["key"]["recheck_pts"] for p in tmp_path.glob("precision-*.json"))
    assert keys == [0.0, 0.5, 2.0]


@pytest.mark.parametrize("faithful, provisional", [(True, True), (False, False)])
def test_only_a_faithful_but_slow_bf16_is_a_provisional_fp32(monkeypatch, faithful, provisional):
    """Slow native bf16 kernels with faithful answers: a provisional fp32 (records.py keeps it for this start);
    unfaithful answers: fp32 for the host (a property of the model and CPU, not of the moment)."""
    from webapp import engine, imaging
    from webapp.models import load_model
    from webapp.settings import load

    figures = {"faithful": faithful, "native_speedup": 0.62 if faithful else 1.5}
    monkeypatch.setattr(engine, "native_bf16", lambda: True)
    monkeypatch.setattr(startup, "judge_bf16", lambda *a, **k: (False, "bf16 kernels 0.62x fp32", dict(figures)))
    model = load_model(load(environ={}, overrides={"MODEL": "resnet18_seeded"}))
    files = startup.calibration_files()[:2]
    precision, reason, got = startup.decide_auto_precision(model, imaging.build_transform(model.preprocessing), files)
    assert precision == "fp32" and bool(got.get("provisional")) is provisional
    assert reason == "auto: oneDNN claims native bf16 but bf16 kernels 0.62x fp32, so fp32"  # records.py: how long


def test_auto_keeps_fp32_for_a_model_whose_bf16_misses_the_bench_targets(monkeypatch):
    """EfficientNet-Lite0's bf16 misses the bench's speed target (with its rechecks it keeps the answers): auto says
    so, measuring nothing."""
    from webapp import catalog, engine, imaging
    from webapp.models import load_model
    from webapp.settings import load

    monkeypatch.setattr(engine, "native_bf16", lambda: True)
    monkeypatch.setattr(startup, "judge_bf16", lambda *a, **k: pytest.fail("judged a model the catalog rules out"))
    model = load_model(load(environ={}, overrides={"MODEL": "efficientnet_lite0"}))
    precision, reason, figures = startup.decide_auto_precision(model, imaging.build_transform(model.preprocessing))
    assert (precision, figures) == ("fp32", None)
    assert reason == f"auto: fp32 for efficientnet_lite0: {catalog.BY_NAME['efficientnet_lite0'].bf16_auto_off}"
    assert "not reliably faster" in reason and startup.precision_key(model, 1)["bf16_auto_off"] is True


@pytest.mark.server
@pytest.mark.extended
def test_a_cold_start_compiles_once_in_a_child_and_no_worker_keeps_the_compiler(tmp_path):
    """The first start on a host: one child process builds the packages (one compile, not one per worker), every
    worker loads them, and none holds what the compile imported and allocated (320-411 MB private per worker
    at ready when each compiled itself; a worker that loads packages holds under ~150)."""
    cache = tmp_path / "cache"
    srv = Server(tmp_path / "cold.log", env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
                 MODEL="resnet18_seeded", PRECISION="fp32", WORKERS=2, THREADS=1, MAX_BATCH_SIZE=2, CACHE_DIR=cache)
    try:
        health = srv.wait_ready(workers=2)
        r = requests.post(srv.url + "/api/v1/predict", files={"file": ("red.png", small_png(), "image/png")},
                          timeout=60)
        assert r.status_code == 200, r.text
    finally:
        out = srv.stop_cleanly()
    # One child built them (the other worker waited on the lock, then found them); no worker built them itself.
    assert out.count("fp32 AOTInductor packages built in a child process") == 1, out[-3000:]
    assert "building them here" not in out and "AOTInductor package built" not in out, out[-3000:]
    assert len(list(cache.glob("aoti-fp32-*.pt2"))) == 2  # batch 1 and the dynamic batch
    for pid, h in health.items():
        assert h["model"]["backend"] == "aoti", h["model"]
        assert h["memory_mb"]["private"] < 200, (pid, h["memory_mb"])


@pytest.mark.parametrize("name, why", [("missing", "No such file or directory"), ("a" * 300, "File name too long")])
def test_a_calibration_dir_that_cannot_be_read_stops_the_start_in_one_line(tmp_path, name, why):
    """Where settings load such a folder is refused (test_settings); one gone or unreadable since is said here."""
    from webapp import settings
    from webapp.errors import StartupError

    s = settings.Settings({**settings.load({}), "CALIBRATION_DIR": str(tmp_path / name)})
    for photos in (startup.given_photos, startup.judged_files):  # int8's calibration, auto's judged photos
        with pytest.raises(StartupError, match=f"^CLASSIFIER_CALIBRATION_DIR={tmp_path / name} cannot be read: "
                                               f"{why}$"):
            photos(s)


@pytest.mark.parametrize("precision, overrides, untrained, want", [
    ("int8", {}, False, 3.0), ("bf16", {}, False, 1.0), ("fp32", {}, False, 0.0),
    ("bf16", {"BF16_RECHECK_PTS": "0"}, False, 0.0), ("int8", {"INT8_RECHECK_PTS": "5"}, False, 5.0),
    ("bf16", {"INT8_RECHECK_PTS": "5"}, False, 1.0),  # each precision its own setting
    ("int8", {}, True, 0.0), ("bf16", {}, True, 0.0),  # untrained: every photo a near-tie, none worth fp32's time
])
def test_close_calls_go_to_fp32_by_precision_and_only_for_trained_weights(precision, overrides, untrained, want):
    from types import SimpleNamespace

    from webapp import settings

    s = settings.load(environ={f"{settings.PREFIX}{k}": v for k, v in overrides.items()}, overrides={})
    model = SimpleNamespace(untrained=untrained)
    assert startup.recheck_points(s, model, precision) == want
    if want == 0:
        assert startup.recheck_engine(s, model, None, precision, None) is None


def test_each_workers_start_line_keeps_a_long_reason_short(make_app, monkeypatch, caplog):
    """Found by a fresh-user tryout: every worker's start line carried the whole precision reason (EfficientNet-Lite0's
    ~420 characters of bench figures). The line says it short and where it is whole; /healthz has it whole."""
    import logging

    reason = "auto: fp32 for this model: " + " ".join(f"figure {i} measured on the bench" for i in range(20))
    monkeypatch.setattr(startup, "choose_engine_precision", lambda *args, **kwargs: ("fp32", reason))
    caplog.set_level(logging.INFO, logger="webapp")
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, PRECISION="auto")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("model resnet18_seeded"))
    assert len(line) < 300 and "(whole: /healthz, python -m webapp info)" in line
    assert "figure 0 measured" in line and "figure 19" not in line
    assert app.test_client().get("/healthz").get_json()["precision_reason"] == reason
