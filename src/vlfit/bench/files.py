"""Write ``bench.json``, ``bench.md`` and ``bench.png``, each through ``vlfit.atomic_files.replace_on_success``.

The sweep writes its partial results after every configuration, and a run can be stopped at any point (a time
budget's SIGINT, SIGTERM, a kill): a reader must see the previous complete file or the new one, never half of one.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from vlfit.atomic_files import replace_on_success, write_text_atomically
from vlfit.bench.chart import write_png
from vlfit.bench.report import format_markdown

logger = logging.getLogger(__name__)

OUTPUT_NAMES: dict[str, str] = {"json": "bench.json", "md": "bench.md", "png": "bench.png"}


def write_outputs(results: dict[str, Any], output_dir: str, *, png: bool = True) -> dict[str, str]:
    """Write ``bench.json``, ``bench.md`` and (when ``png``) ``bench.png`` into ``output_dir``.

    The chart is drawn first; one that cannot be drawn is logged and left out (the numbers are written anyway, and
    ``bench.md`` links no chart).

    Returns:
        Kind (``json``, ``md``, ``png``) -> path of each file written.
    """
    os.makedirs(output_dir, exist_ok=True)
    paths = {kind: os.path.join(output_dir, name) for kind, name in OUTPUT_NAMES.items()}
    if png:
        try:
            with replace_on_success(paths["png"]) as temp:
                write_png(results, temp)
        except Exception:  # a chart is not worth losing the numbers over (fonts, backends, ...)
            logger.exception("could not draw %s; bench.json and bench.md are written anyway", paths["png"])
            png = False
    if not png:
        del paths["png"]
    with replace_on_success(paths["json"]) as temp, open(temp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, allow_nan=False)
    write_text_atomically(paths["md"], format_markdown(results, OUTPUT_NAMES["png"] if png else None))
    return paths
