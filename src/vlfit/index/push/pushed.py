"""A pushed collection, searched as an index is: ``vlfit retrieve query --index URI`` and ``vlfit.Index.open(URI)``.

``PushedIndex`` reads the collection's record (the model it was pushed from) and answers with the same ``Hit`` a
local index gives (id, row, cosine score rounded as a local search rounds it, captions when the index stored some),
so the same query gives the same top-k ids through either. It has the ``manifest`` (identity and model) and ``path``
that ``vlfit.index.search.query_runtime`` reads, so queries are embedded by the model recorded in the collection, on
the runtime, precision and caption length the index was built with.
"""

from __future__ import annotations

import numpy as np
import torch

from vlfit.errors import DataError
from vlfit.index.manifest import IndexManifest
from vlfit.index.push.base import CollectionRecord, Target, TargetError, open_target
from vlfit.index.search import Hit


class PushedIndex:
    """A collection ``vlfit retrieve push`` wrote, opened for searching.

    Args:
        uri: The target URI (``lancedb:PATH#table`` ...).

    Raises:
        MissingExtraError: when the target's extra is not installed.
        TargetError: when the target cannot be reached, holds no such collection, or one vlfit did not write.
    """

    def __init__(self, uri: str) -> None:
        self.path = uri
        self.target: Target = open_target(uri, "--index")
        with self.target.failing("reading the collection"):
            record = self.target.record()
        if record is None:
            raise TargetError(f"{uri}: no collection {self.target.uri.collection!r} there; push an index to it first: "
                              f"vlfit retrieve push --index INDEX --to {uri}")  # fmt: skip
        self.record: CollectionRecord = record
        self.manifest = IndexManifest(record.identity, dict(record.model))

    def __len__(self) -> int:
        with self.target.failing("counting the collection"):
            return self.target.count()

    def search(self, queries: torch.Tensor, k: int, *, exact: bool = False) -> list[list[Hit]]:
        """The ``k`` best items for each query embedding ``[Q, D]``, best first, as ``vlfit.index.search.search``
        gives them.

        Raises:
            DataError: when a query embedding holds NaN or infinite values.
        """
        array = queries.float().contiguous().numpy()
        if not np.isfinite(array).all():
            raise DataError("the model embeds a query to NaN or infinite values: nothing to rank by")
        with self.target.failing("searching"):
            found = self.target.search(array, k, exact=exact)
        return [[Hit(hit.id, round(hit.score, 6), hit.captions, hit.row) for hit in hits] for hits in found]


__all__ = ["PushedIndex"]
