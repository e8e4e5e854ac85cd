"""The database layer: one way to open a database, run a transaction and
migrate a schema, for every database blockdiff keeps (the store's catalog,
the agent records, the LangGraph checkpoints).

Opening. ``connect(path, ...)`` opens a SQLite file as a
:class:`~blockdiff.db.sqlite.SQLiteDatabase`: the file made private if it is
new (``mode``, 0600 by default; a group store passes its ``file_mode``, and
SQLite gives the -wal and -shm files the same), WAL, synchronous=FULL, a
60 s wait for another process's lock, autocommit outside explicit
transactions, foreign keys and secure_delete where asked. One connection per
process is shared by its threads: ``db.lock`` (reentrant) is held by every
transaction; a caller whose reads outside one must not interleave with
another thread's takes it too.

The protocol (:mod:`blockdiff.db.protocol`), which the SQLite implementation
is and a PostgreSQL one (psycopg 3, for the catalog several hosts share) is
to be, serving the same callers:

- ``db.execute(sql, params)`` returns rows (``fetchone``, ``fetchall``,
  iteration); ``db.executemany(sql, rows)``; ``db.insert(sql, params, key)``
  returns the integer key the database gave the new row.
- ``with db.transaction():`` one atomic change that holds the write lock from
  its start (SQLite: ``BEGIN IMMEDIATE``), so concurrent writers queue
  instead of failing half-way; COMMIT at the end, ROLLBACK if the block
  raises. Transactions do not nest: no caller needs it, and a nested one is
  refused (``DatabaseError``).
- ``with db.reading():`` several reads that see one state of the database.
- ``db.tables()``, ``db.integrity_problems()`` (SQLite: ``PRAGMA
  integrity_check`` and ``foreign_key_check``), ``db.close()``; ``db.name``
  for messages and ``db.dialect`` (``"sqlite"``, ``"postgresql"``).
- Errors are blockdiff's, never the driver's: ``DatabaseDamaged`` (status 7)
  for a file that is not the database it should be (empty, not SQLite,
  malformed, its tables missing), ``ConstraintFailed`` for a change the schema
  refuses, ``DatabaseError`` (status 13) for the rest (locked for too long,
  ...), ``SchemaTooNew`` from :func:`migrate`, and ``OSError`` ENOSPC when
  the filesystem is full. Misuse of the driver (a closed connection, a wrong
  number of parameters) is a bug and stays as it is.

SQL that must run on both dialects is written once: ``?`` placeholders (the
PostgreSQL implementation turns them into its own, so no literal ``?`` in
the text); ``INSERT ... ON CONFLICT (key) DO NOTHING`` rather than ``INSERT OR
IGNORE`` and ``ON CONFLICT (key) DO UPDATE SET col = excluded.col`` rather
than ``INSERT OR REPLACE`` (SQLite reads both since 3.24); ``db.insert``
rather than ``RETURNING`` or ``lastrowid``; bytes in and out for BLOB/BYTEA
columns (an implementation returns ``bytes``, not a memoryview); integrity
checks through ``db.integrity_problems()``, the list of tables through
``db.tables()``. Only DDL differs: a migration group's scripts are in the
dialect of its database (PostgreSQL: BYTEA, DOUBLE PRECISION for times,
identity columns for INTEGER PRIMARY KEY). The catalog's SQL keeps to this;
the LangGraph saver's, local to its store, uses SQLite's own (``json_each``,
``INSERT OR REPLACE``).

Migrations. A :class:`Migrations` group is a name and its scripts; the
database records each group's version (:mod:`blockdiff.db.migrations`), and
``migrate(db, *groups)`` applies what is missing in one transaction. Groups
of databases made before (the catalog's ``schema_migrations`` table, the
``PRAGMA user_version`` of the agent and LangGraph databases) name that
marker as ``legacy``: those databases are adopted as they are.

Using it, as the catalog and the LangGraph saver do (the agent records the
same way, with ``secure_delete=True`` and their group ``"agent"``)::

    db = connect(path, mode=store.file_mode)
    try:
        migrate(db, Migrations("agent", MIGRATIONS, legacy="user_version"))
    except BaseException:
        db.close()
        raise
    with db.transaction():
        db.execute("UPDATE threads SET head = ? WHERE id = ?", (head, thread_id))
"""

from __future__ import annotations

import os

from blockdiff.db.migrations import Migrations, migrate, schema_version
from blockdiff.db.postgresql import PostgreSQLDatabase, is_url, open_postgresql, public_url
from blockdiff.db.protocol import Database, Rows, damaged
from blockdiff.db.sqlite import SQLiteDatabase, connect, create_private

__all__ = ["Database", "Migrations", "PostgreSQLDatabase", "Rows", "SQLiteDatabase", "connect",
           "create_private", "damaged", "is_url", "migrate", "open_database", "open_postgresql",
           "public_url", "schema_version"]

# What each kind takes of open_database's options; the rest do not apply to it.
_SQLITE_OPTIONS = frozenset({"create", "mode", "foreign_keys", "secure_delete", "readonly",
                             "timeout"})
_POSTGRESQL_OPTIONS = frozenset({"schema", "connect_timeout", "timeout", "readonly"})


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
        return open_postgresql(target, **{k: v for k, v in options.items()
                                          if k in _POSTGRESQL_OPTIONS})
    return connect(target, **{k: v for k, v in options.items() if k in _SQLITE_OPTIONS})
