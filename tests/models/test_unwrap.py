"""Tests for vlfit.models.unwrap: the model a training wrapper holds, looked up once per wrapper."""

from __future__ import annotations

import gc
import weakref

from accelerate.utils import extract_model_from_parallel
from torch import nn

from vlfit.models import unwrap
from vlfit.models.unwrap import held_model


def test_the_model_a_wrapper_holds_is_found_once_per_wrapper_and_kept_no_longer(monkeypatch) -> None:
    calls = []

    def counted(model: nn.Module) -> nn.Module:
        calls.append(model)
        return extract_model_from_parallel(model)

    monkeypatch.setattr(unwrap, "extract_model_from_parallel", counted)
    inner = nn.Linear(2, 2)
    wrapper = nn.DataParallel(inner)  # with no GPU it only holds the model
    assert held_model(wrapper) is inner and held_model(wrapper) is inner
    assert calls == [wrapper]
    assert held_model(inner) is inner and held_model(inner) is inner and len(calls) == 2
    other = nn.DataParallel(nn.Linear(2, 2))
    assert held_model(other) is other.module  # another wrapper is asked anew
    gone = weakref.ref(inner)
    calls.clear()
    del wrapper, inner
    gc.collect()
    assert gone() is None  # remembering what a wrapper holds keeps neither alive
