"""Optional API token, optional rate limit, and no debugger under gunicorn."""

import io
import re

import pytest
from PIL import Image

from conftest import png_bytes
from webapp import GUNICORN_ENV
from webapp.access import LIMITER_RETRY_AFTER, check_token
from webapp.errors import NotReady, Overloaded, Unauthorized
from webapp.settings import SettingsError

PNG = png_bytes(Image.new("RGB", (32, 32), (10, 120, 200)))


@pytest.fixture(scope="module")
def guarded(make_module_app):
    return make_module_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN="s3cret-token",
                           RATE_LIMIT="4/minute")


def post(client, **headers):
    return client.post("/api/v1/predict", data=PNG, content_type="image/png", headers=headers)


def test_check_token():
    assert check_token("Bearer abc", "abc") and check_token("bearer abc ", "abc")
    assert not check_token("Bearer abd", "abc") and not check_token("abc", "abc") and not check_token(None, "abc")
    assert not check_token("Basic abc", "abc")


def test_token_is_required_for_the_api_only(guarded):
    client = guarded.test_client()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
        resp = post(client, **headers)
        assert resp.status_code == 401 and resp.get_json()["error"]["code"] == "unauthorized"
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
    assert client.get("/").status_code == 200


def test_a_missing_token_and_a_wrong_one_are_told_apart(guarded):
    client = guarded.test_client()
    for headers in ({}, {"Authorization": "s3cret-token"}, {"Authorization": "Bearer "}):
        resp = post(client, **headers)
        assert resp.get_json()["error"]["message"] == "this API needs a token: send 'Authorization: Bearer <token>'"
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="classifier"'
    resp = post(client, Authorization="Bearer wrong")
    assert resp.status_code == 401 and resp.get_json()["error"]["message"] == (
        "this API needs a token, and the bearer token sent is not this server's: send 'Authorization: Bearer <token>' "
        "with the right one")
    assert resp.headers["WWW-Authenticate"] == 'Bearer realm="classifier", error="invalid_token"'


def test_every_401_says_how_to_authenticate(make_app):
    """RFC 9110 15.5.2: a 401 carries WWW-Authenticate; a tryout found one without it. Every route a token guards
    (the API, /v2 infer, /metrics with its own token), missing or wrong, and any Unauthorized raised anywhere."""
    assert Unauthorized("no").headers["WWW-Authenticate"] == 'Bearer realm="classifier"'
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN="api-token",
                      METRICS_TOKEN="prom-token").test_client()
    infer = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic eDp5"}, {"Authorization": ""}):
        for resp in (post(client, **headers), client.post("/v2/models/classifier/infer", json=infer, headers=headers),
                     client.get("/metrics", headers=headers)):
            assert resp.status_code == 401
            assert resp.headers["WWW-Authenticate"].startswith('Bearer realm="classifier"'), resp.request.path
    doc = client.get("/openapi.json").get_json()
    challenges = [response["headers"]["WWW-Authenticate"] for name, response in doc["components"]["responses"].items()
                  if name.endswith("E401")]
    assert len(challenges) == 2 and all(c["required"] and "realm" in c["description"] for c in challenges)
    refs = [op["responses"]["401"]["$ref"] for path in doc["paths"].values() for op in path.values()
            if isinstance(op, dict) and "401" in op.get("responses", {})]
    assert len(refs) >= 3 and all(ref.endswith("E401") for ref in refs)  # predict, /v2 infer, /metrics


def test_the_page_and_the_api_share_one_budget_per_client(make_app):
    """CLASSIFIER_RATE_LIMIT is one budget per client address, whichever way it classifies."""
    import io

    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="3/minute")
    client = app.test_client()

    def page():
        return client.post("/", data={"file": (io.BytesIO(PNG), "a.png")}).status_code

    statuses = [page(), post(client).status_code, page(), post(client).status_code, page()]
    assert statuses == [200, 200, 200, 429, 429]


def test_requests_arriving_together_count_against_the_rate_limit(make_app, monkeypatch):
    """The limit is counted after each answer: a client's requests that arrived together were all let in (20 at
    once against 6/minute: all 200, tryout33). Those still in progress count now: 8 at once against 3/minute, 3
    answered and 5 refused as the limiter refuses, with Retry-After; and once they are answered, the budget spent."""
    import threading
    import time

    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="3/minute")
    clf = app.extensions["classifier"]
    real = clf.classify
    monkeypatch.setattr(clf, "classify", lambda *a, **k: (time.sleep(0.5), real(*a, **k))[1])  # all overlap
    gate, out = threading.Barrier(8), []

    def one():
        gate.wait(10)
        resp = post(app.test_client())
        out.append((resp.status_code, resp.get_json(), resp.headers.get("Retry-After")))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(status for status, _, _ in out) == [200] * 3 + [429] * 5, [status for status, _, _ in out]
    for status, body, wait in out:
        if status == 429:
            assert body["error"]["code"] == "rate_limited" and "3 per 1 minute" in body["error"]["message"], body
            assert int(wait) >= 1
    assert post(app.test_client()).status_code == 429  # the three answered spent the minute's budget


def test_rate_limit_answers_429_with_retry_after(guarded):
    client = guarded.test_client()
    statuses = [post(client, Authorization="Bearer s3cret-token").status_code for _ in range(6)]
    assert statuses[:4] == [200] * 4 and statuses[4:] == [429, 429]
    resp = post(client, Authorization="Bearer s3cret-token")
    body = resp.get_json()["error"]
    assert body["code"] == "rate_limited" and body["status"] == 429 and "4 per 1 minute" in body["message"]
    assert int(resp.headers["Retry-After"]) >= 1
    assert client.get("/healthz").status_code == 200  # probes are never limited


def test_a_rate_limited_refusal_says_when_in_its_words_header_and_page(make_app):
    """The limiter writes its Retry-After after the answer is made; the JSON message and the page (drawn
    before that) said "try again later" / "in a minute". Now all three give the same seconds."""
    import io

    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="2/minute").test_client()
    assert [post(client).status_code for _ in range(2)] == [200, 200]
    refused = post(client)
    wait = int(refused.headers["Retry-After"])
    assert 1 <= wait <= 60
    assert re.search(rf"try again in {wait} s$", refused.get_json()["error"]["message"]), refused.get_json()
    page = client.post("/", data={"file": (io.BytesIO(PNG), "a.png")}, headers={"Accept": "text/html"})
    assert page.status_code == 429 and 1 <= int(page.headers["Retry-After"]) <= 60
    text = re.sub(r"<script.*?</script>", "", page.get_data(as_text=True), flags=re.S)  # the page's words for its script
    assert f"try again in {page.headers['Retry-After']} s" in text and "try again in a minute" not in text


def test_retry_after_is_never_zero(make_app):
    """Flask-Limiter can round the wait to the window's reset down to 0; clients must be told >= 1 s."""
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="4/minute")
    app.add_url_rule("/_zero", "zero", lambda: ("", 429, {LIMITER_RETRY_AFTER: "0"}))  # as the limiter writes it
    resp = app.test_client().get("/_zero")
    assert resp.headers["Retry-After"] == "1" and LIMITER_RETRY_AFTER not in resp.headers


def test_retry_after_is_on_refusals_only(make_app):
    """With a rate limit, Flask-Limiter put Retry-After on every answer of a classify route, a 200 too; only
    its 429 takes it now. The X-RateLimit-* headers (in the OpenAPI document's 200) stay on every answer."""
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="3/minute").test_client()
    answers = [post(client), client.post("/api/v1/predict"), post(client)]
    assert [resp.status_code for resp in answers] == [200, 400, 200]
    for left, resp in zip((2, 1, 0), answers):
        assert "Retry-After" not in resp.headers and LIMITER_RETRY_AFTER not in resp.headers
        assert resp.headers["X-RateLimit-Limit"] == "3" and resp.headers["X-RateLimit-Remaining"] == str(left)
    refused = post(client)
    assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "rate_limited"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60 and LIMITER_RETRY_AFTER not in refused.headers


@pytest.mark.parametrize("error", [Overloaded("busy", headers={"Retry-After": "2"}),
                                   NotReady("starting", headers={"Retry-After": "5"})])
def test_a_refusal_keeps_its_own_retry_after_under_a_rate_limit(make_app, monkeypatch, error):
    """Flask-Limiter raised a 429 overloaded's or a 503's Retry-After to its window's reset (~60 s here)."""
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="3/minute")

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(app.extensions["classifier"], "admit", refuse)
    resp = post(app.test_client())
    assert resp.status_code == error.status and resp.headers["Retry-After"] == error.headers["Retry-After"]


def test_the_servers_own_refusals_cost_no_rate_limit_budget(make_app, monkeypatch):
    """A client told 429 overloaded or 503 not ready, and coming back after Retry-After as told, had spent its budget
    on them and was then refused rate_limited (tryout18). They cost none of it; its own bad requests still do."""
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="2/minute")
    clf, client = app.extensions["classifier"], app.test_client()
    admit, refusals = clf.admit, [Overloaded("busy", headers={"Retry-After": "1"}),
                                  NotReady("starting", headers={"Retry-After": "1"})] * 2

    def refuse_first(*args, **kwargs):
        if refusals:
            raise refusals.pop()
        return admit(*args, **kwargs)

    monkeypatch.setattr(clf, "admit", refuse_first)
    assert [post(client).status_code for _ in range(4)] == [503, 429, 503, 429]
    assert [post(client).status_code for _ in range(2)] == [200, 200]
    limited = post(client)
    assert limited.status_code == 429 and limited.get_json()["error"]["code"] == "rate_limited"
    other = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="2/minute").test_client()
    assert [other.post("/api/v1/predict", data=b"junk", content_type="image/png").status_code
            for _ in range(3)] == [415, 415, 429]  # a bad upload still counts


def test_bad_rate_limit_is_a_settings_error(make_app):
    with pytest.raises(SettingsError, match="^RATE_LIMIT='lots' is not valid; allowed: "):  # a config key: its name
        make_app(MODEL="resnet18_seeded", COMPILE=False, RATE_LIMIT="lots")


def test_debug_is_never_on_under_gunicorn(monkeypatch, make_app):
    monkeypatch.setenv("FLASK_DEBUG", "1")
    monkeypatch.setenv(GUNICORN_ENV, "1")  # as gunicorn.conf.py sets it; the model is then started by its hook
    app = make_app(MODEL="resnet18_seeded", COMPILE=False)
    assert app.debug is False


def test_metrics_needs_the_api_token_when_one_is_set(guarded):
    client = guarded.test_client()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = client.get("/metrics", headers=headers)
        assert resp.status_code == 401 and resp.get_json()["error"]["code"] == "unauthorized"
        assert "/metrics needs a token" in resp.get_json()["error"]["message"]
    assert client.get("/metrics", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200


@pytest.mark.parametrize("api_token", ["", "api-token"])
def test_metrics_token_is_its_own_when_set(make_app, api_token):
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN=api_token,
                      METRICS_TOKEN="prom-token").test_client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer api-token"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer prom-token"}).status_code == 200
    assert (post(client).status_code == 401) == bool(api_token)  # the metrics token guards /metrics only


def test_a_request_without_the_token_counts_against_no_rate_limit_budget(make_app):
    """As the README says: the token is checked first, a 401 has no X-RateLimit-* headers and spends nothing."""
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN="api-token",
                      RATE_LIMIT="2/minute").test_client()
    for _ in range(3):
        resp = post(client)
        assert resp.status_code == 401 and "X-RateLimit-Remaining" not in resp.headers
    resp = post(client, Authorization="Bearer api-token")
    assert resp.status_code == 200 and resp.headers["X-RateLimit-Remaining"] == "1", resp.headers


def test_metrics_stays_open_without_any_token(make_app):
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1).test_client()
    assert client.get("/metrics").status_code == 200


@pytest.mark.server
def test_metrics_token_over_gunicorn(tmp_path):
    import requests

    from serving import Server

    srv = Server(tmp_path / "server.log", args=("--no-control-socket",), MODEL="resnet18_seeded", COMPILE=0,
                 WORKERS=1, THREADS=1, MAX_BATCH_SIZE=1, API_TOKEN="api-token", METRICS_TOKEN="prom-token")
    try:
        srv.wait_ready(workers=1)
        assert requests.get(srv.url + "/metrics", timeout=10).status_code == 401
        ok = requests.get(srv.url + "/metrics", headers={"Authorization": "Bearer prom-token"}, timeout=10)
        assert ok.status_code == 200 and "classifier_worker_ready" in ok.text
    finally:
        assert srv.stop() == 0, srv.output()[-2000:]


@pytest.mark.parametrize("proxies", [0, 1, 2])
def test_the_rate_limit_counts_the_client_a_trusted_proxy_names(make_app, proxies):
    """Behind TRUSTED_PROXIES reverse proxies, each client behind them has its own budget (without the setting
    every client of an nginx shared the nginx's one); with 0, X-Forwarded-For is the client's own words and is
    ignored, so a client cannot get a fresh budget by sending a new one each time."""
    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, RATE_LIMIT="2/minute",
                   TRUSTED_PROXIES=proxies)
    client = app.test_client()

    def post_as(addr):  # each proxy appends the address it was reached from: the outermost one, the client's
        chain = ["198.51.100.9", addr] + [f"10.0.0.{i}" for i in range(2, proxies + 1)]  # after what it sent
        return client.post("/api/v1/predict", data=PNG, content_type="image/png",
                           environ_overrides={"REMOTE_ADDR": "10.0.0.1"},  # the innermost proxy (or the client)
                           headers={"X-Forwarded-For": ", ".join(chain if proxies else [addr])}).status_code

    statuses = [post_as("203.0.113.5"), post_as("203.0.113.5"), post_as("203.0.113.5"), post_as("203.0.113.6")]
    assert statuses == ([200, 200, 429, 200] if proxies else [200, 200, 429, 429])


@pytest.mark.server
def test_behind_a_trusted_proxy_the_access_logs_show_the_client(tmp_path):
    """gunicorn's text access line shows the address the proxy names (it showed the proxy's): ProxyFix changes the
    request's environ, which gunicorn's line is made from. (The JSON line: tests/test_proxy.py, behind nginx.)"""
    import requests

    from serving import Server

    srv = Server(tmp_path / "text.log", args=("--no-control-socket",), MODEL="resnet18_seeded", COMPILE=0,
                 WORKERS=1, THREADS=1, MAX_BATCH_SIZE=1, TRUSTED_PROXIES=1, ACCESS_LOG="text")
    try:
        srv.wait_ready(workers=1)
        resp = requests.post(srv.url + "/api/v1/predict", data=PNG, timeout=30, headers={
            "Content-Type": "image/png", "X-Forwarded-For": "198.51.100.9, 203.0.113.5", "X-Request-ID": "via-1"})
        assert resp.status_code == 200, resp.text
    finally:
        assert srv.stop() == 0, srv.output()[-2000:]
    line = next(ln for ln in srv.output().splitlines() if "via-1" in ln)
    assert line.split()[0] == "203.0.113.5", line


def test_page_login_asks_for_the_token_as_basic_auths_password(make_app):
    """With an API token the page's own POST / classified for anyone who could open the page (tryout18). With
    PAGE_LOGIN the page asks for the token (HTTP Basic, any user name: a browser's login dialog) and takes it on
    its requests after; the static files, the probes and the API's own Bearer rule are as they were."""
    import base64

    token = "s3cret-token-value"
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, API_TOKEN=token,
                      PAGE_LOGIN=True).test_client()

    def basic(user, password):
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}

    refused = client.get("/", headers={"Accept": "text/html"})
    assert refused.status_code == 401 and refused.mimetype == "text/html"
    # no upload form that looks as if it worked, under "Could not classify that": how to sign in (tryout29)
    html = refused.get_data(as_text=True)
    assert "Sign-in needed" in html and "reload the page and give the token as the password" in html
    assert re.search(r"<form [^>]*enctype=\"multipart/form-data\" hidden>", html) and ">Could not classify that</h2>" not in html
    assert "需要登录" in client.get("/?lang=zh", headers=basic("x", "wrong")).get_data(as_text=True)
    assert refused.headers["WWW-Authenticate"] == 'Basic realm="classifier", charset="UTF-8"'
    assert client.get("/", headers=basic("anyone", "wrong")).status_code == 401
    assert client.get("/", headers={"Authorization": "Basic !!not-base64"}).status_code == 401
    assert client.get("/", headers=basic("anyone", token)).status_code == 200
    assert client.get("/", headers=basic("", token)).status_code == 200
    assert client.get("/", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    photo = {"file": (io.BytesIO(PNG), "a.png")}
    assert client.post("/", data=photo, headers={"Accept": "application/json"}).status_code == 401
    ok = client.post("/", data={"file": (io.BytesIO(PNG), "a.png")},
                     headers={"Accept": "application/json", **basic("x", token)})
    assert ok.status_code == 200 and ok.get_json()["results"][0]["predictions"]
    assert client.get("/static/app.js").status_code == 200 and client.get("/healthz").status_code == 200
    assert post(client, **basic("x", token)).status_code == 401  # the API: its Bearer token, as before
    assert post(client, Authorization=f"Bearer {token}").status_code == 200


def test_page_login_without_a_token_is_a_configuration_error(make_app):
    with pytest.raises(SettingsError, match="PAGE_LOGIN needs CLASSIFIER_API_TOKEN: the page asks for that token"):
        make_app(MODEL="resnet18_seeded", COMPILE=False, PAGE_LOGIN=True)
