"""Deterministic synthetic caption matching data shaped like the New Yorker Caption Contest ``matching`` config.

Columns: ``image``, ``image_description``, ``caption_choices`` (5), ``label`` ("A".."E") and ``instance_id``; a
labelled set (``SyntheticConfig.labels``) draws one shape kind (or colour) per scene and adds it as a class column
named ``kind`` (or ``colour``).

Each image holds one or two groups of coloured shapes in distinct regions, and its caption describes them
compositionally ("two red circles on the left and one blue square at the top."). The four distractors are hard
negatives that differ from the true scene in one or two attributes, so no single attribute decides the answer.

Modules, in the order a record is made: ``scenes`` (settings, scene sampling, captions and choices), ``render``
(the scene drawn as a photo-like JPEG), ``dataset`` (rows, splits, writing to disk). Every record depends only on
the seed and its index.
"""

from __future__ import annotations

from vlfit.data.synthetic.dataset import (
    FEATURES,
    SETTINGS_FILE,
    claim_dataset_folder,
    features,
    make_dataset,
    make_record,
    save_dataset,
)
from vlfit.data.synthetic.render import render_scene
from vlfit.data.synthetic.scenes import (
    BACKGROUNDS,
    CAPTION_GRAMMARS,
    COLOUR_NAMES,
    COLOURS,
    COUNT_WORDS,
    KINDS,
    LABEL_CLASSES,
    LETTERS,
    NUM_CHOICES,
    PLURALS,
    REGION_PHRASES,
    REGIONS,
    SPLITS,
    Group,
    Scene,
    SyntheticConfig,
    caption,
    scene_and_choices,
    split_sizes,
)

__all__ = [
    "BACKGROUNDS",
    "CAPTION_GRAMMARS",
    "COLOURS",
    "COLOUR_NAMES",
    "COUNT_WORDS",
    "FEATURES",
    "KINDS",
    "LABEL_CLASSES",
    "LETTERS",
    "NUM_CHOICES",
    "PLURALS",
    "REGIONS",
    "REGION_PHRASES",
    "SETTINGS_FILE",
    "SPLITS",
    "Group",
    "Scene",
    "SyntheticConfig",
    "caption",
    "claim_dataset_folder",
    "features",
    "make_dataset",
    "make_record",
    "render_scene",
    "save_dataset",
    "scene_and_choices",
    "split_sizes",
]
