"""The preset names, read from the preset files (``vlfit.models.presets.list_presets``; kept for old imports)."""

from vlfit.models.presets import list_presets

PRESET_NAMES = tuple(list_presets())
