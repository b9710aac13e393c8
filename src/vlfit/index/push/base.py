"""The one interface every vector database target of ``vlfit retrieve push`` implements, and the URIs that name them.

A target URI names an engine, where it lives and a collection (a table) in it::

    lancedb:PATH[#table]                          a LanceDB folder (embedded)
    qdrant:PATH | qdrant::memory: | qdrant:http(s)://HOST:PORT [#collection]
    chroma:PATH | chroma:http(s)://HOST:PORT [#collection]
    postgresql://USER[:PASSWORD]@HOST[:PORT]/DB[#table]   (postgres:// too; pgvector)
    milvus:PATH.db | milvus:http(s)://HOST:PORT [#collection]

A location of another URL scheme (``qdrant:ftp://x``) is refused. The collection is ``vlfit`` unless the fragment
names another. What a target stores per item is the same everywhere: the item's id (as a search names it: an image
folder's file relative to the folder indexed, or the dataset item's id), its embedding, and a payload (its row in the
index, its captions or None, its path relative to the indexed root or None, the model's checkpoint fingerprint). The
collection itself records the model (``CollectionRecord``: the identity, the model folder and runtime it was built
with) and the metric, so a query embeds with that model and a push from another model is refused.

Each engine's module (``vlfit.index.push.lancedb`` ...) subclasses ``Target``; its client library is an extra of its
own (``vlfit[lancedb]`` ...), checked before the module is imported.
"""

from __future__ import annotations

import atexit
import importlib
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from vlfit.errors import ConfigError, UserError, first_line
from vlfit.extras import require_extra
from vlfit.inference.identity import ModelIdentity

DEFAULT_COLLECTION = "vlfit"
# vlfit's indexes hold L2-normalized embeddings searched by cosine; every target is created with that metric.
METRIC = "cosine"
# Scheme -> (module, extra): the module's TARGET class speaks to the engine through the extra's client library.
TARGETS: dict[str, tuple[str, str]] = {
    "lancedb": ("vlfit.index.push.lancedb", "lancedb"),
    "qdrant": ("vlfit.index.push.qdrant", "qdrant"),
    "chroma": ("vlfit.index.push.chroma", "chroma"),
    "postgresql": ("vlfit.index.push.pgvector", "pgvector"),
    "milvus": ("vlfit.index.push.milvus", "milvus"),
}
URI_FORMS = "lancedb:PATH, qdrant:PATH, chroma:PATH, postgresql://..., milvus:PATH.db (each with an optional #NAME)"
# Scheme -> the URL schemes its location may have (anything else of the form SCHEME://... is no path: the engine's
# client would make a folder named "ftp:" of qdrant:ftp://x, or fail in its own words) and the forms it takes.
LOCATIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "lancedb": (("s3", "gs", "az"), "lancedb:PATH (a folder; or object storage: s3://, gs://, az://)"),
    "qdrant": (("http", "https"), "qdrant:PATH, qdrant::memory: or qdrant:http(s)://HOST:PORT"),
    "chroma": (("http", "https"), "chroma:PATH or chroma:http(s)://HOST:PORT"),
    "milvus": (("http", "https"), "milvus:PATH.db (Milvus Lite's file) or milvus:http(s)://HOST:PORT"),
}
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")  # two letters at least: C://x is a Windows drive
# Item ids as point ids, for engines that take only numbers or UUIDs (Qdrant): a UUID derived from the id alone.
ID_NAMESPACE = uuid.UUID("6f1c3c8e-2d0b-5c41-9a53-7a1d0b5e6f21")


class TargetError(UserError):
    """A vector database target that cannot be used as asked: unreachable, refusing, or holding a collection of
    another shape or model. The message names the target URI and what to do."""


@dataclass(frozen=True)
class TargetURI:
    """A parsed target URI.

    Attributes:
        scheme: A key of ``TARGETS``.
        location: What the engine's client opens: a path, ``:memory:``, a server URL or a PostgreSQL connection URL.
        collection: The collection or table.
        text: The URI as given (what messages name).
    """

    scheme: str
    location: str
    collection: str
    text: str

    @property
    def remote(self) -> bool:
        """A server (``http(s)://`` or PostgreSQL) rather than a folder or file the client embeds."""
        return self.scheme == "postgresql" or self.location.startswith(("http://", "https://"))


def is_target_uri(text: str) -> bool:
    """Whether ``text`` names a vector database (``vlfit retrieve query --index`` takes a folder or one of these)."""
    scheme, colon, rest = text.partition(":")
    if scheme in ("postgresql", "postgres"):
        return rest.startswith("//")
    return bool(colon) and scheme in TARGETS


def parse_target(text: str, flag: str = "--to") -> TargetURI:
    """The ``TargetURI`` of ``text``.

    Raises:
        ConfigError: naming ``flag`` and the forms it takes, for anything else.
    """
    scheme, _, rest = text.partition(":")
    if not is_target_uri(text):
        raise ConfigError(f"{flag} {text}: not a vector database; give one of {URI_FORMS}")
    rest, _, collection = rest.partition("#")
    collection = collection or DEFAULT_COLLECTION
    if scheme in ("postgresql", "postgres"):
        return TargetURI("postgresql", f"postgresql:{rest}", collection, text)
    if not rest:
        raise ConfigError(f"{flag} {text}: no location after {scheme}:; give {scheme}:PATH (e.g. {scheme}:vectors)")
    if rest == ":memory:" and scheme != "qdrant":
        raise ConfigError(f"{flag} {text}: only qdrant has an in-memory mode; give {scheme}:PATH")
    schemes, forms = LOCATIONS[scheme]
    url = _URL.match(rest)
    if url and url.group(1) not in schemes:
        raise ConfigError(f"{flag} {text}: {scheme} does not take {url.group(1)}:// locations; give {forms}")
    return TargetURI(scheme, rest, collection, text)


@dataclass(frozen=True)
class CollectionRecord:
    """What a pushed collection records of the index it came from: the model identity, the model folder and runtime
    its embeddings were made with (as the index's manifest records them: queries are embedded alike) and the metric.
    """

    identity: ModelIdentity
    model: dict[str, Any] = field(default_factory=dict)
    metric: str = METRIC

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": 1, "identity": self.identity.to_dict(), "model": self.model, "metric": self.metric}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CollectionRecord:
        return cls(ModelIdentity.from_dict(data["identity"]), dict(data.get("model") or {}), str(data["metric"]))

    @classmethod
    def parse(cls, text: str | bytes | None) -> CollectionRecord | None:
        """The record stored as ``text`` (JSON), or None when it is not one."""
        try:
            return cls.parse_dict(json.loads(text)) if text else None
        except ValueError:
            return None

    @classmethod
    def parse_dict(cls, data: Any) -> CollectionRecord | None:
        """The record stored as ``data`` (``to_dict``'s), or None when it is not one."""
        try:
            return cls.from_dict(data)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


@dataclass
class Items:
    """A batch of items as every target writes them: ids, float32 embeddings ``[n, D]`` and each item's payload."""

    ids: list[str]
    vectors: np.ndarray
    rows: list[int]
    captions: list[list[str] | None]
    paths: list[str | None]
    model: str

    def __len__(self) -> int:
        return len(self.ids)

    def payloads(self) -> Iterator[dict[str, Any]]:
        """Each item's payload: ``id``, ``row``, ``captions``, ``path`` and ``model`` (the checkpoint fingerprint)."""
        for item, row, captions, path in zip(self.ids, self.rows, self.captions, self.paths, strict=True):
            yield {"id": item, "row": row, "captions": captions, "path": path, "model": self.model}


@dataclass(frozen=True)
class Found:
    """One result of a target's search: the item's id, its cosine similarity to the query and its payload."""

    id: str
    score: float
    row: int
    captions: list[str] | None


# Clients that allow one per folder or file in a process (Qdrant's local mode, Milvus Lite), kept by location and
# shared by every target of that location (also what keeps qdrant::memory:'s points between a push and a search).
_shared_clients: dict[tuple[str, str], tuple[Any, Callable[[], None] | None]] = {}


def shared_client(uri: TargetURI, make: Callable[[], Any], release: Callable[[], None] | None = None) -> Any:
    """The client of ``uri``'s engine and location this process already opened, else ``make()``'s, kept for the
    next (``release``: what frees the location once the client is closed, such as an embedded server of its own)."""
    key = (uri.scheme, uri.location)
    if key not in _shared_clients:
        _shared_clients[key] = (make(), release)
    return _shared_clients[key][0]


def close_shared_clients(prefix: str = "") -> None:
    """Close the shared clients of the locations that start with ``prefix`` (releasing their folders or files)."""
    for key in [key for key in _shared_clients if key[1].startswith(prefix)]:
        client, release = _shared_clients.pop(key)
        close = getattr(client, "close", None)
        if close is not None:
            close()
        if release is not None:
            release()


# Closed at exit, before the interpreter tears its modules down: a Qdrant local-mode client left to its __del__ then
# fails to import what it needs to unlock its folder, printing an "Exception ignored" traceback after every command.
atexit.register(close_shared_clients)


def point_id(item: str) -> str:
    """The UUID an engine that takes no string ids stores ``item`` under (the same for every push)."""
    return str(uuid.uuid5(ID_NAMESPACE, item))


class Target(ABC):
    """One collection of one vector database, as ``vlfit retrieve push`` writes it and ``vlfit retrieve query``
    searches it. Every call that reaches the engine runs under ``failing``, which turns the engine's own errors
    (``ERRORS``) into a ``TargetError`` naming the URI.

    Args:
        uri: The target.
    """

    # The exceptions of the engine's client that mean the target refused or could not be reached.
    ERRORS: ClassVar[tuple[type[BaseException], ...]] = ()
    # Items per write unless told otherwise: what the engine's bulk path writes at once (fewer commits, fragments or
    # round trips; benchmarks/push.py).
    BATCH_SIZE: ClassVar[int] = 1000
    # The index's compact storages (``--vector_storage``) that the engine keeps in a compact form of its own, named;
    # of any other, the push sends the float32 vectors only.
    COMPACT: ClassVar[dict[str, str]] = {}

    def __init__(self, uri: TargetURI) -> None:
        self.uri = uri
        self._client: Any = None
        self.storage = "float32"  # the pushed index's --vector_storage: what ``create`` asks of the engine
        self.rescore = 1  # and its --rescore: compact codes' candidates re-ranked with the float32 vectors per hit

    def storage_note(self) -> str:
        """What the push report says of the index's compact codes (``storage`` int8 or binary): the engine's own form
        they are kept in, or that the push sends float32 vectors only; nothing for float32."""
        if self.storage == "float32":
            return ""
        compact = self.COMPACT.get(self.storage)
        if compact:
            return f"{self.storage} codes as {compact} (for a collection it creates)"
        return f"no {self.storage} form used for this engine: the push sends float32 vectors"

    def connected(self, connect: Callable[[], Any], doing: str = "opening the database") -> Any:
        """The client of this target: ``connect()``'s, made on first use (its errors as ``failing``'s) and kept."""
        if self._client is None:
            with self.failing(doing):
                self._client = connect()
        return self._client

    @contextmanager
    def failing(self, doing: str) -> Iterator[None]:
        """Turn an error of the engine while ``doing`` into one line naming the target."""
        try:
            yield
        except UserError:
            raise
        except self.ERRORS as err:
            hint = " (check that the server is up and the credentials are right)" if self.uri.remote else ""
            raise TargetError(f"{self.uri.text}: {doing} failed: {first_line(err, 300)}{hint}") from None

    def refuse_shape(self, what: str) -> TargetError:
        """The error for a collection that vlfit did not write (or of another shape): name another or drop it."""
        return TargetError(
            f"{self.uri.text}: the collection {self.uri.collection!r} {what}, so it was not written by vlfit retrieve "
            f"push; name another with #COLLECTION at the end of the URI, or drop it"
        )

    @abstractmethod
    def record(self) -> CollectionRecord | None:
        """The collection's record; None when there is no such collection.

        Raises:
            TargetError: when the collection exists but was not written by a push (no record, other columns).
        """

    @abstractmethod
    def create(self, record: CollectionRecord) -> None:
        """Create the collection for embeddings of ``record.identity.embedding_size``, recording ``record``."""

    @abstractmethod
    def ids(self) -> set[str]:
        """The item ids the collection holds."""

    @abstractmethod
    def write(self, items: Items, *, new: bool) -> None:
        """Write a batch, replacing items of the same ids (``new``: none of them is in the collection yet, so the
        engine's plain bulk insert may be used)."""

    def finish(self) -> None:
        """What a push does once its items are written (an engine whose index is faster built over the items than
        kept up during the writes builds it here); nothing by default."""
        return None

    @abstractmethod
    def delete(self, ids: list[str]) -> None:
        """Remove the items of ``ids`` (ids not there are ignored)."""

    @abstractmethod
    def search(self, queries: np.ndarray, k: int, *, exact: bool = False) -> list[list[Found]]:
        """The ``k`` items nearest to each query ``[Q, D]`` by cosine, best first (``exact``: no approximation)."""

    @abstractmethod
    def count(self) -> int:
        """How many items the collection holds."""


class HeldCollectionTarget(Target):
    """A target whose client hands out an object for the collection (Chroma's collection, LanceDB's table):
    ``record`` and ``create`` keep it in ``_collection``."""

    def __init__(self, uri: TargetURI) -> None:
        super().__init__(uri)
        self._collection: Any = None

    @property
    def collection(self) -> Any:
        """The client's object for the collection, read by ``record`` when not yet kept."""
        if self._collection is None and self.record() is None:
            raise self.refuse_shape("is missing")  # every caller reads the record first
        return self._collection


def open_target(text: str, flag: str = "--to") -> Target:
    """The ``Target`` that ``text`` names, its client library checked first.

    Raises:
        ConfigError: for a URI of no known form.
        MissingExtraError: when the target's extra is not installed.
    """
    uri = parse_target(text, flag)
    module, extra = TARGETS[uri.scheme]
    require_extra(extra, f"{flag} {uri.scheme}:")
    return importlib.import_module(module).TARGET(uri)


__all__ = [
    "CollectionRecord",
    "Found",
    "HeldCollectionTarget",
    "Items",
    "Target",
    "TargetError",
    "close_shared_clients",
    "TargetURI",
    "is_target_uri",
    "open_target",
    "parse_target",
    "point_id",
    "shared_client",
]
