"""Progress of planning for people: one line when planning has taken a while, and one when it ends.

Lines go to the ``sublinear.progress`` logger at INFO. When the process has configured no logging, that logger
writes them to stderr itself; once logging is configured, they follow its levels and handlers like every other
record (at the default WARNING level they are not shown). To silence them:
``logging.getLogger("sublinear.progress").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["PROGRESS_AFTER_SECONDS", "PlanningProgress"]

PROGRESS_AFTER_SECONDS = 2.0  # planning shorter than this says nothing

log = logging.getLogger("sublinear.progress")


def _logger() -> logging.Logger:
    """The progress logger, writing to stderr when nothing else in the process would show its records."""
    if not log.handlers and not logging.getLogger().handlers and not logging.getLogger("sublinear").handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class PlanningProgress:
    """Planning of one model, from the first graph planned in a call to the call's end: :meth:`begin` at each
    graph planned (the first starts the clock), :meth:`end` when the call is over. The start line is said only
    once planning has run :data:`PROGRESS_AFTER_SECONDS`, and the end line only when the start line was."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._started: float | None = None
        self._timer: threading.Timer | None = None
        self._said = threading.Event()

    def begin(self) -> None:
        if self._started is not None:
            return
        self._started = time.perf_counter()
        self._said.clear()
        self._timer = threading.Timer(PROGRESS_AFTER_SECONDS, self._say_start)
        self._timer.daemon = True
        self._timer.start()

    def _say_start(self) -> None:
        self._said.set()
        _logger().info("sublinear: planning %s (capture, profile, search and compile of each graph) ...", self.what)

    def end(self, summary: Callable[[], str]) -> None:
        """Planning is over; ``summary()`` says what was planned (called only when the end line is said)."""
        if self._started is None:
            return
        self._timer.cancel()
        self._timer.join()  # a start line being said is said before the end line
        if self._said.is_set():
            _logger().info("sublinear: planned %s in %.1f s: %s", self.what, time.perf_counter() - self._started,
                           summary())
        self._started = self._timer = None
