"""The error table (webapp/errors.py) is the one home of each error's status, code and words:
the handler, the README, OpenAPI, the page and the Ray path all take it from there."""

import pytest

from webapp import errors, i18n, openapi


def test_codes_are_unique_and_statuses_are_errors():
    codes = [cls.code for cls in errors.ERRORS]
    assert len(codes) == len(set(codes))
    for cls in errors.ERRORS:
        assert 400 <= cls.status < 600 and cls.when and cls.__doc__.startswith(f"{cls.status} ``{cls.code}``")


def test_every_code_has_words_in_every_language():
    for lang in i18n.LANGS:
        words = i18n.STRINGS[lang]
        for cls in errors.ERRORS:
            if cls.status == 500:  # both say "something went wrong" (err_other)
                continue
            assert f"err_{cls.code}" in words, (lang, cls.code)
            if cls.retryable:
                assert "{n}" in words[f"err_{cls.code}"] and f"err_{cls.code}_later" in words, (lang, cls.code)


def test_retryable_codes_reach_the_page():
    import json

    assert errors.RETRYABLE == ("overloaded", "rate_limited", "not_ready")
    for lang in i18n.LANGS:
        assert json.loads(i18n.bundle(lang)[0])["retryable"] == list(errors.RETRYABLE)


def test_openapi_errors_are_the_table_by_status():
    by_status = {}
    for cls in errors.ERRORS:
        by_status.setdefault(cls.status, []).append(cls.code)
    assert {s: list(codes) for s, (codes, _) in openapi.ERRORS.items()} == by_status


@pytest.mark.parametrize("cls", errors.ERRORS, ids=lambda c: c.code)
def test_from_dict_rebuilds_the_same_class(cls):
    exc = cls("message for people", headers={"Retry-After": "3"})
    again = errors.from_dict(exc.to_dict()["error"], exc.headers)
    assert type(again) is cls and again.status == cls.status and again.message == "message for people"
    assert again.headers == exc.headers and exc.headers["Retry-After"] == "3"  # a 401 adds its WWW-Authenticate


def test_unknown_code_from_a_replica_is_a_plain_500():
    again = errors.from_dict({"code": "brand_new", "message": "m"})
    assert type(again) is errors.ServiceError and again.status == 500


def test_message_templates():
    assert errors.TooLarge.body(33554432).message == \
        ("the upload is larger than 33,554,432 bytes (CLASSIFIER_MAX_UPLOAD_BYTES): send fewer photos per request, "
         "or smaller ones (scaled down: the model looks at far fewer pixels than a phone photo has)")
    assert errors.TooLarge.body(33554432, 40_000_000).message.startswith(
        "the upload is 40,000,000 bytes; the limit is 33,554,432 (CLASSIFIER_MAX_UPLOAD_BYTES): send fewer")
    assert errors.TooLarge.file(40_000_000, 33554432).message == \
        "the file is 40,000,000 bytes; the limit is 33,554,432 (CLASSIFIER_MAX_UPLOAD_BYTES)"
    assert errors.InferenceTimeout.after(2.5, "cluster").message == \
        "no result within 2.5 s (CLASSIFIER_REQUEST_TIMEOUT_S); the cluster is overloaded, try again later"
    # a timeout under a second fails requests on an idle server too: not only "overloaded" (tryout34)
    assert errors.InferenceTimeout.after(0.01).message == (
        "no result within 0.01 s (CLASSIFIER_REQUEST_TIMEOUT_S); the server is overloaded, try again later (under a "
        "second, one photo's own work may take longer: its operator can raise it)")
    errors.check_file_size(10, 10)
    with pytest.raises(errors.TooLarge, match="the file is 11 bytes; the limit is 10"):
        errors.check_file_size(11, 10)


@pytest.mark.parametrize("path, method, status, code", [
    ("/no/such/route", "get", 404, "not_found"),
    ("/api/v1/predict", "get", 405, "method_not_allowed"),
])
def test_werkzeug_errors_are_rendered_by_their_row(client, path, method, status, code):
    resp = getattr(client, method)(path, headers={"Accept": "application/json"})
    assert resp.status_code == status and resp.get_json()["error"] == {
        "code": code, "message": resp.get_json()["error"]["message"], "status": status}


def test_the_table_ends_with_the_code_every_other_http_error_gets(client, app):
    """``http_error`` is the table's last row (status "other") and a code the OpenAPI document allows; the
    app's one handler gives it, with the real status, to a Werkzeug error that has no row (here a 416 for
    a byte range past the end of a static file)."""
    last = errors.markdown_table().splitlines()[-1]
    assert last.startswith(f"| other | `{errors.OTHER_HTTP_CODE}` | any other HTTP error")
    enum = client.get("/openapi.json").get_json()["components"]["schemas"]["Error"]["properties"]["error"][
        "properties"]["code"]["enum"]
    assert errors.OTHER_HTTP_CODE in enum
    resp = client.get("/static/favicon.svg", headers={"Range": "bytes=99999999-", "Accept": "application/json"})
    assert resp.status_code == 416
    assert resp.get_json()["error"]["code"] == errors.OTHER_HTTP_CODE and resp.get_json()["error"]["status"] == 416


def test_every_api_route_answers_a_wrong_method_with_json(client, app):
    """Only the page's routes (``/``, its assets) answer errors with the HTML page; every other route,
    ``/openapi.json`` included, answers a wrong method with the JSON 405 whatever the client accepts."""
    page = ("ui.", "static")
    api = {r.rule for r in app.url_map.iter_rules() if not r.endpoint.startswith(page) and "<" not in r.rule}
    assert {"/openapi.json", "/healthz", "/readyz", "/metrics", "/api/v1/models", "/api/v1/predict"} <= api
    for path in sorted(api):
        for method in ("put", "delete", "patch") + (() if path.endswith("predict") else ("post",)):
            resp = getattr(client, method)(path, headers={"Accept": "text/html,*/*;q=0.8"})
            assert (resp.status_code, resp.mimetype) == (405, "application/json"), (method, path)
            body = resp.get_json()
            error = body["error"] if isinstance(body["error"], dict) else {"code": body["error"].split(":")[0]}
            assert error["code"] == "method_not_allowed" and resp.headers["Allow"], (method, path)
    resp = client.put("/", headers={"Accept": "text/html"})
    assert (resp.status_code, resp.mimetype) == (405, "text/html")


def test_the_servers_own_failures_are_logged_with_their_reason(client, app, monkeypatch, caplog):
    """The access log has a status only: a 504 (past REQUEST_TIMEOUT_S) was written nowhere else (tryout14). The
    server's own failures get a warning with code and words; a client's error a debug line (LOG_LEVEL=debug)."""
    import io
    import logging

    from PIL import Image

    photo = io.BytesIO()
    Image.new("RGB", (32, 32), "white").save(photo, "PNG")
    classifier = app.extensions["classifier"]

    def late(*args, **kwargs):
        raise errors.InferenceTimeout("no result within 0.1 s (CLASSIFIER_REQUEST_TIMEOUT_S)")

    monkeypatch.setattr(classifier, "classify", late)
    with caplog.at_level(logging.DEBUG, logger=app.logger.name):
        assert client.post("/api/v1/predict", data=photo.getvalue(), content_type="image/png").status_code == 504
        assert client.post("/api/v1/predict").status_code == 400
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith("POST /api/v1/predict: 504 timeout: no result within 0.1 s")
    assert any(r.levelno == logging.DEBUG and ": 400 no_file: " in r.getMessage() for r in caplog.records)


def test_a_probe_path_with_a_trailing_slash_gets_json_not_the_page(client):
    """``/healthz/``, ``/readyz/``, ``/metrics/``: a probe or scrape with a slip got the page's HTML 404 (tryout18)."""
    for path in ("/healthz/", "/readyz/", "/metrics/", "/openapi.json/"):
        resp = client.get(path, headers={"Accept": "*/*"})
        assert resp.status_code == 404 and resp.mimetype == "application/json", (path, resp.mimetype)
        assert resp.get_json()["error"]["code"] == "not_found"
    assert client.get("/no-such-page", headers={"Accept": "text/html"}).mimetype == "text/html"  # a page: a page
