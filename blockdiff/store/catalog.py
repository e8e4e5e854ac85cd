"""The snapshot store's catalog, a database of the :mod:`blockdiff.db` layer
(SQLite in WAL mode, foreign keys enforced), with schema migrations.

Every change is one transaction (``BEGIN IMMEDIATE``, so concurrent writers
queue on SQLite's lock instead of failing half-way). The schema version is
the number of the catalog's migrations applied; opening a store applies the
missing ones and refuses a catalog that is empty, damaged
(``DatabaseDamaged``), or from a newer blockdiff (``SchemaTooNew``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field

from blockdiff.db import Database, Migrations, connect, damaged, migrate, schema_version
from blockdiff.errors import Conflict, ConstraintFailed, DatabaseError

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
    # 3: a row for every layer file: the runs of data it holds and the CRC32C
    # of each chunk of them, ``chunk`` bytes long (kept while any snapshot
    # uses the layer, whoever owned it), where a
    # compaction layer's bytes came from, and when it was last checked whole.
    # ``refs`` is the number of layer_refs rows a snapshot must have, so that
    # lost references are noticed before a layer still in use is deleted;
    # ``retired_ids`` keeps removed ids from coming back with other content.
    """
    CREATE TABLE layers (
        layer INTEGER PRIMARY KEY,
        ranges BLOB NOT NULL,
        chunk INTEGER NOT NULL,
        crcs BLOB NOT NULL,
        origin BLOB,
        checked REAL NOT NULL DEFAULT 0,
        stat TEXT NOT NULL DEFAULT ''
    );
    ALTER TABLE snapshots ADD COLUMN refs INTEGER;
    UPDATE snapshots SET refs = (SELECT COUNT(*) FROM layer_refs WHERE snapshot = seq);
    CREATE TABLE retired_ids (id TEXT PRIMARY KEY, removed REAL NOT NULL);
    """,
    # 4: a store shared by several hosts (see blockdiff.store.shared). Each
    # host that joined; the layer files each one holds in its own objects/
    # (with when it placed the copy, last used it and last checked it whole:
    # vouching is per copy); each layer's and map's size and when it was
    # uploaded to the object store (NULL: not yet); the host that committed
    # a snapshot.
    """
    CREATE TABLE hosts (id TEXT PRIMARY KEY, name TEXT NOT NULL, joined REAL NOT NULL);
    CREATE TABLE layer_copies (
        layer INTEGER NOT NULL REFERENCES layers(layer) ON DELETE CASCADE,
        host TEXT NOT NULL REFERENCES hosts(id),
        placed REAL NOT NULL,
        used REAL NOT NULL,
        checked REAL NOT NULL DEFAULT 0,
        stat TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (layer, host)
    );
    CREATE INDEX layer_copies_host ON layer_copies(host, used);
    ALTER TABLE layers ADD COLUMN size INTEGER;
    ALTER TABLE layers ADD COLUMN uploaded REAL;
    ALTER TABLE snapshots ADD COLUMN host TEXT;
    ALTER TABLE snapshots ADD COLUMN map_size INTEGER;
    ALTER TABLE snapshots ADD COLUMN map_uploaded REAL;
    """,
    # 5: generations, numbers the catalog hands out, each larger than every
    # one before it: a layer copy gets one when its host places it, a
    # snapshot when it is committed (its own layer's copy the same), so that
    # whether a copy was there when a snapshot was committed is read from
    # the catalog, never from hosts' clocks (which step). Copies already
    # placed get 0 (before every snapshot that has one); snapshots already
    # committed get none (their own maps are not trusted on any host).
    """
    CREATE TABLE generations (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
    INSERT INTO generations (name, value) VALUES ('copies', 0);
    ALTER TABLE layer_copies ADD COLUMN generation INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE snapshots ADD COLUMN generation INTEGER;
    """,
]
# The same versions on PostgreSQL. Layer numbers are BIGINT: a layer is named
# by 63 random bits (ids.new_id), a positive int64, as SQLite's INTEGER holds
# it; text compares byte by byte (COLLATE "C"), as SQLite's does.
POSTGRESQL_MIGRATIONS = [
    """
    CREATE TABLE store (key TEXT COLLATE "C" PRIMARY KEY, value TEXT COLLATE "C" NOT NULL);
    CREATE TABLE snapshots (
        seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        id TEXT COLLATE "C" NOT NULL UNIQUE,
        parent BIGINT REFERENCES snapshots(seq),
        created DOUBLE PRECISION NOT NULL,
        message TEXT COLLATE "C" NOT NULL DEFAULT '',
        meta TEXT COLLATE "C" NOT NULL DEFAULT '{}',
        size BIGINT NOT NULL,
        changed_bytes BIGINT NOT NULL,
        ranges BIGINT NOT NULL,
        expires DOUBLE PRECISION,
        map_sha256 TEXT COLLATE "C" NOT NULL
    );
    CREATE INDEX snapshots_parent ON snapshots(parent);
    CREATE TABLE layer_refs (
        snapshot BIGINT NOT NULL REFERENCES snapshots(seq) ON DELETE CASCADE,
        layer BIGINT NOT NULL,
        PRIMARY KEY (snapshot, layer)
    );
    CREATE INDEX layer_refs_layer ON layer_refs(layer);
    """,
    """
    ALTER TABLE snapshots ADD COLUMN map_base BIGINT REFERENCES snapshots(seq);
    CREATE INDEX snapshots_map_base ON snapshots(map_base);
    """,
    """
    CREATE TABLE layers (
        layer BIGINT PRIMARY KEY,
        ranges BYTEA NOT NULL,
        chunk BIGINT NOT NULL,
        crcs BYTEA NOT NULL,
        origin BYTEA,
        checked DOUBLE PRECISION NOT NULL DEFAULT 0,
        stat TEXT COLLATE "C" NOT NULL DEFAULT ''
    );
    ALTER TABLE snapshots ADD COLUMN refs BIGINT;
    UPDATE snapshots SET refs = (SELECT COUNT(*) FROM layer_refs WHERE snapshot = seq);
    CREATE TABLE retired_ids (id TEXT COLLATE "C" PRIMARY KEY,
                              removed DOUBLE PRECISION NOT NULL);
    """,
    """
    CREATE TABLE hosts (id TEXT COLLATE "C" PRIMARY KEY, name TEXT COLLATE "C" NOT NULL,
                        joined DOUBLE PRECISION NOT NULL);
    CREATE TABLE layer_copies (
        layer BIGINT NOT NULL REFERENCES layers(layer) ON DELETE CASCADE,
        host TEXT COLLATE "C" NOT NULL REFERENCES hosts(id),
        placed DOUBLE PRECISION NOT NULL,
        used DOUBLE PRECISION NOT NULL,
        checked DOUBLE PRECISION NOT NULL DEFAULT 0,
        stat TEXT COLLATE "C" NOT NULL DEFAULT '',
        PRIMARY KEY (layer, host)
    );
    CREATE INDEX layer_copies_host ON layer_copies(host, used);
    ALTER TABLE layers ADD COLUMN size BIGINT;
    ALTER TABLE layers ADD COLUMN uploaded DOUBLE PRECISION;
    ALTER TABLE snapshots ADD COLUMN host TEXT COLLATE "C";
    ALTER TABLE snapshots ADD COLUMN map_size BIGINT;
    ALTER TABLE snapshots ADD COLUMN map_uploaded DOUBLE PRECISION;
    """,
    # A sequence: nextval never waits for other transactions, and a value it
    # returns is larger than every value returned before the call.
    """
    CREATE SEQUENCE generations MINVALUE 1;
    ALTER TABLE layer_copies ADD COLUMN generation BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE snapshots ADD COLUMN generation BIGINT;
    """,
]
# Catalogs made before the db layer count their migrations in schema_migrations.
SCHEMA = Migrations("catalog", MIGRATIONS, legacy="schema_migrations",
                    postgresql=POSTGRESQL_MIGRATIONS)
# What a catalog has from its first version on.
_TABLES = frozenset({"store", "snapshots", "layer_refs"})


# Ids may be given by a unique prefix of at least this many hex digits; an
# ambiguous one is refused, naming up to PREFIX_LIST of the candidates.
PREFIX_MIN = 4
PREFIX_LIST = 10
_HEX = frozenset("0123456789abcdef")


def id_prefix(value) -> str | None:
    """``value`` as an id prefix to look up (lower case), or None when it is
    not one: fewer than ``PREFIX_MIN`` or more than 16 digits, or not hex."""
    if not isinstance(value, str) or not PREFIX_MIN <= len(value) <= 16:
        return None
    value = value.lower()
    return value if set(value) <= _HEX else None


def prefix_matches(db: Database, table: str, prefix: str,
                   limit: int = PREFIX_LIST) -> tuple[list[str], int]:
    """The first ``limit`` ids of ``table`` starting with ``prefix`` (already
    checked to be hex digits, so LIKE sees no wildcard) and their number."""
    rows = db.execute(f"SELECT id, COUNT(*) OVER () FROM {table} WHERE id LIKE ? || '%' "
                      f"ORDER BY id LIMIT ?", (prefix, limit)).fetchall()
    return [row[0] for row in rows], rows[0][1] if rows else 0


def candidates(ids: list[str], total: int) -> str:
    """The ids an ambiguous prefix matches, as a phrase: 'a, b and 3 more'."""
    more = total - len(ids)
    return ", ".join(ids) + (f" and {more} more" if more > 0 else "")


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
    host: str | None = None       # in a shared store: the host that committed it
    generation: int | None = None  # in a shared store: the catalog's generation at its commit


@dataclass
class LayerRecord:
    """What the catalog keeps about one layer file."""

    layer: int
    ranges: bytes            # (position, length) of each run of data, u64 pairs, sorted
    chunk: int               # the runs are checksummed in chunks of this many bytes
    crcs: bytes              # the CRC32C of each chunk, u32, in order
    origin: bytes | None = None   # compaction layer: the pieces it copies (see store)
    checked: float = 0.0     # when every chunk last matched its checksum
    stat: str = ""           # the file's identity at that time


_SELECT = """
    SELECT s.seq, s.id, p.id, s.created, s.message, s.meta, s.size, s.changed_bytes,
           s.ranges, s.expires, s.map_sha256, b.id, s.host, s.generation
    FROM snapshots s LEFT JOIN snapshots p ON p.seq = s.parent
    LEFT JOIN snapshots b ON b.seq = s.map_base
"""


def _row(row) -> Snapshot:
    return Snapshot(row[0], row[1], row[2], row[3], row[4], json.loads(row[5]), *row[6:])


class Catalog:
    """A connection to a store's catalog."""

    def __init__(self, target: str | os.PathLike | Database, *, create: bool = False,
                  mode: int = 0o600):
        """Open a catalog: ``target`` is a SQLite file's path or an open
        :class:`~blockdiff.db.Database` (PostgreSQL's, say), which the catalog
        then owns and closes. ``create`` makes a new one (a file with
        ``mode``; in a Database, its tables, if it has none yet), otherwise
        it must hold a catalog already (``DatabaseDamaged``). Usable from any
        thread (a LangGraph checkpointer commits from its workers)."""
        if isinstance(target, (str, os.PathLike)):
            self.db = connect(target, create="new" if create else "never", mode=mode,
                              foreign_keys=True)
        else:
            self.db = target
        try:
            if not create:
                missing = _TABLES - self.db.tables()
                if missing:
                    raise damaged(self.db.name, f"it has no {', '.join(sorted(missing))} "
                                                f"table")
            migrate(self.db, SCHEMA, existing=not create)
        except BaseException:
            self.db.close()
            raise
        # The host this catalog is opened for, in a store shared by several
        # (blockdiff.store.shared sets it): layer copies and their vouching
        # are then per host. None: a store of one host.
        self.host: str | None = None

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def transaction(self):
        """One atomic change: BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error."""
        return self.db.transaction()

    @property
    def schema_version(self) -> int:
        """How many of the catalog's migrations the file has."""
        return schema_version(self.db, SCHEMA)

    def setting(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM store WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        with self.transaction() as db:
            db.execute("INSERT INTO store (key, value) VALUES (?, ?) "
                       "ON CONFLICT (key) DO UPDATE SET value = excluded.value", (key, value))

    def get(self, snapshot_id: str) -> Snapshot | None:
        row = self.db.execute(_SELECT + " WHERE s.id = ?", (snapshot_id,)).fetchone()
        return _row(row) if row else None

    def ids_with_prefix(self, prefix: str, limit: int = PREFIX_LIST) -> tuple[list[str], int]:
        """The first ``limit`` ids (in order) that start with ``prefix``, a
        string of hex digits (see :func:`id_prefix`), and how many there are."""
        return prefix_matches(self.db, "snapshots", prefix, limit)

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

    def add(self, db, snapshot: Snapshot, layers, new_layer: LayerRecord | None = None,
            needed: tuple[str, ...] = ()) -> int:
        """Insert a snapshot, the layers its pieces use and the record of the
        layer it wrote, inside an open transaction; returns its seq.
        ``needed``: snapshots that must still be there (ConstraintFailed),
        as its parent must: those into whose own layers its pieces point as
        well (a removal committed first dropped the record of a layer only
        they used, and deletes its file once the capture lets go of the
        store), and the one it is a part of (whose removal took its parts
        then)."""
        def seq_of(snapshot_id):
            if snapshot_id is None:
                return None
            row = db.execute("SELECT seq FROM snapshots WHERE id = ?", (snapshot_id,)).fetchone()
            if row is None:
                raise ConstraintFailed(f"snapshot {snapshot_id} was removed meanwhile")
            return row[0]

        for snapshot_id in needed:
            seq_of(snapshot_id)
        # In a shared store: the layer copies this host placed before now
        # have smaller generations, those it places later larger ones.
        generation = None if self.host is None else self.next_generation(db)
        if new_layer is not None:
            self.add_layer(db, new_layer, generation=generation)
        layers = sorted({int(layer) for layer in layers})
        seq = db.insert(
            "INSERT INTO snapshots (id, parent, created, message, meta, size, changed_bytes, "
            "ranges, expires, map_sha256, map_base, refs, host, generation) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (snapshot.id, seq_of(snapshot.parent), snapshot.created, snapshot.message,
             json.dumps(snapshot.meta, sort_keys=True), snapshot.size, snapshot.changed_bytes,
             snapshot.ranges, snapshot.expires, snapshot.map_sha256,
             seq_of(snapshot.map_base), len(layers), self.host, generation), key="seq")
        snapshot.generation = generation
        db.executemany("INSERT INTO layer_refs VALUES (?, ?)",
                       [(seq, layer) for layer in layers])
        return seq

    def add_layer(self, db, record: LayerRecord, generation: int | None = None) -> None:
        """Record a new layer file inside an open transaction (in a shared
        store: held by this host from ``generation`` on, by default a new
        one, and checked there)."""
        shared = self.host is not None
        db.execute("INSERT INTO layers (layer, ranges, chunk, crcs, origin, checked, stat) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (record.layer, record.ranges, record.chunk, record.crcs, record.origin,
                    0.0 if shared else record.checked, "" if shared else record.stat))
        if shared:
            self.add_copy(db, record.layer, record.checked, record.stat, generation)

    def layer(self, layer: int) -> LayerRecord | None:
        """The record of one layer, or None (in a shared store, its check
        time and file identity are this host's copy's)."""
        if self.host is None:
            row = self.db.execute("SELECT layer, ranges, chunk, crcs, origin, checked, stat "
                                  "FROM layers WHERE layer = ?", (int(layer),)).fetchone()
        else:
            row = self.db.execute(
                "SELECT l.layer, l.ranges, l.chunk, l.crcs, l.origin, COALESCE(c.checked, 0), "
                "COALESCE(c.stat, '') FROM layers l LEFT JOIN layer_copies c "
                "ON c.layer = l.layer AND c.host = ? WHERE l.layer = ?",
                (self.host, int(layer))).fetchone()
        return LayerRecord(*row) if row else None

    def unrecorded_layers(self) -> set[int]:
        """Layers some snapshot uses that have no record (stores made before records)."""
        return {layer for (layer,) in self.db.execute(
            "SELECT DISTINCT layer FROM layer_refs WHERE layer NOT IN (SELECT layer FROM layers)")}

    def layer_ids(self) -> set[int]:
        """Every layer the catalog has a record of."""
        return {layer for (layer,) in self.db.execute("SELECT layer FROM layers")}

    def mark_checked(self, layer: int, checked: float, stat: str) -> None:
        """Note that every chunk of a layer matched at ``checked``, its file
        being ``stat``. Best effort: unrecorded, the layer is checked again
        next time (on a full disk, say)."""
        with contextlib.suppress(DatabaseError, OSError), self.transaction() as db:
            if self.host is None:
                db.execute("UPDATE layers SET checked = ?, stat = ? WHERE layer = ?",
                           (checked, stat, int(layer)))
            else:
                db.execute("UPDATE layer_copies SET checked = ?, stat = ? "
                           "WHERE layer = ? AND host = ?", (checked, stat, int(layer), self.host))

    def layers_of(self, snapshot: Snapshot) -> set[int]:
        """The layers the catalog says a snapshot's pieces use."""
        return {layer for (layer,) in self.db.execute(
            "SELECT layer FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))}

    def lost_references(self, db=None) -> list[str]:
        """Snapshots whose layer references do not number what was recorded,
        or name a layer without a record."""
        db = db or self.db
        short = [sid for (sid,) in db.execute("""
            SELECT s.id FROM snapshots s
            LEFT JOIN (SELECT snapshot, COUNT(*) AS n FROM layer_refs GROUP BY snapshot) r
                ON r.snapshot = s.seq
            WHERE s.refs IS NOT NULL AND COALESCE(r.n, 0) != s.refs""")]
        unknown = [sid for (sid,) in db.execute("""
            SELECT DISTINCT s.id FROM layer_refs r JOIN snapshots s ON s.seq = r.snapshot
            WHERE NOT EXISTS (SELECT 1 FROM layers l WHERE l.layer = r.layer)""")]
        return sorted(set(short) | set(unknown))

    def retire(self, db, snapshot_id: str) -> None:
        """Remember that an id was removed, inside an open transaction."""
        db.execute("INSERT INTO retired_ids (id, removed) VALUES (?, ?) "
                   "ON CONFLICT (id) DO UPDATE SET removed = excluded.removed",
                   (snapshot_id, time.time()))

    def retired(self, snapshot_id: str) -> bool:
        """Whether a snapshot with this id was removed from this store."""
        return self.db.execute("SELECT 1 FROM retired_ids WHERE id = ?",
                               (snapshot_id,)).fetchone() is not None

    def remove(self, db, snapshot: Snapshot, own_layer: int) -> list[int]:
        """Delete a snapshot inside an open transaction, handing its children to
        its parent, and the records of the layers no remaining snapshot uses
        (its own included). Returns those layers. ``Conflict`` if it is gone
        (removed meanwhile by another process or host, which said so)."""
        if db.execute("SELECT 1 FROM snapshots WHERE seq = ?",
                      (snapshot.seq,)).fetchone() is None:
            raise Conflict(f"snapshot {snapshot.id} was removed meanwhile (by another "
                           f"process or host); nothing was changed")
        used = {layer for (layer,) in db.execute(
            "SELECT layer FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))}
        db.execute("UPDATE snapshots SET parent = (SELECT parent FROM snapshots WHERE seq = ?) "
                   "WHERE parent = ?", (snapshot.seq, snapshot.seq))
        db.execute("DELETE FROM snapshots WHERE seq = ?", (snapshot.seq,))
        self.retire(db, snapshot.id)
        return self._drop_unused(db, used | {int(own_layer)})

    def _drop_unused(self, db, layers) -> list[int]:
        unused = [layer for layer in sorted(layers) if db.execute(
            "SELECT 1 FROM layer_refs WHERE layer = ? LIMIT 1", (layer,)).fetchone() is None]
        db.executemany("DELETE FROM layers WHERE layer = ?", [(layer,) for layer in unused])
        return unused

    def replace_map(self, db, snapshot: Snapshot, digest: str, layers) -> list[int]:
        """Point a snapshot at a rewritten map that uses ``layers``, inside an
        open transaction. Drops the records of the layers no snapshot uses any
        more and returns them. ``Conflict`` if the snapshot's row no longer
        names the map ``snapshot`` does (removed or rewritten meanwhile by
        another process or host): the new map was made from the old one."""
        row = db.execute("SELECT map_sha256 FROM snapshots WHERE seq = ?",
                         (snapshot.seq,)).fetchone()
        if row is None or row[0] != snapshot.map_sha256:
            raise Conflict(f"snapshot {snapshot.id} was removed or rewritten meanwhile "
                           f"(by another process or host); nothing was changed: try again")
        before = {layer for (layer,) in db.execute(
            "SELECT layer FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))}
        layers = sorted({int(layer) for layer in layers})
        db.execute("UPDATE snapshots SET map_sha256 = ?, map_base = NULL, refs = ?, "
                   "map_uploaded = NULL, map_size = NULL WHERE seq = ?",
                   (digest, len(layers), snapshot.seq))
        db.execute("DELETE FROM layer_refs WHERE snapshot = ?", (snapshot.seq,))
        db.executemany("INSERT INTO layer_refs VALUES (?, ?)",
                       [(snapshot.seq, layer) for layer in layers])
        return self._drop_unused(db, before)

    def map_dependents(self, snapshot_id: str, db=None) -> list[Snapshot]:
        """The snapshots whose maps are deltas on this one's."""
        rows = (db or self.db).execute(
            _SELECT + " WHERE s.map_base = (SELECT seq FROM snapshots WHERE id = ?)",
            (snapshot_id,))
        return [_row(r) for r in rows]

    def set_full_maps(self, db, maps: dict[int, str]) -> None:
        """Point snapshots (by seq) at full maps (by digest), inside an open
        transaction."""
        # A new map is not in the object store yet (a shared store's host
        # pushes it next).
        db.executemany("UPDATE snapshots SET map_sha256 = ?, map_base = NULL, "
                       "map_uploaded = NULL, map_size = NULL WHERE seq = ?",
                       [(digest, seq) for seq, digest in maps.items()])

    def layers_in_use(self) -> set[int]:
        """Every layer some snapshot's pieces use."""
        return {layer for (layer,) in self.db.execute("SELECT DISTINCT layer FROM layer_refs")}

    # ------------------------------------------- a store shared by hosts

    def join(self, host: str, name: str) -> None:
        """Record a host joining the store (again: its name is updated)."""
        with self.transaction() as db:
            db.execute("INSERT INTO hosts (id, name, joined) VALUES (?, ?, ?) "
                       "ON CONFLICT (id) DO UPDATE SET name = excluded.name",
                       (host, name, time.time()))

    def host_names(self) -> dict[str, str]:
        """The name of every host that joined, by id."""
        return dict(self.db.execute("SELECT id, name FROM hosts").fetchall())

    def next_generation(self, db) -> int:
        """Inside an open transaction: a generation larger than every one
        handed out before (see migration 5)."""
        if self.db.dialect == "postgresql":
            return int(db.execute("SELECT nextval('generations')").fetchone()[0])
        # SQLite's transactions run one at a time (BEGIN IMMEDIATE).
        db.execute("UPDATE generations SET value = value + 1 WHERE name = 'copies'")
        return int(db.execute("SELECT value FROM generations WHERE name = 'copies'")
                   .fetchone()[0])

    def add_copy(self, db, layer: int, checked: float = 0.0, stat: str = "",
                 generation: int | None = None) -> None:
        """Inside an open transaction: this host holds a copy of ``layer``
        from ``generation`` on (by default a new one: a copy placed again is
        another file, with other blocks), checked whole at ``checked`` (0:
        not yet) when its file was ``stat``."""
        if generation is None:
            generation = self.next_generation(db)
        now = time.time()   # what eviction orders by (and what people read), nothing else
        db.execute("INSERT INTO layer_copies (layer, host, placed, used, checked, stat, "
                   "generation) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (layer, host) DO "
                   "UPDATE SET placed = excluded.placed, used = excluded.used, "
                   "checked = excluded.checked, stat = excluded.stat, "
                   "generation = excluded.generation",
                   (int(layer), self.host, now, now, checked, stat, generation))

    def copies_cover(self, snapshot: Snapshot, generation: int | None = None) -> bool:
        """Whether this host holds a copy of every layer ``snapshot`` uses,
        each placed at ``generation`` or before (None: whenever)."""
        bound = "" if generation is None else " AND c.generation <= ?"
        row = self.db.execute(
            "SELECT COUNT(*) FROM layer_refs r JOIN layer_copies c ON c.layer = r.layer "
            "AND c.host = ? WHERE r.snapshot = ?" + bound,
            (self.host, snapshot.seq) + (() if generation is None else (generation,))
        ).fetchone()
        total = self.db.execute("SELECT COUNT(*) FROM layer_refs WHERE snapshot = ?",
                                (snapshot.seq,)).fetchone()
        return row[0] == total[0]

    def copies_generation(self, snapshot: Snapshot) -> int | None:
        """The latest generation of this host's copies of the layers
        ``snapshot`` uses (None if it lacks one): while
        ``copies_cover(snapshot, that)`` holds, none was placed again."""
        if not self.copies_cover(snapshot):
            return None
        row = self.db.execute(
            "SELECT MAX(c.generation) FROM layer_refs r JOIN layer_copies c "
            "ON c.layer = r.layer AND c.host = ? WHERE r.snapshot = ?",
            (self.host, snapshot.seq)).fetchone()
        return 0 if row[0] is None else int(row[0])

    def drop_copies(self, db, layers) -> None:
        """Inside an open transaction: this host no longer holds ``layers``."""
        db.executemany("DELETE FROM layer_copies WHERE layer = ? AND host = ?",
                       [(int(layer), self.host) for layer in layers])

    def copies_here(self) -> dict[int, float]:
        """The layers this host holds, with when each was last used."""
        return dict(self.db.execute("SELECT layer, used FROM layer_copies WHERE host = ?",
                                    (self.host,)).fetchall())

    def touch_copies(self, layers) -> None:
        """Note that this host's copies of ``layers`` were just used (best
        effort: the order of eviction is all it changes)."""
        now = time.time()
        with contextlib.suppress(DatabaseError, OSError), self.transaction() as db:
            db.executemany("UPDATE layer_copies SET used = ? WHERE layer = ? AND host = ?",
                           [(now, int(layer), self.host) for layer in layers])

    def uploads(self, layers) -> dict[int, tuple[int | None, float | None]]:
        """``(size, uploaded)`` of each of ``layers`` that has a record
        (uploaded None: not in the object store yet)."""
        wanted = sorted({int(x) for x in layers})
        found = {}
        for first in range(0, len(wanted), 500):
            batch = wanted[first:first + 500]
            found.update((layer, (size, uploaded)) for layer, size, uploaded in self.db.execute(
                f"SELECT layer, size, uploaded FROM layers WHERE layer IN "
                f"({', '.join('?' * len(batch))})", batch))
        return found

    def not_uploaded(self, snapshot: Snapshot) -> int:
        """How many of the layers ``snapshot`` uses are not in the object store."""
        return self.db.execute(
            "SELECT COUNT(*) FROM layer_refs r JOIN layers l ON l.layer = r.layer "
            "WHERE r.snapshot = ? AND l.uploaded IS NULL", (snapshot.seq,)).fetchone()[0]

    def pending_layers(self) -> list[int]:
        """Layers this host holds that are not in the object store yet, oldest first."""
        return [layer for (layer,) in self.db.execute(
            "SELECT l.layer FROM layers l JOIN layer_copies c ON c.layer = l.layer "
            "WHERE c.host = ? AND l.uploaded IS NULL ORDER BY c.generation", (self.host,))]

    def pending_maps(self) -> list[Snapshot]:
        """Snapshots whose map is not in the object store yet, oldest first
        (the host that wrote a map holds its file)."""
        return [_row(r) for r in self.db.execute(
            _SELECT + " WHERE s.map_uploaded IS NULL ORDER BY s.seq")]

    def mark_layer_uploaded(self, layer: int, size: int, db=None) -> bool:
        """Record that ``layer`` (``size`` bytes) is in the object store;
        False if it has no record any more (removed meanwhile)."""
        with contextlib.nullcontext(db) if db is not None else self.transaction() as db:
            if db.execute("SELECT 1 FROM layers WHERE layer = ?", (int(layer),)).fetchone() \
                    is None:
                return False
            db.execute("UPDATE layers SET uploaded = ?, size = ? WHERE layer = ?",
                       (time.time(), size, int(layer)))
            return True

    def mark_map_uploaded(self, snapshot: Snapshot, size: int, db=None) -> bool:
        """Record that the map ``snapshot`` names (``size`` bytes) is in the
        object store; False if the snapshot is gone or names another map now."""
        with contextlib.nullcontext(db) if db is not None else self.transaction() as db:
            row = db.execute("SELECT map_sha256 FROM snapshots WHERE seq = ?",
                             (snapshot.seq,)).fetchone()
            if row is None or row[0] != snapshot.map_sha256:
                return False
            db.execute("UPDATE snapshots SET map_uploaded = ?, map_size = ? WHERE seq = ?",
                       (time.time(), size, snapshot.seq))
            return True

    def map_upload(self, snapshot: Snapshot) -> tuple[int | None, float | None]:
        """``(size, uploaded)`` of the map ``snapshot`` names now."""
        row = self.db.execute("SELECT map_size, map_uploaded FROM snapshots WHERE seq = ? "
                              "AND map_sha256 = ?", (snapshot.seq, snapshot.map_sha256)).fetchone()
        return (row[0], row[1]) if row else (None, None)

    def placement(self) -> dict[str, tuple[str | None, bool, set[int]]]:
        """For every snapshot: the host that committed it, whether its own
        map is uploaded, and the layers it uses that are not uploaded."""
        found = {sid: (host, uploaded is not None, set()) for sid, host, uploaded in
                 self.db.execute("SELECT id, host, map_uploaded FROM snapshots")}
        for sid, layer in self.db.execute(
                "SELECT s.id, r.layer FROM layer_refs r JOIN snapshots s ON s.seq = r.snapshot "
                "JOIN layers l ON l.layer = r.layer WHERE l.uploaded IS NULL"):
            found[sid][2].add(layer)
        return found

    def store_problems(self) -> list[str]:
        """What makes the catalog unusable as a store's: no store id, a mode
        it does not know."""
        problems = []
        if not self.setting("store_id"):
            problems.append("it has no store id")
        if self.setting("mode") not in ("reflink", "copy"):
            problems.append(f"it has an unknown mode {self.setting('mode')!r}")
        return problems

    def integrity_problems(self) -> list[str]:
        """What the database's own integrity and foreign-key checks report."""
        return self.db.integrity_problems()
