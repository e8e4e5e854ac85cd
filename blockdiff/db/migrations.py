"""Schema migrations: named groups, each with its own version.

A database records the version of each group it holds in one table,
``schema_versions (name, version)``; a group's version is the number of its
scripts applied. :func:`migrate` applies the missing scripts of every group
given, in order, in one transaction, and refuses a database where a group is
newer than the code knows (``SchemaTooNew``).

Databases made before that table record their version the way they did then,
which a group names as its ``legacy`` marker: ``"schema_migrations"`` (the
store's catalog: a table with a row per applied version) or
``"user_version"`` (the agent records and the LangGraph checkpoints: SQLite's
``PRAGMA user_version``). The version read is the highest either records, so
such a database is adopted as it is; the marker is kept in step with the
table, so that an older blockdiff opening it still refuses a schema newer
than it knows, and still opens one it does know. Those markers are SQLite's
history: a PostgreSQL database is never legacy.

A group's scripts are in one dialect's DDL; a group used on PostgreSQL too
gives its ``postgresql`` scripts beside, one for each version, and
:func:`migrate` applies those of ``db.dialect``. Two processes migrating a
new database at once migrate it once: the transaction holds the write lock
(SQLite's, or PostgreSQL's advisory lock) from its start.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from blockdiff.db.protocol import Database, damaged
from blockdiff.errors import SchemaTooNew

VERSION_TABLE = "schema_versions"
LEGACY_MARKERS = ("schema_migrations", "user_version")


@dataclass(frozen=True)
class Migrations:
    """A named group of migrations: ``scripts[i]`` takes the group's tables
    from version i to i + 1 on SQLite (statements separated by ``;``), and
    ``postgresql[i]``, when the group runs there too, the same on
    PostgreSQL. Append to both; never edit a script once released."""

    name: str
    scripts: Sequence[str]
    legacy: str | None = None      # how SQLite databases made before VERSION_TABLE record it
    postgresql: Sequence[str] | None = None

    def __post_init__(self):
        if self.legacy is not None and self.legacy not in LEGACY_MARKERS:
            raise ValueError(f"legacy must be one of {', '.join(LEGACY_MARKERS)} or None, "
                             f"not {self.legacy!r}")
        if self.postgresql is not None and len(self.postgresql) != len(self.scripts):
            raise ValueError(f"the {self.name} group has {len(self.scripts)} SQLite scripts "
                             f"but {len(self.postgresql)} PostgreSQL ones: a version needs both")

    def scripts_for(self, dialect: str) -> Sequence[str]:
        """The scripts in ``dialect``'s DDL."""
        if dialect == "sqlite":
            return self.scripts
        if dialect == "postgresql" and self.postgresql is not None:
            return self.postgresql
        raise ValueError(f"the {self.name} migrations have no scripts for {dialect}")

    def legacy_on(self, db: Database) -> str | None:
        """The group's legacy marker in ``db``: none outside SQLite."""
        return self.legacy if db.dialect == "sqlite" else None

    @property
    def version(self) -> int:
        """The version this code brings the group to."""
        return len(self.scripts)


def migrate(db: Database, *groups: Migrations, existing: bool = False) -> None:
    """Bring every group of ``db`` to the code's version, in one transaction
    (two processes opening a new database at once migrate it once).
    ``existing``: the database must hold the groups already, so one without a
    version is damage (``DatabaseDamaged``) rather than new."""
    scripts = [group.scripts_for(db.dialect) for group in groups]
    with db.transaction():
        tables = db.tables()
        if VERSION_TABLE not in tables:
            db.execute(f"CREATE TABLE {VERSION_TABLE} "
                       "(name TEXT PRIMARY KEY, version INTEGER NOT NULL)")
        for group, group_scripts in zip(groups, scripts):
            recorded, legacy = _versions(db, group, tables)
            version = max(recorded, legacy)
            if version > group.version:
                raise SchemaTooNew(
                    f"{db.name} was written by a newer blockdiff: its {group.name} schema is "
                    f"version {version}, newer than the {group.version} this one knows; "
                    f"upgrade blockdiff to use it")
            if existing and version == 0:
                raise damaged(db.name, f"it has no {group.name} schema version")
            if version < group.version and group.legacy_on(db) == "schema_migrations":
                db.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                           "(version INTEGER PRIMARY KEY, applied REAL NOT NULL)")
            for number in range(version + 1, group.version + 1):
                for statement in group_scripts[number - 1].split(";"):
                    if statement.strip():
                        db.execute(statement)
                _mark_legacy(db, group, number)
            if recorded != group.version:
                db.execute(f"INSERT INTO {VERSION_TABLE} (name, version) VALUES (?, ?) "
                           "ON CONFLICT (name) DO UPDATE SET version = excluded.version",
                           (group.name, group.version))


def schema_version(db: Database, group: Migrations) -> int:
    """The version of ``group`` that ``db`` holds (0: none)."""
    return max(_versions(db, group, db.tables()))


def _versions(db: Database, group: Migrations, tables: set[str]) -> tuple[int, int]:
    """The group's version as VERSION_TABLE records it, and as its legacy marker does."""
    recorded = legacy = 0
    if VERSION_TABLE in tables:
        row = db.execute(f"SELECT version FROM {VERSION_TABLE} WHERE name = ?",
                         (group.name,)).fetchone()
        recorded = row[0] if row else 0
    marker = group.legacy_on(db)
    if marker == "schema_migrations" and "schema_migrations" in tables:
        legacy = db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0] or 0
    elif marker == "user_version":
        legacy = db.execute("PRAGMA user_version").fetchone()[0]
    return recorded, legacy


def _mark_legacy(db: Database, group: Migrations, number: int) -> None:
    marker = group.legacy_on(db)
    if marker == "schema_migrations":
        db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (number, time.time()))
    elif marker == "user_version":
        db.execute(f"PRAGMA user_version = {int(number)}")
