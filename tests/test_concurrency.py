"""webapp/concurrency.py: ``call_with_timeout`` (outside gevent; the batcher's tests cover the gevent side)."""

from __future__ import annotations

import threading

import pytest

from webapp.concurrency import call_with_timeout


def test_call_with_timeout_returns_the_result_or_raises_its_error():
    assert call_with_timeout(lambda: 42, 30) == (True, 42)
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 30)
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 30, give_up=lambda: False)


def test_call_with_timeout_gives_up_when_asked_long_before_its_timeout():
    never = threading.Event()
    asked = []

    def give_up() -> bool:
        asked.append(1)
        return len(asked) >= 3

    # An hour of timeout: only give_up can end this wait (the test would hang otherwise).
    assert call_with_timeout(never.wait, 3600, give_up=give_up) == (False, None)
    assert len(asked) == 3
    never.set()  # lets the thread finish


def test_call_with_timeout_stops_waiting_at_the_timeout():
    never = threading.Event()
    assert call_with_timeout(never.wait, 0.2) == (False, None)
    assert call_with_timeout(never.wait, 0.2, give_up=lambda: False) == (False, None)
    never.set()


def test_lower_this_thread_lowers_only_the_calling_thread():
    """Niceness is per thread on Linux: the thread that asks runs lower, its caller does not."""
    import _thread
    import os
    import threading

    from webapp.concurrency import lower_this_thread

    me = os.getpriority(os.PRIO_PROCESS, _thread.get_native_id())
    seen = {}

    def worker():
        tid = _thread.get_native_id()
        lower_this_thread(5)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)
        lower_this_thread(0)  # 0: nothing
        seen["zero"] = os.getpriority(os.PRIO_PROCESS, tid)
        lower_this_thread(40)  # never past 19
        seen["most"] = os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"after": min(19, me + 5), "zero": min(19, me + 5), "most": 19}
    assert os.getpriority(os.PRIO_PROCESS, _thread.get_native_id()) == me


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_widen_this_thread_widens_only_the_calling_thread():
    """CPU affinity is per thread on Linux: a thread pinned to one core and then widened may run on all
    of them; the thread that started it keeps its own (one core here, as a gunicorn worker's main thread)."""
    import os

    from webapp.concurrency import widen_this_thread

    everything = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, everything[:1])
    seen = {}

    def worker():
        seen["inherited"] = sorted(os.sched_getaffinity(0))
        seen["widened"] = widen_this_thread(everything)
        seen["after"] = sorted(os.sched_getaffinity(0))

    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen == {"inherited": everything[:1], "widened": True, "after": everything}
        assert sorted(os.sched_getaffinity(0)) == everything[:1]
        assert widen_this_thread([10**6]) is False  # no such core: refused, not raised
    finally:
        os.sched_setaffinity(0, everything)


def test_a_decode_waiting_for_a_free_thread_times_out_on_time_and_never_runs():
    """gevent's ``ThreadPool.spawn`` waits for a free thread without limit: with both decode threads busy, a request
    due in 0.2 s got its timeout only after a whole decode (1 s here), and its photo was decoded afterwards for nobody.
    A free thread is now waited for within the deadline, and work that got none never runs."""
    import json
    import subprocess
    import sys

    code = """
from gevent import monkey; monkey.patch_all()
import json, time, gevent
from webapp.concurrency import Offloader, StillRunning
off, ran = Offloader(max_threads=2), []
def work(i):
    ran.append(i)
    monkey.get_original("time", "sleep")(1.0)  # a decode holding its real thread for 1 s
def call(i):
    t0 = time.monotonic()
    try:
        off.run(work, i, within=0.2)
        return "answered", time.monotonic() - t0
    except StillRunning:
        return "timed out", time.monotonic() - t0
calls = [gevent.spawn(call, i) for i in range(5)]
gevent.joinall(calls)
gevent.sleep(1.5)  # the two running decodes end
print(json.dumps({"calls": [c.value for c in calls], "ran": sorted(ran)}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert [kind for kind, _ in got["calls"]] == ["timed out"] * 5
    assert max(s for _, s in got["calls"]) < 0.7, got  # each at its own 0.2 s deadline, not after a decode (1 s)
    assert got["ran"] == [0, 1], got  # only the two that had a thread ran
