"""The page in a real browser: Debian's Chromium driven by Playwright, against the real gunicorn as a
fresh clone runs it (the default model without ResNet-18 weights: the offline EfficientNet-Lite0 with
its notice, in the precision ``auto`` picks; eager, one worker).

With JavaScript: upload through the file input, see a dog breed in the bars, switch to Chinese in
place and see the Chinese label, drop a photo, paste one, reload (the language is remembered).
Without JavaScript: the plain form. On a phone-sized screen: no sideways scrolling, a camera button.
Photos scaled in the browser (static/scale.js): the bytes the page really sends (intercepted), no EXIF
in them, the same top-1 as the original through the API, the time to labels on a throttled phone
uplink with and without scaling, and the originals that must still go up as they are.
Screenshots land in the test's tmp dir; ``SCREENSHOT_TO=path.png`` copies the main one there too.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image
from torchvision.transforms import v2
from werkzeug.formparser import parse_form_data
from werkzeug.test import EnvironBuilder

from bench.exif_blocks import STORE
from bench.load import multipart_body
from bench.servers import http_json
from conftest import SHARED_IMAGES, encode, shared_image
from serving import Server
from webapp import imaging
from webapp.i18n import STRINGS

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
    # What a new user's page shows (docs/page.png is made here): the default model with no ResNet-18
    # weights in an empty hub cache and no download, so the offline one answers with its notice; eager,
    # so it is ready in seconds; precision auto, which serves this model in fp32 on every CPU (its
    # catalog entry's bf16_auto_off), so nothing is measured at start.
    srv = Server(tmp / "server.log", env={"TORCH_HOME": str(tmp / "torch")}, DOWNLOAD=0, COMPILE=0, WORKERS=1,
                 THREADS=0, MAX_BATCH_SIZE=4, CACHE_DIR=tmp / "cache", PRECISION="auto")
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
    """Wait until ``card`` shows its bars with one of ``wanted`` among its labels; return its labels.

    After a language switch the bars are there at once, in the old language, until the new strings
    arrive: so wait for the labels themselves, not just for bars."""
    card.locator(".predictions .label").first.wait_for()
    deadline = time.monotonic() + TIMEOUT_MS / 1e3
    while not set(got := card.locator(".label").all_inner_texts()) & set(wanted) and time.monotonic() < deadline:
        page.wait_for_timeout(100)
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
        precision = http_json(server.port, "/healthz")[1]["precision"]
        assert meta.startswith(f"EfficientNet-Lite0 (offline) · {precision}")
        assert page.locator(".model .tag").first.inner_text() == precision
        assert page.locator(".note [data-t=note_fallback]").is_visible()  # the fallback is said on the page
        timing = card.locator(".timing").inner_text()
        assert "decode" in timing and "wait for batch" in timing and "inference" in timing
        # and the time this browser waited, upload included (the server's total alone read "total 29 ms" after
        # a 15 s upload on a slow link)
        total, waited = (float(x) for x in re.search(r"total ([\d.]+)\xa0ms · with the upload ([\d.]+)\xa0ms", timing).groups())
        assert waited >= total
        # dog.jpg (768x576) is over the size worth sending (256 px short side): it goes up as a lossless
        # 341x256 copy, and the page says so
        assert card.locator(".timing .sent").inner_text() == "scaled in the browser: 164\xa0KB → 123\xa0KB"
        assert page.locator("#status").inner_text() == "Photo classified."

        # Switch language in place: the labels turn Chinese, the strings too, the choice is remembered.
        page.click(".langs a[data-lang=zh]")
        sync_api.expect(page.locator("html")).to_have_attribute("lang", "zh-Hans")
        wait_for_labels(page, card, DOG_ZH)
        assert page.locator("h1").inner_text() == "AI万物识别"
        assert page.locator(".langs a[data-lang=zh]").get_attribute("aria-current") == "true"
        assert card.locator("img.thumb").get_attribute("alt") == "上传的照片 dog.jpg"
        assert "解码" in card.locator(".timing").inner_text() and "含上传" in card.locator(".timing").inner_text()
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
        sync_api.expect(problem).to_contain_text("cannot be read here")
        page.click(".langs a[data-lang=zh]")
        sync_api.expect(problem).to_contain_text("无法读取这种文件")
        assert page.locator("#status").inner_text() == "这张照片无法识别。"

        # Reload: the server renders the remembered language (cookie), no script needed for that.
        page.reload()
        assert page.locator("html").get_attribute("lang") == "zh-Hans" and page.locator("h1").inner_text() == "AI万物识别"
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

    refusals = [(429, "overloaded"), (503, "not_ready")]

    def busy_once(route):
        calls.append(route.request.url)
        if len(calls) % 2 == 0:
            return route.continue_()
        status, code = refusals[len(calls) // 2]
        route.fulfill(status=status, headers={"Retry-After": "1"}, content_type="application/json",
                      body=json.dumps({"error": {"code": code, "message": "wait", "status": status}}))

    try:
        page.route("**/api/v1/predict*", busy_once)
        page.goto(server.url + "/")
        # The countdown says why, as the final error would: busy, or still starting (it said "busy" for both).
        for said in ("The server is busy: trying again in 1 s…", "The model is still starting: trying again in 1 s…"):
            page.set_input_files("#file", str(dog))
            card = page.locator(".result").first
            sync_api.expect(card.locator(".pending")).to_have_text(said)
            wait_for_labels(page, card, DOG_EN)
        assert len(calls) == 4 and "topk=3" in calls[0]
        # With CLASSIFIER_API_TOKEN set the API answers 401 to the page; the page's own form stays open.
        page.unroute("**/api/v1/predict*")
        page.route("**/api/v1/predict*", lambda route: route.fulfill(
            status=401, content_type="application/json",
            body=json.dumps({"error": {"code": "unauthorized", "message": "token needed", "status": 401}})))
        page.set_input_files("#file", str(dog))
        page.locator(".results[data-server] .label").first.wait_for()
        assert set(page.locator(".results[data-server] .label").all_inner_texts()) & set(DOG_EN)
        assert [e for e in tab.errors if not any(f"status of {n}" in e for n in (429, 503, 401))] == []
    finally:
        tab.close()


def test_photos_picked_while_others_run_are_counted_until_all_are_done(server, browser):
    """The status line (a live region) and aria-busy cover every photo in flight: a second pick answered
    while the first still ran said "Photo classified." and aria-busy false, the first one still spinning."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    held, hold_all = [], []

    def hold_first(route):
        if not held or hold_all:
            held.append(route)  # answered later, below
        else:
            route.continue_()

    try:
        page.route("**/api/v1/predict*", hold_first)
        page.goto(server.url + "/")
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        page.wait_for_function("() => document.querySelectorAll('.result .pending').length === 1")
        while not held:
            page.wait_for_timeout(20)
        page.set_input_files("#file", str(shared_image("eagle.jpg")))
        page.locator(".result").first.locator(".label").first.wait_for()  # the second pick's labels
        # the photo still in flight (it said "Classifying 2 photos…" with one of them answered: tryout33)
        assert page.locator("#status").inner_text() == "Classifying 1 photo…"
        assert page.locator("#cards").get_attribute("aria-busy") == "true"
        held[0].continue_()
        wait_for_labels(page, page.locator(".result").nth(1), DOG_EN)
        sync_api.expect(page.locator("#status")).to_have_text("2 of 2 photos classified.")
        assert page.locator("#cards").get_attribute("aria-busy") == "false"
        # "Clear results" with photos in flight keeps those where they are (it re-listed them oldest first).
        held.clear()
        hold_all.append(True)
        for name in ("kite.jpg", "giraffe.jpg", "horses.jpg"):
            page.set_input_files("#file", str(shared_image(name)))
        while len(held) < 3:
            page.wait_for_timeout(20)
        before = page.locator(".result .filename").all_inner_texts()
        assert before[:3] == ["horses.jpg", "giraffe.jpg", "kite.jpg"], before  # newest first
        page.locator("#clear").click()
        assert page.locator(".result .filename").all_inner_texts() == before[:3]
        # and the line counts those: it went blank, then said "5 of 5" beside three cards (tryout33)
        assert page.locator("#status").inner_text() == "Classifying 3 photos…"
        for route in held:
            route.continue_()
        sync_api.expect(page.locator("#status")).to_have_text("3 of 3 photos classified.")
        assert tab.errors == []
    finally:
        tab.close()


@pytest.mark.extended  # a token-protected API behind the page, rare (~3 s): with `-m extended`
def test_a_token_protected_api_falls_back_to_the_form_with_the_scaled_copies(server, browser):
    """With CLASSIFIER_API_TOKEN set the page's API calls get 401 and it falls back to its own form. It sent the
    originals there, EXIF and GPS included, under its promise that large photos go without them (tryout), and
    every photo of the page again. Now the form gets what the API would have: the scaled copy with its
    original_* fields, a photo sent as is with its four fields empty, and only the photos not yet answered."""
    from urllib.parse import urlsplit

    phone = with_camera_exif(shared_image("phone-12mp.jpg").read_bytes())
    small = encode(Image.open(shared_image("dog.jpg")).convert("RGB").resize((200, 150)), "PNG")
    tab = Page(browser, locale="en-US")
    page = tab.page
    posted = []
    page.on("request", lambda r: posted.append(r) if r.method == "POST" and urlsplit(r.url).path == "/" else None)
    try:
        page.route("**/api/v1/predict*", lambda route: route.fulfill(
            status=401, content_type="application/json",
            body=json.dumps({"error": {"code": "unauthorized", "message": "token needed", "status": 401}})))
        page.goto(server.url + "/")
        laden = metadata_laden("JPEG", (300, 240), quality=90)  # small already: goes as it is, its metadata not
        page.set_input_files("#file", files=[{"name": "phone.jpg", "mimeType": "image/jpeg", "buffer": phone},
                                             {"name": "small.png", "mimeType": "image/png", "buffer": small},
                                             {"name": "laden.jpg", "mimeType": "image/jpeg", "buffer": laden}])
        page.locator(".results[data-server] .label").first.wait_for()
        fields, files = sent_form(posted[0])
        sent = dict(files)
        assert sorted(sent) == ["laden.jpg", "phone.jpg", "small.png"] and sent["small.png"] == small
        assert same_photo_without_metadata(sent["laden.jpg"], laden) and b"PhoneMaker" not in sent["laden.jpg"]
        assert len(sent["phone.jpg"]) < len(phone) / 5 and b"PhoneMaker" not in sent["phone.jpg"]
        order = [name for name, _ in files]
        assert fields["original_format"] == ["JPEG" if n == "phone.jpg" else "" for n in order]
        assert fields["original_bytes"] == [str(len(phone)) if n == "phone.jpg" else "" for n in order]
        assert page.locator(".results[data-server] article.result:not(.failed)").count() == 3
        assert "German shepherd" in page.locator(".results[data-server]").inner_text()
    finally:
        tab.close()


def test_a_failed_cards_try_again_in_n_s_counts_down_to_now(server, browser):
    """A 429 whose Retry-After is too long to wait for on its own (rate limited, 40 s): the card said "try again in 40
    s" for as long as it stayed. It counts down to "you can try again now", its words only: the keyboard stays on
    its "Try again" button."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    refused = []

    def limited_once(route):
        if refused:
            return route.continue_()
        refused.append(route.request.url)
        route.fulfill(status=429, headers={"Retry-After": "40"}, content_type="application/json", body=json.dumps(
            {"error": {"code": "rate_limited", "message": "6 per 1 minute", "status": 429}}))

    try:
        page.clock.install()
        page.route("**/api/v1/predict*", limited_once)
        page.goto(server.url + "/")
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        card = page.locator(".result").first
        problem = card.locator(".problem")
        sync_api.expect(problem).to_have_text("Too many photos in a short time: try again in 40 s.")
        card.locator("button.retry").focus()
        page.clock.run_for(15_000)
        sync_api.expect(problem).to_have_text("Too many photos in a short time: try again in 25 s.")
        assert page.evaluate("document.activeElement === document.querySelector('.result button.retry')")
        page.clock.run_for(30_000)
        sync_api.expect(problem).to_have_text("Too many photos in a short time: you can try again now.")
        page.keyboard.press("Enter")
        wait_for_labels(page, card, DOG_EN)
        assert [e for e in tab.errors if "status of 429" not in e] == []
    finally:
        tab.close()


def test_a_failed_card_can_be_tried_again_and_a_malformed_answer_never_leaves_one_spinning(server, browser):
    """Busy, starting, timed out, failed or unreachable: the card says so and offers "Try again" (the photo is
    still in the page); it had no way back but picking the file again. A 200 without predictions (a proxy's
    page, a broken server) threw in the page and left the card spinning forever."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    answers = ["error", "malformed"]

    def flaky(route):
        if not answers:
            return route.continue_()
        kind = answers.pop(0)
        if kind == "error":
            route.fulfill(status=504, content_type="application/json", body=json.dumps(
                {"error": {"code": "timeout", "message": "no result within 30 s", "status": 504}}))
        else:
            route.fulfill(status=200, content_type="application/json", body='{"results": [{"filename": "x"}], "model": {}}')

    try:
        page.route("**/api/v1/predict*", flaky)
        page.goto(server.url + "/")
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        card = page.locator(".result").first
        card.locator("button.retry").click()  # waits for the failed card and its button
        card.locator(".problem").wait_for()  # the malformed 200: a failed card, not a spinner
        assert card.locator(".problem").inner_text() == (  # not "on the server (it is logged there)": it is not
            "The answer did not come from the classifier (HTTP 200: a proxy or gateway in between may have failed, "
            "or the server is restarting): try again.")
        # named for its photo: a screen reader's list of buttons said "Try again" for every failed card (tryout33)
        assert card.locator("button.retry").get_attribute("aria-label") == "Try again: dog.jpg"
        card.locator("button.retry").focus()
        page.keyboard.press("Enter")  # from the keyboard: focus stays on the card, not <body> (tryout16)
        assert page.evaluate("document.activeElement === document.querySelector('.result')")
        wait_for_labels(page, card, DOG_EN)
        assert card.locator("button.retry").count() == 0
        assert page.evaluate("document.activeElement === document.querySelector('.result')")
        sync_api.expect(page.locator("#status")).to_have_text("Photo classified.")
        # Not for a file the server cannot read: trying again would only be refused again.
        page.set_input_files("#file", files=[{"name": "notes.jpg", "mimeType": "image/jpeg", "buffer": b"not a photo"}])
        bad = page.locator(".result").first
        bad.locator(".problem").wait_for()
        assert bad.locator("button.retry").count() == 0
        assert [e for e in tab.errors if "status of 504" not in e and "status of 415" not in e] == []
    finally:
        tab.close()


def test_the_status_line_after_a_try_again_counts_the_photos_still_failed(server, browser):
    """Two photos picked one after the other failed (the server down), the first tried again: the line said "Photo
    classified." beside the other card, still failed (tryout29), and so after a later pick (tryout31). A batch
    counts every card still failed on the page; "Try the 2 failed again" sends the failed cards again at once."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    down = [True]

    def maybe_down(route):
        if not down[0]:
            return route.continue_()
        route.fulfill(status=504, content_type="application/json", body=json.dumps(
            {"error": {"code": "timeout", "message": "no result within 30 s", "status": 504}}))

    try:
        page.route("**/api/v1/predict*", maybe_down)
        page.goto(server.url + "/")
        for n, name in enumerate(("dog.jpg", "eagle.jpg"), 1):  # two picks: two batches, each ended failed
            page.set_input_files("#file", str(shared_image(name)))
            sync_api.expect(page.locator(".result button.retry")).to_have_count(n)
            sync_api.expect(page.locator("#status")).to_have_text(
                "The photo could not be classified." if n == 1 else "0 of 2 photos classified.")
        down[0] = False
        page.set_input_files("#file", str(shared_image("giraffe.jpg")))  # a new pick counts the failed cards too
        sync_api.expect(page.locator(".result .predictions")).to_have_count(1)
        sync_api.expect(page.locator("#status")).to_have_text("1 of 3 photos classified.")  # (tryout31)
        page.locator(".result:has-text('dog.jpg') button.retry").click()
        sync_api.expect(page.locator(".result .predictions")).to_have_count(2)
        sync_api.expect(page.locator("#status")).to_have_text("2 of 3 photos classified.")
        page.locator(".result button.retry").click()
        sync_api.expect(page.locator(".result .predictions")).to_have_count(3)
        sync_api.expect(page.locator("#status")).to_have_text("3 of 3 photos classified.")
        # Three picked at once, all failed, one tried again: the line said "Classifying 3 photos…" with one in
        # flight (tryout33: "Classifying 5 photos…" of five); it counts the photos in flight, the summary the batch
        page.locator("#clear").click()
        down[0] = True
        page.set_input_files("#file", [str(shared_image(n)) for n in ("dog.jpg", "eagle.jpg", "giraffe.jpg")])
        sync_api.expect(page.locator("#status")).to_have_text("0 of 3 photos classified.")
        sync_api.expect(page.locator("#retry-all")).to_have_text("Try the 3 failed again")
        held = []
        page.unroute("**/api/v1/predict*")
        page.route("**/api/v1/predict*", lambda route: held.append(route))
        page.locator(".result:has-text('eagle.jpg') button.retry").click()
        sync_api.expect(page.locator("#status")).to_have_text("Classifying 1 photo…")
        for _ in range(200):
            if held:
                break
            page.wait_for_timeout(50)
        held[0].continue_()
        sync_api.expect(page.locator("#status")).to_have_text("1 of 3 photos classified.")
        # The two still failed, sent again with one click (after a restart, each card had to be clicked: tryout33)
        sync_api.expect(page.locator("#retry-all")).to_have_text("Try the 2 failed again")
        page.unroute("**/api/v1/predict*")
        page.locator("#retry-all").click()
        sync_api.expect(page.locator(".result .predictions")).to_have_count(3)
        sync_api.expect(page.locator("#status")).to_have_text("3 of 3 photos classified.")
        sync_api.expect(page.locator("#retry-all")).to_be_hidden()
        page.locator("#clear").click()  # the cards and the line with them
        sync_api.expect(page.locator(".result")).to_have_count(0)
        assert page.locator("#status").inner_text() == ""
        assert [e for e in tab.errors if "status of 504" not in e] == []
    finally:
        tab.close()


@pytest.mark.extended  # a proxy's own error pages, rare (~8 s): with `-m extended`
def test_a_proxys_own_answers_are_said_as_such_and_its_gateway_errors_retried(server, browser):
    """Behind a proxy, its own pages reach the page: a 502 HTML page said "Something went wrong on the server (it is
    logged there)", where nothing was logged, and a 503 without the classifier's JSON (the server restarting
    behind the proxy) was not retried as the server's own 503 is (tryout). Now the card names the status and says
    the answer was not the classifier's; a 502/503/504 of that kind is retried (after 2 s without Retry-After);
    a proxy's 413 (its own body limit) is still "too large", in the page's language."""
    from webapp import i18n

    tab = Page(browser, locale="zh-CN")
    page = tab.page
    answers = ["503", "502", "502", "502"]
    calls = []

    def proxy(route):
        calls.append(time.monotonic())
        if not answers:
            return route.continue_()
        status = int(answers.pop(0))
        route.fulfill(status=status, content_type="text/html",
                      body=f"<html><body><h1>{status}</h1><hr>nginx</body></html>")

    zh = i18n.strings("zh")
    try:
        page.route("**/api/v1/predict*", proxy)
        page.goto(server.url + "/?lang=zh")
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        card = page.locator(".result").first
        sync_api.expect(card.locator(".pending")).to_contain_text(zh["retrying_not_classifier"].split("{n}")[0])
        card.locator("button.retry").wait_for()  # 503, then 502 twice more: retried twice, then said
        assert card.locator(".problem").inner_text() == zh["err_not_classifier"].format(status=502)
        assert len(calls) == 3 and calls[1] - calls[0] >= 1.9 and calls[2] - calls[1] >= 1.9, calls
        card.locator("button.retry").click()  # the last 502, retried by itself, then the real server
        wait_for_labels(page, card, DOG_ZH)
        assert len(calls) == 5, calls
        answers.append("413")
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        big = page.locator(".result").first
        big.locator(".problem").wait_for()
        assert big.locator(".problem").inner_text() == zh["err_too_large_photo"]  # one photo a request
    finally:
        tab.close()


@pytest.mark.extended  # a server that never answers the page, rare (~3 s): with `-m extended`
def test_an_answer_that_never_comes_is_a_failed_card_in_time(server, browser):
    """A link that drops without a reset (Wi-Fi gone, a laptop asleep, a proxy that holds on) left the card
    "Classifying…" for good: fetch has no timeout of its own. The page waits what the server says (its
    REQUEST_TIMEOUT_S + 30 s) plus the upload at 8 KB/s, then says no answer came and offers "Try again"."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    held = []
    try:
        page.route("**/api/v1/predict*", lambda route: held.append(route))  # taken, never answered
        page.goto(server.url + "/")
        assert page.evaluate("document.body.dataset.answerWithinS") == "60.0"  # the server's 30 s + 30
        page.evaluate("document.body.dataset.answerWithinS = '1'")  # this test's patience
        t0 = time.monotonic()
        small = encode(Image.open(shared_image("dog.jpg")).convert("RGB").resize((96, 64)), "JPEG")  # ~3 KB: ~0.4 s more
        page.set_input_files("#file", files=[{"name": "dog.jpg", "mimeType": "image/jpeg", "buffer": small}])
        card = page.locator(".result").first
        card.locator(".problem").wait_for()
        took = time.monotonic() - t0
        words = card.locator(".problem").inner_text()
        assert words == "No answer from the server in 1 s (the connection may have dropped): try again.", words
        assert held and 1 <= took < 15, took
        page.unroute("**/api/v1/predict*")
        card.locator("button.retry").click()
        card.locator(".predictions .label").first.wait_for()  # the server's answer, this time
    finally:
        tab.close()


def test_the_pages_words_are_there_before_and_without_the_language_bundle(server, browser):
    """On a slow link the cards said "pending", "err_other", "timing_label: scaled · timing" until the bundle
    (/i18n/<lang>.json: the words and the labels) arrived, on a zh page too, and for good if it failed (tryout).
    The page carries its words; the bundle only adds the labels in its language (English ones meanwhile)."""
    from webapp import i18n

    zh = i18n.strings("zh")
    tab = Page(browser, locale="zh-CN")
    page = tab.page
    try:
        page.route("**/i18n/*", lambda route: route.abort())  # never comes
        page.goto(server.url + "/?lang=zh")
        page.set_input_files("#file", files=[
            {"name": "dog.jpg", "mimeType": "image/jpeg", "buffer": shared_image("dog.jpg").read_bytes()},
            {"name": "notes.jpg", "mimeType": "image/jpeg", "buffer": b"not a photo"}])
        failed = page.locator(".result.failed")
        sync_api.expect(failed.locator(".problem")).to_have_text(zh["err_unsupported_media_type"])
        # the server's English words under them, said to be so (tryout16: English under the Chinese, unexplained)
        assert failed.locator(".detail").inner_text().startswith(zh["server_said"])
        assert failed.locator(".detail span[lang=en]").inner_text().startswith("notes.jpg")
        good = page.locator(".result:not(.failed)")
        wait_for_labels(page, good, DOG_EN)  # the labels in English: those come with the bundle
        assert zh["timing_label"] in good.locator(".timing").inner_text()
        sync_api.expect(page.locator("#status")).to_have_text(zh["done"].format(ok=1, n=2))
    finally:
        tab.close()


def test_a_bidi_override_in_a_file_name_is_shown_as_a_replacement_character(server, browser):
    """"x\u202eexe.jpg" showed as "xgpj.exe" on its card (tryout); the name sent is the file's own."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": "x\u202eexe.jpg", "mimeType": "image/jpeg",
                                              "buffer": shared_image("dog.jpg").read_bytes()}])
        card = page.locator(".result").first
        wait_for_labels(page, card, DOG_EN)
        assert card.locator(".filename").inner_text() == "x\ufffdexe.jpg"
        assert "\u202e" not in card.inner_html() and list(rec.sent()) == ["x\u202eexe.jpg"]
    finally:
        tab.close()


def test_labels_per_photo_outside_the_forms_rule_is_brought_into_it_and_shown(server, browser):
    """The plain form refuses 0 or 11 (min 1, max 10); with JavaScript 0 gave 3 labels, -3 one, and the field
    kept showing what was typed."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    try:
        page.goto(server.url + "/")
        default = page.locator("#topk").input_value()
        for typed, used in [("0", "1"), ("11", "10"), ("2.5", "2"), ("-3", "1"), ("", default), ("5", "5")]:
            if page.locator("#clear").is_visible():
                page.locator("#clear").click()
            page.fill("#topk", typed)
            page.set_input_files("#file", str(shared_image("dog.jpg")))
            card = page.locator(".result").first
            card.locator(".label").first.wait_for()
            assert (card.locator(".label").count(), page.locator("#topk").input_value()) == (int(used), used), typed
        assert tab.errors == []
    finally:
        tab.close()


@pytest.mark.parametrize("platform, key", [("MacIntel", "⌘V"), ("Win32", "Ctrl+V")])
def test_the_paste_hint_names_this_keyboards_shortcut(server, browser, platform, key):
    tab = Page(browser, locale="en-US")
    page = tab.page
    page.add_init_script(f"Object.defineProperty(navigator, 'platform', {{ get: () => '{platform}' }});"
                         "Object.defineProperty(navigator, 'userAgentData', { get: () => undefined });")
    try:
        page.goto(server.url + "/")
        sync_api.expect(page.locator(".drop-hint")).to_have_text(f"You can also drop photos here, or paste one ({key}).")
        page.click(".langs a[data-lang=zh]")  # the strings applied again: the key stays this keyboard's
        sync_api.expect(page.locator(".drop-hint")).to_have_text(STRINGS["zh"]["drop_hint"].replace("Ctrl+V", key))
        assert tab.errors == []
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
        assert not page.locator(".drop-hint").is_visible()  # no dropping and no Ctrl+V on a phone (tryout16)
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
        assert page.get_by_text("未启用 JavaScript 时照片按原文件上传：一次最多 16 张，合计不超过 33 MB。").is_visible()
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        page.click("button[type=submit]")
        page.wait_for_load_state()
        assert set(page.locator(".result .label").all_inner_texts()) & set(DOG_ZH)
        assert page.locator("#status").inner_text() == STRINGS["zh"]["done_one"]  # the summary, as with a script
        assert page.locator(".result img.thumb").get_attribute("alt") == "上传的照片 dog.jpg"
        page.screenshot(path=tmp_path / "nojs.png", full_page=True)
        # The language link works without a script too.
        page.click(".langs a[data-lang=en]")
        assert page.locator("html").get_attribute("lang") == "en"
    finally:
        tab.close()


# ------------------------------------------------------------------------- photos scaled in the browser
PHONE = "phone-12mp.jpg"
SEND_SHORT_SIDE = 256  # what /api/v1/models says for the offline model (checked below, not assumed)
# The target of #15: the top-1 probability within 3 points of the original's. A scaled copy is the image
# the server's own resize would make from a full decode of the original (static/resample.js, checked
# here bit for bit), so it can only differ where the server's answer to the original comes from its
# reduced-scale JPEG decode (imaging.decode: the 12 MP photos, at 1/4): 1.5 points on
# phone-12mp-exif-rotated.jpg, 0 elsewhere. The copies this replaced (Chromium's "high" resize to 512 px,
# JPEG q0.9) moved it 5-12 points: this model is that sensitive to resampling.
SCALED_DRIFT_MAX = 0.03
BATCHING_DRIFT_MAX = 1e-5  # a probability, the same input in batches of other sizes (fp32 rounding)
UPLINK = {"offline": False, "latency": 40, "uploadThroughput": 10e6 / 8, "downloadThroughput": 10e6 / 8}


def sent_form(request) -> tuple[dict[str, list[str]], list[tuple[str, bytes]]]:
    """The multipart body a page really sent: its text fields, and its ``file`` parts as (name, bytes)."""
    body = request.post_data_buffer
    assert body, "the intercepted request has no body"
    env = EnvironBuilder(method="POST", input_stream=io.BytesIO(body), content_length=len(body),
                         content_type=request.headers["content-type"]).get_environ()
    _, form, files = parse_form_data(env)
    return {k: form.getlist(k) for k in form}, [(f.filename, f.read()) for f in files.getlist("file")]


class Recorder:
    """Intercepts the page's uploads (their bodies, as sent) and keeps the API's JSON answers by filename."""

    def __init__(self, page):
        self.requests, self.answers = [], {}
        page.route("**/api/v1/predict*", self._route)
        page.on("response", self._response)

    def _route(self, route):
        self.requests.append(route.request)
        route.continue_()

    def _response(self, resp):
        if "/api/v1/predict" in resp.url and resp.status == 200:
            for r in resp.json()["results"]:
                self.answers[r["filename"]] = r

    def sent(self) -> dict[str, tuple[dict, bytes, int]]:
        """filename -> (text fields, file bytes, whole body bytes) of every upload so far."""
        out = {}
        for req in self.requests:
            fields, ((name, data),) = sent_form(req)
            out[name] = (fields, data, len(req.post_data_buffer))
        return out


def with_camera_exif(jpeg: bytes) -> bytes:
    """``jpeg`` with an EXIF block (APP1) as a phone writes one, inserted without re-encoding: camera make,
    model and serial number, and a GPS position."""
    exif = Image.Exif()
    exif[0x010F], exif[0x0110] = "PhoneMaker", "Phone 12"  # Make, Model
    exif.get_ifd(0x8769)[0xA431] = "SN-0042-TEST"  # BodySerialNumber
    exif.get_ifd(0x8825).update({1: "N", 2: (48.0, 51.0, 29.0), 3: "E", 4: (2.0, 17.0, 40.0)})  # GPS
    block = exif.tobytes()
    assert jpeg[:2] == b"\xff\xd8"
    return jpeg[:2] + b"\xff\xe1" + (len(block) + 2).to_bytes(2, "big") + block + jpeg[2:]


def metadata_laden(fmt: str, size: tuple[int, int], **save) -> bytes:
    """dog.jpg at ``size``, stored turned (EXIF Orientation 6: shown upright only where it is applied), as
    ``fmt`` with what a phone or an editor writes beside the pixels: camera make, model and serial, a GPS
    position, XMP (with a location), a comment or text chunks."""
    with Image.open(shared_image("dog.jpg")) as im:
        upright = im.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    exif = Image.Exif()
    exif[0x010F], exif[0x0110], exif[0x0112] = "PhoneMaker", "Phone 12", 6
    exif.get_ifd(0x8769)[0xA431] = "SN-0042-TEST"
    exif.get_ifd(0x8825).update({1: "N", 2: (48.0, 51.0, 29.0), 3: "E", 4: (2.0, 17.0, 40.0)})
    xmp = b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><photoshop:City>Secretville</photoshop:City></x:xmpmeta>'
    out = io.BytesIO()
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # Orientation 6 turns it back
    if fmt == "PNG":
        from PIL.PngImagePlugin import PngInfo

        text = PngInfo()
        text.add_text("Comment", "taken at Secretville")
        text.add_itxt("XML:com.adobe.xmp", xmp.decode())
        stored.save(out, "PNG", exif=exif, pnginfo=text)
    elif fmt == "MPO":  # a phone's photo with a second image after it (a gain map, a depth map)
        stored.save(out, "MPO", save_all=True, append_images=[stored.resize((64, 48))], exif=exif, **save)
    elif fmt == "MOTION":  # a Motion Photo: the JPEG, then its video after the EOI
        stored.save(out, "JPEG", exif=exif, xmp=xmp, **save)
        out.write(b"\0\0\0\x18ftypmp42\0\0\0\0mp42isom" + bytes(2000) + b"Secretville video")
    else:
        stored.save(out, fmt, exif=exif, xmp=xmp, **({"comment": b"taken at Secretville"} if fmt == "JPEG" else {}),
                    **save)
    return out.getvalue()


def data_after_eoi(jpeg: bytes) -> bytes:
    """What follows a JPEG's EOI (its marker segments and scans walked, as the server walks them)."""
    from webapp.formats import jpeg_segments

    last = list(jpeg_segments(jpeg, scans=True))[-1]
    return jpeg[last.end:]


@pytest.mark.parametrize("name, fmt, size, save", [
    ("small.jpg", "JPEG", (300, 240), {"quality": 90}),  # at the model's size already: goes as it is
    ("larger.jpg", "JPEG", (1200, 795), {"quality": 35}),  # a copy would be no smaller (tryout16)
    ("small.png", "PNG", (300, 240), {}),
    ("small.webp", "WEBP", (300, 240), {"quality": 90}),
    ("phone.mpo.jpg", "MPO", (300, 240), {"quality": 90}),
    ("motion.jpg", "MOTION", (300, 240), {"quality": 90}),
    ("progressive.jpg", "JPEG", (300, 240), {"quality": 90, "progressive": True}),
])
def test_a_photo_sent_as_it_is_goes_without_its_metadata_and_keeps_its_answer(server, browser, name, fmt, size,
                                                                                save):
    """The page says photos go up without their location or camera data; a photo it does not scale (small
    already, a copy no smaller, another format with an orientation) went up whole, GPS and all (tryout16).
    It goes without its metadata now, its orientation kept, and the server answers it as it answers the file."""
    original = metadata_laden(fmt, size, **save)
    assert b"PhoneMaker" in original and b"SN-0042" in original and (fmt == "MPO" or b"Secretville" in original)
    if fmt == "MOTION":
        assert data_after_eoi(original)
    tab = Page(browser, locale="en-US", viewport={"width": 1100, "height": 900})
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": name, "mimeType": "image/jpeg", "buffer": original}])
        card = page.locator(".result").first
        wait_for_labels(page, card, DOG_EN)
        _, data, _ = rec.sent()[name]
        assert not any(secret in data for secret in (b"PhoneMaker", b"SN-0042", b"Secretville", b"xmpmeta")), name
        if fmt in ("JPEG", "MPO", "MOTION"):
            assert data_after_eoi(data) == b"", name  # nothing after the photo: no video, no second image
        how = card.get_attribute("data-sent")
        print(f"\n{name}: {len(original):,} bytes, sent {how}: {len(data):,} bytes")
        with Image.open(io.BytesIO(data)) as sent:
            if how != "scaled":  # as it is, without its metadata: the same pixels, the orientation alone kept
                with Image.open(io.BytesIO(original)) as im:
                    assert sent.format == ("JPEG" if fmt in ("MPO", "MOTION") else im.format) and sent.size == im.size
                    assert np.array_equal(np.asarray(sent.convert("RGB")), np.asarray(im.convert("RGB")))
                assert dict(sent.getexif()) == {0x0112: 6}, dict(sent.getexif())
                assert card.locator(".timing .sent").inner_text() == \
                    f"sent without its metadata: {round(len(data) / 1e3)}\xa0KB"
        reference = api_answer(server, name, original)  # the file as it is, through the API
        got = rec.answers[name]
        assert [p["label"] for p in got["predictions"]] == [p["label"] for p in reference["predictions"]]
        assert all(abs(a["probability"] - b["probability"]) < 1e-4
                   for a, b in zip(got["predictions"], reference["predictions"]))
        assert tab.errors == []
    finally:
        tab.close()


@pytest.mark.parametrize("name, size, quality, how", [
    ("small.avif", (300, 240), 90, "private"),  # at the model's size already: a lossless copy at its own size
    ("larger.avif", (2016, 1512), 30, "scaled"),  # the scaled copy, though larger than the file
])
def test_an_avif_goes_as_a_copy_without_its_metadata(server, browser, name, size, quality, how):
    """strip.js takes no AVIF apart, so an AVIF small already, or whose scaled copy was larger, went up as it was:
    camera, serial number and GPS position included, under the page's promise (tryout29). It goes as a lossless
    copy of the browser's decode now, answered as the file is (another decoder's rounding: within 2 points)."""
    original = metadata_laden("AVIF", size, quality=quality)
    assert b"PhoneMaker" in original and b"SN-0042" in original and b"Secretville" in original
    tab = Page(browser, locale="en-US", viewport={"width": 1100, "height": 900})
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": name, "mimeType": "image/avif", "buffer": original}])
        card = page.locator(".result").first
        wait_for_labels(page, card, DOG_EN)
        assert card.get_attribute("data-sent") == how
        _, data, _ = rec.sent()[name]
        assert not any(secret in data for secret in (b"PhoneMaker", b"SN-0042", b"Secretville", b"xmpmeta")), name
        with Image.open(io.BytesIO(data)) as sent:
            assert sent.format in ("WEBP", "PNG") and not dict(sent.getexif())
            if how == "private":  # the card names the file's format, as a scaled copy's card does, and the copy's
                assert sent.size == (size[0], size[1]) and card.locator(".timing .sent").inner_text() == \
                    f"sent as a lossless {sent.format} copy, without its metadata: {round(len(data) / 1e3)}\xa0KB"
            else:
                assert len(data) > len(original), (len(data), len(original))  # else this case tests nothing
        assert card.locator(".meta").inner_text().endswith(f"{size[0]}×{size[1]} AVIF")  # (said WEBP: tryout31)
        reference, got = api_answer(server, name, original)["predictions"], rec.answers[name]["predictions"]
        assert got[0]["label"] == reference[0]["label"], (got, reference)
        assert abs(got[0]["probability"] - reference[0]["probability"]) < 0.02, (got, reference)
        assert tab.errors == []
    finally:
        tab.close()


def test_a_failed_models_request_is_asked_again_and_a_photo_meanwhile_goes_without_its_metadata(server, browser):
    """tryout33: one failed ``GET /api/v1/models`` (a 503 while the server restarted) was kept for the page's life, and
    every photo after it went whole, GPS position and camera serial included, its card saying "sent as is". A
    failed request is asked again for the next photo now, and a photo that has no size to scale to goes at its own
    size without its metadata."""
    phone = with_camera_exif(shared_image("phone-12mp.jpg").read_bytes())
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    asked = []

    def failing_twice(route):
        asked.append(route.request.url)
        if len(asked) <= 2:  # the page's own at load, and the first photo's
            route.fulfill(status=503, headers={"Retry-After": "5"}, content_type="application/json",
                          body=json.dumps({"error": {"code": "not_ready", "message": "starting", "status": 503}}))
        else:
            route.continue_()

    try:
        page.route("**/api/v1/models*", failing_twice)
        page.goto(server.url + "/")
        deadline = time.monotonic() + 10
        while not asked and time.monotonic() < deadline:
            page.wait_for_timeout(50)
        page.wait_for_timeout(300)  # its answer handled
        for name, how in [("first.jpg", "unscaled"), ("second.jpg", "scaled")]:
            page.set_input_files("#file", files=[{"name": name, "mimeType": "image/jpeg", "buffer": phone}])
            card = page.locator(f".result:has-text('{name}')")
            wait_for_labels(page, card, DOG_EN)
            assert card.get_attribute("data-sent") == how, (name, card.get_attribute("data-sent"))
            sent = rec.sent()[name][1]
            assert not any(s in sent for s in (b"PhoneMaker", b"SN-0042", b"Exif")), name
        assert same_photo_without_metadata(rec.sent()["first.jpg"][1], phone)  # at its own size, its scans as they are
        assert len(rec.sent()["second.jpg"][1]) < len(phone) / 5 and len(asked) == 3
        assert page.locator(".result:has-text('first.jpg') .timing .sent").inner_text().startswith(
            "sent without its metadata: 3.")
    finally:
        tab.close()


@pytest.mark.extended  # a language bundle lost or late, rare (~8 s): with `-m extended`
def test_a_bundle_that_failed_is_asked_again_and_a_late_one_never_undoes_a_language_switch(server, browser):
    """tryout33: one failed zh.json at load left a Chinese page's labels English for good; and an en.json that came
    after the switch to Chinese was applied over the Chinese one (labels and status line English, the heading,
    cookie and aria-current Chinese). A failed bundle is asked again; a late one is dropped."""
    dog = {"name": "dog.jpg", "mimeType": "image/jpeg", "buffer": shared_image("dog.jpg").read_bytes()}
    tab = Page(browser, locale="zh-CN")
    page = tab.page
    failed = []
    try:
        page.route("**/i18n/zh.json*", lambda route: failed.append(1) or route.abort() if not failed else route.continue_())
        page.goto(server.url + "/?lang=zh")
        page.set_input_files("#file", files=[dog])
        wait_for_labels(page, page.locator(".result").first, DOG_ZH)  # once the bundle came, its second time
        assert failed == [1]
    finally:
        tab.close()
    tab = Page(browser, locale="en-US")
    page = tab.page
    held = []
    try:
        page.route("**/i18n/en.json*", lambda route: held.append(route))  # answered below, after the switch
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[dog])
        card = page.locator(".result").first
        wait_for_labels(page, card, DOG_EN)
        page.click(".langs a[data-lang=zh]")
        wait_for_labels(page, card, DOG_ZH)
        assert len(held) == 1
        held[0].continue_()  # the English bundle, late
        page.wait_for_timeout(500)
        assert card.locator(".label").first.inner_text() == DOG_ZH[0]
        assert page.locator("#status").inner_text() == STRINGS["zh"]["done_one"]
    finally:
        tab.close()


def _gif_with_metadata(frames: int) -> bytes:
    """dog.jpg as a GIF of ``frames`` frames (each a shade darker), with a comment and an XMP application extension
    (its sub-blocks as the XMP spec writes them) before the first frame."""
    dog = Image.open(shared_image("dog.jpg")).convert("RGB").resize((240, 180))
    shades = [Image.eval(dog, lambda v, k=k: v * (10 - k) // 10) for k in range(frames)]
    buf = io.BytesIO()
    shades[0].save(buf, "GIF", save_all=frames > 1, append_images=shades[1:], duration=100, loop=0,
                   comment=b"taken at Secretville by PhoneMaker")
    data = buf.getvalue()
    xmp = b'<x:xmpmeta xmlns:x="adobe:ns:meta/">SN-0042</x:xmpmeta>'
    ext = b"\x21\xff\x0bXMP DataXMP" + b"".join(bytes([len(c)]) + c for c in (xmp[i:i + 255] for i in range(0, len(xmp), 255))) + b"\x00"
    at = 13 + (3 * 2 ** ((data[10] & 7) + 1) if data[10] & 0x80 else 0)  # after the header and global colour table
    return data[:at] + ext + data[at:]


def test_gifs_bmps_and_jpegs_cut_without_their_end_go_without_their_metadata(server, browser):
    """tryout31, after the fixes of tryout29: a small BMP or GIF (strip.js takes neither apart) went whole, its lossless
    copy made of a decode already closed; an animated GIF went with its comment and XMP; a JPEG cut short without its
    end marker (Chromium cannot decode it) went with its camera and GPS data. None of them does now, and each gets
    the API's answer for the file itself."""
    from PIL import ImageSequence

    dog = Image.open(shared_image("dog.jpg")).convert("RGB")
    bmp = encode(dog.resize((200, 150)), "BMP") + with_camera_exif(b"\xff\xd8")[2:]  # EXIF bytes after the pixels
    cut = with_camera_exif(encode(dog, "JPEG", quality=92, progressive=True))
    files = {"small.bmp": (bmp, "private"), "still.gif": (_gif_with_metadata(1), "small"),
             "moving.gif": (_gif_with_metadata(3), "animated"), "cut.jpg": (cut[:int(len(cut) * 0.6)], "undecodable")}
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        for name, (data, how) in files.items():
            assert any(s in data for s in (b"PhoneMaker", b"SN-0042")), name
            page.set_input_files("#file", files=[{"name": name, "mimeType": "application/octet-stream", "buffer": data}])
            card = page.locator(f".result:has-text('{name}')")
            card.locator(".timing, .problem").first.wait_for()
            assert card.get_attribute("data-sent") == how, name
            if how == "private":  # the file's format, not its lossless copy's
                assert card.locator(".meta").inner_text().endswith("200×150 BMP"), card.locator(".meta").inner_text()
            sent = rec.sent()[name][1]
            assert not any(s in sent for s in (b"PhoneMaker", b"SN-0042", b"Secretville", b"XMP Data")), name
            if name == "moving.gif":  # the same frames, their timing too
                with Image.open(io.BytesIO(sent)) as a, Image.open(io.BytesIO(data)) as b:
                    assert a.n_frames == b.n_frames == 3 and a.info.get("duration") == b.info.get("duration")
                    assert all(np.array_equal(np.asarray(x.convert("RGB")), np.asarray(y.convert("RGB")))
                               for x, y in zip(ImageSequence.Iterator(a), ImageSequence.Iterator(b)))
            if name == "cut.jpg":  # its scans as they are, and the server's answer to the file itself: its 400
                body, ctype = multipart_body(data, name)
                status, answer = http_json(server.port, "/api/v1/predict", body=body, headers={"Content-Type": ctype})
                assert scans(sent) == scans(data) and status == 400, (status, answer)
                assert card.locator(".problem").inner_text() == "The photo is damaged (perhaps cut short while " \
                    "copying) and cannot be read." and answer["error"]["code"] == "undecodable_image", answer
                continue
            want = api_answer(server, name, data)["predictions"][0]
            got = rec.answers[name]["predictions"][0]
            assert got["label"] == want["label"] and abs(got["probability"] - want["probability"]) < 0.02, name
        assert [e for e in tab.errors if "status of 400" not in e] == []
    finally:
        tab.close()


def same_photo_without_metadata(sent: bytes, original: bytes) -> bool:
    """Whether ``sent`` is ``original`` as static/strip.js sends a photo it does not scale: the same pixels, and
    of its EXIF the orientation alone, if any."""
    with Image.open(io.BytesIO(sent)) as a, Image.open(io.BytesIO(original)) as b:
        exif = dict(a.getexif())
        return (set(exif) <= {0x0112} and exif.get(0x0112, 1) == b.getexif().get(0x0112, 1) and a.size == b.size
                and np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB"))))


def api_answer(server, name: str, data: bytes) -> dict:
    """The API's result for ``data`` uploaded as it is (the reference the page must match)."""
    body, ctype = multipart_body(data, name)
    status, answer = http_json(server.port, "/api/v1/predict?topk=3", body=body,
                               headers={"Content-Type": ctype}, timeout=60)
    assert status == 200, answer
    return answer["results"][0]


def api_top1(server, path: Path) -> dict:
    """Top-1 of the original file uploaded to the API as it is (the reference the page must match)."""
    body, ctype = multipart_body(path.read_bytes(), path.name)
    status, answer = http_json(server.port, "/api/v1/predict?topk=3", body=body,
                               headers={"Content-Type": ctype}, timeout=60)
    assert status == 200, answer
    return answer["results"][0]


def test_page_reads_the_size_worth_sending_from_the_api(server):
    status, models = http_json(server.port, "/api/v1/models")
    (serving,) = [m for m in models["models"] if m["serving"]]
    assert status == 200 and (serving["send_short_side"], serving["send_resample"]) == (SEND_SHORT_SIDE, "bilinear")


# (w, h) -> (ow, oh): odd sizes, factors from 1.01 to 40, one axis kept, a strip of one pixel, and the
# 12 MP photo's factor (4032x3024 -> 341x256, 11.8x: its own size is checked on the photo itself, in
# test_every_shared_photo_scaled_in_the_browser_keeps_its_top1; 48 MB of noise through Playwright took a minute).
RESAMPLE_CASES = [((37, 23), (11, 7)), ((1000, 10), (300, 3)), ((257, 256), (256, 255)), ((64, 48), (64, 12)),
                  ((48, 64), (12, 64)), ((400, 1), (10, 1)), ((1008, 756), (85, 64)), ((801, 999), (20, 25))]


def test_the_pages_resize_is_pillows_bit_for_bit(server, browser):
    """static/resample.js against Pillow's own Image.resize(BILINEAR) on noise (where every rounding shows)."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    try:
        page.goto(server.url + "/")
        for (w, h), (ow, oh) in RESAMPLE_CASES:
            rng = np.random.default_rng(w * 7919 + h)
            src = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            rgba = np.dstack([src, np.full((h, w), 255, np.uint8)])
            got = page.evaluate("""async ([b64, w, h, ow, oh]) => {
                const { resize } = await import("/static/resample.js");
                const rgba = Uint8ClampedArray.from(atob(b64), (c) => c.charCodeAt(0));
                const out = resize(rgba, w, h, ow, oh, "bilinear");
                let s = "";
                for (let i = 0; i < out.length; i += 0x8000) s += String.fromCharCode(...out.subarray(i, i + 0x8000));
                return btoa(s);
            }""", [base64.b64encode(rgba.tobytes()).decode(), w, h, ow, oh])
            out = np.frombuffer(base64.b64decode(got), np.uint8).reshape(oh, ow, 4)
            want = np.asarray(Image.fromarray(src).resize((ow, oh), Image.Resampling.BILINEAR))
            assert (out[..., 3] == 255).all()
            diff = np.abs(out[..., :3].astype(int) - want)
            assert diff.max() == 0, f"{w}x{h} -> {ow}x{oh}: {int((diff > 0).sum())} values differ, by up to {diff.max()}"
        sizes = page.evaluate("""async () => {
            const { resizedSize } = await import("/static/resample.js");
            return [resizedSize(4032, 3024, 256), resizedSize(3024, 4032, 256), resizedSize(1352, 900, 256),
                    resizedSize(500, 500, 256), resizedSize(773, 512, 256)];
        }""")
        # torchvision's own output size for Resize(256) on each
        want = [v2.functional.resize(Image.new("RGB", wh), [256]).size
                for wh in ((4032, 3024), (3024, 4032), (1352, 900), (500, 500), (773, 512))]
        assert [tuple(x) for x in sizes] == want
        assert tab.errors == []
    finally:
        tab.close()


def test_phone_photo_goes_up_scaled_upright_and_without_exif(server, browser, tmp_path):
    original = with_camera_exif(shared_image(PHONE).read_bytes())
    with Image.open(io.BytesIO(original)) as im:  # what must not leave the browser
        assert im.getexif().get_ifd(0x8825)[2] == (48.0, 51.0, 29.0) and im.getexif()[0x0110] == "Phone 12"
    tab = Page(browser, locale="en-US", viewport={"width": 1100, "height": 900})
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        assert page.locator("#privacy").inner_text() == STRINGS["en"]["privacy"]
        page.set_input_files("#file", files=[{"name": PHONE, "mimeType": "image/jpeg", "buffer": original}])
        card = page.locator(".result").first
        wait_for_labels(page, card, DOG_EN)
        fields, data, wire = rec.sent()[PHONE]
        print(f"\n{PHONE}: {len(original):,} bytes; the page sent a {len(data):,}-byte WebP in a {wire:,}-byte "
              f"request body: {len(original) / wire:.1f}x fewer bytes on the wire")
        assert len(original) / wire >= 25
        with Image.open(io.BytesIO(data)) as sent:
            assert sent.format == "WEBP" and sent.size == (341, 256)  # lossless: checked in the next test
            assert not sent.getexif() and "exif" not in sent.info
        assert b"Exif\0\0" not in data and b"SN-0042" not in data and b"PhoneMaker" not in data
        assert fields == {"original_width": ["4032"], "original_height": ["3024"], "original_format": ["JPEG"],
                          "original_bytes": [str(len(original))]}
        assert card.get_attribute("data-sent") == "scaled"
        answer = rec.answers[PHONE]
        assert (answer["width"], answer["height"], answer["bytes"]) == (4032, 3024, len(original))
        assert answer["scaled_by_client"] == {"width": 341, "height": 256, "format": "WEBP", "bytes": len(data)}
        assert card.locator(".meta").inner_text().endswith("4032×3024 JPEG")
        assert card.locator(".timing .sent").inner_text() == f"scaled in the browser: 3.3\xa0MB → {round(len(data) / 1e3)}\xa0KB"
        page.click(".langs a[data-lang=zh]")
        wait_for_labels(page, card, DOG_ZH)
        assert card.locator(".timing .sent").inner_text().startswith("已在浏览器中缩小：3.3\xa0MB → ")
        assert page.locator("#privacy").inner_text() == STRINGS["zh"]["privacy"]
        page.mouse.move(0, 0)
        page.screenshot(path=tmp_path / "phone-photo-zh.png", full_page=True)
        assert tab.errors == []
    finally:
        tab.close()


def test_every_shared_photo_scaled_in_the_browser_keeps_its_top1(server, browser):
    photos = sorted(SHARED_IMAGES.glob("*.jpg"))
    assert {PHONE, "phone-12mp-exif-rotated.jpg", "dog.jpg"} <= {p.name for p in photos}
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        # Several at once (4 in flight), as in-memory files: Chromium streams a file chosen from disk
        # into the request, and the intercepted body then holds no copy of it to compare.
        page.set_input_files("#file", files=[{"name": p.name, "mimeType": "image/jpeg", "buffer": p.read_bytes()}
                                             for p in photos])
        sync_api.expect(page.locator(".result .predictions")).to_have_count(len(photos), timeout=120_000)
        sent = rec.sent()
        how = {n: page.locator(".result", has=page.locator(".filename", has_text=n)).get_attribute("data-sent")
               for n in sent}
    finally:
        tab.close()
    rows, scaled = [], 0
    for path in photos:
        ref, got = api_top1(server, path), rec.answers[path.name]
        fields, data, _ = sent[path.name]
        a, b = ref["predictions"][0], got["predictions"][0]
        rows.append(f"{path.name:28s} {how[path.name]:6s} {len(data):>9,} B  api {a['label']} {a['probability']:.3f}"
                    f"  page {b['label']} {b['probability']:.3f}")
        if how[path.name] == "scaled":
            scaled += 1
            with Image.open(io.BytesIO(data)) as im:
                assert min(im.size) == SEND_SHORT_SIDE and not im.getexif() and b"Exif\0\0" not in data
                # The very pixels the server's own Resize makes from a full decode of the original.
                full = imaging.decode(path.read_bytes(), max_pixels=10**8).image
                assert im.format in ("WEBP", "PNG") and im.convert("RGB").tobytes() == \
                    full.resize(im.size, Image.Resampling.BILINEAR).tobytes(), path.name
            # the original's upright size, as the server itself reads it from the original
            assert (got["width"], got["height"], got["bytes"]) == (ref["width"], ref["height"], path.stat().st_size)
        else:  # at or below the size already, or the copy would be no smaller: the file itself, byte for
            # byte, and no original_* fields
            assert (how[path.name] == "small" and min(ref["width"], ref["height"]) <= SEND_SHORT_SIDE
                    or how[path.name] == "larger" and min(ref["width"], ref["height"]) > SEND_SHORT_SIDE)
            assert same_photo_without_metadata(data, path.read_bytes()) and fields == {}
            assert "scaled_by_client" not in got
        drift = abs(b["probability"] - a["probability"])
        rows[-1] += f"  {100 * drift:4.1f} points"
        assert b["index"] == a["index"], rows[-1]  # the same top-1, every photo
        # the file itself: its answer, up to the float rounding of another batch size (four photos in flight here,
        # one through the API: 1e-6 apart once; README: a probability's last digit can vary with batching)
        assert drift <= (SCALED_DRIFT_MAX if how[path.name] == "scaled" else BATCHING_DRIFT_MAX), rows[-1]
    print("\n" + "\n".join(rows))
    assert scaled >= 7  # all but person.jpg (640x424, 114 KB: its copy is no smaller) and maybe one other


def test_a_strip_goes_up_as_the_part_the_server_keeps(server, browser):
    """Over 2:1 the server keeps the central 2:1 (imaging.center_limit) before its resize: the page's copy
    is that part, resized; the answer equals the original's through the API."""
    rng = np.random.default_rng(7)
    strips = {}
    for name, (w, h) in (("wide.jpg", (3000, 600)), ("tall.jpg", (500, 1700))):
        noise = Image.fromarray(rng.integers(0, 256, (h // 10, w // 10, 3), dtype=np.uint8))
        strips[name] = encode(noise.resize((w, h), Image.Resampling.BICUBIC), "JPEG", quality=95)
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": n, "mimeType": "image/jpeg", "buffer": d} for n, d in strips.items()])
        sync_api.expect(page.locator(".result .predictions")).to_have_count(2, timeout=60_000)
        sent = rec.sent()
        for name, data in strips.items():
            assert page.locator(".result", has=page.locator(".filename", has_text=name)).get_attribute("data-sent") == "scaled"
            full = imaging.decode(data, max_pixels=10**8).image
            w, h = full.size
            keep = 2 * min(w, h)
            off = (max(w, h) - keep) // 2
            view = full.crop((off, 0, off + keep, h) if w > h else (0, off, w, off + keep))
            with Image.open(io.BytesIO(sent[name][1])) as im:
                assert im.size == ((512, 256) if w > h else (256, 512))
                assert im.convert("RGB").tobytes() == view.resize(im.size, Image.Resampling.BILINEAR).tobytes(), name
            ref, got = api_answer(server, name, data), rec.answers[name]
            assert [p["index"] for p in got["predictions"]] == [p["index"] for p in ref["predictions"]]
            assert got["predictions"][0]["probability"] == pytest.approx(ref["predictions"][0]["probability"], abs=1e-4)
        assert tab.errors == []
    finally:
        tab.close()


def time_to_labels(browser, server, photo: Path, *, scale: bool) -> float:
    """ms from choosing ``photo`` (the input's change event) to its labels in the page, on a 10 Mbit/s,
    40 ms phone uplink (Chromium's own network emulation, CDP)."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    try:
        page.goto(server.url + ("/" if scale else "/?scale=0"))
        page.wait_for_load_state("networkidle")  # the page has asked /api/v1/models for the size already
        cdp = tab.context.new_cdp_session(page)
        cdp.send("Network.enable")
        cdp.send("Network.emulateNetworkConditions", UPLINK)
        page.evaluate("""() => {
            window.__t = {};
            document.getElementById("file").addEventListener("change", () => { window.__t.chosen = performance.now(); },
                                                             { capture: true, once: true });
            new MutationObserver((_, obs) => {
                if (!document.querySelector(".result .predictions")) return;
                window.__t.shown = performance.now();
                obs.disconnect();
            }).observe(document.getElementById("cards"), { childList: true, subtree: true });
        }""")
        page.set_input_files("#file", str(photo))
        wait_for_labels(page, page.locator(".result").first, DOG_EN)
        assert page.locator(".result").first.get_attribute("data-sent") == ("scaled" if scale else "off")
        t = page.evaluate("window.__t")
        return t["shown"] - t["chosen"]
    finally:
        tab.close()


@pytest.mark.extended  # a timing over a throttled uplink (~20 s on 2 cores): with `-m extended`
def test_throttled_phone_uplink_labels_come_sooner_scaled(server, browser):
    """On a 10 Mbit/s uplink the scaled copy's labels come several times sooner than the original's.

    How many times depends on the browser's CPU, which decodes, reads and resizes the 12 MP photo before
    the copy goes (~300 ms on a Zen 4 core: 5.7-5.9x; ~500 ms on a 2.45 GHz Zen 3: 4.0x), so the figure is
    printed, not asserted (a timing is a benchmark's, not a test's). Asserted: the throttle is real (the
    original's 3.25 MB take >= 2.6 s) and the copy wins by a margin no working scaling misses on any
    desktop CPU (>= 2x; sending the original, or a copy that is no smaller, gives ~1x)."""
    phone = shared_image(PHONE)
    runs: dict[bool, list[float]] = {True: [], False: []}
    for i in range(3):  # interleaved, so the machine's load hits both alike
        for scale in ((True, False) if i % 2 == 0 else (False, True)):
            runs[scale].append(time_to_labels(browser, server, phone, scale=scale))
    scaled, original = statistics.median(runs[True]), statistics.median(runs[False])
    print(f"\n{PHONE}, choosing it to labels on screen, uplink 10 Mbit/s + 40 ms: scaled in the browser "
          f"{scaled:.0f} ms (runs {', '.join(f'{t:.0f}' for t in runs[True])}), original "
          f"{original:.0f} ms (runs {', '.join(f'{t:.0f}' for t in runs[False])}): {original / scaled:.1f}x sooner")
    assert original >= 2600  # 3.25 MB at 10 Mbit/s: the emulation really throttled the upload
    assert original / scaled >= 2


@pytest.mark.parametrize("name, data, words", [
    ("IMG_0001.HEIC", b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(2000), "cannot be read here"),
    ("broken.jpg", b"\xff\xd8\xff\xe0" + b"not really a JPEG " * 200, "The photo is damaged"),
])
def test_what_the_browser_cannot_decode_goes_up_as_it_is(server, browser, name, data, words):
    card = _refused_as_it_is(server, browser, name, data, words, "undecodable")
    assert card["preview"] == "No preview"


def _refused_as_it_is(server, browser, name: str, data: bytes, words: str, how: str) -> dict:
    """Upload ``data`` as ``name`` on the page: its card must fail saying ``words``, sent as it is for the reason
    ``how`` (its ``data-sent``), the original byte for byte with no original_* fields; ``{"preview"}``: the card's
    preview text (where it has none)."""
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": name, "mimeType": "image/jpeg", "buffer": data}])
        card = page.locator(".result.failed")
        sync_api.expect(card.locator(".problem")).to_contain_text(words)
        assert card.get_attribute("data-sent") == how
        fields, sent, _ = rec.sent()[name]
        assert sent == data and fields == {}  # the original, byte for byte, and the server's own answer
        none = card.locator(".thumb.none")
        return {"preview": none.inner_text() if none.count() else None}
    finally:
        tab.close()


def _cut_and_closed(progressive: bool, kept: float) -> bytes:
    data = shared_image("dog.jpg").read_bytes()
    if progressive:
        data = encode(Image.open(io.BytesIO(data)), "JPEG", quality=90, progressive=True)
    return data[:int(len(data) * kept)] + b"\xff\xd9"


def test_a_webp_with_an_exif_orientation_goes_up_as_it_is_for_the_server_to_turn(server, browser):
    """Chromium does not apply a WebP's EXIF orientation when it decodes it: the page sent a sideways copy
    without EXIF (keeshond 18.8%, where curl gets German shepherd 40.1%). A non-JPEG file carrying an
    orientation now goes as it is and gets curl's answer; one without goes scaled as ever."""
    upright = Image.open(shared_image("dog.jpg")).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to view: stored turned the other way
    buf = io.BytesIO()
    upright.transpose(Image.Transpose.ROTATE_90).save(buf, "WEBP", lossless=True, exif=exif.tobytes())
    oriented = buf.getvalue()
    plain = encode(upright, "WEBP", lossless=True)
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        for name, data, how in [("oriented.webp", oriented, "oriented"), ("plain.webp", plain, "scaled")]:
            page.set_input_files("#file", files=[{"name": name, "mimeType": "image/webp", "buffer": data}])
            card = page.locator(f".result:has-text('{name}')")
            shown = wait_for_labels(page, card, DOG_EN)
            assert card.get_attribute("data-sent") == how
            assert shown[0] == api_answer(server, name, data)["predictions"][0]["label"]
        assert rec.sent()["oriented.webp"][1] == oriented
    finally:
        tab.close()


@pytest.mark.parametrize("fmt, prefix", [("WEBP", b""), ("PNG", b"Exif\x00\x00"), ("PNG", b"")],
                         ids=["webp", "png-exif-prefixed", "png"])
def test_a_photo_with_an_exif_orientation_is_previewed_upright(server, browser, fmt, prefix):
    """Its labels were the upright photo's, but its preview was the browser's decode as stored: sideways, mirrored
    or upside down beside them (orientations 2-8): a WebP (Chromium applies no WebP's orientation: tryout29), a
    PNG whose eXIf chunk holds JPEG's ``Exif\\0\\0`` prefix (the server reads through it, Chromium not:
    tryout31). Each preview is the upright photo now; a PNG as the spec writes it, which Chromium turns itself,
    is not turned twice."""
    dog = Image.open(shared_image("dog.jpg")).convert("RGB")
    small = np.asarray(dog.resize((96, 72)), dtype=float)
    files, sizes, how = [], {}, {}
    for (value, store), size in [*((item, (192, 144)) for item in sorted(STORE.items())), ((6, STORE[6]), (400, 300))]:
        exif = Image.Exif()
        exif[0x0112] = value
        buf = io.BytesIO()
        # (Pillow takes one "Exif\0\0" off a PNG's EXIF: with ``prefix`` its chunk holds the other)
        dog.resize(size).transpose(store).save(buf, fmt, exif=prefix + exif.tobytes(),
                                               **({"lossless": True} if fmt == "WEBP" else {}))
        name = f"o{value}-{size[0]}.{fmt.lower()}"
        files.append({"name": name, "mimeType": f"image/{fmt.lower()}", "buffer": buf.getvalue()})
        sizes[name], how[name] = size if size[0] <= 320 else (320, 240), "small" if size[1] <= 256 else "oriented"
    tab = Page(browser, locale="en-US")
    page = tab.page
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=files)
        for f in files:
            card = page.locator(f".result:has-text('{f['name']}')")
            wait_for_labels(page, card, DOG_EN)
            assert card.get_attribute("data-sent") == how[f["name"]]  # small ones and larger ones alike
            src = card.locator("img.thumb").get_attribute("src")
            with Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))) as shown:
                assert shown.size == sizes[f["name"]], (f["name"], shown.size)
                diff = np.abs(np.asarray(shown.convert("RGB").resize((96, 72)), dtype=float) - small).mean()
            assert diff < 12, (f["name"], diff)  # the upright photo (a JPEG preview of it); any turn is ~60
    finally:
        tab.close()


@pytest.mark.parametrize("progressive, kept", [(False, 0.5), (True, 0.1), (True, 0.4)],
                         ids=["baseline-half", "progressive-10pct", "progressive-40pct"])
def test_a_jpeg_cut_short_and_closed_goes_up_as_it_is_and_shows_the_servers_400(server, browser, progressive, kept):
    """Chromium decodes a JPEG cut and closed by EOI without an error (grey fill, or a blur where it is
    progressive), so a scaled copy would be a good photo of that, classified: the page sends the file as it
    is and shows the server's undecodable_image, as curl gets it."""
    data = _cut_and_closed(progressive, kept)
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": "cut.jpg", "mimeType": "image/jpeg", "buffer": data}])
        card = page.locator(".result.failed")
        sync_api.expect(card.locator(".problem")).to_contain_text("The photo is damaged")
        assert card.get_attribute("data-sent") == "incomplete"
        fields, sent, _ = rec.sent()["cut.jpg"]
        assert scans(sent) == scans(data) and fields == {}  # the photo's own scans, byte for byte
        assert b"Exif" not in sent and b"xmpmeta" not in sent and b"Photoshop" not in sent  # its metadata not: tryout29
    finally:
        tab.close()


def scans(jpeg: bytes) -> bytes:
    """A JPEG's bytes from its first SOS on: what strip.js keeps byte for byte (a file cut short included)."""
    from webapp.formats import jpeg_segments

    return jpeg[next(s.pos for s in jpeg_segments(jpeg) if s.marker == 0xDA):]


def test_a_whole_jpeg_with_a_real_grey_band_still_goes_up_scaled(server, browser):
    """The other side: a whole JPEG with an exact mid-grey edge goes as it is too (only the server can tell a
    band from a cut), and the server answers it with labels; a whole progressive JPEG goes scaled."""
    dog = Image.open(io.BytesIO(shared_image("dog.jpg").read_bytes())).convert("RGB")
    banded = dog.copy()
    banded.paste((128, 128, 128), (0, 576 - 64, 768, 576))
    files = {"band.jpg": with_camera_exif(encode(banded, "JPEG", quality=95)),
             "progressive.jpg": encode(dog, "JPEG", quality=90, progressive=True)}
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        for name, data in files.items():
            page.set_input_files("#file", files=[{"name": name, "mimeType": "image/jpeg", "buffer": data}])
            card = page.locator(f".result[data-sent]:has-text('{name}')").first
            wait_for_labels(page, card, DOG_EN)
        assert page.locator(".result:has-text('band.jpg')").get_attribute("data-sent") == "incomplete"
        assert page.locator(".result:has-text('progressive.jpg')").get_attribute("data-sent") == "scaled"
        sent = rec.sent()["band.jpg"][1]  # as it is, but without its camera and GPS data (they went: tryout29)
        assert scans(sent) == scans(files["band.jpg"]) and b"PhoneMaker" not in sent and b"SN-0042" not in sent
    finally:
        tab.close()


def _dog(mode: str = "RGB") -> Image.Image:
    with Image.open(shared_image("dog.jpg")) as im:
        return im.convert(mode)


def _without_segment(jpeg: bytes, marker: int) -> bytes:
    """``jpeg`` without its first marker segment ``marker`` (an APP14 Adobe, say), nothing re-encoded."""
    from webapp.formats import jpeg_segments

    seg = next(s for s in jpeg_segments(jpeg) if s.marker == marker)
    return jpeg[:seg.pos] + jpeg[seg.end:]


def _cmyk_without_adobe_marker() -> bytes:
    """dog.jpg as a CMYK JPEG without an Adobe APP14 marker, its inks stored as they are, as the server reads such
    a file (and Firefox; Chromium inverts every CMYK JPEG: a negative)."""
    inverted = Image.eval(_dog("CMYK"), lambda v: 255 - v)  # Pillow writes CMYK inverted, Adobe's way, with the marker
    return _without_segment(encode(inverted, "JPEG", quality=90), 0xEE)


def _animation(fmt: str, **save) -> bytes:
    """A fade-in: a fully transparent first frame, then dog.jpg (``fmt`` "WEBP" or "PNG": APNG)."""
    dog = _dog("RGBA")
    return encode(Image.new("RGBA", dog.size, (0, 0, 0, 0)), fmt, save_all=True, append_images=[dog],
                  duration=500, **save)


def _apng_default_image_apart() -> bytes:
    """An APNG whose default image (dog.jpg: what the server and PNG viewers take) is not a frame of its
    animation (a kite, then a giraffe: what an APNG-aware decoder shows first)."""
    dog = _dog()
    frames = [Image.open(shared_image(n)).convert("RGB").resize(dog.size) for n in ("kite.jpg", "giraffe.jpg")]
    return encode(dog, "PNG", save_all=True, default_image=True, append_images=frames, duration=500)


def _zero_dc() -> bytes:
    """dog.jpg with its first quantization table's DC entry set to 0 (a damaged DQT: the server refuses it)."""
    from webapp.formats import jpeg_segments

    data = bytearray(shared_image("dog.jpg").read_bytes())
    dqt = next(s for s in jpeg_segments(bytes(data)) if s.marker == 0xDB)
    data[dqt.pos + 5] = 0  # after FF DB, its length and Pq|Tq: entry 0 (zig-zag order), the DC
    return bytes(data)


def _luma_scan_only() -> bytes:
    """A sequential colour JPEG whose components come in separate scans (``cjpeg -scans``), cut and closed after
    its first, the luma's: a greyscale JPEG of dog.jpg (one component: its scan is a non-interleaved one) with
    its frame made Y, Cb, Cr at 1x1 each, so the browser decodes a colourless photo without an error."""
    from webapp.formats import jpeg_segments

    grey = encode(_dog("L"), "JPEG", quality=90)
    segs = list(jpeg_segments(grey, scans=True))
    out = bytearray(b"\xff\xd8")
    for seg, after in zip(segs, segs[1:] + [None]):
        if seg.marker == 0xC0:  # P, Y, X, Nf = 3; Ci, Hi|Vi, Tqi per component
            payload = grey[seg.pos + 4:seg.pos + 9] + b"\x03" + b"".join(bytes([c, 0x11, 0]) for c in (1, 2, 3))
            out += b"\xff\xc0" + (len(payload) + 2).to_bytes(2, "big") + payload
        elif seg.marker in (0xDB, 0xC4, 0xD9):
            out += grey[seg.pos:seg.end]
        elif seg.marker == 0xDA:  # its header and entropy-coded data
            out += grey[seg.pos:after.pos]
    return bytes(out)


@pytest.mark.parametrize("name, build, how", [
    ("fade-in.webp", lambda: _animation("WEBP", lossless=True), "animated"),
    ("fade-in.png", lambda: _animation("PNG"), "animated"),
    ("default-apart.png", _apng_default_image_apart, "animated"),
    ("two-frames.gif", lambda: encode(_dog("P"), "GIF", save_all=True, append_images=[
        Image.open(shared_image("kite.jpg")).convert("P").resize((768, 576))], duration=500), "animated"),
    ("cmyk.jpg", _cmyk_without_adobe_marker, "cmyk"),
], ids=["fade-in-webp", "fade-in-apng", "apng-default-image-apart", "gif", "cmyk-jpeg"])
@pytest.mark.extended  # animations and CMYK through the page, rare (~2 s each): with `-m extended`
def test_what_the_browser_decodes_otherwise_goes_up_as_it_is_for_the_servers_answer(server, browser, name, build,
                                                                                   how):
    """The browser's decode is not the server's for these (tryout): an animation's first frame as stored, where
    the server takes the first visible one (a fade-in's copy went up blank: "518 KB -> 520 B", nematode) or an
    APNG's default image; a CMYK JPEG without an Adobe marker, inverted by Chromium and not by the server (a
    negative). The file goes as it is, with no preview, and the page shows curl's answer."""
    data = build()
    reference = api_answer(server, name, data)
    if name.startswith(("fade-in", "default-apart", "cmyk")):
        assert reference["predictions"][0]["label"] == DOG_EN[0], reference  # the server sees the dog
    tab = Page(browser, locale="en-US")
    page = tab.page
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": name, "mimeType": "image/png", "buffer": data}])
        card = page.locator(".result").first
        wait_for_labels(page, card, [reference["predictions"][0]["label"]])
        assert card.get_attribute("data-sent") == how
        fields, sent, _ = rec.sent()[name]
        assert sent == data and fields == {}  # no metadata to take out: the file itself
        got = rec.answers[name]["predictions"]
        assert [p["label"] for p in got] == [p["label"] for p in reference["predictions"]]
        assert card.locator(".thumb.none").inner_text() == "No preview"  # this decode is not what is classified
        assert tab.errors == []
    finally:
        tab.close()


@pytest.mark.parametrize("name, build, how", [
    ("zero-dc.jpg", _zero_dc, "damaged"), ("luma-scan-only.jpg", _luma_scan_only, "incomplete"),
    ("ftp-ascii.jpg", lambda: re.sub(rb"(?<!\r)\n", b"\r\n", shared_image("phone-12mp.jpg").read_bytes()),
     "damaged")],
    ids=["zero-dc", "components-cut", "copied-as-text"])
@pytest.mark.extended  # damaged JPEGs through the page, rare (~3 s each): with `-m extended`
def test_a_jpeg_the_server_refuses_and_the_browser_decodes_goes_up_as_it_is(server, browser, name, build, how):
    """A JPEG with a 0 DC quantizer (grey where libjpeg decodes it), and a sequential one whose colour components
    come in separate scans, closed after the luma's (a colourless photo): Chromium decodes both without an error,
    and the page sent a good copy of that and showed labels, where the API answers 400. The file goes as it is
    now, and the page shows the server's undecodable_image."""
    data = build()
    body, ctype = multipart_body(data, name)
    status, answer = http_json(server.port, "/api/v1/predict", body=body, headers={"Content-Type": ctype},
                               timeout=60)
    assert status == 400 and answer["error"]["code"] == "undecodable_image", answer
    _refused_as_it_is(server, browser, name, data, "The photo is damaged", how)


# Encoders other browsers have: one without WebP (Safari: toBlob/convertToBlob then write PNG), one whose
# WebP at quality 1 is lossy (caught by decoding it back: PNG goes instead), and one that fails (the
# original goes). Set up before the page's script runs.
NO_WEBP = """{
    const original = OffscreenCanvas.prototype.convertToBlob;
    OffscreenCanvas.prototype.convertToBlob = function (o = {}) {
        return original.call(this, o.type === "image/webp" ? { ...o, type: "image/png" } : o);
    };
}"""
LOSSY_WEBP = """{
    const original = OffscreenCanvas.prototype.convertToBlob;
    OffscreenCanvas.prototype.convertToBlob = function (o = {}) {
        return original.call(this, o.type === "image/webp" ? { ...o, quality: 0.8 } : o);
    };
}"""
BROKEN_ENCODER = """{
    OffscreenCanvas.prototype.convertToBlob = () => Promise.reject(new Error("encoder broke"));
    HTMLCanvasElement.prototype.toBlob = function () { throw new Error("encoder broke"); };
}"""


@pytest.mark.parametrize("script, how, fmt", [(NO_WEBP, "scaled", "PNG"), (LOSSY_WEBP, "scaled", "PNG"),
                                              (BROKEN_ENCODER, "failed", None)],
                         ids=["no-webp-encoder", "lossy-webp", "encoder-fails"])
@pytest.mark.extended  # browsers without a lossless WebP encoder, rare (~3 s each): with `-m extended`
def test_scaling_without_a_lossless_webp_or_with_a_failing_encoder(server, browser, script, how, fmt):
    phone = shared_image(PHONE)
    original = phone.read_bytes()
    tab = Page(browser, locale="en-US")
    page = tab.page
    page.add_init_script(script)
    rec = Recorder(page)
    try:
        page.goto(server.url + "/")
        page.set_input_files("#file", files=[{"name": PHONE, "mimeType": "image/jpeg", "buffer": original}])
        card = page.locator(".result").first
        wait_for_labels(page, card, DOG_EN)  # the photo is answered either way
        assert card.get_attribute("data-sent") == how
        fields, data, _ = rec.sent()[PHONE]
        if how == "scaled":
            with Image.open(io.BytesIO(data)) as im:  # a PNG of the same pixels the WebP would have held
                assert im.format == fmt and im.size == (341, 256) and not im.getexif()
                full = imaging.decode(original, max_pixels=10**8).image
                assert im.convert("RGB").tobytes() == full.resize(im.size, Image.Resampling.BILINEAR).tobytes()
            assert len(original) / len(data) >= 10
        else:
            assert same_photo_without_metadata(data, original) and fields == {}
            assert card.locator(".timing .sent").inner_text() == "sent without its metadata: 3.3\xa0MB"
    finally:
        tab.close()


@pytest.mark.extended  # its own server, with a token (~15 s on 2 cores): with `-m extended`
@pytest.mark.parametrize("page_login", [False, True])
def test_with_an_api_token_each_pick_adds_its_card_and_the_earlier_ones_stay(tmp_path, browser, page_login):
    """With CLASSIFIER_API_TOKEN set the page fell back to its plain form on the API's 401: each new pick reloaded
    the page and the earlier cards were gone (tryout16). A real server with a token: the page sends each photo to
    its own route as JSON, never gets a 401, and two picks leave two cards with their labels. With PAGE_LOGIN the
    browser is asked for the token once (HTTP Basic; here Playwright's credentials answer) and the same holds."""
    token = "s3cret-token-value"
    srv = Server(tmp_path / "server.log", env={"TORCH_HOME": str(tmp_path / "torch")}, DOWNLOAD=0, COMPILE=0,
                 WORKERS=1, THREADS=0, MAX_BATCH_SIZE=4, CACHE_DIR=tmp_path / "cache", PRECISION="fp32",
                 API_TOKEN=token, PAGE_LOGIN=int(page_login))
    tab = None
    try:
        srv.wait_ready(1)
        if page_login:  # without the token the page is refused, with Basic's challenge
            refused = requests.get(srv.url + "/", timeout=30)
            assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Basic ")
        login = {"http_credentials": {"username": "me", "password": token}} if page_login else {}
        tab = Page(browser, locale="en-US", **login)
        page = tab.page
        statuses = []
        page.on("response", lambda r: statuses.append((r.request.method, r.url, r.status)))
        page.goto(srv.url + "/")
        page.set_input_files("#file", str(shared_image("dog.jpg")))
        wait_for_labels(page, page.locator(".result").first, DOG_EN)
        page.set_input_files("#file", str(shared_image("eagle.jpg")))
        sync_api.expect(page.locator(".result")).to_have_count(2)
        wait_for_labels(page, page.locator(".result").nth(1), DOG_EN)  # the first pick's card, still there
        page.locator(".result").first.locator(".predictions .label").first.wait_for()
        posts = [(url, status) for method, url, status in statuses if method == "POST"]
        assert [s for _, s in posts] == [200, 200] and all("/api/" not in url for url, _ in posts), posts
        assert page.locator(".results[data-server]").count() == 0  # no server-rendered page: never reloaded
        assert tab.errors == []
    finally:
        if tab is not None:
            tab.close()
        srv.stop()
