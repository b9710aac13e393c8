"""How ``vlfit demo`` ends on SIGTERM or Ctrl-C outside training: at once, with one line saying what was kept and
the command that carries on, and exit ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a
process the signal ended.

Training has its own handling (``vlfit.training.preemption.PreemptionCallback``: finish the step, save, stop); it
takes the signals over while it trains and gives them back to ``StopSignals`` afterwards. Everywhere else (data
generation, setting up the run, the final evaluation) there is nothing worth finishing, so the signal raises
``DemoStopped`` in the main thread, as Ctrl-C raises ``KeyboardInterrupt``, and the code being left cleans up on the
way out: datasets' ``map`` terminates its generation workers, the loaders stop theirs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

import psutil

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)


class DemoStopped(BaseException):
    """A stop signal arrived outside training (a ``BaseException``, as ``KeyboardInterrupt``: no ``except Exception``
    on the way out takes it for an error to handle)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """While entered, SIGTERM and SIGINT raise ``DemoStopped`` in this process's main thread.

    A ``DemoStopped`` that Python drops because it was raised where exceptions cannot propagate (a finalizer, an
    at-fork callback such as logging's lock release as a loader forks its workers) is not printed as "Exception
    ignored ... Traceback" (``sys.unraisablehook``, while entered): ``raise_if_received`` raises it again where it
    can stop the demo. Every other unraisable exception is reported as before.

    Children forked meanwhile (datasets' generation workers, loader workers) inherit the handler; there it leaves
    the stop to this process: SIGINT (which Ctrl-C sends to every process of the terminal's group) is ignored, and
    SIGTERM (what a pool's ``terminate`` sends its workers) ends the child as it would have without the handler.
    Outside the main thread, entering does nothing.

    Attributes:
        received: The first stop signal received, or ``None``.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        self._pid = os.getpid()
        self._previous: dict[int, Any] = {}
        self._unraisable: Any = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
            self._unraisable, sys.unraisablehook = sys.unraisablehook, self._report_unraisable
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._unraisable is not None:
            sys.unraisablehook, self._unraisable = self._unraisable, None

    def _report_unraisable(self, unraisable: Any) -> None:
        """Python's report of an exception it drops, but for a ``DemoStopped`` (``raise_if_received`` raises it
        again)."""
        if not isinstance(unraisable.exc_value, DemoStopped):
            self._unraisable(unraisable)

    def raise_if_received(self) -> None:
        """Raise ``DemoStopped`` for a signal received whose exception got lost on the way out: one raised while
        a finalizer ran (a pool's or a temporary file's, during garbage collection) is printed as "Exception
        ignored" and dropped by Python, and the work went on."""
        if self.received is not None:
            raise DemoStopped(self.received)

    @property
    def exit_code(self) -> int:
        """``128 + signal``, what a shell reports for a process the signal ended (``received`` must be set)."""
        assert self.received is not None
        return 128 + self.received

    @staticmethod
    def end_children() -> None:
        """Send SIGTERM to the child processes still there once the stop has unwound. The code left behind stops
        its own (datasets' pools, loaders), except where the signal came as it started them: a pool interrupted
        while forking its workers leaves them waiting for work, each holding the pipe a new task would come
        through, so they would never end. (multiprocessing's resource tracker ignores SIGTERM and ends with this
        process.)"""
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.terminate()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child: the parent stops it
            if signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum
        raise DemoStopped(signum)
