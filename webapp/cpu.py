"""CPU layout: how many workers, how many intra-op threads each, and which cores each is pinned to.

The one place this policy lives; ``gunicorn.conf.py`` applies it and ``/healthz`` shows it.
Why this shape: every worker holds its own model and batches its own requests, so workers
scale throughput almost linearly while they do not share cores; each extra intra-op thread
inside a worker shortens one forward pass but with falling returns (oneDNN splits a batch-1..8
ResNet-18 conv over few threads well, over many poorly), and each worker costs memory and a
warm-up. So: 1 thread per worker on up to 3 cores (lowest latency per request is less important
than not leaving a core idle), 2 on up to 8 cores, 4 beyond. Pinning keeps a worker's OpenMP
threads on its own cores, so two workers never fight for one core's caches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# /proc/cpuinfo flags that decide which kernels oneDNN and ATen can use.
CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8")


def usable_cores() -> list[int]:
    """Cores this process may run on (``os.sched_getaffinity``: respects ``taskset`` and cgroup cpusets)."""
    return sorted(os.sched_getaffinity(0))


def default_threads(n_cores: int) -> int:
    """Intra-op threads per worker for ``n_cores`` usable cores (see the module docstring for why)."""
    if n_cores <= 3:
        return 1
    if n_cores <= 8:
        return 2
    return 4


@dataclass(frozen=True)
class Plan:
    """``slots[i]`` is the core list of worker slot ``i``; ``shared`` is True when cores are oversubscribed."""

    slots: tuple[tuple[int, ...], ...]
    threads: int
    shared: bool

    @property
    def workers(self) -> int:
        """Number of gunicorn workers."""
        return len(self.slots)


def plan(cores: list[int], *, workers: int = 0, threads: int = 0) -> Plan:
    """Split ``cores`` into one core set per worker.

    ``workers``/``threads`` of 0 are derived: threads from ``default_threads``, workers as
    ``len(cores) // threads`` (at least 1). Explicit values that need more cores than there are
    wrap around the core list (``shared=True``: the caller should warn).
    """
    if not cores:
        raise ValueError("no usable cores")
    n = len(cores)
    t = threads or (default_threads(n) if not workers else max(1, n // workers))
    w = workers or max(1, n // t)
    slots = tuple(tuple(cores[(i * t + j) % n] for j in range(t)) for i in range(w))
    return Plan(slots=slots, threads=t, shared=w * t > n)


def cpu_info(path: str = "/proc/cpuinfo") -> dict:
    """CPU model name and the flags in ``CPU_FLAGS`` (present or not), from ``/proc/cpuinfo``."""
    model, flags = None, set()
    try:
        with open(path) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "logical_cpus": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}
