"""The SQLite implementation of :class:`~blockdiff.db.protocol.Database`: one
file, WAL, synchronous=FULL, one connection per process shared by its threads."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from blockdiff.db.protocol import ReadRows, damaged
from blockdiff.errors import ConstraintFailed, DatabaseError

# Seconds a statement waits for another connection to release its lock.
TIMEOUT = 60.0
CREATE_MODES = ("missing", "new", "never")

# SQLite's primary result codes that tell which blockdiff error a failure is.
_BUSY, _LOCKED, _CORRUPT, _FULL, _CONSTRAINT, _NOTADB = 5, 6, 11, 13, 19, 26
# Python 3.10's exceptions carry no code: their messages are SQLite's own
# text for each code.
_CODE_MESSAGES = {
    "database is locked": _BUSY,
    "database table is locked": _LOCKED,
    "database disk image is malformed": _CORRUPT,
    "database or disk is full": _FULL,
    "file is not a database": _NOTADB,
}


def create_private(path: str | os.PathLike, mode: int = 0o600, *,
                   exclusive: bool = False) -> None:
    """Make an empty ``path`` with ``mode`` (less the umask) unless it exists
    (``exclusive``: FileExistsError if it does). SQLite makes a new database
    0644 and gives its -wal and -shm files the database's own mode, so a
    database file made here first stays private, and all that goes with it.
    An existing file keeps its mode."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, mode)
    except FileExistsError:
        if exclusive:
            raise
        return
    os.close(fd)


def connect(path: str | os.PathLike, *, create: str = "missing", mode: int = 0o600,
            foreign_keys: bool = False, secure_delete: bool = False,
            readonly: bool = False, timeout: float = TIMEOUT) -> SQLiteDatabase:
    """Open the SQLite database ``path``, in WAL mode with synchronous=FULL.

    ``create``: ``"missing"`` makes the file (private, with ``mode``) if there
    is none; ``"new"`` makes it and refuses one that exists (FileExistsError);
    ``"never"`` wants a database there already (FileNotFoundError, or
    DatabaseDamaged for an empty file). ``foreign_keys`` enforces REFERENCES;
    ``secure_delete`` zeroes what a change frees instead of leaving it in free
    pages. ``readonly`` opens an existing database without writing anything,
    its settings as they are. ``timeout``: seconds a statement waits for
    another connection's lock before DatabaseError."""
    name = str(path)
    translating = _Translating(name, timeout)
    if readonly:
        target, uri = Path(path).absolute().as_uri() + "?mode=ro", True
    else:
        target, uri = name, False
        if create not in CREATE_MODES:
            raise ValueError(f"create must be one of {', '.join(CREATE_MODES)}, not {create!r}")
        if create == "never":
            # SQLite takes an empty file for an empty database: a truncated
            # one would pass for a database with nothing in it yet.
            if os.stat(path).st_size == 0:
                raise damaged(name, "the file is empty")
        else:
            create_private(path, mode, exclusive=create == "new")
    with translating:
        connection = sqlite3.connect(target, timeout=timeout, isolation_level=None,
                                     check_same_thread=False, uri=uri)
    try:
        with translating:
            if secure_delete:
                connection.execute("PRAGMA secure_delete=ON")
            if not readonly:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA synchronous=FULL")
            if foreign_keys:
                connection.execute("PRAGMA foreign_keys=ON")
    except BaseException:
        connection.close()
        raise
    return SQLiteDatabase(connection, name, translating)


@contextlib.contextmanager
def immediate_transaction(connection: sqlite3.Connection):
    """BEGIN IMMEDIATE ... COMMIT on a bare connection, or ROLLBACK on error:
    writers queue on SQLite's lock at the start instead of failing half-way.
    SQLite's errors pass as they are (:meth:`SQLiteDatabase.transaction`
    turns them into blockdiff's)."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield connection
        connection.execute("COMMIT")
    except BaseException:
        # Also after a failed COMMIT (a full disk), which can leave the
        # transaction open.
        if connection.in_transaction:
            connection.execute("ROLLBACK")
        raise


class SQLiteDatabase:
    """A connection to one SQLite file (made by :func:`connect`), usable from
    any thread: :attr:`lock` keeps one thread's transaction whole."""

    dialect = "sqlite"

    def __init__(self, connection: sqlite3.Connection, name: str,
                 translating: _Translating):
        self._connection = connection
        self._translating = translating
        self.name = name
        self.lock = threading.RLock()

    # Every use of the connection holds the lock: a statement of another
    # thread would otherwise run inside a transaction open on the shared
    # connection, and Python's sqlite3 crashes the process when the
    # connection is closed while another thread steps a statement on it.

    def execute(self, sql: str, params: Sequence[Any] = ()) -> ReadRows:
        """Run one statement; see :meth:`Database.execute`. Its rows are
        read at once, as PostgreSQL's are."""
        with self.lock, self._translating:
            return ReadRows(self._connection.execute(sql, params).fetchall())

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement for each row of parameters."""
        with self.lock, self._translating:
            self._connection.executemany(sql, rows)

    def insert(self, sql: str, params: Sequence[Any], key: str) -> int:
        """Run one INSERT; the new row's ``key``, the table's INTEGER PRIMARY
        KEY, which is SQLite's rowid."""
        with self.lock, self._translating:
            return self._connection.execute(sql, params).lastrowid

    @contextlib.contextmanager
    def transaction(self):
        """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK if the block raises."""
        with self.lock, self._translating, immediate_transaction(self._connection):
            yield self

    @contextlib.contextmanager
    def reading(self):
        """BEGIN (deferred: no lock until the first read) ... COMMIT."""
        with self.lock, self._translating:
            self._connection.execute("BEGIN")
            try:
                yield self
            finally:
                self._connection.execute("COMMIT")

    def tables(self) -> set[str]:
        """The names of the file's tables."""
        return {name for (name,) in self.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}

    def integrity_problems(self) -> list[str]:
        """What PRAGMA integrity_check and foreign_key_check report."""
        problems = [row[0] for row in self.execute("PRAGMA integrity_check") if row[0] != "ok"]
        problems += [f"dangling reference in {row[0]}"
                     for row in self.execute("PRAGMA foreign_key_check")]
        return problems

    def close(self) -> None:
        """Close the connection, once no other thread uses it; a statement
        after is refused (sqlite3.ProgrammingError)."""
        with self.lock:
            self._connection.close()


class _Translating:
    """A context that turns SQLite's errors about a database into blockdiff's
    (a class, not a generator: it wraps every statement)."""

    __slots__ = ("name", "timeout")

    def __init__(self, name: str, timeout: float):
        self.name = name
        self.timeout = timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        # ProgrammingError and InterfaceError are misuse of the module (a
        # closed connection, a wrong number of parameters): bugs, left as they are.
        if (kind is not None and issubclass(kind, sqlite3.DatabaseError)
                and not issubclass(kind, sqlite3.ProgrammingError)):
            raise translate(error, self.name, self.timeout) from error
        return False


def translate(error: sqlite3.DatabaseError, name: str, timeout: float = TIMEOUT) -> Exception:
    """The blockdiff error for SQLite's ``error`` about database ``name``: no
    room on its filesystem (OSError ENOSPC), DatabaseDamaged,
    ConstraintFailed, or DatabaseError (locked for more than ``timeout``
    seconds, and the rest)."""
    code = _result_code(error)
    # A full disk shows in many ways (a -shm file that cannot grow, a write
    # that fails); the filesystem tells which.
    if code == _FULL or (code not in (_BUSY, _LOCKED, _CONSTRAINT) and _out_of_space(name)):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
    if code in (_CORRUPT, _NOTADB):
        return damaged(name, str(error))
    if code == _CONSTRAINT:
        return ConstraintFailed(f"{name}: {error}")
    if code in (_BUSY, _LOCKED):
        return DatabaseError(f"{name} is locked: another process held it for more than "
                             f"{timeout:g} s ({error}); try again when it is done")
    return DatabaseError(f"{name}: {error}")


def _result_code(error: sqlite3.DatabaseError) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)      # Python 3.11 and later
    if code is not None:
        return code & 0xFF
    if isinstance(error, sqlite3.IntegrityError):
        return _CONSTRAINT
    return _CODE_MESSAGES.get(str(error))


def _out_of_space(path: str) -> bool:
    """Whether the filesystem holding ``path`` has no room for SQLite's files."""
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 1024
