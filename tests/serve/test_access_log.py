"""The access log's lines are formatted and written by a thread of their own (``vlfit.logs.BackgroundAccessLog``, on
uvicorn's access logger by ``vlfit.serve.access_log``): in order, all of them at the end, and a stalled output never
holds the caller: it drops and counts, and says so."""

from __future__ import annotations

import io
import logging
import logging.config
import threading
import time

from vlfit.logs import BackgroundAccessLog
from vlfit.serve.access_log import ACCESS_LOGGER, log_config


class StalledStream(io.StringIO):
    """An output whose reader has stopped: every write waits until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def write(self, text: str) -> int:
        self.go.wait(timeout=30)
        return super().write(text)


def _logger(handler: logging.Handler) -> logging.Logger:
    logger = logging.getLogger("tests.access_log")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_lines_are_formatted_by_the_writer_in_order_and_all_written_at_close() -> None:
    stream = io.StringIO()
    handler = BackgroundAccessLog(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = _logger(handler)
    for number in range(500):
        logger.info('127.0.0.1 - "GET /api/search?q=%d HTTP/1.1" 200', number)
    handler.close()
    lines = stream.getvalue().splitlines()
    assert lines == [f'INFO 127.0.0.1 - "GET /api/search?q={n} HTTP/1.1" 200' for n in range(500)]
    assert handler.dropped == 0


def test_a_stalled_output_never_holds_the_caller_and_the_dropped_lines_are_counted_in_the_log() -> None:
    stream = StalledStream()
    handler = BackgroundAccessLog(stream, maxsize=100)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = _logger(handler)
    started = time.monotonic()
    for number in range(1000):
        logger.info("request %d", number)
    assert time.monotonic() - started < 5  # the writer waits on the output; the caller did not
    assert 1000 - 101 <= handler.dropped <= 1000 - 100  # a queue of 100, one more in the writer's hands
    stream.go.set()
    deadline = time.monotonic() + 10
    while not handler.queue.empty() and time.monotonic() < deadline:  # the reader caught up
        time.sleep(0.01)
    logger.info("request after")
    handler.close()
    lines = stream.getvalue().splitlines()
    said = " access log lines were dropped: the reader of the server's output did not keep up"
    reports = [int(line.removesuffix(said)) for line in lines if line.endswith(said)]
    assert reports and sum(reports) == handler.dropped  # each drop said once, when the writer wrote again
    assert lines[-1] == "request after" and len(lines) - len(reports) == 1000 - handler.dropped + 1


def test_uvicorns_access_logger_gets_the_background_writer_and_keeps_the_redaction() -> None:
    config = log_config()
    assert config["handlers"]["access"]["()"].endswith("BackgroundAccessLog")
    logging.config.dictConfig(config)
    try:
        handler = logging.getLogger(ACCESS_LOGGER).handlers[0]
        assert isinstance(handler, BackgroundAccessLog)
        stream = io.StringIO()
        handler.writer.setStream(stream)
        logging.getLogger(ACCESS_LOGGER).info(
            '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5", "GET", "/api/search?q=cat&api_key=s3cret", "1.1", 200
        )
        handler.close()
        assert "api_key=REDACTED" in stream.getvalue() and "s3cret" not in stream.getvalue()
    finally:
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
