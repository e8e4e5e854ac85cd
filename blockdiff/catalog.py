"""The snapshot store's catalog: SQLite in WAL mode, with schema migrations.

Every change is one transaction (``BEGIN IMMEDIATE``, so concurrent writers
queue on SQLite's lock instead of failing half-way). The schema version is
the highest applied migration; opening a store applies the missing ones.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field

MIGRATIONS = [
    # 1: the snapshot tree.
    """
    CREATE TABLE store (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE snapshots (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        parent INTEGER REFERENCES snapshots(seq),
        created REAL NOT NULL,
        message TEXT NOT NULL DEFAULT '',
        meta TEXT NOT NULL DEFAULT '{}',
        size INTEGER NOT NULL,
        changed_bytes INTEGER NOT NULL,
        ranges INTEGER NOT NULL,
        expires REAL,
        map_sha256 TEXT NOT NULL
    );
    CREATE INDEX snapshots_parent ON snapshots(parent);
    CREATE TABLE layer_refs (
        snapshot INTEGER NOT NULL REFERENCES snapshots(seq) ON DELETE CASCADE,
        layer INTEGER NOT NULL,
        PRIMARY KEY (snapshot, layer)
    );
    CREATE INDEX layer_refs_layer ON layer_refs(layer);
    """,
    # 2: maps stored as a delta on another snapshot's map. The reference
    # keeps that snapshot from being deleted while a map still needs it.
    """
    ALTER TABLE snapshots ADD COLUMN map_base INTEGER REFERENCES snapshots(seq);
    CREATE INDEX snapshots_map_base ON snapshots(map_base);
    """,
]


@contextlib.contextmanager
def immediate_transaction(db: sqlite3.Connection):
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error: writers queue on
    SQLite's lock at the start instead of failing half-way."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


@dataclass
class Snapshot:
    """One node of the tree, as the catalog records it."""

    seq: int
    id: str
    parent: str | None
    created: float
    message: str
    meta: dict = field(default_factory=dict)
    size: int = 0
    changed_bytes: int = 0
    ranges: int = 0
    expires: float | None = None
    map_sha256: str = ""
    map_base: str | None = None   # the snapshot whose map this one's is a delta on


_SELECT = """
    SELECT s.seq, s.id, p.id, s.created, s.message, s.meta, s.size, s.changed_bytes,
           s.ranges, s.expires, s.map_sha256, b.id
    FROM snapshots s LEFT JOIN snapshots p ON p.seq = s.parent
    LEFT JOIN snapshots b ON b.seq = s.map_base
"""


def _row(row) -> Snapshot:
    return Snapshot(row[0], row[1], row[2], row[3], row[4], json.loads(row[5]), *row[6:])


class Catalog:
    """A connection to a store's catalog."""

    def __init__(self, path: str):
        # Usable from any thread (a LangGraph checkpointer commits from its
        # workers); the lock keeps one thread's transaction whole.
        self.db = sqlite3.connect(path, timeout=60, isolation_level=None,
                                  check_same_thread=False)
        self._lock = threading.RLock()
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA foreign_keys=ON")
        self._migrate()

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self):
        """One atomic change: BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error."""
        with self._lock, immediate_transaction(self.db) as db:
            yield db

    def _migrate(self) -> None:
        with self.transaction() as db:
            db.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
                       "(version INTEGER PRIMARY KEY, applied REAL NOT NULL)")
            done = {v for (v,) in db.execute("SELECT version FROM schema_migrations")}
            for version, script in enumerate(MIGRATIONS, 1):
                if version not in done:
                    for statement in script.split(";"):
                        if statement.strip():
                            db.execute(statement)
                    db.execute("INSERT INTO schema_migrations VALUES (?, ?)",
                               (version, time.time()))

    @property
    def schema_version(self) -> int:
        (version,) = self.db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()
        return version or 0

    def setting(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM store WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO store VALUES (?, ?)", (key, value))

    def get(self, snapshot_id: str) -> Snapshot | None:
        row = self.db.execute(_SELECT + " WHERE s.id = ?", (snapshot_id,)).fetchone()
        return _row(row) if row else None

    def all(self) -> list[Snapshot]:
        """Every snapshot, newest first."""
        return [_row(r) for r in self.db.execute(_SELECT + " ORDER BY s.seq DESC")]

    def ancestry(self, snapshot_id: str) -> list[Snapshot]:
        """A snapshot and its ancestors, newest first."""
        rows = self.db.execute("""
            WITH RECURSIVE line(seq) AS (
                SELECT seq FROM snapshots WHERE id = ?
                UNION ALL
                SELECT s.parent FROM snapshots s JOIN line ON s.seq = line.seq
                WHERE s.parent IS NOT NULL)
            """ + _SELECT.replace("FROM snapshots s", "FROM line JOIN snapshots s USING (seq)")
            + " ORDER BY s.seq DESC", (snapshot_id,))
        return [_row(r) for r in rows]

    def add(self, db, snapshot: Snapshot, layers) -> int:
        """Insert a snapshot, and the layers its pieces use, inside an open
        transaction; returns its seq."""
        def seq_of(snapshot_id):
            if snapshot_id is None:
                return None
            row = db.execute("SELECT seq FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
            if row is None:
                raise sqlite3.IntegrityError(f"snapshot {snapshot_id} was removed meanwhile")
            return row[0]

        cur = db.execute(
            "INSERT INTO snapshots (id, parent, created, message, meta, size, changed_bytes, "
            "ranges, expires, map_sha256, map_base) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (snapshot.id, seq_of(snapshot.parent), snapshot.created, snapshot.message,
             json.dumps(snapshot.meta, sort_keys=True), snapshot.size, snapshot.changed_bytes,
             snapshot.ranges, snapshot.expires, snapshot.map_sha256,
             seq_of(snapshot.map_base)))
        db.executemany("INSERT INTO layer_refs VALUES (?, ?)",
                       [(cur.lastrowid, int(layer)) for layer in layers])
        return cur.lastrowid

    def remove(self, db, snapshot: Snapshot) -> list[int]:
        """Delete a snapshot inside an open transaction, handing its children to
        its parent. Returns the layers no remaining snapshot uses."""
        used = [layer for (layer,) in db.execute(
            "SELECT layer FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))]
        db.execute("UPDATE snapshots SET parent = (SELECT parent FROM snapshots WHERE seq = ?) "
                   "WHERE parent = ?", (snapshot.seq, snapshot.seq))
        db.execute("DELETE FROM snapshots WHERE seq = ?", (snapshot.seq,))
        return [layer for layer in used if db.execute(
            "SELECT 1 FROM layer_refs WHERE layer = ? LIMIT 1", (layer,)).fetchone() is None]

    def replace_map(self, db, snapshot: Snapshot, digest: str, layers) -> list[int]:
        """Point a snapshot at a rewritten map that uses ``layers``, inside an
        open transaction. Returns the layers no snapshot uses any more."""
        before = [layer for (layer,) in db.execute(
            "SELECT layer FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))]
        db.execute("UPDATE snapshots SET map_sha256 = ?, map_base = NULL WHERE seq = ?",
                   (digest, snapshot.seq))
        db.execute("DELETE FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))
        db.executemany("INSERT INTO layer_refs VALUES (?, ?)",
                       [(snapshot.seq, int(layer)) for layer in layers])
        return [layer for layer in before if db.execute(
            "SELECT 1 FROM layer_refs WHERE layer = ? LIMIT 1", (layer,)).fetchone() is None]

    def map_dependents(self, snapshot_id: str, db=None) -> list[Snapshot]:
        """The snapshots whose maps are deltas on this one's."""
        rows = (db or self.db).execute(
            _SELECT + " WHERE s.map_base = (SELECT seq FROM snapshots WHERE id = ?)",
            (snapshot_id,))
        return [_row(r) for r in rows]

    def set_full_maps(self, db, maps: dict[int, str]) -> None:
        """Point snapshots (by seq) at full maps (by digest), inside an open
        transaction."""
        db.executemany("UPDATE snapshots SET map_sha256 = ?, map_base = NULL WHERE seq = ?",
                       [(digest, seq) for seq, digest in maps.items()])

    def layers_in_use(self) -> set[int]:
        """Every layer some snapshot's pieces use."""
        return {layer for (layer,) in self.db.execute("SELECT DISTINCT layer FROM layer_refs")}

    def integrity_problems(self) -> list[str]:
        """What SQLite's own integrity and foreign-key checks report."""
        problems = [row[0] for row in self.db.execute("PRAGMA integrity_check")
                    if row[0] != "ok"]
        problems += [f"dangling reference in {row[0]}"
                     for row in self.db.execute("PRAGMA foreign_key_check")]
        return problems
