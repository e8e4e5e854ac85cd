"""The database layer: one way to open a database, run a transaction and
migrate a schema, for every database blockdiff keeps (the store's catalog,
the agent records, the LangGraph checkpoints), on SQLite (the embedded
default, one host) or PostgreSQL (a catalog several hosts share).

Opening. ``open_database(target, **options)`` opens either kind: a
``postgresql://`` or ``postgres://`` URL with :func:`open_postgresql`, any
other target as a SQLite file with :func:`connect`; each kind takes its own
options and ignores the other's (:func:`open_database` says which).

- ``connect(path, ...)`` opens a SQLite file as a
  :class:`~blockdiff.db.sqlite.SQLiteDatabase`: the file made private if it
  is new (``mode``, 0600 by default; a group store passes its ``file_mode``,
  and SQLite gives the -wal and -shm files the same), WAL,
  synchronous=FULL, a 60 s wait for another process's lock, autocommit
  outside explicit transactions, foreign keys and secure_delete where asked.
- ``open_postgresql(url, schema=..., ...)`` connects with psycopg 3 as a
  :class:`~blockdiff.db.postgresql.PostgreSQLDatabase`: credentials from the
  URL or libpq's environment (``PGPASSWORD``, ``~/.pgpass``, ``PGPASSFILE``),
  a 10 s connect timeout, a 60 s wait for another connection's lock,
  autocommit outside explicit transactions, the tables in ``schema`` (made
  if missing). The three users each take a schema of their own (their
  migration group's name: ``catalog``, ``agent``, ``langgraph``), since the
  agent records and the LangGraph checkpoints both have a ``checkpoints``
  table. :func:`public_url` is a URL without its secrets, for display and storage
  (:mod:`blockdiff.db.conninfo`). :mod:`blockdiff.db.postgresql`, and psycopg
  with it, is imported only when a PostgreSQL database is opened (or one of
  its names is asked of this package): a store of one host starts without it.

One connection per process is shared by its threads: ``db.lock``
(reentrant) is held by every transaction and every statement, whose rows
are read before it is let go, so another thread's statement waits for a
transaction to end rather than run inside it, and closing waits for both;
a caller whose several reads outside a transaction must not interleave
with another thread's takes it too.

The protocol (:mod:`blockdiff.db.protocol`), which both implementations are,
serving the same callers:

- ``db.execute(sql, params)`` returns rows (``fetchone``, ``fetchall``,
  iteration); ``db.executemany(sql, rows)``; ``db.insert(sql, params, key)``
  returns the integer key the database gave the new row.
- ``with db.transaction():`` one atomic change that holds the write lock from
  its start (SQLite: ``BEGIN IMMEDIATE``; PostgreSQL: a transaction-level
  advisory lock, one key per schema, taken first thing), so concurrent
  writers queue instead of failing half-way or losing an update; COMMIT at
  the end, ROLLBACK if the block raises. Transactions do not nest: no caller
  needs it, and a nested one is refused (``DatabaseError``).
- ``with db.reading():`` several reads that see one state of the database
  (PostgreSQL: REPEATABLE READ, READ ONLY).
- ``db.tables()`` (PostgreSQL: of the schema in use),
  ``db.integrity_problems()`` (SQLite: ``PRAGMA integrity_check`` and
  ``foreign_key_check``; PostgreSQL: invalid indexes and constraints not
  validated, since it enforces foreign keys on every change and checking
  pages needs amcheck), ``db.close()``; ``db.name`` for messages (a file's
  path; a URL without its password, and the schema) and ``db.dialect``
  (``"sqlite"``, ``"postgresql"``).
- Errors are blockdiff's, never the driver's: ``DatabaseDamaged`` (status 7)
  for a file that is not the database it should be (empty, not SQLite,
  malformed, its tables missing), ``ConstraintFailed`` for a change the schema
  refuses (unique, foreign key, not null, check), ``DatabaseError`` (status
  13) for the rest (locked for too long, a server that cannot be reached,
  credentials refused, no such database, a connection lost, ...), each one
  line that says what, where and what to do, with no password in it;
  ``SchemaTooNew`` from :func:`migrate`, and ``OSError`` ENOSPC when the
  filesystem (or the server's disk) is full. Misuse of the driver (a closed
  connection, a wrong number of parameters) is a bug and stays as it is; a
  PostgreSQL URL that libpq cannot read is a ``UsageError``.
- A lost PostgreSQL connection (a server restarted): outside a transaction
  the next statement connects again, waiting up to the connect timeout for
  the server to come back; a read whose connection broke under it runs
  again, a change raises ``DatabaseError`` (it may have been made). Inside a
  transaction it raises ``DatabaseError`` and the transaction is gone,
  nothing of it committed.

SQL that must run on both dialects is written once: ``?`` placeholders (the
PostgreSQL implementation turns them into its own and doubles every literal
``%``, so no literal ``?`` in the text); ``INSERT ... ON CONFLICT (key) DO
NOTHING`` rather than ``INSERT OR IGNORE`` and ``ON CONFLICT (key) DO UPDATE
SET col = excluded.col`` rather than ``INSERT OR REPLACE`` (SQLite reads both
since 3.24); ``db.insert`` rather than ``RETURNING`` or ``lastrowid``; a
``VALUES`` list joined on a key rather than ``json_each``; bytes in and out
for BLOB/BYTEA columns (an implementation returns ``bytes``, not a
memoryview); integers for flags (a bool parameter is stored as 0 or 1, as
SQLite does); no NUL in text (PostgreSQL's text cannot hold it); integrity
checks through ``db.integrity_problems()``, the list of tables through
``db.tables()``. Only DDL differs: a migration group's scripts come in each
dialect it runs on (PostgreSQL: BIGINT for INTEGER, DOUBLE PRECISION for
times, BYTEA for BLOB, identity columns for INTEGER PRIMARY KEY, and
``COLLATE "C"`` on text, so that it orders and compares byte by byte as
SQLite does, whatever the database's locale). The few statements that
cannot be shared pick by ``db.dialect`` (the agent records' legacy-hash
predicate: SQLite's ``instr``, PostgreSQL's ``strpos``).

Migrations. A :class:`Migrations` group is a name and its scripts, with
``postgresql=[...]`` beside them (the same versions) for a group that runs
there; the database records each group's version
(:mod:`blockdiff.db.migrations`), and ``migrate(db, *groups)`` applies what is
missing in one transaction, so two processes migrating a new database at
once migrate it once. Groups of SQLite databases made before (the catalog's
``schema_migrations`` table, the ``PRAGMA user_version`` of the agent and
LangGraph databases) name that marker as ``legacy``: those databases are
adopted as they are. A PostgreSQL database is never legacy.

Using it, as the catalog and the LangGraph saver do (the agent records the
same way, with ``secure_delete=True`` and their group ``"agent"``)::

    db = open_database(target, mode=store.file_mode, schema="agent")
    try:
        migrate(db, Migrations("agent", MIGRATIONS, legacy="user_version",
                               postgresql=POSTGRESQL_MIGRATIONS))
    except BaseException:
        db.close()
        raise
    with db.transaction():
        db.execute("UPDATE threads SET head = ? WHERE id = ?", (head, thread_id))

The users take an open Database: ``Catalog(db, create=...)``,
``AgentDB(store, codec, db=db)``, ``BlockdiffSaver(store, disk, db=db,
agent_db=...)``, each then owning and closing it.
"""

from __future__ import annotations

import os

from blockdiff.db.conninfo import is_url, public_url
from blockdiff.db.migrations import Migrations, migrate, schema_version
from blockdiff.db.protocol import Database, Rows, damaged
from blockdiff.db.sqlite import SQLiteDatabase, connect, create_private

__all__ = ["Database", "Migrations", "PostgreSQLDatabase", "Rows", "SQLiteDatabase", "connect",
           "create_private", "damaged", "is_url", "migrate", "open_database", "open_postgresql",
           "public_url", "schema_version"]

# What each kind takes of open_database's options; the rest do not apply to it.
_SQLITE_OPTIONS = frozenset({"create", "mode", "foreign_keys", "secure_delete", "readonly",
                             "timeout"})
_POSTGRESQL_OPTIONS = frozenset({"schema", "connect_timeout", "timeout", "readonly"})
# Names of blockdiff.db.postgresql offered here, imported on first use: it
# imports psycopg, a tenth of a second that a store of one host never needs.
_POSTGRESQL_NAMES = frozenset({"PostgreSQLDatabase", "open_postgresql"})


def __getattr__(name: str):
    if name in _POSTGRESQL_NAMES:
        from blockdiff.db import postgresql

        return getattr(postgresql, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_database(target: str | os.PathLike, **options) -> Database:
    """Open a database of either kind: a ``postgresql://`` or ``postgres://``
    URL with :func:`open_postgresql` (``schema``, ``connect_timeout``,
    ``timeout``, ``readonly``), anything else as a SQLite file with
    :func:`connect` (``create``, ``mode``, ``foreign_keys``,
    ``secure_delete``, ``readonly``, ``timeout``). An option of the other
    kind only is ignored: a PostgreSQL database has no file mode and always
    enforces foreign keys, a SQLite file has no schemas."""
    unknown = set(options) - _SQLITE_OPTIONS - _POSTGRESQL_OPTIONS
    if unknown:
        raise TypeError(f"open_database() got unknown options: {', '.join(sorted(unknown))}")
    if is_url(target):
        from blockdiff.db.postgresql import open_postgresql

        return open_postgresql(target, **{k: v for k, v in options.items()
                                          if k in _POSTGRESQL_OPTIONS})
    return connect(target, **{k: v for k, v in options.items() if k in _SQLITE_OPTIONS})
