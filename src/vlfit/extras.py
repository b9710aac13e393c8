"""vlfit's optional dependency groups (the extras of ``pyproject.toml``) and the check that one is installed.

The core install trains, evaluates, benchmarks, prepares and makes data. Everything else is an extra, installed with
``pip install 'vlfit[<extra>]'`` (``vlfit[all]`` for every one): a command or option that needs a missing extra
stops in one line naming it, before any work is done.
"""

from __future__ import annotations

import importlib.util

from vlfit.errors import MissingExtraError

# Extra -> the modules it provides (import names), as pyproject.toml's [project.optional-dependencies] lists them.
EXTRAS: dict[str, tuple[str, ...]] = {
    "export": ("onnx", "onnxscript", "onnxruntime", "openvino", "nncf"),
    "search": ("optuna",),
    "lora": ("peft",),
    "fewshot": ("sklearn",),
    "gpu": ("torchcodec",),
    "serve": ("faiss", "fastapi", "uvicorn", "python_multipart"),
    "stream": ("fsspec", "aiohttp"),
    "ray": ("ray",),  # vlfit retrieve index --distributor ray
    # vlfit retrieve push --to URI (and query --index URI): one extra per vector database.
    "lancedb": ("lancedb",),
    "qdrant": ("qdrant_client",),
    "chroma": ("chromadb",),
    "pgvector": ("psycopg", "pgvector"),
    "milvus": ("pymilvus", "milvus_lite"),
    "open_clip": ("open_clip",),  # vlfit export --format open_clip: the folder is checked with open_clip's loader
}
# The CLI commands that need an extra as a whole.
COMMAND_EXTRAS: dict[str, str] = {
    "export": "export",
    "search": "search",
    "merge-lora": "lora",
    "fewshot": "fewshot",
    "classify": "fewshot",
    "serve": "serve",
}


def missing_modules(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or the subset ``modules`` of it) that cannot be imported; found without importing."""
    missing = []
    for module in modules if modules is not None else EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module hidden as None in sys.modules
            found = False
        if not found:
            missing.append(module)
    return missing


def require_extra(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise ``MissingExtraError`` unless every module of ``extra`` (or of ``modules``) is installed.

    Args:
        extra: The extra's name in ``pyproject.toml`` (``"export"``).
        what: Who needs it, as the message's subject (``"vlfit export"``, ``"--lora_r"``).
        modules: Only these modules of the extra are needed (e.g. ``("onnxruntime",)`` for one backend).
    """
    missing = missing_modules(extra, modules)
    if missing:
        raise MissingExtraError(what, extra, ", ".join(missing))
