"""A split of 8 images with 3 captions each, as a CSV of rows (one caption each, an ``image_id`` column) and as a
``save_to_disk`` folder with a list caption column (one row per image)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import datasets
from PIL import Image

IMAGES, CAPTIONS_PER_IMAGE = 8, 3
COLOURS = [(220, 30, 30), (30, 200, 40), (40, 50, 230), (240, 220, 20), (20, 210, 220), (200, 40, 210),
           (120, 120, 120), (250, 140, 30)]  # fmt: skip


def jpeg(number: int) -> bytes:
    """A distinct 48x40 JPEG for each number."""
    colour = COLOURS[number % len(COLOURS)]
    image = Image.new("RGB", (48, 40), colour)
    image.paste((colour[2], colour[0], colour[1]), (4 + 3 * number, 4, 20 + 3 * number, 18))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def captions_of(number: int) -> list[str]:
    return [f"picture {number} caption {k}" for k in range(CAPTIONS_PER_IMAGE)]


def write_csv(folder: Path) -> Path:
    """``folder/val.csv`` (``file_name``, ``caption``, ``image_id``: 24 rows, 3 per image file) and the images."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "val.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["file_name", "caption", "image_id"])
        for number in range(IMAGES):
            (folder / f"im{number}.jpg").write_bytes(jpeg(number))
            for caption in captions_of(number):
                writer.writerow([f"im{number}.jpg", caption, f"img-{number}"])
    return folder / "val.csv"


def write_caption_lists(folder: Path) -> Path:
    """A ``save_to_disk`` folder whose split ``test`` has one row per image and a ``captions`` list column."""
    features = datasets.Features({"image": datasets.Image(), "id": datasets.Value("string"),
                                  "captions": datasets.List(datasets.Value("string"))})  # fmt: skip
    rows = {"image": [{"bytes": jpeg(n), "path": None} for n in range(IMAGES)],
            "id": [f"im{n}" for n in range(IMAGES)], "captions": [captions_of(n) for n in range(IMAGES)]}  # fmt: skip
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(str(folder))
    return folder
