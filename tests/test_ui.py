"""The upload page: a plain form that works without JavaScript, results rendered into the page."""

import io
import re

from PIL import Image

from conftest import png_bytes, shared_image


def test_index_has_a_plain_form(client):
    resp = client.get("/")
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    assert re.search(r'<form method="post" action="/" enctype="multipart/form-data">', html)
    assert 'type="file"' in html and 'name="file"' in html and 'accept="image/*"' in html
    assert '<label for="file">' in html and "<script" not in html  # no JavaScript needed
    assert "untrained" in html  # the seeded model is marked on the page


def test_security_headers(client):
    resp = client.get("/")
    assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
    assert resp.headers["X-Content-Type-Options"] == "nosniff" and resp.headers["X-Frame-Options"] == "DENY"


def test_upload_shows_top3_with_percentages(offline_client):
    data = shared_image("dog.jpg").read_bytes()
    resp = offline_client.post("/", data={"file": (io.BytesIO(data), "dog.jpg")})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200
    labels = re.findall(r'<span class="label">([^<]+)</span>', html)
    pcts = re.findall(r'<span class="pct">([\d.]+)%</span>', html)
    assert len(labels) == 3 and len(pcts) == 3
    assert "German shepherd" in labels
    assert 'src="data:image/jpeg;base64,' in html and 'alt="Uploaded photo dog.jpg"' in html


def test_filename_is_escaped_never_a_path(client):
    name = '<script>alert(1)</script>../../étoile🐶.png'
    resp = client.post("/", data={"file": (io.BytesIO(png_bytes(Image.new("RGB", (32, 32)))), name)})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;../../étoile🐶.png" in html


def test_errors_are_shown_in_words_on_the_page(client):
    resp = client.post("/", data={"file": (io.BytesIO(b"not a photo"), "notes.txt")})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 415 and resp.mimetype == "text/html"
    assert 'role="alert"' in html and "not an image format" in html
    resp = client.post("/", data={"file": (io.BytesIO(b""), "")})
    assert resp.status_code == 400 and "choose a photo" in resp.get_data(as_text=True)


def test_static_css_is_served(client):
    resp = client.get("/static/style.css")
    assert resp.status_code == 200 and "text/css" in resp.content_type
