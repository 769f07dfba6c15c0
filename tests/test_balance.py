"""webapp/balance.py: new requests go to an idle worker first (``CLASSIFIER_IDLE_FIRST``).

Unit tests of the shared table and the two rules; then a real gunicorn with 2 workers, one of them kept
busy by an 8-photo upload of the 12 MP photo: new connections are all answered by the other, and a
keep-alive client answered by the busy one is told ``Connection: close`` while one answered by the
idle one keeps its connection.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time

import pytest

from fleet import healthz
from webapp import balance

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the board is shared through fork")


@pytest.fixture
def board(monkeypatch):
    """A fresh 4-entry board installed as this process's, this process as entry 0 (serving)."""
    monkeypatch.setattr(balance, "_board", None)
    monkeypatch.setattr(balance, "_me", None)
    monkeypatch.setattr(balance, "_serving", False)
    monkeypatch.setattr(balance, "_in_progress", 0)
    b = balance.install(4)
    assert balance.claim() == 0
    balance.join(0)
    return b


def test_entries_are_claimed_and_released_and_start_unused():
    b = balance.Board(3)
    assert b.values() == [balance.UNUSED] * 3
    assert [b.claim(), b.claim(), b.claim(), b.claim()] == [0, 1, 2, None]  # full: the worker has no entry
    assert b.values() == [balance.STARTING] * 3
    b.put(1, balance.UNUSED)
    assert b.claim() == 1
    with pytest.raises(ValueError):
        balance.Board(0)


def test_a_forked_child_writes_what_the_parent_reads():
    b = balance.Board(2)
    pid = os.fork()
    if pid == 0:  # the child: one write, then out without running pytest's teardown
        b.put(1, 7)
        os._exit(0)
    os.waitpid(pid, 0)
    assert b.get(1) == 7


def test_only_a_serving_worker_with_nothing_in_progress_counts_as_idle(board):
    assert board.values()[0] == balance.STARTING and not board.idle_other_than(1)
    balance.serving()
    assert board.get(0) == 0 and board.idle_other_than(1) and not board.idle_other_than(0)
    balance.begin()
    assert board.get(0) == 1 and not board.idle_other_than(1)
    balance.end()
    balance.end()  # an extra end never goes below 0
    assert board.get(0) == 0 and balance.in_progress() == 0
    balance.serving(False)  # stopping: not idle, whatever is in progress
    assert board.get(0) == balance.STARTING


def test_the_rules_apply_only_while_another_worker_is_idle(board):
    balance.serving()
    other = board.claim()
    assert not balance.defer_accept() and not balance.hand_over()  # nothing in progress here
    balance.begin()
    assert not balance.defer_accept()  # the other worker is still starting
    board.put(other, 0)  # ... and now serves, idle
    assert balance.defer_accept() and not balance.hand_over()  # the request being answered is the only one
    balance.begin()
    assert balance.hand_over()
    board.put(other, 3)  # everyone busy: work as before
    assert not balance.defer_accept() and not balance.hand_over()
    assert balance.describe() == {"entry": 0, "in_progress": 2, "board": [2, 3, balance.UNUSED, balance.UNUSED]}


def test_without_a_board_nothing_applies(monkeypatch):
    monkeypatch.setattr(balance, "_board", None)
    monkeypatch.setattr(balance, "_me", None)
    balance.begin()
    balance.end()
    assert not balance.active() and not balance.defer_accept() and not balance.hand_over()
    assert balance.describe() is None


# -- a real gunicorn --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    from serving import Server

    srv = Server(tmp_path_factory.mktemp("balance") / "gunicorn.log", MODEL="efficientnet_lite0", COMPILE=0,
                 WORKERS=2, THREADS=1, PRECISION="fp32", MAX_WAIT_MS=60_000)
    try:
        srv.wait_ready(workers=2)
        yield srv
    finally:
        srv.stop_cleanly()


def _post(conn: http.client.HTTPConnection, body: bytes, ctype: str) -> http.client.HTTPResponse:
    conn.request("POST", "/api/v1/predict", body=body, headers={"Content-Type": ctype})
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200, resp.status
    return resp


def _pid(conn: http.client.HTTPConnection) -> int:
    """The worker at the other end of this keep-alive connection."""
    conn.request("GET", "/healthz")
    return json.loads(conn.getresponse().read())["pid"]


def _busy_one(srv, big: bytes, ctype: str, conn: http.client.HTTPConnection | None = None,
              pid: int | None = None) -> tuple[threading.Thread, dict]:
    """Upload ``big`` in a thread, on ``conn`` (a kept-alive connection to worker ``pid``) or on a connection
    of its own; return once its worker shows it in progress."""
    if conn is None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
        pid = _pid(conn)  # asked first, on the same connection: its answer may close it
    conn.timeout = 300
    if conn.sock is not None:
        conn.sock.settimeout(300)
    out = {"pid": pid}

    def upload():
        _post(conn, big, ctype)
        conn.close()

    t = threading.Thread(target=upload)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        board = healthz(srv)["idle_first"]["board"]
        if sorted(v for v in board if v >= 0) == [0, 1]:  # one worker at work, the other idle
            return t, out
        time.sleep(0.01)
    pytest.fail(f"the 8-photo upload never showed on the board: {board}")


def _photos():
    from conftest import shared_image
    from fleet import multipart

    phone = shared_image("phone-12mp.jpg").read_bytes()
    big = multipart([(f"p{i}.jpg", phone, "image/jpeg") for i in range(8)])  # 26 MB: seconds of decoding
    small = multipart([("dog.jpg", shared_image("dog.jpg").read_bytes(), "image/jpeg")])
    return big, small


def _affinities(pid: int) -> dict[int, list[int]]:
    """Every thread of process ``pid``: the cores it may run on (``/proc/PID/task/TID/status``)."""
    import os

    def parse_core_list(text: str) -> list[int]:  # "0-2,5" -> [0, 1, 2, 5]
        cores = []
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cores += range(int(lo), int(hi or lo) + 1)
        return cores

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = open(f"/proc/{pid}/task/{tid}/status").read()
        except OSError:  # a thread that has just ended
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(tid)] = parse_core_list(line.split(":", 1)[1].strip())
    return out


@pytest.mark.server
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_decode_threads_may_use_the_whole_servers_cores_and_inference_stays_pinned(two_workers):
    """``DECODE_CORES=server`` (the default): a worker's main thread (its hub) and inference thread keep its
    own core; its decode threads (made for the start-up self-test already) may run on every core of the
    server, so a busy worker's decodes can use an idle neighbour's core."""
    import os

    server = sorted(os.sched_getaffinity(two_workers.proc.pid))
    healths = two_workers.wait_ready(workers=2)
    assert len(healths) == 2
    for pid, h in healths.items():
        threads = _affinities(pid)
        own = threads[pid]  # the main thread
        assert own == h["cores"] and len(own) < len(server), (pid, own, server)
        assert h["decode_cores"] == server, h["decode_cores"]
        widened = [tid for tid, cores in threads.items() if cores == server]
        assert 1 <= len(widened) <= 2, threads  # the decode pool's threads (max_threads 2), nothing else
        assert all(cores in (own, server) for cores in threads.values()), threads


@pytest.mark.server
def test_new_connections_go_to_the_idle_worker(two_workers):
    (big, ctype), (small, sctype) = _photos()
    t, out = _busy_one(two_workers, big, ctype)
    served = []
    while t.is_alive() and len(served) < 6:  # each on a new connection, one after the other
        conn = http.client.HTTPConnection("127.0.0.1", two_workers.port, timeout=60)
        pid = _pid(conn)  # asked first: an answer with "Connection: close" would make http.client reconnect,
        resp = _post(conn, small, sctype)  # maybe to the other worker, and a pid asked after could be that one's
        served.append((pid, resp.getheader("Connection")))
        conn.close()
    t.join(300)
    assert len(served) >= 3, f"the 8-photo upload ended after {len(served)} small ones"
    # Without the rule about half of them would be accepted by the busy worker (and wait behind it).
    assert all(pid != out["pid"] for pid, _ in served), (out, served)
    assert len({pid for pid, _ in served}) == 1, served
    board = healthz(two_workers)["idle_first"]  # for the message: the board after
    assert all(c != "close" for _, c in served), (served, out, board)  # the idle worker had nothing else in progress


@pytest.mark.server
def test_a_busy_worker_closes_a_keep_alive_clients_connection_while_another_is_idle(two_workers):
    (big, ctype), (small, sctype) = _photos()
    conns: dict[int, list] = {}
    while max((len(c) for c in conns.values()), default=0) < 3:  # keep-alive connections opened while both
        conn = http.client.HTTPConnection("127.0.0.1", two_workers.port, timeout=120)  # are idle: the kernel
        conns.setdefault(_pid(conn), []).append(conn)  # may give every one to the same worker
    busy_pid = max(conns, key=lambda p: len(conns[p]))
    t, out = _busy_one(two_workers, big, ctype, conn=conns[busy_pid].pop(), pid=busy_pid)  # that worker at work
    for _ in range(32):  # and, if the kernel gave the other worker none, some now: the accept rule sends them there
        if len(conns) == 2 and min(len(c) for c in conns.values()) >= 2:
            break
        conn = http.client.HTTPConnection("127.0.0.1", two_workers.port, timeout=120)
        conns.setdefault(_pid(conn), []).append(conn)
    assert len(conns) == 2, {pid: len(c) for pid, c in conns.items()}
    answers = []
    (p1, c1), (p2, c2) = conns.items()
    for pid, conn in [pair for both in zip(zip([p1] * len(c1), c1), zip([p2] * len(c2), c2)) for pair in both]:
        if t.is_alive():  # one worker's connection, then the other's
            said = _post(conn, small, sctype).getheader("Connection")
            if t.is_alive():  # the big one still in progress when this was answered (not just when it was sent)
                answers.append((pid, said))
    t.join(300)
    for held in conns.values():
        for conn in held:
            conn.close()
    busy = [c for pid, c in answers if pid == out["pid"]]
    idle = [c for pid, c in answers if pid != out["pid"]]
    assert busy and idle, (out, answers)
    assert all(c == "close" for c in busy), answers  # its next request connects again: to the idle worker
    assert all(c != "close" for c in idle), answers
