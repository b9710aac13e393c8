"""The server's error answer: ``{"error": "..."}`` with the status, for the app's routes and its middlewares alike."""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The server's error answer: ``{"error": message}``."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)
