"""What a synthetic sample shows and says: settings, scene sampling, the caption and its hard-negative choices.

A scene is one or two groups of identical shapes, each group in its own region of the image. Its caption lists
the groups in ``REGIONS`` order ("two red circles on the left and one blue square at the top."); the four other
choices are one-attribute edits of the same hidden base scene (see ``scene_and_choices``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from vlfit.errors import DataError
from vlfit.output_folders import SYNTHETIC_SPLITS

SPLITS: tuple[str, ...] = SYNTHETIC_SPLITS
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
# What a labelled set (SyntheticConfig.labels) can be labelled by, each with its class names in label order; the
# class column has the attribute's name. A scene labelled by region has one group; the region's class name is its
# caption phrase ("on the left"), so zero-shot prompts can hold it as captions do.
LABEL_CLASSES: dict[str, tuple[str, ...]] = {
    "kind": KINDS,
    "colour": COLOUR_NAMES,
    "region": tuple(REGION_PHRASES[region] for region in REGIONS),
}
# A shifted distribution (``benchmarks/forgetting.py`` fine-tunes on one) draws scenes of the same kind on other
# backgrounds ("light" or "dark" textures) or tells them otherwise: captions that say where each group is
# ("regions": "two red circles on the left and one blue square at the top.") or not ("no_regions": "a picture of
# two red circles and one blue square.").
BACKGROUNDS: tuple[str, ...] = ("light", "dark")
# "long": the regions caption after a description every image shares (LONG_PREAMBLE: about 100 words, past the 77
# tokens of a CLIP text tower), so captions differ only past token 77: cut there, every caption is the same
# (vlfit.models.long_captions stretches a tower for them).
CAPTION_GRAMMARS: tuple[str, ...] = ("regions", "no_regions", "long")
LONG_PREAMBLE = (
    "This is a synthetic picture, made by a program for testing how well a model matches images with their "
    "descriptions. Its background is a soft textured surface with no text, no people, no animals and no photographs "
    "in it, and every shape on it is flat and drawn with one solid colour, without shading, shadows or outlines of "
    "another colour. The shapes never touch each other or the edges of the picture, their sizes differ only a "
    "little, and they are spread over the parts of the picture named below, which is where the picture differs "
    "from every other picture of this set. After all of this general description, what it shows is: "
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
        labels: ``kind``, ``colour`` or ``region``: every group of a scene (and of its caption choices) has the
            same value of it (a scene labelled by region has one group), and rows get it as a class column of that
            name (``LABEL_CLASSES``): a labelled image-classification set for ``vlfit fewshot``. ``None``: no
            class column.
        background: ``light`` (desaturated mid-grey to light textures) or ``dark`` (the same textures near black);
            the scenes, layouts and captions of a seed are the same for both.
        caption_grammar: ``regions`` (each group's count, colour, kind and where it is), ``no_regions``
            ("a picture of ...": count, colour and kind only; choices that differ only in a region are not drawn,
            so a seed's scenes differ from those of ``regions``) or ``long`` (``regions`` after ``LONG_PREAMBLE``,
            about 100 words every caption shares: the captions differ only past a CLIP tower's 77 tokens).
    """

    num_samples: int = 3000
    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    seed: int = 0
    min_long_side: int = 600
    max_long_side: int = 1400
    jpeg_quality: int = 90
    labels: str | None = None
    background: str = "light"
    caption_grammar: str = "regions"

    def __post_init__(self) -> None:
        if self.num_samples < 3:
            raise DataError(f"--num_samples must be at least 3 (one row per split), got {self.num_samples}")
        for name in ("validation_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise DataError(f"--{name} must be in [0, 1), got {value}")
        if self.validation_fraction + self.test_fraction >= 1.0:
            raise DataError(
                "--validation_fraction + --test_fraction must be below 1 to leave training rows, got "
                f"{self.validation_fraction} + {self.test_fraction}"
            )
        if self.seed < 0:
            raise DataError(f"--seed must be non-negative, got {self.seed}")
        if self.min_long_side < 32:
            raise DataError(f"--min_long_side must be at least 32 pixels, got {self.min_long_side}")
        if self.min_long_side > self.max_long_side:
            raise DataError(
                f"--min_long_side ({self.min_long_side}) must not exceed --max_long_side ({self.max_long_side})"
            )
        if self.labels is not None and self.labels not in LABEL_CLASSES:
            raise DataError(f"--labels must be one of {', '.join(LABEL_CLASSES)}, got {self.labels!r}")
        if self.background not in BACKGROUNDS:
            raise DataError(f"--background must be one of {', '.join(BACKGROUNDS)}, got {self.background!r}")
        if self.caption_grammar not in CAPTION_GRAMMARS:
            raise DataError(
                f"--caption_grammar must be one of {', '.join(CAPTION_GRAMMARS)}, got {self.caption_grammar!r}"
            )
        if self.labels == "region" and self.caption_grammar == "no_regions":
            raise DataError("--labels region needs captions that name the region: drop --caption_grammar no_regions")
        if not 1 <= self.jpeg_quality <= 100:
            raise DataError(f"--jpeg_quality must be in 1..100, got {self.jpeg_quality}")
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
        raise DataError(
            f"--num_samples {n} is too small for --validation_fraction {config.validation_fraction} and "
            f"--test_fraction {config.test_fraction}: no training rows left"
        )
    return {"train": train, **sizes}


def caption(scene: Scene, grammar: str = "regions") -> str:
    """Return the templated caption of a scene.

    Args:
        scene: One or two groups in distinct regions.
        grammar: One of ``CAPTION_GRAMMARS``.

    Returns:
        E.g. ``"two red circles on the left and one blue square at the top."`` (``regions``) or ``"a picture of
        two red circles and one blue square."`` (``no_regions``); groups are listed in ``REGIONS`` order, so a
        scene has exactly one caption.
    """
    parts = []
    for group in sorted(scene, key=lambda g: REGIONS.index(g.region)):
        noun = group.kind if group.count == 1 else PLURALS[group.kind]
        where = f" {REGION_PHRASES[group.region]}" if grammar != "no_regions" else ""
        parts.append(f"{COUNT_WORDS[group.count]} {group.colour} {noun}{where}")
    text = " and ".join(parts) + "."
    if grammar == "long":
        return LONG_PREAMBLE + text
    return text if grammar == "regions" else f"a picture of {text}"


def parse_caption(text: str) -> Scene:
    """The scene a caption of ``caption`` describes (its inverse).

    Raises:
        ValueError: ``text`` is not a caption this module writes.
    """
    nouns = {**{kind: kind for kind in KINDS}, **{plural: kind for kind, plural in PLURALS.items()}}
    counts = {word: count for count, word in COUNT_WORDS.items()}
    regions = {phrase: region for region, phrase in REGION_PHRASES.items()}
    groups = []
    for part in text.removeprefix(LONG_PREAMBLE).removesuffix(".").split(" and "):
        words = part.split(" ", 3)
        if len(words) != 4 or words[0] not in counts or words[1] not in COLOURS or words[2] not in nouns:
            raise DataError(f"not a synthetic caption: {text!r}")
        if words[3] not in regions:
            raise DataError(f"not a synthetic caption: {text!r}")
        groups.append(Group(kind=nouns[words[2]], colour=words[1], count=counts[words[0]], region=regions[words[3]]))
    return tuple(groups)


def differing_attributes(a: Scene, b: Scene) -> tuple[str, ...]:
    """The attributes (kind, colour, count, region) whose values over the groups differ between two scenes."""
    return tuple(
        name
        for name in ("kind", "colour", "count", "region")
        if sorted(getattr(g, name) for g in a) != sorted(getattr(g, name) for g in b)
    )


def _sample_scene(rng: np.random.Generator, shared: str | None = None) -> Scene:
    num_groups = 1 if shared == "region" or rng.random() < 0.4 else 2
    regions = rng.choice(len(REGIONS), size=num_groups, replace=False)
    scene = tuple(
        Group(
            kind=KINDS[rng.integers(len(KINDS))],
            colour=COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))],
            count=int(rng.integers(1, 4)),
            region=REGIONS[r],
        )
        for r in regions
    )
    return _share(scene, shared) if shared in ("kind", "colour") else scene


def _share(scene: Scene, attribute: str) -> Scene:
    """The scene with every group's ``attribute`` (kind or colour) that of its first group."""
    value = getattr(scene[0], attribute)
    return tuple(group._replace(**{attribute: value}) for group in scene)


def _edit(scene: Scene, rng: np.random.Generator, shared: str | None = None) -> Scene:
    """Change one attribute (kind, colour, count or region) of one group; the result may equal the input.

    An edit of the ``shared`` attribute changes every group's, so the scene keeps one value of it.
    """
    groups = list(scene)
    i = int(rng.integers(len(groups)))
    attribute = ("kind", "colour", "count", "region")[rng.integers(4)]
    if attribute in ("kind", "colour"):
        values = KINDS if attribute == "kind" else COLOUR_NAMES
        value = values[rng.integers(len(values))]
        every = attribute == shared
        groups = [g._replace(**{attribute: value}) if every or j == i else g for j, g in enumerate(groups)]
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


def scene_and_choices(
    rng: np.random.Generator, shared: str | None = None, grammar: str = "regions"
) -> tuple[Scene, list[str], int]:
    """Return the scene to draw, 5 distinct captions and the index of the scene's caption among them.

    All five are one-attribute edits of a hidden base scene, and the drawn one is picked at random among them: any
    two choices differ in one or two attributes, and the true caption is exchangeable with the distractors, so
    the text alone (e.g. "the choice most like the others") gives chance accuracy; the image must be looked at.

    Args:
        rng: The record's generator; this advances it.
        shared: ``kind`` or ``colour``: every group of the scene and of every choice has the same value of it;
            ``region``: scenes of one group (``SyntheticConfig.labels``).
        grammar: The captions' grammar (``CAPTION_GRAMMARS``); choices are distinct as captions of it.

    Returns:
        ``(scene, choices, answer)``: the scene to draw, ``NUM_CHOICES`` distinct captions and the index of the
        scene's own caption among them.
    """
    base = _sample_scene(rng, shared)
    while not _distinguishable(base):
        base = _sample_scene(rng, shared)
    scenes: list[Scene] = []
    texts = {caption(base, grammar)}
    # Terminates: every scene has at least 10 valid one-edit neighbours in kind, colour and count alone.
    while len(scenes) < NUM_CHOICES:
        candidate = _edit(base, rng, shared)
        text = caption(candidate, grammar)
        if text not in texts and _distinguishable(candidate):
            texts.add(text)
            scenes.append(candidate)
    answer = int(rng.integers(NUM_CHOICES))
    return scenes[answer], [caption(scene, grammar) for scene in scenes], answer
