"""The upload page: ``GET /`` shows the form, ``POST /`` classifies and renders the top-k into the page.

Works without JavaScript: a plain multipart form. With JavaScript, ``static/app.js`` enhances the
same page (drag and drop, paste, previews, several photos in parallel through the JSON API) and
loads its strings and labels from ``GET /i18n/<lang>.json``. Photos are never stored; the
no-JS preview is a small JPEG thumbnail sent back inline as a data URI.

English or Simplified Chinese (``webapp.i18n``): ``?lang=en|zh`` on any page sets the ``lang``
cookie, so a plain link switches and remembers the language.
"""

from __future__ import annotations

import base64
import re

from flask import Blueprint, abort, current_app, g, jsonify, render_template, request, url_for
from . import i18n
from .sizes import check_request_pixels
from .errors import NoFile, NotAnImage, TooLarge, UndecodableImage
from .headers import check_headers
from .uploads import read_uploads, request_topk

bp = Blueprint("ui", __name__)


def jpeg_data_uri(jpeg: bytes) -> str:
    """JPEG bytes (the answer's ``thumbnail``, made once by ``imaging.prepare``) -> ``data:image/jpeg;base64,...``."""
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode("ascii")


def request_lang() -> str:
    """This request's language (``?lang``, the cookie, ``Accept-Language``), computed once per request."""
    if "ui_lang" not in g:
        g.ui_lang = i18n.choose(request.args.get("lang"), request.cookies.get(i18n.COOKIE), request.accept_languages)
    return g.ui_lang


@bp.app_context_processor
def i18n_context() -> dict:
    """What index.html needs for its language; applies to every page, the error pages included."""
    lang, clf = request_lang(), current_app.extensions.get("classifier")
    return {
        "lang": lang,
        "html_lang": i18n.HTML_LANG[lang],
        "t": i18n.strings(lang),
        "langs": i18n.LANG_NAMES,
        "html_langs": i18n.HTML_LANG,
        "i18n_url": i18n_url,
        "error_text": lambda code, retry_after=None: i18n.error_text(code, lang, retry_after),
        "timing_text": lambda timing: i18n.strings(lang)["timing"].format(**{k: _ms(v) for k, v in timing.items()}),
        "model_title": lambda model: i18n.model_title(model, lang),
        "shown_name": shown_name,
        # static/app.js's words from the first paint (the bundle it fetches adds the labels): on a slow link the
        # cards said "pending", "err_other" until it came, and for good if it failed (tryout)
        "page_words": i18n.page_words(lang),
        # static/app.js waits this long (s), plus the upload's time, before saying no answer came: the server's own
        # bound on an answer (REQUEST_TIMEOUT_S: body read to result) and 30 s for the network and the queue to it
        "answer_within_s": clf.settings.REQUEST_TIMEOUT_S + 30 if clf else "",
        # the plain form sends photos as they are, all in one body: its limits, said before they refuse it (a 40 MB
        # photo beside a good one failed both without a word before: tryout16)
        "form_limits": i18n.strings(lang)["nojs_limits"].format(
            files=clf.settings.MAX_FILES, size=decimal_size(clf.settings.MAX_UPLOAD_BYTES)) if clf else "",
        # where static/app.js sends each photo: the JSON API, or, where the API needs a token (CLASSIFIER_API_TOKEN)
        # the page has not, the page's own open route, which answers as the API does when asked for JSON. The page
        # had fallen back to its plain form on the API's 401: each new pick reloaded it, the earlier cards gone.
        "page_api": url_for("ui.classify") if clf and clf.settings.API_TOKEN else url_for("api.predict"),
    }


def shown_name(name: str) -> str:
    """A file name as the page shows it: bidirectional controls (U+202A-202E, U+2066-2069) as U+FFFD, so that
    ``x\u202eexe.jpg`` cannot show as "xgpj.exe" (static/app.js does the same); the answer keeps the name."""
    return _BIDI.sub("\ufffd", name)


_BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")


def decimal_size(n: int) -> str:
    """Bytes for people, in decimal units as phones and file managers show them (static/app.js's ``size``): 33 MB,
    3.2 MB, 400 KB, 900 B. A limit under 1 MB read "0 MB" (tryout18)."""
    if n >= 10**7:
        return f"{n // 10**6:,} MB"
    return f"{n / 1e6:.1f} MB" if n >= 10**6 else f"{round(n / 1e3)} KB" if n >= 10**3 else f"{n} B"


def _ms(value: float) -> str:
    """Milliseconds for people: one decimal under 10 ms, whole numbers above (as static/app.js does)."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def i18n_url(lang: str) -> str:
    """URL of ``lang``'s strings and labels for static/app.js, versioned by content (cached for a year)."""
    from flask import url_for

    return url_for("ui.i18n_bundle", lang=lang, v=i18n.bundle(lang)[1])


@bp.after_app_request
def remember_lang(resp):
    """A valid ``?lang=`` sets the ``lang`` cookie (on any page), so the choice sticks without JavaScript."""
    chosen = i18n.normalize(request.args.get("lang"))
    if chosen and request.cookies.get(i18n.COOKIE) != chosen and resp.mimetype == "text/html":
        resp.set_cookie(i18n.COOKIE, chosen, max_age=i18n.COOKIE_MAX_AGE, path="/", samesite="Lax",
                        secure=request.is_secure)
    if resp.mimetype == "text/html":
        resp.vary.update(("Cookie", "Accept-Language"))
    return resp


@bp.get("/")
def index():
    """The empty upload form."""
    clf = current_app.extensions["classifier"]
    return render_template("index.html", model=clf.describe(), ready=clf.ready, answer=None, error=None,
                           topk=clf.settings.TOP_K)


@bp.post("/")
def classify():
    """Classify the form's photo(s) and show them with their top-k labels and percentages.

    Asked for JSON (``Accept: application/json``, as static/app.js asks where the API needs a token), it answers
    as ``POST /api/v1/predict`` does, errors included (``topk`` from the query too): the API token guards the API's
    scripted use, the page is open (unless ``PAGE_LOGIN``: webapp/access.py), and its photos go here then, one
    request each."""
    clf = current_app.extensions["classifier"]
    check_headers(request)  # what the headers decide (411, 415, 400) is answered as such, never as a 429
    clf.admit(request.environ)  # not ready, or too late to answer in time: answered before the body is read
    topk = request_topk(request, clf.settings.TOP_K)
    # The form has two file inputs named "file" (choose, and take a photo); read_uploads drops the one left empty (a
    # part with no name and no bytes: not a photo the person sent).
    uploads = read_uploads(request, max_files=clf.settings.MAX_FILES)
    if request.accept_mimetypes.best == "application/json":  # static/app.js (errors: JSON too, webapp/errors.py)
        return jsonify(clf.classify(uploads, topk=topk))
    # Classified one by one below: the request's photos are bounded together here, where this process decodes
    # them (a cluster's RemoteClassifier has no ``started``: its replicas decode, and bound, each request's own).
    if len(uploads) > 1 and (started := getattr(clf, "started", None)) is not None:
        check_request_pixels(uploads, limit=clf.settings.MAX_REQUEST_PIXELS,  # each keeps its size: read once
                             min_side=started.min_side(clf.settings.FAST_DECODE))
    answer = clf.classify(uploads, topk=topk, keep_images=True) if len(uploads) == 1 else each(clf, uploads, topk)
    for item in answer["results"]:
        if "thumbnail" in item:
            item["thumbnail"] = jpeg_data_uri(item["thumbnail"])
    i18n.translate(answer, request_lang())
    return render_template("index.html", model=answer["model"], ready=True, answer=answer, error=None, topk=topk)


_THE_FILES_OWN = (NoFile, NotAnImage, TooLarge, UndecodableImage)  # 400, 413, 415: about that photo alone


def each(clf, uploads: list, topk: int) -> dict:
    """Several photos from the plain form, each classified on its own: one that cannot be read (400, 413, 415)
    is a failed card beside the others' labels, as the JavaScript page shows it (the JSON API fails the whole
    request instead: documented there). Returns the ``classify`` answer of them all, a failed one as
    ``{"filename", "error": {"code", "message", "status"}}``, timings (ms) summed.

    :raises ServiceError: every photo's own error when none could be read (the first one's); any other error
        (429, 503, 504, 500) at once, as for one photo.
    """
    answers, results, first = [], [], None
    for up in uploads:
        try:
            answers.append(clf.classify([up], topk=topk, keep_images=True))
        except _THE_FILES_OWN as exc:
            first = first or exc
            results.append({"filename": up.name, "error": {"code": exc.code, "message": exc.message,
                                                           "status": exc.status}})
            continue
        results.extend(answers[-1]["results"])
    if not answers:
        raise first
    timing = {k: sum(a["timing_ms"][k] for a in answers) for k in answers[0]["timing_ms"]}
    return {**answers[-1], "results": results, "timing_ms": timing}


@bp.get("/i18n/<lang>.json")
def i18n_bundle(lang: str):
    """``{"lang", "htmlLang", "strings", "labels"}`` for static/app.js (labels: null for English); gzip-compressed
    for a client that accepts it (``Content-Encoding: gzip``, ``Vary: Accept-Encoding``)."""
    if lang not in i18n.LANGS:
        abort(404)
    body, etag = i18n.bundle(lang)
    gz = request.accept_encodings["gzip"] > 0  # every browser asks for it; Flask compresses nothing itself
    resp = current_app.response_class(i18n.bundle_gzip(lang) if gz else body, mimetype="application/json")
    if gz:
        resp.content_encoding = "gzip"
    resp.vary.add("Accept-Encoding")
    resp.set_etag(f"{etag}-gzip" if gz else etag)  # another representation: another strong ETag (RFC 9110 8.8.3)
    # The page asks for it with ?v=<hash>: a changed file is a new URL, so it may be cached long.
    resp.cache_control.public = True
    resp.cache_control.max_age = 365 * 24 * 3600 if request.args.get("v") == etag else 300
    return resp.make_conditional(request)
