"""Errors safe to show a user, each with its own exit code.

Library code raises these (or ``OSError`` with errno and path); only the CLI
turns them into one line on stderr and an exit status. Anything else escaping
the library is a bug and keeps its traceback.
"""

from __future__ import annotations


class BlockdiffError(Exception):
    """Something the user can fix; the message says what and how."""

    exit_code = 1


class UsageError(BlockdiffError):
    """The arguments do not make sense together."""

    exit_code = 2


class InvalidDiff(BlockdiffError):
    """A diff file is not well formed: wrong magic, truncated, bad ranges."""

    exit_code = 3


class ChecksumMismatch(InvalidDiff):
    """A diff's header or data does not match its checksum: it is corrupt."""


class WrongBase(BlockdiffError):
    """The base given to apply is not the one the diff was made against."""

    exit_code = 4


class Unsupported(BlockdiffError):
    """The file or filesystem is in a state the engine refuses to guess about."""

    exit_code = 5
