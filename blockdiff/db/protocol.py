"""What every database implementation offers (see the package docstring for
the rules its SQL follows)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

from blockdiff.errors import DatabaseDamaged


class Rows(Protocol):
    """The result of one statement; errors while reading it are blockdiff's."""

    def fetchone(self) -> tuple | None:
        """The next row, or None after the last."""

    def fetchall(self) -> list[tuple]:
        """Every row not read yet."""

    def __iter__(self) -> Iterator[tuple]:
        """The rows not read yet."""


class ReadRows:
    """:class:`Rows` read in full while the statement ran, under the
    database's lock: nothing is left to read from the connection after."""

    __slots__ = ("_rows", "_next")

    def __init__(self, rows: list[tuple]):
        self._rows = rows
        self._next = 0

    def fetchone(self) -> tuple | None:
        """The next row, or None."""
        if self._next >= len(self._rows):
            return None
        self._next += 1
        return self._rows[self._next - 1]

    def fetchall(self) -> list[tuple]:
        """The rows not read yet."""
        rows, self._next = self._rows[self._next:], len(self._rows)
        return rows

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.fetchall())


class Database(Protocol):
    """One connection to a database, shared by the threads of a process."""

    name: str
    """What messages call the database: a file's path, a server's URL
    without its password."""

    dialect: str
    """``"sqlite"`` or ``"postgresql"``: which DDL its migrations are
    written in."""

    lock: contextlib.AbstractContextManager
    """Held by :meth:`transaction` and :meth:`reading`; a caller that wants a
    few statements outside a transaction not to interleave with another
    thread's takes it too (it is reentrant)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        """Run one statement with ``?`` placeholders."""

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement once for each row of parameters."""

    def insert(self, sql: str, params: Sequence[Any], key: str) -> int:
        """Run one INSERT and return the integer ``key`` the database gave the
        new row (SQLite: its rowid; PostgreSQL: ``RETURNING key``)."""

    def transaction(self) -> contextlib.AbstractContextManager[Database]:
        """One atomic change, holding the write lock from its start so that
        concurrent writers queue instead of failing half-way; committed when
        the block ends, rolled back if it raises. Transactions do not nest."""

    def reading(self) -> contextlib.AbstractContextManager[Database]:
        """Several reads that see one state of the database, whatever other
        connections commit meanwhile."""

    def tables(self) -> set[str]:
        """The names of the tables the database has."""

    def integrity_problems(self) -> list[str]:
        """What the database's own consistency checks report (SQLite: pages,
        indexes, foreign keys; PostgreSQL: invalid indexes, constraints not
        validated); empty when it is sound."""

    def close(self) -> None:
        """Close the connection (after any transaction another thread has open)."""


def damaged(name: str, reason: str) -> DatabaseDamaged:
    """The error for a database that is not the one it should be, and why."""
    return DatabaseDamaged(f"{name} is damaged ({reason})")
