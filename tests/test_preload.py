"""webapp/preload.py: the libraries gunicorn's master imports before fork, and each process's memory.

The unit tests read this process's own ``/proc``; the server test starts a real gunicorn with 2 workers
and checks that the master holds torch yet started none of its thread pools before forking them, that
the workers share the master's pages, and that ``/healthz`` reports each worker's memory.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from conftest import small_png
from serving import Server
from webapp import preload

ROOT = Path(__file__).resolve().parents[1]
LINUX_PROC = Path("/proc/self/smaps_rollup").exists()


@pytest.mark.skipif(not LINUX_PROC, reason="needs Linux's /proc/PID/smaps_rollup")
def test_memory_reads_this_process():
    mem = preload.memory()
    assert {"private_bytes", "pss_bytes", "rss_bytes", "shared_dirty_bytes"} <= set(mem)
    assert 0 < mem["private_bytes"] <= mem["rss_bytes"] and 0 < mem["pss_bytes"] <= mem["rss_bytes"]
    # 64 MiB written: private memory of this process alone. A fresh anonymous mapping, not a bytearray: malloc
    # may hand out heap pages an earlier test freed, already private (grown by 34 MiB, run after 1,300 tests).
    block = mmap.mmap(-1, 64 << 20)
    block[::4096] = b"x" * len(block[::4096])
    grown = preload.memory()["private_bytes"] - mem["private_bytes"]
    block.close()
    assert grown >= 60 << 20, grown
    assert preload.memory(pid=2**22 + 7) == {}  # no such process: nothing, not an error
    assert preload.threads() >= 1


_ARENAS = '''
import ctypes, sys, threading
from webapp import preload
assert preload.limit_arenas(int(sys.argv[1])) == (int(sys.argv[1]) > 0)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
go = threading.Barrier(4)
def allocate():
    go.wait()  # all four at once: each one's first malloc gets an arena of its own where the cap allows
    libc.free(ctypes.c_void_p(libc.malloc(1000)))
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(preload.arenas())
'''


@pytest.mark.skipif(preload.arenas() is None, reason="needs glibc (malloc_info, mallopt)")
@pytest.mark.parametrize("cap, expected", [(0, 5), (1, 1), (2, 2)])
def test_limit_arenas_caps_the_arenas_a_processs_threads_get(cap, expected):
    out = subprocess.run([sys.executable, "-c", _ARENAS, str(cap)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert int(out) == expected  # 0: glibc's own default, the main arena and one per thread


def test_import_shared_starts_no_thread_and_freezes_what_it_made():
    """In a fresh interpreter (as gunicorn's master): torch and the rest imported, no thread started
    (numpy's OpenBLAS pool included), the objects frozen out of the cyclic GC, OPENBLAS_NUM_THREADS
    left as it was."""
    code = (
        "import gc, json, os, sys; sys.path.insert(0, %r)\n"
        "from webapp import preload\n"
        "done = preload.import_shared()\n"
        "print(json.dumps({**done, 'frozen': gc.get_freeze_count(), 'torch': 'torch' in sys.modules,\n"
        "                  'env': os.environ.get('OPENBLAS_NUM_THREADS')}))\n" % str(ROOT))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["torch"] and set(preload.LIBRARIES) <= set(out["seconds"])
    assert out["threads_after"] == out["threads_before"] == 1, out
    assert out["frozen"] > 10_000 and out["env"] is None, out
    if LINUX_PROC:
        assert sum(out["private_mb"].values()) > 100, out  # torch alone is ~280 MB: what the workers now share


@pytest.mark.server
@pytest.mark.skipif(not LINUX_PROC or len(os.sched_getaffinity(0)) < 2,
                    reason="needs /proc and 2 cores: with one, an OpenMP pool started in the master adds no thread")
def test_master_shares_the_libraries_with_two_workers_and_started_no_thread_pool(tmp_path):
    srv = Server(tmp_path / "gunicorn.log", MODEL="efficientnet_lite0", COMPILE=0, WORKERS=2, THREADS=1,
                 MAX_BATCH_SIZE=2, PRECISION="fp32")
    try:
        health = srv.wait_ready(workers=2)
        master = srv.proc.pid
        # torch is loaded in the master (else this test would prove nothing)...
        assert "libtorch_cpu" in Path(f"/proc/{master}/maps").read_text()
        # ...and it runs only its own two threads: gunicorn's main thread and the 503 responder
        # (webapp/responder.py). An OpenMP or oneDNN pool started before fork would add at least one more
        # (cores - 1), and every forked worker would inherit its locks without its threads.
        tasks = sorted(os.listdir(f"/proc/{master}/task"))
        assert len(tasks) == 2, tasks
        assert "threads 1 -> 1" in srv.output()  # as counted in the master around its imports, before listening
        for pid, h in health.items():
            mem = h["memory_mb"]  # MB = 2**20 bytes
            assert 0 < mem["private"] < mem["rss"] and 0 < mem["pss"] < mem["rss"], (pid, mem)
            # The master's torch pages, still shared: without the master's imports this was ~5 MB.
            assert mem["shared_dirty"] > 100, (pid, mem)
        r = requests.post(srv.url + "/api/v1/predict", files={"file": ("red.png", small_png(), "image/png")},
                          timeout=60)
        assert r.status_code == 200, r.text  # gevent's patching after fork still serves
        # CLASSIFIER_MALLOC_ARENAS (1), set in the master before its 503 responder's thread allocated and as
        # each worker forked: its decode, inference and heartbeat threads allocate from the main arena instead
        # of one more each (4 per worker here with 0; 2 when the responder's arena came with the fork).
        for h in [*health.values(), requests.get(srv.url + "/healthz", timeout=10).json()]:
            assert h["malloc_arenas"] == 1, h
        assert "Monkey-patching" not in srv.output()
    finally:
        srv.stop_cleanly()
