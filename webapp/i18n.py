"""The page in English and Simplified Chinese: which language a request gets, the UI strings, the labels.

The language comes from, in order: ``?lang=en|zh`` (a plain link, so it works without JavaScript),
the ``lang`` cookie (set by that link, or by the page's script), then ``Accept-Language`` (any
``zh-*`` gets Simplified Chinese), else English.

ImageNet labels in Chinese live in one data file, ``webapp/data/imagenet_zh.txt``: one line per
class in index order, ``index<TAB>English<TAB>Chinese`` (the English column is torchvision's
name, kept for review and checked against ``webapp.models.IMAGENET_CATEGORIES`` by the tests).
The API keeps answering English labels and class indices; the page maps the index to its label.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import lru_cache
from pathlib import Path

from . import catalog
from .errors import RETRYABLE

LANGS = ("en", "zh")
DEFAULT_LANG = "en"
COOKIE = "lang"
COOKIE_MAX_AGE = 365 * 24 * 3600
# What each language is called in itself (the switch shows these) and its BCP 47 tag for <html lang>.
LANG_NAMES = {"en": "English", "zh": "简体中文"}
HTML_LANG = {"en": "en", "zh": "zh-Hans"}
LABELS_FILE = Path(__file__).with_name("data") / "imagenet_zh.txt"

# UI strings. ``{name}`` placeholders are filled by the template (str.format) or by static/app.js.
STRINGS: dict[str, dict[str, str]] = {
    "en": {
        "title": "Photo classifier",
        "intro": "Choose photos and the model names what it sees in each, with its top labels.",
        "language": "Language",
        "model": "Model:",
        "untrained": "untrained",
        "fallback": "offline fallback",
        "note_fallback": "ResNet-18 weights were not found on this server, so the offline EfficientNet-Lite0 answers instead.",
        "note_untrained": "This model has random weights (for speed tests): its labels mean nothing.",
        "details": "Details",
        "starting": "The model is still starting; photos are answered once it is ready.",
        "photos": "Choose photos",
        "photos_hint": "JPEG, PNG, WebP, GIF, BMP, TIFF, AVIF or PPM; several at once.",
        "nojs_limits": "Without JavaScript photos go up as they are: at most {files} at once, {size} together.",
        "camera": "Take a photo",
        "drop_hint": "You can also drop photos here, or paste one (Ctrl+V).",
        "privacy": "Photos go up without their location or camera data (EXIF), large ones scaled down in your browser "
                   "first; each photo's card says how it went (a file this browser cannot read goes as it is).",
        "dropping": "Drop the photos to classify them",
        "topk": "Labels per photo",
        "submit": "Classify",
        "clear_results": "Clear results",
        "try_again": "Try again",
        "try_again_named": "Try again: {name}",
        "retry_all": "Try the {n} failed again",
        "results": "Results",
        "predictions": "Top labels for {name}",
        "preview_alt": "Uploaded photo {name}",
        "no_preview": "No preview",
        "server_said": "",  # before the server's own message, which is English: nothing to say in English
        "pending": "Classifying…",
        "retrying": "The server is busy: trying again in {n} s…",
        "retrying_not_ready": "The model is still starting: trying again in {n} s…",
        "retrying_rate_limited": "Too many photos in a short time: trying again in {n} s…",
        "retrying_not_classifier": "The proxy did not pass on the classifier's answer: trying again in {n} s…",
        "working": "Classifying {n} photos…",
        "working_one": "Classifying 1 photo…",
        "done": "{ok} of {n} photos classified.",
        "done_one": "Photo classified.",
        "failed_one": "The photo could not be classified.",
        "meta": "{model} · {precision}",
        "size": "{width}×{height} {format}",
        # (no-break spaces before units: on a 375 px phone the line broke between a number and its unit)
        "timing": "decode {decode}\u00a0ms · wait for batch {queue}\u00a0ms · inference {inference}\u00a0ms · "
                  "total {total}\u00a0ms",
        "round_trip": "with the upload {ms}\u00a0ms",
        "scaled": "scaled in the browser: {from} → {to}",
        "sent_as_is": "sent as is, with any metadata in it: {size}",
        "sent_bare": "sent without its metadata: {size}",
        "sent_copy": "sent as a lossless {format} copy, without its metadata: {size}",
        "timing_label": "Time taken:",
        "error_title": "Could not classify that",
        "error_title_no_page": "No such page",
        "login_title": "Sign-in needed",
        "login_text": "This page needs the server's access token: reload the page and give the token as the "
                      "password (any user name).",
        "err_no_file": "No photo was received: the file is empty (0 bytes), or none was chosen.",
        "err_length_required": "The browser sent the photo without saying its size: try another browser.",
        "err_too_large": "Too large: this photo (or this many photos at once) is more than the server accepts.",
        "err_too_large_photo": "Too large: this photo is more than the server accepts (its bytes or its pixels).",
        "err_unsupported_media_type": "This kind of file cannot be read here: send the photo as JPEG (8-bit), PNG, "
                                      "WebP, GIF, BMP, TIFF, AVIF or PPM.",
        "err_undecodable_image": "The photo is damaged (perhaps cut short while copying) and cannot be read.",
        "err_overloaded": "The server is busy: try again in {n} s.",
        "err_overloaded_later": "The server is busy: try again in a few seconds.",
        "err_overloaded_now": "The server was busy: try again now.",
        "err_rate_limited": "Too many photos in a short time: try again in {n} s.",
        "err_rate_limited_later": "Too many photos in a short time: try again in a minute.",
        "err_rate_limited_now": "Too many photos in a short time: you can try again now.",
        "err_not_ready": "The model is still starting: try again in {n} s.",
        "err_not_ready_later": "The model is still starting: try again in a few seconds.",
        "err_not_ready_now": "The model was still starting: try again now.",
        "err_timeout": "That took too long (the server is very busy): try again.",
        "err_body_timeout": "The upload stalled (the connection is too slow or was interrupted): try again.",
        "err_client_gone": "The connection closed before the photo was classified: try again.",
        "err_unauthorized": "This server's API needs an access token.",
        "err_bad_request": "The request was not understood; the details below say what was wrong in it.",
        "err_not_found": "There is no such page.",
        "err_method_not_allowed": "That address does not take this kind of request.",
        "err_network": "The server could not be reached: check the connection and try again.",
        "err_no_answer": "No answer from the server in {n} s (the connection may have dropped): try again.",
        "err_other": "Something went wrong on the server (it is logged there): try again.",
        "err_not_classifier": "The answer did not come from the classifier (HTTP {status}: a proxy or gateway in "
                              "between may have failed, or the server is restarting): try again.",
        "err_page": "Something went wrong in this page while it handled the answer: try again.",
    },
    "zh": {
        "title": "AI万物识别",
        "intro": "选择照片，模型会说出每张照片里最可能是什么。",
        "language": "语言",
        "model": "模型：",
        "untrained": "未训练",
        "fallback": "离线备用模型",
        "note_fallback": "此服务器上没有 ResNet-18 权重，现由离线模型 EfficientNet-Lite0 识别。",
        "note_untrained": "此模型为随机权重（仅用于测速），识别结果没有意义。",
        "details": "详情",
        "starting": "模型仍在启动，就绪后即可识别照片。",
        "photos": "选择照片",
        "photos_hint": "支持 JPEG、PNG、WebP、GIF、BMP、TIFF、AVIF、PPM，可一次选多张。",
        "nojs_limits": "未启用 JavaScript 时照片按原文件上传：一次最多 {files} 张，合计不超过 {size}。",
        "camera": "拍照",
        "drop_hint": "也可以把照片拖到这里，或直接粘贴（Ctrl+V）。",
        "privacy": "照片上传时不含位置和相机信息（EXIF），较大的照片会先在浏览器中缩小；每张照片的卡片会说明上传方式（本浏览器无法读取的文件按原文件上传）。",
        "dropping": "松开即可识别这些照片",
        "topk": "每张照片的标签数",
        "submit": "识别",
        "clear_results": "清除结果",
        "try_again": "重试",
        "try_again_named": "重试：{name}",
        "retry_all": "重试失败的 {n} 张",
        "results": "识别结果",
        "predictions": "{name} 最可能的标签",
        "preview_alt": "上传的照片 {name}",
        "no_preview": "无法预览",
        "server_said": "服务器的原话（英文）：",
        "pending": "识别中…",
        "retrying": "服务器繁忙：{n} 秒后自动重试…",
        "retrying_not_ready": "模型仍在启动：{n} 秒后自动重试…",
        "retrying_rate_limited": "短时间内上传太多：{n} 秒后自动重试…",
        "retrying_not_classifier": "代理没有转来识别服务的回答：{n} 秒后自动重试…",
        "working": "正在识别 {n} 张照片…",
        "working_one": "正在识别 1 张照片…",
        "done": "已识别 {ok}/{n} 张照片。",
        "done_one": "照片已识别。",
        "failed_one": "这张照片无法识别。",
        "meta": "{model} · {precision}",
        "size": "{width}×{height} {format}",
        "timing": "解码 {decode} 毫秒 · 等待组批 {queue} 毫秒 · 推理 {inference} 毫秒 · 总计 {total} 毫秒",
        "round_trip": "含上传 {ms} 毫秒",
        "scaled": "已在浏览器中缩小：{from} → {to}",
        "sent_as_is": "按原文件上传（含其中的元数据）：{size}",
        "sent_bare": "已去除元数据后上传：{size}",
        "sent_copy": "已转为无损 {format} 副本（不含元数据）后上传：{size}",
        "timing_label": "耗时：",
        "error_title": "无法识别",
        "error_title_no_page": "没有这个页面",
        "login_title": "需要登录",
        "login_text": "此页面需要服务器的访问令牌：请重新加载页面，并输入令牌作为密码（用户名任意）。",
        "err_no_file": "没有收到照片：文件是空的（0 字节），或者没有选择文件。",
        "err_length_required": "浏览器发送照片时没有说明其大小：请换一个浏览器再试。",
        "err_too_large": "文件太大：这张照片（或一次上传的照片数量）超出了服务器的限制。",
        "err_too_large_photo": "文件太大：这张照片超出了服务器的限制（字节数或像素数）。",
        "err_unsupported_media_type": "无法读取这种文件：请以 JPEG（8 位）、PNG、WebP、GIF、BMP、TIFF、AVIF 或 PPM 格式发送照片。",
        "err_undecodable_image": "照片已损坏（可能在复制时被截断），无法读取。",
        "err_overloaded": "服务器繁忙：请 {n} 秒后再试。",
        "err_overloaded_later": "服务器繁忙：请几秒后再试。",
        "err_overloaded_now": "服务器刚才繁忙：现在可以重试。",
        "err_rate_limited": "短时间内上传太多：请 {n} 秒后再试。",
        "err_rate_limited_later": "短时间内上传太多：请一分钟后再试。",
        "err_rate_limited_now": "短时间内上传太多：现在可以重试。",
        "err_not_ready": "模型仍在启动：请 {n} 秒后再试。",
        "err_not_ready_later": "模型仍在启动：请几秒后再试。",
        "err_not_ready_now": "模型刚才仍在启动：现在可以重试。",
        "err_timeout": "处理超时（服务器非常繁忙）：请重试。",
        "err_body_timeout": "上传中断（网络太慢或连接中断）：请重试。",
        "err_client_gone": "照片分类完成前连接已断开：请重试。",
        "err_unauthorized": "此服务器的 API 需要访问令牌。",
        "err_bad_request": "请求无法识别，具体原因见下方说明。",
        "err_not_found": "页面不存在。",
        "err_method_not_allowed": "该地址不接受这种请求。",
        "err_network": "无法连接服务器：请检查网络后重试。",
        "err_no_answer": "服务器 {n} 秒内没有回应（连接可能已断开）：请重试。",
        "err_other": "服务器出错（已记录）：请重试。",
        "err_not_classifier": "收到的回答不是识别服务给出的（HTTP {status}：中间的代理或网关可能出了故障，或服务器正在重启）：请重试。",
        "err_page": "此网页处理回答时出错：请重试。",
    },
}

# Model titles in the page's languages, by the catalog's model name (webapp/catalog.py holds the English
# ones; a test checks that every catalog model has one here in every other language).
MODEL_TITLES: dict[str, dict[str, str]] = {
    "zh": {
        "resnet18": "ResNet-18",
        "efficientnet_lite0": "EfficientNet-Lite0（离线模型）",
        "resnet18_seeded": "ResNet-18（未训练，随机权重）",
    },
}


def model_titles(lang: str) -> dict[str, str]:
    """Every catalog model's title in ``lang`` (the catalog's English title where there is no translation)."""
    own = MODEL_TITLES.get(lang, {})
    return {m.name: own.get(m.name, m.title) for m in catalog.MODELS}


def model_title(model: dict, lang: str) -> str:
    """An answer's ``model`` object's title in ``lang`` (its own title, then its name, for a model not in the catalog)."""
    return model_titles(lang).get(model.get("name"), model.get("title") or model.get("name") or "")


# Error codes whose words say "try again in N s" when the answer carries Retry-After (webapp/errors.py).
RETRY_CODES = RETRYABLE


def normalize(value: str | None) -> str | None:
    """``"zh"``, ``"zh-CN"``, ``"ZH_hans"``... -> ``"zh"``; ``"en-GB"`` -> ``"en"``; anything else -> None."""
    if not value:
        return None
    primary = value.strip().replace("_", "-").split("-")[0].lower()
    return primary if primary in LANGS else None


def choose(arg: str | None, cookie: str | None, accept_languages) -> str:
    """The language of a request: ``?lang=``, else the ``lang`` cookie, else ``Accept-Language``, else English.

    ``accept_languages`` is Werkzeug's ``request.accept_languages`` (its ``best_match`` falls back
    from ``zh-CN`` to ``zh``), or None.
    """
    for value in (arg, cookie):
        lang = normalize(value)
        if lang:
            return lang
    if accept_languages is not None:
        best = accept_languages.best_match(LANGS)
        if best:
            return best
    return DEFAULT_LANG


def read_labels(path: Path = LABELS_FILE) -> list[tuple[int, str, str]]:
    """The data file's rows ``(index, english, chinese)``, in file order; ``#`` lines are comments.

    :raises ValueError: a line without exactly three tab-separated fields, or an index that is not an integer.
    """
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"{path}:{n}: expected index<TAB>English<TAB>Chinese, got {line!r}")
        rows.append((int(fields[0]), fields[1], fields[2].strip()))
    return rows


@lru_cache(maxsize=None)
def labels(lang: str) -> tuple[str, ...] | None:
    """The 1000 ImageNet labels in ``lang`` by class index; None for English (the model's own labels)."""
    if lang == "en":
        return None
    rows = read_labels()
    if [r[0] for r in rows] != list(range(len(rows))):
        raise ValueError(f"{LABELS_FILE}: the indices are not 0..{len(rows) - 1} in order")
    return tuple(r[2] for r in rows)


def label(index: int, english: str, lang: str) -> str:
    """One prediction's label in ``lang`` (the English one where there is no translation)."""
    names = labels(lang)
    if names is None or not 0 <= index < len(names):
        return english
    return names[index]


def translate(answer: dict, lang: str) -> dict:
    """Put ``lang`` labels into a classify answer's predictions, in place (``index`` stays as it is)."""
    if lang != "en":
        for item in answer.get("results", ()):
            for p in item.get("predictions", ()):
                p["label"] = label(p["index"], p["label"], lang)
    return answer


def strings(lang: str) -> dict[str, str]:
    return STRINGS.get(lang, STRINGS[DEFAULT_LANG])


def error_text(code: str, lang: str, retry_after: str | int | None = None) -> str:
    """An error ``code`` (and the 429/503 ``Retry-After`` seconds, if known) in words for people."""
    t = strings(lang)
    if code in RETRY_CODES:
        try:
            n = int(retry_after)
        except (TypeError, ValueError):
            return t[f"err_{code}_later"]
        return t[f"err_{code}"].format(n=max(n, 1))
    return t.get(f"err_{code}", t["err_other"])


@lru_cache(maxsize=None)
def page_words(lang: str) -> dict:
    """``bundle``'s content but the labels (~5 KB, not ~40): what the page embeds for its script."""
    return {"lang": lang, "htmlLang": HTML_LANG[lang], "strings": strings(lang), "modelTitles": model_titles(lang),
            "retryable": list(RETRY_CODES)}


@lru_cache(maxsize=None)
def bundle(lang: str) -> tuple[bytes, str]:
    """What ``static/app.js`` loads for ``lang``: ``{"lang", "htmlLang", "strings", "labels", "modelTitles",
    "retryable"}`` as JSON bytes, and its short hash. ``modelTitles``: model name -> title in ``lang``;
    ``retryable``: the error codes whose words say "try again in N s"."""
    body = json.dumps({**page_words(lang), "labels": labels(lang)},
                      ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return body, hashlib.sha256(body).hexdigest()[:12]


@lru_cache(maxsize=None)
def bundle_gzip(lang: str) -> bytes:
    """``bundle(lang)``'s bytes gzip-compressed (level 9, no timestamp: the same bytes every time): the Chinese
    bundle is 16 KB, 8 KB compressed, on a first load over a slow phone link (cached a year after)."""
    return gzip.compress(bundle(lang)[0], 9, mtime=0)
