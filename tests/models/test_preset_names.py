from vlfit.models.preset_names import PRESET_NAMES
from vlfit.models.registry import preset_names


def test_the_light_preset_list_is_the_families_own():
    assert list(PRESET_NAMES) == preset_names()
