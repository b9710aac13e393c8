"""The one reader of an index's shard files: ``ShardVectors``, the embeddings by row (or by shard) from the
memory-mapped files, what exact search, the ANN structure's rebuilds and its re-ranking read.

A ``.safetensors`` shard's header is parsed and its data mapped; a ``.npy`` shard is mapped by numpy. A shard that
is missing, cut short or of another shape raises a ``DamagedIndexError`` naming it and the command that rebuilds
it. What the operating system caches of the files is shared between processes and given back under pressure.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from vlfit.index.integrity import DamagedIndexError

EMBEDDINGS_KEY = "embeddings"  # the tensor's name in a .safetensors shard


def _mapped_shard(file: str, dim: int, repair: str) -> np.ndarray:
    """The ``[n, D]`` float32 embeddings of one shard file, memory-mapped.

    A ``.safetensors`` file is 8 bytes of little-endian header length, a JSON header giving the tensor's dtype,
    shape and byte range, then the data (the format's specification); a ``.npy`` file maps through numpy. The
    mapping is copy-on-write (``mode="c"``): the file is never written, and torch can view the array without a copy.

    Raises:
        DamagedIndexError: when the file is missing, cut short, or does not hold float32 embeddings of size ``dim``
            (the message ends with ``repair``, the command that rebuilds it).
    """
    try:
        if file.endswith(".npy"):
            mapped = np.load(file, mmap_mode="c")
        else:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            entry = header.get(EMBEDDINGS_KEY) or {}
            begin, end = entry.get("data_offsets", (0, 0))
            shape = tuple(entry.get("shape", ()))
            if entry.get("dtype") != "F32" or len(shape) != 2 or end - begin != 4 * shape[0] * shape[1]:
                raise DamagedIndexError(file, f"not a shard of float32 embeddings (header {entry})", repair)
            mapped = np.memmap(file, dtype=np.float32, mode="c", offset=8 + length + begin, shape=shape)
    except FileNotFoundError:
        raise DamagedIndexError(file, "missing", repair) from None
    except (OSError, ValueError, struct.error, AttributeError) as err:  # cut short, or not this format
        raise DamagedIndexError(file, f"cannot be read ({type(err).__name__}: {err})", repair) from None
    if mapped.dtype != np.float32 or mapped.ndim != 2 or mapped.shape[1] != dim:
        problem = f"holds {mapped.dtype} {mapped.shape}, not float32 embeddings of size {dim}"
        raise DamagedIndexError(file, problem, repair)
    return mapped


class ShardVectors:
    """An index's embeddings by row, straight from its memory-mapped shards: a query's candidates are read,
    not the index (what the operating system caches of the files is shared, and given back under pressure). A
    shard is mapped when a row of it is first read.

    Args:
        files: The shard files, in row order.
        counts: The rows of each.
        dim: The embedding size.
        repair: The command that rebuilds a damaged shard, for the message of one that is.
    """

    def __init__(self, files: list[str], counts: list[int], dim: int, repair: str = "vlfit retrieve index") -> None:
        self.files = files
        self.dim = dim
        self.repair = repair
        self.starts = np.cumsum([0, *counts])
        self._mapped: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard(self, number: int) -> np.ndarray:
        """Shard ``number``'s embeddings ``[n, D]``, mapped when first asked for.

        Raises:
            DamagedIndexError: when the file does not hold the float32 rows the manifest lists.
        """
        mapped = self._mapped.get(number)
        if mapped is None:
            mapped = _mapped_shard(self.files[number], self.dim, self.repair)
            if len(mapped) != self.starts[number + 1] - self.starts[number]:
                rows = self.starts[number + 1] - self.starts[number]
                problem = f"holds {len(mapped)} rows, the manifest says {rows}"
                raise DamagedIndexError(self.files[number], problem, self.repair)
            mapped = self._mapped.setdefault(number, mapped)
        return mapped

    def all_rows(self) -> np.ndarray:
        """Every row at once, float32 ``[N, D]`` in memory (a copy: the shards are not kept mapped by it)."""
        parts = [self.shard(number) for number in range(len(self.files))]
        return np.concatenate(parts) if parts else np.empty((0, self.dim), dtype=np.float32)

    def __getitem__(self, rows: Any) -> np.ndarray:
        """The float32 embeddings ``[len(rows), D]`` of ``rows`` (any order, repeats allowed)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows must be in [0, {len(self)}), got {rows.min()}..{rows.max()}")
        out = np.empty((rows.size, self.dim), dtype=np.float32)
        shard_of = np.searchsorted(self.starts, rows, side="right") - 1
        for number in np.unique(shard_of).tolist():
            picked = shard_of == number
            out[picked] = self.shard(number)[rows[picked] - self.starts[number]]
        return out


__all__ = ["EMBEDDINGS_KEY", "ShardVectors"]
