"""The upload page: a plain form that works without JavaScript, results rendered into the page,
in English or Simplified Chinese (``?lang=``, the ``lang`` cookie, ``Accept-Language``)."""

import io
import json
import re

import pytest
from PIL import Image

from conftest import png_bytes, shared_image
from webapp.errors import Overloaded


def test_index_has_a_plain_form(client):
    resp = client.get("/")
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and resp.mimetype == "text/html"
    assert re.search(r'<form method="post" action="/" enctype="multipart/form-data">', html)
    assert 'type="file"' in html and 'name="file"' in html and 'accept="image/*"' in html
    assert re.search(r'<label for="file"[^>]*>', html) and re.search(r'<button type="submit"[^>]*>Classify</button>', html)
    # A phone can take a photo straight from the camera; the multiple picker stays a picker.
    assert re.search(r'<input id="camera" name="file" type="file" accept="image/\*" capture="environment">', html)
    assert not re.search(r'<input id="file"[^>]*capture', html) and re.search(r'<input id="file"[^>]*multiple', html)
    # JavaScript only enhances the page: one external module, no inline script, no inline style; its words
    # ride along as a JSON data block, which is never run (and so needs nothing from the CSP).
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", html, flags=re.S)
    assert [a for a, body in scripts if body] == [' type="application/json" id="words"']
    assert '<script type="module" src="/static/app.js"></script>' in html
    words = json.loads(re.search(r'<script type="application/json" id="words">(.*?)</script>', html, re.S).group(1))
    assert words["lang"] == "en" and words["strings"]["pending"] and "labels" not in words
    assert not re.search(r"<[^>]+\s(style|on[a-z]+)=", html)  # no inline style or event handler (CSP)
    assert "untrained" in html  # the seeded model is marked on the page
    assert '<html lang="en"' in html and '<p id="status" class="status" role="status">' in html
    assert "aria-live" not in html  # the status line (role=status) is the one live region, not the cards


def test_security_headers(client):
    resp = client.get("/")
    assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
    assert resp.headers["X-Content-Type-Options"] == "nosniff" and resp.headers["X-Frame-Options"] == "DENY"


def test_upload_shows_top3_with_percentages(offline_client):
    data = shared_image("dog.jpg").read_bytes()
    resp = offline_client.post("/", data={"file": (io.BytesIO(data), "dog.jpg")}, headers={"Accept-Language": "en"})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200
    labels = re.findall(r'<span class="label">([^<]+)</span>', html)
    pcts = re.findall(r'<span class="pct">([\d.]+)%</span>', html)
    assert len(labels) == 3 and len(pcts) == 3
    assert "German shepherd" in labels
    assert 'src="data:image/jpeg;base64,' in html and 'alt="Uploaded photo dog.jpg"' in html
    assert "EfficientNet-Lite0" in html and re.search(r"· (fp32|bf16|int8)", html)  # model and precision
    assert re.search(r"decode [\d.]+\xa0ms · wait for batch [\d.]+\xa0ms · inference [\d.]+\xa0ms", html)
    shown = re.sub(r"<script.*?</script>", "", html, flags=re.S)  # the words for the script hold every template
    assert "queue" not in shown.lower()  # an idle request's batch window is not a queue (it reads like congestion)


def test_upload_in_chinese_shows_chinese_labels(offline_client):
    data = shared_image("dog.jpg").read_bytes()
    resp = offline_client.post("/", data={"file": (io.BytesIO(data), "dog.jpg")},
                               headers={"Accept-Language": "zh-CN,zh;q=0.9,en;q=0.8"})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and '<html lang="zh-Hans"' in html
    labels = re.findall(r'<span class="label">([^<]+)</span>', html)
    assert "德国牧羊犬" in labels and "German shepherd" not in labels
    assert 'alt="上传的照片 dog.jpg"' in html and "解码" in html and "推理" in html and "等待组批" in html
    # The model's title in the page's language too (i18n.MODEL_TITLES), in the header and on the card.
    assert html.count("EfficientNet-Lite0（离线模型）") == 2 and "(offline)" not in html


def test_without_javascript_the_request_timing_is_shown_once(offline_client):
    """Several photos in one form post are one request: one timing line, not the same line on every card."""
    data = shared_image("dog.jpg").read_bytes()
    resp = offline_client.post("/", data={"file": [(io.BytesIO(data), "a.jpg"), (io.BytesIO(data), "b.jpg"),
                                                   (io.BytesIO(png_bytes(Image.new("RGB", (40, 30)))), "c.png")]},
                               headers={"Accept-Language": "en"})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and html.count('<article class="result">') == 3
    assert html.count('class="timing"') == 1 and len(re.findall(r"decode [\d.]+\xa0ms", html)) == 1
    cards = html.split('<article class="result">')[1:]
    assert not any("decode" in card.split("</article>")[0] for card in cards)


def test_without_javascript_a_photo_that_cannot_be_read_is_one_failed_card_beside_the_others(offline_client):
    """The plain form's one bad file threw away the other photos' labels (a 415 page); the JavaScript page shows
    them with one failed card, and so does the form now. Only when none can be read is it the error page."""
    dog = shared_image("dog.jpg").read_bytes()
    resp = offline_client.post("/", data={"file": [(io.BytesIO(dog), "dog.jpg"), (io.BytesIO(b"not a photo"), "notes.txt"),
                                                   (io.BytesIO(dog[: len(dog) // 3]), "cut.jpg")]},
                               headers={"Accept-Language": "en"})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and html.count('<article class="result">') == 1, html[-3000:]
    assert html.count('<article class="result failed">') == 2 and "German shepherd" in html
    failed = [card.split("</article>")[0] for card in html.split('<article class="result failed">')[1:]]
    assert "notes.txt" in failed[0] and "cannot be read here" in failed[0] and "unsupported_media_type" in failed[0]
    assert "cut.jpg" in failed[1] and "undecodable_image" in failed[1]
    assert html.index("dog.jpg") < html.index("notes.txt") < html.index("cut.jpg")  # in the order sent
    resp = offline_client.post("/", data={"file": [(io.BytesIO(b"x"), "a.txt"), (io.BytesIO(b"y"), "b.txt")]})
    assert resp.status_code == 415 and "a.txt" in resp.get_data(as_text=True)


def test_the_model_title_follows_the_language(offline_client):
    en = offline_client.get("/?lang=en").get_data(as_text=True)
    zh = offline_client.get("/?lang=zh").get_data(as_text=True)
    assert '<strong data-model="efficientnet_lite0">EfficientNet-Lite0 (offline)</strong>' in en
    assert '<strong data-model="efficientnet_lite0">EfficientNet-Lite0（离线模型）</strong>' in zh


def test_empty_camera_input_is_not_a_photo(client):
    """Without JavaScript both inputs are sent; the empty one must not fail the request."""
    photo = png_bytes(Image.new("RGB", (32, 32), "red"))
    resp = client.post("/", data={"file": [(io.BytesIO(photo), "red.png"), (io.BytesIO(b""), "")]})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and html.count('class="result"') == 1 and "red.png" in html


@pytest.mark.parametrize("camera_first", [True, False])
def test_a_chosen_empty_file_is_shown_with_its_error_wherever_the_empty_camera_input_is(client, camera_first):
    """The page paired its uploads (the empty camera part already dropped) with the form's parts (not dropped): with
    the camera part first, every pair was off by one, and a chosen 0-byte file vanished from the page unsaid."""
    photo = png_bytes(Image.new("RGB", (32, 32), "red"))
    camera, chosen = [(io.BytesIO(b""), "")], [(io.BytesIO(b""), "empty.jpg"), (io.BytesIO(photo), "red.png")]
    resp = client.post("/", data={"file": camera + chosen if camera_first else chosen + camera})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and "empty.jpg" in html and "red.png" in html


def test_the_most_photos_with_the_empty_camera_input_are_all_classified(client):
    """Without JavaScript a browser sends the unused camera input as an empty part beside the chosen photos:
    CLASSIFIER_MAX_FILES photos must still be accepted (not refused as one file too many)."""
    limit = client.application.extensions["settings"].MAX_FILES
    files = [(io.BytesIO(png_bytes(Image.new("RGB", (32, 32), (i * 15, 0, 0)))), f"p{i}.png") for i in range(limit)]
    resp = client.post("/", data={"file": files + [(io.BytesIO(b""), "")]})
    assert resp.status_code == 200 and resp.get_data(as_text=True).count('class="result"') == limit
    files = [(io.BytesIO(png_bytes(Image.new("RGB", (32, 32)))), f"p{i}.png") for i in range(limit + 1)]
    assert client.post("/", data={"file": files + [(io.BytesIO(b""), "")]}).status_code == 413  # still the limit


def test_filename_is_escaped_never_a_path(client):
    name = '../../<img src=x onerror=alert(1)>étoile🐶.png'  # shown as its last path component, escaped
    resp = client.post("/", data={"file": (io.BytesIO(png_bytes(Image.new("RGB", (32, 32)))), name)})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and "../.." not in html
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;étoile🐶.png" in html


def test_a_bidi_override_in_a_file_name_cannot_disguise_it_on_the_page(client):
    """"x\u202eexe.jpg" showed as "xgpj.exe" (tryout): the page shows bidirectional controls as U+FFFD; the
    answer itself keeps the name as sent."""
    name = "x\u202eexe.jpg"
    resp = client.post("/", data={"file": (io.BytesIO(png_bytes(Image.new("RGB", (32, 32)))), name)})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 200 and '<h3 class="filename">x\ufffdexe.jpg</h3>' in html and "\u202e" not in html
    api = client.post("/api/v1/predict", data={"file": (io.BytesIO(png_bytes(Image.new("RGB", (32, 32)))), name)})
    assert api.get_json()["results"][0]["filename"] == name


def test_errors_are_shown_in_words_on_the_page(client):
    resp = client.post("/", data={"file": (io.BytesIO(b"not a photo"), "notes.txt")})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 415 and resp.mimetype == "text/html"
    assert 'role="alert"' in html and "cannot be read here" in html and "not an image format" in html
    resp = client.post("/", data={"file": (io.BytesIO(b""), "")})
    assert resp.status_code == 400 and "choose a photo" in resp.get_data(as_text=True)


def test_a_bad_request_is_not_blamed_on_topk(client):
    """The page's words for a 400 are general; what was wrong is the detail under them (here a bad original_*
    field the page's script would send), never "labels per photo" for a fault that is not topk."""
    photo = png_bytes(Image.new("RGB", (32, 32), "red"))
    resp = client.post("/", data={"file": (io.BytesIO(photo), "red.png"), "original_width": "abc",
                                  "original_height": "1", "original_format": "JPEG", "original_bytes": "5"})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 400 and "original_width" in html
    assert "labels per photo" not in html and "not understood" in html
    resp = client.post("/", data={"file": (io.BytesIO(b"%PDF-1.4"), "a.pdf")})
    assert resp.status_code == 415 and "PPM" in resp.get_data(as_text=True)  # the formats it does read, all of them


def test_a_page_that_does_not_exist_is_not_called_a_photo_that_could_not_be_classified(client):
    for lang, heading in [("en", "No such page"), ("zh", "没有这个页面")]:
        resp = client.get(f"/no-such-page?lang={lang}", headers={"Accept": "text/html"})
        html = resp.get_data(as_text=True)
        assert resp.status_code == 404 and f'<h2 id="error-title">{heading}</h2>' in html
    html = client.post("/?lang=en", data={"file": (io.BytesIO(b"not a photo"), "notes.txt")}).get_data(as_text=True)
    assert '<h2 id="error-title">Could not classify that</h2>' in html


def test_errors_in_chinese(client):
    client.set_cookie("lang", "zh")
    resp = client.post("/", data={"file": (io.BytesIO(b"not a photo"), "notes.txt")})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 415 and "无法读取这种文件" in html and "无法识别" in html
    assert '<span lang="en">' in html  # the server's own (English) detail is marked as English
    # ... and said to be the server's own words in English, not left unexplained under the Chinese (tryout16)
    assert '服务器的原话（英文）：<span lang="en">' in html
    client.set_cookie("lang", "en")
    html = client.post("/", data={"file": (io.BytesIO(b"not a photo"), "notes.txt")}).get_data(as_text=True)
    assert '<p class="code"><span lang="en">' in html  # in English, nothing before it


def test_busy_is_said_in_words(client, app, monkeypatch):
    def busy(*args, **kwargs):
        raise Overloaded("server busy: 70 images queued (limit 64); try again in 3 s", headers={"Retry-After": "3"})

    monkeypatch.setattr(app.extensions["classifier"], "classify", busy)
    photo = png_bytes(Image.new("RGB", (32, 32)))
    resp = client.post("/", data={"file": (io.BytesIO(photo), "a.png")})
    assert resp.status_code == 429 and resp.headers["Retry-After"] == "3"
    assert "The server is busy: try again in" in resp.get_data(as_text=True)
    resp = client.post("/", data={"file": (io.BytesIO(photo), "a.png")}, headers={"Accept-Language": "zh"})
    assert "服务器繁忙" in resp.get_data(as_text=True)


def test_error_page_says_when_to_try_again(app):
    """With the answer's Retry-After passed to the template, the wait is said in seconds."""
    from flask import render_template

    with app.test_request_context("/", headers={"Accept-Language": "zh-CN"}):
        html = render_template("index.html", model={"name": "m"}, ready=True, answer=None, topk=3, retry_after="7",
                               error={"code": "overloaded", "message": "server busy", "status": 429})
    assert "服务器繁忙：请 7 秒后再试。" in html and 'role="alert"' in html


def test_language_from_accept_language_cookie_and_link(client):
    assert '<html lang="zh-Hans"' in client.get("/", headers={"Accept-Language": "zh-CN,zh;q=0.9"}).get_data(as_text=True)
    assert '<html lang="en"' in client.get("/", headers={"Accept-Language": "en-US,en;q=0.9,zh;q=0.5"}).get_data(as_text=True)
    assert '<html lang="en"' in client.get("/", headers={"Accept-Language": "fr-FR"}).get_data(as_text=True)
    # A plain link switches and remembers (works without JavaScript).
    resp = client.get("/?lang=zh", headers={"Accept-Language": "en"})
    html = resp.get_data(as_text=True)
    assert '<html lang="zh-Hans"' in html and "<h1" in html and "AI万物识别" in html
    cookie = resp.headers["Set-Cookie"]
    assert cookie.startswith("lang=zh;") and "Max-Age=" in cookie and "SameSite=Lax" in cookie and "Path=/" in cookie
    assert {"Cookie", "Accept-Language"} <= set(resp.vary)
    assert '<html lang="zh-Hans"' in client.get("/", headers={"Accept-Language": "en"}).get_data(as_text=True)
    # The switch links: both languages, the current one marked.
    assert re.search(r'<a href="/\?lang=en"[^>]*lang="en"', html)
    assert re.search(r'<a href="/\?lang=zh"[^>]*aria-current="true"', html)
    resp = client.get("/?lang=en")
    assert "lang=en" in resp.headers["Set-Cookie"] and '<html lang="en"' in resp.get_data(as_text=True)
    assert "Set-Cookie" not in client.get("/?lang=xx").headers  # unknown: ignored, not stored


def test_i18n_bundle_for_the_script(client):
    resp = client.get("/i18n/zh.json")
    body = resp.get_json()
    assert resp.status_code == 200 and body["lang"] == "zh" and body["htmlLang"] == "zh-Hans"
    assert len(body["labels"]) == 1000 and body["labels"][235] == "德国牧羊犬"
    assert body["modelTitles"]["efficientnet_lite0"] == "EfficientNet-Lite0（离线模型）"
    assert body["strings"]["title"] == "AI万物识别"
    en = client.get("/i18n/en.json").get_json()
    assert en["labels"] is None and set(en["strings"]) == set(body["strings"])
    # The page links it with its content hash: cached for long, revalidated by ETag.
    html = client.get("/?lang=zh").get_data(as_text=True)
    url = re.search(r'<body data-lang="zh" data-i18n="([^"]+)"', html).group(1)
    resp = client.get(url)
    assert resp.headers["Cache-Control"].startswith("public") and "max-age=31536000" in resp.headers["Cache-Control"]
    assert client.get(url, headers={"If-None-Match": resp.headers["ETag"]}).status_code == 304
    assert client.get("/i18n/fr.json").status_code == 404


def test_the_i18n_bundle_goes_compressed_to_a_client_that_accepts_it(client):
    """A first load of the zh page over a slow phone link waited for 16 KB of labels; gzip makes it 8 KB. The
    same JSON either way, each representation with its own ETag (a cache keeps them apart: Vary)."""
    import gzip

    plain = client.get("/i18n/zh.json")
    packed = client.get("/i18n/zh.json", headers={"Accept-Encoding": "gzip, deflate, br"})
    assert "Content-Encoding" not in plain.headers and packed.headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(packed.data) == plain.data and len(packed.data) < len(plain.data) * 0.6
    assert "Accept-Encoding" in plain.headers["Vary"] and "Accept-Encoding" in packed.headers["Vary"]
    assert plain.headers["ETag"] != packed.headers["ETag"]
    assert client.get("/i18n/zh.json", headers={"Accept-Encoding": "gzip",
                                                "If-None-Match": packed.headers["ETag"]}).status_code == 304
    assert client.get("/i18n/zh.json", headers={"Accept-Encoding": "gzip;q=0"}).headers.get("Content-Encoding") is None


def test_static_files_are_served(client):
    resp = client.get("/static/style.css")
    assert resp.status_code == 200 and "text/css" in resp.content_type
    resp = client.get("/static/app.js")
    assert resp.status_code == 200 and "javascript" in resp.content_type
    assert "eval(" not in resp.get_data(as_text=True) and "innerHTML" not in resp.get_data(as_text=True)


def test_the_forms_photos_are_bounded_together(make_app):
    """Without JavaScript the form's photos are classified one by one; their pixels together are still bounded
    by CLASSIFIER_MAX_REQUEST_PIXELS, before any is decoded (as the API's)."""
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=4, PRECISION="fp32",
                      MAX_REQUEST_PIXELS=3 * 32 * 32).test_client()

    def photos(n):
        return {"file": [(io.BytesIO(png_bytes(Image.new("RGB", (32, 32), (i * 40, 0, 0)))), f"p{i}.png")
                         for i in range(n)]}

    ok = client.post("/", data=photos(3), headers={"Accept-Language": "en"})
    assert ok.status_code == 200 and ok.get_data(as_text=True).count('<article class="result">') == 3
    refused = client.post("/", data=photos(4), headers={"Accept-Language": "en"})
    html = refused.get_data(as_text=True)
    assert refused.status_code == 413 and "CLASSIFIER_MAX_REQUEST_PIXELS" in html and "4,096" in html, html[-2000:]


def test_an_empty_file_is_said_to_be_empty_not_unchosen(client):
    """A chosen file of 0 bytes was told "choose a photo first": the person had chosen one."""
    resp = client.post("/", data={"file": [(io.BytesIO(b""), "empty.jpg")]}, headers={"Accept-Language": "en"})
    html = resp.get_data(as_text=True)
    assert resp.status_code == 400 and "empty.jpg" in html and "0 bytes" in html, html[-1500:]
    assert "choose a photo first" not in html
    zh = client.post("/", data={"file": [(io.BytesIO(b""), "empty.jpg")]}, headers={"Accept-Language": "zh"})
    assert "0 字节" in zh.get_data(as_text=True)


def test_the_forms_photos_on_a_classifier_that_decodes_elsewhere_are_answered(make_app, monkeypatch):
    """The page serves a cluster's RemoteClassifier too, which has no ``started`` (its replicas decode and bound
    each request): the form's several photos must still be answered there, not fail on the budget's check."""
    class Elsewhere:  # the local classifier, seen as a cluster's: everything but ``started``
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "started":
                raise AttributeError(name)
            return getattr(self._inner, name)

    app = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=4, PRECISION="fp32")
    monkeypatch.setitem(app.extensions, "classifier", Elsewhere(app.extensions["classifier"]))
    files = [(io.BytesIO(png_bytes(Image.new("RGB", (32, 32), (i * 40, 0, 0)))), f"p{i}.png") for i in range(2)]
    resp = app.test_client().post("/", data={"file": files}, headers={"Accept-Language": "en"})
    assert resp.status_code == 200 and resp.get_data(as_text=True).count('<article class="result">') == 2


def test_with_an_api_token_the_page_sends_its_photos_to_its_own_route_as_json(make_app):
    """With CLASSIFIER_API_TOKEN set the page's photos got the API's 401, and it fell back to its plain form: each
    new pick reloaded the page, the earlier cards gone (tryout16). The page now sends them to its own open route,
    which answers as the API does when asked for JSON, errors included."""
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=4, PRECISION="fp32",
                      API_TOKEN="s3cret-token-value").test_client()
    assert 'data-api="/"' in client.get("/").get_data(as_text=True)
    photo = png_bytes(Image.new("RGB", (64, 48), (30, 160, 90)))
    asked = {"headers": {"Accept": "application/json"}, "content_type": "multipart/form-data"}
    resp = client.post("/?topk=2", data={"file": (io.BytesIO(photo), "a.png")}, **asked)
    assert resp.status_code == 200 and resp.mimetype == "application/json", resp.get_data(as_text=True)[:300]
    api = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=4, PRECISION="fp32").test_client()
    theirs = api.post("/api/v1/predict?topk=2", data={"file": (io.BytesIO(photo), "a.png")},
                      content_type="multipart/form-data").get_json()
    mine = resp.get_json()
    assert set(mine) == set(theirs) and mine["results"][0]["predictions"] == theirs["results"][0]["predictions"]
    assert len(mine["results"][0]["predictions"]) == 2 and "thumbnail" not in mine["results"][0]
    refused = client.post("/", data={"file": (io.BytesIO(b"not a photo at all"), "a.png")}, **asked)
    assert refused.status_code == 415 and refused.get_json()["error"]["code"] == "unsupported_media_type"
    # The plain form (a browser's Accept: text/html first) still gets the page; the API still needs the token.
    page = client.post("/", data={"file": (io.BytesIO(photo), "a.png")}, content_type="multipart/form-data",
                       headers={"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"})
    assert page.mimetype == "text/html" and "a.png" in page.get_data(as_text=True)
    assert client.post("/api/v1/predict", data=photo, content_type="image/png").status_code == 401
    assert 'data-api="/api/v1/predict"' in api.get("/").get_data(as_text=True)  # no token: the API, as before


def test_the_forms_byte_limit_is_said_in_units_that_fit_it(make_app):
    """``CLASSIFIER_MAX_UPLOAD_BYTES=400000`` read "0 MB together" (tryout18)."""
    from webapp.ui import decimal_size

    assert [decimal_size(n) for n in (33_554_432, 3_200_000, 400_000, 900)] == ["33 MB", "3.2 MB", "400 KB", "900 B"]
    client = make_app(MODEL="resnet18_seeded", COMPILE=False, MAX_BATCH_SIZE=1, MAX_UPLOAD_BYTES=400_000).test_client()
    assert "at most 16 at once, 400 KB together." in client.get("/?lang=en").get_data(as_text=True)
    assert "合计不超过 400 KB。" in client.get("/?lang=zh").get_data(as_text=True)
