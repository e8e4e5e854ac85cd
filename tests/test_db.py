"""The database layer (blockdiff.db): opening, transactions, errors, and the
migration runner, including databases made before it (the catalog's
``schema_migrations``, the LangGraph saver's ``PRAGMA user_version``), made
here with the SQL the code used then."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time

import pytest

import filesystems
from blockdiff.db import Migrations, connect, migrate, schema_version
from blockdiff.db.sqlite import immediate_transaction
from blockdiff.errors import (
    ConstraintFailed,
    Damaged,
    DatabaseDamaged,
    DatabaseError,
    SchemaTooNew,
)
from blockdiff.store import catalog as catalog_module
from blockdiff.store.catalog import Catalog
from blockdiff.store.store import Store

ITEMS = Migrations("items", ["CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT UNIQUE)",
                             "ALTER TABLE items ADD COLUMN size INTEGER NOT NULL DEFAULT 0"])


def raw(path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


# ---------------------------------------------------------------- opening


def test_a_new_database_is_private_and_durable(tmp_path):
    old = os.umask(0o022)
    try:
        db = connect(tmp_path / "a.sqlite", foreign_keys=True, secure_delete=True)
        with db.transaction():
            db.execute("CREATE TABLE t (x)")
        group = connect(tmp_path / "g.sqlite", mode=0o640)
        with group.transaction():
            group.execute("CREATE TABLE t (x)")
    finally:
        os.umask(old)
    for name, mode in (("a.sqlite", 0o600), ("g.sqlite", 0o640)):
        for suffix in ("", "-wal", "-shm"):
            path = tmp_path / (name + suffix)
            assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
    pragmas = {p: db.execute(f"PRAGMA {p}").fetchone()[0]
               for p in ("journal_mode", "synchronous", "foreign_keys", "secure_delete")}
    assert pragmas == {"journal_mode": "wal", "synchronous": 2, "foreign_keys": 1,
                       "secure_delete": 1}
    # secure_delete not asked for is SQLite's build default, as before.
    assert group.execute("PRAGMA foreign_keys").fetchone() == (0,)
    db.close()
    group.close()


def test_an_existing_file_keeps_its_mode(tmp_path):
    path = tmp_path / "a.sqlite"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    connect(path).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_create_new_and_never(tmp_path):
    path = tmp_path / "a.sqlite"
    with pytest.raises(FileNotFoundError):
        connect(path, create="never")
    connect(path, create="new").close()
    with pytest.raises(FileExistsError):
        connect(path, create="new")
    os.truncate(path, 0)
    with pytest.raises(DatabaseDamaged, match="the file is empty"):
        connect(path, create="never")     # SQLite would take it for a new database
    with pytest.raises(ValueError):
        connect(path, create="sometimes")


def test_readonly_reads_without_writing(tmp_path):
    path = tmp_path / "a.sqlite"
    with connect(path).transaction() as db:
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (1)")
    reader = connect(path, readonly=True)
    assert reader.execute("SELECT x FROM t").fetchall() == [(1,)]
    with pytest.raises(DatabaseError, match="readonly"):
        reader.execute("INSERT INTO t VALUES (2)")
    reader.close()
    with pytest.raises(DatabaseError):
        connect(tmp_path / "missing.sqlite", readonly=True).execute("SELECT 1")


# ----------------------------------------------------------------- errors


def test_a_file_that_is_no_database_is_damage(tmp_path):
    path = tmp_path / "a.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(DatabaseDamaged, match="a.sqlite is damaged") as raised:
        connect(path, create="never")
    assert isinstance(raised.value, Damaged) and raised.value.exit_code == 7


def test_a_database_locked_too_long_is_a_database_error(tmp_path):
    path = tmp_path / "a.sqlite"
    connect(path).close()
    holder = raw(path)
    holder.execute("BEGIN IMMEDIATE")
    db = connect(path, timeout=0.2)
    try:
        with pytest.raises(DatabaseError, match="is locked") as raised:
            with db.transaction():
                pass
        assert raised.value.exit_code == 13
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with db.transaction():       # free again
        db.execute("CREATE TABLE t (x)")
    db.close()


def test_constraints_and_misuse(tmp_path):
    db = connect(tmp_path / "a.sqlite", foreign_keys=True)
    db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    db.execute("CREATE TABLE child (parent INTEGER REFERENCES parent(id))")
    with pytest.raises(ConstraintFailed, match="FOREIGN KEY"):
        db.execute("INSERT INTO child VALUES (7)")
    db.execute("INSERT INTO parent VALUES (1)")
    with pytest.raises(ConstraintFailed, match="UNIQUE|PRIMARY"):
        db.execute("INSERT INTO parent VALUES (1)")
    with pytest.raises(DatabaseError, match="no such table"):
        db.execute("SELECT * FROM missing_table")
    # Misuse of the driver is a bug, not a state of the database.
    with pytest.raises(sqlite3.ProgrammingError):
        db.execute("SELECT ?", (1, 2))
    db.close()
    with pytest.raises(sqlite3.ProgrammingError):
        db.execute("SELECT 1")


def test_a_full_filesystem_is_enospc(fresh_filesystem):
    root = fresh_filesystem("xfs", size=320 * 1024 * 1024)
    db = connect(root / "a.sqlite")
    with db.transaction():
        db.execute("CREATE TABLE t (x BLOB)")
    filesystems.fill(root)
    try:
        with pytest.raises(OSError) as raised:
            with db.transaction():
                db.executemany("INSERT INTO t VALUES (?)", [(os.urandom(65536),)] * 64)
        assert raised.value.errno == 28 and raised.value.filename == str(root / "a.sqlite")
        assert db.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)
    finally:
        os.unlink(root / "filler")
        db.close()


# ----------------------------------------------------------- transactions


def test_a_transaction_commits_or_rolls_back_whole(tmp_path):
    db = connect(tmp_path / "a.sqlite")
    with db.transaction():
        db.execute("CREATE TABLE t (x)")
        assert db.insert("INSERT INTO t VALUES (?)", ("a",), key="rowid") == 1
        assert db.insert("INSERT INTO t VALUES (?)", ("b",), key="rowid") == 2
    with pytest.raises(KeyError):
        with db.transaction():
            db.execute("INSERT INTO t VALUES ('c')")
            raise KeyError("stop")
    assert [x for (x,) in db.execute("SELECT x FROM t")] == ["a", "b"]
    # A nested one is refused, and the outer one goes on.
    with db.transaction():
        with pytest.raises(DatabaseError, match="within a transaction"):
            with db.transaction():
                pass
        db.execute("INSERT INTO t VALUES ('d')")
    assert db.execute("SELECT COUNT(*) FROM t").fetchone() == (3,)
    db.close()


def test_writers_queue_on_the_lock(tmp_path):
    """Threads of one connection and other connections wait for a transaction
    to end instead of failing half-way."""
    path = tmp_path / "a.sqlite"
    db = connect(path)
    with db.transaction():
        db.execute("CREATE TABLE t (x)")
    other = connect(path)
    order = []
    started = threading.Event()

    def add(database, value):
        with database.transaction():
            order.append(value)
            database.execute("INSERT INTO t VALUES (?)", (value,))

    with db.transaction():
        workers = [threading.Thread(target=add, args=(db, "thread")),
                   threading.Thread(target=add, args=(other, "process"))]
        for worker in workers:
            worker.start()
        started.set()
        time.sleep(0.3)
        assert order == []          # both wait for this transaction
        db.execute("INSERT INTO t VALUES ('first')")
        order.append("first")
    for worker in workers:
        worker.join()
    assert order[0] == "first" and sorted(order[1:]) == ["process", "thread"]
    assert db.execute("SELECT COUNT(*) FROM t").fetchone() == (3,)
    db.close()
    other.close()


def test_another_threads_statement_stays_out_of_a_transaction(tmp_path):
    """The threads share one connection: a plain statement of one waits for
    another's transaction, instead of running (and being rolled back) in it."""
    db = connect(tmp_path / "a.sqlite")
    with db.transaction():
        db.execute("CREATE TABLE t (x)")
    outside = threading.Thread(target=db.execute, args=("INSERT INTO t VALUES ('outside')",))
    with pytest.raises(KeyError), db.transaction():
        db.execute("INSERT INTO t VALUES ('inside')")
        outside.start()
        outside.join(0.3)
        assert outside.is_alive()          # waits for the transaction
        raise KeyError("roll back")
    outside.join()
    assert db.execute("SELECT x FROM t").fetchall() == [("outside",)]
    db.close()


_CLOSE_WHILE_BUSY = """
import sqlite3, sys, threading, time
from blockdiff.db import connect

db = connect(sys.argv[1])
db.execute("CREATE TABLE t (x)")
db.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(2000)])
refused, running = threading.Event(), threading.Event()

def busy():
    while True:
        try:
            running.set()
            db.execute("SELECT COUNT(*) FROM t a, t b WHERE a.x < b.x").fetchone()
        except sqlite3.ProgrammingError:
            refused.set()
            return

thread = threading.Thread(target=busy)
thread.start()
running.wait()
time.sleep(0.01)        # into the statement (about 0.1 s each)
db.close()
thread.join(60)
print("refused" if refused.is_set() else "still running")
"""


def test_closing_while_another_thread_runs_a_statement(tmp_path):
    """Closing waits for the statement another thread runs, whose next one
    is refused; Python's sqlite3 crashed the process (SIGSEGV) when the
    connection closed under a statement being stepped. In a child process,
    so that a crash is a failure here, not the end of the test run."""
    done = subprocess.run([sys.executable, "-c", _CLOSE_WHILE_BUSY, str(tmp_path / "a.sqlite")],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "refused"), done.stderr


def test_reading_sees_one_state(tmp_path):
    path = tmp_path / "a.sqlite"
    db = connect(path)
    with db.transaction():
        db.execute("CREATE TABLE t (x)")
        db.execute("INSERT INTO t VALUES (1)")
    writer = connect(path)
    with db.reading():
        before = db.execute("SELECT COUNT(*) FROM t").fetchone()
        with writer.transaction():
            writer.execute("INSERT INTO t VALUES (2)")
        assert db.execute("SELECT COUNT(*) FROM t").fetchone() == before == (1,)
    assert db.execute("SELECT COUNT(*) FROM t").fetchone() == (2,)
    db.close()
    writer.close()


def test_tables_and_integrity(tmp_path):
    db = connect(tmp_path / "a.sqlite")      # foreign keys off: a dangling row gets in
    db.execute("CREATE TABLE parent (id INTEGER PRIMARY KEY)")
    db.execute("CREATE TABLE child (parent INTEGER REFERENCES parent(id))")
    assert db.tables() == {"parent", "child"}
    assert db.integrity_problems() == []
    db.execute("INSERT INTO child VALUES (7)")
    assert db.integrity_problems() == ["dangling reference in child"]
    db.close()


def test_immediate_transaction_on_a_bare_connection(tmp_path):
    """The catalog's name for it, which AgentDB uses until it moves over."""
    conn = raw(tmp_path / "a.sqlite")
    with immediate_transaction(conn):
        conn.execute("CREATE TABLE t (x)")
    with pytest.raises(KeyError), immediate_transaction(conn):
        conn.execute("INSERT INTO t VALUES (1)")
        raise KeyError("stop")
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone() == (0,) and not conn.in_transaction
    conn.close()


# ------------------------------------------------------------- migrations


def test_groups_migrate_once_each_with_its_version(tmp_path):
    notes = Migrations("notes", ["CREATE TABLE notes (text TEXT)"], legacy="user_version")
    db = connect(tmp_path / "a.sqlite")
    migrate(db, ITEMS, notes)
    assert (schema_version(db, ITEMS), schema_version(db, notes)) == (2, 1)
    assert db.execute("PRAGMA user_version").fetchone() == (1,)     # notes' marker in step
    assert "schema_migrations" not in db.tables()
    db.execute("INSERT INTO items (name, size) VALUES ('a', 3)")
    migrate(db, ITEMS, notes)                                       # nothing to do
    assert db.execute("SELECT name, size FROM items").fetchall() == [("a", 3)]
    grown = Migrations("items", [*ITEMS.scripts, "CREATE INDEX items_size ON items (size)"])
    migrate(db, grown, notes)
    assert schema_version(db, grown) == 3 and schema_version(db, notes) == 1
    assert db.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                      "AND name = 'items_size'").fetchone()
    db.close()


def test_a_failing_migration_leaves_every_group_as_it_was(tmp_path):
    db = connect(tmp_path / "a.sqlite")
    broken = Migrations("broken", ["CREATE TABLE b (x)", "CREATE TABLE b (x)"])
    with pytest.raises(DatabaseError, match="already exists"):
        migrate(db, ITEMS, broken)
    assert db.tables() == set()
    assert schema_version(db, ITEMS) == 0
    db.close()


def test_a_newer_schema_is_refused(tmp_path):
    db = connect(tmp_path / "a.sqlite")
    migrate(db, ITEMS)
    db.execute("UPDATE schema_versions SET version = 9 WHERE name = 'items'")
    with pytest.raises(SchemaTooNew, match="newer") as raised:
        migrate(db, ITEMS)
    assert raised.value.exit_code == 13
    assert db.execute("SELECT version FROM schema_versions").fetchone() == (9,)
    db.close()


def test_a_newer_schema_by_its_legacy_marker_is_refused(tmp_path):
    """An older blockdiff may have been replaced by a newer one that wrote
    only what it knew: the highest version recorded wins."""
    path = tmp_path / "a.sqlite"
    notes = Migrations("notes", ["CREATE TABLE notes (text TEXT)"], legacy="user_version")
    db = connect(path)
    migrate(db, notes)
    db.execute("PRAGMA user_version = 5")
    with pytest.raises(SchemaTooNew):
        migrate(db, notes)
    db.close()


def test_an_existing_database_without_a_version_is_damage(tmp_path):
    db = connect(tmp_path / "a.sqlite")
    with pytest.raises(DatabaseDamaged, match="no items schema version"):
        migrate(db, ITEMS, existing=True)
    db.close()


# ------------------------------------------- databases made before the layer


def _old_catalog(path, versions: int) -> None:
    """A catalog as blockdiff made it before the db layer (its _migrate), at
    ``versions`` of its migrations, with a store's settings, a line of two
    snapshots and their layers."""
    db = raw(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("BEGIN IMMEDIATE")
    db.execute("CREATE TABLE IF NOT EXISTS schema_migrations "
               "(version INTEGER PRIMARY KEY, applied REAL NOT NULL)")
    for version, script in enumerate(catalog_module.MIGRATIONS[:versions], 1):
        for statement in script.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, time.time()))
    db.execute("INSERT OR REPLACE INTO store VALUES ('store_id', 'feedfacefeedface')")
    db.execute("INSERT OR REPLACE INTO store VALUES ('mode', 'reflink')")
    for seq, parent in ((1, None), (2, 1)):
        db.execute("INSERT INTO snapshots (seq, id, parent, created, message, meta, size, "
                   "changed_bytes, ranges, expires, map_sha256) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (seq, f"{seq:016x}", parent, 1000.0 + seq, f"step {seq}",
                    json.dumps({"n": seq}), 1 << 20, 4096 * seq, seq, None, "ab" * 32))
        db.executemany("INSERT INTO layer_refs VALUES (?, ?)",
                       [(seq, layer) for layer in range(1, seq + 1)])
    if versions >= 3:
        db.execute("UPDATE snapshots SET refs = (SELECT COUNT(*) FROM layer_refs "
                   "WHERE snapshot = seq)")
        db.executemany("INSERT INTO layers (layer, ranges, chunk, crcs) VALUES (?, ?, ?, ?)",
                       [(layer, b"\0" * 16, 65536, b"\1\2\3\4") for layer in (1, 2)])
        db.execute("INSERT OR REPLACE INTO retired_ids VALUES ('00000000000000aa', 5.0)")
    db.execute("COMMIT")
    db.close()


@pytest.mark.parametrize("versions", [1, 2, 3])
def test_a_catalog_made_before_the_layer_opens_with_its_data(tmp_path, versions):
    path = tmp_path / "catalog.sqlite"
    _old_catalog(path, versions)
    catalog = Catalog(str(path))
    latest = len(catalog_module.MIGRATIONS)
    assert catalog.schema_version == latest
    assert catalog.db.execute("SELECT version FROM schema_versions "
                              "WHERE name = 'catalog'").fetchone() == (latest,)
    # The old record is kept in step, for an older blockdiff opening it.
    assert [v for (v,) in catalog.db.execute(
        "SELECT version FROM schema_migrations ORDER BY version")] == list(range(1, latest + 1))
    assert catalog.store_problems() == []
    assert catalog.setting("store_id") == "feedfacefeedface"
    snaps = catalog.all()
    assert [(s.id, s.parent, s.message, s.meta, s.changed_bytes) for s in snaps] == [
        ("0000000000000002", "0000000000000001", "step 2", {"n": 2}, 8192),
        ("0000000000000001", None, "step 1", {"n": 1}, 4096)]
    assert catalog.layers_of(snaps[0]) == {1, 2}
    # Migration 3 counted the references of snapshots made before it.
    assert [r for (r,) in catalog.db.execute("SELECT refs FROM snapshots ORDER BY seq")] == [1, 2]
    assert catalog.layer_ids() == ({1, 2} if versions >= 3 else set())
    assert catalog.retired("00000000000000aa") == (versions >= 3)
    assert catalog.integrity_problems() == []
    catalog.close()
    again = Catalog(str(path))              # reopening changes nothing
    assert again.schema_version == latest and len(again.all()) == 2
    assert again.db.execute("SELECT COUNT(*) FROM schema_migrations").fetchone() == (latest,)
    again.close()


def test_the_old_catalog_check_still_refuses_a_newer_catalog(tmp_path):
    """What blockdiff before the layer reads (the highest schema_migrations
    row) follows the migrations this one applies."""
    path = tmp_path / "catalog.sqlite"
    Catalog(str(path), create=True).close()
    db = raw(path)
    assert db.execute("SELECT MAX(version) FROM schema_migrations").fetchone() == (
        len(catalog_module.MIGRATIONS),)
    db.execute("INSERT INTO schema_migrations VALUES (99, 0)")
    db.close()
    with pytest.raises(SchemaTooNew, match="catalog schema is version 99"):
        Catalog(str(path))


def test_a_catalog_without_its_tables_or_version_is_damage(tmp_path):
    path = tmp_path / "catalog.sqlite"
    db = raw(path)
    db.execute("CREATE TABLE unrelated (x)")
    db.close()
    with pytest.raises(DatabaseDamaged, match="no layer_refs, snapshots, store table"):
        Catalog(str(path))
    _old_catalog(tmp_path / "bare.sqlite", 3)
    db = raw(tmp_path / "bare.sqlite")
    db.execute("DROP TABLE schema_migrations")
    db.close()
    with pytest.raises(DatabaseDamaged, match="no catalog schema version"):
        Catalog(str(tmp_path / "bare.sqlite"))


def test_a_store_refuses_a_newer_catalog_and_names_damage(xfs):
    root = xfs / "store"
    Store.init(root).close()
    db = raw(root / "catalog.sqlite")
    db.execute("UPDATE schema_versions SET version = 99 WHERE name = 'catalog'")
    db.close()
    with pytest.raises(SchemaTooNew, match="upgrade blockdiff"):
        Store(root)
    (root / "catalog.sqlite-wal").unlink(missing_ok=True)
    (root / "catalog.sqlite-shm").unlink(missing_ok=True)
    (root / "catalog.sqlite").write_bytes(b"\0" * 4096)
    with pytest.raises(DatabaseDamaged, match="catalog.sqlite is damaged .*Put back a copy"):
        Store(root)


def _old_saver_database(path, versions: int, checkpoint: tuple[str, bytes],
                        metadata: tuple[str, bytes]) -> None:
    """A LangGraph database as the saver made it before the db layer (its
    _migrate: PRAGMA user_version), with one checkpoint of thread 't'."""
    from blockdiff.agent.langgraph import MIGRATIONS

    db = raw(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("BEGIN IMMEDIATE")
    for number, script in enumerate(MIGRATIONS[:versions], 1):
        for statement in script.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {number}")
    db.execute("INSERT INTO checkpoints VALUES ('t', '', 'c1', NULL, ?, ?, ?, ?, NULL, 1.0)",
               (*checkpoint, *metadata))
    db.execute("COMMIT")
    db.close()


@pytest.mark.parametrize("versions", [1, 2])
def test_a_saver_database_made_before_the_layer_opens_with_its_data(xfs, versions):
    pytest.importorskip("langgraph")
    from langgraph.checkpoint.base import empty_checkpoint

    from blockdiff.agent.langgraph import DB_NAME, SCHEMA_VERSION, BlockdiffSaver

    root = xfs / "store"
    store = Store.init(root)
    checkpoint = {**empty_checkpoint(), "id": "c1"}
    checkpoint.pop("channel_values")
    with BlockdiffSaver(store) as saver:      # for its serializer; its database goes
        serialized = (saver.serde.dumps_typed(checkpoint),
                      saver.serde.dumps_typed({"run_id": "r1", "step": 0}))
    for suffix in ("", "-wal", "-shm"):
        (root / (DB_NAME + suffix)).unlink(missing_ok=True)
    _old_saver_database(root / DB_NAME, versions, *serialized)

    saver = BlockdiffSaver(store)
    assert saver.schema_version == SCHEMA_VERSION
    found = saver.get_tuple({"configurable": {"thread_id": "t"}})
    assert found.checkpoint["id"] == "c1" and found.metadata["run_id"] == "r1"
    saver.delete_for_runs(["r1"])      # reads the run of a checkpoint saved without one
    assert saver.get_tuple({"configurable": {"thread_id": "t"}}) is None
    saver.close()
    db = raw(root / DB_NAME)
    assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    assert db.execute("SELECT version FROM schema_versions "
                      "WHERE name = 'langgraph'").fetchone() == (SCHEMA_VERSION,)
    db.close()
    store.close()
