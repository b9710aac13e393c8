"""Source specs of the shard stream: ``::``-joined brace patterns of fsspec URLs, with one weight per source.

``'https://host/a/{000..099}.tar::s3://bucket/b/{000..009}.tar'`` is two sources (open_clip's form), the first of
100 shards and the second of 10. A part is a URL fsspec knows (``https://``, ``s3://``, ``gs://``, ``file://``...)
or a plain local path (globs expand too). fsspec's own URL chaining (``simplecache::s3://...``) uses the same
separator, so it cannot be written in a spec: pass caching options through ``storage_options`` instead.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vlfit.data.file_patterns import expand_braces
from vlfit.errors import ConfigError, MissingFileError

SOURCE_SEPARATOR = "::"


@dataclass(frozen=True)
class StreamSource:
    """One source of the stream: its shards and its share of the mixture.

    Attributes:
        urls: The shard URLs (or local paths), in the order the spec expands to.
        weight: Relative weight when several sources are mixed (any positive number).
        spec: The pattern as written, for messages.
    """

    urls: tuple[str, ...]
    weight: float = 1.0
    spec: str = ""


def protocol(url: str) -> str:
    """The fsspec protocol of ``url``: ``"https"``, ``"s3"``..., ``"file"`` for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def parse_storage_options(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``--storage_options`` (fsspec options: headers, auth, client_kwargs...) as a dict: a JSON object as text, a
    mapping as it is, ``{}`` when not given.

    Raises:
        ConfigError: naming the flag, when it is not a JSON object.
    """
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        options = json.loads(raw)
    except ValueError as err:
        raise ConfigError(
            f"--storage_options is not valid JSON ({err}); give an object, e.g. '{{\"headers\": {{}}}}'"
        ) from None
    if not isinstance(options, dict):
        raise ConfigError(f"--storage_options must be a JSON object of fsspec options, not {type(options).__name__}")
    return options


def is_http(url: str) -> bool:
    """Whether ``url`` is read through fsspec's HTTP filesystem (which needs aiohttp)."""
    return protocol(url) in ("http", "https")


def parse_weights(weights: str | Sequence[float], *, flag: str = "--train_data_weights") -> list[float]:
    """Weights as floats, from a comma-separated string (``"1,4"``) or a sequence.

    Raises:
        ConfigError: naming ``flag`` for a value that is not a finite positive number.
    """
    parts = [p.strip() for p in weights.split(",")] if isinstance(weights, str) else list(weights)
    values = []
    for part in parts:
        try:
            value = float(part)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag}: {part!r} is not a number; give one positive weight per source") from None
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(
                f"{flag}: weight {part!r} must be a positive number (a source of weight 0 is a source "
                "to leave out of the spec)"
            )
        values.append(value)
    return values


def parse_sources(
    spec: str,
    weights: str | Sequence[float] | None = None,
    *,
    flag: str = "--train_file",
    weights_flag: str = "--train_data_weights",
) -> list[StreamSource]:
    """Split a spec into its sources, expand each one's braces, and attach the weights.

    Args:
        spec: ``::``-separated patterns, each with bash-style braces (``{000..099}``, ``{a,b}``).
        weights: One weight per source (a sequence, or a comma-separated string); ``None``: all equal.
        flag: The option the spec came from, for messages.
        weights_flag: The option the weights came from, for messages.

    Returns:
        The sources, in the order written.

    Raises:
        ConfigError: for an empty source, or when the weights are not one positive number per source.
        MissingFileError: for a local path (plain or ``file://``) that does not exist.
    """
    patterns = [part.strip() for part in spec.split(SOURCE_SEPARATOR)]
    if not spec.strip() or not all(patterns):
        raise ConfigError(f"{flag}: empty source in {spec!r}; write sources as 'a/{{000..099}}.tar::b/{{0..9}}.tar'")
    values = [1.0] * len(patterns) if weights is None else parse_weights(weights, flag=weights_flag)
    if len(values) != len(patterns):
        raise ConfigError(
            f"{weights_flag}: {len(values)} weight(s) for {len(patterns)} source(s) of {flag} {spec!r}; "
            "give one weight per '::'-separated source"
        )
    sources = []
    for pattern, weight in zip(patterns, values, strict=True):
        urls = tuple(found for url in expand_braces(pattern) for found in _local(url, flag, spec))
        sources.append(StreamSource(urls, weight, pattern))
    return sources


def _local(url: str, flag: str, spec: str) -> list[str]:
    """A URL as it is; a local path with ``~`` expanded and a glob expanded (sorted). A local path that does not
    exist is refused now rather than as bad shards."""
    if protocol(url) != "file":
        return [url]
    path = os.path.expanduser(url[len("file://") :] if url.startswith("file://") else url)
    if glob.has_magic(path):
        matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not matches:
            raise MissingFileError(f"{flag}: no shard matches {path!r} (from {spec!r})")
        return matches
    if not os.path.isfile(path):
        raise MissingFileError(f"{flag}: shard {path!r} not found (from {spec!r})")
    return [url if url.startswith("file://") else path]
