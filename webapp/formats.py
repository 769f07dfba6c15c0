"""What an upload is, from its first bytes: the photo format it starts like (``claimed_format``: a file that
does and that Pillow cannot open is a damaged photo, 400) or the format it is that this service does not
decode (``sniff_format``: the 415 names it: HEIC, PDF, SVG...); and a JPEG's marker segments (``jpeg_segments``,
the one walk that the cut, mend and scan checks share) and its frame (``jpeg_frame``: the decoder it needs, or
none here, and its quantization tables' damage: 0 for a DC entry); and a file of far more parts than a photo
has (``too_many_parts``: scans, segments, chunks, GIF extension blocks). Pure bytes, no Pillow, no torch.
"""

from __future__ import annotations

import re
import struct
from typing import Iterator, NamedTuple

# Leading bytes of formats we cannot decode, so the 415 can name them.
_SIGNATURES = (
    (b"%PDF", "PDF"), (b"%!PS", "PostScript"), (b"PK\x03\x04", "ZIP"), (b"\x1f\x8b", "gzip"),
    (b"8BPS", "PSD"), (b"<svg", "SVG"), (b"<?xml", "XML/SVG"), (b"<!doctype html", "HTML"), (b"<html", "HTML"),
    (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"), (b"\x00\x00\x00\x0cJXL \r\n\x87\n", "JPEG XL"), (b"\xff\x0a", "JPEG XL"),
    (b"qoif", "QOI"), (b"v/1\x01", "OpenEXR"), (b"DDS ", "DDS"), (b"#?RADIANCE", "Radiance HDR"),
    (b"#?RGBE", "Radiance HDR"), (b"P7\n", "PAM"), (b"\x01\xda", "SGI"), (b"\x59\xa6\x6a\x95", "Sun raster"),
    (b"#define ", "XBM"), (b"/* XPM */", "XPM"), (b"SIMPLE  =", "FITS"), (b"\x1a\x45\xdf\xa3", "Matroska/WebM video"),
    (b"OggS", "Ogg"), (b"ID3", "MP3"), (b"{\\rtf", "RTF"), (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "Microsoft Office"),
)  # compared case-blind (HTML's doctype is written either way); TGA has no magic bytes
# Leading bytes of formats we do decode: a file that starts like one but that Pillow cannot even
# identify claims that format and is broken (400 undecodable), not an unknown format (415).
# Every format of FORMATS has its magic here (WebP and AVIF, in RIFF and ISO media boxes, in claimed_format).
_DECODABLE = ((b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
              (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"BM", "BMP"),
              *((b"P%d" % i, "PPM") for i in range(1, 7)))
_FTYP_BRANDS = {b"heic": "HEIC", b"heix": "HEIC", b"hevc": "HEIC", b"mif1": "HEIF", b"msf1": "HEIF",
                b"avif": "AVIF", b"avis": "AVIF"}


def claimed_format(data: bytes) -> str | None:
    """The decodable format ``data`` starts like (one of ``FORMATS``, by its magic bytes, or by the start of them
    where the file is shorter; a JPEG also by its SOI alone, or by the JFIF or EXIF block that follows a damaged or
    missing SOI), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[4:8] == b"ftyp" and {b"avif", b"avis"} & set(_ftyp_brands(data)):
        return "AVIF"
    for magic, name in _DECODABLE:
        if data.startswith(magic):
            return name
    if len(data) > 2 and data[:2] == b"\xff\xd8" or any(data[at - 4:at - 3] == b"\xff" and data[at:at + 5] in (
            b"JFIF\x00", b"Exif\x00") for at in (4, 6)):  # the marker after SOI damaged, or SOI itself, or SOI
        return "JPEG"  # missing, before a JFIF or EXIF block: a damaged JPEG (400), not "not an image format"
    for magic, name in _DECODABLE:  # cut inside its signature (a 2-byte FF D8): the format it began as, where
        # the bytes say so (2 of them not ASCII, or 3 or more; "GI" or "P" alone is as likely a text file)
        if 2 <= len(data) < len(magic) and magic.startswith(data) and (len(data) >= 3 or not data.isascii()):
            return name
    return None


def _ftyp_brands(data: bytes) -> list[bytes]:
    """An ISO media file's brands: its major brand, then the compatible ones of its ``ftyp`` box (an AVIF
    may say ``mif1`` first and ``avif`` among the compatible ones)."""
    size = min(int.from_bytes(data[:4], "big"), len(data), 256)
    return [data[8:12]] + [data[i:i + 4] for i in range(16, size - 3, 4)]


def sniff_format(data: bytes) -> str | None:
    """Name the format of bytes Pillow cannot open (HEIC, PDF...), for the 415 message; None if unknown."""
    if data[4:8] == b"ftyp":
        brand = data[8:12]
        if len(brand) < 4 or not all(0x20 < c < 0x7F for c in brand):  # cut inside it, or not a brand
            return "ISO media (HEIC, AVIF, MP4...)"
        return _FTYP_BRANDS.get(brand, "ISO media (" + brand.decode("ascii") + ")")
    head = data[:64].lstrip().lower()
    for magic, name in _SIGNATURES:
        if head.startswith(magic.lower()):
            return name
    if data[:4] == b"RIFF":  # WebP is decoded (claimed_format); other RIFF files are audio or video
        return {b"AVI ": "AVI video", b"WAVE": "WAV audio"}.get(data[8:12], "RIFF")
    if data.endswith(b"TRUEVISION-XFILE.\x00"):  # TGA 2.0's footer: TGA has no leading magic
        return "TGA"
    if len(data) >= 128 and data[0] == 0x0A and data[1] in (0, 2, 3, 4, 5) and data[2] in (0, 1) and \
            data[3] in (1, 2, 4, 8):  # PCX: manufacturer 10, version, RLE flag, bits per pixel (no real magic)
        return "PCX"
    return None


def article(name: str) -> str:
    """"a" or "an" before a format's name as it is said: letter by letter for the acronyms (an HTML, an SVG)."""
    return "an" if name[:1] in "AEIOU" or name in ("HTML", "SVG", "XML/SVG", "SGI", "XBM", "XPM", "MP3", "RTF") else "a"


# SOF markers of arithmetic-coded and of lossless JPEG frames (ITU T.81 table B.1).
_ARITHMETIC_SOF = {0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_LOSSLESS_SOF = {0xC3, 0xC7, 0xCB, 0xCF}
_NO_LENGTH = {0x01, 0xD8, 0xD9, *range(0xD0, 0xD8)}  # TEM, SOI, EOI, RST0-7: a marker alone (T.81 B.1.1.3)
_SOS, _EOI = 0xDA, 0xD9
NEXT_MARKER = re.compile(rb"\xff(?![\x00\xd0-\xd7\xff])")  # in scan data: not a stuffed 00, an RSTn or a fill


class Segment(NamedTuple):
    """One JPEG marker segment: ``pos``, the offset of its FF; ``marker``, the byte after it (None where the data
    ended before it); ``end``, the offset just after the segment (its 2-byte length counted from ``pos + 2``; a
    marker alone is 2 bytes). ``end`` > ``len(data)`` where the data ends inside the segment."""
    pos: int
    marker: int | None
    end: int


def jpeg_segments(data: bytes, scans: bool = False) -> Iterator[Segment]:
    """JPEG ``data``'s marker segments after its SOI, walked by their lengths (ITU T.81 B.1.1), fill bytes
    (``FF FF``) skipped: the one walk that ``cuts``, ``repair``, ``incomplete`` and ``jpeg_frame`` share.

    The walk ends after EOI; after SOS, unless ``scans``: then each SOS's entropy-coded data is skipped to the
    next marker (its stuffed ``FF 00`` and RSTn are part of it) and the walk goes on, or ends where none
    follows; after a segment the data ends inside (yielded, with ``end`` past the data); and, yielding
    nothing more, at a byte that is not FF where a marker must be or at a length under 2 (damage). The
    caller tells a cut (the last segment's ``end`` > ``len(data)``) from damage (the walk just stops)."""
    pos, n = 2, len(data)
    while True:
        if pos + 2 > n:
            yield Segment(pos, None, pos + 2)
            return
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker in _NO_LENGTH:
            yield Segment(pos, marker, pos + 2)
            if marker == _EOI:
                return
            pos += 2
            continue
        if pos + 4 > n:
            yield Segment(pos, marker, pos + 4)
            return
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if length < 2:
            return
        end = pos + 2 + length
        yield Segment(pos, marker, end)
        if end > n or (marker == _SOS and not scans):
            return
        if marker == _SOS:
            found = NEXT_MARKER.search(data, end)
            if found is None:
                return
            end = found.start()
        pos = end


# The most parts a file may have before it is refused unread (tryout21: valid files built to cost seconds of CPU
# in small bytes). Scans: a photo's encoder writes 1, or 10 (libjpeg's progressive script) to about 20, and each
# scan is another pass over the whole image: a 489 KB file of 3,000 scans of an 8900x8900 frame took 13-17 s
# in libjpeg. nvImageCodec refuses over 256 for the same reason (NVIMGCODEC_MAX_JPEG_SCANS, after cure53's
# libjpeg-turbo audit); 100 bounds that file to about 1.5 s, a large PNG's cost. Other parts (JPEG marker
# segments, PNG chunks besides image data): a photo has tens; 1,000,000 empty COM segments took 7-10 s, 500,000
# PNG chunks 4.7 s, each walked in Python. Image data chunks are cheaper (a 2000x1500 PNG in 74,000 chunks of 64
# bytes: 0.24 s against 0.16 s in 72) and encoders write them small (libpng 8 KB, streaming ones 1 KB: a 32 MB
# PNG of 1 KB chunks has 32,000): only the walk's own bound applies to them.
MAX_JPEG_SCANS = 100
MAX_PARTS = 10_000
MAX_DATA_BLOCKS = 200_000  # PNG image data chunks, GIF blocks: a bound on the walk, not on photos


def too_many_parts(data: bytes) -> str | None:
    """Words for a JPEG of more than ``MAX_JPEG_SCANS`` scans or ``MAX_PARTS`` marker segments, a PNG of more
    than ``MAX_PARTS`` chunks besides its image data (or ``MAX_DATA_BLOCKS`` of that), or a GIF of as many
    extension blocks (``_gif_parts``): ``decode`` refuses it (413)
    before Pillow walks them. None for any other file, and where the walk stops early (damage: ``decode``'s to
    judge). Walks at most ``MAX_PARTS`` + 1 parts (a PNG and a GIF: and ``MAX_DATA_BLOCKS`` + 1 data blocks)."""
    if data[:3] == b"\xff\xd8\xff":
        scans = 0
        for count, seg in enumerate(jpeg_segments(data, scans=True), 1):
            scans += seg.marker == _SOS
            if scans > MAX_JPEG_SCANS:
                return (f"the JPEG has more than {MAX_JPEG_SCANS} scans, each a pass over the whole image (a "
                        f"photo has 1, or about 10 to 20 when progressive); save it again")
            if count > MAX_PARTS:
                return f"the JPEG has more than {MAX_PARTS:,} marker segments (a photo has tens); save it again"
    elif data[:8] == b"\x89PNG\r\n\x1a\n":  # image data chunks (IDAT, APNG's fdAT): counted apart
        pos, count, image = 8, 0, 0
        while pos + 8 <= len(data) and (kind := data[pos + 4:pos + 8]) != b"IEND":
            pos = pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
            count, image = (count, image + 1) if kind in (b"IDAT", b"fdAT") else (count + 1, image)
            if count > MAX_PARTS or image > MAX_DATA_BLOCKS:
                return (f"the PNG has more than {MAX_PARTS:,} chunks besides its image data, or {MAX_DATA_BLOCKS:,} "
                        f"image data chunks (a photo has tens, and a few thousand); save it again")
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        return _gif_parts(data)
    return None


def _gif_parts(data: bytes) -> str | None:
    """``too_many_parts`` of a GIF (GIF89a spec, sections 17-27): more than ``MAX_PARTS`` extension data sub-blocks
    besides each extension's first (tryout21: one comment of 2,000,000 one-byte sub-blocks, 4 MB, took 1.3 s; a
    frame's graphic control extension has one, an animation of any length few more), or more than
    ``MAX_DATA_BLOCKS`` blocks and sub-blocks in all (the walk's own bound: a 32 MB GIF of 255-byte sub-blocks
    has 131,000)."""
    n = len(data)
    pos = 13 + (3 << ((data[10] & 7) + 1) if n > 10 and data[10] & 0x80 else 0)  # header, screen, global colours
    parts = blocks = 0
    while pos < n and data[pos] in (0x21, 0x2C):
        if data[pos] == 0x2C:  # an image: descriptor, local colours, LZW code size, then its data sub-blocks
            flags = data[pos + 9] if pos + 9 < n else 0
            pos, extension = pos + 11 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0), False
        else:  # an extension: introducer, label, then its data sub-blocks
            pos, extension = pos + 2, True
        first = True
        while pos < n and data[pos]:
            pos, blocks, parts = pos + 1 + data[pos], blocks + 1, parts + (extension and not first)
            first = False
            if parts > MAX_PARTS or blocks > MAX_DATA_BLOCKS:
                return (f"the GIF has more than {MAX_PARTS:,} extension blocks, or {MAX_DATA_BLOCKS:,} blocks in "
                        f"all (a photo has a few; an animation one a frame); save it again")
        pos, blocks = pos + 1, blocks + 1
    return None


class JpegFrame(NamedTuple):
    """A JPEG's frame header as far as the decoders care: its SOF ``marker``, its sample ``precision`` (bits),
    and ``zero_dc``: the components (their places in the frame, from 0: Y, Cb, Cr in a colour photo) whose
    quantization table has 0 for its DC entry. That is a damaged DQT segment (T.81 B.2.4.1: entries are 1-255,
    or 1-65535 at 16 bits); libjpeg does not check, and multiplies every block's average by 0: such a luma
    decodes as mid-grey (with its edges, where the AC entries are not 0 too), such a chroma without its colour,
    and the model would classify that."""
    marker: int
    precision: int
    zero_dc: tuple[int, ...] = ()

    @property
    def arithmetic(self) -> bool:
        """Whether the frame is arithmetic-coded (T.81 annex D): Pillow's libjpeg lacks that decoder."""
        return self.marker in _ARITHMETIC_SOF

    @property
    def undecodable(self) -> str | None:
        """What makes the frame one no decoder here reads, as words ("a lossless 16-bit JPEG", "a 12-bit JPEG":
        medical and scientific exports), or None: Pillow's and torchvision's libjpeg-turbo decode 8-bit lossy
        frames only."""
        if self.marker in _LOSSLESS_SOF:
            return f"a lossless {self.precision}-bit JPEG" if 2 <= self.precision <= 16 else None
        return "a 12-bit JPEG" if self.precision == 12 else None  # T.81 B.2.2: DCT frames are 8 or 12 bits; any
        # other precision is a damaged header, which the decoder refuses as such


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """JPEG ``data``'s frame: the first SOF (T.81 B.2.2) among its marker segments, with the quantization
    tables as defined before the first scan, where each component's is taken (T.81 G.1.1.1), in one walk of
    the header. None for another format, a damaged header or one with no frame before its first scan;
    ``zero_dc`` is () where a segment the check needs is cut."""
    if data[:2] != b"\xff\xd8":
        return None
    frame: JpegFrame | None = None
    dc: dict[int, int] = {}
    used: list[int] = []
    for seg in jpeg_segments(data):
        if seg.marker is None or seg.marker in (_EOI, _SOS) or seg.pos + 5 > len(data):
            break
        whole, body = seg.end <= len(data), data[seg.pos + 4:seg.end]
        if seg.marker == 0xDB and whole:  # DQT: (Pq << 4 | Tq, then 64 entries of 1 byte, or 2 where Pq is 1)...
            at = 0
            while at + 3 <= len(body):
                wide, table = body[at] >> 4, body[at] & 0x0F
                dc[table] = int.from_bytes(body[at + 1:at + 3], "big") if wide else body[at + 1]
                at += 1 + 64 * (2 if wide else 1)
        elif frame is None and 0xC0 <= seg.marker <= 0xCF and seg.marker not in (0xC4, 0xC8, 0xCC):  # a SOF (not
            frame = JpegFrame(seg.marker, data[seg.pos + 4])  # DHT, JPG, DAC)
            if whole and len(body) >= 6:  # Ci, Hi|Vi, Tqi per component
                used = [body[6 + 3 * i + 2] for i in range(body[5]) if 6 + 3 * i + 2 < len(body)]
    if frame is None:
        return None
    return frame._replace(zero_dc=tuple(i for i, table in enumerate(used) if dc.get(table) == 0))


def jpeg_arithmetic(data: bytes) -> bool:
    """Whether JPEG ``data``'s frame is arithmetic-coded (T.81 annex D)."""
    frame = jpeg_frame(data)
    return frame is not None and frame.arithmetic


# TIFF 6.0 field types a tag's values may come in (BYTE, SHORT, LONG, LONG8), by type number.
_TIFF_VALUES = {1: "B", 3: "H", 4: "I", 16: "Q"}
_TIFF_FLOAT, _TIFF_COMPLEX = 3, (5, 6)  # SampleFormat (tag 339): IEEE float; complex integer, complex float


def tiff_samples(data: bytes) -> str | None:
    """Words for a TIFF whose first IFD declares samples no decoder here reads, e.g. "a TIFF of 64-bit
    floating-point samples, 3 per pixel"; None for every other file. Pillow reads one float format only, 32-bit
    with one sample a pixel (mode F); float16, float64, several float samples a pixel or complex ones it cannot even
    identify, which read as a damaged file (tryout19: a valid float TIFF "starts like TIFF, but its header cannot be
    read"). Tags 258 BitsPerSample, 277 SamplesPerPixel, 339 SampleFormat. Raises nothing."""
    try:
        order = "<" if data[:4] == b"II*\x00" else ">" if data[:4] == b"MM\x00*" else None
        if order is None:
            return None
        ifd = struct.unpack_from(order + "I", data, 4)[0]
        tags: dict[int, tuple[int, ...]] = {}
        for i in range(min(struct.unpack_from(order + "H", data, ifd)[0], 4096)):
            tag, kind, n = struct.unpack_from(order + "HHI", data, ifd + 2 + 12 * i)
            if tag in (258, 277, 339) and kind in _TIFF_VALUES and 0 < n <= 64:
                size = n * struct.calcsize(_TIFF_VALUES[kind])
                at = ifd + 10 + 12 * i if size <= 4 else struct.unpack_from(order + "I", data, ifd + 10 + 12 * i)[0]
                tags[tag] = struct.unpack_from(f"{order}{n}{_TIFF_VALUES[kind]}", data, at)
    except struct.error:
        return None
    fmt, bits, spp = tags.get(339, (1,))[0], tags.get(258, (1,))[0], tags.get(277, (1,))[0]
    if fmt == _TIFF_FLOAT and not (bits == 32 and spp == 1) or fmt in _TIFF_COMPLEX:
        kind = "complex" if fmt in _TIFF_COMPLEX else "floating-point"
        return f"a TIFF of {bits}-bit {kind} samples" + (f", {spp} per pixel" if spp > 1 else "")
    return None
