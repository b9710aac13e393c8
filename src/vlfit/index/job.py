"""Indexing a collection, behind one door: ``vlfit retrieve index`` and ``vlfit.Index.build`` both describe what
they want as an ``IndexJob`` and hand it to ``index_collection``, so the rules of a build hold on both paths:

- every value is checked when the job is made, before anything is opened, loaded, embedded or written;
- the collection is opened as ``vlfit.data.sources.open_collection`` opens it (tar shards at URLs with the job's
  retries, timeout, storage options and block size, their reader checked before the model loads);
- the model is a reference (``vlfit.models.reference``: a checkpoint, an export, a preset) opened on its backend,
  or an encoder already open;
- under torchrun the processes form a gloo group and each embeds its share of the shards (``vlfit.index.build``);
  with ``distributor="ray"`` this process is Ray's driver and Ray's actors embed them (``vlfit.index.distribute``);
- rank 0 brings the ANN structure up to date (``vlfit.index.ann_update``) and the report says what was done;
- the build's settings (``BUILD_SETTINGS``: the ANN type and its parameters, the shard size) are recorded with each
  build in the manifest's ``collections``, and a job that leaves one unset (None) replays the index's recorded one
  (``IndexJob.replayed``): an append builds as the index was built, from the CLI and ``vlfit.Index.append`` alike;
- tar shards that could not be fetched are listed as bad in the manifest, and the report's ``raise_for_failures``
  (``vlfit.index.report``) turns them into an error once it is shown (the next run tries them again): nothing is
  lost in silence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vlfit.data.sources.openers import open_collection
from vlfit.data.sources.tar import ShardCollection
from vlfit.data.stream.urls import parse_storage_options
from vlfit.errors import ConfigError
from vlfit.extras import require_extra
from vlfit.index.ann_choice import (
    DEFAULT_MAX_INDEX_MEMORY,
    DEFAULT_TARGET_RECALL,
    check_index_type,
    check_target_recall,
    check_vector_storage,
)
from vlfit.index.build import BuildRequest, build_index
from vlfit.index.distribute import check_distributor, open_distributor
from vlfit.index.integrity import check_verify_level
from vlfit.index.report import ANN_SUMMARY, IndexReport
from vlfit.index.store import EmbeddingIndex, check_storage
from vlfit.inference.backends import Encoder
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings

# The settings a build records (under "settings" of its manifest's collections entry) and an append replays, with
# what a new index gets when a job leaves one unset.
BUILD_SETTINGS: dict[str, Any] = {
    "index_type": "auto",
    "max_index_memory": DEFAULT_MAX_INDEX_MEMORY,
    "target_recall": DEFAULT_TARGET_RECALL,
    "shard_size": 4096,
    "vector_storage": "float32",
    "rescore": None,  # tuned to --target_recall (vlfit.index.ann_choice.rescore_factors)
}


@dataclass(frozen=True)
class IndexJob:
    """One run of indexing: the model, the collection, the index folder, and how each step is done.

    Attributes:
        model: A model reference (checkpoint or export folder, preset name) or an open ``Encoder``.
        output_dir: The index folder (created; an existing index is resumed and appended to).
        images: A folder of image files, or else ``dataset_name`` (a hub id, a folder, data files or tar shards,
            local or at URLs) with its ``split`` and columns; ``image_id_column`` names the image a row shows.
        runtime: How a model reference is run (``vlfit.load``'s, through one ``ModelRuntime``); its
            ``max_num_patches`` left None is the index's recorded one (``replayed``).
        batch_size, num_workers, shard_size, storage, progress, verify: The build's (``BuildRequest``).
        index_type, max_index_memory, target_recall: The ANN structure's (``vlfit.index.ann_update``).
        vector_storage, rescore: What queries scan: the ANN structure's float32 vectors, or ``int8`` or ``binary``
            codes of which the top ``rescore`` x k are re-scored with the shards' float32 vectors (a new index's
            ``rescore`` left None is tuned to ``target_recall``).
            These five and ``shard_size``, left None, are the index's recorded ones (``BUILD_SETTINGS``).
        shard_retries, shard_timeout, storage_options, shard_block_size: How tar shards at URLs are fetched.
        ddp_timeout: Under torchrun, seconds the processes wait for each other.
        distributor: Who writes the shards: ``torch`` (this process, or torchrun's) or ``ray`` (Ray's actors).
        ray_address: ``ray``: the cluster to join (None: ``RAY_ADDRESS`` when set, else a local cluster).

    Raises:
        ConfigError: naming the flag, for a value no build could use.
    """

    model: str | Encoder
    output_dir: str
    images: str | None = None
    dataset_name: str | None = None
    split: str = "test"
    image_column: str = "image"
    caption_column: str | None = "image_description"
    image_id_column: str | None = None
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    batch_size: int = 32
    num_workers: int = 0
    shard_size: int | None = None
    storage: str = "safetensors"
    progress: bool = True
    verify: str = "quick"
    index_type: str | None = None
    max_index_memory: int | None = None
    target_recall: float | None = None
    vector_storage: str | None = None
    rescore: int | None = None
    shard_retries: int = 3
    shard_timeout: float = 60.0
    storage_options: Mapping[str, Any] | str | None = field(default=None, repr=False)  # headers may hold secrets
    shard_block_size: int | None = None
    ddp_timeout: int = 1800
    distributor: str = "torch"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        check_distributor(self.distributor)
        if self.index_type is not None:
            check_index_type(self.index_type)
        if self.target_recall is not None:
            check_target_recall(self.target_recall)
        check_vector_storage(self.vector_storage or "float32", self.index_type or "auto")
        check_verify_level(self.verify)
        check_storage(self.storage)
        for flag, value, least in (
            ("batch_size", self.batch_size, 1),
            ("dataloader_num_workers", self.num_workers, 0),
            ("shard_size", self.shard_size, 1),
            ("max_index_memory", self.max_index_memory, 1),
            ("rescore", self.rescore, 1),
            ("ddp_timeout", self.ddp_timeout, 1),
        ):
            if value is not None and value < least:
                raise ConfigError(f"--{flag} must be at least {least}, got {value}")
        object.__setattr__(self, "storage_options", parse_storage_options(self.storage_options))

    def replayed(self, index: EmbeddingIndex | None) -> IndexJob:
        """This job with each ``BUILD_SETTINGS`` entry it leaves unset (None) as the index at ``output_dir`` last
        recorded it (the default for a new index, or one built before settings were recorded), and a NaFlex model's
        patch budget as its items were embedded at: another one asked for is refused here, before the model loads.
        ``index`` is the index at ``output_dir`` as the caller opened it (``EmbeddingIndex.existing``; None: there is
        none yet).
        """
        recorded: dict[str, Any] = {}
        runtime = self.runtime
        if index is not None:  # appended items are embedded at the index's patch budget and cut to its size
            manifest = index.manifest
            recorded = manifest.collections[-1].get("settings", {}) if manifest.collections else {}
            budget = manifest.model.get("max_num_patches")
            patches = budget if runtime.max_num_patches is None else runtime.max_num_patches
            manifest.check_appendable(patches, runtime.embedding_dim, index.path)
            runtime = dataclasses.replace(runtime, max_num_patches=patches,
                                          embedding_dim=manifest.model.get("embedding_dim"))  # fmt: skip
        unset = {name: recorded.get(name, default) for name, default in BUILD_SETTINGS.items()
                 if getattr(self, name) is None}  # fmt: skip
        return dataclasses.replace(self, **unset, runtime=runtime)

    def settings(self) -> dict[str, Any]:
        """The ``BUILD_SETTINGS`` of this job, as a build records them."""
        return {name: getattr(self, name) for name in BUILD_SETTINGS}

    def open_collection(self) -> tuple[Any, dict[str, Any]]:
        """The collection's source (tar shards at URLs fetched as the job says) and its manifest description."""
        source, collection = open_collection(
            images=self.images, dataset_name=self.dataset_name, split=self.split, image_column=self.image_column,
            caption_column=self.caption_column, image_id_column=self.image_id_column,
        )  # fmt: skip
        if isinstance(source, ShardCollection):
            source = dataclasses.replace(
                source,
                retries=self.shard_retries,
                timeout=self.shard_timeout,
                storage_options=self.storage_options,
                block_size=self.shard_block_size,
            )
            source.reader()  # bad --shard_retries, --shard_timeout, --shard_block_size: refused before the model loads
        return source, collection

    def encoder(self) -> Encoder:
        """The model, open on its backend."""
        if isinstance(self.model, Encoder):
            return self.model
        return ModelRuntime.open(self.model, self.runtime).encoder


def index_collection(job: IndexJob) -> IndexReport:
    """Embed what ``job``'s collection holds that its index does not yet, bring the ANN structure up to date, and
    report (see the module's docstring for the rules).

    Raises:
        vlfit.errors.MissingExtraError: without faiss (the ``serve`` extra), before anything is opened.
        vlfit.inference.identity.RefusedModelError: when the index was built with a model whose embeddings are not
            comparable.
    """
    require_extra("serve", "vlfit retrieve index", modules=("faiss",))
    index = EmbeddingIndex.existing(job.output_dir)  # read once: replayed, built on, its ANN brought up to date
    job = job.replayed(index)
    distributor = open_distributor(job.distributor, job.encoder, job.ray_address)  # ray refused here when missing
    source, collection = job.open_collection()
    encoder = job.encoder()
    from vlfit.launch import join_gloo_group

    # 0, 1 unless launched by torchrun; a cluster engine's driver is one process
    rank, world_size = join_gloo_group(job.ddp_timeout) if job.distributor == "torch" else (0, 1)
    request = BuildRequest(
        job.output_dir, {**collection, "settings": job.settings()}, batch_size=job.batch_size,
        num_workers=job.num_workers, shard_size=job.shard_size, storage=job.storage, progress=job.progress,
        rank=rank, world_size=world_size, verify=job.verify,
    )  # fmt: skip
    built = build_index(encoder, source, request, index=index, distributor=distributor)
    if not request.lead:
        return IndexReport(job.output_dir, encoder.description, lead=False)  # rank 0 lists, builds the ANN, reports
    from vlfit.index.ann_update import update_ann

    ann = update_ann(job.output_dir, built.manifest, index_type=job.index_type, max_index_memory=job.max_index_memory,
                     target_recall=job.target_recall, verify=job.verify, storage=job.vector_storage,
                     rescore=job.rescore)  # fmt: skip
    urls = set(source.urls) if isinstance(source, ShardCollection) else set()
    manifest = built.manifest
    return IndexReport(
        job.output_dir,
        encoder.description,
        items=manifest.count,
        added=built.added,
        bad_samples=built.bad_samples,
        removed=len(manifest.removed),
        ann={key: ann[key] for key in ANN_SUMMARY if key in ann},
        lost_shards=[bad for bad in built.bad_samples if bad["id"] in urls],
        shards=len(urls),
    )


__all__ = ["IndexJob", "index_collection"]
