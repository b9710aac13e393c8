"""An index build is one transaction: a job reads the index's manifest once (its settings replayed, its shards built
on, its ANN structure brought up to date from it) and writes it where what it lists is on disk: the shards a round
added, then the ANN structure."""

from __future__ import annotations

import shutil

from vlfit.index import manifest
from vlfit.index.job import IndexJob, index_collection
from vlfit.index.manifest import IndexManifest
from vlfit.index.store import EmbeddingIndex


def test_an_append_reads_the_manifest_once_and_writes_it_for_its_shards_then_its_ann(
    tiny_checkpoint, image_folder, tmp_path, monkeypatch
) -> None:
    folder, out = tmp_path / "photos", str(tmp_path / "index")
    shutil.copytree(image_folder / "validation", folder)
    job = IndexJob(str(tiny_checkpoint), out, images=str(folder), progress=False, index_type="flat")
    index_collection(job)
    first = EmbeddingIndex(out).ids()
    shutil.copytree(image_folder / "test", folder / "more")

    reads, writes = [], []
    parse, write = IndexManifest.from_dict.__func__, manifest.write_text_atomically
    monkeypatch.setattr(IndexManifest, "from_dict", classmethod(lambda cls, data: reads.append(1) or parse(cls, data)))
    monkeypatch.setattr(
        manifest, "write_text_atomically", lambda path, *args, **kw: writes.append(path) or write(path, *args, **kw)
    )
    report = index_collection(job)

    assert len(reads) == 1
    assert len(writes) == 2  # the round of new shards, then the ANN structure over them
    appended = EmbeddingIndex(out)
    assert report.added > 0 and appended.ids()[: len(first)] == first and len(appended) == len(first) + report.added
    assert appended.manifest.ann is not None and appended.manifest.ann["count"] == len(appended)
