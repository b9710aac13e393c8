"""The preset names, without importing the families (flag help and ``--model_preset`` checks stay light).

Each family module defines its presets; ``tests/models/test_registry.py`` checks this list is theirs, in order.
"""

PRESET_NAMES = (
    "tiny", "small", "small-p8", "base", "large",
    "clip-tiny", "clip-small", "clip-base",
    "siglip-tiny", "siglip-small", "siglip-base",
)  # fmt: skip
