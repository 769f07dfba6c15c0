"""English and Simplified Chinese: the 1000 Chinese ImageNet labels, the UI strings, the language choice."""

import re
from pathlib import Path

import pytest
from werkzeug.datastructures import LanguageAccept
from werkzeug.http import parse_accept_header

from webapp import errors, i18n
from webapp.models import IMAGENET_CATEGORIES

ROOT = Path(__file__).resolve().parents[1]
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")


def test_the_data_file_has_1000_unique_chinese_labels_aligned_by_index():
    rows = i18n.read_labels()
    assert len(rows) == 1000
    assert [r[0] for r in rows] == list(range(1000))
    # The English column is the model's own category list, index for index: nothing shifted.
    assert [r[1] for r in rows] == IMAGENET_CATEGORIES
    zh = [r[2] for r in rows]
    assert all(name and name == name.strip() and "\t" not in name for name in zh)
    assert len(set(zh)) == 1000, sorted({n for n in zh if zh.count(n) > 1})
    untranslated = [(i, n) for i, n in enumerate(zh) if not CJK.search(n)]
    assert untranslated == [(605, "iPod")]  # a brand name; every other label is in Chinese
    assert list(i18n.labels("zh")) == zh and i18n.labels("en") is None


@pytest.mark.parametrize("index, english, chinese", [
    (0, "tench", "丁鲷"),
    (1, "goldfish", "金鱼"),
    (21, "kite", "鸢"),
    (22, "bald eagle", "白头海雕"),
    (130, "flamingo", "火烈鸟"),
    (151, "Chihuahua", "吉娃娃"),
    (207, "golden retriever", "金毛寻回犬"),
    (208, "Labrador retriever", "拉布拉多寻回犬"),
    (235, "German shepherd", "德国牧羊犬"),
    (249, "malamute", "阿拉斯加雪橇犬"),
    (250, "Siberian husky", "西伯利亚哈士奇"),
    (281, "tabby", "虎斑猫"),
    (291, "lion", "狮子"),
    (340, "zebra", "斑马"),
    (388, "giant panda", "大熊猫"),
    (409, "analog clock", "指针式时钟"),
    (504, "coffee mug", "咖啡马克杯"),
    (817, "sports car", "跑车"),
    (954, "banana", "香蕉"),
    (963, "pizza", "披萨"),
    (999, "toilet tissue", "卫生纸"),
])
def test_well_known_classes(index, english, chinese):
    assert IMAGENET_CATEGORIES[index] == english
    assert i18n.label(index, english, "zh") == chinese
    assert i18n.label(index, english, "en") == english


@pytest.mark.parametrize("a, b, za, zb", [
    (134, 517, "鹤", "起重机"),          # crane (bird) / crane (machine)
    (638, 639, "紧身衣", "连体泳衣"),    # maillot (tights) / maillot, tank suit
    (836, 837, "墨镜", "太阳镜"),        # sunglass / sunglasses
    (620, 681, "笔记本电脑", "便携电脑"),  # laptop / notebook computer
    (987, 998, "玉米", "玉米穗"),        # corn / ear
])
def test_near_duplicate_english_names_get_distinct_chinese_ones(a, b, za, zb):
    names = i18n.labels("zh")
    assert (names[a], names[b]) == (za, zb)


def test_translate_an_answer_keeps_indices():
    answer = {"results": [{"predictions": [{"label": "German shepherd", "index": 235, "probability": 0.4},
                                           {"label": "malamute", "index": 249, "probability": 0.3}]}]}
    i18n.translate(answer, "zh")
    assert [(p["label"], p["index"]) for p in answer["results"][0]["predictions"]] == [("德国牧羊犬", 235), ("阿拉斯加雪橇犬", 249)]
    assert i18n.label(5000, "made up", "zh") == "made up"  # out of range: the model's own label


def accept(header):
    return parse_accept_header(header, LanguageAccept)


@pytest.mark.parametrize("arg, cookie, header, expected", [
    (None, None, None, "en"),
    (None, None, "zh-CN,zh;q=0.9,en;q=0.8", "zh"),
    (None, None, "zh-Hans", "zh"),
    (None, None, "zh-TW", "zh"),
    (None, None, "en-GB,en;q=0.9,zh-CN;q=0.5", "en"),
    (None, None, "de-DE,zh;q=0.5", "zh"),
    (None, None, "fr-FR", "en"),
    (None, "zh", "en-US", "zh"),        # the remembered choice beats the browser's
    ("en", "zh", "zh-CN", "en"),        # the link beats both
    ("xx", "bogus", "zh", "zh"),        # invalid values are ignored
    ("ZH_cn", None, None, "zh"),
])
def test_choose_language(arg, cookie, header, expected):
    assert i18n.choose(arg, cookie, accept(header) if header else None) == expected


def test_both_languages_have_the_same_strings_and_placeholders():
    en, zh = i18n.STRINGS["en"], i18n.STRINGS["zh"]
    assert set(en) == set(zh)
    assert not set(en) & set(dir(dict)), "the template reads t.<key>: a key named like a dict method hides it"
    for key in en:
        assert set(re.findall(r"\{(\w+)\}", en[key])) == set(re.findall(r"\{(\w+)\}", zh[key])), key
        assert zh[key] and (CJK.search(zh[key]) or key in ("meta", "size")), key


HALF_WIDTH_BY_CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef][:;,?!]|[:;,?!][\u3000-\u303f\u4e00-\u9fff]")


def test_chinese_strings_use_full_width_punctuation_and_the_page_adds_none():
    """The Chinese page's screen-reader timing label read "耗时: " (tryout25): the template and app.js added an
    ASCII colon after the label in every language. Punctuation is the strings' own, full-width in Chinese."""
    for key, text in i18n.STRINGS["zh"].items():
        assert not HALF_WIDTH_BY_CJK.search(text), (key, text)
    for name in ("templates/index.html", "static/app.js"):
        source = (ROOT / name).read_text(encoding="utf-8")
        assert not re.search(r"(\}\}|tr\(\"\w+\"\)\s*\+\s*\")[:;,]", source), name


def test_every_catalog_model_has_a_title_in_every_language():
    """Titles live in the catalog (English) and in i18n.MODEL_TITLES (the others), keyed by model name."""
    from webapp import catalog

    for lang in i18n.LANGS:
        titles = i18n.model_titles(lang)
        assert set(titles) == set(catalog.NAMES)
        if lang != "en":
            assert set(i18n.MODEL_TITLES[lang]) == set(catalog.NAMES), f"{lang}: a model without its title"
    assert i18n.model_titles("en") == {m.name: m.title for m in catalog.MODELS}
    assert i18n.model_title({"name": "efficientnet_lite0", "title": "EfficientNet-Lite0 (offline)"}, "zh") == \
        "EfficientNet-Lite0（离线模型）"
    assert i18n.model_title({"name": "not_in_catalog", "title": "Custom"}, "zh") == "Custom"


def test_every_string_the_page_and_script_use_exists():
    template = (ROOT / "templates" / "index.html").read_text(encoding="utf-8")
    script = (ROOT / "static" / "app.js").read_text(encoding="utf-8")
    used = set(re.findall(r'data-t(?:-aria-label)?="(\w+)"', template)) | set(re.findall(r"\bt\.(\w+)", template))
    used |= set(re.findall(r'\btr\("(\w+)"', script))
    # The script's "try again in N s" codes come with the strings, from the error table.
    assert "state.i18n?.retryable" in script and i18n.RETRY_CODES == errors.RETRYABLE
    used |= {f"err_{code}{later}" for code in i18n.RETRY_CODES for later in ("", "_later", "_now")}
    assert used and used <= set(i18n.STRINGS["en"]), used - set(i18n.STRINGS["en"])


@pytest.mark.parametrize("code, retry, lang, words", [
    ("overloaded", "3", "en", "The server is busy: try again in 3 s."),
    ("overloaded", "3", "zh", "服务器繁忙：请 3 秒后再试。"),
    ("overloaded", None, "en", "The server is busy: try again in a few seconds."),
    ("rate_limited", 30, "en", "Too many photos in a short time: try again in 30 s."),
    ("not_ready", "5", "zh", "模型仍在启动：请 5 秒后再试。"),
    ("too_large", None, "en", "Too large: this photo (or this many photos at once) is more than the server accepts."),
    ("unsupported_media_type", None, "zh", "无法读取这种文件：请以 JPEG（8 位）、PNG、WebP、GIF、BMP、TIFF、AVIF 或 PPM 格式发送照片。"),
    ("something_new", None, "en", i18n.STRINGS["en"]["err_other"]),
])
def test_error_words(code, retry, lang, words):
    assert i18n.error_text(code, lang, retry) == words


def test_every_error_code_of_the_service_has_words():
    from webapp.access import Unauthorized

    codes = {cls.code for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.ServiceError)}
    codes |= {Unauthorized.code, "too_large", "not_found", "rate_limited"} | set(errors.BY_CODE)
    for code in codes - {"internal_error", "inference_failed"}:  # those two say "something went wrong"
        assert f"err_{code}" in i18n.STRINGS["en"], code
