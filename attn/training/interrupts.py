"""Stopping a run without losing it: Ctrl-C (SIGINT) and SIGTERM (a scheduler, ``timeout``, a
closed terminal) both ask the training loop to stop at the next step boundary, where the
checkpoint is written from a consistent state; the command then exits with the status a shell
expects of a process ended by that signal (128 + its number: 130 and 143), so a script or a
scheduler sees that the run did not finish, and says how to resume it. A second signal aborts
at once without saving.

Before the loop (reading the corpus, learning the vocabulary) there is nothing to save:
:func:`abort_on_signals` turns either signal into :class:`Interrupted` at once.
"""
from __future__ import annotations

import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """What a shell reports for a process that a signal ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal before it could save (``signum``: which one)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def _install(handler) -> dict:
    """``handler`` for SIGINT and SIGTERM; returns the previous handlers (none off the main thread,
    where signals cannot be caught: the defaults stay)."""
    old = {}
    for sig in SIGNALS:
        try:
            old[sig] = signal.signal(sig, handler)
        except ValueError:
            break
    return old


def _restore(old: dict) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


class StopSignals:
    """Inside ``with StopSignals(say) as stop:``, the first SIGINT or SIGTERM sets ``stop.requested``
    and ``stop.signum`` for the loop to check between steps, and ``say`` tells the user what will
    happen; a second one raises :class:`Interrupted`."""

    def __init__(self, say=lambda message: print(message, file=sys.stderr)):
        self.requested = False
        self.signum: int | None = None
        self._say = say
        self._old: dict = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def __enter__(self):
        def handler(signum, frame):
            if self.requested:
                raise Interrupted(signum)
            self.requested, self.signum = True, signum
            self._say(f"\n{signal.Signals(signum).name}: finishing this step, saving a checkpoint, then exiting "
                      "(send it again to abort without saving)")
        self._old = _install(handler)
        return self

    def __exit__(self, *exc):
        _restore(self._old)
        return False


class abort_on_signals:
    """Inside ``with abort_on_signals():``, SIGINT and SIGTERM raise :class:`Interrupted` at once."""

    def __enter__(self):
        def handler(signum, frame):
            raise Interrupted(signum)
        self._old = _install(handler)
        return self

    def __exit__(self, *exc):
        _restore(self._old)
        return False
