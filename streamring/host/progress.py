"""Progress lines of a long job: rank 0 says, at least every ``progress_s`` seconds, what the job is doing.

A job (``runner.run_layer``, ``verify.stress.run_stress``) sets ``what`` on the object it is handed as it moves
from one step to the next (plain attribute writes: no import of this module below the host layer); a daemon
thread of rank 0 prints the current step and the time spent, on stderr, so the table on stdout stays the
report. Other ranks get a :class:`Heartbeat` that prints nothing.
"""

from __future__ import annotations

import sys
import threading
import time


class Heartbeat:
    """While entered, prints ``"{prefix}: {elapsed} s: {what}"`` every ``period_s`` seconds, the first after half
    of one (``period_s <= 0``: never), from a daemon thread. ``what`` is set by the job; a step's own elapsed
    time follows it when it has run for a whole period."""

    def __init__(self, prefix: str, period_s: float, file=None):
        self.prefix, self.period_s = prefix, float(period_s)
        self.file = file if file is not None else sys.stderr
        self._what, self._since = "starting", time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="streamring-progress", daemon=True)

    @property
    def what(self) -> str:
        return self._what

    @what.setter
    def what(self, text: str) -> None:
        self._what, self._since = text, time.monotonic()

    def _run(self) -> None:
        t0 = time.monotonic()
        # the first line after half a period: the job's start-up before this (the launcher, the ranks' imports)
        # then still fits in one period
        wait = self.period_s / 2
        while not self._stop.wait(wait):
            wait = self.period_s
            now = time.monotonic()
            step = now - self._since
            digits = 0 if self.period_s >= 1 else 1
            line = f"{self.prefix}: {now - t0:.{digits}f} s: {self._what}"
            if step >= self.period_s:
                line += f" (for {step:.{digits}f} s)"
            try:
                self.file.write(line + "\n")
                self.file.flush()
            except (OSError, ValueError):  # the stream went away: nothing to tell
                return

    def __enter__(self) -> "Heartbeat":
        if self.period_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> bool:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return False
