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
    quiet_third_parties(numeric > logging.DEBUG)


# transformers warns at each load of a SigLIP config that its default bos/eos ids (49406/49407) lie outside the
# vocabulary: SigLIP's text tower never reads them, and nothing the user can pass changes them.
_TOKEN_ID_WARNING = "Model config: "


class _DropTokenIdWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(_TOKEN_ID_WARNING) and "_token_id must be `None` or an integer" in message)


_TOKEN_ID_FILTER = _DropTokenIdWarnings()


def quiet_third_parties(quiet: bool = True) -> None:
    """Hide (``quiet``) or show again the third-party output that tells a user nothing: transformers' own progress
    bars ("Loading weights", "Writing model shards") and its warnings about a config's special-token ids.

    Download bars (huggingface_hub's) stay: a large download's progress is news. ``--log_level debug`` shows all.
    """
    import huggingface_hub.utils
    import transformers

    downloads_shown = not huggingface_hub.utils.are_progress_bars_disabled()
    config_logger = logging.getLogger("transformers.configuration_utils")
    if quiet:
        transformers.utils.logging.disable_progress_bar()
        config_logger.addFilter(_TOKEN_ID_FILTER)
    else:
        transformers.utils.logging.enable_progress_bar()
        config_logger.removeFilter(_TOKEN_ID_FILTER)
    if downloads_shown:  # transformers' switch turns huggingface_hub's bars too; leave those as they were
        huggingface_hub.utils.enable_progress_bars()


def quiet_replicas(process_log_level: int, should_log: bool) -> None:
    """On a process that is not the main one of a distributed run, show vlfit's warnings only (the Trainer's
    ``--log_level_replica``), so N processes do not log every line N times."""
    if not should_log:
        logging.getLogger("vlfit").setLevel(max(process_log_level, logging.WARNING))
