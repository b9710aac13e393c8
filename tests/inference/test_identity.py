"""Which embeddings are comparable (``vlfit.inference.identity``), and how a refusal names the two sources."""

from __future__ import annotations

import pytest

from vlfit.inference.identity import ModelIdentity, RefusedModelError


def test_a_refusal_names_a_preset_whole_and_a_checkpoint_by_its_digest() -> None:
    index = ModelIdentity("clip", 32, "preset:clip-tiny")
    model = ModelIdentity("clip", 32, "ab" * 32)
    with pytest.raises(RefusedModelError, match=r"with the preset:clip-tiny but .* from checkpoint abababababab:"):
        index.check_compatible(model, what="the index x", other_what="the model y")
