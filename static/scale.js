// Make each photo's upload and preview from one decode: the photo scaled in the browser to what the
// model needs, so a 3 MB phone photo goes up as a ~130 KB lossless copy without its EXIF (no GPS
// position, no camera serial), or, whenever that cannot be done or gains nothing, the original's bytes
// without its metadata where static/strip.js can take it out losslessly, else the original itself.
//
// The copy is the very image the server's own first step would make from the original: scaled to
// `send_short_side` (the serving model's resize size, from GET /api/v1/models) with Pillow's
// resampling reproduced pixel for pixel (static/resample.js, the filter named by `send_resample`),
// and encoded losslessly (WebP, else PNG; decoded back and compared before it is sent). So the
// model answers the copy as it answers the original, to the pixel: a lossy or differently resampled
// copy moved its top-1 probability by up to 15 points (JPEG q0.9 at 2x size: 5-12 points here).
// The decode applies the EXIF orientation (createImageBitmap's default), so the copy is upright and
// needs no EXIF; colours are taken as stored (no ICC conversion), as the server takes them.
// Originals go up when: scaling is off (`?scale=0`, a diagnostic), the size or filter is unknown, the
// file is not a format we recognise (the server names it in its 415), the browser cannot decode it
// (HEIC outside Safari, TIFF...), this browser would decode it otherwise than the server (an animation, a CMYK
// JPEG), the server would refuse it (a JPEG cut short or damaged: its 400 is the answer curl gets), the photo is
// at or below the size already, the copy is no smaller, or anything fails on the way: the optimisation never
// loses a photo. Where the original would go with metadata strip.js cannot take out (an AVIF), the copy goes
// instead, at the photo's own size where it is small already.

import { FILTERS, resize, resizedSize } from "./resample.js";
import { pngExif, withoutMetadata } from "./strip.js";

const THUMB_QUALITY = 0.9;  // the preview's JPEG (only shown on the page, never sent)
const THUMB_PX = 320;       // preview size (long side), drawn to a canvas: the CSP allows data: images only
const LOSSLESS = ["image/webp", "image/png"];   // WebP at quality 1 is lossless in Chromium; checked anyway

export const scalingOn = new URLSearchParams(location.search).get("scale") !== "0";

let target = null;
/**
 * What to scale to, from GET /api/v1/models: { short, resample } of the serving model (short side in
 * px, and the name of the resampling filter), or null where it cannot be had or the filter is not one
 * this page reproduces (then photos go up at their own size, without their metadata). A failed request
 * (a restart, a proxy's 502) is asked again for the next photo: kept, one 503 at page load sent every later
 * photo whole, GPS position included (tryout33).
 */
export function sendSize(url) {
  target ??= fetch(url, { headers: { Accept: "application/json" } })
    .then((r) => {
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      return r.json();
    })
    .then((j) => {
      const m = j?.models?.find((x) => x.serving) ?? j?.models?.find((x) => x.name === j.requested);
      const short = m?.send_short_side, resample = m?.send_resample;
      // (not Object.hasOwn: Chrome before 93 and Safari before 15.4 threw there, and sent photos whole)
      const known = Object.prototype.hasOwnProperty.call(FILTERS, resample);
      return Number.isInteger(short) && short > 0 && known ? { short, resample } : null;
    })
    .catch(() => {
      target = null;   // asked again for the next photo
      return null;
    });
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

// JPEG markers (ITU-T T.81 table B.1), as webapp/incomplete.py reads them: progressive frames (SOF2,
// SOF10), the other frames, a scan's start (SOS), the end (EOI).
const PROGRESSIVE = new Set([0xc2, 0xca]);
const OTHER_FRAMES = new Set([0xc0, 0xc1, 0xc3, 0xc5, 0xc6, 0xc7, 0xc9, 0xcb, 0xcd, 0xce, 0xcf]);

// The next marker at or after `from` in a scan's entropy-coded data (0xFF then not 00, a restart
// marker D0-D7 or fill FF), or -1.
function nextMarker(b, from) {
  for (let i = b.indexOf(0xff, from); i >= 0 && i + 1 < b.length; i = b.indexOf(0xff, i + 1)) {
    const n = b[i + 1];
    if (n !== 0x00 && n !== 0xff && !(n >= 0xd0 && n <= 0xd7)) return i;
  }
  return -1;
}

// The marker segments of JPEG bytes `b` (a Uint8Array), in order, as { marker, seg, end }: where the
// segment's payload starts and where it ends (a scan's: at the next marker after its entropy-coded data, -1
// where none follows). Fill bytes, RSTn and TEM are skipped; the walk stops after EOI, at the end of `b`, and
// where a marker must be and is not (damage: judged by the decoders, not here).
function* jpegSegments(b) {
  for (let pos = 2; pos + 2 <= b.length && b[pos] === 0xff;) {
    const marker = b[pos + 1];
    if (marker === 0xff) { pos += 1; continue; }   // fill before a marker
    if (marker === 0xd9) { yield { marker, seg: pos + 2, end: pos + 2 }; return; }   // EOI
    if ((marker >= 0xd0 && marker <= 0xd7) || marker === 0x01) { pos += 2; continue; }   // RSTn, TEM
    if (pos + 4 > b.length) return;
    let end = pos + 2 + ((b[pos + 2] << 8) | b[pos + 3]);
    if (marker === 0xda) end = nextMarker(b, end);   // SOS: its header, then its entropy-coded data
    yield { marker, seg: pos + 4, end };
    if (end < 0) return;
    pos = end;
  }
}

/**
 * Why JPEG bytes `b` must go as they are, in one walk of its segments, or null:
 * - "incomplete": closed by EOI before its scans brought every component to full precision (browsers, like
 *   libjpeg, decode it without an error: a blur, or components left at zero). A progressive JPEG whose scans
 *   stop early (webapp/incomplete.py jpeg_scans_cut), or a sequential one (SOF0/SOF1) whose components come in
 *   separate scans and not all came (jpeg_components_cut: cut after its luma scan, a colourless photo). The
 *   server refuses both (400): the page sends the file and shows that.
 * - "damaged": a quantization table used by the frame has 0 for its DC entry (webapp/formats.py jpeg_frame
 *   zero_dc): libjpeg, the browser's too, decodes it (a grey luma, a colourless chroma); the server refuses it.
 * - "cmyk": 4 components (CMYK, YCCK). Decoders disagree on their inversion without an Adobe APP14 marker
 *   (Chromium always inverts, Firefox only with it, the server as libvips does): a copy could be a negative.
 */
export function jpegAsItIs(b) {
  const precision = new Map(), dc = new Map(), seen = new Set();
  let progressive = null, sequential = null, tables = null, scans = 0;
  for (const { marker, seg, end } of jpegSegments(b)) {
    if (marker === 0xd9) {   // EOI
      if (progressive && scans > 0 && progressive.some((c) => precision.get(c).some((al) => al !== 0))) {
        return "incomplete";
      }
      if (sequential && scans > 0 && !sequential.every((c) => seen.has(c))) return "incomplete";
      break;
    }
    if (marker === 0xdb && scans === 0) {   // DQT before the first scan: (Pq << 4 | Tq), 64 or 128 bytes...
      for (let at = seg; at + 3 <= Math.min(end, b.length); at += 1 + 64 * (b[at] >> 4 ? 2 : 1)) {
        dc.set(b[at] & 15, b[at] >> 4 ? (b[at + 1] << 8) | b[at + 2] : b[at + 1]);
      }
    }
    const frame = marker >= 0xc0 && marker <= 0xcf && ![0xc4, 0xc8, 0xcc].includes(marker);   // SOFn (not DHT...)
    if (frame && tables === null) {   // the first frame: the one decoded; Ci, Hi|Vi, Tqi per component
      if (b[seg + 5] === 4) return "cmyk";
      tables = Array.from({ length: b[seg + 5] }, (_, i) => b[seg + 8 + 3 * i]);
    }
    if (PROGRESSIVE.has(marker)) {
      progressive = Array.from({ length: b[seg + 5] }, (_, i) => b[seg + 6 + 3 * i]);
      sequential = null;
      precision.clear();
      for (const c of progressive) precision.set(c, new Array(64).fill(null));
    } else if (marker === 0xc0 || marker === 0xc1) {
      sequential = Array.from({ length: b[seg + 5] }, (_, i) => b[seg + 6 + 3 * i]);
      progressive = null;
    } else if (OTHER_FRAMES.has(marker)) {
      progressive = sequential = null;   // lossless, arithmetic...: no cut judged here
    }
    if (marker === 0xda) {   // SOS: components, Ss, Se, Ah/Al
      if (scans === 0 && tables?.some((t) => dc.get(t) === 0)) return "damaged";   // the tables as decoded
      if (progressive === null && sequential === null) return null;
      const n = b[seg], ss = b[seg + 1 + 2 * n], se = b[seg + 2 + 2 * n], al = b[seg + 3 + 2 * n] & 15;
      for (let i = 0; i < n; i++) {
        const c = b[seg + 1 + 2 * i];
        seen.add(c);
        if (progressive === null) continue;
        if (!precision.has(c) || !(ss <= se && se <= 63)) return null;
        precision.get(c).fill(al, ss, se + 1);
      }
      scans += 1;
    }
  }
  return null;   // whole, or no EOI: browsers refuse a JPEG without one themselves
}

// True for JPEG bytes `b` that a text copy changed: in the first 64 KiB after the first SOS marker (judged where
// there are 16 KiB or more of it, as random as a photo's: >= 7 bits a byte), no CR or no LF byte at all (curl -d
// strips both, tr -d '\r' the CRs, an old Mac copy makes LF CR), or 8 LFs or more each after a CR (FTP ASCII). Decoders make noise of it without an error;
// the server refuses it (webapp/mangled.py jpeg_copied_as_text, whose docstring says why these marks decide), so
// the file goes as it is.
export function copiedAsText(b) {
  let sos = 2;
  while (sos + 1 < b.length && !(b[sos] === 0xff && b[sos + 1] === 0xda)) sos += 1;
  const w = b.subarray(sos, sos + 65536);
  if (w.length < 16384) return false;
  const counts = new Array(256).fill(0);
  let lf = 0, crlf = 0, cr = 0, bits = 0;
  for (let i = 0; i < w.length; i++) {
    counts[w[i]] += 1;
    if (w[i] === 0x0a) { lf += 1; if (i > 0 && w[i - 1] === 0x0d) crlf += 1; } else if (w[i] === 0x0d) cr += 1;
  }
  for (const c of counts) if (c) bits -= (c / w.length) * Math.log2(c / w.length);
  return bits >= 7 && (lf === 0 || cr === 0 || (lf >= 8 && crlf === lf));
}

// True for an animation: a GIF with more than one image, a WebP with VP8X's animation flag or an ANIM chunk, a PNG
// with acTL before its image data (APNG). createImageBitmap takes the first frame as it is, where the server takes
// the first one visible (a fade-in's first frame is transparent: the copy went up blank, "nematode") and an
// APNG's default image (which need not be a frame of the animation): the file goes as it is.
export function animated(b, format) {
  const ascii = (from, to) => String.fromCharCode(...b.subarray(from, to));
  const u32 = (i, le) => (le ? b[i] + (b[i + 1] << 8) + (b[i + 2] << 16) + b[i + 3] * 16777216
    : b[i] * 16777216 + (b[i + 1] << 16) + (b[i + 2] << 8) + b[i + 3]);
  if (format === "WEBP") {   // RIFF chunks: FourCC, little-endian size, data, pad to even
    if (ascii(12, 16) === "VP8X" && b[20] & 0x02) return true;
    for (let at = 12; at + 8 <= b.length; at += 8 + u32(at + 4, true) + (b[at + 4] & 1)) {
      if (ascii(at, at + 4) === "ANIM") return true;
    }
  }
  if (format === "PNG") {   // chunks: big-endian size, type, data, CRC
    for (let at = 8; at + 8 <= b.length && ascii(at + 4, at + 8) !== "IDAT"; at += 12 + u32(at, false)) {
      if (ascii(at + 4, at + 8) === "acTL") return true;
    }
  }
  if (format === "GIF") {   // header, screen descriptor, global colour table; then blocks up to the trailer (0x3B)
    let at = 13 + (b[10] & 0x80 ? 3 << ((b[10] & 7) + 1) : 0), images = 0;
    const blocks = (i) => { while (i < b.length && b[i] !== 0) i += b[i] + 1; return i + 1; };   // sub-blocks
    while (at < b.length && b[at] !== 0x3b) {
      if (b[at] === 0x21) at = blocks(at + 2);   // extension: label, sub-blocks
      else if (b[at] === 0x2c) {   // image: descriptor, local colour table, LZW code size, sub-blocks
        if (++images > 1) return true;
        at = blocks(at + 11 + (b[at + 9] & 0x80 ? 3 << ((b[at + 9] & 7) + 1) : 0));
      } else break;   // damaged: the server judges it
    }
  }
  return false;
}

// True where a whole edge of the decoded photo is exact mid-grey (128, 128, 128): what libjpeg (in the
// browser too) writes past the cut of a baseline JPEG closed by EOI, at the bottom as stored, so on any
// edge once EXIF turned it. Such a file goes as it is: the server tells a cut from a real grey band
// (webapp/incomplete.py jpeg_rows_decoded) and a real band costs only the bytes.
function greyEdge(src, w, h) {
  const grey = (d) => d.every((v, i) => i % 4 === 3 || v === 128);
  return [[w, 1, 0, h - 1], [w, 1, 0, 0], [1, h, 0, 0], [1, h, w - 1, 0]].some(
    ([ew, eh, x, y]) => grey(pixels(src, ew, eh, x, y)));
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

async function encode(c, type, quality) {
  if (c.convertToBlob) return c.convertToBlob({ type, quality });
  return new Promise((ok, fail) => c.toBlob((b) => (b ? ok(b) : fail(new Error("toBlob"))), type, quality));
}

// The RGBA bytes (ImageData.data) of the w x h region at (x, y) of a drawable, unscaled, on white (the
// server turns transparency white; every pixel is then opaque), colours as stored.
function pixels(src, w, h, x = 0, y = 0) {
  const c = canvas(w, h);
  const ctx = c.getContext("2d", { willReadFrequently: true });   // read back, not drawn on a GPU
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, w, h);
  ctx.drawImage(src, -x, -y);
  return ctx.getImageData(0, 0, w, h).data;
}

// The part of a w x h photo the server resizes: all of it, or of a strip over 2:1 its central 2:1
// (webapp/imaging.py center_limit, which crops before the resize). Returns [x, y, width, height].
function serverView(w, h) {
  const short = Math.min(w, h), long = Math.max(w, h);
  if (long <= 2 * short) return [0, 0, w, h];
  const keep = 2 * short, off = Math.floor((long - keep) / 2);
  return w > h ? [off, 0, keep, h] : [0, off, w, keep];
}

async function samePixels(blob, want, w, h) {
  const back = await createImageBitmap(blob, { colorSpaceConversion: "none", premultiplyAlpha: "none" });
  try {
    if (back.width !== w || back.height !== h) return false;
    const got = pixels(back, w, h);
    for (let i = 0; i < want.length; i += 4) {
      if (got[i] !== want[i] || got[i + 1] !== want[i + 1] || got[i + 2] !== want[i + 2]) return false;
    }
    return true;
  } finally {
    back.close();
  }
}

// `rgba` (w x h, opaque) as a lossless file: the first of LOSSLESS this browser encodes and that decodes
// back to the same pixels (a browser whose WebP at quality 1 is lossy, or that writes PNG for an encoder
// it lacks, is caught here). Throws where none does.
async function lossless(rgba, w, h) {
  const c = canvas(w, h);
  c.getContext("2d").putImageData(new ImageData(rgba, w, h), 0, 0);
  for (const type of LOSSLESS) {
    const blob = await encode(c, type, 1);
    if (blob.type === type && (await samePixels(blob, rgba, w, h))) return { blob, canvas: c };
  }
  throw new Error("no lossless encoder");
}

// 2x1 files whose EXIF Orientation is 6, decoded 1x2 where this browser turns such a file as its EXIF says:
// Chromium does not turn a WebP (its preview showed sideways beside its upright labels: tryout29); it turns a
// PNG whose eXIf chunk is as the spec writes it, not one that starts with JPEG's "Exif\0\0" (tryout31).
const TURNED = {
  WEBP: "UklGRlIAAABXRUJQVlA4WAoAAAAIAAAAAQAAAAAAVlA4TBEAAAAvAQAAAA8Q87//8x8OMqL/AQBFWElGGgAAAE1NACoAAAAIAAEBEgADAAAAAQAGAAAAAAAA",
  PNG: "iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAAGmVYSWZNTQAqAAAACAABARIAAwAAAAEABgAAAAAAANZnS2kAAAAPSURBVHicY/zPwMDAwAAABggBActHdnUAAAAASUVORK5CYII=",
};
const turns = {};
async function browserTurns(format) {
  if (!(format in TURNED)) return true;   // any other format: its preview as the browser draws it
  if (turns[format] === undefined) {
    try {
      const bytes = Uint8Array.from(atob(TURNED[format]), (c) => c.charCodeAt(0));
      const bmp = await createImageBitmap(new Blob([bytes], { type: `image/${format.toLowerCase()}` }));
      turns[format] = bmp.width === 1;
      bmp.close();
    } catch {
      turns[format] = true;   // cannot tell: leave the preview as the browser draws it
    }
  }
  return turns[format];
}

// `src` (stored as EXIF orientation `o`, 1-8, says) drawn upright on a canvas: the transform of each orientation.
function upright(src, o) {
  const w = src.width, h = src.height, swap = o >= 5;
  const c = canvas(swap ? h : w, swap ? w : h);
  const ctx = c.getContext("2d");
  const m = { 2: [-1, 0, 0, 1, w, 0], 3: [-1, 0, 0, -1, w, h], 4: [1, 0, 0, -1, 0, h], 5: [0, 1, 1, 0, 0, 0],
    6: [0, 1, -1, 0, h, 0], 7: [0, -1, -1, 0, h, w], 8: [0, -1, 1, 0, 0, w] }[o];
  if (m) ctx.setTransform(...m);
  ctx.drawImage(src, 0, 0);
  return c;
}

async function thumbnail(src) {
  const s = Math.min(1, THUMB_PX / Math.max(src.width, src.height));
  const c = draw(src, Math.max(1, Math.round(src.width * s)), Math.max(1, Math.round(src.height * s)));
  const blob = await encode(c, "image/jpeg", THUMB_QUALITY);
  return new Promise((ok) => {
    const r = new FileReader();
    r.onload = () => ok(r.result);
    r.onerror = () => ok(null);
    r.readAsDataURL(blob);
  });
}

// The EXIF orientation (1-8) in bytes `b`, found by a TIFF header ("II*\0" or "MM\0*") and its IFD0's tag
// 0x0112; 1 where none is found. A false find only sends the original, never a wrong copy.
function exifOrientation(b) {
  for (let i = 0; i + 8 <= b.length; i += 1) {
    const le = b[i] === 0x49 && b[i + 1] === 0x49 && b[i + 2] === 0x2a && b[i + 3] === 0;
    const be = b[i] === 0x4d && b[i + 1] === 0x4d && b[i + 2] === 0 && b[i + 3] === 0x2a;
    if (!le && !be) continue;
    const u16 = (o) => (le ? b[o] | (b[o + 1] << 8) : (b[o] << 8) | b[o + 1]);
    const u32 = (o) => (le ? u16(o) + u16(o + 2) * 65536 : u16(o) * 65536 + u16(o + 2));
    const ifd = i + u32(i + 4), n = ifd + 2 <= b.length ? u16(ifd) : 0;
    for (let k = 0; k < n && k < 512 && ifd + 14 + 12 * k <= b.length; k += 1) {
      const e = ifd + 2 + 12 * k;
      if (u16(e) === 0x0112 && u16(e + 2) === 3) {
        const v = u16(e + 8);
        if (v >= 1 && v <= 8) return v;
      }
    }
  }
  return 1;
}

// A non-JPEG file's EXIF orientation, { orientation (1-8), prefixed }: a WebP's from its EXIF chunk (after the
// image data, where the container puts it), a PNG's from its eXIf chunk before the image data (prefixed: that
// chunk starts with JPEG's "Exif\0\0"), any other's from its first 256 KB and last 64 KB (AVIF's Exif item).
async function orientationOf(file, format) {
  const bytes = async (from, to) => new Uint8Array(await file.slice(from, to).arrayBuffer());
  const found = (orientation, prefixed = false) => ({ orientation, prefixed });
  if (format === "WEBP") {
    for (let at = 12; at + 8 <= file.size;) {   // RIFF chunks: FourCC, little-endian size, data, pad to even
      const head = await bytes(at, at + 8);
      const size = head[4] | (head[5] << 8) | (head[6] << 16) | (head[7] * 16777216);
      if (String.fromCharCode(...head.subarray(0, 4)) === "EXIF") return found(exifOrientation(await bytes(at + 8, at + 8 + size)));
      at += 8 + size + (size % 2);
    }
    return found(1);
  }
  if (format === "PNG") return pngExif(await bytes(0, file.size)) ?? found(1);
  const head = exifOrientation(await bytes(0, 1 << 18));
  return found(head !== 1 ? head : exifOrientation(await bytes(Math.max(0, file.size - (1 << 16)), file.size)));
}

/**
 * What to send for `file`, and its preview, from one decode. `send` is sendSize()'s { short, resample }.
 * Resolves to { blob, original, thumb, why, kept, bare }: `blob` the bytes to upload (the scaled lossless copy,
 * or the file without its metadata: static/strip.js, or the file itself); `original` {width, height, format,
 * bytes} of the photo when `blob` is a scaled copy (the page sends it as the original_* fields), else null;
 * `thumb` a data: URL or null (not decodable here); `why` a word for tests and the console: scaled | off |
 * unknown | unscaled (no size to scale to: the server's models could not be asked) | undecodable | small | incomplete (a JPEG perhaps cut short: the server judges it) | damaged (a JPEG
 * with a zero DC quantizer, or copied as text: the server refuses it) | animated | cmyk (decoded otherwise here than by the server: no
 * preview) | oriented (not a JPEG, with an EXIF orientation: the server turns it) | larger (the copy would be no
 * smaller) | private (small already, in a format strip.js does not take: a lossless copy at its own size) | failed;
 * `copyOf` (a private copy only) the file's format, as sniff() names it; `kept`
 * true where the file goes as it is, with whatever metadata it holds (a format or a structure strip.js does not
 * take, scaling off); `bare` the file as it goes where not scaled (what the page sends if the server refuses the
 * copy). Never rejects.
 */
export async function prepare(file, send) {
  const format = await sniff(file).catch(() => null);
  const plain = async (why, thumb = null) => {
    // The photo goes without its metadata where strip.js takes it apart, its image data byte for byte, so the server
    // judges the same photo: one perhaps cut short or not decodable here too (such JPEGs went up with their GPS
    // position: tryout29, tryout31). The file itself goes where its format is unknown, where it is damaged (a JPEG
    // copied as text: its damage is the answer) and under ?scale=0 (a diagnostic).
    const { blob, kept } = ["off", "unknown", "damaged"].includes(why)
      ? { blob: file, kept: true } : await withoutMetadata(file, format);
    return { blob, original: null, thumb, why, kept, bare: blob };
  };
  // What would go with its metadata although this browser decoded it (a format or a structure strip.js does not
  // take: AVIF, BMP...) goes as a lossless copy of the decode at its own size instead, where that decode is upright
  // as the server's (a JPEG's EXIF orientation and an AVIF's container rotation are applied by both; a WebP's EXIF
  // one by the server only): an AVIF small already went up whole, GPS position and camera included (tryout29).
  const privately = async (sent, turn) => {   // (turn: the file's EXIF orientation, 1 for a JPEG: prepare's)
    if (!sent.kept || !(format === "AVIF" || turn === 1)) return sent;
    try {
      const { blob } = await lossless(pixels(bmp, bmp.width, bmp.height), bmp.width, bmp.height);
      return { ...sent, blob, why: "private", kept: false, copyOf: format };   // (the card names the file's format)
    } catch {
      return sent;
    }
  };
  let bmp;
  try {
    // EXIF orientation applied: width/height are upright. Colours as stored: the server applies no ICC profile.
    bmp = await createImageBitmap(file, { colorSpaceConversion: "none" });
  } catch {
    return plain(format ? "undecodable" : "unknown");   // the server may still read it, or says why not
  }
  try {
    // The preview upright, where this browser drew the file as stored (its EXIF orientation unapplied)
    const exif = format && format !== "JPEG" ? await orientationOf(file, format) : { orientation: 1 };
    const turn = exif.orientation;
    const view = turn !== 1 && (exif.prefixed || !(await browserTurns(format))) ? upright(bmp, turn) : bmp;
    const thumbFrom = async (src = view) => thumbnail(src).catch(() => null);
    if (!scalingOn) return plain("off", await thumbFrom());
    if (!format) return plain("unknown", await thumbFrom());
    const { width, height } = bmp;
    // What the browser decodes otherwise than the server (an animation's first frame, a CMYK JPEG's inks) goes as
    // it is, with no preview (this decode is not what the server classifies); what the server refuses goes as the
    // file itself, for the server's 400 (curl's answer), not a good copy of a damaged photo.
    const bytes = new Uint8Array(await file.arrayBuffer());
    const judged = format === "JPEG" ? (copiedAsText(bytes) ? "damaged" : jpegAsItIs(bytes))
      : animated(bytes, format) ? "animated" : null;
    if (judged === "animated" || judged === "cmyk") return plain(judged);
    if (judged) return plain(judged, await thumbFrom());
    // (awaited here: the decode is closed as this returns, and the copy is made of it)
    // No size to scale to (the server's models could not be asked): the photo goes as it is, without its metadata
    if (!send) return plain("unscaled", await thumbFrom());
    if (Math.min(width, height) <= send.short) return await privately(await plain("small", await thumbFrom()), turn);
    if (format === "JPEG" && greyEdge(bmp, width, height)) {
      return plain("incomplete", await thumbFrom());   // perhaps cut short: the server judges its scans as they are
    }
    // Browsers apply the EXIF orientation of a JPEG when they decode it; of a WebP, Chromium does not (a
    // sideways copy: keeshond, not German shepherd, where the server turns it upright). Any other format
    // that carries one goes as it is, for the server to turn.
    if (turn !== 1) return plain("oriented", await thumbFrom());
    const [x, y, vw, vh] = serverView(width, height);
    const [w, h] = resizedSize(vw, vh, send.short);
    const rgba = resize(pixels(bmp, vw, vh, x, y), vw, vh, w, h, send.resample);
    const { blob, canvas: copy } = await lossless(rgba, w, h);
    const thumb = await thumbFrom(copy);
    const bare = await plain("larger", thumb);
    if (blob.size >= bare.blob.size && !bare.kept) return bare;   // larger, but without the file's metadata
    return { blob, thumb, why: "scaled", original: { width, height, format, bytes: file.size }, kept: false,
      bare: bare.blob };
  } catch {
    return plain("failed", await thumbnail(bmp).catch(() => null));
  } finally {
    bmp.close();
  }
}
