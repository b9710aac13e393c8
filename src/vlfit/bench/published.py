"""The study's published figures, kept as data in ``published.json`` (package data) with their source.

Samples/s of BridgeTower-large contrastive fine-tuning on 8 devices for ``dataloader_num_workers`` 0/1/2 (and, on
Gaudi2, with the media pipeline decoding on the device), from the Hugging Face blog post the bench reproduces. The
report and the chart read them from here; ``bench.json`` carries a copy under ``published``.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from vlfit.errors import ConfigError

PUBLISHED_FILE = "published.json"


@functools.cache
def _text() -> str:
    return resources.files(__package__).joinpath(PUBLISHED_FILE).read_text(encoding="utf-8")


def published_figures() -> dict[str, Any]:
    """The published figures (a fresh copy: callers may change it).

    Returns:
        ``label``, ``source`` (title, authors, publisher, url, dates), ``setup``, ``devices`` (accelerators per
        run), ``workers`` (the worker counts measured, as strings) and ``rows``: per accelerator, ``device``,
        ``samples_per_second`` by worker count for all devices together and, where measured,
        ``media_pipeline`` (with ``media_pipeline_workers`` workers).

    Raises:
        ValueError: when the file lacks a figure for one of its worker counts.
    """
    figures = json.loads(_text())
    for row in figures["rows"]:
        missing = [w for w in figures["workers"] if w not in row["samples_per_second"]]
        if missing:
            raise ConfigError(f"{PUBLISHED_FILE}: {row['device']} has no figure for {', '.join(missing)} workers")
    return figures


def per_device(figure: float, figures: dict[str, Any]) -> float:
    """A published figure (all devices together) divided by the number of devices."""
    return figure / figures["devices"]


def citation(figures: dict[str, Any]) -> str:
    """``Authors, "Title", Publisher, date (updated date), url``."""
    source = figures["source"]
    updated = f" (updated {source['updated']})" if source.get("updated") else ""
    return (
        f'{" and ".join(source["authors"])}, "{source["title"]}", {source["publisher"]}, '
        f"{source['published']}{updated}, {source['url']}"
    )
