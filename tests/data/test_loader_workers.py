"""Stopping the loader workers of a loop an error ended (``vlfit.data.loader_workers``)."""

from __future__ import annotations

import gc
import sys

import pytest
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from vlfit.data.loader_workers import stop_loader_workers


class Stopped(Exception):
    """What a stop signal's handler raises."""


def test_an_iterator_a_stop_interrupts_while_it_is_made_leaves_no_traceback(monkeypatch):
    # A SIGTERM landing early in _MultiProcessingDataLoaderIter.__init__ (before torch sets _shutdown): its __del__
    # failed with an AttributeError that Python printed as "Exception ignored ..." after the run's one line.
    made = _BaseDataLoaderIter.__init__

    def interrupted(self, loader):
        made(self, loader)
        raise Stopped

    monkeypatch.setattr(_BaseDataLoaderIter, "__init__", interrupted)
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(Stopped) as caught:
        iter(DataLoader(list(range(8)), num_workers=1))
    stop_loader_workers(caught.value.__traceback__)
    del caught
    gc.collect()
    assert unraisable == []
