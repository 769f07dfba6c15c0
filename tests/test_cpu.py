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
    assert plan.slots == ((0,), (1,), (0,)) and plan.shared


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
