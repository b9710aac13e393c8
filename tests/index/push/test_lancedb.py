"""LanceDB: whether a table is there is what the database lists, not what an error's words say."""

from __future__ import annotations

import shutil

import pytest

from tests.index.push.conftest import write_synthetic_index
from vlfit.index.push.base import TargetError
from vlfit.index.push.job import push_index
from vlfit.index.push.pushed import PushedIndex
from vlfit.index.store import EmbeddingIndex


def test_a_table_that_cannot_be_opened_is_not_taken_for_no_table(tmp_path) -> None:
    """A table whose versions are gone: LanceDB lists it and cannot open it ("... was not found"). A push would have
    made a new table over it, and a search said none was ever pushed."""
    write_synthetic_index(tmp_path / "index", 20)
    uri = f"lancedb:{tmp_path / 'lance'}#items"
    push_index(EmbeddingIndex(str(tmp_path / "index")), uri)
    shutil.rmtree(tmp_path / "lance" / "items.lance" / "_versions")
    for action in (lambda: push_index(EmbeddingIndex(str(tmp_path / "index")), uri), lambda: PushedIndex(uri)):
        with pytest.raises(TargetError) as refused:
            action()
        assert str(refused.value).startswith(f"{uri}: reading the collection failed: ")
    assert (tmp_path / "lance" / "items.lance" / "data").is_dir()  # left as it was found
