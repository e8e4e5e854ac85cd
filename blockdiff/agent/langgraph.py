"""A LangGraph checkpointer that keeps a graph's checkpoints in a blockdiff store
and ties each one to the snapshot of the sandbox disk at that step.

Install with ``pip install blockdiff[langgraph]``. Checkpoints go to their own
SQLite database in the store directory (``langgraph.sqlite``), so any number of
processes can share a store, or to a :class:`~blockdiff.db.Database` given
(``db=``: the shared catalog's PostgreSQL, so that savers on several hosts
share them). With a ``disk`` (an :class:`~blockdiff.agent.disks.ImageDisk`,
a :class:`~blockdiff.vm.sandbox.Sandbox`, or anything with ``checkpoint`` and
``restore``), every checkpoint of the top-level graph first snapshots the disk
(an unchanged disk reuses its last snapshot) and records the snapshot id, also
in the checkpoint's metadata as ``"disk_snapshot"``. Going back to an earlier
checkpoint then takes the disk back with it::

    from blockdiff.agent.disks import ImageDisk
    from blockdiff.agent.langgraph import BlockdiffSaver

    disk = ImageDisk("/xfs/store", "/xfs/sandbox.img")
    saver = BlockdiffSaver("/xfs/store", disk)

    def step(state, config):
        saver.wait_for_disk(config)      # before the node touches the disk
        ...

    graph = builder.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "task-1"}}
    graph.invoke(inputs, config)

    # replay (or fork) from an earlier step, with the disk as it was then
    past = list(graph.get_state_history(config))[3]
    saver.restore_disk(past.config)
    graph.invoke(None, past.config)
    # or: graph.invoke(None, graph.update_state(past.config, {...}))

LangGraph saves a checkpoint in the background while the next step already
runs, so a node that writes the disk calls ``saver.wait_for_disk(config)``
(``await saver.await_for_disk(config)`` in an async node) first: it returns
once the snapshot of the checkpoint the node runs from is taken. Without it,
the next step's writes can end up in the previous step's snapshot.

Only the top-level graph's checkpoints (``checkpoint_ns == ""``) snapshot the
disk; a subgraph's checkpoints have none, and what a subgraph writes is in the
parent's next snapshot. Deleting a thread keeps its disk snapshots, which other
threads may share; ``blockdiff gc`` removes snapshots by the store's policy.

Besides the base contract the saver has LangGraph's optional methods, sync and
async: ``copy_thread`` (every checkpoint, blob and pending write of a thread
under another thread id, which must have none; both threads then name the same
disk snapshots), ``prune`` (``"keep_latest"``: the newest checkpoint of each
namespace of each thread, and the ancestors a ``DeltaChannel`` of it is rebuilt
from; ``"delete"``: none) and ``delete_for_runs`` (the checkpoints whose
metadata has one of the run ids). What they delete takes its writes and the
channel values nothing else uses with it, and the disk snapshots that only the
deleted checkpoints used are removed from the store (``Store.rm``; every other
snapshot stays restorable), except those that a checkpoint of any thread or an
agent checkpoint (``agent.sqlite``, or the ``agent_db`` given) still names, and
those a LangGraph saver did not take (a snapshot an unchanged disk reused, such
as its base image's).

Its SQL runs on both dialects of :mod:`blockdiff.db` (``ON CONFLICT`` upserts,
the channel values looked up through a ``VALUES`` list joined on the blobs'
key); only the DDL differs.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    SerializerProtocol,
    get_checkpoint_id,
    get_checkpoint_metadata,
)

from blockdiff.agent.saver_deletion import (
    CHUNK,
    SnapshotRelease,
    chunks,
    drop_unused_blobs,
    marks,
    needed_by_latest,
)
from blockdiff.db import Database, Migrations, connect, migrate, schema_version
from blockdiff.errors import (
    DiskWaitTimeout,
    MissingConfigKey,
    NoDiskSnapshot,
    SaverError,
    SnapshotsNotRemoved,
    ThreadNotEmpty,
    UnknownSaverCheckpoint,
    UnknownSnapshot,
    UnknownStrategy,
)
from blockdiff.store.shared import open_shared_database
from blockdiff.store.store import Store

DB_NAME = "langgraph.sqlite"
DISK_SNAPSHOT_KEY = "disk_snapshot"
# How often a wait re-reads the database, for checkpoints saved by another
# process or saver (those in this saver wake it at once).
_POLL = 0.05
_LIST_PAGE = 64
# How many times put takes the disk snapshot again when a prune removed the
# one it reused before it was recorded.
_SNAPSHOT_ATTEMPTS = 3
_CHECKPOINT_COLUMNS = ("thread_id, checkpoint_ns, checkpoint_id, parent_checkpoint_id, "
                       "checkpoint_type, checkpoint, metadata_type, metadata, disk_snapshot, "
                       "created")
_TABLES = ("checkpoints", "checkpoint_runs", "blobs", "writes")

# Index i holds the script that takes the database from version i to i + 1.
# Append; never edit an applied one.
MIGRATIONS = [
    """
    CREATE TABLE checkpoints (
        thread_id TEXT NOT NULL,
        checkpoint_ns TEXT NOT NULL,
        checkpoint_id TEXT NOT NULL,
        parent_checkpoint_id TEXT,
        checkpoint_type TEXT NOT NULL,
        checkpoint BLOB NOT NULL,
        metadata_type TEXT NOT NULL,
        metadata BLOB NOT NULL,
        disk_snapshot TEXT,
        created REAL NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
    );
    CREATE INDEX checkpoints_order ON checkpoints (checkpoint_id);
    CREATE INDEX checkpoints_disk_snapshot ON checkpoints (disk_snapshot);
    CREATE TABLE blobs (
        thread_id TEXT NOT NULL,
        checkpoint_ns TEXT NOT NULL,
        channel TEXT NOT NULL,
        version TEXT NOT NULL,
        type TEXT NOT NULL,
        value BLOB NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, channel, version)
    );
    CREATE TABLE writes (
        thread_id TEXT NOT NULL,
        checkpoint_ns TEXT NOT NULL,
        checkpoint_id TEXT NOT NULL,
        task_id TEXT NOT NULL,
        idx INTEGER NOT NULL,
        channel TEXT NOT NULL,
        type TEXT NOT NULL,
        value BLOB NOT NULL,
        task_path TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
    );
    """,
    # The run that made a checkpoint (its metadata's run_id, '' if none), for
    # delete_for_runs: metadata is serialized (and may be encrypted), so SQL
    # cannot read it. A table of its own, so that a process of an earlier
    # version still running on the store keeps saving; a checkpoint without a
    # row here (saved before, or by such a process) has its metadata read once.
    """
    CREATE TABLE checkpoint_runs (
        thread_id TEXT NOT NULL,
        checkpoint_ns TEXT NOT NULL,
        checkpoint_id TEXT NOT NULL,
        run_id TEXT NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
    );
    CREATE INDEX checkpoint_runs_run_id ON checkpoint_runs (run_id);
    """,
]
# The same versions on PostgreSQL: BYTEA for BLOB, DOUBLE PRECISION for REAL,
# text compared byte by byte (COLLATE "C": checkpoint ids are ordered), as
# SQLite's is.
POSTGRESQL_MIGRATIONS = [
    """
    CREATE TABLE checkpoints (
        thread_id TEXT COLLATE "C" NOT NULL,
        checkpoint_ns TEXT COLLATE "C" NOT NULL,
        checkpoint_id TEXT COLLATE "C" NOT NULL,
        parent_checkpoint_id TEXT COLLATE "C",
        checkpoint_type TEXT COLLATE "C" NOT NULL,
        checkpoint BYTEA NOT NULL,
        metadata_type TEXT COLLATE "C" NOT NULL,
        metadata BYTEA NOT NULL,
        disk_snapshot TEXT COLLATE "C",
        created DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
    );
    CREATE INDEX checkpoints_order ON checkpoints (checkpoint_id);
    CREATE INDEX checkpoints_disk_snapshot ON checkpoints (disk_snapshot);
    CREATE TABLE blobs (
        thread_id TEXT COLLATE "C" NOT NULL,
        checkpoint_ns TEXT COLLATE "C" NOT NULL,
        channel TEXT COLLATE "C" NOT NULL,
        version TEXT COLLATE "C" NOT NULL,
        type TEXT COLLATE "C" NOT NULL,
        value BYTEA NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, channel, version)
    );
    CREATE TABLE writes (
        thread_id TEXT COLLATE "C" NOT NULL,
        checkpoint_ns TEXT COLLATE "C" NOT NULL,
        checkpoint_id TEXT COLLATE "C" NOT NULL,
        task_id TEXT COLLATE "C" NOT NULL,
        idx BIGINT NOT NULL,
        channel TEXT COLLATE "C" NOT NULL,
        type TEXT COLLATE "C" NOT NULL,
        value BYTEA NOT NULL,
        task_path TEXT COLLATE "C" NOT NULL DEFAULT '',
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id, task_id, idx)
    );
    """,
    """
    CREATE TABLE checkpoint_runs (
        thread_id TEXT COLLATE "C" NOT NULL,
        checkpoint_ns TEXT COLLATE "C" NOT NULL,
        checkpoint_id TEXT COLLATE "C" NOT NULL,
        run_id TEXT COLLATE "C" NOT NULL,
        PRIMARY KEY (thread_id, checkpoint_ns, checkpoint_id)
    );
    CREATE INDEX checkpoint_runs_run_id ON checkpoint_runs (run_id);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
# Databases made before the db layer count their migrations in PRAGMA user_version.
SCHEMA = Migrations("langgraph", MIGRATIONS, legacy="user_version",
                    postgresql=POSTGRESQL_MIGRATIONS)

# Each table's columns (in the order of its DDL) and key, for the upserts
# that replace a row ("INSERT OR REPLACE" on SQLite only).
_COLUMNS = {
    "checkpoints": (_CHECKPOINT_COLUMNS.split(", "), ("thread_id", "checkpoint_ns",
                                                      "checkpoint_id")),
    "blobs": (("thread_id", "checkpoint_ns", "channel", "version", "type", "value"),
              ("thread_id", "checkpoint_ns", "channel", "version")),
    "writes": (("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx", "channel",
                "type", "value", "task_path"),
               ("thread_id", "checkpoint_ns", "checkpoint_id", "task_id", "idx")),
    "checkpoint_runs": (("thread_id", "checkpoint_ns", "checkpoint_id", "run_id"),
                        ("thread_id", "checkpoint_ns", "checkpoint_id")),
}


def _upsert(table: str, rows: str | None = None, *, replace: bool = True) -> str:
    """An INSERT into ``table`` of every column, from ``rows`` (a SELECT; by
    default one row of ``?``), that replaces a row of the same key
    (``replace``) or keeps it."""
    columns, key = _COLUMNS[table]
    source = rows or f"VALUES ({', '.join('?' * len(columns))})"
    if replace:
        update = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
        action = f"DO UPDATE SET {update}"
    else:
        action = "DO NOTHING"
    return (f"INSERT INTO {table} ({', '.join(columns)}) {source} "
            f"ON CONFLICT ({', '.join(key)}) {action}")


def _configurable(config: RunnableConfig | None) -> dict:
    return (config or {}).get("configurable") or {}


def _thread_id(config: RunnableConfig | None) -> str:
    thread_id = _configurable(config).get("thread_id")
    if thread_id is None or thread_id == "":
        raise MissingConfigKey(
            "the config has no thread_id; pass config={'configurable': {'thread_id': ...}}")
    return str(thread_id)


def _key_config(thread_id: str, checkpoint_ns: str, checkpoint_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": thread_id, "checkpoint_ns": checkpoint_ns,
                             "checkpoint_id": checkpoint_id}}


class BlockdiffSaver(BaseCheckpointSaver[str]):
    """LangGraph checkpoints in a blockdiff store, each tied to a disk snapshot.

    ``store`` is a :class:`~blockdiff.store.store.Store` or its directory; ``disk``
    follows the disk protocol of :mod:`blockdiff.agent.disks` (None: no snapshots).
    ``db``: an open :class:`~blockdiff.db.Database` for the checkpoints
    instead of the store's ``langgraph.sqlite`` (its tables made if it has
    none), which the saver then owns and closes; ``agent_db``: where the
    agent checkpoints whose disk snapshots a prune leaves alone are, if not
    in the store's ``agent.sqlite`` (the saver reads it, and leaves it open).
    Close the saver when done (or use it as a context manager); a ``Store``
    passed in stays open.
    """

    def __init__(self, store: Store | str | os.PathLike, disk: Any = None, *,
                 serde: SerializerProtocol | None = None, db: Database | None = None,
                 agent_db: Database | None = None) -> None:
        super().__init__(serde=serde)
        # The store disk snapshots are removed from by prune and delete_for_runs;
        # a directory is opened only for that.
        self._store = store if isinstance(store, Store) else None
        if isinstance(store, Store):
            self.root = Path(store.root)
            mode = getattr(store, "file_mode", 0o600)
            shared = store.shared
        else:
            with Store(store) as opened:   # refuses a directory that is no store
                self.root = Path(opened.root)
                mode = getattr(opened, "file_mode", 0o600)
                shared = opened.shared
        self.disk = disk
        # A store shared by several hosts keeps the checkpoints, and the
        # agent records a prune consults, in its shared database; the disk's
        # snapshots are uploaded in the background.
        self._own_agent_db = None
        if shared is not None:
            if db is None:
                db = open_shared_database(shared, self.root, "langgraph")
            if agent_db is None:
                agent_db = self._own_agent_db = open_shared_database(shared, self.root, "agent")
            disk_store = getattr(disk, "store", None)
            if getattr(disk_store, "shared", None) is not None:
                disk_store.push_in_background()
        # The SQLite file of the checkpoints; None in a Database given.
        self.path = self.root / DB_NAME if db is None else None
        self._releases = SnapshotRelease(self._store, self.root, agent_db)
        # One connection shared by LangGraph's worker threads, used under its
        # lock: a connection per thread would outlive pool threads and hold
        # the file open.
        self._db = db if db is not None else connect(self.path, mode=mode)
        self._lock = self._db.lock
        try:
            migrate(self._db, SCHEMA)
        except BaseException:
            self._db.close()
            if self._own_agent_db is not None:
                self._own_agent_db.close()
            raise
        # Disk calls are serialised: a snapshot and a restore of one disk must
        # never overlap, and ImageDisk refuses a second commit as busy.
        self._disk_lock = threading.Lock()
        self._saved = threading.Condition()
        # thread id -> (checkpoint id, error) of a top-level save that failed.
        # LangGraph then skips the saves queued behind it, so nodes waiting on
        # any later checkpoint of that thread must give up too.
        self._failed: dict[str, tuple[str, BaseException]] = {}

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        self._db.close()
        if self._own_agent_db is not None:
            self._own_agent_db.close()

    def __enter__(self) -> BlockdiffSaver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def schema_version(self) -> int:
        """How many of the saver's migrations the database has."""
        with self._lock:
            return schema_version(self._db, SCHEMA)

    # -------------------------------------------------------------- reading

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint the config names, or the thread's latest; None if none."""
        thread_id = _thread_id(config)
        checkpoint_ns = _configurable(config).get("checkpoint_ns", "")
        checkpoint_id = get_checkpoint_id(config)
        with self._db.reading() as db:
            if checkpoint_id:
                row = db.execute(
                    "SELECT checkpoint_id FROM checkpoints WHERE thread_id = ? "
                    "AND checkpoint_ns = ? AND checkpoint_id = ?",
                    (thread_id, checkpoint_ns, checkpoint_id)).fetchone()
            else:
                row = db.execute(
                    "SELECT checkpoint_id FROM checkpoints WHERE thread_id = ? "
                    "AND checkpoint_ns = ? ORDER BY checkpoint_id DESC LIMIT 1",
                    (thread_id, checkpoint_ns)).fetchone()
            if row is None:
                return None
            return self._load(db, thread_id, checkpoint_ns, row[0])

    def _load(self, db, thread_id: str, checkpoint_ns: str,
              checkpoint_id: str) -> CheckpointTuple | None:
        row = db.execute(
            "SELECT parent_checkpoint_id, checkpoint_type, checkpoint, metadata_type, metadata "
            "FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ? AND checkpoint_id = ?",
            (thread_id, checkpoint_ns, checkpoint_id)).fetchone()
        if row is None:
            return None
        parent_id, checkpoint_type, checkpoint_blob, metadata_type, metadata_blob = row
        checkpoint: Checkpoint = self.serde.loads_typed((checkpoint_type, checkpoint_blob))
        versions = checkpoint["channel_versions"]
        wanted = [(channel, str(version)) for channel, version in versions.items()]
        values: dict[str, Any] = {}
        # Blobs are looked up by (channel, version) pairs: a checkpoint stores only
        # the channels that changed, and shares the rest with its ancestors. The
        # pairs are a VALUES list joined on the blobs' key: one index lookup each.
        for chunk in chunks(wanted, CHUNK // 2):
            pairs = ", ".join(["(?, ?)"] * len(chunk))
            for channel, value_type, value in db.execute(
                    f"WITH wanted (channel, version) AS (VALUES {pairs}) "
                    "SELECT b.channel, b.type, b.value FROM wanted w JOIN blobs b "
                    "ON b.thread_id = ? AND b.checkpoint_ns = ? AND b.channel = w.channel "
                    "AND b.version = w.version",
                    (*(item for pair in chunk for item in pair), thread_id, checkpoint_ns)):
                if value_type != "empty":
                    values[channel] = self.serde.loads_typed((value_type, value))
        writes = [
            (task_id, channel, self.serde.loads_typed((value_type, value)))
            for task_id, channel, value_type, value in db.execute(
                "SELECT task_id, channel, type, value FROM writes WHERE thread_id = ? "
                "AND checkpoint_ns = ? AND checkpoint_id = ? ORDER BY task_path, task_id, idx",
                (thread_id, checkpoint_ns, checkpoint_id))]
        return CheckpointTuple(
            config=_key_config(thread_id, checkpoint_ns, checkpoint_id),
            checkpoint={**checkpoint, "channel_values": values},
            metadata=self.serde.loads_typed((metadata_type, metadata_blob)),
            parent_config=(_key_config(thread_id, checkpoint_ns, parent_id)
                           if parent_id else None),
            pending_writes=writes,
        )

    def list(self, config: RunnableConfig | None, *, filter: dict[str, Any] | None = None,
             before: RunnableConfig | None = None,
             limit: int | None = None) -> Iterator[CheckpointTuple]:
        """Checkpoints, newest first: of the config's thread (every thread if
        None), namespace and checkpoint id when it gives them; whose metadata
        has every ``filter`` item; older than ``before``; at most ``limit``."""
        conf = _configurable(config)
        where, params = [], []
        for key in ("thread_id", "checkpoint_ns", "checkpoint_id"):
            if conf.get(key) is not None and (key == "checkpoint_ns" or conf.get(key) != ""):
                where.append(f"{key} = ?")
                params.append(str(conf[key]))
        if before is not None and (before_id := get_checkpoint_id(before)):
            where.append("checkpoint_id < ?")
            params.append(before_id)
        remaining = limit
        last: tuple[str, str, str] | None = None
        while remaining is None or remaining > 0:
            # Fetched a page at a time and not held open across yields, so
            # the caller may write (or stop) between items.
            page_where = list(where)
            page_params = list(params)
            if last is not None:
                page_where.append("(checkpoint_id, thread_id, checkpoint_ns) < (?, ?, ?)")
                page_params.extend(last)
            with self._lock:
                rows = self._db.execute(
                    "SELECT checkpoint_id, thread_id, checkpoint_ns, metadata_type, metadata "
                    "FROM checkpoints" + (" WHERE " + " AND ".join(page_where) if page_where
                                          else "")
                    + " ORDER BY checkpoint_id DESC, thread_id DESC, checkpoint_ns DESC LIMIT ?",
                    (*page_params, _LIST_PAGE)).fetchall()
            if not rows:
                return
            last = rows[-1][:3]
            for checkpoint_id, thread_id, checkpoint_ns, metadata_type, metadata in rows:
                if filter:
                    found = self.serde.loads_typed((metadata_type, metadata))
                    if not all(found.get(key) == value for key, value in filter.items()):
                        continue
                with self._db.reading() as db:
                    item = self._load(db, thread_id, checkpoint_ns, checkpoint_id)
                if item is None:      # deleted since the page was read
                    continue
                yield item
                if remaining is not None:
                    remaining -= 1
                    if remaining <= 0:
                        return
            if len(rows) < _LIST_PAGE:
                return

    # -------------------------------------------------------------- writing

    def put(self, config: RunnableConfig, checkpoint: Checkpoint, metadata: CheckpointMetadata,
            new_versions: ChannelVersions) -> RunnableConfig:
        """Save a checkpoint, after snapshotting the disk when it is top-level."""
        thread_id = _thread_id(config)
        checkpoint_ns = _configurable(config).get("checkpoint_ns", "")
        try:
            stored = checkpoint.copy()
            values: dict[str, Any] = stored.pop("channel_values")  # type: ignore[misc]
            blobs = []
            for channel, version in new_versions.items():
                value_type, value = (self.serde.dumps_typed(values[channel])
                                     if channel in values else ("empty", b""))
                blobs.append((thread_id, checkpoint_ns, channel, str(version), value_type, value))
            checkpoint_type, checkpoint_blob = self.serde.dumps_typed(stored)
            meta = dict(get_checkpoint_metadata(config, metadata))
            # The key always tells the truth about this checkpoint: metadata
            # copied from a loaded checkpoint may carry that one's snapshot.
            meta.pop(DISK_SNAPSHOT_KEY, None)
            run_id = "" if meta.get("run_id") is None else str(meta["run_id"])
            for _attempt in range(_SNAPSHOT_ATTEMPTS):
                # The disk first: a checkpoint must never name a snapshot that
                # does not exist, while a snapshot whose checkpoint failed to
                # save is only garbage for the store's gc.
                snapshot = None
                if self.disk is not None and checkpoint_ns == "":
                    snapshot = self._disk_call(
                        "checkpoint",
                        message=f"langgraph {thread_id} step {metadata.get('step')}",
                        meta={"langgraph.thread": thread_id,
                              "langgraph.checkpoint": checkpoint["id"]},
                        skip_unchanged=True)
                    meta[DISK_SNAPSHOT_KEY] = snapshot
                metadata_type, metadata_blob = self.serde.dumps_typed(meta)
                with self._db.transaction() as db:
                    # An unchanged disk reuses its last snapshot, which a prune
                    # may have removed since (it removes under this lock): then
                    # the disk is snapshotted again.
                    if snapshot is not None and self._snapshot_removed(snapshot):
                        continue
                    db.executemany(_upsert("blobs"), blobs)
                    db.execute(
                        _upsert("checkpoints"),
                        (thread_id, checkpoint_ns, checkpoint["id"],
                         _configurable(config).get("checkpoint_id"), checkpoint_type,
                         checkpoint_blob, metadata_type, metadata_blob, snapshot, time.time()))
                    db.execute(_upsert("checkpoint_runs"),
                               (thread_id, checkpoint_ns, checkpoint["id"], run_id))
                break
            else:
                raise SaverError(f"the disk snapshot of checkpoint {checkpoint['id']} of thread "
                                 f"{thread_id!r} was removed from the store {_SNAPSHOT_ATTEMPTS} "
                                 f"times before it could be recorded")
        except BaseException as e:
            if checkpoint_ns == "":
                with self._saved:
                    self._failed[thread_id] = (checkpoint["id"], e)
                    self._saved.notify_all()
            raise
        with self._saved:
            failed = self._failed.get(thread_id)
            if failed is not None and failed[0] <= checkpoint["id"]:
                del self._failed[thread_id]
            self._saved.notify_all()
        return _key_config(thread_id, checkpoint_ns, checkpoint["id"])

    def put_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                   task_id: str, task_path: str = "") -> None:
        """Save a task's writes against the checkpoint the config names."""
        thread_id = _thread_id(config)
        checkpoint_ns = _configurable(config).get("checkpoint_ns", "")
        checkpoint_id = get_checkpoint_id(config)
        if not checkpoint_id:
            raise MissingConfigKey("put_writes needs the config of a saved checkpoint; "
                                   "this one has no checkpoint_id")
        rows = []
        for idx, (channel, value) in enumerate(writes):
            value_type, blob = self.serde.dumps_typed(value)
            rows.append((WRITES_IDX_MAP.get(channel, idx), channel, value_type, blob))
        with self._db.transaction() as db:
            for idx, channel, value_type, blob in rows:
                # A task's ordinary writes are final once saved (a retry must
                # not change them); its special writes (error, interrupt,
                # resume) are replaced by the latest.
                db.execute(_upsert("writes", replace=idx < 0),
                           (thread_id, checkpoint_ns, checkpoint_id, task_id, idx, channel,
                            value_type, blob, task_path))

    def delete_thread(self, thread_id: str) -> None:
        """Delete a thread's checkpoints and writes (its disk snapshots stay)."""
        with self._db.transaction() as db:
            for table in _TABLES:
                db.execute(f"DELETE FROM {table} WHERE thread_id = ?", (str(thread_id),))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint of a thread, in every namespace, with its
        channel values and pending writes, to another thread id; checkpoint
        ids, parents, metadata and disk snapshots stay as they are, so both
        threads name the same snapshots. The target must have no checkpoint
        (``ThreadNotEmpty``); a source without any copies nothing."""
        source, target = str(source_thread_id), str(target_thread_id)
        with self._db.transaction() as db:
            if db.execute("SELECT 1 FROM checkpoints WHERE thread_id = ? LIMIT 1",
                          (target,)).fetchone():
                raise ThreadNotEmpty(
                    f"thread {target!r} already has checkpoints in {self._db.name}; copy into a "
                    f"new thread id, or delete that thread first")
            columns = _CHECKPOINT_COLUMNS.split(", ", 1)[1]
            db.execute(f"INSERT INTO checkpoints ({_CHECKPOINT_COLUMNS}) "
                       f"SELECT ?, {columns} FROM checkpoints WHERE thread_id = ?",
                       (target, source))
            for table in ("checkpoint_runs", "blobs", "writes"):
                # (A SELECT with a WHERE: SQLite's parser takes the ON of
                # ON CONFLICT right after a bare FROM for a join's.)
                rest = ", ".join(_COLUMNS[table][0][1:])
                db.execute(_upsert(table, f"SELECT ?, {rest} FROM {table} WHERE thread_id = ?"),
                           (target, source))
        with self._saved:
            self._saved.notify_all()

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Thin out threads' checkpoints. ``"keep_latest"`` keeps the newest
        checkpoint of each namespace, with its pending writes, and the
        ancestors (with their writes) that a ``DeltaChannel`` of it is rebuilt
        from, back to each such channel's last full snapshot; ``"delete"``
        keeps nothing. Deleted checkpoints take their writes and the channel
        values no kept one uses, and the disk snapshots that no checkpoint
        names any more are removed from the store (see the module's notes)."""
        if strategy not in ("keep_latest", "delete"):
            raise UnknownStrategy(f"no prune strategy {strategy!r}; "
                                  f"use 'keep_latest' or 'delete'")
        threads = list(dict.fromkeys(str(t) for t in thread_ids))
        if not threads:
            return

        def select(db) -> list[tuple]:
            doomed = []
            for thread in threads:
                for (ns,) in db.execute("SELECT DISTINCT checkpoint_ns FROM checkpoints "
                                        "WHERE thread_id = ?", (thread,)).fetchall():
                    rows = db.execute(
                        "SELECT checkpoint_id, parent_checkpoint_id, disk_snapshot "
                        "FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = ? "
                        "ORDER BY checkpoint_id DESC", (thread, ns)).fetchall()
                    keep = (set() if strategy == "delete"
                            else needed_by_latest(self.serde, db, thread, ns, rows))
                    doomed += [(thread, ns, cid, snap) for cid, _, snap in rows
                               if cid not in keep]
                if strategy == "delete":
                    # Writes and values left without a checkpoint go too.
                    for table in _TABLES[1:]:
                        db.execute(f"DELETE FROM {table} WHERE thread_id = ?", (thread,))
            return doomed

        self._delete_and_release(select)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints, in any thread and namespace, whose metadata
        has one of these ``run_id``s, with their writes, the channel values no
        other checkpoint uses and the disk snapshots no checkpoint names any
        more (see the module's notes). The other checkpoints are left as they
        are: one whose parent was deleted keeps its parent id."""
        runs = sorted({str(r) for r in run_ids})
        if not runs:
            return

        def select(db) -> list[tuple]:
            self._record_run_ids(db)
            doomed = []
            for chunk in chunks(runs):
                doomed += db.execute(
                    "SELECT c.thread_id, c.checkpoint_ns, c.checkpoint_id, c.disk_snapshot "
                    "FROM checkpoint_runs r JOIN checkpoints c USING (thread_id, checkpoint_ns, "
                    f"checkpoint_id) WHERE r.run_id IN ({marks(chunk)})", chunk).fetchall()
            return doomed

        self._delete_and_release(select)

    # ------------------------------------------------------------ deleting

    def _record_run_ids(self, db) -> None:
        """Record the run of checkpoints saved without (before the table, or
        by an earlier version's process), from their metadata."""
        rows = db.execute(
            "SELECT c.thread_id, c.checkpoint_ns, c.checkpoint_id, c.metadata_type, c.metadata "
            "FROM checkpoints c LEFT JOIN checkpoint_runs r USING (thread_id, checkpoint_ns, "
            "checkpoint_id) WHERE r.run_id IS NULL").fetchall()
        found = []
        for thread_id, checkpoint_ns, checkpoint_id, metadata_type, metadata in rows:
            run_id = (self.serde.loads_typed((metadata_type, metadata)) or {}).get("run_id")
            found.append((thread_id, checkpoint_ns, checkpoint_id,
                          "" if run_id is None else str(run_id)))
        db.executemany(_upsert("checkpoint_runs"), found)

    def _delete_and_release(self, select) -> None:
        """In one transaction: delete the checkpoints ``select(db)`` names
        (``(thread, ns, id, disk snapshot)``) with their writes and the blobs
        no remaining checkpoint of their namespace uses, then remove from the
        store the disk snapshots nothing names any more. The snapshots go
        under the database lock, so that a put that reused one (an unchanged
        disk) sees it gone and snapshots the disk again. Once a snapshot may
        have gone, the deletion commits whatever happens next."""
        failure = None
        with self._db.transaction() as db:
            doomed = select(db)
            keys = [row[:3] for row in doomed]
            for table in ("checkpoints", "checkpoint_runs", "writes"):
                db.executemany(f"DELETE FROM {table} WHERE thread_id = ? "
                               "AND checkpoint_ns = ? AND checkpoint_id = ?", keys)
            for thread_id, checkpoint_ns in sorted({row[:2] for row in doomed}):
                drop_unused_blobs(self.serde, db, thread_id, checkpoint_ns)
            try:
                errors = self._releases.release(db, {row[3] for row in doomed if row[3]})
            except BaseException as e:     # raised once the deletion is committed
                failure = e
        if failure is not None:
            raise failure
        if errors:
            listed = "; ".join(f"{sid}: {e}" for sid, e in sorted(errors.items()))
            raise SnapshotsNotRemoved(
                f"the checkpoints were deleted, but {len(errors)} disk snapshot(s) only they "
                f"used could not be removed from {self.root} ({listed}); remove them with: "
                f"blockdiff rm --store {self.root} ID", errors)

    def _snapshot_removed(self, snapshot: str) -> bool:
        """Whether a snapshot the disk returned is gone from its store (a prune
        removed it); False when the disk has no store to ask."""
        store = getattr(self.disk, "store", None)
        if not isinstance(store, Store):
            return False
        try:
            store.get(snapshot)
        except UnknownSnapshot:
            return True
        return False

    def get_next_version(self, current: str | None, channel: None = None) -> str:
        if current is None:
            current_v = 0
        elif isinstance(current, int):
            current_v = current
        else:
            current_v = int(current.split(".")[0])
        # The random fraction keeps versions written by two diverging forks of
        # one thread from colliding in the blobs table.
        return f"{current_v + 1:032}.{random.random():016}"

    # ---------------------------------------------------------------- async

    async def _in_thread(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(fn, *args, **kwargs))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self._in_thread(self.get_tuple, config)

    async def alist(self, config: RunnableConfig | None, *,
                    filter: dict[str, Any] | None = None, before: RunnableConfig | None = None,
                    limit: int | None = None) -> AsyncIterator[CheckpointTuple]:
        items = self.list(config, filter=filter, before=before, limit=limit)
        done = object()
        while (item := await self._in_thread(next, items, done)) is not done:
            yield item

    async def aput(self, config: RunnableConfig, checkpoint: Checkpoint,
                   metadata: CheckpointMetadata, new_versions: ChannelVersions) -> RunnableConfig:
        return await self._in_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(self, config: RunnableConfig, writes: Sequence[tuple[str, Any]],
                          task_id: str, task_path: str = "") -> None:
        await self._in_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self._in_thread(self.delete_thread, thread_id)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._in_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._in_thread(self.prune, thread_ids, strategy=strategy)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._in_thread(self.delete_for_runs, run_ids)

    # ----------------------------------------------------------------- disk

    def _disk_call(self, method: str, *args, **kwargs):
        # LangGraph saves from its worker threads: one disk operation at a time.
        with self._disk_lock:
            return getattr(self.disk, method)(*args, **kwargs)

    def disk_snapshot(self, config: RunnableConfig) -> str | None:
        """The disk snapshot of the checkpoint the config names (of the thread's
        latest if it names none); None if it has none or the thread has no
        checkpoint. ``UnknownSaverCheckpoint`` if the named checkpoint is not saved."""
        thread_id = _thread_id(config)
        checkpoint_ns = _configurable(config).get("checkpoint_ns", "")
        checkpoint_id = get_checkpoint_id(config)
        with self._lock:
            if checkpoint_id:
                row = self._db.execute(
                    "SELECT disk_snapshot FROM checkpoints WHERE thread_id = ? "
                    "AND checkpoint_ns = ? AND checkpoint_id = ?",
                    (thread_id, checkpoint_ns, checkpoint_id)).fetchone()
                if row is None:
                    raise UnknownSaverCheckpoint(
                        f"no checkpoint {checkpoint_id!r} in thread {thread_id!r}"
                        + (f" (namespace {checkpoint_ns!r})" if checkpoint_ns else "")
                        + f" of {self._db.name}; list them with graph.get_state_history(config)")
            else:
                row = self._db.execute(
                    "SELECT disk_snapshot FROM checkpoints WHERE thread_id = ? "
                    "AND checkpoint_ns = ? ORDER BY checkpoint_id DESC LIMIT 1",
                    (thread_id, checkpoint_ns)).fetchone()
        return None if row is None else row[0]

    def restore_disk(self, config: RunnableConfig) -> str:
        """Make the disk what it was at the checkpoint the config names (the
        thread's latest if it names none); returns the snapshot id. Call it
        before replaying or forking from that checkpoint."""
        if self.disk is None:
            raise SaverError("this saver has no disk to restore; "
                             "construct it as BlockdiffSaver(store, disk)")
        snapshot = self.disk_snapshot(config)
        if snapshot is None:
            thread_id = _thread_id(config)
            checkpoint_id = get_checkpoint_id(config)
            if checkpoint_id is None and self.get_tuple(config) is None:
                raise UnknownSaverCheckpoint(
                    f"thread {thread_id!r} has no checkpoint in {self._db.name}")
            which = f"checkpoint {checkpoint_id}" if checkpoint_id else "the latest checkpoint"
            raise NoDiskSnapshot(f"{which} of thread {thread_id!r} has no disk snapshot: it was "
                                 f"saved without a disk, or by a subgraph")
        self._disk_call("restore", snapshot)
        return snapshot

    def wait_for_disk(self, config: RunnableConfig, timeout: float | None = 300.0) -> None:
        """Wait until the disk snapshot of the checkpoint a node runs from is
        taken; call it with the node's ``config`` before the node writes to the
        disk. Returns at once without a disk, or when LangGraph saves only on
        exit (``durability="exit"``), which takes no snapshot between steps."""
        if self.disk is None:
            return
        conf = _configurable(config)
        # LangGraph passes the mode to nodes only under this internal key, and
        # only when it is not the default ("async", which saves between steps).
        if conf.get("__pregel_durability") == "exit":
            return
        thread_id = _thread_id(config)
        checkpoint_id = (conf.get("checkpoint_map") or {}).get("")
        if checkpoint_id is None and conf.get("checkpoint_ns", "") == "":
            checkpoint_id = conf.get("checkpoint_id")
        if not checkpoint_id:
            raise MissingConfigKey("wait_for_disk needs the config LangGraph passes to a node "
                                   "(it names the checkpoint the node runs from)")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._saved:
            while True:
                with self._lock:
                    if self._db.execute(
                            "SELECT 1 FROM checkpoints WHERE thread_id = ? AND checkpoint_ns = '' "
                            "AND checkpoint_id = ?", (thread_id, checkpoint_id)).fetchone():
                        return
                failed_id, error = self._failed.get(thread_id, (None, None))
                if failed_id is not None and failed_id <= checkpoint_id:
                    raise SaverError(f"saving checkpoint {failed_id} of thread {thread_id!r} "
                                     f"failed: {error}") from error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DiskWaitTimeout(
                        f"checkpoint {checkpoint_id} of thread {thread_id!r} was not saved "
                        f"within {timeout:g} s; is the graph compiled with this saver?")
                self._saved.wait(_POLL if left is None else min(left, _POLL))

    async def await_for_disk(self, config: RunnableConfig,
                             timeout: float | None = 300.0) -> None:
        """``wait_for_disk`` for async nodes."""
        await self._in_thread(self.wait_for_disk, config, timeout)
