"""How a long operation reports how far it has got, without printing.

The library's long operations (commit, restore, verify, export, import,
compact, building a VM image, booting a VM) take an optional ``progress``:
any object with the three methods of :class:`Progress`. The library calls it
in proportion to the real work (bytes read or written, build steps, boot
phases); what it shows, and where, is the caller's business (the CLI draws a
bar on a terminal). ``NO_PROGRESS``, the default, does nothing.

An operation announces each phase of its work with ``start`` (a phase that
starts ends the one before) and advances it by the amount done; the advances
of a phase add up to its total when the phase completes. Whoever made the
progress calls ``finish`` when the operation returns or fails (an operation
may be one phase of a longer one: a fork is a check, then a boot).
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """What a long operation reports its progress to."""

    def start(self, total: int, unit: str, what: str) -> None:
        """A phase of ``total`` units ("B" for bytes, "step", "phase") begins;
        ``what`` says what it does, for a person."""

    def advance(self, n: int) -> None:
        """``n`` more units of the current phase are done."""

    def finish(self) -> None:
        """The operation is over (done or failed); called by the progress's maker."""


class NoProgress:
    """A progress that ignores everything: the default."""

    def start(self, total: int, unit: str, what: str) -> None:
        """Ignored."""

    def advance(self, n: int) -> None:
        """Ignored."""

    def finish(self) -> None:
        """Ignored."""


NO_PROGRESS: Progress = NoProgress()


class Steps:
    """An operation made of ``count`` named steps (a build, a boot) reported to
    ``progress`` as one phase of one step each, "what (k/count)"."""

    def __init__(self, progress: Progress, count: int):
        self.progress = progress
        self.count = count
        self.number = 0
        self._open = False

    def begin(self, what: str) -> None:
        """The step before is done and step ``what`` begins."""
        self.end()
        self.number += 1
        self.progress.start(1, "step", f"{what} ({self.number}/{self.count})")
        self._open = True

    def end(self) -> None:
        """The current step is done (the last one, or one before a pause)."""
        if self._open:
            self.progress.advance(1)
            self._open = False
