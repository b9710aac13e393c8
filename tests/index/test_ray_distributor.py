"""vlfit retrieve index --distributor ray on a real Ray cluster of two nodes (two raylets on this machine, one CPU
slot each): the index its actors write equals the one a single process builds, an actor whose process dies midway is
started again and its shard written again with nothing lost or listed twice, and a stopped build resumes."""

import os
import sys

import pytest
import torch

from vlfit.cli import main
from vlfit.data.sources.images import ImageFolderSource
from vlfit.errors import MissingExtraError
from vlfit.index.build import BuildRequest, build_index
from vlfit.index.distribute import open_distributor
from vlfit.index.job import IndexJob
from vlfit.index.store import EmbeddingIndex
from vlfit.inference.runtime import ModelRuntime

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

SETTINGS = {"batch_size": 2, "shard_size": 2, "progress": False}  # 9 shards of the folder's 17 files


class DyingSource(ImageFolderSource):
    """The image folder, whose reader's process exits the first time it reads ``victim`` (then leaves ``marker``)."""

    def __init__(self, root: str, victim: str, marker: str) -> None:
        super().__init__(root)
        self.victim, self.marker = victim, marker

    def _read(self, row: int):
        record = super()._read(row)
        if record.id == self.victim and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)  # the actor's process dies mid-shard, as with its node
        return record


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes on this machine (a head and a second raylet), advertised on 127.0.0.1; stopped at the end."""
    from ray.cluster_utils import Cluster

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # DyingSource travels to the actors
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's node address: 127.0.0.1, not the machine's
    patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.head_node, cluster.add_node(num_cpus=1)]
    try:
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
        patch.undo()
        assert not [node for node in nodes if node.any_processes_alive()]


def _build(encoder, source, out, **kwargs):
    request = BuildRequest(str(out), {"images": source.root}, **SETTINGS)
    return build_index(encoder, source, request, index=EmbeddingIndex.existing(str(out)), **kwargs)


@pytest.fixture(scope="module")
def one_process(tiny_checkpoint, image_folder, tmp_path_factory):
    """The index one process builds, and the model open."""
    encoder = ModelRuntime.open(str(tiny_checkpoint)).encoder
    out = tmp_path_factory.mktemp("ray") / "once"
    _build(encoder, ImageFolderSource(str(image_folder)), out)
    return EmbeddingIndex(str(out)), encoder


def test_a_stopped_ray_build_with_a_dead_worker_resumes_to_the_one_process_index(
    cluster, one_process, tiny_checkpoint, image_folder, tmp_path
):
    """One build through the API, in which the actor that reads an item of the 3rd shard dies there once (it is
    started again and the shard handed to it again), stopped once 4 shards are listed; then the same build, resumed
    through the CLI, joining the cluster by its address: the index one process builds."""
    once, encoder = one_process
    job = IndexJob(str(tiny_checkpoint), str(tmp_path / "unused"))
    distributor = open_distributor("ray", job.encoder, cluster)
    marker = tmp_path / "died"
    source = DyingSource(str(image_folder), ImageFolderSource(str(image_folder)).paths[5], str(marker))

    def stop(manifest):
        if len(manifest.shards) == 4:
            raise KeyboardInterrupt

    out = tmp_path / "ray"
    with pytest.raises(KeyboardInterrupt):
        _build(encoder, source, out, on_shard=stop, distributor=distributor)
    assert marker.exists()  # a worker did die
    stopped = EmbeddingIndex(str(out))
    assert stopped.ids() == once.ids()[: len(stopped)] and len(stopped.manifest.shards) == 4  # none lost or twice
    assert not ray.is_initialized()  # the build left the cluster it joined

    assert main(["retrieve", "index", "--model", str(tiny_checkpoint), "--images", str(image_folder),
                 "--output_dir", str(out), "--batch_size", "2", "--shard_size", "2", "--dataloader_num_workers",
                 "0", "--disable_tqdm", "true", "--distributor", "ray", "--ray_address", cluster]) == 0  # fmt: skip
    built = EmbeddingIndex(str(out))
    assert len(built.manifest.shards) == len(once.manifest.shards) == 9
    assert built.ids() == once.ids() and len(set(built.ids())) == len(built)  # every item once, in order
    torch.testing.assert_close(built.embeddings(), once.embeddings(), atol=1e-5, rtol=0)
    assert built.manifest.bad_samples == once.manifest.bad_samples  # the broken file listed once
    assert [s["count"] for s in built.manifest.shards] == [s["count"] for s in once.manifest.shards]
    assert built.manifest.ann is not None and built.manifest.ann["count"] == once.manifest.count  # the driver's
    assert not ray.is_initialized()


def test_ray_missing_is_one_line_naming_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtraError, match=r"^--distributor ray needs the ray extra .*pip install 'vlfit\[ray\]'"):
        open_distributor("ray", lambda: None)
