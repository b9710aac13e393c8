"""MemorySource: records in a list behave as any stored source (indexing, select with repeats, captions)."""

from __future__ import annotations

import pytest

from vlfit.data.records import Record
from vlfit.data.sources.memory import MemorySource


def test_memory_source_selects_indexes_and_lists_captions() -> None:
    records = [Record(id=f"r{i}", image=bytes([i]), caption=f"c{i}", extra={"label": i}) for i in range(4)]
    source = MemorySource(records, name="four")
    assert len(source) == 4 and source[-1].id == "r3" and source.column_names[-1] == "label"
    picked = source.select([2, 0, 2])
    assert [r.id for r in picked] == ["r2", "r0", "r2"] and picked.captions() == ["c2", "c0", "c2"]
    assert picked.select([1])[0].id == "r0"  # a selection of a selection maps onto the original rows
    with pytest.raises(IndexError, match="four"):
        source[4]
