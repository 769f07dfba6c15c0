"""The input tensor of an Open Inference Protocol ("KServe v2") inference request: the photos' bytes.

``webapp/v2_codec.py`` reads the request around it (header, parameters, outputs) and answers it;
this module reads its one input, ``image`` (``BYTES``, shape ``[N]``): its datatype, shape,
parameters and elements, sent with the binary tensor data extension (a 4-byte little-endian length
then the bytes, for each element) or as JSON ``data`` strings. Also the small readers of JSON
values both modules use. Flask-free and torch-free, as the codec.

Every refusal is a ``ServiceError`` with the API's status: 400 ``bad_request`` (a datatype,
shape, parameter or element the input does not take: the message names it and what it takes),
400 ``no_file`` (N = 0), 413 ``too_large`` (N > ``MAX_FILES``, or more than ``MAX_UPLOAD_BYTES``
of photos), 415 ``unsupported_media_type`` (an element declared text, ``content_type`` ``str``,
whose text is base64 or hex of a photo).
"""

from __future__ import annotations

import base64
import binascii
import json
import struct

from . import mangled
from .errors import BadRequest, NoFile, NotAnImage, TooLarge
from .formats import claimed_format

INPUT = "image"
HEADER = "Inference-Header-Content-Length"
# The protocol's tensor datatypes (KServe's list, and Triton's BF16), upper case as the protocol spells them.
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "BF16", "FP16",
             "FP32", "FP64", "BYTES")
# ``content_type`` values read: "base64" (each string base64 of a photo); the rest, each string's UTF-8 bytes
# (MLServer's StringCodec says "str"; the others are spellings of it clients use).
BASE64 = "base64"
TEXT_TYPES = ("str", "string", "utf8", "utf-8")
CONTENT_TYPES = (BASE64, *TEXT_TYPES)
# The input's parameters the server reads; any other is refused (400) rather than ignored.
INPUT_PARAMETERS = ("content_type", "binary_data_size")


def json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words (the messages go to protocol clients, not Python readers)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false",
            type(None): "null"}.get(type(value), "a number")


def as_object(value, what: str) -> dict:
    """``value`` (a parsed JSON value; None: absent) as a dict, ``{}`` where absent.

    :raises BadRequest: not a JSON object (400; ``what`` names it).
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what} must be a JSON object, got {json_kind(value)}")
    return value


def count(value, what: str, lo: int, hi: int) -> int:
    """``value`` as an int in ``lo..hi`` (JSON true/false and 3.0 are not integers).

    :raises BadRequest: anything else (400; ``what`` names it).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{what} must be an integer from {lo} to {hi}, got {json.dumps(value)[:40]}")
    return value


def flag(value, what: str) -> bool:
    """``value`` as JSON true/false. :raises BadRequest: anything else, "true" and 1 included (400)."""
    if not isinstance(value, bool):
        raise BadRequest(f"{what} must be true or false, got {json.dumps(value)[:40]}")
    return value


def read_content_type(params: dict, what: str, default: str | None) -> str | None:
    """``params``' ``content_type`` (``default`` where absent): one of ``CONTENT_TYPES``, or None.

    ``what`` names where it was ("the request's", "input 'image'").

    :raises BadRequest: not a string, or a string that is not one of ``CONTENT_TYPES`` (400, naming the value
        and the ones read: an MLServer codec's own, ``np`` or ``pd``, was once taken as if absent, so a client
        that meant something by it got an answer to another reading of its strings).
    """
    value = params.get("content_type", default)
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadRequest(f"{what} content_type must be a string such as \"base64\" or \"str\", got "
                         f"{json.dumps(value)[:40]}")
    if value not in CONTENT_TYPES:
        case = f" (content types are lower case: {json.dumps(value.lower())})" if value.lower() in CONTENT_TYPES \
            else ""
        raise BadRequest(f"{what} content_type {json.dumps(value)[:60]} is not one this server reads{case}: it reads "
                         f"\"base64\" (each string is base64 of a photo) and \"str\" (each string's own UTF-8 bytes "
                         f"are the photo; also \"string\", \"utf8\", \"utf-8\"); without content_type a string "
                         f"that is valid base64 is decoded, any other is read as its UTF-8 text")
    return value


def check_datatype(value) -> None:
    """Check the input's ``datatype`` (a parsed JSON value) is ``BYTES``.

    :raises BadRequest: absent, not a string, a protocol name in the wrong case (``"bytes"``: said so, with the
        name), a name the protocol does not have, or another datatype (decoded pixels: said so) (400).
    """
    if value == "BYTES":
        return
    where = f"input '{INPUT}'"
    if value is None:
        raise BadRequest(f"{where} has no datatype: it is \"BYTES\" (encoded photos)")
    if not isinstance(value, str):
        raise BadRequest(f"{where} datatype must be a string, \"BYTES\", got {json.dumps(value)[:40]}")
    shown = json.dumps(value)[:40]
    if value in DATATYPES:
        raise BadRequest(f"{where} is BYTES (encoded photos), not {shown}; send the photo files' bytes, not decoded "
                         f"pixels")
    if value.upper() in DATATYPES:
        raise BadRequest(f"{where} datatype {shown} is not a datatype; the protocol's names are upper case: "
                         f"{json.dumps(value.upper())}")
    raise BadRequest(f"{where} datatype {shown} is not a datatype; the protocol's are {', '.join(DATATYPES)}, and "
                     f"this input is \"BYTES\" (encoded photos)")


def no_other_parameters(params: dict, where: str, takes: tuple[str, ...], why: dict[str, str]) -> None:
    """Refuse a parameter of ``params`` not in ``takes`` rather than ignore it: the client meant something by it.

    ``where`` names the place ("input 'image'"); ``why`` gives, for names sent to the wrong place, where they are
    read (e.g. ``"topk": "a request parameter"``).

    :raises BadRequest: the first parameter not in ``takes`` (400): its name, what ``where`` takes, and where it is
        read where ``why`` knows.
    """
    for name in params:
        if name in takes:
            continue
        if name.startswith("shared_memory_"):
            hint = ("; this server has no shared memory extension (GET /v2 lists its extensions): the tensors "
                    "go in the HTTP bodies")
        else:
            hint = f"; {name} is {why[name]}" if name in why else ""
        raise BadRequest(f"{where} has parameter {json.dumps(name)[:60]}, which this server does not read there: it "
                         f"takes {', '.join(takes)}{hint}")


def bytes_elements(data: bytes, count: int) -> list[bytes]:
    """The binary extension's BYTES tensor: ``count`` elements, each a 4-byte little-endian length then its bytes.

    :raises BadRequest: a length running past the data, or elements other than ``count`` (400).
    """
    out, pos = [], 0
    while pos < len(data):
        if len(out) == count:
            raise BadRequest(f"input '{INPUT}' has binary data past its {count} element(s) (shape [{count}])")
        if pos + 4 > len(data):
            raise BadRequest(f"input '{INPUT}': element {len(out)} has a cut 4-byte length")
        (size,) = struct.unpack_from("<I", data, pos)
        if pos + 4 + size > len(data):  # a photo's own first bytes read as a length: say the format (tryout27)
            head = f" ({data[pos:pos + 4]!r} read as one: a photo without it?)" if claimed_format(data[pos:]) else ""
            raise BadRequest(f"input '{INPUT}': element {len(out)} says {size:,} bytes, {len(data) - pos - 4:,} "
                             f"are left; each BYTES element is a 4-byte little-endian length, then that many "
                             f"bytes{head}")
        out.append(data[pos + 4:pos + 4 + size])
        pos += 4 + size
    if len(out) != count:
        raise BadRequest(f"input '{INPUT}' has shape [{count}] but its binary data holds {len(out)} element(s)")
    return out


def _flatten(data) -> list:
    out: list = []
    stack = [iter(data)]
    while stack:  # no recursion: a deeply nested list is a 400, not a RecursionError
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


class Text(bytes):
    """A ``data`` element's bytes read as its UTF-8 text, where it was not base64: its errors say so."""


def _relaxed_base64(text: str) -> bytes | None:
    """Base64 without its ``=`` padding or in the URL-safe alphabet (``mangled.lenient_base64``), where what it
    decodes to starts as a photo does (``formats.claimed_format``). Both were refused with a 415 telling the client
    to send base64 in a /v2 JSON request, which it did (tryout27). None otherwise: hex or other text keeps its own
    reading and its own words."""
    data = mangled.lenient_base64(text.encode()) if text.isascii() else None
    return data if data and claimed_format(data) else None


def json_element(text: str, index: int, content_type: str | None) -> bytes:
    """One JSON ``data`` element -> the photo's bytes: base64 where ``content_type`` is ``base64`` (a
    ``data:...;base64,`` prefix and whitespace allowed; unpadded or URL-safe where it decodes to a photo); its UTF-8 bytes where it is one of ``TEXT_TYPES``;
    without one, base64 if the text is valid base64, else its UTF-8 bytes (a ``Text``).

    :raises BadRequest: declared base64 that is not (400).
    :raises NotAnImage: declared text (``str``...) whose text is base64 or hex of a photo, or a ``data:`` URL of
        one (415, as such text is on ``/api/v1/predict``, but saying which ``content_type`` reads it: the API's
        words would tell a JSON client to send the bytes themselves).
    """
    if content_type in TEXT_TYPES:
        raw = text.encode("utf-8", "surrogatepass")
        found = mangled.how_mangled(raw)
        if found is not None and not found[1]:  # text that holds a photo, not a photo changed on the way
            # its words begin "it is <base64 text|hex text|a data: URL> of a <format>, not the ...": that part
            what = found[0].partition(", not the ")[0].removeprefix("it is ")
            raise NotAnImage(f"element {index} of input '{INPUT}' is {what}, but content_type "
                             f"{json.dumps(content_type)} takes each string's own UTF-8 bytes as the photo: send "
                             f"\"content_type\": \"base64\" for base64 strings (or leave content_type out)")
        return raw
    cleaned = "".join(text.split())
    if cleaned.startswith("data:") and ";base64," in cleaned[:200]:
        cleaned = cleaned.split(";base64,", 1)[1]
    try:
        return base64.b64decode(cleaned, validate=True)
    except (binascii.Error, ValueError) as exc:
        if (photo := _relaxed_base64(cleaned)) is not None:
            return photo
        if content_type == BASE64:
            raise BadRequest(f"element {index} of input '{INPUT}' is not valid base64 ({exc})") from None
        return Text(text.encode("utf-8", "surrogatepass"))


def read_input(doc: dict, rest: bytes, *, max_files: int, max_bytes: int, content_type: str | None) -> list[bytes]:
    """The photos (bytes each, in order) of the request ``doc``'s one input; ``rest``: the bytes after its JSON
    header (binary tensor data); ``content_type``: the request's (the input's own wins).

    :raises BadRequest: no input, several, another name, datatype, shape or parameter, data that does not
        match the shape or its binary_data_size, an element that is not a string (400).
    :raises NoFile: shape [0] (400).
    :raises TooLarge: more than ``max_files`` photos, or more than ``max_bytes`` of them (413).
    :raises NotAnImage: an element declared text that is base64 or hex of a photo (415; ``json_element``).
    """
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1:
        if isinstance(inputs, list):
            got = f"{len(inputs)} inputs"
        elif "inputs" not in doc:
            got = "no 'inputs' list"
        else:
            got = f"'inputs' as {json_kind(inputs)}, not a list"
        raise BadRequest(f"this model takes one input, '{INPUT}' (BYTES, shape [N]: N encoded photos); got {got}")
    tensor = as_object(inputs[0], "an input")
    name = tensor.get("name")
    if name != INPUT:
        raise BadRequest(f"unknown input {json.dumps(name)[:60]}: this model takes one input, '{INPUT}' (BYTES, "
                         f"shape [N]: N encoded photos)")
    check_datatype(tensor.get("datatype"))
    shape = tensor.get("shape")
    if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)
            and not isinstance(shape[0], bool) and shape[0] >= 0):
        raise BadRequest(f"input '{INPUT}' has shape {json.dumps(shape)[:60]}; it takes [N], N photos")
    n = shape[0]
    if n == 0:
        raise NoFile(f"no image: input '{INPUT}' has shape [0]")
    if n > max_files:
        raise TooLarge(f"{n} photos in one request; the limit is {max_files} (CLASSIFIER_MAX_FILES)")
    params = as_object(tensor.get("parameters"), f"input '{INPUT}' parameters")
    no_other_parameters(params, f"input '{INPUT}'", INPUT_PARAMETERS, {
        "topk": "a request parameter ({\"parameters\": {\"topk\": 5}} beside \"inputs\")",
        "binary_data_output": "a request parameter", "binary_data": "an output's parameter",
        "classification": "a parameter of output 'probabilities'"})
    content_type = read_content_type(params, f"input '{INPUT}'", content_type)
    if "binary_data_size" in params:
        size = count(params["binary_data_size"], f"input '{INPUT}' binary_data_size", 0, 2**62)
        if "data" in tensor:
            raise BadRequest(f"input '{INPUT}' has both 'data' and binary_data_size: send one")
        if size != len(rest):
            raise BadRequest(f"input '{INPUT}' binary_data_size is {size:,} bytes; {len(rest):,} follow the JSON "
                             f"header ({HEADER})")
        photos = bytes_elements(rest, n)
    else:
        if rest:
            raise BadRequest(f"{len(rest):,} bytes follow the JSON header, but input '{INPUT}' has no "
                             f"binary_data_size")
        data = tensor.get("data")
        if data is not None and not isinstance(data, list):
            raise BadRequest(f"input '{INPUT}': 'data' must be a list (one base64 string per photo), got "
                             f"{json_kind(data)}")
        if data is None:
            raise BadRequest(f"input '{INPUT}' has no data: send 'data' (one base64 string per photo) or the binary "
                             f"tensor data extension (binary_data_size)")
        items = _flatten(data)
        if len(items) != n:
            raise BadRequest(f"input '{INPUT}' has shape [{n}] but {len(items)} data element(s)")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise BadRequest(f"element {i} of input '{INPUT}' is {json_kind(item)}: send each photo as a "
                                 f"base64 string")
        encoded = sum(len(s) for s in items)
        if encoded // 4 * 3 > max_bytes + 3 * len(items):  # over the limit however it decodes: do not decode
            raise TooLarge(f"the photos are about {encoded // 4 * 3:,} bytes decoded; the limit is {max_bytes:,} "
                           f"(CLASSIFIER_MAX_UPLOAD_BYTES)")
        photos = [json_element(s, i, content_type) for i, s in enumerate(items)]
    total = sum(len(p) for p in photos)
    if total > max_bytes:
        raise TooLarge(f"the photos are {total:,} bytes; the limit is {max_bytes:,} (CLASSIFIER_MAX_UPLOAD_BYTES)")
    return photos
