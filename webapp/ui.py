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

from flask import Blueprint, abort, current_app, g, render_template, request
from . import i18n
from .uploads import parse_topk, read_uploads

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
    lang = request_lang()
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
    }


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
    """Classify the form's photo(s) and show them with their top-k labels and percentages."""
    clf = current_app.extensions["classifier"]
    clf.admit(request.environ)  # not ready, or too late to answer in time: answered before the body is read
    # the form's topk field; only a multipart body is read for it (any other type is refused by its headers)
    topk = parse_topk(request.form.get("topk") if request.mimetype == "multipart/form-data" else None,
                      clf.settings.TOP_K)
    uploads = read_uploads(request, max_files=clf.settings.MAX_FILES)
    # The form has two file inputs named "file" (choose, and take a photo); the one left empty
    # arrives as a part with no name and no bytes: not a photo the person sent.
    parts = request.files.getlist("file")
    uploads = [u for u, p in zip(uploads, parts) if p.filename or u.data] or uploads
    answer = clf.classify(uploads, topk=topk, keep_images=True)
    for item in answer["results"]:
        item["thumbnail"] = jpeg_data_uri(item["thumbnail"])
    i18n.translate(answer, request_lang())
    return render_template("index.html", model=answer["model"], ready=True, answer=answer, error=None, topk=topk)


@bp.get("/i18n/<lang>.json")
def i18n_bundle(lang: str):
    """``{"lang", "htmlLang", "strings", "labels"}`` for static/app.js (labels: null for English)."""
    if lang not in i18n.LANGS:
        abort(404)
    body, etag = i18n.bundle(lang)
    resp = current_app.response_class(body, mimetype="application/json")
    resp.set_etag(etag)
    # The page asks for it with ?v=<hash>: a changed file is a new URL, so it may be cached long.
    resp.cache_control.public = True
    resp.cache_control.max_age = 365 * 24 * 3600 if request.args.get("v") == etag else 300
    return resp.make_conditional(request)
