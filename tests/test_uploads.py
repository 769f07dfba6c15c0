"""Reading uploads (webapp/uploads.py): the optional ``original_*`` fields a client sends with a photo
it scaled before upload (the page does, in the browser), validated, carried through ``Upload.original``
and reported by ``answers.answer`` as the photo's, with ``scaled_by_client`` saying what arrived."""

from __future__ import annotations

import io
import re

import pytest
import schemathesis
from PIL import Image

from conftest import encode, small_png
from webapp.contract import ORIGINAL_FORMATS, Original, Upload
from webapp.errors import BadRequest
from webapp.uploads import ORIGINAL_FIELDS, TEXT_FIELDS, read_originals
from werkzeug.datastructures import MultiDict

SCALED = encode(Image.new("RGB", (80, 60), (40, 120, 200)), "JPEG", quality=90)  # the "scaled copy"
ORIGINAL = {"original_width": "4032", "original_height": "3024", "original_format": "JPEG",
            "original_bytes": "3212345"}


def post(client, files, **fields):
    data = MultiDict([("file", (io.BytesIO(d), n)) for n, d in files])
    for k, v in fields.items():
        for one in v if isinstance(v, list) else [v]:
            data.add(k, one)
    return client.post("/api/v1/predict", data=data, content_type="multipart/form-data")


def test_a_scaled_upload_is_reported_as_its_original(client, app):
    resp = post(client, [("phone.jpg", SCALED)], **ORIGINAL)
    assert resp.status_code == 200, resp.get_json()
    (res,) = resp.get_json()["results"]
    assert (res["width"], res["height"], res["format"], res["bytes"]) == (4032, 3024, "JPEG", 3212345)
    assert res["scaled_by_client"] == {"width": 80, "height": 60, "format": "JPEG", "bytes": len(SCALED)}
    # and that answer is the one the document describes
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").get_json())
    schema["/api/v1/predict"]["POST"].validate_response(resp)


def test_without_the_fields_the_result_describes_the_upload(client):
    (res,) = post(client, [("small.jpg", SCALED)]).get_json()["results"]
    assert (res["width"], res["height"], res["format"], res["bytes"]) == (80, 60, "JPEG", len(SCALED))
    assert "scaled_by_client" not in res


def test_one_value_per_file_in_order(client):
    fields = {"original_width": ["4000", "1000"], "original_height": ["3000", "750"],
              "original_format": ["heic", "webp"], "original_bytes": ["2000000", "90000"]}
    resp = post(client, [("a.jpg", SCALED), ("b.jpg", SCALED)], **fields)
    assert resp.status_code == 200, resp.get_json()
    got = [(r["filename"], r["width"], r["height"], r["format"], r["bytes"]) for r in resp.get_json()["results"]]
    assert got == [("a.jpg", 4000, 3000, "HEIC", 2000000), ("b.jpg", 1000, 750, "WEBP", 90000)]


def test_a_part_sent_as_it_is_beside_scaled_copies_has_its_four_values_empty(client):
    """The page's fallback form (an API token it does not have) sends scaled copies and photos as they are in one
    request: one set of values per file part still, all four empty for one that is not a copy."""
    fields = {"original_width": ["4000", ""], "original_height": ["3000", ""], "original_format": ["heic", ""],
              "original_bytes": ["2000000", ""]}
    resp = post(client, [("a.jpg", SCALED), ("b.jpg", SCALED)], **fields)
    assert resp.status_code == 200, resp.get_json()
    a, b = resp.get_json()["results"]
    assert (a["width"], a["format"], "scaled_by_client" in a) == (4000, "HEIC", True)
    assert (b["width"], b["format"], b["bytes"], "scaled_by_client" in b) == (80, "JPEG", len(SCALED), False)
    fields["original_format"] = ["heic", "JPEG"]  # some of a part's four and not the others: refused, as ever
    assert post(client, [("a.jpg", SCALED), ("b.jpg", SCALED)], **fields).status_code == 400


@pytest.mark.parametrize("field, value", [
    ("original_width", "0"), ("original_width", "65536"), ("original_width", "-5"), ("original_width", "4e3"),
    ("original_width", "4 0"), ("original_width", "3_000"), ("original_width", "٣"), ("original_width", ""),
    ("original_width", "9" * 5000), ("original_height", "1.5"), ("original_bytes", "0"),
    ("original_bytes", str(2**40 + 1)), ("original_format", "EXE"), ("original_format", ""),
])
def test_a_bad_value_is_400_naming_the_field(client, field, value):
    resp = post(client, [("x.jpg", SCALED)], **{**ORIGINAL, field: value})
    assert resp.status_code == 400
    err = resp.get_json()["error"]
    assert err["code"] == "bad_request" and err["message"].startswith(field), err


@pytest.mark.parametrize("missing", ORIGINAL_FIELDS)
def test_the_four_fields_go_together(client, missing):
    fields = {k: v for k, v in ORIGINAL.items() if k != missing}
    resp = post(client, [("x.jpg", SCALED)], **fields)
    assert resp.status_code == 400
    assert resp.get_json()["error"]["message"].startswith(f"{missing} is missing")


def test_one_value_for_two_files_is_400(client):
    resp = post(client, [("a.jpg", SCALED), ("b.jpg", SCALED)], **ORIGINAL)
    assert resp.status_code == 400
    assert resp.get_json()["error"]["message"] == ("original_width: 1 value(s) for 2 file(s); send one per file "
                                                   "part, in the same order")


def test_limits_are_inclusive_and_every_format_is_known():
    for fmt in ORIGINAL_FORMATS:
        form = MultiDict({"original_width": str(Original.MAX_SIDE), "original_height": "1",
                          "original_format": fmt.lower(), "original_bytes": str(Original.MAX_BYTES)})
        said = "JPEG" if fmt == "MPO" else fmt  # a JPEG with more images after the photo: the server says JPEG
        assert read_originals(form, 1) == [Original(Original.MAX_SIDE, 1, said, Original.MAX_BYTES)]
    assert read_originals(MultiDict({"topk": "3"}), 2) == [None, None]
    with pytest.raises(BadRequest, match="original_format must be one of JPEG, PNG"):
        read_originals(MultiDict({**ORIGINAL, "original_format": "PDF"}), 1)
    # Every format the service decodes itself may be named (a tryout's client scaled a PPM: 400 for the copy,
    # where the PPM sent as it is was answered), and the phone formats the service does not decode.
    from webapp.contract import FORMATS

    assert set(FORMATS) < set(ORIGINAL_FORMATS) and {"HEIC", "HEIF"} < set(ORIGINAL_FORMATS)
    assert read_originals(MultiDict({**ORIGINAL, "original_format": "ppm"}), 1)[0].format == "PPM"
    # Pillow names a phone's JPEG with a gain map after the photo "MPO" (a client scaling with Pillow says so):
    # the service decodes and reports such a file as JPEG (imaging.decode), so the original is a JPEG too.
    assert read_originals(MultiDict({**ORIGINAL, "original_format": "MPO"}), 1)[0].format == "JPEG"


def test_the_shared_answer_reports_the_original(app):
    """``answers.answer`` (the gunicorn worker's and the Ray replica's) reads ``Upload.original``."""
    clf = app.extensions["classifier"]
    up = Upload("p.jpg", SCALED, Original(4032, 3024, "HEIC", 2_500_000))
    scaled, plain = clf.classify([up, Upload("q.jpg", SCALED)], topk=1)["results"]
    assert (scaled["width"], scaled["height"], scaled["format"], scaled["bytes"]) == (4032, 3024, "HEIC", 2_500_000)
    assert scaled["scaled_by_client"] == {"width": 80, "height": 60, "format": "JPEG", "bytes": len(SCALED)}
    assert (plain["width"], plain["bytes"], "scaled_by_client" in plain) == (80, len(SCALED), False)


def test_too_many_form_parts_is_413_saying_so_not_the_byte_limit(client):
    """A small body with more parts than Werkzeug's form limit (1,000) is refused for its parts, not for a
    byte limit it is far from (a new user's finding)."""
    resp = post(client, [("a.jpg", SCALED)], junk=[str(i) for i in range(1100)])
    body = resp.get_json()["error"]
    assert resp.status_code == 413 and body["code"] == "too_large", body
    assert "too many parts" in body["message"] and "1,000 parts" in body["message"], body
    assert "CLASSIFIER_MAX_UPLOAD_BYTES" not in body["message"]
    assert post(client, [("a.jpg", SCALED)], junk=[str(i) for i in range(900)]).status_code == 200


def test_a_file_part_is_handed_over_without_a_copy():
    """The part's bytes are the in-memory stream's own buffer (``getvalue``), not a second copy of it:
    a 12 MP upload in flight holds its 3 MB once, not twice."""
    from werkzeug.test import EnvironBuilder

    from webapp.uploads import UploadRequest, read_uploads

    photo = bytes(range(256)) * 4096  # 1 MiB: over Werkzeug's 500 KB spool limit
    env = EnvironBuilder(method="POST", data={"file": (io.BytesIO(photo), "big.jpg")}).get_environ()
    request = UploadRequest(env)
    [upload] = read_uploads(request, max_files=4)
    assert upload.data == photo and upload.name == "big.jpg"
    assert upload.data is request.files["file"].stream.getvalue()  # the same object: no copy was made


def test_a_file_field_sent_as_text_says_so(client):
    """``curl -F 'file=<photo.jpg'`` sends the photo as a text field (no filename): the 400 says that, not
    that no ``file`` field arrived."""
    resp = client.post("/api/v1/predict", data={"file": "not really a photo"}, content_type="multipart/form-data")
    error = resp.get_json()["error"]
    assert resp.status_code == 400 and error["code"] == "no_file"
    assert "arrived as a text field" in error["message"] and "file=@photo.jpg" in error["message"], error


@pytest.mark.parametrize("field", TEXT_FIELDS)
def test_a_text_field_sent_as_a_file_part_says_so(client, field):
    """``curl -F 'original_width=@w.txt'`` sends the field as a file part (a filename): it read as missing
    (``original_width is missing``), and a ``topk`` sent so was silently the default. Now 400 naming the field
    and how to send it, on the API and on the page's form, whatever the other fields say."""
    def data() -> MultiDict:
        fields = MultiDict([("file", (io.BytesIO(SCALED), "p.jpg"))])
        for k, v in {**ORIGINAL, "topk": "2"}.items():
            fields.add(k, (io.BytesIO(v.encode()), f"{k}.txt") if k == field else v)
        return fields

    page = client.post("/", data=data(), content_type="multipart/form-data")
    assert page.status_code == 400 and f"{field} arrived as a file part" in page.get_data(as_text=True)
    error = client.post("/api/v1/predict", data=data(), content_type="multipart/form-data").get_json()["error"]
    assert error["code"] == "bad_request" and error["message"].startswith(f"{field} arrived as a file part"), error
    assert re.search(rf"curl -F '{field}=[^'<]+'", error["message"]), error  # a value, never curl's "<": a file


def _one_part(disposition: bytes, data: bytes) -> bytes:
    return (b"--XX\r\nContent-Disposition: " + disposition + b"\r\nContent-Type: image/png\r\n\r\n" + data
            + b"\r\n--XX--\r\n")


@pytest.mark.parametrize("raw, shown", [
    (b"a\rb.png", "a%0Db.png"), (b"a\nb.png", "a%0Ab.png"), (b"a\r\nb.png", "a%0D%0Ab.png"),
    (b"two\rbreaks\n.png", "two%0Dbreaks%0A.png"), (b"caf\xc3\xa9\r.png", "caf\u00e9%0D.png"),
])
def test_a_raw_line_break_in_a_filename_keeps_the_part_a_file(client, raw, shown):
    """A hand-made client's raw CR or LF inside the quoted filename used to end the header there: the photo
    arrived "as a text field" (400). It is the file part it is, its name shown as a browser would send it."""
    body = _one_part(b'form-data; name="file"; filename="' + raw + b'"', small_png())
    resp = client.post("/api/v1/predict", data=body, content_type="multipart/form-data; boundary=XX")
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["results"][0]["filename"] == shown


def test_a_filename_never_closed_is_still_not_a_file(client):
    """Without a closing quote on the next line there is nothing to rejoin: the part has no filename, as before,
    and the next header line (its Content-Type) is not swallowed into a name."""
    body = _one_part(b'form-data; name="file"; filename="a', small_png())
    resp = client.post("/api/v1/predict", data=body, content_type="multipart/form-data; boundary=XX")
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "no_file"


@pytest.mark.parametrize("parts, said", [
    ([b'form-data; filename="a.jpg"'], "file fields received: (a part with no name)"),
    ([b'form-data; filename="a.jpg"', b'form-data; name="photo"; filename="b.jpg"'],
     "file fields received: (a part with no name), photo"),
    ([b"form-data"], "file fields received: none"),
])
def test_a_part_without_a_name_is_400_no_file_not_a_500(client, parts, said):
    """Found by a tryout: a part whose Content-Disposition has no name= (Werkzeug keys it None) made the 'no file'
    message sort None with names: TypeError, 500 on the API and on the page. It is the client's 400 no_file."""
    body = b"".join(b"--XX\r\nContent-Disposition: " + d + b"\r\nContent-Type: image/png\r\n\r\n" + small_png() + b"\r\n"
                    for d in parts) + b"--XX--\r\n"
    for url in ("/api/v1/predict", "/"):
        resp = client.post(url, data=body, content_type="multipart/form-data; boundary=XX")
        assert resp.status_code == 400, (url, resp.status_code, resp.get_data(as_text=True)[:300])
    error = client.post("/api/v1/predict", data=body, content_type="multipart/form-data; boundary=XX").get_json()["error"]
    assert error["code"] == "no_file" and said in error["message"], error


@pytest.mark.parametrize("width, height, ok", [(80, 60, True), (81, 61, True), (79, 60, True), (78, 60, False),
                                               (80, 58, False), (10, 10, False), (8000, 6000, True),
                                               (4032, 3024, True), (3024, 4032, False), (65535, 65535, False),
                                               (4000, 2800, False), (4000, 3200, False), (4000, 2970, True)])
def test_an_original_smaller_than_the_copy_received_or_of_another_shape_is_refused(client, width, height, ok):
    """``original_width=10`` beside an 80x60 copy was reported as the photo's size: a scaled copy is never
    larger than its original (one pixel of rounding allowed), so such fields are a client's bug, said as one. So is
    an original of another shape (a portrait 3024x4032 beside a landscape copy: tryout22); each copy side may be
    2 px off by rounding (80x60 of 4000x2970 would be 80x59.4)."""
    fields = {**ORIGINAL, "original_width": str(width), "original_height": str(height)}
    resp = post(client, [("c.jpg", SCALED)], **fields)
    if ok:
        assert resp.status_code == 200 and resp.get_json()["results"][0]["width"] == width
    else:
        body = resp.get_json()["error"]
        assert resp.status_code == 400 and body["code"] == "bad_request", body
        assert f"{width}x{height}" in body["message"] and "80x60" in body["message"] and "c.jpg" in body["message"]


@pytest.mark.parametrize("width, height", [(65535, 49151), (10400, 7800)])
def test_an_original_over_max_pixels_is_a_413_as_the_photo_sent_whole_is(client, width, height):
    """Found by a fresh-user tryout: an 85 MP photo got 413 from curl and ``classify --server``, but the page scaled
    it before upload and classified it. The photo is the original: over ``MAX_PIXELS`` (80 MP here) it is a 413."""
    fields = {**ORIGINAL, "original_width": str(width), "original_height": str(height)}
    body = post(client, [("c.jpg", SCALED)], **fields).get_json()["error"]
    assert body["status"] == 413 and body["code"] == "too_large", body
    assert body["message"].startswith(f"c.jpg: {width}x{height} is {width * height:,} pixels; the limit is 80,000,000")


@pytest.mark.parametrize("original, copy, ok", [((10000, 1000), (512, 256), True), ((10000, 1000), (2560, 256), True),
                                                ((10000, 1000), (300, 256), False), ((1000, 10000), (256, 512), True),
                                                ((1000, 10000), (512, 256), False)])
def test_a_strips_copy_may_be_of_its_central_2_to_1_or_of_the_whole(client, original, copy, ok):
    """A client crops a strip over 2:1 to its central 2:1 before scaling (static/scale.js, classify --server), or
    sends it whole: either shape describes the original; another does not."""
    photo = encode(Image.new("RGB", copy, (40, 90, 140)), "PNG")
    fields = {**ORIGINAL, "original_width": str(original[0]), "original_height": str(original[1])}
    resp = post(client, [("strip.png", photo)], **fields)
    assert (resp.status_code == 200) == ok, resp.get_json()
    if not ok:
        assert "not the shape of the" in resp.get_json()["error"]["message"]
