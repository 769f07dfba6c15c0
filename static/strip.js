// A photo that goes up as it is (not scaled: small already, perhaps cut short, a copy no smaller...) goes without
// its metadata: EXIF (GPS position, camera make, model and serial, dates), XMP, IPTC and comments; the page says
// so, and a scaled copy never had any. Losslessly: the pixels' bytes are not touched, so the server decodes the
// very same image. What decoding needs stays: a JPEG's JFIF and Adobe segments (its colour space), its ICC
// profile; the EXIF orientation, which the server applies, is kept as a minimal EXIF of that one tag.
// JPEG: only the photo itself (an MPF file's first image: a phone's gain map or depth map, a Motion Photo's
// video and vendors' trailers after it go too; the server classifies the first image only). PNG: eXIf and text
// chunks. WebP: its EXIF and XMP chunks. GIF: comments and application extensions (XMP). Any other format, or a
// file whose structure does not parse, goes as it is ("kept": its metadata with it), for the server to judge.

const JPEG_KEEP = new Set([0xe0, 0xe2, 0xee]);   // APP0 (JFIF), APP2 (ICC_PROFILE; not MPF), APP14 (Adobe)
const PNG_DROP = new Set(["eXIf", "tEXt", "zTXt", "iTXt", "tIME"]);
const WEBP_DROP = new Set(["EXIF", "XMP "]);

const u16be = (b, o) => (b[o] << 8) | b[o + 1];
const u32be = (b, o) => ((b[o] << 24) >>> 0) + (b[o + 1] << 16) + (b[o + 2] << 8) + b[o + 3];
const u32le = (b, o) => b[o] + (b[o + 1] << 8) + (b[o + 2] << 16) + ((b[o + 3] << 24) >>> 0);
const ascii = (b, from, to) => String.fromCharCode(...b.subarray(from, to));

// A TIFF block (big-endian) with one IFD0 entry: Orientation (0x0112, SHORT) = `value` (2-8).
function orientationTiff(value) {
  return new Uint8Array([0x4d, 0x4d, 0, 0x2a, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, value, 0, 0, 0, 0, 0, 0]);
}

// The Orientation (1-8) in an EXIF block `raw` (TIFF, with or without "Exif\0\0"), read as the server reads it
// (webapp/exif.py's orientation_from_block, rule for rule), so the minimal EXIF says what the server would
// have applied: 1 where it is absent, damaged, of another type or count than one SHORT, or outside 1-8.
function blockOrientation(raw) {
  if (ascii(raw, 0, 6) === "Exif\0\0") raw = raw.subarray(6);
  const order = ascii(raw, 0, 2);
  if (raw.length < 8 || (order !== "II" && order !== "MM")) return 1;
  const le = order === "II";
  const u16 = (o) => (le ? raw[o] | (raw[o + 1] << 8) : u16be(raw, o));
  const u32 = (o) => (le ? u32le(raw, o) : u32be(raw, o));
  const ifd0 = u32(4);
  if (u16(2) !== 42 || ifd0 < 8 || ifd0 + 2 > raw.length) return 1;
  const first = ifd0 + 2, n = Math.min(u16(ifd0), Math.floor((raw.length - first) / 12));
  for (let i = 0; i < n; i += 1) {
    const e = first + 12 * i;
    if (u16(e) !== 0x0112) continue;
    if (u16(e + 2) !== 3 || u32(e + 4) !== 1) return 1;
    const value = u16(e + 8);
    return value >= 1 && value <= 8 ? value : 1;
  }
  return 1;
}

// Where the scans that start with the SOS segment at `pos` end: after the photo's EOI, or at the end of `b` (cut
// short). Each scan's entropy-coded data is skipped to the next marker (its FF 00 and RSTn are data), and the
// segments between scans (a progressive JPEG's DHT and SOS) by their lengths, so no byte pair inside a table is
// taken for the EOI.
function scansEnd(b, pos) {
  for (let at = pos; at + 4 <= b.length;) {
    at += 2 + u16be(b, at + 2);   // past the segment (SOS: its header; the scan's data follows)
    while (at + 1 < b.length && !(b[at] === 0xff && b[at + 1] !== 0 && b[at + 1] !== 0xff
                                  && !(b[at + 1] >= 0xd0 && b[at + 1] <= 0xd7))) at += 1;
    if (at + 1 >= b.length) return b.length;
    if (b[at + 1] === 0xd9) return at + 2;
  }
  return b.length;
}

/**
 * JPEG bytes `b` without metadata: [parts], or null where its header does not parse (then it goes as it is).
 * The first EXIF segment's orientation (the one Pillow reads) is written back as a minimal EXIF.
 */
function jpeg(b) {
  const parts = [b.subarray(0, 2)];
  let orientation = null;
  for (let pos = 2; pos + 4 <= b.length;) {
    if (b[pos] !== 0xff) return null;
    const marker = b[pos + 1];
    if (marker === 0xff) { pos += 1; continue; }   // fill byte
    if (marker === 0xda) {   // SOS: the scans, up to the photo's EOI (or to the end, where it has none: cut short)
      parts.push(b.subarray(pos, scansEnd(b, pos)));
      if (orientation > 1) {
        const app1 = new Uint8Array([0xff, 0xe1, 0, 2 + 6 + 26, 0x45, 0x78, 0x69, 0x66, 0, 0]);   // "Exif\0\0"
        parts.splice(1, 0, app1, orientationTiff(orientation));
      }
      return parts;
    }
    if (marker === 0xd8 || marker === 0xd9 || marker === 0x01 || (marker >= 0xd0 && marker <= 0xd7)) return null;
    const end = pos + 2 + u16be(b, pos + 2);
    if (end > b.length || end < pos + 4) return null;
    const app = marker >= 0xe0 && marker <= 0xef;
    const mpf = marker === 0xe2 && ascii(b, pos + 4, pos + 8) === "MPF\0";
    if (marker === 0xe1 && orientation === null && ascii(b, pos + 4, pos + 10) === "Exif\0\0") {
      orientation = blockOrientation(b.subarray(pos + 4, end));
    }
    if (!((app && !JPEG_KEEP.has(marker)) || mpf || marker === 0xfe)) parts.push(b.subarray(pos, end));   // COM: 0xFE
    pos = end;
  }
  return null;   // no scan: not a photo this can mend; the server says what it is
}

let crcTable = null;
function crc32(bytes) {   // PNG's CRC (ISO 3309, as zlib's)
  crcTable ??= Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k += 1) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  let c = 0xffffffff;
  for (const x of bytes) c = crcTable[(c ^ x) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

function pngChunk(type, data) {
  const out = new Uint8Array(12 + data.length), view = new DataView(out.buffer);
  view.setUint32(0, data.length);
  for (let i = 0; i < 4; i += 1) out[4 + i] = type.charCodeAt(i);
  out.set(data, 8);
  view.setUint32(8 + data.length, crc32(out.subarray(4, 8 + data.length)));
  return out;
}

// A PNG's eXIf chunk before its image data (what the server and browsers read; a later one neither does):
// { orientation, prefixed } (prefixed: the chunk starts with JPEG's "Exif\0\0", against the PNG spec: read
// through here and by the server, not by Chromium), or null where there is none or the chunks do not parse.
export function pngExif(b) {
  for (let pos = 8; pos + 12 <= b.length;) {
    const size = u32be(b, pos), type = ascii(b, pos + 4, pos + 8), data = b.subarray(pos + 8, pos + 8 + size);
    if (type === "IDAT" || pos + 12 + size > b.length) return null;
    if (type === "eXIf") return { orientation: blockOrientation(data), prefixed: ascii(data, 0, 6) === "Exif\0\0" };
    pos += 12 + size;
  }
  return null;
}

// PNG: the orientation of an eXIf chunk before the image data (Pillow reads one after it only as it decodes,
// after the server looked), written back after IHDR.
function png(b) {
  const parts = [b.subarray(0, 8)];
  let orientation = 1, data = false;
  for (let pos = 8; pos + 12 <= b.length;) {
    const size = u32be(b, pos), type = ascii(b, pos + 4, pos + 8), end = pos + 12 + size;
    if (end > b.length) return null;
    if (type === "IDAT") data = true;
    if (type === "eXIf" && !data) orientation = blockOrientation(b.subarray(pos + 8, pos + 8 + size));
    if (!PNG_DROP.has(type)) parts.push(b.subarray(pos, end));
    if (type === "IEND") {
      if (orientation > 1) parts.splice(2, 0, pngChunk("eXIf", orientationTiff(orientation)));   // after IHDR
      return parts;
    }
    pos = end;
  }
  return null;
}

function webp(b) {
  if (b.length < 30 || ascii(b, 12, 16) !== "VP8X") return [b];   // a simple WebP holds no metadata
  const parts = [null, b.subarray(12, 30)];
  let orientation = 1;
  for (let pos = 30; pos + 8 <= b.length;) {
    const size = u32le(b, pos + 4), end = pos + 8 + size + (size % 2), type = ascii(b, pos, pos + 4);
    if (end > b.length) return null;
    if (type === "EXIF") orientation = blockOrientation(b.subarray(pos + 8, pos + 8 + size));
    if (!WEBP_DROP.has(type)) parts.push(b.subarray(pos, end));
    pos = end;
  }
  const vp8x = parts[1].slice();
  vp8x[8] &= ~0x0c;   // the EXIF (0x08) and XMP (0x04) flags
  parts[1] = vp8x;
  if (orientation > 1) {
    vp8x[8] |= 0x08;
    const tiff = orientationTiff(orientation), head = new Uint8Array(8);
    head.set([0x45, 0x58, 0x49, 0x46, tiff.length, 0, 0, 0]);   // "EXIF", little-endian size (even: no pad)
    parts.push(head, tiff);
  }
  const size = parts.slice(1).reduce((n, p) => n + p.length, 4);
  const riff = new Uint8Array(12);
  riff.set(b.subarray(0, 12));
  new DataView(riff.buffer).setUint32(4, size, true);
  parts[0] = riff;
  return parts;
}

// GIF: its comments and application extensions but the loop count's (NETSCAPE2.0, ANIMEXTS1.0): XMP, ICC, an
// editor's own (a GIF with XMP and a comment went up with them: tryout31). Frames, their timing and disposal stay.
function gif(b) {
  const table = (flags) => (flags & 0x80 ? 3 * (1 << ((flags & 7) + 1)) : 0);   // a colour table's bytes
  const subBlocks = (at) => {   // past the data sub-blocks from `at` and their terminator
    while (at < b.length && b[at] !== 0) at += b[at] + 1;
    return at + 1;
  };
  if (b.length < 13) return null;
  let pos = 13 + table(b[10]);
  const parts = [b.subarray(0, pos)];
  while (pos < b.length) {
    const kind = b[pos];
    if (kind === 0x3b) return [...parts, b.subarray(pos, pos + 1)];   // the trailer
    let end;
    if (kind === 0x21) {   // an extension: its label, then data sub-blocks
      end = subBlocks(pos + 2);
      const app = b[pos + 1] === 0xff && b[pos + 2] === 11 ? ascii(b, pos + 3, pos + 14) : null;
      if (b[pos + 1] === 0xf9 || b[pos + 1] === 0x01 || app === "NETSCAPE2.0" || app === "ANIMEXTS1.0") {
        parts.push(b.subarray(pos, end));
      }
    } else if (kind === 0x2c) {   // a frame: its descriptor, local colour table, LZW code size, data sub-blocks
      end = subBlocks(pos + 10 + table(b[pos + 9]) + 1);
      parts.push(b.subarray(pos, end));
    } else {
      return null;
    }
    if (end > b.length) return null;   // cut short: it goes as it is, for the server to judge
    pos = end;
  }
  return null;
}

/**
 * `file` (of `format`, sniff()'s name) without its metadata, its EXIF orientation kept: resolves to { blob, kept }
 * where `kept` is true when the file went as it is, metadata and all (a format not handled here, a structure that
 * does not parse). Never rejects.
 */
export async function withoutMetadata(file, format) {
  const strip = { JPEG: jpeg, PNG: png, WEBP: webp, GIF: gif }[format];
  if (!strip) return { blob: file, kept: true };
  try {
    const parts = strip(new Uint8Array(await file.arrayBuffer()));
    return parts ? { blob: new Blob(parts, { type: file.type }), kept: false } : { blob: file, kept: true };
  } catch {
    return { blob: file, kept: true };
  }
}
