"""Drawing a scene as a photo-like JPEG: textured background, shapes placed inside their regions, grain.

Images are built to look like real photos *to a JPEG decoder*: textured everywhere (smooth multi-scale noise,
grain, strokes), JPEG with 4:2:0 chroma subsampling and a long side of several hundred pixels, so decode cost in
benchmarks is representative.
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, ImageDraw

from vlfit.data.synthetic.scenes import COLOURS, Group, Scene, SyntheticConfig

# The central square of the image (what resizing the short side and center-cropping keep, as every training
# pipeline does) is partitioned into a center box and four trapezoids cut by the diagonals (normalised x, y in
# that square). Objects stay inside it, so a caption never names an object the crop removed; the margins beyond
# it carry background only.
_EDGE = 0.28
_REGION_POLYGONS: dict[str, tuple[tuple[float, float], ...]] = {
    "left": ((0, 0), (_EDGE, _EDGE), (_EDGE, 1 - _EDGE), (0, 1)),
    "right": ((1, 0), (1, 1), (1 - _EDGE, 1 - _EDGE), (1 - _EDGE, _EDGE)),
    "top": ((0, 0), (1, 0), (1 - _EDGE, _EDGE), (_EDGE, _EDGE)),
    "bottom": ((_EDGE, 1 - _EDGE), (1 - _EDGE, 1 - _EDGE), (1, 1), (0, 1)),
    "center": ((_EDGE, _EDGE), (1 - _EDGE, _EDGE), (1 - _EDGE, 1 - _EDGE), (_EDGE, 1 - _EDGE)),
}
# Where object centres are drawn from (normalised x0, y0, x1, y1): away from the corners between regions.
_REGION_CORES: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "left": ((0.0, 0.2), (_EDGE, 0.8)),
    "right": ((1 - _EDGE, 0.2), (1.0, 0.8)),
    "top": ((0.2, 0.0), (0.8, _EDGE)),
    "bottom": ((0.2, 1 - _EDGE), (0.8, 1.0)),
    "center": ((_EDGE, _EDGE), (1 - _EDGE, 1 - _EDGE)),
}
# Object extent as a fraction of the short side, smaller when more objects must fit in one region.
_SIZE_RANGE = {1: (0.18, 0.25), 2: (0.15, 0.21), 3: (0.12, 0.17)}
# Circumradius / extent per kind, used for placement (containment and non-overlap).
_RADIUS_FACTOR = {"circle": 0.5, "square": 0.5 * math.sqrt(2), "triangle": 0.66, "cross": 0.53}


def _smooth_noise(
    rng: np.random.Generator, height: int, width: int, cells: tuple[float, ...], channels: int
) -> np.ndarray:
    """Sum of bicubically upsampled random grids, one per cell size (in pixels), as float32 (h, w, channels)."""
    out = np.zeros((height, width, channels), np.float32)
    for cell in cells:
        gh, gw = max(2, math.ceil(height / cell) + 1), max(2, math.ceil(width / cell) + 1)
        grid = rng.standard_normal((gh, gw, channels), dtype=np.float32)
        for c in range(channels):
            layer = Image.fromarray(grid[:, :, c], mode="F").resize((width, height), Image.Resampling.BICUBIC)
            out[:, :, c] += np.asarray(layer) * (cell / max(cells)) ** 0.5  # coarser scales carry more energy
    return out


# Range of a background's mean grey level per ``SyntheticConfig.background``.
_BACKGROUND_LEVELS = {"light": (80.0, 190.0), "dark": (15.0, 60.0)}


def _background(rng: np.random.Generator, width: int, height: int, background: str = "light") -> Image.Image:
    # Built at quarter resolution and upsampled once: the smooth part has no detail worth full-res noise.
    lw, lh = max(2, width // 4), max(2, height // 4)
    # Desaturated so objects keep their colour; one draw either way, so a seed's layouts do not depend on it.
    base = rng.uniform(*_BACKGROUND_LEVELS[background]) + rng.uniform(-14, 14, size=3)
    luma = _smooth_noise(rng, lh, lw, (lh / 1.5, lh / 5, 6.0, 2.0), 1) * rng.uniform(14, 26)
    chroma = _smooth_noise(rng, lh, lw, (lh / 2.0,), 3) * 6.0
    low = np.clip(base + luma + chroma, 0, 255).astype(np.uint8)
    image = Image.fromarray(low, "RGB").resize((width, height), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(image)
    short = min(width, height)
    for _ in range(int(rng.integers(3, 9))):  # a few sketchy strokes for hard edges in the background
        points = [
            (float(x), float(y)) for x, y in rng.uniform(0, 1, size=(int(rng.integers(2, 5)), 2)) * (width, height)
        ]
        tone = int(rng.uniform(20, 235))
        draw.line(points, fill=(tone, tone, tone), width=max(1, int(short * rng.uniform(0.002, 0.008))))
    return image


def _inside(point: tuple[float, float], radius: float, polygon: list[tuple[float, float]]) -> bool:
    """Whether a disc lies inside a convex polygon given in clockwise-or-counter-clockwise order."""
    cx = sum(p[0] for p in polygon) / len(polygon)
    cy = sum(p[1] for p in polygon) / len(polygon)
    for (x0, y0), (x1, y1) in zip(polygon, polygon[1:] + polygon[:1], strict=True):
        nx, ny = y0 - y1, x1 - x0
        norm = math.hypot(nx, ny)
        sign = 1.0 if (cx - x0) * nx + (cy - y0) * ny > 0 else -1.0  # orient the normal inwards
        if sign * ((point[0] - x0) * nx + (point[1] - y0) * ny) / norm < radius:
            return False
    return True


def _place(scene: Scene, rng: np.random.Generator, width: int, height: int) -> list[tuple[Group, float, float, float]]:
    """Return (group, x, y, extent) for every object: fully inside its region of the central square and never
    overlapping another."""
    short = min(width, height)
    left, top = (width - short) / 2, (height - short) / 2
    gap = 0.05 * short  # wide enough to count objects after downscaling to ~128 px
    placed: list[tuple[Group, float, float, float]] = []
    for group in scene:
        polygon = [(left + u * short, top + v * short) for u, v in _REGION_POLYGONS[group.region]]
        (u0, v0), (u1, v1) = _REGION_CORES[group.region]
        lo, hi = _SIZE_RANGE[group.count]
        extent = rng.uniform(lo, hi) * short
        core = (left + u0 * short, top + v0 * short, left + u1 * short, top + v1 * short)
        attempts = 60
        for attempt in range(attempts):
            if attempt and attempt % 6 == 0:
                extent = max(0.09 * short, extent * 0.93)  # crowded region: shrink the group rather than overlap
            # The last attempt keeps its candidates whatever happens, so the caption's count always holds.
            objects = _place_group(group, extent, polygon, core, placed, gap, rng, strict=attempt < attempts - 1)
            if objects is not None:
                break
        placed.extend(objects)
    return placed


def _place_group(
    group: Group,
    extent: float,
    polygon: list[tuple[float, float]],
    core: tuple[float, float, float, float],
    placed: list[tuple[Group, float, float, float]],
    gap: float,
    rng: np.random.Generator,
    strict: bool,
) -> list[tuple[Group, float, float, float]] | None:
    """Place all objects of a group at about one size, or return None when the region is too full (if strict)."""
    objects: list[tuple[Group, float, float, float]] = []
    for _ in range(group.count):
        size = extent * rng.uniform(0.92, 1.08)
        radius = size * _RADIUS_FACTOR[group.kind]
        for _ in range(100):
            # Centres come from the region's core so objects sit clearly left/top/...; the disc must fit the region.
            x, y = rng.uniform(core[0], core[2]), rng.uniform(core[1], core[3])
            if _inside((x, y), radius, polygon) and all(
                math.hypot(x - ox, y - oy) >= radius + oe * _RADIUS_FACTOR[og.kind] + gap
                for og, ox, oy, oe in placed + objects
            ):
                break
        else:
            if strict:
                return None
        objects.append((group, x, y, size))
    return objects


def _cross_outline(arm: float = 0.5, half_thickness: float = 1 / 6) -> list[tuple[float, float]]:
    # One arm tip plus the inner corner after it, rotated by quarter turns.
    points = [(-half_thickness, -arm), (half_thickness, -arm), (half_thickness, -half_thickness)]
    outline = []
    for _ in range(4):
        outline.extend(points)
        points = [(-v, u) for u, v in points]
    return outline


# Unit outlines (extent 1, centred on the origin) of the polygon kinds.
_OUTLINES = {
    "square": [(-0.5, -0.5), (0.5, -0.5), (0.5, 0.5), (-0.5, 0.5)],
    "triangle": [(0.66 * math.cos(a), 0.66 * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)],
    "cross": _cross_outline(),
}


def _shape(kind: str, x: float, y: float, extent: float, angle: float) -> list[tuple[float, float]]:
    cos, sin = math.cos(angle), math.sin(angle)
    return [(x + extent * (u * cos - v * sin), y + extent * (u * sin + v * cos)) for u, v in _OUTLINES[kind]]


def render_scene(scene: Scene, rng: np.random.Generator, config: SyntheticConfig) -> bytes:
    """Draw ``scene`` as a JPEG: size, background, placement, colours and grain all come from ``rng``.

    Args:
        scene: The groups to draw, each inside its region.
        rng: The record's generator, already advanced past the scene sampling (the record is a function of it).
        config: Image size range, background and JPEG quality.

    Returns:
        The JPEG bytes (4:2:0 chroma subsampling, quality ``config.jpeg_quality``).
    """
    long_side = int(rng.integers(config.min_long_side, config.max_long_side + 1))
    short_side = max(1, round(long_side / rng.uniform(1.05, 1.4)))
    width, height = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
    image = _background(rng, width, height, config.background)
    draw = ImageDraw.Draw(image)
    outline_width = max(1, round(min(width, height) * rng.uniform(0.004, 0.01)))
    outline = rng.random() < 0.5
    for group, x, y, extent in _place(scene, rng, width, height):
        fill = tuple(int(c) for c in np.clip(np.array(COLOURS[group.colour]) + rng.integers(-15, 16, 3), 0, 255))
        edge = (25, 25, 25) if outline else None
        if group.kind == "circle":
            r = extent / 2
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill, outline=edge, width=outline_width)
        else:
            spin = rng.uniform(-0.35, 0.35) if group.kind != "triangle" else rng.uniform(-0.5, 0.5)
            draw.polygon(_shape(group.kind, x, y, extent, spin), fill=fill, outline=edge, width=outline_width)
    # Shading plus grain over everything so objects are textured too; most of the JPEG bits come from here.
    shade = _smooth_noise(rng, max(2, height // 8), max(2, width // 8), (6.0, 2.0), 1)[:, :, 0] * 6.0
    shade = np.asarray(Image.fromarray(shade, mode="F").resize((width, height), Image.Resampling.BILINEAR))
    grain = rng.integers(-7, 8, size=(height, width), dtype=np.int16)
    pixels = np.asarray(image, dtype=np.int16) + (grain + shade.astype(np.int16))[:, :, None]
    out = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    buffer = io.BytesIO()
    out.save(buffer, format="JPEG", quality=config.jpeg_quality, subsampling=2)  # 2 = 4:2:0
    return buffer.getvalue()
