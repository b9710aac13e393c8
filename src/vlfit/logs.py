"""Where vlfit's log lines go: configured once, by the entry point (``vlfit.cli.main``), never by library code.

Library modules only call ``logging.getLogger(__name__)``: a Python caller who configures logging (or does not)
decides what is shown, as with any library. The CLI shows vlfit's INFO lines on stderr (``--log_level`` changes
that), keeping stdout for results.
"""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s - %(levelname)s - %(name)s - %(message)s"


def configure_logging(level: str = "info") -> None:
    """Send the ``vlfit`` loggers' records at ``level`` and above to stderr, and transformers' warnings too.

    Called once per process by ``vlfit.cli.main``; calling it again replaces the handler it added.
    """
    import transformers

    numeric = getattr(logging, level.upper())
    package = logging.getLogger("vlfit")
    for handler in list(package.handlers):
        if getattr(handler, "_vlfit", False):
            package.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler._vlfit = True  # type: ignore[attr-defined]
    package.addHandler(handler)
    package.setLevel(numeric)
    transformers.utils.logging.set_verbosity(max(numeric, logging.WARNING))


def quiet_replicas(process_log_level: int, should_log: bool) -> None:
    """On a process that is not the main one of a distributed run, show vlfit's warnings only (the Trainer's
    ``--log_level_replica``), so N processes do not log every line N times."""
    if not should_log:
        logging.getLogger("vlfit").setLevel(max(process_log_level, logging.WARNING))
