"""Deterministic synthetic caption matching data shaped like the New Yorker Caption Contest ``matching`` config.

Columns: ``image``, ``image_description``, ``caption_choices`` (5), ``label`` ("A".."E") and ``instance_id``.

Each image holds one or two groups of coloured shapes in distinct regions, and its caption describes them
compositionally ("two red circles on the left and one blue square at the top."). The four distractors are hard
negatives that differ from the true scene in one or two attributes, so no single attribute decides the answer.

Images are built to look like real photos *to a JPEG decoder*: textured everywhere (smooth multi-scale noise,
grain, strokes), quality-90 JPEG with 4:2:0 chroma subsampling and a long side of several hundred pixels, so
decode cost in benchmarks is representative.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from PIL import Image, ImageDraw

try:
    import datasets
except ImportError:  # make_record needs only numpy and Pillow (vlfit bench on a machine without datasets)
    datasets = None  # type: ignore[assignment]

SPLITS: tuple[str, ...] = ("train", "validation", "test")
LETTERS = "ABCDE"
NUM_CHOICES = 5

KINDS: tuple[str, ...] = ("circle", "square", "triangle", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
# Well-separated saturated hues; backgrounds stay desaturated so these stand out after downscaling.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 30, 35),
    "green": (35, 165, 60),
    "blue": (35, 75, 215),
    "yellow": (240, 210, 30),
    "purple": (140, 45, 175),
    "orange": (245, 125, 20),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
REGIONS: tuple[str, ...] = ("left", "top", "center", "bottom", "right")
REGION_PHRASES = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "center": "in the center",
}
# The image is partitioned into a center box and four trapezoids cut by the diagonals (normalised x, y).
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

FEATURES = datasets and datasets.Features(  # None without the datasets package
    {
        "image": datasets.Image(),
        "image_description": datasets.Value("string"),
        "caption_choices": datasets.List(datasets.Value("string")),
        "label": datasets.Value("string"),
        "instance_id": datasets.Value("string"),
    }
)


@dataclass
class SyntheticConfig:
    """Settings of a synthetic dataset; every record depends only on ``seed`` and its index.

    Args:
        num_samples: Total number of rows over all splits (at least 3).
        validation_fraction: Share of rows in the validation split, in [0, 1).
        test_fraction: Share of rows in the test split, in [0, 1); the two fractions sum to less than 1.
        seed: Non-negative base seed.
        min_long_side: Smallest long side of an image in pixels (at least 32).
        max_long_side: Largest long side of an image in pixels.
        jpeg_quality: JPEG quality, 1..100.
    """

    num_samples: int = 3000
    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    seed: int = 0
    min_long_side: int = 600
    max_long_side: int = 1400
    jpeg_quality: int = 90

    def __post_init__(self) -> None:
        if self.num_samples < 3:
            raise ValueError(f"--num_samples must be at least 3 (one row per split), got {self.num_samples}")
        for name in ("validation_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"--{name} must be in [0, 1), got {value}")
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise ValueError(
                "--validation_fraction + --test_fraction must be below 1 to leave training rows, got "
                f"{self.validation_fraction} + {self.test_fraction}"
            )
        if self.seed < 0:
            raise ValueError(f"--seed must be non-negative, got {self.seed}")
        if self.min_long_side < 32:
            raise ValueError(f"--min_long_side must be at least 32 pixels, got {self.min_long_side}")
        if self.min_long_side > self.max_long_side:
            raise ValueError(
                f"--min_long_side ({self.min_long_side}) must not exceed --max_long_side ({self.max_long_side})"
            )
        if not 1 <= self.jpeg_quality <= 100:
            raise ValueError(f"--jpeg_quality must be in 1..100, got {self.jpeg_quality}")
        split_sizes(self)  # fails early when the fractions leave a split without rows


class Group(NamedTuple):
    """One group of identical objects: ``count`` shapes of one kind and colour inside one region."""

    kind: str
    colour: str
    count: int
    region: str


Scene = tuple[Group, ...]


def split_sizes(config: SyntheticConfig) -> dict[str, int]:
    """Return the number of rows per split; a split with a positive fraction gets at least one row.

    Raises:
        ValueError: when no training rows would be left.
    """
    n = config.num_samples
    sizes = {
        "validation": max(1, round(n * config.validation_fraction)) if config.validation_fraction > 0 else 0,
        "test": max(1, round(n * config.test_fraction)) if config.test_fraction > 0 else 0,
    }
    train = n - sizes["validation"] - sizes["test"]
    if train < 1:
        raise ValueError(
            f"--num_samples {n} is too small for --validation_fraction {config.validation_fraction} and "
            f"--test_fraction {config.test_fraction}: no training rows left"
        )
    return {"train": train, **sizes}


def caption(scene: Scene) -> str:
    """Return the templated caption of a scene.

    Args:
        scene: One or two groups in distinct regions.

    Returns:
        E.g. ``"two red circles on the left and one blue square at the top."``; groups are listed in ``REGIONS``
        order, so a scene has exactly one caption.
    """
    parts = []
    for group in sorted(scene, key=lambda g: REGIONS.index(g.region)):
        noun = group.kind if group.count == 1 else PLURALS[group.kind]
        parts.append(f"{COUNT_WORDS[group.count]} {group.colour} {noun} {REGION_PHRASES[group.region]}")
    return " and ".join(parts) + "."


def _sample_scene(rng: np.random.Generator) -> Scene:
    num_groups = 1 if rng.random() < 0.4 else 2
    regions = rng.choice(len(REGIONS), size=num_groups, replace=False)
    return tuple(
        Group(
            kind=KINDS[rng.integers(len(KINDS))],
            colour=COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))],
            count=int(rng.integers(1, 4)),
            region=REGIONS[r],
        )
        for r in regions
    )


def _edit(scene: Scene, rng: np.random.Generator) -> Scene:
    """Change one attribute (kind, colour, count or region) of one group; the result may equal the input."""
    groups = list(scene)
    i = int(rng.integers(len(groups)))
    attribute = ("kind", "colour", "count", "region")[rng.integers(4)]
    if attribute == "kind":
        groups[i] = groups[i]._replace(kind=KINDS[rng.integers(len(KINDS))])
    elif attribute == "colour":
        groups[i] = groups[i]._replace(colour=COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))])
    elif attribute == "count":
        groups[i] = groups[i]._replace(count=int(rng.integers(1, 4)))
    else:
        taken = {other.region for j, other in enumerate(groups) if j != i}
        free = [r for r in REGIONS if r not in taken]
        groups[i] = groups[i]._replace(region=free[rng.integers(len(free))])
    return tuple(groups)


def _distinguishable(scene: Scene) -> bool:
    """Two groups must differ in kind or colour, or the eye cannot tell where one group ends (same rule for all
    choices, so it gives no hint about the answer)."""
    return len(scene) == 1 or (scene[0].kind, scene[0].colour) != (scene[1].kind, scene[1].colour)


def _scene_and_choices(rng: np.random.Generator) -> tuple[Scene, list[str], int]:
    """Return the scene to draw, 5 distinct captions and the index of the scene's caption among them.

    All five are one-attribute edits of a hidden base scene, and the drawn one is picked at random among them: any
    two choices differ in one or two attributes, and the true caption is exchangeable with the distractors, so
    the text alone (e.g. "the choice most like the others") gives chance accuracy; the image must be looked at.
    """
    base = _sample_scene(rng)
    while not _distinguishable(base):
        base = _sample_scene(rng)
    scenes: list[Scene] = []
    texts = {caption(base)}
    while len(scenes) < NUM_CHOICES:  # terminates: every scene has at least 10 valid one-edit neighbours
        candidate = _edit(base, rng)
        text = caption(candidate)
        if text not in texts and _distinguishable(candidate):
            texts.add(text)
            scenes.append(candidate)
    answer = int(rng.integers(NUM_CHOICES))
    return scenes[answer], [caption(scene) for scene in scenes], answer


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


def _background(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    # Built at quarter resolution and upsampled once: the smooth part has no detail worth full-res noise.
    lw, lh = max(2, width // 4), max(2, height // 4)
    base = rng.uniform(80, 190) + rng.uniform(-14, 14, size=3)  # desaturated so objects keep their colour
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
    """Return (group, x, y, extent) for every object: fully inside its region and never overlapping another."""
    short = min(width, height)
    gap = 0.05 * short  # wide enough to count objects after downscaling to ~128 px
    placed: list[tuple[Group, float, float, float]] = []
    for group in scene:
        polygon = [(u * width, v * height) for u, v in _REGION_POLYGONS[group.region]]
        (u0, v0), (u1, v1) = _REGION_CORES[group.region]
        lo, hi = _SIZE_RANGE[group.count]
        extent = rng.uniform(lo, hi) * short
        core = (u0 * width, v0 * height, u1 * width, v1 * height)
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


def _render(scene: Scene, rng: np.random.Generator, config: SyntheticConfig) -> bytes:
    long_side = int(rng.integers(config.min_long_side, config.max_long_side + 1))
    short_side = max(1, round(long_side / rng.uniform(1.05, 1.4)))
    width, height = (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)
    image = _background(rng, width, height)
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


def make_record(index: int, config: SyntheticConfig) -> dict[str, Any]:
    """Build one row; it depends only on ``config.seed``, ``index`` and the image settings.

    Args:
        index: Row index over the whole dataset (train rows first, then validation, then test).
        config: Dataset settings.

    Returns:
        A dict with ``image`` (``{"bytes": jpeg, "path": None}``), ``image_description`` (the true caption),
        ``caption_choices`` (5 distinct captions), ``label`` (letter of the true one) and ``instance_id``.
    """
    rng = np.random.default_rng([config.seed, index])
    scene, choices, answer = _scene_and_choices(rng)
    jpeg = _render(scene, rng, config)
    return {
        "image": {"bytes": jpeg, "path": None},
        "image_description": caption(scene),
        "caption_choices": choices,
        "label": LETTERS[answer],
        "instance_id": f"synthetic-{config.seed}-{index:07d}",
    }


def _make_batch(batch: dict[str, list], config: SyntheticConfig) -> dict[str, list]:
    rows = [make_record(int(i), config) for i in batch["index"]]
    return {name: [row[name] for row in rows] for name in FEATURES}


def make_dataset(config: SyntheticConfig, num_proc: int = 1) -> datasets.DatasetDict:
    """Generate the train / validation / test splits in memory.

    Rows are contiguous index ranges (train first); each row is seeded from ``(seed, index)``, so the output is
    byte-identical for any ``num_proc``.

    Args:
        config: Dataset settings.
        num_proc: Worker processes used for generation.

    Returns:
        A ``DatasetDict`` with the splits in ``SPLITS``, features ``FEATURES``.
    """
    if num_proc < 1:
        raise ValueError(f"--num_proc must be at least 1, got {num_proc}")
    splits = {}
    start = 0
    for name, size in split_sizes(config).items():
        indices = datasets.Dataset.from_dict({"index": list(range(start, start + size))})
        start += size
        if size == 0:
            splits[name] = datasets.Dataset.from_dict({k: [] for k in FEATURES}, features=FEATURES)
            continue
        splits[name] = indices.map(
            _make_batch,
            batched=True,
            batch_size=16,
            fn_kwargs={"config": config},
            remove_columns=["index"],
            features=FEATURES,
            num_proc=min(num_proc, size),
            keep_in_memory=True,
            desc=f"Generating {name}",
        )
    return datasets.DatasetDict({name: splits[name] for name in SPLITS})


def save_dataset(dataset_dict: datasets.DatasetDict, output_dir: str, format: str = "arrow") -> list[str]:
    """Write a dataset to disk.

    Args:
        dataset_dict: The splits to write.
        output_dir: Target folder (created if missing).
        format: ``"arrow"`` for a ``save_to_disk`` folder (read back with ``datasets.load_from_disk``), or
            ``"parquet"`` for one ``{split}.parquet`` file per split.

    Returns:
        The written paths: the folder for ``"arrow"``, one file per split for ``"parquet"``.

    Raises:
        ValueError: for an unknown format.
    """
    if format not in ("arrow", "parquet"):
        raise ValueError(f"unknown format {format!r}; choose one of 'arrow', 'parquet'")
    os.makedirs(output_dir, exist_ok=True)
    if format == "arrow":
        dataset_dict.save_to_disk(output_dir)
        return [output_dir]
    paths = []
    for name, split in dataset_dict.items():
        path = os.path.join(output_dir, f"{name}.parquet")
        split.to_parquet(path)
        paths.append(path)
    return paths
