"""The queries of ``vlfit retrieve query``: texts and image files from the flags or a file of queries, embedded in
order through the index's model runtime."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlfit.data.image_inputs import concat_image_batches
from vlfit.data.text_checks import unicode_problem
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.index.stages import StageTimes
from vlfit.inference.runtime import ModelRuntime

# In a file of queries, a line starting with this is an image query (the rest is the image's path).
IMAGE_PREFIX = "image:"


@dataclass(frozen=True)
class Query:
    """A text query, or an image query (``image`` is a file path)."""

    text: str | None = None
    image: str | None = None

    @property
    def description(self) -> str:
        return self.text if self.text is not None else f"{IMAGE_PREFIX}{self.image}"


def read_queries(path: str) -> list[Query]:
    """One query per non-empty line: text, or ``image:PATH``.

    ``PATH`` is taken as typed, as ``--image PATH`` would be: a relative path is relative to the working directory
    (not to the file), and results name it as written.

    Raises:
        MissingFileError: when the file does not exist.
        ConfigError: when it holds no query.
    """
    if not os.path.isfile(path):
        raise MissingFileError(f"--queries {path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    queries = []
    for line in lines:
        if not line:
            continue
        if line.startswith(IMAGE_PREFIX):
            image = line[len(IMAGE_PREFIX) :].strip()
            queries.append(Query(image=image))
        else:
            queries.append(Query(text=line))
    if not queries:
        raise ConfigError(f"--queries {path}: no queries in it (one per line: text, or image:PATH)")
    return queries


def check_queries(queries: Sequence[Query]) -> None:
    """Refuse, before the index and the model are opened, an image query whose file does not exist and a text query
    that is no Unicode text (bytes of the command line that are not UTF-8 arrive as lone surrogates).

    Raises:
        MissingFileError: naming ``--image`` and the file.
        DataError: naming the text query and what is wrong with it.
    """
    for number, query in enumerate(queries, start=1):
        if query.image is not None and not os.path.isfile(query.image):
            raise MissingFileError(f"--image {query.image}: no such file")
        problem = None if query.text is None else unicode_problem(query.text, f"text query {number}")
        if problem is not None:
            raise DataError(f"{problem}; give the query as UTF-8 text")


def embed_queries(
    runtime: ModelRuntime, queries: Sequence[Query], batch_size: int = 32, times: StageTimes | None = None
) -> torch.Tensor:
    """The embeddings ``[Q, D]`` of ``queries`` in order: texts through the runtime's text tower, image files
    through its ``pixels`` (the fast CPU pipeline's transform) and image tower. ``times`` gets the ``decode``
    (reading and decoding the image files) and ``encode`` (the towers' forwards) time.

    Raises:
        MissingFileError: for an image file that does not exist.
        DataError: for an image that cannot be decoded, naming ``--image`` and the file.
    """
    times = times or StageTimes()
    rows: list[torch.Tensor | None] = [None] * len(queries)
    check_queries(queries)
    texts = [(i, q.text) for i, q in enumerate(queries) if q.text is not None]
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        with times.stage("encode"):
            embeddings = runtime.embed_texts([text for _, text in chunk], batch_size)
        for (i, _), row in zip(chunk, embeddings, strict=True):
            rows[i] = row
    images = [(i, q.image) for i, q in enumerate(queries) if q.image is not None]
    for start in range(0, len(images), batch_size):
        chunk = images[start : start + batch_size]
        with times.stage("decode"):
            pixels = _pixels(runtime, [path for _, path in chunk])
        with times.stage("encode"):
            embedded = runtime.encoder.encode_images(**pixels)
        for (i, _), row in zip(chunk, embedded, strict=True):
            rows[i] = row
    return torch.stack([row for row in rows if row is not None])


def _pixels(runtime: ModelRuntime, paths: list[str]) -> dict[str, torch.Tensor]:
    """The encoder's image inputs of ``paths`` (``ModelRuntime.image_batch``), a bad one named by its flag."""
    batches = []
    for path in paths:  # one at a time: the error names the flag and the file
        try:
            batches.append(runtime.image_batch(path))
        except DataError as error:
            raise DataError(f"--image {path}: cannot be used: {error}") from None
    return concat_image_batches(batches)
