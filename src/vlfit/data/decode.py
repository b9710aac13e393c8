"""CPU image decoding: libjpeg-turbo with DCT-domain scaling for JPEG, Pillow for everything else.

Every decoder returns RGB with EXIF orientation applied (as Pillow's ``ImageOps.exif_transpose`` does), so the
pipelines agree on what a valid image looks like whatever its encoding.
"""

from __future__ import annotations

import io
import struct
import warnings
from dataclasses import dataclass

import numpy as np
import simplejpeg
from PIL import Image, ImageOps, UnidentifiedImageError

from vlfit.errors import DataError

JPEG_MAGIC = b"\xff\xd8\xff"
# Decompression-bomb guard: refuse images whose header declares more pixels than this (about 16k x 11k).
MAX_IMAGE_PIXELS = 178_956_970


class DecodeError(DataError):
    """An image cannot be decoded: ``sample <id>: <reason>``.

    Build it with ``for_sample``. The constructor takes the message alone because that is how torch re-raises a
    DataLoader worker's exception in the main process (``type(message)``): the type survives, the attributes are
    then ``None``.

    Attributes:
        sample_id: The sample's id as the caller named it (``images[0]``, a file's path).
        reason: Why it cannot be decoded, without the sample.
    """

    def __init__(self, message: str, sample_id: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.sample_id = sample_id
        self.reason = reason

    @classmethod
    def for_sample(cls, sample_id: str, reason: str) -> DecodeError:
        """``sample <id>: <reason>``."""
        return cls(f"sample {sample_id}: {reason}", sample_id, reason)


def is_jpeg(data: bytes) -> bool:
    """True when ``data`` starts with the JPEG start-of-image marker."""
    return data[:3] == JPEG_MAGIC


def jpeg_exif_orientation(data: bytes) -> int:
    """Read the EXIF orientation (1..8) of a JPEG from its APP1 segment without decoding; 1 when absent.

    Only the marker segments before the first scan are walked, so this costs microseconds.
    """
    pos, end = 2, len(data)
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # markers without a length field
            pos += 2
            continue
        if marker == 0xDA:  # start of scan: no EXIF after this point
            break
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        if marker == 0xE1 and data[pos + 4 : pos + 10] == b"Exif\x00\x00":
            return _tiff_orientation(data[pos + 10 : pos + 2 + length])
        pos += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    endian = "<" if tiff[:2] == b"II" else ">"
    (ifd,) = struct.unpack(endian + "I", tiff[4:8])
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack(endian + "H", tiff[ifd : ifd + 2])
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            break
        tag, kind = struct.unpack(endian + "HH", tiff[entry : entry + 4])
        if tag == 0x0112 and kind == 3:
            (value,) = struct.unpack(endian + "H", tiff[entry + 8 : entry + 10])
            return value if 1 <= value <= 8 else 1
    return 1


# Each EXIF orientation as what it does to the stored pixels, in order: transpose, flip the rows, flip the columns.
_ORIENTATIONS = {
    1: (False, False, False),
    2: (False, False, True),
    3: (False, True, True),
    4: (False, True, False),
    5: (True, False, False),
    6: (True, False, True),  # a quarter turn clockwise
    7: (True, True, True),
    8: (True, True, False),  # a quarter turn counter-clockwise
}
SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # those that swap width and height


def apply_orientation(hwc: np.ndarray, orientation: int) -> np.ndarray:
    """Transpose an HWC array as EXIF ``orientation`` asks (the same result as ``ImageOps.exif_transpose``)."""
    transpose, flip_rows, flip_columns = _ORIENTATIONS.get(orientation, _ORIENTATIONS[1])
    if transpose:
        hwc = hwc.transpose(1, 0, 2)
    if flip_rows:
        hwc = hwc[::-1]
    return hwc[:, ::-1] if flip_columns else hwc


def decode_pil(data: bytes, sample_id: str = "?", draft_size: int | tuple[int, int] | None = None) -> Image.Image:
    """Decode any format Pillow reads into an RGB image with EXIF orientation applied.

    Args:
        data: Encoded image bytes.
        sample_id: Named in errors.
        draft_size: For JPEG, let libjpeg downscale by 1/2, 1/4 or 1/8 while keeping both sides at least this
            (or the ``(width, height)`` given, as stored: before EXIF orientation).
    """
    try:
        image = _open_pil(data, sample_id)
        if draft_size is not None and image.format == "JPEG":
            image.draft("RGB", (draft_size, draft_size) if isinstance(draft_size, int) else draft_size)
        image = ImageOps.exif_transpose(image)
        if image.mode.startswith("I;16"):
            # Pillow clips 16-bit samples to 255 when converting to RGB (a white image); keep the high byte instead.
            image = Image.fromarray((np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8))
        return image.convert("RGB")
    except DecodeError:
        raise
    except Exception as err:  # Pillow raises many types for corrupt data
        raise DecodeError.for_sample(sample_id, f"cannot decode image ({type(err).__name__}: {err})") from err


def _open_pil(data: bytes, sample_id: str) -> Image.Image:
    """``Image.open`` (header only) with the emptiness, format and bomb checks every path shares."""
    if not data:
        raise DecodeError.for_sample(sample_id, "image is empty (0 bytes)")
    try:
        # Pillow warns from 89.5 megapixels; the size is checked against vlfit's own limits below (and a server's
        # lower --max_query_pixels after), which refuse or accept it, so the warning would only repeat them.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as err:
        # Pillow's own message names a BytesIO object, which tells the user nothing.
        raise DecodeError.for_sample(
            sample_id, f"not an image format Pillow can read ({len(data)} bytes starting {data[:8]!r})"
        ) from err
    except Image.DecompressionBombError as err:  # Pillow's own guard fires first for the largest declared sizes
        raise DecodeError.for_sample(sample_id, f"image is over the bomb limit ({err})") from err
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise DecodeError.for_sample(sample_id, f"image declares {width}x{height} pixels, over the bomb limit")
    return image


def check_image_header(data: bytes, sample_id: str = "?") -> tuple[int, int]:
    """Read an image's declared size without decoding it; refuse what no decoder would accept.

    Costs microseconds (only the header is parsed), so device-decode workers run it on every sample: data that
    is empty, not an image, or declares more than ``MAX_IMAGE_PIXELS`` is found while the dataset can still
    replace the sample. Corruption after the header is only found by decoding.

    Returns:
        ``(width, height)`` as the header declares them (before EXIF orientation).

    Raises:
        DecodeError: naming the sample and the reason.
    """
    if is_jpeg(data):
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        except Exception as err:
            raise DecodeError.for_sample(sample_id, f"corrupt JPEG header ({err})") from err
    else:
        try:
            width, height = _open_pil(data, sample_id).size
        except DecodeError:
            raise
        except Exception as err:  # Pillow raises many types for corrupt headers
            raise DecodeError.for_sample(sample_id, f"corrupt image header ({type(err).__name__}: {err})") from err
    if width * height > MAX_IMAGE_PIXELS:
        raise DecodeError.for_sample(sample_id, f"image declares {width}x{height} pixels, over the bomb limit")
    return width, height


@dataclass(frozen=True)
class ScaledPixels:
    """An image decoded at a reduced DCT scale (or at full size), EXIF orientation applied.

    Attributes:
        pixels: RGB HWC uint8.
        box: ``(top, left, height, width)``: where the whole image lies in ``pixels``, in their units. libjpeg decodes
            at ``n/8`` of the size and rounds each side up, so the last row and column stand partly for the encoder's
            padding past the image's edge (7/8 of them for a 577-row photo at 1/8), and an EXIF flip or turn puts
            them first. Resampling the box rather than all the pixels puts each output pixel where a decode at full
            size puts it: resampling all of them put a 64-pixel SigLIP's embeddings of 770 x 577 photos, upright and
            turned by their EXIF orientation, at cosine 0.994 to 0.998 of plain transformers' (0.9999 so).
    """

    pixels: np.ndarray
    box: tuple[float, float, float, float]

    @property
    def reduced(self) -> bool:
        """True when ``box`` is not all of ``pixels`` (then resample it with ``resize_crop_uint8``'s ``image_box``)."""
        return self.box != (0, 0, *self.pixels.shape[:2])


def decode_reduced(
    data: bytes, min_height: int, min_width: int, sample_id: str = "?", *, powers_of_two: bool = False
) -> ScaledPixels:
    """Decode at the smallest DCT scale whose sides, as shown (EXIF orientation applied), are still at least
    ``min_height x min_width``.

    JPEG goes through libjpeg-turbo (simplejpeg), at any of its ``n/8`` scales or, with ``powers_of_two``, at 1/8,
    1/4, 1/2 or 1 only (the scales with SIMD inverse DCTs, as Pillow's draft); the JPEGs libjpeg-turbo cannot
    convert to RGB (CMYK, YCCK) through Pillow's draft (the same power-of-two scaling); other formats through Pillow
    at full size.
    """
    if not is_jpeg(data):
        # np.array copies: Pillow's buffer is read-only, and torch warns on non-writable arrays.
        pixels = np.array(decode_pil(data, sample_id))
        return ScaledPixels(pixels, (0, 0, *pixels.shape[:2]))
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception as err:
        raise DecodeError.for_sample(sample_id, f"corrupt JPEG header ({err})") from err
    if height * width > MAX_IMAGE_PIXELS:
        raise DecodeError.for_sample(sample_id, f"image declares {width}x{height} pixels, over the bomb limit")
    orientation = jpeg_exif_orientation(data)
    if orientation in SWAPPING_ORIENTATIONS:
        min_height, min_width = min_width, min_height
    if colorspace in ("CMYK", "YCCK"):
        pixels = np.array(decode_pil(data, sample_id, draft_size=(min_width, min_height)))
        return ScaledPixels(pixels, _image_box(pixels.shape[:2], height, width, orientation))
    if powers_of_two:
        # libjpeg-turbo has SIMD inverse DCTs for 1/2 and 1/4 (1/8 is the DC term alone); its 3/8, 5/8 ... run in
        # plain C. On 1.1-megapixel photos at twice a 256-patch grid: 2.5-3.0 ms an image, against 2.9-3.1 ms at the
        # smallest of all its scales.
        for scale in (8, 4, 2, 1):
            scaled_height, scaled_width = -(-height // scale), -(-width // scale)
            if scaled_height >= min_height and scaled_width >= min_width:
                break
        min_height, min_width = scaled_height, scaled_width
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=min_height, min_width=min_width)
    except Exception as err:
        raise DecodeError.for_sample(sample_id, f"cannot decode JPEG ({err})") from err
    oriented = apply_orientation(pixels, orientation)
    return ScaledPixels(oriented, _image_box(oriented.shape[:2], height, width, orientation))


def _image_box(shape: tuple[int, ...], height: int, width: int, orientation: int) -> tuple[float, float, float, float]:
    """``ScaledPixels.box`` of a JPEG of ``height x width`` (as stored) decoded to ``shape`` (as shown)."""
    transpose, flip_rows, flip_columns = _ORIENTATIONS.get(orientation, _ORIENTATIONS[1])
    if transpose:
        height, width = width, height
    rows, columns = shape
    # libjpeg's scaled sides are ceil(side * n / 8); n is the only eighth that gives the long side's.
    long_side, long_decoded = max((height, rows), (width, columns))
    eighths = max(1, min(8, 8 * long_decoded // long_side))
    box_height, box_width = height * eighths / 8, width * eighths / 8
    if (-(-height * eighths // 8), -(-width * eighths // 8)) != (rows, columns):  # not a scaled decode of it
        return (0, 0, rows, columns)
    return (rows - box_height if flip_rows else 0, columns - box_width if flip_columns else 0, box_height, box_width)


def decode_scaled(data: bytes, min_side: int, sample_id: str = "?") -> np.ndarray:
    """Decode to an RGB HWC uint8 array, using DCT scaling to the smallest scale whose sides are still >= min_side
    (``decode_reduced``'s pixels: the last row and column may stand partly for padding past the image's edge)."""
    return decode_reduced(data, min_side, min_side, sample_id).pixels
