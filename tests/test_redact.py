"""redact: credential-like query parameters hidden in access lines (a token sent in the URL, tryout28)."""

import pytest

from webapp.redact import HIDDEN, hide_query_secrets, hide_uri_secrets


@pytest.mark.parametrize("query, logged", [
    ("topk=5&token=abc", f"topk=5&token={HIDDEN}"),
    ("access_token=abc&topk=5", f"access_token={HIDDEN}&topk=5"),
    ("API_KEY=abc;x=1", f"API_KEY={HIDDEN};x=1"),
    ("password=p&secret=s&auth=a&sig=z", f"password={HIDDEN}&secret={HIDDEN}&auth={HIDDEN}&sig={HIDDEN}"),
    ("topk=5&original_width=10", "topk=5&original_width=10"),  # nothing secret: as it was
    ("token=", "token="), ("token", "token"), ("", ""),  # no value: nothing to hide
    ("a=1&&token=x=y", f"a=1&&token={HIDDEN}"),
])
def test_a_credential_in_the_query_is_hidden_and_nothing_else_changes(query, logged):
    assert hide_query_secrets(query) == logged


def test_request_lines_and_targets():
    assert hide_uri_secrets("GET /api/v1/predict?key=k&topk=2 HTTP/1.1") == \
        f"GET /api/v1/predict?key={HIDDEN}&topk=2 HTTP/1.1"
    assert hide_uri_secrets("/healthz?token=t") == f"/healthz?token={HIDDEN}"
    assert hide_uri_secrets("GET /healthz HTTP/1.1") == "GET /healthz HTTP/1.1"
