"""The Open Inference Protocol ("KServe v2") over HTTP: its inference requests and answers as bytes.

The routes are in ``webapp/v2.py``; this module only turns a request body into the photos to
classify and the outputs asked for, and an answer into the protocol's body. Flask-free and
torch-free (``struct`` packs the binary tensors), so it is tested on bytes alone.

The model, as ``GET /v2/models/{name}`` describes it:

- input ``image``: ``BYTES``, shape ``[N]``: N encoded photos (any format ``/api/v1/predict``
  takes), 1 <= N <= ``MAX_FILES``. Sent either with the **binary tensor data extension** (the
  ``Inference-Header-Content-Length`` header gives the JSON header's length in bytes; the input's
  ``binary_data_size`` parameter its share of the bytes after it, each element a 4-byte
  little-endian length then its bytes), as Triton's and KServe's clients do; or as JSON ``data``:
  one string per photo, base64 (``"content_type": "base64"`` in the input's or the request's
  ``parameters``, as MLServer sends it; ``"str"``, also ``"string"``, ``"utf8"``, ``"utf-8"``: each
  string's UTF-8 bytes; without ``content_type`` a string that is valid base64 is decoded, any other
  is taken as its UTF-8 bytes, which then must be an image).
- outputs ``labels`` ``BYTES [N, k]``, ``probabilities`` ``FP32 [N, k]``, ``indices`` ``INT64
  [N, k]``: the top-k (request parameter ``topk``, 1..10, default ``TOP_K``) highest first. The
  **classification extension** (``"classification": c`` in an output's parameters, on
  ``probabilities``) ranks the full softmax vector (all 1000 classes) and answers ``BYTES [N, c]``
  strings ``"<probability>:<index>:<label>"``, as Triton does; 1 <= c <= the model's classes.
- each output is JSON ``data`` or binary (its ``binary_data`` parameter, else the request's
  ``binary_data_output``, else JSON); a binary answer carries ``Inference-Header-Content-Length``
  and ``Content-Type: application/octet-stream``.

The input is read by ``webapp/v2_inputs.py``. Every parameter the server does not read where it was
sent (an output's ``topk``, a ``content_type`` other than those above) is refused, not ignored.

Every refusal is a ``ServiceError`` with the API's status: 400 ``bad_request`` (malformed
request: wrong input name, datatype, shape, data, parameter), 400 ``no_file`` (N = 0), 413 ``too_large``
(N > ``MAX_FILES``, or decoded photos over ``MAX_UPLOAD_BYTES`` in all), 415 ``unsupported_media_type``
(a string declared text, ``"content_type": "str"``, that is base64 of a photo; a photo's bytes as the body).
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass, field

from .errors import BadRequest, NotAnImage
from .formats import claimed_format, sniff_format
from .headers import parse_topk
from .v2_inputs import (HEADER, INPUT, as_object, count, flag, json_kind, no_other_parameters, read_content_type,
                        read_input)
# The input's readers keep their names here too: webapp/v2.py and the tests know the codec as one module.
from .v2_inputs import Text, bytes_elements, json_element  # noqa: F401

OUTPUTS = {"labels": "BYTES", "probabilities": "FP32", "indices": "INT64"}  # name -> datatype, in answer order
CLASSIFIABLE = "probabilities"  # the output the classification extension ranks
EXTENSIONS = ("binary_tensor_data", "classification")
VERSION = "1"  # the model's one version: the weights are fixed for the life of the server
ALIAS = "classifier"  # a model name that always means the serving model
PLATFORM = "pytorch"
# Room for the JSON around the photos (ids, parameters, outputs, quotes and commas), bytes.
JSON_SLACK = 64 * 1024
_PACK = {"FP32": "f", "INT64": "q"}


def body_limit(max_upload_bytes: int) -> int:
    """Largest request body (bytes) for ``max_upload_bytes`` of photos: base64 adds a third, plus ``JSON_SLACK``."""
    return -(-max_upload_bytes // 3) * 4 + JSON_SLACK


def model_metadata(name: str) -> dict:
    """``GET /v2/models/{name}``: the model's versions, platform, and its tensors (``-1``: a variable dim)."""
    return {"name": name, "versions": [VERSION], "platform": PLATFORM,
            "inputs": [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}],
            "outputs": [{"name": n, "datatype": d, "shape": [-1, -1]} for n, d in OUTPUTS.items()]}


@dataclass
class Wanted:
    """One output to answer: its ``name``, ``binary`` (bytes after the JSON) and ``classification``
    (the classification extension's class count; 0 for the plain top-k tensor)."""

    name: str
    binary: bool
    classification: int = 0


@dataclass
class InferRequest:
    """A parsed inference request: its ``id`` (None if not sent), the ``photos`` (bytes each, the
    input's elements in order), ``topk`` (1..10) and the ``outputs`` to answer, in order."""

    id: str | None
    photos: list[bytes]
    topk: int
    outputs: list[Wanted] = field(default_factory=list)

    @property
    def ranks(self) -> int:
        """Labels per photo the classifier must return: the most any output needs."""
        return max([self.topk, *(w.classification for w in self.outputs)])


# -- reading -------------------------------------------------------------------------------------------------
def _not_json(name: str):
    """Python's ``json`` reads ``NaN``, ``Infinity`` and ``-Infinity``; JSON (RFC 8259) has no such values."""
    raise ValueError(f"{name} is not a JSON value (RFC 8259 has no NaN or Infinity)")


def _json_object_end(body: bytes) -> int | None:
    """Where a JSON object at the start of ``body`` ends (bytes), if something other than whitespace follows
    it: the binary extension's layout sent without its header-length header. None otherwise."""
    text = body.decode("utf-8", "surrogateescape")  # the bytes after the JSON need not be UTF-8
    try:
        doc, end = json.JSONDecoder(parse_constant=_not_json).raw_decode(text.lstrip())
    except (ValueError, RecursionError):
        return None
    end += len(text) - len(text.lstrip())
    if not isinstance(doc, dict) or not text[end:].strip():
        return None
    return len(text[:end].encode("utf-8", "surrogateescape"))


def split_header(body: bytes, header_length: str | None) -> tuple[dict, bytes]:
    """The JSON header of ``body`` and the bytes after it (``header_length``: the binary extension's
    ``Inference-Header-Content-Length`` value, or None for an all-JSON body).

    :raises BadRequest: a header length that is not an integer in 1..len(body), or a header that is
        not a JSON object (400).
    """
    if header_length is None:
        head, rest = body, b""
    else:
        text = header_length.strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 12 and 1 <= int(text) <= len(body)):
            raise BadRequest(f"{HEADER} must be the JSON header's length in bytes, 1 to {len(body):,} for this "
                             f"body, got {header_length[:40]!r}")
        head, rest = body[:int(text)], body[int(text):]
    if not head.strip():
        raise BadRequest("empty body: send an inference request, {\"inputs\": [{\"name\": \"image\", ...}]}")
    try:
        doc = json.loads(head, parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        if header_length is None and (end := _json_object_end(head)) is not None:
            raise BadRequest(f"the body is a JSON header of {end:,} bytes followed by {len(head) - end:,} more (binary "
                             f"tensor data?): send the {HEADER} header with the JSON header's length, {end}") from None
        if header_length is None and (fmt := claimed_format(head) or sniff_format(head)):  # a photo posted as is
            # (tryout19: octet-stream; tryout20: HEIC, JPEG XL)
            raise NotAnImage(f"the body is {fmt} bytes, not an inference request: send the protocol's JSON (photos as "
                             f"base64 strings), or binary tensor data after a JSON header whose length the {HEADER} "
                             f"header gives; or POST the photo to /api/v1/predict")
        binary = (f"; a body with binary tensor data needs the {HEADER} header"
                  if header_length is None and _binary(head) else "")
        if isinstance(exc, RecursionError):  # valid JSON maybe, but nested deeper than Python's parser goes
            raise BadRequest("the inference request nests its JSON arrays or objects deeper than this server reads "
                             f"(about {sys.getrecursionlimit():,} levels); an image tensor needs 4") from None
        raise BadRequest(f"the inference request is not valid JSON ({str(exc)[:120]}){binary}") from None
    return as_object(doc, "the inference request"), rest


def _binary(data: bytes) -> bool:
    """Whether ``data`` is not text: a NUL byte, or not UTF-8, in its first KiB (a cut character at its end aside)."""
    try:
        data[:1024].decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < min(len(data), 1024) - 3
    return b"\x00" in data[:1024]


# An output's parameters the server reads; any other is refused (400) rather than ignored.
OUTPUT_PARAMETERS = ("binary_data", "classification")
# Parameters sent on an output that are read elsewhere, or by another name: where, in the refusal's words.
_TOPK = (f"a request parameter ({{\"parameters\": {{\"topk\": 5}}}} beside \"outputs\"), for every output; or ask "
         f"'{CLASSIFIABLE}' for \"classification\": 5 (the classification extension: \"<probability>:<index>:<label>\" "
         f"strings)")
_ELSEWHERE = {"topk": _TOPK, "top_k": _TOPK, "binary_data_output": "a request parameter",
              "class_count": f"tritonclient's name for \"classification\", the parameter it sends (on "
                             f"'{CLASSIFIABLE}')",
              "content_type": "an input's parameter (this model's outputs have one encoding each)"}


# The request's parameters the server reads; any other is refused (400): a misspelt "top_k" answered 3 labels
# without a word, where the same name on an output was a 400 (tryout27). tritonclient sends "priority" and
# "timeout" where its caller gives them: taken as hints (one queue; admission's own deadline, MAX_WAIT_MS).
REQUEST_PARAMETERS = ("topk", "binary_data_output", "content_type", "priority", "timeout")
_ON_AN_OUTPUT = f"an output's parameter (\"outputs\": [{{\"name\": \"{CLASSIFIABLE}\", \"parameters\": {{...}}}}])"
_STATELESS = "for sequence batching, which this stateless model has none of: leave it out"
REQUEST_ELSEWHERE = {"top_k": "spelt \"topk\" here", "topK": "spelt \"topk\" here", "binary_data": _ON_AN_OUTPUT +
                     "; binary_data_output is the request's, for every output", "classification": _ON_AN_OUTPUT,
                     "class_count": f"tritonclient's name for \"classification\", {_ON_AN_OUTPUT}",
                     "binary_data_size": "an input's parameter", "sequence_id": _STATELESS,
                     "sequence_start": _STATELESS, "sequence_end": _STATELESS}


def _outputs(doc: dict, *, binary_default: bool, categories: int) -> list[Wanted]:
    asked = doc.get("outputs")
    if asked is None or asked == []:
        return [Wanted(name, binary_default) for name in OUTPUTS]
    if not isinstance(asked, list):
        raise BadRequest(f"'outputs' must be a list, got {json_kind(asked)}")
    wanted: list[Wanted] = []
    for item in asked:
        out = as_object(item, "an output")
        name = out.get("name")
        if not isinstance(name, str) or name not in OUTPUTS:
            raise BadRequest(f"unknown output {json.dumps(name)[:60]}: this model answers {', '.join(OUTPUTS)}")
        if any(w.name == name for w in wanted):
            raise BadRequest(f"output '{name}' is asked for twice")
        params = as_object(out.get("parameters"), f"output '{name}' parameters")
        no_other_parameters(params, f"output '{name}'", OUTPUT_PARAMETERS, _ELSEWHERE)
        binary = flag(params["binary_data"], f"output '{name}' binary_data") if "binary_data" in params \
            else binary_default
        classes = 0
        if "classification" in params:
            if name != CLASSIFIABLE:
                raise BadRequest(f"classification applies to the '{CLASSIFIABLE}' output, not '{name}'")
            classes = count(params["classification"], f"output '{name}' classification", 1, categories)
        wanted.append(Wanted(name, binary, classes))
    return wanted


def parse_request(body: bytes, header_length: str | None, *, default_topk: int, max_files: int, max_bytes: int,
                  categories: int) -> InferRequest:
    """An inference request body -> ``InferRequest`` (see the module docstring for the format).

    ``header_length``: the ``Inference-Header-Content-Length`` header (None if absent);
    ``max_files`` and ``max_bytes`` (decoded photos, in all) are ``MAX_FILES`` and ``MAX_UPLOAD_BYTES``;
    ``categories`` bounds the classification extension's class count.

    :raises BadRequest: a malformed request (400; the message says what and where).
    :raises NoFile: shape [0] (400).
    :raises TooLarge: more than ``max_files`` photos, or more than ``max_bytes`` of them (413).
    :raises NotAnImage: a string declared text that is base64 or hex of a photo (415).
    """
    doc, rest = split_header(body, header_length)
    req_id = doc.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise BadRequest(f"'id' must be a string, got {json.dumps(req_id)[:40]}")
    if req_id is not None and not req_id.encode("utf-8", "surrogatepass").decode("utf-8", "replace") == req_id:
        # A lone surrogate (\ud800) is JSON but not text: echoed back, strict clients refuse the answer (tryout21).
        raise BadRequest(f"'id' must be text: it holds a lone UTF-16 surrogate ({json.dumps(req_id)[:40]})")
    params = as_object(doc.get("parameters"), "the request's parameters")
    no_other_parameters(params, "the request", REQUEST_PARAMETERS, REQUEST_ELSEWHERE)
    topk = default_topk
    if "topk" in params:
        raw = params["topk"]
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            raise BadRequest(f"topk must be an integer from 1 to 10, got {json.dumps(raw)[:40]}")
        topk = parse_topk(str(raw), default_topk)
    binary_default = flag(params.get("binary_data_output", False), "binary_data_output")
    content_type = read_content_type(params, "the request's", None)
    photos = read_input(doc, rest, max_files=max_files, max_bytes=max_bytes, content_type=content_type)
    return InferRequest(req_id, photos, topk, _outputs(doc, binary_default=binary_default, categories=categories))


# -- answering -----------------------------------------------------------------------------------------------
def _tensor(wanted: Wanted, predictions: list[list[dict]], topk: int) -> tuple[str, list]:
    """(datatype, row-major values) of one output for every photo's predictions (highest first)."""
    if wanted.classification:
        return "BYTES", [f"{p['probability']:f}:{p['index']}:{p['label']}"
                         for preds in predictions for p in preds[:wanted.classification]]
    key = {"labels": "label", "probabilities": "probability", "indices": "index"}[wanted.name]
    return OUTPUTS[wanted.name], [p[key] for preds in predictions for p in preds[:topk]]


def _pack(datatype: str, values: list) -> bytes:
    if datatype == "BYTES":
        raw = [v.encode("utf-8") for v in values]
        return b"".join(struct.pack("<I", len(b)) + b for b in raw)
    return struct.pack(f"<{len(values)}{_PACK[datatype]}", *values)


def encode_answer(req: InferRequest, predictions: list[list[dict]], *, model_name: str,
                  request_id: str | None) -> tuple[bytes, dict[str, str]]:
    """The answer to ``req``: (body, headers). ``predictions``: per photo, ``[{"label", "index",
    "probability"}]`` highest first, at least ``req.ranks`` of them where the model has that many classes.

    ``id`` echoes the request's, else ``request_id`` (the ``X-Request-ID``). A binary answer is the
    JSON header then each binary output's bytes, in order, with ``Inference-Header-Content-Length``
    and ``Content-Type: application/octet-stream``; else JSON.
    """
    outputs, chunks = [], []
    n = len(predictions)
    for wanted in req.outputs:
        datatype, values = _tensor(wanted, predictions, req.topk)
        tensor = {"name": wanted.name, "datatype": datatype, "shape": [n, len(values) // n if n else 0]}
        if wanted.binary:
            chunk = _pack(datatype, values)
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            tensor["data"] = values
        outputs.append(tensor)
    doc = {"id": req.id if req.id is not None else (request_id or ""), "model_name": model_name,
           "model_version": VERSION, "outputs": outputs}
    head = json.dumps(doc, separators=(",", ":")).encode("ascii")
    if not chunks:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(chunks), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}
