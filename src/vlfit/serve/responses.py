"""The server's error answers: ``{"error": "..."}`` with the status, and what a request that failed on the server
itself (a bug, a broken model file) gets: a 500 whose one line says nothing of the failure but a reference, while
the log gets the reference with the whole traceback.

A 500 never echoes the exception: its text may hold the server's paths (a model file, an index shard) and
internals that every other answer keeps from the client (``--absolute_paths`` aside).
"""

from __future__ import annotations

import logging
import secrets

from fastapi.responses import JSONResponse


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The server's error answer: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def internal_error(logger: logging.Logger, what: str, error: BaseException) -> JSONResponse:
    """The 500 of a request whose ``what`` (``"a search (text of 12 characters: ...)"``) failed with ``error``:
    logged at ERROR with its traceback under a fresh reference, which the answer gives and nothing else."""
    reference = secrets.token_hex(4)
    logger.error("%s failed (error %s)", what, reference, exc_info=error, stacklevel=2)
    return error_response(500, f"internal error {reference}: the server's log has its details under that reference")
