"""Scale-out on a Ray cluster: Ray Serve replicas behind the same HTTP API, Ray Data for bulk folders.

The only package that imports Ray (``pip install -r requirements-cluster.txt``); one box with
gunicorn needs none of it. Everything a photo meets is the code gunicorn runs: the settings
table, start-up (``webapp/startup.py``: model, weights, precision, compile, warm-up, self-test),
decode and preprocess (``imaging.prepare``), the engine and the answer (``answers.answer``); only
who forms the batches changes.

Ray Serve (``deploy.build_app``; ``python -m webapp serve --cluster``, or ``serve run/deploy`` with
deploy/ray-serve.yaml, whose ``import_path`` is ``webapp.cluster:build_app``)::

    Ray's HTTP proxy (one per node)
      -> HTTP replicas   ingress.py: the Flask app of create_app(), run by a2wsgi: same routes,
                         forms, JSON, errors, token, page; its classifier is a RemoteClassifier
      -> model replicas  replica.py: startup.load_engine + self-test, decode on real threads,
                         @serve.batch(max_batch_size, batch_wait_timeout_s)

Each model replica reserves ``num_cpus`` = its intra-op threads, so Ray places replicas on free
cores across nodes. Back-pressure: a model replica takes ``CLUSTER_MAX_ONGOING_REQUESTS``; past
those, each HTTP replica queues ``CLUSTER_MAX_QUEUED_REQUESTS`` and refuses more with the
gunicorn app's 429 + ``Retry-After`` (the proxy does the same in front of the HTTP replicas).

Ray Data (``bulk.classify_to_parquet``; ``python -m webapp classify --cluster SRC --out DEST.parquet``).

``serve --cluster`` stops by a deadline however its SIGTERM arrives, with the Ray it started shut down
and nothing left running (``stopping``; the foreground process is ``webapp/cli/supervise.py``).

Modules: ``config`` (the replicas' settings), ``replica``, ``ingress``, ``deploy``, ``stopping``, ``bulk``.
"""

from .bulk import BulkClassifier, classify_to_parquet, parquet_schema, ray_output_in
from .config import replica_settings, startup_failure
from .deploy import APP_NAME, application, build_app, connect, serve_forever
from .ingress import Ingress, RemoteClassifier, behind_ray_proxy
from .replica import ModelReplica

__all__ = ["APP_NAME", "BulkClassifier", "Ingress", "ModelReplica", "RemoteClassifier", "application",
           "behind_ray_proxy", "build_app", "classify_to_parquet", "connect", "parquet_schema", "ray_output_in",
           "replica_settings", "serve_forever", "startup_failure"]
