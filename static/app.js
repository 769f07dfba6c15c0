// Progressive enhancement of the upload form (the page works without this file).
// Photos come from the file picker, the camera input, drag and drop or paste; each is scaled in the
// browser to the size the model needs (static/scale.js: one decode gives the upload and the preview;
// the original goes up where that cannot be done), sent on its own to POST /api/v1/predict (the
// server batches concurrent requests) and rendered with its top labels, model, precision, what was
// sent and the timing. The language switch applies in place.
// Strings and Chinese labels come from /i18n/<lang>.json (labels by ImageNet class index).

import { prepare, scalingOn, sendSize } from "./scale.js";

const MAX_PARALLEL = 4;     // photos in flight at once
const MAX_RETRIES = 2;      // automatic retries of a 429/503 that asks to wait at most RETRY_MAX_S
const RETRY_MAX_S = 10;
const BUNDLE_WAIT_MS = 3000;  // longest a card waits for the language bundle (its labels) before it shows
const GATEWAY_WAIT_S = 2;   // before retrying a proxy's 502/503/504 that gives no Retry-After (s)
// How long a photo waits for its answer before its card says so (ms): what the server gives (data-answer-within-s:
// its REQUEST_TIMEOUT_S + 30 s, webapp/ui.py) and the upload at 8 KB/s (64 kbit/s: an EDGE phone link still gets
// through; a typical scaled copy adds ~16 s). A link that drops without a reset (Wi-Fi gone, a laptop asleep, a
// proxy that holds on) left the card "Classifying…" for good.
const answerWithinMs = (bytes) => (Number(body.dataset.answerWithinS) || 60) * 1000 + bytes / 8;

const doc = document.documentElement;
const body = document.body;
const form = document.querySelector("form");
const drop = document.getElementById("drop");
const cards = document.getElementById("cards");
const results = cards.closest("section");
const status = document.getElementById("status");
const clearButton = document.getElementById("clear");
const retryAllButton = document.getElementById("retry-all");
const topk = document.getElementById("topk");
const pickers = [document.getElementById("file"), document.getElementById("camera")];

doc.classList.replace("no-js", "js");
if (scalingOn) sendSize(body.dataset.models);     // fetched once, before the first photo needs it
else document.getElementById("privacy").hidden = true;   // ?scale=0 (a diagnostic): originals go up

// The page's own words are in it (webapp/ui.py's page_words): right from the first paint, even if the bundle
// (which adds the labels in this language) is slow or never comes.
// The paste shortcut as this keyboard has it: ⌘V on a Mac (the hint said Ctrl+V there too: tryout16).
const MAC = /Mac/.test(navigator.userAgentData?.platform ?? navigator.platform ?? "");
function pasteKey() {
  if (MAC) for (const el of document.querySelectorAll(".drop-hint")) el.textContent = el.textContent.replace("Ctrl+V", "⌘V");
}
pasteKey();
const embedded = (() => { try { return JSON.parse(document.getElementById("words").textContent); } catch { return null; } })();
const state = { lang: body.dataset.lang, i18n: embedded, items: [], queue: [], running: 0, batch: null };
// The language last asked for: a bundle that comes after another language was chosen is not applied (a slow en.json
// turned the labels English after a switch to Chinese: tryout33).
const firstLang = body.dataset.lang;
let wanted = firstLang;
let loading = loadI18n(body.dataset.i18n, 4);   // asked again where it fails (one failure left it English for good)

async function loadI18n(url, tries = 1) {
  for (let i = 1; ; i += 1) {
    try {
      const resp = await fetch(url);
      if (!resp.ok) throw new Error(`${url}: HTTP ${resp.status}`);
      return await resp.json();
    } catch (e) {
      if (i >= tries) throw e;
      await new Promise((done) => setTimeout(done, 2000 * i));   // 2, 4, 6 s
    }
  }
}

const tr = (key, vars = {}) =>
  (state.i18n?.strings[key] ?? key).replace(/\{(\w+)\}/g, (m, k) => (k in vars ? vars[k] : m));

function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v === undefined || v === null || v === false) continue;
    if (k in el && k !== "lang") el[k] = v; else el.setAttribute(k, v);
  }
  el.append(...children.filter((c) => c !== null && c !== undefined));
  return el;
}

// -- taking photos in -------------------------------------------------------------------------
function add(files) {
  files = [...files].filter((f) => f instanceof File);
  if (!files.length || form.hidden) return;   // hidden: the page's sign-in failed (a drop or paste sends nothing)
  results.hidden = false;
  clearButton.hidden = false;
  const fresh = files.map((file, i) => ({
    file, name: file.name || `photo-${state.items.length + i + 1}.png`, thumb: undefined, sent: null,
    answer: null, error: null, waiting: null, card: null,
  }));
  state.items.push(...fresh);
  joinBatch(fresh);
  const frag = document.createDocumentFragment();
  for (const item of fresh) {
    item.card = h("article", { className: "result" });
    frag.append(item.card);
    render(item);
    state.queue.push(item);
  }
  cards.prepend(frag);
  showStatus();
  pump();
}

for (const input of pickers) {
  input.addEventListener("change", () => { add(input.files); input.value = ""; });
}
form.addEventListener("submit", (e) => {
  e.preventDefault();
  add(pickers.flatMap((p) => [...p.files]));
  for (const p of pickers) p.value = "";
});
clearButton.addEventListener("click", () => {
  state.items = state.items.filter((it) => !it.answer && !it.error);  // keep the ones still running
  const kept = new Set(state.items.map((it) => it.card));
  for (const card of [...cards.children]) if (!kept.has(card)) card.remove();   // the rest stay where they were
  // The status line counts the cards still there: "12 of 12" beside 8 cards, or nothing while they ran (tryout33)
  if (state.batch) state.batch.items = state.batch.items.filter((it) => state.items.includes(it));
  showStatus();
  clearButton.hidden = state.items.length === 0;
  results.hidden = state.items.length === 0;
  pickers[0].focus();
});

// Drag and drop anywhere on the page; the drop zone lights up.
let dragDepth = 0;
const hasFiles = (e) => [...(e.dataTransfer?.types ?? [])].includes("Files");
document.addEventListener("dragenter", (e) => {
  if (!hasFiles(e)) return;
  dragDepth += 1;
  drop.classList.add("dragging");
});
document.addEventListener("dragleave", () => {
  dragDepth = Math.max(0, dragDepth - 1);
  if (!dragDepth) drop.classList.remove("dragging");
});
document.addEventListener("dragover", (e) => {
  if (!hasFiles(e)) return;
  e.preventDefault();
  e.dataTransfer.dropEffect = "copy";
});
document.addEventListener("drop", (e) => {
  dragDepth = 0;
  drop.classList.remove("dragging");
  if (!e.dataTransfer?.files.length) return;
  e.preventDefault();
  add(e.dataTransfer.files);
});

// Paste a copied image (or copied image files) anywhere.
document.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData?.files ?? [])];
  if (!files.length) return;
  e.preventDefault();
  add(files);
});

// -- classifying -------------------------------------------------------------------------------
// Photos picked (or tried again) while others still run join their batch: the status line (a live region)
// and aria-busy count every photo in flight, and the summary covers them all, not only the latest pick.
// A new batch counts every card on the page still failed too: the line said "Photo classified." beside failed cards
// of an earlier batch (tryout29, tryout31).
function joinBatch(items) {
  const before = state.batch?.items ?? [];
  const running = before.some((it) => !it.answer && !it.error);
  const kept = running ? before : state.items.filter((it) => it.error);
  state.batch = { items: [...kept.filter((it) => !items.includes(it)), ...items] };
}

// A failed card's "Try again" (busy, starting, timed out, unreachable: not a file the server cannot read); "Try the
// 5 failed again" sends every such card at once (after a restart each card had to be clicked: tryout33).
const THE_FILES_OWN = ["no_file", "unsupported_media_type", "too_large", "undecodable_image", "bad_request"];
const againable = (item) => item.error && !THE_FILES_OWN.includes(item.error.code);
function retry(...items) {
  for (const item of items) {
    item.error = null;
    item.waiting = null;
  }
  joinBatch(items);   // (their batch's summary covers the batch: "3 of 5 photos classified")
  for (const item of items) {
    render(item);
    state.queue.push(item);
  }
  const first = items[0].card;   // the button is gone with the failure: keep the keyboard on a card, not <body>
  first.tabIndex = -1;
  first.focus();
  showStatus();
  pump();
}
retryAllButton.addEventListener("click", () => {
  // (in the cards' order on the page, newest first, as the photos were added)
  const order = [...cards.children];
  const items = state.items.filter(againable).sort((a, b) => order.indexOf(a.card) - order.indexOf(b.card));
  if (items.length) retry(...items);
});

function pump() {
  while (state.running < MAX_PARALLEL && state.queue.length) {
    const item = state.queue.shift();
    state.running += 1;
    classify(item)
      .catch(() => {   // never a card left spinning: whatever went wrong, it ends as a failed card
        item.answer = null;
        item.error ??= { code: "page" };
        try { render(item); } catch { item.card.className = "result failed"; }
      })
      .finally(() => { state.running -= 1; showStatus(); pump(); });
  }
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// The upload (scaled copy or original) and the preview, from one decode of the photo.
async function prepareItem(item) {
  const send = scalingOn ? await sendSize(body.dataset.models) : null;
  item.sent = await prepare(item.file, send);
  item.thumb = item.sent.thumb;
  item.card.dataset.sent = item.sent.why;
  render(item);
}

// Labels per photo: the form's own rule (1 to 10); what the field holds otherwise is brought into it (0 -> 1,
// 11 -> 10, 2.5 -> 2, empty or not a number -> the server's default) and shown there, so the page says what it used.
function labelsPerPhoto() {
  const v = Math.trunc(Number(topk.value));
  const k = topk.value.trim() === "" || !Number.isFinite(v) ? Number(topk.defaultValue) || 3 : Math.min(10, Math.max(1, v));
  if (topk.value !== String(k)) topk.value = String(k);
  return k;
}

async function classify(item) {
  const k = labelsPerPhoto();
  await prepareItem(item);
  for (let attempt = 0; ; attempt += 1) {
    const { blob, original } = item.sent;
    const data = new FormData();
    data.append("file", blob, item.name);
    if (original) {   // the server reports the photo as this original, marked scaled_by_client
      for (const key of ["width", "height", "format", "bytes"]) data.append(`original_${key}`, original[key]);
    }
    let resp, json = null;
    // (its upload shares the link with the others in flight: 4 photos at 6 KB/s all ran out of time: tryout33)
    const limit = answerWithinMs(blob.size * Math.max(1, state.running));
    const late = new AbortController(), timer = setTimeout(() => late.abort(), limit);
    try {
      const sentAt = performance.now();
      resp = await fetch(`${body.dataset.api}?topk=${k}`,
        { method: "POST", body: data, headers: { Accept: "application/json" }, signal: late.signal });
      json = await resp.json().catch((e) => { if (late.signal.aborted) throw e; return null; });
      item.roundTrip = performance.now() - sentAt;   // upload, server and answer, as this browser saw it (ms)
    } catch {
      item.error = late.signal.aborted ? { code: "no_answer", seconds: Math.round(limit / 1000) } : { code: "network" };
      break;
    } finally {
      clearTimeout(timer);
    }
    if (resp.ok && Array.isArray(json?.results?.[0]?.predictions) && json.model) {
      item.answer = json;
      break;
    }
    if (resp.status === 401) return submitPlainForm();   // API token set: the page itself stays open
    if (item.sent.blob !== item.sent.bare && (resp.status === 400 || resp.status === 415)) {
      // The server refused a copy (scaled, or at its own size): send the photo as if it had never been copied,
      // without its metadata where strip.js takes it out, else the file itself (the optimisations never lose a
      // photo). The photo without its metadata refused is the server's answer: its image data is the file's, byte
      // for byte, and the file itself sent after it went up with the GPS position the page promises to keep back.
      const next = item.sent.bare;
      item.sent = { ...item.sent, blob: next, original: null, why: "refused", kept: next === item.file };
      item.card.dataset.sent = "refused";
      continue;
    }
    const wait = parseInt(resp.headers.get("Retry-After"), 10);
    // Not the classifier's own answer (a proxy's or gateway's page, a 200 of another shape): said as such, with its
    // status, not as an error the server logged; a 502/503/504 of that kind (the server restarting behind a proxy)
    // is retried as the server's own 503 is, after GATEWAY_WAIT_S where it does not say how long.
    const code = json?.error?.code ?? (resp.status === 429 ? "overloaded" : resp.status === 413 ? "too_large" : "not_classifier");
    const gateway = code === "not_classifier" && [502, 503, 504].includes(resp.status);
    const pause = Number.isFinite(wait) ? wait : gateway ? GATEWAY_WAIT_S : NaN;
    if ((resp.status === 429 || resp.status === 503 || gateway) && pause >= 0 && pause <= RETRY_MAX_S && attempt < MAX_RETRIES) {
      for (let s = Math.max(1, pause); s > 0; s -= 1) {
        item.waiting = s;
        item.waitingFor = code;   // why: busy, starting or over the rate limit, said as the final error would
        render(item);
        await sleep(1000);
      }
      item.waiting = null;
      continue;
    }
    // (its "try again in 20 s" counts down on the card, to "try again now": it said 20 s for as long as it stayed)
    item.error = { code, status: resp.status, message: json?.error?.message, retryAfter: Number.isFinite(wait) ? wait : null,
                   until: Number.isFinite(wait) ? Date.now() + Math.max(1, wait) * 1000 : null };
    countDown();
    break;
  }
  // The labels in the page's language where its bundle comes within BUNDLE_WAIT_MS, else English now and the page's
  // when it comes (a bundle held on a slow link held every card with it)
  await Promise.race([loading.catch(() => {}), sleep(BUNDLE_WAIT_MS)]);
  render(item);
}

// The API needs a token this page does not have: send the photos not yet answered through the plain form
// instead, as they would have gone (the scaled copy, without EXIF, with its original_* fields; the others without
// their metadata where strip.js takes it, their four fields empty), so the page's promise about location and
// camera data still holds.
let submitted = false;
async function submitPlainForm() {
  if (submitted) return;
  submitted = true;
  const dt = new DataTransfer();
  const fields = { original_width: [], original_height: [], original_format: [], original_bytes: [] };
  for (const it of state.items.filter((x) => !x.answer)) {
    if (!it.sent) await prepareItem(it).catch(() => {});
    const copy = it.sent?.original ? it.sent : null, bare = it.sent?.bare ?? it.file;   // (strip.js: no metadata)
    dt.items.add(copy ? new File([copy.blob], it.name, { type: copy.blob.type })
      : bare === it.file ? it.file : new File([bare], it.name, { type: it.file.type }));
    for (const key of ["width", "height", "format", "bytes"]) fields[`original_${key}`].push(copy ? copy.original[key] : "");
  }
  if (fields.original_width.some((v) => v !== "")) {
    for (const [name, list] of Object.entries(fields)) {
      for (const value of list) form.append(h("input", { type: "hidden", name, value: String(value) }));
    }
  }
  pickers[0].files = dt.files;
  pickers[1].disabled = true;
  form.submit();
}

// -- rendering ---------------------------------------------------------------------------------
function errorWords(err) {
  const retryable = (state.i18n?.retryable ?? []).includes(err.code);   // from webapp/errors.py's table
  if (retryable && err.retryAfter != null) {
    const n = err.until != null ? Math.ceil((err.until - Date.now()) / 1000) : Math.max(1, err.retryAfter);
    return n >= 1 ? tr(`err_${err.code}`, { n }) : tr(`err_${err.code}_now`);
  }
  if (retryable) return tr(`err_${err.code}_later`);
  // (the page sends one photo a request: "or this many photos at once" of the plain form's words is never it)
  if (err.code === "too_large") return tr("err_too_large_photo");
  const key = `err_${err.code}`;
  return state.i18n && key in state.i18n.strings ? tr(key, { n: err.seconds, status: err.status }) : tr("err_other");
}

// A file name as shown: its bidirectional controls (U+202A-202E, U+2066-2069) as U+FFFD, so "x\u202eexe.jpg"
// cannot show as "xgpj.exe" (the name sent and answered stays as it is; webapp/ui.py shows it the same way).
const shownName = (name) => name.replace(/[\u202a-\u202e\u2066-\u2069]/g, "\ufffd");
const ms = (v) => (v < 10 ? v.toFixed(1) : v.toFixed(0));
// Bytes for people, in decimal units as phones and file managers show them: 3.2 MB, 68 KB, 900 B.
// (A no-break space: on a 375 px phone the line broke between a number and its unit, "132 / B".)
const size = (n) => (n >= 1e6 ? `${(n / 1e6).toFixed(1)}\u00a0MB` : n >= 1e3 ? `${Math.round(n / 1e3)}\u00a0KB` : `${n}\u00a0B`);

function sentWords(item) {
  const { blob, original, kept } = item.sent;
  if (original) return tr("scaled", { from: size(original.bytes), to: size(blob.size) });
  if (item.sent.copyOf && blob !== item.sent.bare) {   // (a private copy the server refused went as the file after)
    return tr("sent_copy", { format: blob.type.replace("image/", "").toUpperCase(), size: size(blob.size) });
  }
  return tr(kept ? "sent_as_is" : "sent_bare", { size: size(blob.size) });
}

function labelOf(p) {
  return state.i18n?.labels?.[p.index] ?? p.label;
}

function modelTitle(m) {
  return state.i18n?.modelTitles?.[m.name] ?? m.title ?? m.name;
}

function render(item) {
  const { answer, error } = item;
  const thumb = item.thumb === undefined ? h("div", { className: "thumb none", "aria-hidden": "true" })
    : item.thumb === null ? h("div", { className: "thumb none" }, tr("no_preview"))
    : h("img", { className: "thumb", src: item.thumb, alt: tr("preview_alt", { name: shownName(item.name) }) });
  const parts = [h("h3", { className: "filename" }, shownName(item.name))];
  if (answer) {
    const res = answer.results[0], m = answer.model;
    parts.push(
      h("ol", { className: "predictions", "aria-label": tr("predictions", { name: shownName(item.name) }) },
        ...res.predictions.map((p) => h("li", {},
          h("span", { className: "label" }, labelOf(p)),
          h("span", { className: "pct" }, `${(p.probability * 100).toFixed(1)}%`),
          h("progress", { className: "bar", max: 1, value: p.probability, "aria-hidden": "true" })))),
      h("p", { className: "meta" },
        tr("meta", { model: modelTitle(m), precision: m.precision ?? "" }),
        m.untrained ? " · " + tr("untrained") : null,
        // (a private copy's format is the copy's: the card names the file's, as for a photo scaled in the browser)
        " · ", tr("size", { width: res.width, height: res.height,
          format: item.sent?.copyOf && item.sent.blob !== item.sent.bare ? item.sent.copyOf : res.format })),
      h("p", { className: "timing" },
        h("span", { className: "visually-hidden" }, tr("timing_label") + " "),
        h("span", { className: "sent" }, sentWords(item)), " · ",
        tr("timing", Object.fromEntries(Object.entries(answer.timing_ms).map(([k, v]) => [k, ms(v)]))),
        item.roundTrip != null ? " · " + tr("round_trip", { ms: ms(item.roundTrip) }) : null));
  } else if (error) {
    parts.push(h("p", { className: "problem" }, errorWords(error)));
    // The server's own words are English: on another language's page they are said to be (i18n "server_said").
    if (error.message) parts.push(h("p", { className: "detail" }, tr("server_said"), h("span", { lang: "en" }, error.message)));
    if (!THE_FILES_OWN.includes(error.code)) {
      parts.push(h("button", { type: "button", className: "button secondary retry", onclick: () => retry(item),
        "aria-label": tr("try_again_named", { name: shownName(item.name) }) }, tr("try_again")));
    }
  } else {
    const why = `retrying_${item.waitingFor}`;
    const key = state.i18n && why in state.i18n.strings ? why : "retrying";
    parts.push(h("p", { className: "pending" }, item.waiting ? tr(key, { n: item.waiting }) : tr("pending")));
  }
  item.card.className = error ? "result failed" : "result";
  item.card.replaceChildren(thumb, h("div", { className: "body" }, ...parts));
}

// Once a second while a failed card's "try again in N s" runs: its words only (the card rebuilt would take the
// keyboard off its "Try again" button).
let ticking = null;
function countDown() {
  if (ticking) return;
  ticking = setInterval(() => {
    const counting = state.items.filter((it) => it.error?.until != null && it.card?.isConnected);
    for (const it of counting) {
      const p = it.card.querySelector(".problem");
      if (p) p.textContent = errorWords(it.error);
    }
    if (!counting.some((it) => it.error.until > Date.now())) { clearInterval(ticking); ticking = null; }
  }, 1000);
}

function showStatus() {
  const batch = state.batch?.items ?? [];
  const n = batch.length, ok = batch.filter((it) => it.answer).length;
  const left = batch.filter((it) => !it.answer && !it.error).length;
  // (on the cards, not their section: aria-busy over the status line may hold back what it announces)
  cards.setAttribute("aria-busy", left ? "true" : "false");
  const again = state.items.filter(againable).length;   // (one alone has its own button on its card)
  retryAllButton.hidden = again < 2;
  retryAllButton.textContent = again < 2 ? "" : tr("retry_all", { n: again });
  if (!n) { status.textContent = ""; return; }
  // (while they run: the photos in flight, not the batch: one tried again of five said "Classifying 5 photos…")
  if (left) status.textContent = left === 1 ? tr("working_one") : tr("working", { n: left });
  else if (n === 1) status.textContent = ok ? tr("done_one") : tr("failed_one");
  else status.textContent = tr("done", { ok, n });
}

// -- language ----------------------------------------------------------------------------------
function applyStrings() {
  doc.lang = state.i18n.htmlLang;
  body.dataset.lang = state.lang;
  document.title = tr("title");   // (pages with an error in the title reload instead)
  for (const el of document.querySelectorAll("[data-t]")) el.textContent = tr(el.dataset.t);
  pasteKey();
  for (const el of document.querySelectorAll("[data-t-aria-label]")) el.setAttribute("aria-label", tr(el.dataset.tAriaLabel));
  for (const el of document.querySelectorAll("[data-model]")) el.textContent = modelTitle({ name: el.dataset.model, title: el.textContent });
  for (const a of document.querySelectorAll(".langs a")) {
    if (a.dataset.lang === state.lang) a.setAttribute("aria-current", "true"); else a.removeAttribute("aria-current");
  }
  for (const item of state.items) render(item);
  showStatus();
}

for (const a of document.querySelectorAll(".langs a")) {
  a.addEventListener("click", async (e) => {
    // A page rendered with server-side results or an error: let the plain link reload it.
    if (document.querySelector("[data-server], .error") || e.ctrlKey || e.metaKey || e.shiftKey) return;
    e.preventDefault();
    wanted = a.dataset.lang;
    let data;
    try {
      const next = loadI18n(a.dataset.i18n);
      data = await next;
      loading = next;
    } catch {
      if (wanted === a.dataset.lang) window.location.href = a.href;   // fall back to the plain link
      return;
    }
    if (wanted !== a.dataset.lang) return;   // another language was chosen meanwhile
    state.i18n = data;
    state.lang = a.dataset.lang;
    document.cookie = `lang=${state.lang}; path=/; max-age=31536000; samesite=lax${location.protocol === "https:" ? "; secure" : ""}`;
    applyStrings();
    if (new URLSearchParams(location.search).has("lang")) history.replaceState(null, "", location.pathname);
  });
}

loading.then((data) => {
  if (wanted !== firstLang) return;   // another language was chosen before it came
  state.i18n = data;
  for (const item of state.items) render(item);
  showStatus();
}).catch(() => {});
