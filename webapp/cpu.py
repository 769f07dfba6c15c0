"""CPU layout: how many workers, how many intra-op threads each, and which cores each is pinned to.

The one place this policy lives; ``gunicorn.conf.py`` applies it, ``/healthz`` shows each worker's
cores, and the server's log and ``python -m webapp info`` say it in words (``describe``).
Why this shape: every worker holds its own model and batches its own requests, so workers
scale throughput almost linearly while they do not share cores; each extra intra-op thread
inside a worker shortens one forward pass but with falling returns (oneDNN splits a batch-1..8
ResNet-18 conv over few threads well, over many poorly), and each worker costs memory and a
warm-up. So: 1 thread per worker on up to 3 cores (lowest latency per request is less important
than not leaving a core idle), 2 on up to 8 cores, 4 beyond. Pinning keeps a worker's OpenMP
threads on its own cores, so two workers never fight for one core's caches. Decode threads are the
exception (``DECODE_CORES``, ``concurrency.Offloader``): they may run on any of the server's cores, so
a busy worker's decodes can use an idle neighbour's core.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

# /proc/cpuinfo flags that decide which kernels oneDNN and ATen can use.
CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8")


# The cores of the whole server, as its master may use them: set in each gunicorn worker before it is
# pinned to its own slot (gunicorn.conf.py's post_fork); None elsewhere (the CLI, tests, Ray).
SERVER_CORES: list[int] | None = None


@contextmanager
def borrowed_cores(cores: list[int] | None, threads: int):
    """Run the block on ``cores`` with ``threads`` intra-op threads, then put every thread of this process
    back on the cores it had and the intra-op threads as they were.

    For one-off work a worker does while its neighbours wait for it (``auto``'s start-up judgement of
    bf16, under the record's lock): on a 2-core box it halves the wait. Every thread is put back
    (``/proc/self/task``), the OpenMP threads the block started included, so nothing stays off the
    worker's slot. ``cores`` None or empty, or ``threads`` <= 1: the block runs as it is.
    """
    if not cores or threads <= 1:
        yield
        return
    import torch

    own, before = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), own)
            except OSError:  # a thread that has just ended
                pass


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
    """``slots[i]`` is the core set of worker slot ``i`` (each core once, ascending); ``threads`` the
    intra-op threads of each worker; ``oversubscribed`` when workers x threads exceed the cores;
    ``shared`` when two workers' core sets overlap (only with more workers than the cores allow)."""

    slots: tuple[tuple[int, ...], ...]
    threads: int
    oversubscribed: bool
    shared: bool

    @property
    def workers(self) -> int:
        """Number of gunicorn workers."""
        return len(self.slots)


def plan(cores: list[int], *, workers: int = 0, threads: int = 0) -> Plan:
    """Split ``cores`` into one core set per worker.

    ``workers``/``threads`` of 0 are derived: threads from ``default_threads``, workers as
    ``len(cores) // threads`` (at least 1). Explicit values that need more cores than there are
    wrap around the core list: ``oversubscribed`` (and ``shared`` where workers overlap), which
    ``describe`` says in words.

    :raises ValueError: ``cores`` is empty.
    """
    if not cores:
        raise ValueError("no usable cores")
    n = len(cores)
    t = threads or (default_threads(n) if not workers else max(1, n // workers))
    w = workers or max(1, n // t)
    slots = tuple(tuple(sorted({cores[(i * t + j) % n] for j in range(t)})) for i in range(w))
    held = [c for slot in slots for c in slot]
    return Plan(slots=slots, threads=t, oversubscribed=w * t > n, shared=len(held) != len(set(held)))


def core_ranges(cores) -> str:
    """Cores as people write them: ``[0, 1, 2, 3, 6]`` -> ``0-3,6``."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def describe(p: Plan, cores: list[int]) -> str:
    """The plan in plain words, as the server's log and ``python -m webapp info`` print it.

    ``1 worker, 4 threads on 2 cores: oversubscribed``; ``2 workers, 2 threads each, on 4 cores,
    pinned to 2-3 | 4-5 (one core set per worker)``; ``3 workers, 1 thread each, on 2 cores:
    oversubscribed, workers share cores (0 | 1 | 0)``. ``cores``: the usable cores the plan was made from.
    """
    n, w, t = len(cores), p.workers, p.threads
    threads = f"{t} thread{'' if t == 1 else 's'}"
    head = f"1 worker, {threads} on" if w == 1 else f"{w} workers, {threads} each, on"
    text = f"{head} {n} core{'' if n == 1 else 's'}"
    sets = " | ".join(core_ranges(s) for s in p.slots)
    if p.oversubscribed:
        return text + (f": oversubscribed, workers share cores ({sets})" if p.shared else ": oversubscribed")
    if w == 1:
        return f"{text} ({sets})"
    return f"{text}, pinned to {sets} (one core set per worker)"


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


# Memory one worker holds of its own (private, not shared with the master): 143-150 MB measured for a loaded
# EfficientNet-Lite0 worker with one malloc arena, 84 MB at ready (README, "Precision and speed"; #14 item 7).
# A floor: a plan is refused only where even this much per worker does not fit.
WORKER_MB = 150


def available_mb(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process may still use, in MB (2**20 bytes): ``MemAvailable`` of ``/proc/meminfo``, or less
    where a cgroup v2 ``memory.max`` (a container's or a systemd unit's ``MemoryMax``) leaves less; None where
    neither can be read (not Linux)."""
    found = []
    try:
        with open(meminfo, encoding="ascii") as f:
            found += [int(line.split()[1]) // 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(os.path.join(cgroup, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        with open(os.path.join(cgroup, "memory.current"), encoding="ascii") as f:
            used = int(f.read().strip())
        if limit != "max":
            found.append(max(0, int(limit) - used) // 2**20)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def memory_problem(workers: int, available: int | None) -> str | None:
    """Why ``workers`` workers cannot fit in ``available`` MB (``available_mb``), in one line naming the settings,
    or None where they can (or memory is unknown). Each needs at least ``WORKER_MB`` of its own: a plan over
    that would have the host swap until it stops answering (1000 workers on a 24 GB box: it did)."""
    if available is None or workers * WORKER_MB <= available:
        return None
    most = max(1, available // WORKER_MB)
    return (f"{workers} workers need at least {workers * WORKER_MB / 1024:,.1f} GB ({WORKER_MB} MB each) and this "
            f"host has {available / 1024:,.1f} GB available: give at most {most} (CLASSIFIER_WORKERS or gunicorn "
            f"-w; 0 picks one per core set)")
