"""bench/e2e_bench.py's queueing floor: what one ideal shared queue would give at the open-loop load."""

from __future__ import annotations

import math

from bench.e2e_bench import ideal_fcfs_p99


def test_the_ideal_queue_matches_queueing_theory():
    # Constant service 100 ms: at a trickle nobody waits, so the p99 is the service time itself.
    assert abs(ideal_fcfs_p99([100.0], 0.01, 2) - 100.0) < 1e-6
    # M/D/2 at utilization 0.5 (10/s, 100 ms, 2 servers): P(wait) ~0.3, p99 ~2.5x the service time.
    p99 = ideal_fcfs_p99([100.0], 10.0, 2)
    assert 230 <= p99 <= 280, p99
    # One server at the same rate is at utilization 1: the queue grows without bound.
    assert ideal_fcfs_p99([100.0], 10.0, 1, arrivals=20_000) > 10 * p99
    # Variable service times wait longer than constant ones of the same mean (Pollaczek-Khinchine).
    assert ideal_fcfs_p99([20.0, 180.0], 10.0, 2) > p99
    assert math.isnan(ideal_fcfs_p99([], 10.0, 2))
