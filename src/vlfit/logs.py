"""Where vlfit's log lines go: configured once, by the entry point (``vlfit.cli.main``), never by library code.

Library modules only call ``logging.getLogger(__name__)``: a Python caller who configures logging (or does not)
decides what is shown, as with any library. The CLI shows vlfit's INFO lines on stderr (``--log_level`` changes
that), keeping stdout for results. ``vlfit serve``'s access log is written by ``BackgroundAccessLog``
(``vlfit.serve.access_log``), a thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import queue
import sys
import threading
from typing import IO

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s - %(levelname)s - %(name)s - %(message)s"


def configure_logging(level: str = "info") -> None:
    """Send the ``vlfit`` loggers' records at ``level`` and above to stderr, and transformers' warnings too
    (``configure_third_parties``).

    Called once per process by ``vlfit.cli.main``; calling it again replaces the handler it added.
    """
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
    configure_third_parties(level)


def log_level() -> str:
    """The level vlfit's records are shown at (``configure_logging``'s, in a command: ``--log_level``)."""
    return logging.getLevelName(logging.getLogger("vlfit").getEffectiveLevel()).lower()


def configure_third_parties(level: str = "info") -> None:
    """Show transformers' records at ``level`` (WARNING at least) and, unless ``level`` is debug, hide the output of
    third parties that tells a user nothing (``quiet_third_parties``): ``configure_logging``'s part that a process a
    command starts without logging of its own (``vlfit serve``'s workers) does too."""
    import transformers

    numeric = getattr(logging, level.upper())
    transformers.utils.logging.set_verbosity(max(numeric, logging.WARNING))
    quiet_third_parties(numeric > logging.DEBUG)


def _uninformative(message: str) -> bool:
    """Whether a transformers record tells a vlfit user nothing they could act on:

    - a config's special-token ids outside its vocabulary ("Model config: bos_token_id must be `None` or an integer
      within the vocabulary"), at every SigLIP and SigLIP 2 load: the text tower never reads them, and no flag
      changes them;
    - a weights load report listing only UNEXPECTED keys (the checkpoint's weights the model does not take): a CLIP
      checkpoint as the vision tower of a two-tower run leaves out its text tower, 24 rows; a report with MISSING
      or MISMATCH rows (weights started afresh) is news and stays;
    - the Trainer's note that it set the config's PAD/BOS/EOS ids to the tokenizer's (a two-tower run's text
      tower): nothing in a contrastive model reads them.
    """
    if message.startswith("Model config: ") and "_token_id must be `None` or an integer" in message:
        return True
    if "LOAD REPORT" in message and "UNEXPECTED" in message:
        return not any(status in message for status in ("MISSING", "MISMATCH", "CONVERSION"))
    return message.startswith("The tokenizer has new PAD/BOS/EOS tokens that differ from the model config")


class _DropUninformative(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _uninformative(record.getMessage())


_UNINFORMATIVE_FILTER = _DropUninformative()
# The loggers of what _uninformative drops: a logger's filters see only its own records.
_FILTERED_LOGGERS = ("transformers.configuration_utils", "transformers.modeling_utils", "transformers.trainer_utils")


def end_progress_bars() -> None:
    """Close the progress bars still open, so that the line printed next starts a line of its own. A stop or an
    error can leave one behind mid-line: datasets draws its "Generating train split" bar before it starts its
    pool, and a signal that comes while the pool forks leaves the bar open, so a one-line message printed then
    would run on after it. A closed bar ends its line (or clears it, for one that does not stay)."""
    std = sys.modules.get("tqdm.std")  # not imported: no bar drawn
    bars = list(getattr(getattr(std, "tqdm", None), "_instances", ()))
    for bar in sorted(bars, key=lambda bar: -abs(getattr(bar, "pos", 0))):  # the innermost first, as `with` would
        with contextlib.suppress(Exception):  # a bar whose stream is closed already: nothing to end
            bar.close()


def quiet_third_parties(quiet: bool = True) -> None:
    """Hide (``quiet``) or show again the third-party output that tells a user nothing: transformers' own progress
    bars ("Loading weights", "Writing model shards") and the warnings ``_uninformative`` lists.

    Download bars (huggingface_hub's) stay: a large download's progress is news. ``--log_level debug`` shows all.
    """
    import huggingface_hub.utils
    import transformers

    downloads_shown = not huggingface_hub.utils.are_progress_bars_disabled()
    if quiet:
        transformers.utils.logging.disable_progress_bar()
    else:
        transformers.utils.logging.enable_progress_bar()
    for name in _FILTERED_LOGGERS:
        if quiet:
            logging.getLogger(name).addFilter(_UNINFORMATIVE_FILTER)
        else:
            logging.getLogger(name).removeFilter(_UNINFORMATIVE_FILTER)
    if downloads_shown:  # transformers' switch turns huggingface_hub's bars too; leave those as they were
        huggingface_hub.utils.enable_progress_bars()


def quiet_replicas(process_log_level: int, should_log: bool) -> None:
    """On a process that is not the main one of a distributed run, show vlfit's warnings only (the Trainer's
    ``--log_level_replica``), so N processes do not log every line N times."""
    if not should_log:
        logging.getLogger("vlfit").setLevel(max(process_log_level, logging.WARNING))


# Access records waiting for the writer thread: about 2 MB of records, seconds of the server's busiest rate.
QUEUE_RECORDS = 10_000
# At the process's end, how long the writer gets to write what is queued (a stalled output cannot hold the exit).
CLOSE_WAIT_S = 5.0


class BackgroundAccessLog(logging.handlers.QueueHandler):
    """A handler that hands each record to a thread of its own, which formats it and writes it to ``stream`` (why:
    ``vlfit.serve.access_log``): a ``QueueHandler`` whose records are formatted by its writer, not by the caller.

    Args:
        stream: Where the lines go (uvicorn's access log: standard output).
        maxsize: The most records waiting; more are dropped and counted (``dropped``).
    """

    def __init__(self, stream: IO[str] | None = None, maxsize: int = QUEUE_RECORDS) -> None:
        super().__init__(queue.Queue(maxsize))
        self.writer = logging.StreamHandler(stream)
        self.dropped = 0
        self._reported = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="vlfit-access-log", daemon=True)
        self._thread.start()

    def setFormatter(self, fmt: logging.Formatter | None) -> None:  # noqa: N802 - logging's name
        self.writer.setFormatter(fmt)  # the writer formats: dictConfig's "formatter" is its

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # formatted by the writer thread (QueueHandler's own would format it here, on the loop)

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self.dropped += 1

    def _run(self) -> None:
        while (record := self.queue.get()) is not None:
            with self._lock:
                dropped, self._reported = self.dropped - self._reported, self.dropped
            if dropped:
                self.writer.handle(logging.makeLogRecord({
                    "name": record.name, "levelno": logging.WARNING, "levelname": "WARNING",
                    "msg": "%d access log lines were dropped: the reader of the server's output did not keep up",
                    "args": (dropped,)}))  # fmt: skip
            self.writer.handle(record)

    def close(self) -> None:
        # At the process's end (logging.shutdown) or a new logging configuration: what is queued is written first.
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self.queue.put(None, timeout=CLOSE_WAIT_S)
            self._thread.join(CLOSE_WAIT_S)
        if not self._thread.is_alive():  # a writer stalled on its output is left to end with the process
            self.writer.flush()
        super().close()
