import os

import pytest

from webapp import cpu


@pytest.mark.parametrize("cores, workers, threads, slots", [
    ([0, 1], 0, 0, ((0,), (1,))),                      # 2 cores: 2 workers x 1 thread
    ([0, 1, 2, 3], 0, 0, ((0, 1), (2, 3))),            # 4 cores: 2 x 2
    (list(range(16)), 0, 0, tuple(tuple(range(i, i + 4)) for i in range(0, 16, 4))),  # 16: 4 x 4
    ([4, 5], 0, 0, ((4,), (5,))),                      # taskset -c 4-5: the cores we were given
    ([0, 1, 2, 3], 1, 0, ((0, 1, 2, 3),)),             # one worker takes every core
    ([0, 1, 2, 3], 0, 1, ((0,), (1,), (2,), (3,))),    # 1 thread each: 4 workers
])
def test_plan_splits_cores_without_overlap(cores, workers, threads, slots):
    plan = cpu.plan(cores, workers=workers, threads=threads)
    assert plan.slots == slots and not plan.shared
    used = [c for slot in plan.slots for c in slot]
    assert len(used) == len(set(used))


def test_oversubscription_wraps_and_says_so():
    plan = cpu.plan([0, 1], workers=3, threads=1)
    assert plan.slots == ((0,), (1,), (0,)) and plan.oversubscribed and plan.shared


def test_one_worker_with_more_threads_than_cores_oversubscribes_without_sharing():
    """The README's ``CLASSIFIER_WORKERS=1 CLASSIFIER_THREADS=4 taskset -c 0-3`` on a 2-core box."""
    plan = cpu.plan([0, 1], workers=1, threads=4)
    assert plan.slots == ((0, 1),)  # each core once: the worker's affinity mask, not a thread list
    assert plan.oversubscribed and not plan.shared


@pytest.mark.parametrize("cores, workers, threads, words", [
    ([0, 1], 1, 4, "1 worker, 4 threads on 2 cores: oversubscribed"),
    ([0, 1], 0, 0, "2 workers, 1 thread each, on 2 cores, pinned to 0 | 1 (one core set per worker)"),
    ([2, 3, 4, 5], 0, 0, "2 workers, 2 threads each, on 4 cores, pinned to 2-3 | 4-5 (one core set per worker)"),
    ([0, 1, 2, 3], 1, 0, "1 worker, 4 threads on 4 cores (0-3)"),
    ([5], 0, 0, "1 worker, 1 thread on 1 core (5)"),
    ([0, 1], 3, 1, "3 workers, 1 thread each, on 2 cores: oversubscribed, workers share cores (0 | 1 | 0)"),
])
def test_the_plan_in_plain_words(cores, workers, threads, words):
    assert cpu.describe(cpu.plan(cores, workers=workers, threads=threads), cores) == words


def test_core_ranges():
    assert cpu.core_ranges([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9"
    assert cpu.core_ranges([4]) == "4"


def test_usable_cores_is_the_affinity_mask():
    """What ``taskset -c`` (or a cgroup cpuset) leaves this process, sorted; not every core the machine has."""
    given = os.sched_getaffinity(0)
    first, last = min(given), max(given)
    try:
        os.sched_setaffinity(0, {last})  # this thread only (Linux): like `taskset -c <last>`
        assert cpu.usable_cores() == [last]
        assert cpu.plan(cpu.usable_cores()).slots == ((last,),)
        os.sched_setaffinity(0, {last, first})
        assert cpu.usable_cores() == sorted({first, last})
    finally:
        os.sched_setaffinity(0, given)
    assert cpu.usable_cores() == sorted(os.sched_getaffinity(0)) == sorted(given)


def test_no_cores_is_an_error():
    with pytest.raises(ValueError, match="^no usable cores$"):
        cpu.plan([])


@pytest.mark.server
def test_the_server_log_says_the_plan_in_plain_words(tmp_path):
    """The README's ``CLASSIFIER_WORKERS=1 CLASSIFIER_THREADS=4 taskset -c <2 cores>``: gunicorn's log
    says it in ``describe``'s words, not "1 workers", a thread list or "workers share cores"."""
    import time

    from serving import Server

    given = os.sched_getaffinity(0)
    if len(given) < 2:
        pytest.skip("needs 2 usable cores")
    two = sorted(given)[:2]
    os.sched_setaffinity(0, two)  # the server inherits it: like `taskset -c A,B`
    try:
        srv = Server(tmp_path / "server.log", WORKERS=1, THREADS=4, MODEL="efficientnet_lite0", COMPILE=0,
                     PRECISION="fp32", METRICS=0)
    finally:
        os.sched_setaffinity(0, given)
    try:
        deadline = time.monotonic() + 60
        while "pinned to cores" not in srv.output() and time.monotonic() < deadline and srv.proc.poll() is None:
            time.sleep(0.2)
        out = srv.output()
    finally:
        srv.stop()
    assert "plan: 1 worker, 4 threads on 2 cores: oversubscribed" in out, out[-3000:]
    # and said as what it costs, at WARNING (999 threads on 2 cores was an INFO line and ~40x slower: tryout34)
    assert "[WARNING] CLASSIFIER_THREADS=4: more intra-op threads than the 2 cores this server may use" in out
    assert f"pinned to cores {cpu.core_ranges(two)}" in out, out[-3000:]
    assert "1 workers" not in out and "workers share" not in out and "[0, 1, 0, 1]" not in out


def test_available_memory_is_the_smaller_of_the_host_and_its_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n")
    group = tmp_path / "cgroup"
    group.mkdir()
    assert cpu.available_mb(str(meminfo), str(group)) == 20480  # no cgroup files: the host's MemAvailable
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text(f"{2**30}\n")
    assert cpu.available_mb(str(meminfo), str(group)) == 20480  # a cgroup without a limit
    (group / "memory.max").write_text(f"{4 * 2**30}\n")  # a unit's MemoryMax=4G, 1 GiB of it used
    assert cpu.available_mb(str(meminfo), str(group)) == 3072
    assert cpu.available_mb(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_workers_that_cannot_fit_are_refused_naming_how_many_can():
    assert cpu.memory_problem(2, 23_000) is None and cpu.memory_problem(5000, None) is None
    assert cpu.memory_problem(153, 153 * cpu.WORKER_MB) is None  # exactly fits
    why = cpu.memory_problem(1000, 23_654)
    assert why == (f"1000 workers need at least {1000 * cpu.WORKER_MB / 1024:,.1f} GB ({cpu.WORKER_MB} MB each) "
                   f"and this host has 23.1 GB available: give at most {23_654 // cpu.WORKER_MB} (CLASSIFIER_WORKERS "
                   f"or gunicorn -w; 0 picks one per core set)")
    assert "give at most 1 " in cpu.memory_problem(2, 100)
