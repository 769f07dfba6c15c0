"""Run by tests/test_batcher.py in a subprocess: InferenceBatcher under ``monkey.patch_all()``.

20 greenlets classify one image each (plus one poisoned image) while the model does ~0.3 s of
real CPU work per batch; a ticker greenlet sleeps 10 ms at a time and records the largest gap
between ticks. Prints one JSON line for the test to check.
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gevent  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from webapp.batcher import InferenceBatcher  # noqa: E402
from webapp.concurrency import gevent_active, keep_alive  # noqa: E402
from webapp.errors import ServiceError  # noqa: E402

PREDICT_S = 0.3
POISON = 999

# A handler made after patching (its lock is a gevent lock): the inference thread logs through it.
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
torch.set_num_threads(1)

predict_native_ids: set[int] = set()
batch_sizes: list[int] = []
predict_times: list[float] = []
_a = torch.randn(128, 128)


def predict(x: torch.Tensor) -> torch.Tensor:
    predict_native_ids.add(threading.get_native_id())
    batch_sizes.append(x.shape[0])
    t0 = time.perf_counter()
    y = _a
    while time.perf_counter() - t0 < PREDICT_S:  # real CPU work, not a sleep
        y = torch.tanh(y @ _a)
    predict_times.append(time.perf_counter() - t0)
    ids = x.mean(dim=(1, 2, 3))
    if (ids.round() == POISON).any():
        raise ValueError("poisoned")
    return ids[:, None].repeat(1, 5) + 0 * y[0, 0]


def main() -> None:
    out = {"gevent_active": gevent_active(), "main_native_id": threading.get_native_id()}
    # The fixed wait: the 20 clients, spawned first, fill batches of 4 in order, so the poisoned image
    # (spawned last) runs alone. Without it the first client runs at once (nothing else is counted as
    # on its way) and the poison would share a batch with clients.
    b = InferenceBatcher(predict, max_batch_size=4, batch_timeout=0.02, queue_size=64, request_timeout=20,
                         wait="fixed")
    b.start()

    state = {"done": False, "ticks": 0, "max_gap": 0.0}

    def ticker():
        last = time.perf_counter()
        while not state["done"]:
            gevent.sleep(0.01)
            now = time.perf_counter()
            state["max_gap"] = max(state["max_gap"], now - last)
            state["ticks"] += 1
            last = now

    def client(i: int):
        (r,) = b.infer([torch.full((3, 4, 4), float(i))])
        return i, int(r.logits[0].item())

    def poisoned():
        try:
            b.infer([torch.full((3, 4, 4), float(POISON))])
        except ServiceError as e:
            return e.status
        return None

    tick = gevent.spawn(ticker)
    gevent.sleep(0.05)
    jobs = [gevent.spawn(client, i) for i in range(20)]
    bad = gevent.spawn(poisoned)
    gevent.joinall(jobs + [bad], timeout=30, raise_error=True)
    state["done"] = True
    tick.join(1)
    results = [j.value for j in jobs]
    out.update(
        n_results=sum(r is not None for r in results),
        ids_ok=all(r is not None and r[0] == r[1] for r in results),
        poison_status=bad.value,
        ticks=state["ticks"],
        max_tick_gap_s=round(state["max_gap"], 4),
        predict_native_ids=sorted(predict_native_ids),
        batch_sizes=list(batch_sizes),
        min_predict_s=round(min(predict_times), 4),
    )

    t0 = time.perf_counter()
    b.stop(timeout=5)
    out.update(stop_s=round(time.perf_counter() - t0, 4), alive_after_stop=b.alive)

    # stop() while a batch still runs and nothing else is left on the hub (gunicorn's worker_exit):
    # it must wait for the thread, not end in gevent's LoopExit, and the queued image is served.
    b2 = InferenceBatcher(predict, max_batch_size=4, batch_timeout=0.0, queue_size=8, request_timeout=20)
    b2.start()
    (req,) = b2.submit([torch.full((3, 4, 4), 7.0)])
    monkey.get_original("time", "sleep")(0.05)  # the inference thread has taken it and is predicting
    try:
        b2.stop(timeout=5)
        out["stop_while_running"] = "ok"
    except BaseException as exc:  # LoopExit is a BaseException
        out["stop_while_running"] = type(exc).__name__
    out["served_before_stop"] = int(b2.wait(req).logits[0].item()) == 7

    # The wait for company under gevent: a lone image runs at once (batch_timeout is 5 s), one queued
    # while another is on its way waits for it, and a greenlet cancelling that one ends the wait.
    b3 = InferenceBatcher(predict, max_batch_size=4, batch_timeout=5.0, queue_size=8, request_timeout=20)
    b3.start()
    t0 = time.perf_counter()
    b3.infer([torch.full((3, 4, 4), 1.0)])
    out["lone_s"] = round(time.perf_counter() - t0, 4)
    coming = b3.coming(1)
    t0 = time.perf_counter()
    waiter = gevent.spawn(b3.infer, [torch.full((3, 4, 4), 2.0)])
    gevent.sleep(0.5)
    out["waited_for_company"] = not waiter.ready()
    gevent.spawn(coming.cancel).join()
    waiter.join(5)
    out["after_cancel_s"] = round(time.perf_counter() - t0, 4)
    out["coming_after"] = b3.coming_images
    b3.stop(timeout=5)

    # keep_alive: beats continue while this (the hub's) thread is blocked outright.
    beats = []
    stop_beats = keep_alive(lambda: beats.append(1), every=0.05, limit=2.0)
    monkey.get_original("time", "sleep")(0.4)
    out["beats_while_blocked"] = len(beats)
    stop_beats()

    print(json.dumps(out))


if __name__ == "__main__":
    main()
