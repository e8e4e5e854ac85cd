"""The PostgreSQL implementation of :class:`~blockdiff.db.protocol.Database`
(psycopg 3), for the catalog several hosts share: one connection per process
shared by its threads, autocommit outside explicit transactions, the callers'
``?`` SQL turned into psycopg's, and psycopg's errors into blockdiff's.

Where it differs from SQLite, and why:

- Writers queue on an advisory lock. :meth:`PostgreSQLDatabase.transaction`
  takes a transaction-level advisory lock (``pg_advisory_xact_lock``) first
  thing, as ``BEGIN IMMEDIATE`` takes SQLite's write lock, so concurrent
  writers in any process on any host wait for each other instead of failing
  half-way or losing an update. The transaction is READ COMMITTED: each
  statement sees what the writer before committed (REPEATABLE READ would keep
  the snapshot taken before the lock was granted). The key is fixed per
  schema (a CRC of its name): the catalog, the agent records and the
  LangGraph checkpoints of one database each queue on their own, so that a
  transaction on one of them may write another (the LangGraph saver removes
  a store snapshot from inside its own transaction) without waiting for
  itself. With one key per database, that would wait for the lock timeout.
  A transaction idle for half the lock timeout is ended by the server
  (``idle_in_transaction_session_timeout``): a process stopped inside one
  (SIGSTOP, a paused VM) holds no other host's writers up past theirs.
- A schema per user. The three users have tables of the same name
  (``checkpoints``), so each opens the database with its own ``schema``
  (made when missing; the ``search_path`` of its connection).
- Lost connections. Outside a transaction a connection the server closed
  (a restart) is noticed before the next statement is sent and made again;
  a statement whose connection broke while it ran is run again only if it
  reads, a change raises ``DatabaseError`` (it may or may not have been
  applied). Inside a transaction the loss raises ``DatabaseError`` and the
  transaction is gone: nothing of it was committed (unless the loss came
  during COMMIT, which the message says).
- Secrets. :attr:`~PostgreSQLDatabase.name` is the URL without its secrets
  (:func:`~blockdiff.db.conninfo.public_url`); every message is scrubbed of
  the URL and its secrets (:func:`~blockdiff.db.conninfo.scrub`), whatever
  libpq put in it (its errors quote a URL it cannot read whole).
- Text is compared byte by byte. Every TEXT column of blockdiff's
  PostgreSQL DDL is ``COLLATE "C"``, SQLite's BINARY order, whatever the
  database's locale. Text cannot hold NUL characters (a ``DatabaseError``),
  and Python's bools are stored as the integers 0 and 1, as SQLite does.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import select
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from blockdiff.db.conninfo import ConninfoError, check_url, public_url, refusal, scrub
from blockdiff.db.protocol import ReadRows
from blockdiff.errors import ConstraintFailed, DatabaseError, UsageError

try:
    import psycopg
except ImportError:           # an optional extra: blockdiff[shared]
    psycopg = None

# Seconds to wait for the server to answer a new connection.
CONNECT_TIMEOUT = 10
# Seconds a statement waits for a lock another connection holds (the
# advisory lock of a transaction, a row) before DatabaseError, as SQLite's.
LOCK_TIMEOUT = 60.0
# The first half of every advisory lock key blockdiff takes ("bdif"): keeps
# them apart from other programs' locks on the same database.
_LOCK_CLASS = 0x62646966
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# A server that vanished without closing the connection (a partition, a host
# that died) is noticed within about a minute instead of never: TCP
# keepalives while idle, and a bound on unacknowledged writes.
_DEAD_PEER = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
              "keepalives_count": 3, "tcp_user_timeout": 60_000}
# Seconds between attempts to connect again to a server that is restarting.
_RECONNECT_PAUSE = 0.2
# How many times an idle connection's input is read before a statement: a
# server that closed it sent a message and the end of the stream.
_IDLE_READS = 4
# Statements that only read, which may run again after a lost connection.
_READ = re.compile(r"\s*(SELECT|WITH)\b", re.IGNORECASE)
_CHANGE = re.compile(r"\b(INSERT|UPDATE|DELETE|MERGE)\b", re.IGNORECASE)


def _secrets_of(url: str) -> list[str]:
    """Secrets a message about ``url`` must never show besides the URL's
    own (:func:`~blockdiff.db.conninfo.scrub` finds those): the environment's."""
    return [os.environ.get(name, "") for name in ("PGPASSWORD", "PGSSLPASSWORD")]


@functools.lru_cache(maxsize=2048)
def to_psycopg(sql: str) -> str:
    """``sql`` with ``?`` placeholders in psycopg's style: ``%s``, and every
    literal ``%`` doubled (the callers' SQL has no literal ``?``)."""
    return sql.replace("%", "%%").replace("?", "%s")


def open_postgresql(url: str, *, schema: str | None = None,
                    connect_timeout: float = CONNECT_TIMEOUT, timeout: float = LOCK_TIMEOUT,
                    readonly: bool = False) -> PostgreSQLDatabase:
    """Connect to the PostgreSQL database ``url`` (credentials from the URL
    or libpq's environment: ``PGPASSWORD``, ``~/.pgpass``, ``PGPASSFILE``).
    ``schema``: the schema its tables are in, made if missing (None: the
    server's default, usually ``public``). ``connect_timeout``: seconds to
    wait for the server; ``timeout``: seconds a statement waits for another
    connection's lock before DatabaseError; ``readonly``: every transaction
    only reads (nor is a missing schema made)."""
    if psycopg is None:
        raise DatabaseError(f"cannot open {public_url(url)}: psycopg is not installed "
                            f"(pip install 'blockdiff[shared]')")
    try:
        check_url(url)
    except ConninfoError as e:
        raise UsageError(refusal(url, e)) from None
    if schema is not None and not _SCHEMA_NAME.fullmatch(schema):
        raise UsageError(f"{schema!r} is not a schema name blockdiff uses: lower-case letters, "
                         f"digits and _, at most 63, not starting with a digit")
    db = PostgreSQLDatabase(url, schema=schema, connect_timeout=connect_timeout,
                            timeout=timeout, readonly=readonly)
    if schema is not None and not readonly:
        try:
            db._make_schema()
        except BaseException:
            db.close()
            raise
    return db


class PostgreSQLDatabase:
    """A connection to one PostgreSQL database (made by :func:`open_postgresql`),
    usable from any thread: :attr:`lock` keeps one thread's transaction
    whole, and every statement takes it, so that another thread's statement
    never runs inside a transaction it is not part of."""

    dialect = "postgresql"

    def __init__(self, url: str, *, schema: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT, timeout: float = LOCK_TIMEOUT,
                 readonly: bool = False):
        self._url = url
        self._secrets = _secrets_of(url)
        self.schema = schema
        self.name = public_url(url) + (f" (schema {schema})" if schema else "")
        self.lock = threading.RLock()
        self._connect_timeout = max(1, round(connect_timeout))
        self._lock_timeout_ms = max(1, round(timeout * 1000))
        self._idle_timeout_ms = max(1, self._lock_timeout_ms // 2)
        self._readonly = readonly
        # Advisory lock key: fixed per schema (see the module's notes).
        self._lock_key = (_LOCK_CLASS, _signed32(zlib.crc32((schema or "").encode())))
        self._closed = False
        # None outside a transaction; "open" inside one; "lost" once its
        # connection broke (every statement until its end fails).
        self._transaction: str | None = None
        self._connection = None
        self._connection = self._connect()

    def __repr__(self) -> str:
        return f"<PostgreSQLDatabase {self.name}>"

    # ------------------------------------------------------------ connection

    def _connect(self, *, patient: bool = False):
        """A new connection. ``patient``: the server is coming back (the
        last connection was lost), so a server that refuses connections is
        tried again for up to the connect timeout before DatabaseError."""
        # A transaction left idle longer than half the lock timeout is ended
        # by the server: a process stopped inside one (SIGSTOP, a paused VM,
        # a host swapping) would otherwise hold the advisory lock, and every
        # writer on every host would fail once its lock timeout ran out. The
        # stopped process finds its transaction gone when it wakes, and
        # nothing of it committed. No transaction of blockdiff's waits
        # between statements (no transfer or file work runs inside one).
        options = (f"-c lock_timeout={self._lock_timeout_ms} -c "
                   f"idle_in_transaction_session_timeout={self._idle_timeout_ms}")
        if self.schema:
            options += f" -c search_path={self.schema}"
        if self._readonly:
            options += " -c default_transaction_read_only=on"
        deadline = time.monotonic() + (self._connect_timeout if patient else 0)
        while True:
            # The errors are raised outside the handlers: psycopg's, which may
            # quote the URL (a malformed one, password and all), are dropped,
            # not kept as the context of blockdiff's.
            try:
                return psycopg.connect(self._url, autocommit=True,
                                       connect_timeout=self._connect_timeout,
                                       options=options, application_name="blockdiff",
                                       **_DEAD_PEER)
            except psycopg.ProgrammingError as e:     # libpq could not read the URL
                error, passing = UsageError(f"{self.name} is not a database URL libpq "
                                            f"accepts ({self._one_line(e)})"), False
            except psycopg.Error as e:
                error, passing = self._connect_failure(e)
            if not (passing and time.monotonic() < deadline):
                raise error
            time.sleep(_RECONNECT_PAUSE)

    def _connect_failure(self, error) -> tuple[DatabaseError, bool]:
        """The error for a connection refused (credentials, no such database,
        no server) and whether it is the last, which may pass. libpq gives
        no code for these, so its (English) text tells them apart; a text in
        another language is reported as it is, as no server."""
        reason = self._one_line(error)
        lowered = reason.lower()
        if "password" in lowered or "authentication" in lowered or (
                "role" in lowered and "does not exist" in lowered):
            return DatabaseError(f"the database server of {self.name} refused the credentials "
                                 f"({reason}); check the user and the password (in the URL, "
                                 f"PGPASSWORD or ~/.pgpass)"), False
        if "database" in lowered and "does not exist" in lowered:
            return DatabaseError(f"there is no database {self.name} ({reason}); create it "
                                 f"(createdb) or correct the URL"), False
        return DatabaseError(f"cannot connect to the database {self.name} ({reason}); check "
                             f"that its server runs and that this host can reach it"), True

    def _one_line(self, error) -> str:
        """psycopg's message, on one line, without any secret."""
        text = scrub(str(error), self._url, self._secrets)
        text = text.removeprefix("connection failed: ")
        return " ".join(text.split()).rstrip(".")

    def _alive_connection(self):
        """The connection, made again if the server closed it since the last
        statement (a restart). Only outside a transaction."""
        connection = self._connection
        if self._closed:
            return connection        # psycopg refuses it: misuse, as SQLite's
        # An idle connection has nothing to read, unless the server sent a
        # notice or said goodbye (its FATAL message, then the end of the
        # stream, which libpq sees only on the read after): consuming the
        # input while there is some tells which.
        for _ in range(_IDLE_READS):
            if connection is None or connection.closed:
                break
            pgconn = connection.pgconn
            try:
                if not select.select([pgconn.socket], [], [], 0)[0]:
                    break
                pgconn.consume_input()
            except (OSError, ValueError, psycopg.OperationalError):
                break
        if connection is None or connection.closed or connection.broken:
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.close()
            self._connection = None
            self._connection = connection = self._connect(patient=True)
        return connection

    def _make_schema(self) -> None:
        exists = ("SELECT 1 FROM pg_namespace WHERE nspname = ?", (self.schema,))
        if self.execute(*exists).fetchone() is None:
            with self.transaction():
                # Under the schema's lock: two processes making it at once
                # would otherwise collide on its name.
                if self.execute(*exists).fetchone() is None:
                    self.execute(f'CREATE SCHEMA "{self.schema}"')

    # ------------------------------------------------------------ statements

    def execute(self, sql: str, params: Sequence[Any] = ()) -> ReadRows:
        """Run one statement; see :meth:`Database.execute`."""
        params = _adapted(params)
        with self.lock:
            cursor = self._run(lambda c: c.execute(to_psycopg(sql), params),
                               retry=_is_read(sql))
            return ReadRows(cursor.fetchall() if cursor.description is not None else [])

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        """Run one statement for each row of parameters (pipelined)."""
        rows = [_adapted(row) for row in rows]
        if not rows:
            return
        with self.lock:
            self._run(lambda c: c.cursor().executemany(to_psycopg(sql), rows), retry=False)

    def insert(self, sql: str, params: Sequence[Any], key: str) -> int:
        """Run one INSERT; the new row's ``key``, by ``RETURNING``."""
        return self.execute(f"{sql} RETURNING {key}", params).fetchone()[0]

    def _run(self, statement, *, retry: bool):
        """``statement(connection)``, with psycopg's errors turned into
        blockdiff's, and the connection made again where that is safe."""
        if self._transaction == "lost":
            raise DatabaseError(f"the connection to {self.name} was lost during this "
                                f"transaction; nothing of it was committed")
        in_transaction = self._transaction is not None
        connection = self._connection if in_transaction else self._alive_connection()
        try:
            return statement(connection)
        except psycopg.Error as e:
            if self._closed or not _lost(connection, e):
                self._raise_translated(e)
            reason = self._one_line(e)
        if in_transaction:
            self._transaction = "lost"
            raise DatabaseError(f"lost the connection to {self.name} during a transaction "
                                f"({reason}); nothing of it was committed: try again")
        if retry:
            try:
                return statement(self._alive_connection())
            except psycopg.Error as e:
                self._raise_translated(e)
        raise DatabaseError(f"lost the connection to {self.name} while it made a change "
                            f"({reason}); whether the change was made is unknown: check, "
                            f"then try again")

    def _raise_translated(self, error):
        translated = self._translate(error)
        if translated is error:
            raise error
        raise translated from error

    def _translate(self, error) -> Exception:
        """The blockdiff error for psycopg's ``error``; misuse of psycopg (a
        wrong number of parameters, a closed connection) as it is."""
        sqlstate = getattr(error, "sqlstate", None) or ""
        reason = self._one_line(error)
        if not sqlstate and isinstance(error, (psycopg.ProgrammingError,
                                               psycopg.InterfaceError)):
            return error
        if self._closed:
            return error
        if sqlstate.startswith("23"):         # integrity constraint violation
            return ConstraintFailed(f"{self.name}: {reason}")
        if sqlstate == "53100":               # disk full
            return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} on the database "
                                         f"server ({reason})", self.name)
        if sqlstate == "55P03":               # lock not available
            return DatabaseError(f"{self.name} is locked: another connection held it for "
                                 f"more than {self._lock_timeout_ms / 1000:g} s ({reason}); "
                                 f"try again when it is done")
        if sqlstate.startswith("28"):         # invalid authorization
            return self._connect_failure(error)[0]
        if not sqlstate and isinstance(error, psycopg.OperationalError):
            return DatabaseError(f"the database {self.name} cannot be reached ({reason}); "
                                 f"check that its server runs, then try again")
        return DatabaseError(f"{self.name}: {reason}")

    # ---------------------------------------------------------- transactions

    def transaction(self):
        """BEGIN, the schema's advisory lock, ... COMMIT; ROLLBACK if the block
        raises. Nested: DatabaseError."""
        # One round trip for both (the key is ours, two integers).
        return self._block("BEGIN ISOLATION LEVEL READ COMMITTED; "
                           "SELECT pg_advisory_xact_lock(%d, %d)" % self._lock_key)

    def reading(self):
        """BEGIN REPEATABLE READ, READ ONLY ... COMMIT: every read of the
        block sees the state of its first."""
        return self._block("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")

    @contextlib.contextmanager
    def _block(self, begin: str):
        """A transaction opened by ``begin``, under the lock: COMMIT at the
        end, ROLLBACK if the block raises."""
        with self.lock:
            self._begin(begin)
            try:
                yield self
            except BaseException:
                self._end("ROLLBACK")
                raise
            self._end("COMMIT")

    def _begin(self, command: str) -> None:
        """Run ``command`` (SQL without parameters: BEGIN and what goes with
        it) to open a transaction."""
        if self._transaction is not None:
            raise DatabaseError(f"{self.name}: a transaction is open already in this "
                                f"process; transactions do not nest")
        try:
            # Nothing is done before the transaction begins: safe to run again.
            self._run(lambda c: c.execute(command), retry=True)
        except BaseException:
            # BEGIN may have passed and the lock not (its timeout, Ctrl-C).
            with contextlib.suppress(psycopg.Error):
                if self._connection is not None and not self._connection.closed:
                    self._connection.execute("ROLLBACK")
            raise
        self._transaction = "open"

    def _end(self, command: str) -> None:
        lost = self._transaction == "lost"
        self._transaction = None
        if lost:
            if command == "COMMIT":
                raise DatabaseError(f"the connection to {self.name} was lost during the "
                                    f"transaction; nothing of it was committed")
            return
        if command == "ROLLBACK":
            # After a failure the connection may be gone too: nothing to undo then.
            with contextlib.suppress(psycopg.Error):
                self._connection.execute("ROLLBACK")
            return
        self._transaction = "committing"
        try:
            self._run(lambda c: c.execute("COMMIT"), retry=False)
        except DatabaseError as e:
            if self._transaction == "lost":
                raise DatabaseError(f"lost the connection to {self.name} while committing: "
                                    f"whether the change was made is unknown; check, then "
                                    f"try again") from e
            raise
        finally:
            self._transaction = None

    # ------------------------------------------------------------- the rest

    def tables(self) -> set[str]:
        """The names of the tables of the schema in use."""
        return {name for (name,) in self.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}

    def integrity_problems(self) -> list[str]:
        """What PostgreSQL can report without reading every page: indexes of
        the schema left invalid (a CREATE INDEX CONCURRENTLY that failed) and
        constraints not validated. It does not check the table and index
        pages (amcheck needs an extension and superuser rights), and foreign
        keys need no check: the server enforces them on every change."""
        problems = [f"index {name} is invalid" for (name,) in self.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relnamespace = current_schema()::regnamespace "
            "AND NOT (i.indisvalid AND i.indisready) ORDER BY c.relname")]
        problems += [f"constraint {name} of {table} is not validated"
                     for name, table in self.execute(
                         "SELECT conname, conrelid::regclass::text FROM pg_constraint "
                         "WHERE connamespace = current_schema()::regnamespace "
                         "AND NOT convalidated ORDER BY conname")]
        return problems

    def close(self) -> None:
        """Close the connection, once no thread is in a transaction."""
        with self.lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close()


def _adapted(params: Sequence[Any]) -> tuple:
    """Parameters as PostgreSQL takes them: a bool as the integer 0 or 1, as
    SQLite keeps it (the schemas have INTEGER flags, no BOOLEAN columns)."""
    return tuple(int(p) if isinstance(p, bool) else p for p in params)


def _is_read(sql: str) -> bool:
    return bool(_READ.match(sql)) and not _CHANGE.search(sql)


def _lost(connection, error) -> bool:
    """Whether ``error`` came with the loss of the connection."""
    sqlstate = getattr(error, "sqlstate", None) or ""
    return (connection.closed or connection.broken or sqlstate.startswith("08")
            or sqlstate in ("57P01", "57P02", "57P03"))


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value
