"""The Ray path (webapp/cluster/) against the gunicorn app, on one local Ray instance.

A Ray instance of 4 logical CPUs is started here; ``python -m webapp serve --cluster`` (2 model
replicas of 1 CPU, 1 HTTP replica) and ``python -m webapp classify --cluster`` (2 Ray Data
actors) join it through ``RAY_ADDRESS``, as they would join a real cluster. A real gunicorn
server with the same settings (offline EfficientNet-Lite0, eager fp32) gives the answers both
must match: same top-3 for every shared photo, same status and error code for every bad upload.

Skipped where Ray is absent (requirements-cluster.txt; requirements-dev.txt installs it).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from PIL import Image

from conftest import ROOT, SHARED_IMAGES, png_bytes, png_declaring, shared_image
from serving import Server, free_port

pytestmark = pytest.mark.cluster
# The HTTP tests of a real `serve --cluster` (a Ray instance, 2 model replicas and the gunicorn reference: ~50 s of
# set-up on 2 cores) are in the extended tier, which CI runs as its own step; the replica's own batching, bad
# uploads and failures, the settings and the usage errors stay in the plain run.
SERVE_TIER = pytest.mark.extended

ray = pytest.importorskip("ray", reason="the Ray path needs requirements-cluster.txt")
pytest.importorskip("a2wsgi", reason="the Ray path needs requirements-cluster.txt")

MiB = 1024 * 1024
# Both servers: the offline model, eager fp32 (ready in seconds, identical numbers), small limits.
COMMON = {"MODEL": "efficientnet_lite0", "COMPILE": 0, "PRECISION": "fp32", "MAX_BATCH_SIZE": 4,
          "MAX_UPLOAD_BYTES": 4 * MiB, "MAX_FILES": 4, "THREADS": 1, "LOG_LEVEL": "warning"}
# The Ray app: 2 model replicas taking 4 requests each, 8 more queued per HTTP replica (Ray counts
# a request as queued for the moment before it is routed too: a smaller queue refuses bursts of 8).
CLUSTER = {"CLUSTER_REPLICAS": 2, "CLUSTER_MAX_ONGOING_REQUESTS": 4, "CLUSTER_MAX_QUEUED_REQUESTS": 8}
READY_TIMEOUT_S = 300


def _env(settings: dict, **extra) -> dict:
    # Only what each test says: no CLASSIFIER_* of this shell, and no RAY_ADDRESS unless given.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLASSIFIER_") and k != "RAY_ADDRESS"}
    env.update({f"CLASSIFIER_{k}": str(v) for k, v in settings.items()})
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _photos() -> list[str]:
    if not SHARED_IMAGES.is_dir():
        pytest.skip(f"{SHARED_IMAGES} is absent (the shared photos live in ../shared/images)")
    return sorted(p.name for p in SHARED_IMAGES.glob("*.jpg"))


# ----------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance (4 logical CPUs) that the CLI commands join; shut down at the end."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def gunicorn(tmp_path_factory):
    """The gunicorn app with the same settings: the reference answers."""
    srv = Server(tmp_path_factory.mktemp("cluster-gunicorn") / "server.log", args=("--no-control-socket",),
                 WORKERS=1, **COMMON)
    try:
        srv.wait_ready(1)
        yield srv
    finally:
        srv.stop_cleanly()


class ClusterServer:
    """The ``serve --cluster`` process of the module: ``url``, ``proc``, ``log_path``."""

    def __init__(self, url: str, proc: subprocess.Popen, log_path):
        self.url, self.proc, self.log_path = url, proc, log_path


@pytest.fixture(scope="module")
def cluster(ray_address, tmp_path_factory):
    """``python -m webapp serve --cluster`` joined to the test's Ray. SIGTERM at the end (or by the drain test)."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("cluster-serve") / "serve.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "webapp", "serve", "--cluster"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT,
                            env=_env({**COMMON, **CLUSTER, "BIND": f"127.0.0.1:{port}"}, RAY_ADDRESS=ray_address))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"serve --cluster exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"serve --cluster not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield ClusterServer(url, proc, log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
        assert code == 0, f"serve --cluster exited with {code} on SIGTERM:\n{log_path.read_text()[-4000:]}"


def _post(url: str, name: str, data: bytes, **kw) -> requests.Response:
    return requests.post(url + "/api/v1/predict", files={"file": (name, data)}, timeout=120, **kw)


def _four_names(i: int) -> list[str]:
    """The file names of request ``i`` of a burst: each answer must echo its own."""
    return [f"{i}-{k}.jpg" for k in range(4)]


def _post_four(url: str, i: int, data: bytes) -> requests.Response:
    """Request ``i`` of a burst: the same photo 4 times (MAX_FILES), named ``_four_names(i)``."""
    return requests.post(url + "/api/v1/predict", timeout=120, files=[("file", (n, data)) for n in _four_names(i)])


def _top3(resp: requests.Response) -> list[tuple[str, float]]:
    assert resp.status_code == 200, resp.text
    return [(p["label"], p["probability"]) for p in resp.json()["results"][0]["predictions"]]


# ----------------------------------------------------------------------------------------- settings

def test_replica_settings_resolve_threads_and_paths(tmp_path, monkeypatch):
    from webapp.cluster import replica_settings
    from webapp.settings import SettingsError

    monkeypatch.chdir(tmp_path)
    values = replica_settings({"WEIGHTS": "w/resnet18.pth", "THREADS": 0}, environ={})
    assert values["THREADS"] == 1  # a replica reserves as many CPUs as it runs threads
    assert values["WEIGHTS"] == str(tmp_path / "w" / "resnet18.pth")  # replicas run in other folders
    assert replica_settings({"THREADS": 3}, environ={})["THREADS"] == 3
    assert replica_settings({}, environ={"CLASSIFIER_CLUSTER_REPLICAS": "5"})["CLUSTER_REPLICAS"] == 5
    with pytest.raises(SettingsError, match="CLUSTER_MIN_REPLICAS=5 is above"):
        replica_settings({"CLUSTER_REPLICAS": 0, "CLUSTER_MIN_REPLICAS": 5, "CLUSTER_MAX_REPLICAS": 2}, environ={})
    with pytest.raises(SettingsError, match="CLASSIFIER_CLUSTER_REPLICAS"):
        replica_settings({}, environ={"CLASSIFIER_CLUSTER_REPLICAS": "-1"})


def test_serve_config_file_builds_the_application():
    """deploy/ray-serve.yaml is a valid Serve config whose import_path builds the app from its args."""
    import yaml
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "deploy" / "ray-serve.yaml").read_text()))
    (app,) = config.applications
    module, _, attr = app.import_path.partition(":")
    builder = getattr(__import__(module, fromlist=[attr]), attr)
    built = call_user_app_builder_with_args_if_necessary(builder, app.args)
    assert isinstance(built, Application)
    http = built._bound_deployment
    (model_app,) = [a for a in http.init_args if isinstance(a, Application)]
    model = model_app._bound_deployment
    assert model.num_replicas == app.args["CLUSTER_REPLICAS"]
    assert model.ray_actor_options["num_cpus"] == app.args["THREADS"]
    assert model.max_ongoing_requests == app.args["CLUSTER_MAX_ONGOING_REQUESTS"]
    assert model.max_queued_requests == app.args["CLUSTER_MAX_QUEUED_REQUESTS"]
    assert http.ray_actor_options["num_cpus"] == 0


def test_autoscaling_from_settings():
    from webapp.cluster import application, replica_settings

    built = application(replica_settings({"CLUSTER_REPLICAS": 0, "CLUSTER_MIN_REPLICAS": 2,
                                          "CLUSTER_MAX_REPLICAS": 6, "MAX_BATCH_SIZE": 8}, environ={}))
    model = [a for a in built._bound_deployment.init_args if hasattr(a, "_bound_deployment")][0]._bound_deployment
    auto = model._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (2, 6, 8)


# ----------------------------------------------------------------------------------------- a model replica, in-process

@pytest.fixture(scope="module")
def replica():
    """The model replica's class run here, outside Ray Serve (``@serve.batch`` is plain asyncio), with
    its own event loop: batching and failures are checked without a cluster."""
    import asyncio

    from ray.serve import batching

    from webapp.cluster import ModelReplica, replica_settings

    values = replica_settings({"MODEL": "resnet18_seeded", "COMPILE": False, "PRECISION": "fp32",
                               "MAX_BATCH_SIZE": 4, "BATCH_TIMEOUT_MS": 50}, environ={})
    with pytest.MonkeyPatch.context() as mp:
        # Ray's batch queue reads max_ongoing_requests from the replica context only to log a warning;
        # there is no replica context here.
        mp.setattr(batching._BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
        r = ModelReplica.func_or_class(values)
        r.loop = asyncio.new_event_loop()
        yield r
        pending = asyncio.all_tasks(r.loop)  # the batch queue's loop task
        for task in pending:
            task.cancel()
        r.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        r.loop.close()


def _classify_all(replica, requests_: list[list]) -> list[dict]:
    import asyncio

    async def main():
        return await asyncio.gather(*(replica.classify(ups, 3) for ups in requests_))

    return replica.loop.run_until_complete(main())


def _png_upload(name: str, shade: int):
    from webapp.contract import Upload

    return Upload(name, png_bytes(Image.new("RGB", (40, 30), (shade, 255 - shade, 90))))


def test_replica_batches_concurrent_requests_and_keeps_them_apart(replica):
    before = replica.batches
    answers = _classify_all(replica, [[_png_upload(f"{i}.png", 20 * i)] for i in range(10)])
    assert [a["answer"]["results"][0]["filename"] for a in answers] == [f"{i}.png" for i in range(10)]
    sizes = [a["answer"]["results"][0]["batch_size"] for a in answers]
    assert max(sizes) > 1 and max(sizes) <= 4  # @serve.batch formed batches, never above MAX_BATCH_SIZE
    assert replica.batches - before < 10
    assert all(a["served_by"] == replica.replica for a in answers)


def test_replica_answers_a_bad_upload_as_data_and_spares_the_others(replica):
    from webapp.contract import Upload

    answers = _classify_all(replica, [[_png_upload("ok.png", 1), Upload("bad.jpg", b"\xff\xd8\xffnope")],
                                      [_png_upload("other.png", 2)]])
    assert answers[0]["error"]["code"] == "undecodable_image" and "bad.jpg" in answers[0]["error"]["message"]
    assert answers[1]["answer"]["results"][0]["filename"] == "other.png"
    # each photo that cannot be read is named, as the gunicorn app names them (answers.every_fault)
    [both] = _classify_all(replica, [[Upload("bad.jpg", b"\xff\xd8\xffnope"), _png_upload("ok.png", 1),
                                      Upload("text.jpg", b"just some text")]])
    assert both["error"]["code"] == "undecodable_image" and both["error"]["status"] == 400
    assert both["error"]["message"].startswith("2 of the 3 photos cannot be used: (1) bad.jpg: ")
    assert "; (2) text.jpg: " in both["error"]["message"]


def test_replica_reports_the_original_of_a_client_scaled_upload(replica):
    from webapp.contract import Original

    up = _png_upload("phone.png", 3)
    up.original = Original(4032, 3024, "HEIC", 2_500_000)  # what the page says of a photo it scaled
    (answer,) = _classify_all(replica, [[up]])
    res = answer["answer"]["results"][0]
    assert (res["width"], res["height"], res["format"], res["bytes"]) == (4032, 3024, "HEIC", 2_500_000)
    assert res["scaled_by_client"] == {"width": 40, "height": 30, "format": "PNG", "bytes": len(up.data)}


def test_replica_batch_failure_fails_its_requests_then_serves_again(replica, monkeypatch):
    def broken(batch):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(replica.started.engine, "predict", broken)
    answers = _classify_all(replica, [[_png_upload(f"{i}.png", i)] for i in range(3)])
    assert [a["error"]["code"] for a in answers] == ["inference_failed"] * 3
    assert "simulated" not in answers[0]["error"]["message"]  # logged on the server, never sent
    monkeypatch.undo()
    assert "answer" in _classify_all(replica, [[_png_upload("after.png", 9)]])[0]
    assert replica.health()["ready"] is True and replica.health()["images"] >= 1
    replica.check_health()


# ----------------------------------------------------------------------------------------- Ray Data

@pytest.mark.extended  # a Ray Data job over every shared photo, ~55 s on 2 cores: with `-m extended`
def test_bulk_classify_matches_gunicorn(ray_address, gunicorn, tmp_path):
    """classify --cluster over the shared photos plus broken files: one row per file, errors as rows."""
    photos = _photos()
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = {"text.jpg": b"this is not a photo\n", "truncated.jpg": shared_image("dog.jpg").read_bytes()[:3000],
              "empty.png": b"", "huge.png": png_declaring(20_000, 20_000)}
    for name, data in broken.items():
        (bad / name).write_bytes(data)
    # classify's own listing rules: a camera's "_MG_" name is read, hidden and non-image files are not.
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buf, format="JPEG")
    (bad / "_MG_0001.JPG").write_bytes(buf.getvalue())
    (bad / ".hidden.jpg").write_bytes(buf.getvalue())
    (bad / "notes.txt").write_text("not a photo")
    out = tmp_path / "out" / "labels.parquet"
    run = subprocess.run([sys.executable, "-m", "webapp", "classify", "--cluster", str(SHARED_IMAGES), str(bad),
                          "--out", str(out), "--cluster-actors", "2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, env=_env(COMMON, RAY_ADDRESS=ray_address))
    assert run.returncode == 1, run.stderr[-4000:]  # some files failed, the job did not
    assert (f"{len(photos) + len(broken) + 1} files: {len(photos) + 1} classified by efficientnet_lite0, "
            f"{len(broken)} failed" in run.stderr), run.stderr[-3000:]
    assert "skipped in folders: 2 other files (--all-files tries them)" in run.stderr
    # Only our lines on the terminal: Ray's own (its loggers, its C++ core, the actors') went to its log file.
    ours = ("classifying ", "classify:", f"{len(photos) + len(broken) + 1} files:", "Ray's own messages: ")
    assert all(line.lstrip("\r").startswith(ours) for line in run.stderr.splitlines() if line.strip()), run.stderr
    assert "\x1b[" not in run.stderr and "core_worker" not in run.stderr

    import pyarrow.parquet as pq

    table = pq.read_table(out)
    assert table.schema.names == ["path", "model", "width", "height", "format", "labels", "indices",
                                  "probabilities", "error_code", "error"]
    rows = {os.path.basename(r["path"]): r for r in table.to_pylist()}
    assert len(rows) == table.num_rows and sorted(rows) == sorted(photos + list(broken) + ["_MG_0001.JPG"])
    # Paths as local classify prints them: the folder as given, the file's name under it (not resolved).
    assert {r["path"] for r in table.to_pylist()} == (
        {str(SHARED_IMAGES / n) for n in photos} | {str(bad / n) for n in [*broken, "_MG_0001.JPG"]})
    assert (rows["_MG_0001.JPG"]["width"], rows["_MG_0001.JPG"]["error"]) == (64, None)
    for name in photos:
        row = rows[name]
        assert row["error"] is None and row["error_code"] is None
        reference = _top3(_post(gunicorn.url, name, (SHARED_IMAGES / name).read_bytes()))
        assert row["labels"] == [label for label, _ in reference], name
        assert row["probabilities"] == pytest.approx([p for _, p in reference], abs=1e-5)
        assert len(row["indices"]) == 3 and row["model"] == "efficientnet_lite0"
        assert row["width"] > 0 and row["height"] > 0 and row["format"] == "JPEG"
    for name, data in broken.items():
        row = rows[name]
        expected = _post(gunicorn.url, name, data).json()["error"]
        assert row["error_code"] == expected["code"], (name, row["error"])
        assert row["error"] and row["labels"] == [] and row["probabilities"] == []


@pytest.mark.extended  # a misconfigured job, ~13 s of actors failing on 2 cores: with `-m extended`
def test_bulk_classify_says_why_the_model_cannot_start(ray_address, tmp_path):
    """No weights and no fallback: one line saying what to do, exit 2 (configuration), not a job that hangs or a
    traceback last."""
    (tmp_path / "a.png").write_bytes(png_bytes(Image.new("RGB", (32, 32))))
    run = subprocess.run([sys.executable, "-m", "webapp", "classify", "--cluster", str(tmp_path), "--out",
                          str(tmp_path / "x.parquet"), "--cluster-actors", "1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env=_env({**COMMON, "MODEL": "resnet18", "FALLBACK": 0, "DOWNLOAD": 0,
                                   "WEIGHTS": str(tmp_path / "missing.pth")}, RAY_ADDRESS=ray_address))
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot start the model: ") and "missing.pth" in last, run.stderr[-3000:]


def test_startup_failure_is_found_in_a_remote_traceback():
    from webapp.cluster import startup_failure

    text = ("ray.exceptions.ActorDiedError: The actor died because of an error raised in its creation task\n"
            "  File \"/x/webapp/models.py\", line 263, in load_model\n"
            "webapp.errors.StartupError: ResNet-18 weights not found; put the file at /w.pth\n")
    assert str(startup_failure(text)) == "ResNet-18 weights not found; put the file at /w.pth"
    assert startup_failure("RuntimeError: something else") is None


def test_bulk_classify_usage_errors(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "webapp", "classify", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env=_env({}))

    missing_out = run("--cluster", str(tmp_path))
    assert missing_out.returncode == 2 and "--out DEST.parquet" in missing_out.stderr
    missing_src = run("--cluster", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.parquet"))
    assert missing_src.returncode == 2 and "no such file or directory" in missing_src.stderr
    no_cluster = run(str(tmp_path), "--out", str(tmp_path / "x.parquet"))
    assert no_cluster.returncode == 2 and "go with --cluster" in no_cluster.stderr
    out_is_folder = run("--cluster", str(tmp_path), "--out", str(tmp_path))
    assert out_is_folder.returncode == 2 and "is a folder" in out_is_folder.stderr
    with_format = run("--cluster", str(tmp_path), "--out", str(tmp_path / "x.parquet"), "--format", "csv")
    assert with_format.returncode == 2 and "--format" in with_format.stderr
    as_csv = run("--cluster", str(tmp_path), "--out", str(tmp_path / "x.csv"))  # wrote Parquet into x.csv (tryout24)
    assert as_csv.returncode == 2 and "writes Parquet, not .csv" in as_csv.stderr, as_csv.stderr
    assert f"name it {tmp_path / 'x.parquet'}" in as_csv.stderr and not (tmp_path / "x.csv").exists()
    for result in (missing_out, missing_src, no_cluster, out_is_folder, with_format, as_csv):
        assert "Traceback" not in result.stderr


@pytest.mark.extended  # serve --cluster's refusals, rare (~7 s): with `-m extended`
def test_serve_cluster_refuses_a_bad_or_busy_address_or_no_cluster():
    import socket

    def run(bind):
        return subprocess.run([sys.executable, "-m", "webapp", "serve", "--cluster", "--bind", bind], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, env=_env({}))

    bad = run("127.0.0.1:99999")
    assert bad.returncode == 2 and "--bind" in bad.stderr and "(port 1 to 65535)" in bad.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = run(f"127.0.0.1:{busy.getsockname()[1]}")
    assert taken.returncode == 2 and "cannot listen on" in taken.stderr and "Traceback" not in taken.stderr
    nobody = subprocess.run([sys.executable, "-m", "webapp", "serve", "--cluster", "--address",
                             f"127.0.0.1:{free_port()}"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=_env({}))
    assert nobody.returncode == 1 and "no Ray cluster answers at" in nobody.stderr, nobody.stderr[-2000:]


# ----------------------------------------------------------------------------------------- Ray Serve

@SERVE_TIER
def test_serve_gives_the_gunicorn_top3(cluster, gunicorn):
    for name in _photos():
        data = (SHARED_IMAGES / name).read_bytes()
        ours, reference = _post(cluster.url, name, data), _post(gunicorn.url, name, data)
        assert [label for label, _ in _top3(ours)] == [label for label, _ in _top3(reference)], name
        assert [p for _, p in _top3(ours)] == pytest.approx([p for _, p in _top3(reference)], abs=1e-5)
        a, b = ours.json(), reference.json()
        assert a.keys() == b.keys() and a["timing_ms"].keys() == b["timing_ms"].keys()
        assert a["model"] == b["model"]
        same = ("filename", "width", "height", "format")
        assert a["results"][0].keys() == b["results"][0].keys()
        assert [a["results"][0][k] for k in same] == [b["results"][0][k] for k in same]


def _bad_requests() -> dict[str, dict]:
    dog = shared_image("dog.jpg").read_bytes()
    noise = Image.frombytes("RGB", (1100, 1100), os.urandom(1100 * 1100 * 3))
    return {
        "not an image": {"files": {"file": ("a.jpg", b"hello, I am text")}},
        "truncated jpeg": {"files": {"file": ("t.jpg", dog[:2000])}},
        "empty file": {"files": {"file": ("e.jpg", b"")}},
        "no file field": {"files": {"photo": ("a.jpg", dog)}},
        "too many files": {"files": [("file", (f"{i}.jpg", dog)) for i in range(5)]},
        "too many pixels": {"files": {"file": ("big.png", png_declaring(30_000, 30_000))}},
        "body too large": {"files": {"file": ("noise.png", png_bytes(noise) * 2)}},
        "bad topk": {"files": {"file": ("a.jpg", dog)}, "params": {"topk": "0"}},
        "text body": {"data": b"hello", "headers": {"Content-Type": "text/plain"}},
        "raw jpeg body, bad bytes": {"data": b"\xff\xd8\xff\xe0garbage", "headers": {"Content-Type": "image/jpeg"}},
    }


@SERVE_TIER
@pytest.mark.parametrize("case", list(_bad_requests()) if SHARED_IMAGES.is_dir() else ["(no photos)"])
def test_serve_bad_uploads_get_the_gunicorn_status(cluster, gunicorn, case):
    if not SHARED_IMAGES.is_dir():
        pytest.skip("the shared photos are absent")
    kwargs = _bad_requests()[case]
    ours = requests.post(cluster.url + "/api/v1/predict", timeout=60, **kwargs)
    reference = requests.post(gunicorn.url + "/api/v1/predict", timeout=60, **kwargs)
    assert ours.status_code == reference.status_code, (case, ours.text, reference.text)
    assert ours.json()["error"]["code"] == reference.json()["error"]["code"], case
    assert ours.json()["error"]["status"] == ours.status_code


@SERVE_TIER
def test_serve_other_routes(cluster, gunicorn):
    health = requests.get(cluster.url + "/healthz", timeout=10).json()
    assert health["ready"] is True and health["replica"] and health["ingress"]["replica"]
    assert health["intra_op_threads"] == 1 and health["self_test"]["passed"] is True
    ready = requests.get(cluster.url + "/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["model"]["name"] == "efficientnet_lite0"
    models = requests.get(cluster.url + "/api/v1/models", timeout=10).json()
    assert models == requests.get(gunicorn.url + "/api/v1/models", timeout=10).json()
    page = requests.get(cluster.url + "/", timeout=10)
    assert page.status_code == 200 and "EfficientNet-Lite0" in page.text
    # The page's form: the answer page with the labels, thumbnails carried back from the model replica.
    form = requests.post(cluster.url + "/", files={"file": ("dog.jpg", shared_image("dog.jpg").read_bytes())},
                         data={"topk": "3"}, timeout=60)
    assert form.status_code == 200 and "German shepherd" in form.text and "data:image/" in form.text
    assert requests.get(cluster.url + "/nowhere", timeout=10).status_code == 404


@SERVE_TIER
def test_two_replicas_both_serve(cluster):
    """Concurrent requests spread over both model replicas (X-Served-By names the one that answered)."""
    photos = _photos()
    data = {name: (SHARED_IMAGES / name).read_bytes() for name in photos}

    def one(i: int) -> tuple[str, str, str]:
        name = photos[i % len(photos)]
        resp = _post(cluster.url, f"{i}-{name}", data[name])
        assert resp.status_code == 200, resp.text
        return resp.headers["X-Served-By"], resp.json()["results"][0]["filename"], f"{i}-{name}"

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(24)))
    assert all(got == sent for _, got, sent in answers)  # each request got its own answer
    assert len({replica for replica, _, _ in answers}) == 2


@SERVE_TIER
def test_overload_answers_429_with_retry_after(cluster):
    """Past 2 replicas x 4 ongoing + 8 queued, requests get 429 + Retry-After; the others their own answer."""
    dog = shared_image("dog.jpg").read_bytes()

    def one(i: int) -> requests.Response:
        return _post_four(cluster.url, i, dog)

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(one, range(40)))
    statuses = sorted({r.status_code for r in answers})
    assert set(statuses) <= {200, 429}, [(r.status_code, r.text[:200]) for r in answers]
    refused = [r for r in answers if r.status_code == 429]
    assert refused and any(r.status_code == 200 for r in answers), statuses
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1
    assert any(r.headers.get("Content-Type", "").startswith("application/json")
               and r.json()["error"]["code"] == "overloaded" for r in refused)
    for i, r in enumerate(answers):
        if r.status_code == 200:
            assert [x["filename"] for x in r.json()["results"]] == _four_names(i)
    # ... and it serves again once the burst is over
    assert _post(cluster.url, "dog.jpg", dog).status_code == 200


@SERVE_TIER
def test_serve_takes_chunked_uploads_and_sends_one_request_id(cluster, gunicorn):
    dog = shared_image("dog.jpg").read_bytes()

    def chunked():
        for i in range(0, len(dog), 20_000):
            yield dog[i:i + 20_000]

    for url in (cluster.url, gunicorn.url):
        resp = requests.post(url + "/api/v1/predict", data=chunked(), timeout=60,
                             headers={"Content-Type": "image/jpeg", "X-Request-ID": "trace-42"})
        assert resp.status_code == 200, (url, resp.text)
        assert resp.raw.headers.getlist("X-Request-ID") == ["trace-42"], url
    from urllib3 import encode_multipart_formdata

    body, content_type = encode_multipart_formdata({"file": ("dog.jpg", dog, "image/jpeg")})
    form = requests.post(cluster.url + "/api/v1/predict", timeout=60, headers={"Content-Type": content_type},
                         data=(body[i:i + 30_000] for i in range(0, len(body), 30_000)))  # chunked multipart
    assert form.status_code == 200, form.text
    assert form.json()["results"][0]["filename"] == "dog.jpg"


@SERVE_TIER
def test_sigterm_answers_the_requests_in_flight(cluster):
    """Last of the module: SIGTERM while requests run; each gets its answer, then the command exits 0."""
    dog = shared_image("dog.jpg").read_bytes()

    def one(i: int) -> requests.Response:
        return _post_four(cluster.url, i, dog)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(0.4)
        assert not all(f.done() for f in futures), "the burst ended before SIGTERM: nothing in flight"
        cluster.proc.send_signal(signal.SIGTERM)
        answers = [f.result() for f in futures]
    assert [r.status_code for r in answers] == [200] * 8, [r.text[:200] for r in answers]
    for i, r in enumerate(answers):
        assert [x["filename"] for x in r.json()["results"]] == _four_names(i)
    assert cluster.proc.wait(120) == 0, cluster.log_path.read_text()[-4000:]
