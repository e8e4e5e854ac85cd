"""Progress bars for the long commands, on stderr, only for a person.

A command asks :func:`progress_bar` for the progress object it hands the
library. On a terminal (stderr is a TTY) and without ``--json`` that object
draws a bar (tqdm) per phase of the work: what the command is doing, the
bytes done of the total and the rate, or the step of a build or a boot.
Anywhere else (piped, redirected, a program reading ``--json``) it is the
library's no-op and nothing is drawn.
tqdm is imported only when a bar is drawn, and the library's protocol only
when a command runs, so that start-up stays quick.
"""

from __future__ import annotations

import contextlib
import sys


class TerminalProgress:
    """Draws the library's progress on stderr as a tqdm bar, one per phase,
    each named ``command: phase``; a finished phase's bar is cleared."""

    def __init__(self, command: str):
        self.command = command
        self._bar = None

    def start(self, total: int, unit: str, what: str) -> None:
        """Replace the current bar with one for the new phase (none for an
        empty one)."""
        from tqdm import tqdm

        self._close()
        if total <= 0:   # nothing to do in this phase (layers already vouched for)
            return
        if unit == "B":
            # SI prefixes (kB, MB), the ones tqdm's scaling names correctly.
            shape = dict(unit="B", unit_scale=True, unit_divisor=1000,
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B "
                                    "[{elapsed}<{remaining}, {rate_fmt}]")
        else:   # a step of a build or a boot, one blocking call: what it is
            shape = dict(unit=unit, bar_format="{desc} ...")
        self._bar = tqdm(total=total, desc=f"{self.command}: {what}", file=sys.stderr,
                         leave=False, dynamic_ncols=True, mininterval=0.1, **shape)

    def advance(self, n: int) -> None:
        """Move the current bar on."""
        if self._bar is not None:
            self._bar.update(n)

    def finish(self) -> None:
        """Clear the bar: the command's own output follows."""
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def progress_bar(command: str, *, as_json: bool = False):
    """The progress object for ``command`` (what the bar calls it, e.g.
    "commit"): a bar on stderr when stderr is a terminal and ``as_json`` is
    false, else the no-op. Finished when the block ends, however it ends."""
    if as_json or not sys.stderr.isatty():
        from blockdiff.progress import NO_PROGRESS

        yield NO_PROGRESS
        return
    progress = TerminalProgress(command)
    try:
        yield progress
    finally:
        progress.finish()
