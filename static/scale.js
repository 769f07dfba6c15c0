// Make each photo's upload and preview from one decode: the photo scaled in the browser to what the
// model needs, so a 3 MB phone photo goes up as a ~70 KB JPEG without its EXIF (no GPS position,
// no camera serial), or, whenever that cannot be done or gains nothing, the original bytes.
//
// The size comes from GET /api/v1/models (`send_short_side` of the serving model: twice the short
// side the server resizes to, so its own antialiased resize still has margin). The decode applies
// the EXIF orientation (createImageBitmap's default), so the copy is upright and needs no EXIF.
// Originals go up when: scaling is off (`?scale=0`, a diagnostic), the size is unknown, the file is
// not a format we recognise (the server names it in its 415), the browser cannot decode it (HEIC
// outside Safari, TIFF...), the photo is at or below the size already, the copy does not at least
// halve the bytes (MIN_SAVING), or anything fails on the way: the optimisation never loses a photo.

const JPEG_QUALITY = 0.9;   // bench/page_bench.py encodes its stand-in for this copy with Pillow quality=90
// A copy must be at most 1/MIN_SAVING of the original's bytes to be sent instead: a copy changes the
// pixels the model sees, and one that saves little is not worth it (dog.jpg, 768x576, 164 KB -> 95 KB
// moved the offline model's top-1 probability by 9.8 points, 40.2% -> 50.0%, in the browser test).
const MIN_SAVING = 2;
const THUMB_PX = 320;       // preview size (long side), drawn to a canvas: the CSP allows data: images only

export const scalingOn = new URLSearchParams(location.search).get("scale") !== "0";

let target = null;
/** The short side (px) worth sending, from GET /api/v1/models; null where it cannot be had. */
export function sendShortSide(url) {
  target ??= fetch(url, { headers: { Accept: "application/json" } })
    .then((r) => (r.ok ? r.json() : null))
    .then((j) => {
      const m = j?.models?.find((x) => x.serving) ?? j?.models?.find((x) => x.name === j.requested);
      return Number.isInteger(m?.send_short_side) && m.send_short_side > 0 ? m.send_short_side : null;
    })
    .catch(() => null);
  return target;
}

// The format a file's first bytes say it is (the names webapp/contract.py's ORIGINAL_FORMATS uses),
// or null. By content, not by name or type: a phone may call a HEIC "IMG_0001.JPG".
export async function sniff(file) {
  const b = new Uint8Array(await file.slice(0, 16).arrayBuffer());
  const ascii = (from, to) => String.fromCharCode(...b.subarray(from, to));
  if (b[0] === 0xff && b[1] === 0xd8 && b[2] === 0xff) return "JPEG";
  if (ascii(0, 8) === "\x89PNG\r\n\x1a\n") return "PNG";
  if (ascii(0, 4) === "GIF8") return "GIF";
  if (ascii(0, 4) === "RIFF" && ascii(8, 12) === "WEBP") return "WEBP";
  if (ascii(0, 2) === "BM") return "BMP";
  if (ascii(0, 4) === "II*\0" || ascii(0, 4) === "MM\0*") return "TIFF";
  if (ascii(4, 8) === "ftyp") {
    const brand = ascii(8, 12);
    if (brand === "avif" || brand === "avis") return "AVIF";
    if (["heic", "heix", "hevc", "hevx"].includes(brand)) return "HEIC";
    if (brand === "mif1" || brand === "msf1") return "HEIF";
  }
  return null;
}

// Whether createImageBitmap knows `resizeQuality`: a browser reads every dictionary member it knows,
// so the getter runs only where the option is understood (elsewhere it would be silently ignored).
let highQuality = null;
async function resizeQualityKnown() {
  if (highQuality === null) {
    let read = false;
    const probe = { resizeWidth: 1, resizeHeight: 1, get resizeQuality() { read = true; return "high"; } };
    try { (await createImageBitmap(new ImageData(1, 1), probe)).close(); } catch { /* read stays as it is */ }
    highQuality = read;
  }
  return highQuality;
}

function canvas(w, h) {
  if (typeof OffscreenCanvas !== "undefined") return new OffscreenCanvas(w, h);
  return Object.assign(document.createElement("canvas"), { width: w, height: h });
}

// Draw `src` at w x h on white (transparent pixels become white, as the server does) and return the canvas.
function draw(src, w, h) {
  const c = canvas(w, h);
  const ctx = c.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, w, h);
  ctx.imageSmoothingEnabled = true;
  ctx.imageSmoothingQuality = "high";
  ctx.drawImage(src, 0, 0, w, h);
  return c;
}

// bmp scaled to w x h: createImageBitmap's high-quality resize where the browser has it, else halving
// steps on a canvas (one bilinear step from far above the size would alias: every step at most 2x).
async function resize(bmp, w, h) {
  if (await resizeQualityKnown()) {
    return createImageBitmap(bmp, { resizeWidth: w, resizeHeight: h, resizeQuality: "high" });
  }
  let src = bmp, sw = bmp.width, sh = bmp.height;
  while (sw / 2 >= w && sh / 2 >= h) {
    sw = Math.round(sw / 2);
    sh = Math.round(sh / 2);
    src = draw(src, sw, sh);
  }
  return draw(src, w, h);
}

async function jpeg(c) {
  if (c.convertToBlob) return c.convertToBlob({ type: "image/jpeg", quality: JPEG_QUALITY });
  return new Promise((ok, fail) => c.toBlob((b) => (b ? ok(b) : fail(new Error("toBlob"))), "image/jpeg", JPEG_QUALITY));
}

async function thumbnail(src) {
  const s = Math.min(1, THUMB_PX / Math.max(src.width, src.height));
  const c = draw(src, Math.max(1, Math.round(src.width * s)), Math.max(1, Math.round(src.height * s)));
  const blob = await jpeg(c);
  return new Promise((ok) => {
    const r = new FileReader();
    r.onload = () => ok(r.result);
    r.onerror = () => ok(null);
    r.readAsDataURL(blob);
  });
}

/**
 * What to send for `file`, and its preview, from one decode.
 * Resolves to { blob, original, thumb, why }: `blob` the bytes to upload (the file itself, or the
 * scaled JPEG); `original` {width, height, format, bytes} of the photo when `blob` is a scaled copy
 * (the page sends it as the original_* fields), else null; `thumb` a data: URL or null (not
 * decodable here); `why` a word for tests and the console: scaled | off | unknown | undecodable |
 * small | larger (the copy would not halve the bytes) | failed. Never rejects.
 */
export async function prepare(file, short) {
  const plain = (why, thumb = null) => ({ blob: file, original: null, thumb, why });
  const format = await sniff(file).catch(() => null);
  let bmp;
  try {
    bmp = await createImageBitmap(file);   // EXIF orientation applied: width/height are upright
  } catch {
    return plain(format ? "undecodable" : "unknown");   // the server may still read it, or says why not
  }
  let scaled = null;
  try {
    const thumbFrom = async (src) => thumbnail(src).catch(() => null);
    if (!scalingOn) return plain("off", await thumbFrom(bmp));
    if (!format || !short) return plain("unknown", await thumbFrom(bmp));
    const s = short / Math.min(bmp.width, bmp.height);
    if (s >= 1) return plain("small", await thumbFrom(bmp));
    const w = Math.max(1, Math.round(bmp.width * s)), h = Math.max(1, Math.round(bmp.height * s));
    scaled = await resize(bmp, w, h);
    const [blob, thumb] = await Promise.all([jpeg(draw(scaled, w, h)), thumbFrom(scaled)]);
    if (blob.size * MIN_SAVING > file.size) return plain("larger", thumb);
    return { blob, thumb, why: "scaled",
             original: { width: bmp.width, height: bmp.height, format, bytes: file.size } };
  } catch {
    return plain("failed", await thumbnail(bmp).catch(() => null));
  } finally {
    scaled?.close?.();
    bmp.close();
  }
}
