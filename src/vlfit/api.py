"""vlfit from Python: load a model and embed, train, evaluate, and build or query an index.

    import vlfit

    model = vlfit.load("runs/demo/model")
    images = model.encode_images(["cat.jpg", pil_image, jpeg_bytes, uint8_array])   # [4, D] float32, L2-normalized
    texts = model.encode_texts(["a cat", "a dog"])                                   # [2, D]
    scores = model.similarity(["cat.jpg"], ["a cat", "a dog"])                       # [1, 2] cosines

    result = vlfit.train(model_preset="clip-tiny", dataset_name="data/", output_dir="runs/x", max_steps=10)
    result.metrics["train_loss"], result.output_dir

Every function takes the flags of the matching CLI command as keyword arguments (``vlfit.train(learning_rate=1e-4)``
is ``vlfit train --learning_rate 1e-4``), converted and checked as the command line's are (``max_steps="10"`` is
10, ``max_steps="ten"`` is refused), before anything is loaded or written. A mistake raises a ``vlfit.UserError``
naming the keyword argument (``learning_rate=``): an unknown keyword or a value of the wrong type is an
``ArgumentError`` (also a ``TypeError``), with the closest keywords (``did you mean `precision=`?``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlfit.data.image_inputs import ImageInput
from vlfit.errors import ConfigError, DataError, python_api, unknown_keywords
from vlfit.index.search import Hit
from vlfit.inference.backends import Encoder
from vlfit.inference.runtime import ModelRuntime
from vlfit.inference.runtime_settings import RuntimeSettings


class Model:
    """A model ready to embed: a checkpoint (PyTorch) or a folder ``vlfit export`` wrote (ONNX Runtime, OpenVINO);
    or, for a folder ``vlfit train --task vqa`` wrote, ready to answer questions (``answer``), with nothing to embed
    with. Every call runs through one ``vlfit.inference.runtime.ModelRuntime``: the caption length and image
    settings the run was trained with, one thread setting.

    Args:
        runtime: The model's runtime (``load`` opens it).
    """

    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime

    @property
    def encoder(self) -> Encoder:
        """The backend's encoder.

        Raises:
            RefusedModelError: for a question-answering model, which has no contrastive heads to embed with.
        """
        return self.runtime.encoder

    @property
    def backend(self) -> str:
        """``torch``, ``onnxruntime`` or ``openvino``."""
        return "torch" if self.runtime.answers_questions else self.encoder.backend

    @property
    def image_size(self) -> int:
        """The side of the square images the model takes."""
        return self.runtime.image_size

    @property
    def max_seq_length(self) -> int:
        """Captions (questions) are cut at this many tokens: the run's, unless ``load`` was given another."""
        return self.runtime.inputs.max_seq_length

    @property
    def rerank_weight(self) -> float | None:
        """The cosine's weight beside the matching log-odds that re-ranking uses by default (``--rerank_score
        itm+itc``), as the run saved it (``rerank.json``); None without one (re-ranking by ITM alone)."""
        return self.runtime.saved_rerank_weight

    @property
    def embedding_dim(self) -> int:
        """Length of an embedding."""
        return self.encoder.identity.embedding_size

    def __repr__(self) -> str:
        return f"vlfit.{self.runtime!r}".replace("ModelRuntime(", "Model(", 1)

    @python_api
    def encode_images(self, images: ImageInput | Iterable[ImageInput], batch_size: int = 32) -> np.ndarray:
        """L2-normalized float32 embeddings ``[N, D]`` of images: paths, encoded bytes, PIL images or uint8 arrays
        (``[H, W(, C)]``, or one ``[N, H, W, C]`` batch).

        Images go through the fast CPU pipeline (DCT-scaled decode, center crop, bicubic resize on uint8), as in
        training and evaluation. A single image (not in a list) gives ``[1, D]``.

        Raises:
            MissingFileError: for a path that does not exist.
            DataError: for an image that cannot be decoded or an input of another kind (naming its position).
            ArgumentError: for ``images`` that is neither an image nor an iterable of them, a bad ``batch_size``.
        """
        _check_at_least("batch_size", batch_size, 1)
        return _as_numpy(self.runtime.embed_images(images, batch_size))

    @python_api
    def encode_texts(self, texts: str | Sequence[str], batch_size: int = 256) -> np.ndarray:
        """L2-normalized float32 embeddings ``[N, D]`` of captions, tokenized as training tokenized them."""
        _check_at_least("batch_size", batch_size, 1)
        return _as_numpy(self.runtime.embed_texts(_strings("texts", texts), batch_size))

    @python_api
    def similarity(self, images: ImageInput | Iterable[ImageInput], texts: str | Sequence[str]) -> np.ndarray:
        """Cosine similarities ``[num_images, num_texts]`` (the model's temperature is not applied)."""
        return self.encode_images(images) @ self.encode_texts(texts).T

    @python_api
    def answer(
        self,
        images: ImageInput | Iterable[ImageInput],
        questions: str | Sequence[str],
        top_k: int = 3,
        batch_size: int = 32,
    ) -> list[list[tuple[str, float]]]:
        """The ``top_k`` best answers to each question, best first, as ``(answer, score)`` pairs (score: the
        sigmoid of the answer's logit), from a model ``vlfit train --task vqa`` saved (PyTorch backend),
        ``batch_size`` questions to a forward.

        One image per question, or one image for every question (images as ``encode_images`` takes them).

        Raises:
            ConfigError: for a model without a VQA head.
            DataError: for as many images as questions but not one image per question, or a bad image.
        """
        _check_at_least("top_k", top_k, 1)
        _check_at_least("batch_size", batch_size, 1)
        answers = self.runtime.answer(images, _strings("questions", questions), top_k, batch_size)
        return [[(a.answer, a.score) for a in row] for row in answers]


def _check_at_least(keyword: str, value: int | float, least: int | float) -> None:
    if value < least:
        raise ConfigError(f"--{keyword} must be at least {least}, got {value}")


def _strings(keyword: str, texts: str | Sequence[str]) -> list[str]:
    """``texts`` as a list of strings (a string alone: a list of one)."""
    items = [texts] if isinstance(texts, str) else list(texts)
    for position, text in enumerate(items):
        if not isinstance(text, str):
            raise DataError(f"{keyword}[{position}]: expected a string, got {type(text).__name__}")
    return items


def _as_numpy(embeddings: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(embeddings.numpy(), dtype=np.float32)


@python_api(renames={"model": "path_or_preset", "model_name_or_path": "path_or_preset"})
def load(
    path_or_preset: str | os.PathLike,
    backend: str = "auto",
    *,
    precision: str = "auto",
    num_threads: int | None = None,
    max_seq_length: int | None = None,
    allow_spinning: bool = True,
    max_num_patches: int | None = None,
) -> Model:
    """Load a model to embed with (or, for a VQA run, to answer questions with).

    Args:
        path_or_preset: A checkpoint folder (``vlfit train``'s output, LoRA adapters included), a folder
            ``vlfit export`` wrote, or a preset name (random weights, with a byte-level tokenizer trained on
            ``vlfit make-data``'s caption grammar: for trying the API, not for results).
        backend: ``auto`` (the folder's own runtime: PyTorch for a checkpoint, the exported format's runtime),
            ``torch``, ``onnxruntime`` or ``openvino``.
        precision: Exported graphs: ``auto`` (INT8 when exported), ``fp32`` or ``int8``.
        num_threads: Threads of the runtime (``None``: its default).
        max_seq_length: Cut captions at this many tokens (``None``: the length the run was trained with, from
            its ``input_spec.json``; another is logged).
        allow_spinning: ONNX Runtime's idle threads spin-wait for the next call (its default; a server that shares
            its cores with an event loop turns it off).
        max_num_patches: A NaFlex model's (SigLIP 2) token budget per image (``None``: the budget the run was
            trained with, from its ``input_spec.json``; another is logged; an export takes at most its own).
    """
    settings = RuntimeSettings(backend=backend, precision=precision, num_threads=num_threads,
                               max_seq_length=max_seq_length, allow_spinning=allow_spinning,
                               max_num_patches=max_num_patches)  # fmt: skip
    runtime = ModelRuntime.open(path_or_preset, settings)
    runtime.answerer if runtime.answers_questions else runtime.encoder  # noqa: B018  (a bad folder fails here)
    return Model(runtime)


# ---------------------------------------------------------------------------------------------- train and evaluate


@dataclass
class RunResult:
    """What ``train``, ``evaluate`` and ``merge`` return.

    Attributes:
        metrics: The final metrics (``train_*`` and ``eval_*``), as the run's ``*_results.json`` hold them.
        output_dir: Where the model (``train``, ``merge``) or the metrics (``evaluate``) were saved.
    """

    metrics: dict[str, Any]
    output_dir: str


def _parse(prog: str, function: str, values: dict[str, Any]) -> Any:
    """The parsed flags of ``values``, converted and checked as the command line's (unknown keywords first)."""
    from vlfit.commands import evaluate, train
    from vlfit.commands.parsing import ParsedArguments

    parser = evaluate.parser() if prog == "vlfit eval" else train.parser_for(prog)
    known = parser.keyword_names()
    if set(values) - known:
        raise unknown_keywords(function, set(values) - known, known)
    if prog == "vlfit eval":
        return evaluate.parse_values(values)
    parsed, given = parser.parse_values(values)
    return ParsedArguments(*parsed, given=given)


@python_api(flags=True)
def train(**flags: Any) -> RunResult:
    """Fine-tune as ``vlfit train`` does, with its flags as keyword arguments; returns the metrics and the folder.

    Example: ``vlfit.train(model_preset="clip-tiny", dataset_name="data/", output_dir="runs/x", max_steps=10)``.
    """
    from vlfit.commands.train import train_parsed

    args = _parse("vlfit train", "train", flags)
    call = ", ".join(f"{name}={value!r}" for name, value in flags.items())
    metrics = train_parsed(args, command_line=f"vlfit.train({call})")
    return RunResult(metrics, args.training.output_dir)


@python_api(flags=True)
def evaluate(**flags: Any) -> RunResult:
    """Evaluate as ``vlfit eval`` does (recall@1/5/10 both ways, matching accuracy) with its flags as keyword
    arguments; the metrics are also written to ``output_dir`` (default: the model folder) as ``eval_results.json``."""
    from vlfit.commands.evaluate import evaluate_parsed

    args = _parse("vlfit eval", "evaluate", flags)
    metrics = evaluate_parsed(args)
    return RunResult(metrics, args.training.output_dir)


@python_api(flags=True)
def merge(**flags: Any) -> RunResult:
    """Merge fine-tuned runs of one base as ``vlfit merge`` does, with its flags as keyword arguments: ``method=``
    ``wise``, ``uniform``, ``greedy`` or ``stock``; returns the merged model's held-out metrics (empty without data)
    and its folder, a run every door loads.

    Example: ``vlfit.merge(method="greedy", runs=["runs/a", "runs/b"], dataset_name="data/", output_dir="runs/soup")``.
    """
    from vlfit.commands import merge as merge_command

    known = merge_command.parser().keyword_names()
    if set(flags) - known:
        raise unknown_keywords("merge", set(flags) - known, known)
    parsed = merge_command.parse_values(flags)
    call = ", ".join(f"{name}={value!r}" for name, value in flags.items())
    result = merge_command.merge_parsed(parsed, command_line=f"vlfit.merge({call})")
    return RunResult(result.metrics, result.output_dir)


# ----------------------------------------------------------------------------------------------------- the index


SearchHit = Hit  # one result of ``Index.search``: the one hit type of every search (``vlfit.index.search.Hit``)


class Index:
    """An embedding index on disk (what ``vlfit retrieve index`` builds): build, open, append, search.

    Build one with ``Index.build(model, "runs/index", images="photos/")`` (or ``dataset_name=..., split=...``),
    open it later with ``Index.open("runs/index")``, add the new images of the folder with ``append()``, and
    search it with ``search("a red square", k=5)``. An index opens only when its files are those its manifest
    records (``verify``: ``quick``, each file there with its size, or ``full``, checksums and finite embeddings
    too); otherwise ``vlfit.index.integrity.DamagedIndexError`` (a ``DataError``) names the file and the command
    that rebuilds it.

    ``push("qdrant:vectors")`` writes the index to a vector database (``vlfit retrieve push``), and
    ``Index.open("qdrant:vectors")`` searches what was pushed there with the model recorded in it, with the same hits.
    """

    def __init__(self, path: str, model: Model | None = None, verify: str = "quick") -> None:
        self.path = path
        self._model = model
        self._reload(verify)

    def _reload(self, verify: str = "quick") -> None:
        from vlfit.index.push.base import is_target_uri
        from vlfit.index.verify import open_index

        if is_target_uri(self.path):  # a collection vlfit retrieve push wrote
            from vlfit.index.push.pushed import PushedIndex

            self._index: Any = PushedIndex(self.path)
        else:
            self._index = open_index(self.path, verify)  # the manifest as the last build wrote it
        self._reranker: Any = None  # opened by the first search that re-ranks

    def __len__(self) -> int:
        return len(self._index)

    @property
    def model(self) -> Model:
        """The model the index was built with (loaded on first use)."""
        if self._model is None:
            from vlfit.index.search import query_runtime

            self._model = Model(query_runtime(self._index))
        return self._model

    @classmethod
    @python_api(renames={"index": "path", "output_dir": "path", "dataloader_num_workers": "num_workers"})
    def build(
        cls,
        model: Model | str,
        path: str,
        *,
        images: str | None = None,
        dataset_name: str | None = None,
        split: str = "test",
        image_column: str = "image",
        caption_column: str | None = "image_description",
        image_id_column: str | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        shard_size: int | None = None,
        progress: bool = False,
        index_type: str | None = None,
        max_index_memory: int | None = None,
        target_recall: float | None = None,
        verify: str = "quick",
    ) -> Index:
        """Embed a folder of images (``images``) or a dataset split into the index at ``path`` (created, or resumed
        and appended to when it exists: only items not in it yet are embedded; an index of another model is
        refused), then bring its ANN structure up to date as ``vlfit retrieve index`` does (``index_type``:
        ``auto``, ``flat``, ``hnsw`` or ``ivfpq``; needs the serve extra). ``shard_size``, ``index_type``,
        ``max_index_memory`` and ``target_recall`` left None are those the index was built with (of a new index:
        4096, ``auto``, 4 GiB, 0.95). A dataset's rows that show one image (one ``image_id_column`` value, one row of
        a list caption column, or identical bytes) are one item with all their captions, as evaluation groups them."""
        from vlfit.index.job import IndexJob, index_collection

        # Every value is checked as the job is made, before the model loads.
        job = IndexJob(
            model if isinstance(model, str) else model.encoder, path, images=images, dataset_name=dataset_name,
            split=split, image_column=image_column, caption_column=caption_column, image_id_column=image_id_column,
            batch_size=batch_size, num_workers=num_workers, shard_size=shard_size, progress=progress, verify=verify,
            index_type=index_type, max_index_memory=max_index_memory, target_recall=target_recall,
        )  # fmt: skip
        if isinstance(model, str):  # appended to at the patch budget it was built with (a NaFlex model's)
            model = load(model, max_num_patches=job.replayed().runtime.max_num_patches)
            job = dataclasses.replace(job, model=model.encoder)
        index_collection(job).raise_for_lost_shards()
        return cls(path, model)

    @classmethod
    @python_api(renames={"index": "path"})
    def open(cls, path: str, model: Model | None = None, verify: str = "quick") -> Index:
        """The index at ``path``, checked against its manifest (``verify``: ``quick`` or ``full``, as ``vlfit
        retrieve verify`` checks it); queries are embedded with ``model`` (default: the one it was built with).
        ``path`` may name a vector database an index was pushed to (``lancedb:PATH``, ``qdrant:PATH``,
        ``chroma:PATH``, ``postgresql://...``, ``milvus:PATH.db``, each ``[#collection]``)."""
        index = cls(path, model, verify)
        if model is not None:
            model.encoder.check_embeds_into(index._index.manifest.identity, f"the index {path}")
        return index

    @python_api(renames={"index": "path"})
    def append(self, progress: bool = False, batch_size: int = 32, num_workers: int = 0) -> int:
        """Embed what the index's folder or dataset holds that the index does not yet, with the settings it was
        built with (its columns, shard size, ANN type and parameters, as ``vlfit retrieve index`` appends do);
        returns how many were added."""
        from vlfit.data.sources.openers import COLLECTION_KEYS

        last = self._index.manifest.collections[-1]  # what the latest build embedded, opened again
        before = len(self._index)
        Index.build(
            self.model, self.path, **{key: last[key] for key in COLLECTION_KEYS if key in last}, progress=progress,
            batch_size=batch_size, num_workers=num_workers,
        )  # fmt: skip
        self._reload()
        return len(self._index) - before

    @python_api(renames={"to": "uri"})
    def push(
        self,
        uri: str,
        *,
        overwrite: bool = False,
        delete_missing: bool = False,
        batch_size: int | None = None,
        progress: bool = False,
    ) -> dict[str, object]:
        """Push the index to the vector database ``uri`` as ``vlfit retrieve push --to URI`` does (items already
        there skipped unless ``overwrite``; ``delete_missing`` removes those the index does not hold); returns its
        report (``pushed``, ``skipped``, ``deleted``, ``total``, ...)."""
        from vlfit.index.push.job import push_index
        from vlfit.index.push.pushed import PushedIndex

        if isinstance(self._index, PushedIndex):
            raise ConfigError(f"{self.path} is a pushed collection: push the index folder it came from")
        report = push_index(self._index, uri, overwrite=overwrite, delete_missing=delete_missing,
                            batch_size=batch_size, progress=progress)  # fmt: skip
        return report.to_dict()

    @python_api(renames={"index": "path", "rerank_top_k": "rerank"})
    def search(
        self,
        queries: str | Sequence[str] | np.ndarray,
        k: int = 10,
        rerank: int | None = None,
        rerank_score: str | None = None,
        rerank_weight: float | None = None,
    ) -> list[SearchHit] | list[list[SearchHit]]:
        """The ``k`` best items for a text (a list of ``SearchHit``), for several texts or for query embeddings
        ``[Q, D]`` (a list of lists), best first.

        ``rerank``: re-rank each text's top ``rerank`` candidates by the model's image-text matching head (BridgeTower
        trained with ``--objective contrastive+itm``, or its export) and keep ``k`` of them; re-ranked hits carry
        ``match_score``. It reads the candidates' images, so the index must reach them (an image folder, a dataset).
        ``rerank_score``: ``itm`` (the log-odds alone) or ``itm+itc`` (plus ``rerank_weight`` times the cosine, the
        hits then carry ``fused_score``); by default ``itm+itc`` with the weight the run saved, ``itm`` without one.
        """
        from vlfit.index.push.pushed import PushedIndex
        from vlfit.index.rerank import Reranker, check_rerank_top_k
        from vlfit.index.search import search

        _check_at_least("k", k, 1)
        check_rerank_top_k(rerank, "--rerank")
        by = self.model.runtime.rerank_score(rerank_score, rerank_weight) if rerank is not None else None
        single = isinstance(queries, str)
        texts: list[str] = []
        if isinstance(queries, np.ndarray):
            if rerank is not None:
                raise ConfigError("--rerank scores texts against images: pass the query texts, not embeddings")
            embeddings = torch.from_numpy(self._query_embeddings(queries))
        else:
            texts = _strings("queries", queries)
            embeddings = torch.from_numpy(self.model.encode_texts(texts))  # a view: no copy
        if isinstance(self._index, PushedIndex):  # a pushed collection: its engine searches
            if rerank is not None:
                raise ConfigError(f"--rerank reads the candidates' images, which {self.path} does not hold")
            results = self._index.search(embeddings, k)
        else:
            results = search(self._index, embeddings, max(k, rerank or 0))
        if rerank is not None:
            if self._reranker is None:
                self._reranker = Reranker.beside(self.model.runtime, self._index)
            results = self._reranker.rerank(results, texts, rerank, k, by)
        return results[0] if single else results

    def _query_embeddings(self, queries: np.ndarray) -> np.ndarray:
        """Query embeddings ``[Q, D]`` (one ``[D]`` alone: one query), checked against the index's size."""
        dim = self._index.manifest.identity.embedding_size
        array = np.atleast_2d(queries)
        if array.ndim != 2 or array.shape[1] != dim or not np.issubdtype(array.dtype, np.number):
            raise DataError(
                f"--queries: embeddings must be numbers of shape [Q, {dim}] (or [{dim}]) for this index, got "
                f"{queries.dtype} {list(queries.shape)}"
            )
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise DataError("--queries: embeddings hold NaN or infinite values")
        return array
