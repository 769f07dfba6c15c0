"""The measured costs (webapp/costs.py): a decode's by its size, and the worker's overhead around its work."""

from __future__ import annotations

import pytest

from conftest import Clock
from webapp.costs import DecodeCost, Overhead

MB = 1_000_000


@pytest.mark.unit
def test_decode_cost_fits_a_line_through_sizes_that_differ():
    cost = DecodeCost()
    assert cost.line() == (0.0, 0.0) and cost.predict(MB) == 0.0  # nothing measured yet: no guess
    for nbytes in (50_000, 3 * MB, 200_000, 1 * MB, 3 * MB, 100_000) * 5:
        cost.observe(nbytes, 2.0 + 3e-5 * nbytes)  # 2 ms per photo + 30 ms per MB
    a, b = cost.line()
    assert a == pytest.approx(2.0, rel=1e-6) and b == pytest.approx(3e-5, rel=1e-6)
    assert cost.predict(2 * MB, uploads=2) == pytest.approx(2 * 2.0 + 60.0, rel=1e-6)


@pytest.mark.unit
def test_decode_cost_of_one_size_is_its_mean_time_for_any_size():
    """A size never measured is guessed at the mean time, not scaled by bytes: a guess too high would refuse
    photos that, refused, never correct it (a golden photo of 40 KB scaled to 3 MB: 1 s instead of 35 ms)."""
    cost = DecodeCost()
    for ms in (40.0, 60.0, 50.0):
        cost.observe(2 * MB, ms)
    a, b = cost.line()
    assert b == 0.0 and a == pytest.approx(cost._my)  # the weighted mean time of that size
    assert cost.mean_bytes == 2 * MB and cost.predict(30 * MB) == cost.predict(1000) == a
    cost.observe(40_000, 4.0)  # a second size: now a line through both
    a, b = cost.line()
    assert b > 0 and cost.predict(40_000) == pytest.approx(4.0) and cost.predict(2 * MB) > 40.0


@pytest.mark.unit
def test_decode_cost_does_not_trust_a_line_with_a_negative_intercept():
    cost = DecodeCost()
    for nbytes, ms in ((MB, 10.0), (3 * MB, 90.0)) * 5:  # the line through them crosses 0 at 0.75 MB
        cost.observe(nbytes, ms)
    a, b = cost.line()
    assert a == 0.0 and b == pytest.approx(cost._my / cost._mx)


@pytest.mark.unit
def test_overhead_is_the_whole_workers_cpu_per_second_of_work_measured_each_second_and_capped():
    clock, cpu = Clock(), {"process": 0.0, "work": 0.0}
    o = Overhead(lambda: cpu["work"], clock, lambda: cpu["process"])
    cpu.update(process=0.6, work=0.5)
    assert o.factor() == 1.0  # no full window yet
    clock.now += 1.0
    assert o.factor() == pytest.approx(1.2)  # 0.6 s of the process for 0.5 s of work
    cpu.update(process=0.61, work=0.51)  # a window with hardly any work: the figure stays
    clock.now += 1.0
    assert o.factor() == pytest.approx(1.2)
    cpu.update(process=5.61, work=1.51)  # 5 s of CPU (say, refusals) for 1 s of work: capped at MAX
    clock.now += 1.0
    assert o.factor() == pytest.approx(1.2 + Overhead.ALPHA * (Overhead.MAX - 1.2))
    for _ in range(30):
        cpu.update(process=cpu["process"] + 0.5, work=cpu["work"] + 1.0)  # less than the work: never below 1
        clock.now += 1.0
        o.factor()
    assert o.value == pytest.approx(1.0, abs=1e-3)
