"""``/metrics``: the counts add up, in one process (Flask's test client) and across the workers of a
real gunicorn (prometheus-client's multiprocess mode, ``gunicorn.conf.py``'s metrics folder)."""

from __future__ import annotations

import io
import json
import os
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import small_png
from serving import Server

PREDICT = "/api/v1/predict"


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape: ``{(name, frozenset(labels.items())): value}``."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value, 0 when absent (a counter never incremented has no sample); the requests counter's
    summed over the labels not given (its ``code``, say)."""
    if name == "classifier_http_requests_total":
        return sum(matching(samples, name, **labels).values())
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)


def matching(samples: dict, name: str, **labels) -> dict[frozenset, float]:
    want = {(k, str(v)) for k, v in labels.items()}
    return {lab: v for (n, lab), v in samples.items() if n == name and want <= lab}


def by_status(series: dict[frozenset, float]) -> Counter:
    """Series summed by their ``status`` label (several methods may share one: GET, PUT... all 405)."""
    out: Counter = Counter()
    for lab, v in series.items():
        out[dict(lab)["status"]] += v
    return out


def requests_by_status(samples: dict, method: str = "POST") -> Counter:
    return by_status(matching(samples, "classifier_http_requests_total", endpoint=PREDICT, method=method))


def latency_counts(samples: dict) -> Counter:
    return by_status(matching(samples, "classifier_http_request_duration_seconds_count", endpoint=PREDICT))


def diff(after: Counter, before: Counter) -> dict:
    return {k: after[k] - before[k] for k in set(after) | set(before) if after[k] - before[k]}


# ------------------------------------------------------------------------------------ one process
def scrape(client) -> dict:
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.mimetype == "text/plain", resp.get_data(as_text=True)[:500]
    return parse(resp.get_data(as_text=True))


def test_made_up_methods_are_one_label_value_not_a_series_each(client):
    """A client inventing methods (M1, M2, ...) must not grow /metrics without bound: they count as "other".
    Counted from a scrape before (the counters are the process's: other tests' requests are in them too)."""
    before = scrape(client)
    for i in range(20):
        assert client.open("/healthz", method=f"M{i}").status_code == 405
    client.open("/healthz", method="DELETE")
    text = client.get("/metrics").get_data(as_text=True)
    samples = parse(text)
    assert not any('method="M' in line for line in text.splitlines())
    for method, count in (("other", 20), ("DELETE", 1)):
        labels = {"endpoint": "/healthz", "method": method, "status": 405}
        assert value(samples, "classifier_http_requests_total", **labels) - value(
            before, "classifier_http_requests_total", **labels) == count, method


def test_counts_add_up_in_one_process(client):
    before = scrape(client)
    answers = []
    for i in range(5):
        resp = client.post(PREDICT, data=small_png((i * 40, 10, 10)), content_type="image/png")
        assert resp.status_code == 200
        answers.append(resp.get_json())
    files = [(io.BytesIO(small_png((0, i * 50, 0))), f"{i}.png") for i in range(3)]
    resp = client.post(PREDICT, data={"file": files})
    assert resp.status_code == 200
    answers.append(resp.get_json())
    for topk in ("0", "abc"):
        assert client.post(f"{PREDICT}?topk={topk}", data=small_png(), content_type="image/png").status_code == 400
    assert client.post(PREDICT, data=b"hello", content_type="text/plain").status_code == 415
    assert client.get(PREDICT).status_code == 405
    after = scrape(client)

    assert diff(requests_by_status(after), requests_by_status(before)) == {"200": 6, "400": 2, "415": 1}
    assert diff(latency_counts(after), latency_counts(before)) == {"200": 6, "400": 2, "415": 1, "405": 1}  # any method
    assert diff(requests_by_status(after, "GET"), requests_by_status(before, "GET")) == {"405": 1}  # under its route
    # ... and by the error table's code (empty for an answer): two 400s of the same code, the 415's, the 405's
    for code, count in (("", 6), ("bad_request", 2), ("unsupported_media_type", 1)):
        assert value(after, "classifier_http_requests_total", endpoint=PREDICT, method="POST", code=code) - value(
            before, "classifier_http_requests_total", endpoint=PREDICT, method="POST", code=code) == count, code
    assert value(after, "classifier_http_requests_total", endpoint=PREDICT, method="GET", status=405,
                 code="method_not_allowed") - value(before, "classifier_http_requests_total", endpoint=PREDICT,
                                                    method="GET", status=405, code="method_not_allowed") == 1
    assert client.get("/no/such/path").status_code == 404
    assert value(scrape(client), "classifier_http_requests_total", endpoint="unmatched", method="GET", status=404) \
        - value(before, "classifier_http_requests_total", endpoint="unmatched", method="GET", status=404) == 1
    # One observation per classified image (5 + 3), from the answers' own numbers.
    images = [r for a in answers for r in a["results"]]
    for name in ("classifier_queue_wait_seconds_count", "classifier_batch_size_count",
                 "classifier_inference_seconds_count"):
        assert value(after, name) - value(before, name) == len(images) == 8, name
    assert value(after, "classifier_batch_size_sum") - value(before, "classifier_batch_size_sum") \
        == sum(r["batch_size"] for r in images)
    # Queue wait: exact for one image; for several, each at most the request's longest (timing_ms.queue).
    queued = value(after, "classifier_queue_wait_seconds_sum") - value(before, "classifier_queue_wait_seconds_sum")
    singles = sum(a["timing_ms"]["queue"] for a in answers if len(a["results"]) == 1) / 1e3
    bound = sum(a["timing_ms"]["queue"] * len(a["results"]) for a in answers) / 1e3
    assert singles - 1e-4 <= queued <= bound + 1e-4
    # Histogram buckets are cumulative and end in the count.
    assert value(after, "classifier_batch_size_bucket", le="+Inf") == value(after, "classifier_batch_size_count")
    assert value(after, "classifier_http_request_duration_seconds_bucket", endpoint=PREDICT, method="POST",
                 status=200, le="+Inf") == value(after, "classifier_http_requests_total", endpoint=PREDICT,
                                                 method="POST", status=200)
    # Gauges of this (only) worker.
    assert value(after, "classifier_worker_ready") == 1 and value(after, "classifier_queue_depth") == 0
    (info,) = matching(after, "classifier_model_info").items()
    assert dict(info[0])["model"] == "resnet18_seeded" and dict(info[0])["untrained"] == "true" and info[1] == 1


def test_batcher_results_are_recorded_per_image():
    from webapp.batcher import Result
    from webapp.metrics import Metrics

    m = Metrics()
    m.observe_results([Result(logits=None, queue_ms=2.0, inference_ms=30.0, batch_size=3)] * 3
                      + [Result(logits=None, queue_ms=0.5, inference_ms=10.0, batch_size=1)])
    samples = parse(generate_latest(m.registry).decode())
    assert value(samples, "classifier_batch_size_count") == 4 and value(samples, "classifier_batch_size_sum") == 10
    assert value(samples, "classifier_queue_wait_seconds_sum") == pytest.approx(0.0065)
    assert value(samples, "classifier_inference_seconds_sum") == pytest.approx(0.1)
    assert value(samples, "classifier_batch_size_bucket", le="1.0") == 1
    assert value(samples, "classifier_batch_size_bucket", le="3.0") == 4


def test_gauges_follow_the_worker(app, client, monkeypatch):
    monkeypatch.setattr(app.extensions["classifier"], "_ready", False)
    assert value(scrape(client), "classifier_worker_ready") == 0
    monkeypatch.undo()
    assert value(scrape(client), "classifier_worker_ready") == 1


def test_openmetrics_when_asked(client):
    resp = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert resp.status_code == 200 and resp.mimetype == "application/openmetrics-text"
    assert resp.get_data(as_text=True).rstrip().endswith("# EOF")


def test_odd_accept_headers_get_text(client):
    for accept in ("application/openmetrics-text; version=banana", "text/plain; version=x.y", "*/*", "",
                   "application/json"):
        resp = client.get("/metrics", headers={"Accept": accept})
        assert resp.status_code == 200 and resp.mimetype in ("text/plain", "application/openmetrics-text"), accept


def test_metrics_off_is_404(make_app):
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, METRICS=False).test_client()
    assert client.get("/metrics").status_code == 404
    assert "/metrics" not in client.get("/openapi.json").get_json()["paths"]
    assert client.post(PREDICT, data=small_png(), content_type="image/png").status_code == 200


# ------------------------------------------------------------------------------------ real gunicorn
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # An empty PROMETHEUS_MULTIPROC_DIR: gunicorn.conf.py makes its own folder, whatever this shell has.
    # MAX_WAIT_MS: these tests count requests; admission by time is tests/test_admission.py's. At its 1 s
    # default, 8 clients of eager ResNet-18 on one slow core each (2.45 GHz Zen 3) got 13 of 30 refused (429).
    srv = Server(tmp_path_factory.mktemp("metrics") / "server.log", env={"PROMETHEUS_MULTIPROC_DIR": ""},
                 MODEL="resnet18_seeded", COMPILE=0, PRECISION="fp32", WORKERS=2, THREADS=1, MAX_BATCH_SIZE=4,
                 ACCESS_LOG="json", MAX_WAIT_MS=60000)
    srv.health = srv.wait_ready(workers=2)
    yield srv
    out = srv.stop_cleanly()
    made = re.findall(r"PROMETHEUS_MULTIPROC_DIR=(\S+)", out)
    assert made and not os.path.exists(made[0]), "the metrics folder gunicorn.conf.py made is left behind"


def access_log(srv) -> list[dict]:
    return [json.loads(line) for line in srv.output().splitlines() if line.startswith("{")]


@pytest.mark.server
def test_counts_add_up_across_gunicorn_workers(server):
    """30 good + 5 bad predicts over 2 workers: the one scrape counts every one of them, from both workers."""
    png = small_png()

    def good(i):
        return requests.post(server.url + PREDICT, data=png, headers={"Content-Type": "image/png"}, timeout=60)

    def bad(i):
        if i < 3:
            return requests.post(server.url + PREDICT + "?topk=99", data=png, headers={"Content-Type": "image/png"},
                                 timeout=60)
        return requests.post(server.url + PREDICT, data=b"not an image", headers={"Content-Type": "text/plain"},
                             timeout=60)

    sent = Counter()
    with ThreadPoolExecutor(8) as pool:
        for resp in [*pool.map(good, range(30)), *pool.map(bad, range(5))]:
            sent[str(resp.status_code)] += 1
    assert sent == {"200": 30, "400": 3, "415": 2}
    # The JSON access log says which worker answered each; until both have, send more (counted too).
    pids = set(server.health)
    for _ in range(20):
        per_pid = Counter(r["pid"] for r in access_log(server) if r["path"] == PREDICT)
        if set(per_pid) == pids:
            break
        with ThreadPoolExecutor(8) as pool:
            for resp in pool.map(good, range(8)):
                sent[str(resp.status_code)] += 1
    assert set(per_pid) == pids, f"one worker answered every request: {per_pid}"
    assert sum(per_pid.values()) == sum(sent.values())

    resp = requests.get(server.url + "/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain")
    samples = parse(resp.text)
    assert requests_by_status(samples) == sent
    assert latency_counts(samples) == sent
    for name in ("classifier_queue_wait_seconds_count", "classifier_batch_size_count",
                 "classifier_inference_seconds_count"):
        assert value(samples, name) == sent["200"], name  # one image per good request
    assert value(samples, "classifier_batch_size_bucket", le="+Inf") == sent["200"]
    # Both workers' live gauges are in the scrape, one sample per pid (multiprocess mode 'liveall').
    ready = {int(dict(lab)["pid"]): v for lab, v in matching(samples, "classifier_worker_ready").items()}
    assert ready == {pid: 1.0 for pid in pids}
    assert value(samples, "classifier_queue_depth") == 0
    (info,) = matching(samples, "classifier_model_info").items()
    assert dict(info[0])["model"] == "resnet18_seeded" and info[1] == 1


@pytest.mark.server
def test_requests_gunicorn_refuses_are_counted(server):
    """Found by a fresh-user tryout: a 414 (a 9,000-byte path), a 431 (a 9,000-byte header) or a 400 gunicorn
    answers itself was in the access log but not in /metrics, so a flood of malformed requests did not show."""
    import socket

    def raw(request: bytes) -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(request)
            while sock.recv(65536):  # to the end of its answer: the connection closes after it
                pass

    def refused(samples) -> Counter:
        return by_status(matching(samples, "classifier_http_requests_total", endpoint="(unparsed)"))

    before = refused(parse(requests.get(server.url + "/metrics", timeout=10).text))
    raw(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n")
    raw(b"POST /api/v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    samples = parse(requests.get(server.url + "/metrics", timeout=10).text)
    assert diff(refused(samples), before) == {"414": 1, "431": 1, "400": 1}
    assert value(samples, "classifier_http_requests_total", endpoint="(unparsed)", status=400,
                 code="bad_request") >= 1


def test_rechecked_images_are_counted(app, client):
    """int8's and bf16's close calls that fp32 answered (``Engine.rechecked``) reach ``/metrics`` and
    ``/healthz``: here a second engine of the same (seeded) model rechecks every row (100 points: every margin
    is under it), so each classified image counts once, in whichever request it came, and a scrape adds only
    what is new."""
    from webapp.engine import Engine

    engine = app.extensions["classifier"].engine
    module = app.extensions["classifier"].model.module
    engine.add_recheck(Engine(module, input_size=engine.input_size, compile=False), 100.0)
    try:
        before, health = scrape(client), client.get("/healthz").get_json()
        files = [(io.BytesIO(small_png((0, i * 50, 0))), f"{i}.png") for i in range(3)]
        assert client.post(PREDICT, data={"file": files}).status_code == 200
        assert client.post(PREDICT, data=small_png(), content_type="image/png").status_code == 200
        after = scrape(client)
        assert value(after, "classifier_rechecked_images_total") - value(
            before, "classifier_rechecked_images_total") == 4
        assert value(scrape(client), "classifier_rechecked_images_total") == value(
            after, "classifier_rechecked_images_total")  # nothing new: nothing added
        assert client.get("/healthz").get_json()["rechecked"] - health["rechecked"] == 4
    finally:
        engine.add_recheck(engine, 0.0)
