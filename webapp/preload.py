"""Libraries imported once in gunicorn's master, shared by every worker; each process's memory.

Why: every worker used to import torch and the rest itself, after fork, and so held its own copy
of what they allocate on import: ~545 MB private (``Private_Dirty`` in ``/proc/PID/smaps_rollup``)
per worker serving a 19 MB model, of which a bare ``import torch`` is ~280 MB, torchvision ~87 MB,
timm ~30 MB and inductor's compiler ~43 MB (measured on the 2-core box, torch 2.14). Imported in the
master before fork, those pages are shared copy-on-write by every worker; ``gc.freeze`` then keeps
the workers' cyclic GC from writing to (and so copying) the objects they made.

What must *not* happen in the master: loading a model, starting a thread pool, or running a torch op
that starts OpenMP/oneDNN threads (a forked child inherits their locks but not the threads, and
hangs on its first parallel op). Importing starts none of torch's pools; numpy's OpenBLAS starts its
own on import, so it is imported with ``OPENBLAS_NUM_THREADS=1`` (the service does no BLAS in numpy).
``import_shared`` checks the master's thread count before and after, and says so if it grew.
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import time

# In import order. The webapp modules pull in Flask, Pillow, prometheus-client and the model code.
LIBRARIES = ("numpy", "torch", "torchvision", "timm", "PIL.Image", "flask")
SERVICE = ("webapp.service", "webapp.efficientnet_lite", "webapp.api", "webapp.ui", "webapp.v2", "webapp.metrics")
# Not inductor's compiler (``torch._inductor.compile_fx``): a cold start builds its packages in a child
# process (``startup.build_in_child``) and a warm one loads them, so a worker imports the compiler only where
# that child failed (it then builds itself); preloading it for that rare case cost every start ~2 s (1.8-2.3 s
# on the Zen 3 box) and the master ~43 MB.


def threads(pid: int | str = "self") -> int:
    """OS threads of process ``pid`` now (``/proc/PID/task``); 0 where ``/proc`` is absent."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def import_shared() -> dict:
    """Import ``LIBRARIES`` and ``SERVICE`` in this process, then
    ``gc.freeze()``; for gunicorn's master before it forks (``gunicorn.conf.py``). Idempotent.

    Returns ``{"seconds": {module: s}, "private_mb": {module: MB added}, "threads_before": n,
    "threads_after": n}`` (MB = 2**20 bytes of ``Private_Dirty``; empty where ``/proc`` is absent).

    :raises ImportError: a module cannot be imported (the worker could not have either).
    """
    before = threads()
    seconds, private = {}, {}
    had = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = had or "1"  # read once, when numpy loads OpenBLAS
    try:
        for name in LIBRARIES + SERVICE:
            m0, t0 = memory().get("private_bytes"), time.perf_counter()
            importlib.import_module(name)
            seconds[name] = round(time.perf_counter() - t0, 3)
            m1 = memory().get("private_bytes")
            if m0 is not None and m1 is not None:
                private[name] = round((m1 - m0) / 2**20, 1)
    finally:
        if had is None:  # the workers' own setting stays as the user left it
            os.environ.pop("OPENBLAS_NUM_THREADS", None)
    gc.collect()
    gc.freeze()  # the workers' collections never scan (and so never write to) what was made here
    return {"seconds": seconds, "private_mb": private, "threads_before": before, "threads_after": threads()}


def trim() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``, every arena); False where there
    is no glibc.

    For a worker once start-up is done: compiling and warming up leave ~40 MB of freed but still mapped
    heap in each worker (measured: 183 -> 142 MB private for ResNet-18 at batch sizes 1..8), which
    glibc only returns from the top of its main arena on its own. And whenever the worker falls idle
    (the batcher's ``on_idle``): a 12 MP upload's decode and a batch's activations leave freed blocks
    in the decode threads' and the inference thread's arenas."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)  # 1: some memory was released, 0: none
    return True


M_ARENA_MAX = -8  # glibc's <malloc.h>


def limit_arenas(n: int) -> bool:
    """Let this process's threads share at most ``n`` glibc malloc arenas (``mallopt(M_ARENA_MAX, n)``);
    False where ``n`` is 0 (glibc's default kept) or there is no glibc.

    For a worker as it forks, before its threads start (``CLASSIFIER_MALLOC_ARENAS``). glibc gives each
    thread that allocates while others hold the arenas an arena of its own, up to 8 per core, and each
    keeps the blocks its thread freed: the decode threads' 12 MP buffers and the inference thread's
    batches. Measured (2 workers, ResNet-18, closed loop of 12 MP uploads at 8 clients, 2-core Zen 5,
    2026-12-02): private memory loaded 148-175 MB per worker with glibc's default, 143-150 with one
    arena, idle after ``trim`` 99-100 vs 86 MB, at the same CPU per image (51.8/52.0 vs 50.7/52.2 ms).
    The threads then take one lock for their allocations; big buffers are ``mmap``-ed outside it."""
    if n <= 0:
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_ARENA_MAX, int(n)))


def arenas() -> int | None:
    """How many glibc malloc arenas this process has now (``malloc_info``'s ``<heap>`` entries: the main
    arena and one per thread group that got its own); None where there is no glibc."""
    import ctypes

    libc = _libc()
    if libc is None or not all(hasattr(libc, f) for f in ("malloc_info", "open_memstream", "fclose", "free")):
        return None
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    fp = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not fp:
        return None
    try:
        libc.malloc_info(0, ctypes.c_void_p(fp))
    finally:
        libc.fclose(ctypes.c_void_p(fp))
    try:
        text = ctypes.string_at(buf.value, size.value) if buf.value else b""
    finally:
        libc.free(buf)
    return text.count(b"<heap nr=")


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    import ctypes.util

    try:  # find_library runs ldconfig: once per process, not once per idle spell
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if hasattr(libc, "open_memstream"):
        libc.open_memstream.restype = ctypes.c_void_p  # a FILE *, not the default int (arenas)
    return libc


def _malloc_trim():
    libc = _libc()
    return getattr(libc, "malloc_trim", None)  # musl, macOS: no malloc_trim


_FIELDS = {"Rss:": "rss_bytes", "Pss:": "pss_bytes", "Private_Dirty:": "private_bytes",
           "Private_Clean:": "private_clean_bytes", "Shared_Clean:": "shared_clean_bytes",
           "Shared_Dirty:": "shared_dirty_bytes"}


def memory(pid: int | str = "self") -> dict:
    """Process ``pid``'s memory in bytes from ``/proc/PID/smaps_rollup`` (Linux 4.14+): ``private_bytes``
    (``Private_Dirty``: what this process alone costs, the figure that grows with every worker),
    ``pss_bytes`` (its proportional share, shared pages split between the processes mapping them),
    ``rss_bytes``, ``private_clean_bytes``, ``shared_clean_bytes``, ``shared_dirty_bytes``; ``{}`` where
    the file cannot be read (not Linux, or another user's process)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in _FIELDS and len(parts) >= 2:
                    out[_FIELDS[parts[0]]] = int(parts[1]) * 1024  # the file says kB
    except (OSError, ValueError):
        return {}
    return out
