"""The upload page: ``GET /`` shows the form, ``POST /`` classifies and renders the top-k into the page.

Works without JavaScript: a plain multipart form. Photos are never stored; the preview is a
small JPEG thumbnail sent back inline as a data URI.
"""

from __future__ import annotations

import base64
import io

from flask import Blueprint, current_app, render_template, request
from PIL import Image

from .uploads import parse_topk, read_uploads

bp = Blueprint("ui", __name__)


def thumbnail_uri(img: Image.Image, size: int = 320) -> str:
    """RGB PIL image -> ``data:image/jpeg;base64,...`` no larger than ``size`` px on its long side."""
    thumb = img.copy()
    thumb.thumbnail((size, size))
    buf = io.BytesIO()
    thumb.save(buf, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


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
    topk = parse_topk(request.form.get("topk"), clf.settings.TOP_K)
    answer = clf.classify(read_uploads(request, max_files=clf.settings.MAX_FILES), topk=topk, keep_images=True)
    for item in answer["results"]:
        item["thumbnail"] = thumbnail_uri(item.pop("image"))
    return render_template("index.html", model=answer["model"], ready=True, answer=answer, error=None, topk=topk)
