"""Errors turned into one line on stderr and an exit status, in one place.

A library error carries its exit status (the table in ``blockdiff.errors``);
the statuses given here are for what is not a blockdiff error: an OS error (1)
and an interrupt (130). Database errors arrive as blockdiff errors: the
database layer (``blockdiff.db``) turns SQLite's into them. Every command runs under
this handler, because the top-level group (:class:`ReportingGroup`) invokes
them all through it, option callbacks included.
"""

from __future__ import annotations

import errno
import sys
from typing import NoReturn

import click

_OS_HINTS = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check the file's permissions or run as a user who may access it",
    errno.EPERM: "check the file's permissions and attributes",
    errno.ENOSPC: "free some space or write to another filesystem",
    errno.EDQUOT: "free some space or raise the quota",
    errno.EROFS: "write to a writable filesystem",
    errno.EISDIR: "give a file, not a directory",
    errno.EXDEV: "put both files on one filesystem",
}


def fail(message: str, code: int) -> NoReturn:
    """End the command: ``blockdiff: error: MESSAGE`` on stderr, exit status CODE."""
    click.echo(f"blockdiff: error: {message}", err=True)
    sys.exit(code)


def report_errors(call, *args, **kwargs):
    """``call(*args, **kwargs)``, with library errors ending the process as
    one line on stderr and a non-zero exit status (click's own usage errors
    pass through to click)."""
    from blockdiff.errors import BlockdiffError

    try:
        return call(*args, **kwargs)
    except BlockdiffError as e:
        fail(str(e), e.exit_code)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        hint = _OS_HINTS.get(e.errno)
        fail(f"{e.strerror or e}{where}" + (f" ({hint})" if hint else ""), 1)
    except KeyboardInterrupt:
        fail("interrupted; nothing was left under the final name", 130)


class ReportingGroup(click.Group):
    """A click group that runs its subcommands (parsing their options, then
    the command itself) under :func:`report_errors`, so that no command can
    leave a library error to a traceback."""

    def invoke(self, ctx: click.Context):
        """Invoke the subcommand the arguments name, reporting its errors."""
        return report_errors(super().invoke, ctx)
