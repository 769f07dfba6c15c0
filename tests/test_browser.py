"""The page in a real browser: Debian's Chromium driven by Playwright, against the real gunicorn
(offline EfficientNet-Lite0, eager, one worker).

With JavaScript: upload through the file input, see a dog breed in the bars, switch to Chinese in
place and see the Chinese label, drop a photo, paste one, reload (the language is remembered).
Without JavaScript: the plain form. On a phone-sized screen: no sideways scrolling, a camera button.
Screenshots land in the test's tmp dir; ``SCREENSHOT_TO=path.png`` copies the main one there too.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import SHARED_IMAGES, shared_image
from serving import Server

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync"]
DOG_EN = ("German shepherd", "malamute")
DOG_ZH = ("德国牧羊犬", "阿拉斯加雪橇犬")
TIMEOUT_MS = 20_000

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements-dev.txt)")
if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not SHARED_IMAGES.is_dir():
        pytest.skip(f"{SHARED_IMAGES} is absent")
    tmp = tmp_path_factory.mktemp("browser-server")
    srv = Server(tmp / "server.log", MODEL="efficientnet_lite0", COMPILE=0, WORKERS=1, THREADS=0, MAX_BATCH_SIZE=4,
                 PRECISION="fp32", CACHE_DIR=tmp / "cache")
    try:
        srv.wait_ready(1)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


class Page:
    """A fresh context and page that records console errors (CSP violations show up there)."""

    def __init__(self, browser, **context):
        self.context = browser.new_context(**context)
        self.context.set_default_timeout(TIMEOUT_MS)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def close(self):
        self.context.close()


def labels(page) -> list[str]:
    return page.locator(".result").first.locator(".label").all_inner_texts()


def wait_for_labels(page, card, wanted) -> list[str]:
    """Wait until ``card`` shows its bars; return its labels (one of ``wanted`` must be among them)."""
    card.locator(".predictions .label").first.wait_for()
    got = card.locator(".label").all_inner_texts()
    assert set(got) & set(wanted), got
    return got


def drop_or_paste(page, path: Path, how: str) -> None:
    """Drop (or paste) ``path`` the way a person would: a DataTransfer holding the file, built in the page."""
    page.evaluate("""async ([b64, name, how]) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], name, { type: "image/jpeg" }));
        if (how === "paste") {
            document.dispatchEvent(new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true }));
            return;
        }
        const zone = document.getElementById("drop");
        for (const type of ["dragenter", "dragover", "drop"])
            zone.dispatchEvent(new DragEvent(type, { dataTransfer: dt, bubbles: true, cancelable: true }));
    }""", [base64.b64encode(path.read_bytes()).decode(), path.name, how])


def test_upload_switch_language_drop_and_paste(server, browser, tmp_path):
    dog, eagle, kite = shared_image("dog.jpg"), shared_image("eagle.jpg"), shared_image("kite.jpg")
    tab = Page(browser, locale="en-US", viewport={"width": 1100, "height": 900})
    page = tab.page
    try:
        page.goto(server.url + "/")
        assert page.locator("html").get_attribute("lang") == "en"
        assert page.locator("html").get_attribute("class") == "js"  # the script ran (CSP allows it)

        # Choose a photo: it is classified at once, previewed, and shown with labelled bars.
        page.set_input_files("#file", str(dog))
        card = page.locator(".result").first
        got = wait_for_labels(page, card, DOG_EN)
        assert len(got) == 3 and card.locator("progress.bar").count() == 3
        pcts = card.locator(".pct").all_inner_texts()
        assert all(p.endswith("%") for p in pcts) and float(pcts[0][:-1]) > 10
        assert card.locator("img.thumb").get_attribute("src").startswith("data:image/jpeg")
        assert card.locator("img.thumb").get_attribute("alt") == "Uploaded photo dog.jpg"
        meta = card.locator(".meta").inner_text()
        assert "EfficientNet-Lite0" in meta and "fp32" in meta
        timing = card.locator(".timing").inner_text()
        assert "decode" in timing and "queue" in timing and "inference" in timing
        assert page.locator("#status").inner_text() == "Photo classified."

        # Switch language in place: the labels turn Chinese, the strings too, the choice is remembered.
        page.click(".langs a[data-lang=zh]")
        sync_api.expect(page.locator("html")).to_have_attribute("lang", "zh-Hans")
        wait_for_labels(page, card, DOG_ZH)
        assert page.locator("h1").inner_text() == "照片识别"
        assert page.locator(".langs a[data-lang=zh]").get_attribute("aria-current") == "true"
        assert card.locator("img.thumb").get_attribute("alt") == "上传的照片 dog.jpg"
        assert "解码" in card.locator(".timing").inner_text()
        assert {"name": "lang", "value": "zh"} in [{k: c[k] for k in ("name", "value")} for c in tab.context.cookies()]

        # Drop a photo on the drop zone, and paste another: each gets its own card, newest first.
        drop_or_paste(page, eagle, "drop")
        page.locator(".result").nth(1).wait_for()
        wait_for_labels(page, page.locator(".result").first, ("鸢", "白头海雕"))
        drop_or_paste(page, kite, "paste")
        page.locator(".result").nth(2).wait_for()
        wait_for_labels(page, page.locator(".result").first, ("降落伞",))
        assert page.locator(".result .filename").all_inner_texts() == ["kite.jpg", "eagle.jpg", "dog.jpg"]

        page.screenshot(path=tmp_path / "page-zh.png", full_page=True)
        page.click(".langs a[data-lang=en]")
        sync_api.expect(page.locator("html")).to_have_attribute("lang", "en")
        wait_for_labels(page, page.locator(".result").nth(2), DOG_EN)
        page.mouse.move(0, 0)
        page.screenshot(path=tmp_path / "page.png", full_page=True)

        # A file that is not a photo: said in words, in the chosen language.
        page.set_input_files("#file", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"}])
        problem = page.locator(".result.failed .problem")
        sync_api.expect(problem).to_contain_text("Not a photo")
        page.click(".langs a[data-lang=zh]")
        sync_api.expect(problem).to_contain_text("这不是照片")
        assert page.locator("#status").inner_text() == "这张照片无法识别。"

        # Reload: the server renders the remembered language (cookie), no script needed for that.
        page.reload()
        assert page.locator("html").get_attribute("lang") == "zh-Hans" and page.locator("h1").inner_text() == "照片识别"
        # Chrome logs the deliberate 415 as a failed resource; nothing else (no CSP violation, no script error).
        assert [e for e in tab.errors if "status of 415" not in e] == []
    finally:
        tab.close()
    if os.environ.get("SCREENSHOT_TO"):
        dest = Path(os.environ["SCREENSHOT_TO"])
        if dest.is_dir():
            dest = dest / "page.png"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "page.png", dest)


def test_busy_api_is_retried_and_a_token_protected_api_falls_back_to_the_form(server, browser):
    dog = shared_image("dog.jpg")
    tab = Page(browser, locale="en-US")
    page = tab.page
    calls = []

    def busy_once(route):
        calls.append(route.request.url)
        if len(calls) > 1:
            return route.continue_()
        route.fulfill(status=429, headers={"Retry-After": "1"}, content_type="application/json",
                      body=json.dumps({"error": {"code": "overloaded", "message": "server busy", "status": 429}}))

    try:
        page.route("**/api/v1/predict*", busy_once)
        page.goto(server.url + "/")
        page.set_input_files("#file", str(dog))
        card = page.locator(".result").first
        sync_api.expect(card.locator(".pending")).to_have_text("The server is busy: trying again in 1 s…")
        wait_for_labels(page, card, DOG_EN)
        assert len(calls) == 2 and "topk=3" in calls[0]
        # With CLASSIFIER_API_TOKEN set the API answers 401 to the page; the page's own form stays open.
        page.unroute("**/api/v1/predict*")
        page.route("**/api/v1/predict*", lambda route: route.fulfill(
            status=401, content_type="application/json",
            body=json.dumps({"error": {"code": "unauthorized", "message": "token needed", "status": 401}})))
        page.set_input_files("#file", str(dog))
        page.locator(".results[data-server] .label").first.wait_for()
        assert set(page.locator(".results[data-server] .label").all_inner_texts()) & set(DOG_EN)
        assert [e for e in tab.errors if not ("status of 429" in e or "status of 401" in e)] == []
    finally:
        tab.close()


def test_phone_layout(server, browser, tmp_path):
    tab = Page(browser, locale="zh-CN", viewport={"width": 375, "height": 740}, device_scale_factor=2,
               is_mobile=True, has_touch=True)
    page = tab.page
    try:
        page.goto(server.url + "/")
        assert page.locator("html").get_attribute("lang") == "zh-Hans"  # from Accept-Language
        assert page.locator("label[for=camera]").is_visible()  # "Take a photo" on a touch screen
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        wait_for_labels(page, page.locator(".result").first, DOG_ZH)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")  # no sideways scrolling
        # (a viewport shot: a full-page one re-emulates the screen and drops touch for the capture)
        page.screenshot(path=tmp_path / "phone.png")
        assert tab.errors == []
    finally:
        tab.close()


def test_plain_form_without_javascript(server, browser, tmp_path):
    tab = Page(browser, locale="en-US", java_script_enabled=False)
    page = tab.page
    try:
        page.goto(server.url + "/?lang=zh")
        assert page.locator("html").get_attribute("class") == "no-js"
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        page.click("button[type=submit]")
        page.wait_for_load_state()
        assert set(page.locator(".result .label").all_inner_texts()) & set(DOG_ZH)
        assert page.locator(".result img.thumb").get_attribute("alt") == "上传的照片 dog.jpg"
        page.screenshot(path=tmp_path / "nojs.png", full_page=True)
        # The language link works without a script too.
        page.click(".langs a[data-lang=en]")
        assert page.locator("html").get_attribute("lang") == "en"
    finally:
        tab.close()
