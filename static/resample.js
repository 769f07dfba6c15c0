// Pillow's antialiased resize, in the browser, pixel for pixel: so that a photo scaled here before upload
// gives the server the very pixels its own first step (torchvision Resize on a PIL image, i.e. Pillow's
// Image.resize) would make from the original, and the model answers the same.
//
// Why not the browser's own resize: this model's top-1 probability moves up to 15 points between two
// good resamplings of one photo (Chromium's "high" resize to 2x and a JPEG at quality 0.9: 5-12 points on
// the shared photos; Pillow Lanczos instead of bilinear to the same size: up to 19). The same pixels
// move it by nothing. tests/test_browser.py checks this file against Pillow itself, bit for bit.
//
// The recipe is Pillow's libImaging/Resample.c (Pillow 9-12): a separable filter whose support is
// scaled by the reduction factor (antialiasing), coefficients normalised per output pixel and rounded
// to 22-bit fixed point (PRECISION_BITS = 32 - 8 - 2), a horizontal pass to 8 bits (rounded, clipped),
// then a vertical pass over it.

const PRECISION_BITS = 32 - 8 - 2;
const ONE = 1 << PRECISION_BITS;
const HALF = 1 << (PRECISION_BITS - 1);
const MAX = 255 << PRECISION_BITS;

// The filters this page can reproduce, by the name GET /api/v1/models gives as `send_resample`.
export const FILTERS = {
  bilinear: { support: 1, weight: (x) => { x = Math.abs(x); return x < 1 ? 1 - x : 0; } },
};

// For each output pixel along one axis: the first input pixel, how many, and their fixed-point weights.
function coefficients(inSize, outSize, filter) {
  const scale = inSize / outSize;
  const filterscale = Math.max(scale, 1);
  const support = filter.support * filterscale;
  const ksize = Math.ceil(support) * 2 + 1;
  const first = new Int32Array(outSize), count = new Int32Array(outSize);
  const weights = new Int32Array(outSize * ksize);
  const k = new Float64Array(ksize);
  for (let xx = 0; xx < outSize; xx++) {
    const center = (xx + 0.5) * scale;
    const xmin = Math.max(Math.trunc(center - support + 0.5), 0);   // C's (int) cast truncates
    const n = Math.min(Math.trunc(center + support + 0.5), inSize) - xmin;
    let total = 0;
    for (let x = 0; x < n; x++) total += k[x] = filter.weight((x + xmin - center + 0.5) / filterscale);
    for (let x = 0; x < n; x++) {
      const v = total !== 0 ? k[x] / total : k[x];
      weights[xx * ksize + x] = v < 0 ? Math.trunc(-0.5 + v * ONE) : Math.trunc(0.5 + v * ONE);
    }
    first[xx] = xmin;
    count[xx] = n;
  }
  return { ksize, first, count, weights };
}

const clip8 = (v) => (v >= MAX ? 255 : v <= 0 ? 0 : v >> PRECISION_BITS);

/**
 * Resize opaque RGBA pixels exactly as Pillow's `Image.resize((ow, oh), filter)` resizes the RGB image.
 * `rgba`: Uint8ClampedArray of w*h*4 (ImageData.data; alpha is ignored: draw on white first);
 * returns Uint8ClampedArray of ow*oh*4 with alpha 255, ready for `new ImageData(out, ow, oh)`.
 * Throws on an unknown filter name.
 */
export function resize(rgba, w, h, ow, oh, name = "bilinear") {
  const filter = FILTERS[name];
  if (!filter) throw new Error(`no such filter: ${name}`);
  // Horizontal pass (skipped where the width stays, as Pillow skips it): w x h RGBA -> ow x h RGB.
  let mid = rgba, stride = 4, mw = w;
  if (ow !== w) {
    const { ksize, first, count, weights } = coefficients(w, ow, filter);
    const src = new Uint32Array(rgba.buffer, rgba.byteOffset, w * h);   // one load per pixel (little-endian)
    mid = new Uint8Array(ow * h * 3);
    for (let y = 0; y < h; y++) {
      const row = y * w;
      let o = y * ow * 3;
      for (let xx = 0; xx < ow; xx++) {
        const n = count[xx], k0 = xx * ksize;
        let p = row + first[xx], r = HALF, g = HALF, b = HALF;
        for (let x = 0; x < n; x++, p++) {
          const c = weights[k0 + x], px = src[p];
          r += (px & 255) * c;
          g += ((px >>> 8) & 255) * c;
          b += ((px >>> 16) & 255) * c;
        }
        mid[o++] = clip8(r);
        mid[o++] = clip8(g);
        mid[o++] = clip8(b);
      }
    }
    stride = 3;
    mw = ow;
  }
  // Vertical pass over the (rounded) horizontal result: mw x h -> ow x oh RGBA.
  const out = new Uint8ClampedArray(ow * oh * 4);
  if (oh === h) {
    for (let i = 0, j = 0; i < out.length; i += 4, j += stride) {
      out[i] = mid[j]; out[i + 1] = mid[j + 1]; out[i + 2] = mid[j + 2]; out[i + 3] = 255;
    }
    return out;
  }
  const { ksize, first, count, weights } = coefficients(h, oh, filter);
  const line = mw * stride;
  for (let yy = 0; yy < oh; yy++) {
    const n = count[yy], k0 = yy * ksize, top = first[yy] * line;
    let o = yy * ow * 4;
    for (let xx = 0; xx < ow; xx++) {
      let p = top + xx * stride, r = HALF, g = HALF, b = HALF;
      for (let y = 0; y < n; y++, p += line) {
        const c = weights[k0 + y];
        r += mid[p] * c;
        g += mid[p + 1] * c;
        b += mid[p + 2] * c;
      }
      out[o++] = clip8(r);
      out[o++] = clip8(g);
      out[o++] = clip8(b);
      out[o++] = 255;
    }
  }
  return out;
}

/**
 * The size torchvision's Resize(short) gives a w x h image: the short side becomes `short`, the long
 * one `floor(short * long / short_side)` (torchvision's `int(...)`), so the server's own resize of the
 * copy is then the identity. Returns [width, height].
 */
export function resizedSize(w, h, short) {
  const s = Math.min(w, h), l = Math.max(w, h);
  const long = Math.floor((short * l) / s);
  return w <= h ? [short, long] : [long, short];
}
