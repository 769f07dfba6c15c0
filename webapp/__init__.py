"""A fast CPU image-classification service: Flask UI + JSON API over a compiled CNN.

``create_app()`` is the only entry point; importing this package does no work (no torch, no
model, no thread), so gunicorn's master can import it safely before forking.
"""

from __future__ import annotations

import logging
import os

from flask import Flask, g, request

from . import settings as settings_mod
from .settings import GUNICORN_ENV

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def create_app(config: dict | None = None, *, classifier=None) -> Flask:
    """Build the Flask app and its classifier from the settings table (env vars, then ``config``).

    ``config`` takes setting names without the prefix (``{"MODEL": "resnet18_seeded"}``). Outside
    gunicorn's config the model is loaded, compiled and warmed up here, before returning;
    under it, in each worker's ``post_worker_init``. A ``classifier`` given is used as it is and
    not started: the Ray Serve HTTP replica passes one that forwards to model replicas
    (webapp/cluster/).

    :raises SettingsError: a bad setting (the message names it, its value and what is allowed).
    :raises StartupError: the model cannot be served (no weights with fallback off, bad file,
        failed self-test).
    """
    from .bodies import guard_bodies
    from .errors import init_errors
    from .service import Classifier

    settings = settings_mod.load(overrides=config)
    log = logging.getLogger("webapp")
    log.setLevel(settings.LOG_LEVEL.upper())
    if not log.handlers and not os.environ.get(GUNICORN_ENV):  # gunicorn.conf.py routes it to gunicorn's log
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"))
        log.addHandler(handler)
    from .uploads import UploadRequest, lenient_multipart_headers

    lenient_multipart_headers()

    app = Flask(__name__, template_folder="../templates", static_folder="../static")
    # Werkzeug answers "/api/v1//predict" with a 308 HTML redirect to the merged path, built from the Host header,
    # documented nowhere (tryout24): a path that is not a route is a 404 in the API's shape, like any other.
    app.url_map.merge_slashes = False
    app.request_class = UploadRequest
    app.config["MAX_CONTENT_LENGTH"] = settings.MAX_UPLOAD_BYTES
    app.config["MAX_FORM_MEMORY_SIZE"] = settings.MAX_UPLOAD_BYTES
    app.extensions["settings"] = settings
    own_classifier = classifier is None
    if own_classifier:
        classifier = Classifier(settings)
        # A request admitted by time that ends before its photos are decoded stops counting as work
        # ahead of the others (webapp/admission.py).
        app.teardown_request(lambda exc: classifier.end_request())
    app.extensions["classifier"] = classifier

    from . import api, ui, v2
    from .access import init_access
    from .logs import init_logs
    from .metrics import init_metrics
    from .v2_codec import body_limit

    app.register_blueprint(api.bp)
    app.register_blueprint(ui.bp)
    app.register_blueprint(v2.bp)  # the Open Inference Protocol (KServe v2) over the same classifier
    init_access(app, settings)
    init_logs(app, settings)  # request ids (X-Request-ID) and the JSON access log
    init_metrics(app, settings)  # GET /metrics, if METRICS is on
    init_errors(app, settings)  # one handler: JSON for the API, the page for the UI
    # Under gunicorn: refusals answered before the body, an idle timeout on bodies, drains after answers.
    app.wsgi_app = guard_bodies(app.wsgi_app, idle_s=settings.BODY_TIMEOUT_S, max_bytes=settings.MAX_UPLOAD_BYTES,
                                largest_body=body_limit(settings.MAX_UPLOAD_BYTES))  # /v2's: base64
    if settings.TRUSTED_PROXIES:  # Werkzeug's ProxyFix: REMOTE_ADDR (which gunicorn's access log shows too), scheme
        from werkzeug.middleware.proxy_fix import ProxyFix  # and host from the headers the last n proxies appended

        n = settings.TRUSTED_PROXIES
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=n, x_proto=n, x_host=n)
    if os.environ.get(GUNICORN_ENV):
        app.debug = False  # never the interactive debugger in a served app, whatever FLASK_DEBUG says

    @app.after_request
    def security_headers(resp):
        for name, value in SECURITY_HEADERS.items():
            resp.headers.setdefault(name, value)
        served_by = g.get("served_by")  # on a Ray cluster: the model replica that answered
        if served_by:
            resp.headers["X-Served-By"] = served_by
        # Flask answers OPTIONS itself with 200 and an empty text/html body; RFC 9110 9.3.7: what there is
        # to say is in Allow, so no content and no Content-Type.
        if request.method == "OPTIONS" and resp.status_code == 200 and "Allow" in resp.headers \
                and not resp.content_length:
            resp.status_code = 204
            del resp.headers["Content-Type"]
        return resp

    if own_classifier and not os.environ.get(GUNICORN_ENV):
        classifier.start()
    return app
