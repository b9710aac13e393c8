"""The server's access log: secrets given in a URL's query string kept out of it, and its lines written by a thread
of their own.

A client may put a key in the query string (``/api/search?api_key=...``, ``?token=...``), whatever the server
asks for: uvicorn's access log writes each request's path with its query, so the value would land in every log the
server's output goes to. ``RedactQuerySecrets`` is a ``logging.Filter`` on the ``uvicorn.access`` logger that
replaces the value of each query parameter whose name holds ``key``, ``token``, ``secret``, ``password`` or
``auth`` (any case, percent-encoded names decoded first) with ``REDACTED``; ``log_config`` is uvicorn's logging
configuration with it installed, which uvicorn applies in the server process and in each worker of ``--workers N``.

uvicorn logs each request from its event loop: formatting the line and writing it to the output (a pipe, a
terminal, a journal) took about a tenth of the loop's time under load, and a reader of the output that falls behind
would stall the loop at its write, every connection's requests with it. ``log_config`` gives the access logger
``vlfit.logs.BackgroundAccessLog``, which takes each record off the loop onto a bounded queue, and a thread of its
own formats and writes it: the loop pays for making the record only. When the queue is full (the output's reader has
stopped keeping up) a record is dropped and counted, never waited for; the writer says how many in a line of the log
once it writes again.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any
from urllib.parse import unquote_plus

from vlfit.logs import BackgroundAccessLog

ACCESS_LOGGER = "uvicorn.access"
REDACTED = "REDACTED"
SECRET_NAMES = re.compile(r"key|token|secret|password|auth", re.IGNORECASE)
_FILTER_NAME = "vlfit_redact_query_secrets"


def redact_query(target: str) -> str:
    """``target`` (a path with its query string) with the value of each secret-looking parameter replaced by
    ``REDACTED``; a target without a query string is returned as it is."""
    path, mark, query = target.partition("?")
    if not mark:
        return target
    fragment = ""
    if "#" in query:
        query, fragment = query.split("#", 1)
        fragment = "#" + fragment
    parts = []
    for part in re.split(r"([&;])", query):  # the separators kept, so the rest of the query reads as it came
        name, equals, _ = part.partition("=")
        parts.append(f"{name}={REDACTED}" if equals and SECRET_NAMES.search(unquote_plus(name)) else part)
    return f"{path}?{''.join(parts)}{fragment}"


class RedactQuerySecrets(logging.Filter):
    """Rewrites the query string of every text argument of an access record (uvicorn's request target) and of its
    message, secrets' values replaced by ``REDACTED``; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(arg) if isinstance(arg, str) else arg for arg in record.args)
        if isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def log_config(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """uvicorn's logging configuration (``base``, default ``uvicorn.config.LOGGING_CONFIG``) with
    ``RedactQuerySecrets`` on the ``uvicorn.access`` logger and its handler's lines written by
    ``BackgroundAccessLog``: what ``uvicorn.run(log_config=...)`` takes."""
    if base is None:
        from uvicorn.config import LOGGING_CONFIG

        base = LOGGING_CONFIG
    config = copy.deepcopy(base)
    config.setdefault("filters", {})[_FILTER_NAME] = {"()": f"{__name__}.RedactQuerySecrets"}
    access = config.setdefault("loggers", {}).setdefault(ACCESS_LOGGER, {})
    access["filters"] = [*access.get("filters", []), _FILTER_NAME]
    for name in access.get("handlers", []):
        handler = config["handlers"][name]
        if handler.get("class") == "logging.StreamHandler":
            handler.pop("class")
            handler["()"] = f"{BackgroundAccessLog.__module__}.BackgroundAccessLog"
    return config
