"""What a LangGraph saver's deletions (``BlockdiffSaver.prune`` and
``delete_for_runs``) keep and take with them: the ancestors a kept
checkpoint's delta channels are rebuilt from, the channel values no
checkpoint uses any more, and the disk snapshots left unneeded, removed from
the store only when no checkpoint of any thread names them, no agent
checkpoint does either, and the saver took them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from blockdiff.agent.disks import remove_disk_snapshot
from blockdiff.db import Database, connect
from blockdiff.errors import DatabaseError, UnknownSnapshot
from blockdiff.store.store import Store

# The agent layer's checkpoints (blockdiff.agent.agent.DB_NAME), whose disk
# snapshots a prune leaves alone.
AGENT_DB_NAME = "agent.sqlite"
# Host parameters per statement, below SQLite's limit.
CHUNK = 500


def chunks(items: list, size: int = CHUNK) -> Iterator[list]:
    """``items`` in lists of at most ``size``, for ``IN (...)`` lists."""
    for start in range(0, len(items), size):
        yield items[start:start + size]


def marks(chunk: list) -> str:
    """The ``?, ?, ...`` of an ``IN`` list of ``chunk``."""
    return ", ".join("?" * len(chunk))


def needed_by_latest(serde, db, thread_id: str, checkpoint_ns: str,
                     rows: list[tuple]) -> set[str]:
    """Of a namespace's checkpoints (``(id, parent, snapshot)``, newest
    first): the newest, and the ancestors LangGraph's ancestor walk
    (``get_delta_channel_history``) reads to rebuild its delta channels."""
    if not rows:
        return set()
    parents = {cid: parent for cid, parent, _ in rows}
    latest = rows[0][0]
    keep = {latest}
    metadata_type, metadata = db.execute(
        "SELECT metadata_type, metadata FROM checkpoints WHERE thread_id = ? "
        "AND checkpoint_ns = ? AND checkpoint_id = ?",
        (thread_id, checkpoint_ns, latest)).fetchone()
    # LangGraph counts, per delta channel, the steps since its last full
    # snapshot; a channel it lists is rebuilt from the ancestors' writes.
    counters = (serde.loads_typed((metadata_type, metadata)) or {}).get(
        "counters_since_delta_snapshot") or {}
    if not counters:
        return keep
    versions = _channel_versions(serde, db, thread_id, checkpoint_ns, latest)
    missing = {ch for ch in counters if ch in versions
               and not _has_value(db, thread_id, checkpoint_ns, ch, versions[ch])}
    cursor = parents[latest]
    while missing and cursor in parents:
        keep.add(cursor)
        versions = _channel_versions(serde, db, thread_id, checkpoint_ns, cursor)
        missing = {ch for ch in missing if not (
            ch in versions
            and _has_value(db, thread_id, checkpoint_ns, ch, versions[ch]))}
        cursor = parents[cursor]
    return keep


def _channel_versions(serde, db, thread_id: str, checkpoint_ns: str,
                      checkpoint_id: str) -> dict[str, Any]:
    checkpoint_type, checkpoint = db.execute(
        "SELECT checkpoint_type, checkpoint FROM checkpoints WHERE thread_id = ? "
        "AND checkpoint_ns = ? AND checkpoint_id = ?",
        (thread_id, checkpoint_ns, checkpoint_id)).fetchone()
    return serde.loads_typed((checkpoint_type, checkpoint))["channel_versions"]


def _has_value(db, thread_id: str, checkpoint_ns: str, channel: str, version) -> bool:
    return db.execute(
        "SELECT 1 FROM blobs WHERE thread_id = ? AND checkpoint_ns = ? AND channel = ? "
        "AND version = ? AND type != 'empty'",
        (thread_id, checkpoint_ns, channel, str(version))).fetchone() is not None


def drop_unused_blobs(serde, db, thread_id: str, checkpoint_ns: str) -> None:
    """Delete the channel values no checkpoint left in the namespace uses."""
    used = set()
    for checkpoint_type, checkpoint in db.execute(
            "SELECT checkpoint_type, checkpoint FROM checkpoints WHERE thread_id = ? "
            "AND checkpoint_ns = ?", (thread_id, checkpoint_ns)).fetchall():
        versions = serde.loads_typed((checkpoint_type, checkpoint))["channel_versions"]
        used.update((channel, str(version)) for channel, version in versions.items())
    unused = [(thread_id, checkpoint_ns, channel, version)
              for channel, version in db.execute(
                  "SELECT channel, version FROM blobs WHERE thread_id = ? "
                  "AND checkpoint_ns = ?", (thread_id, checkpoint_ns)).fetchall()
              if (channel, version) not in used]
    db.executemany("DELETE FROM blobs WHERE thread_id = ? AND checkpoint_ns = ? "
                   "AND channel = ? AND version = ?", unused)


class SnapshotRelease:
    """The removal of a saver's disk snapshots from ``store`` (None: the
    store at ``root``, opened to remove them), consulting the agent
    checkpoints in ``agent_db`` (None: the store's ``agent.sqlite``)."""

    def __init__(self, store: Store | None, root: Path, agent_db: Database | None):
        self.store = store
        self.root = root
        self.agent_db = agent_db

    def release(self, db, snapshots: set[str]) -> dict[str, BaseException]:
        """Remove from the store those of ``snapshots`` (named by checkpoints
        just deleted in ``db``'s transaction) that nothing needs any more:
        no checkpoint of any thread names them, nor an agent checkpoint, and
        a LangGraph saver took them. Returns the errors, by snapshot id."""
        unused = set(snapshots)
        for chunk in chunks(sorted(unused)):
            unused -= {r[0] for r in db.execute(
                "SELECT DISTINCT disk_snapshot FROM checkpoints "
                f"WHERE disk_snapshot IN ({marks(chunk)})", chunk)}
        unused -= self._agent_references(unused)
        if not unused:
            return {}
        errors: dict[str, BaseException] = {}
        with self._removal_store() as store:
            for snapshot_id in sorted(unused):
                try:
                    snap = store.get(snapshot_id)
                    # A snapshot another program took (a base image's, a VM's
                    # own) that an unchanged disk reused is not the saver's.
                    if "langgraph.checkpoint" not in (snap.meta or {}):
                        continue
                    remove_disk_snapshot(store, snapshot_id)
                except UnknownSnapshot:
                    continue        # removed already, or in another store
                except Exception as e:      # the rest are still removed
                    errors[snapshot_id] = e
        return errors

    def _agent_references(self, snapshots: set[str]) -> set[str]:
        """Those of ``snapshots`` that agent checkpoints (``blockdiff.agent.agent``,
        in the same store, or in ``agent_db``) name; all of them if that
        database cannot be read."""
        if self.agent_db is not None:
            return self._snapshots_named(self.agent_db, snapshots)
        path = self.root / AGENT_DB_NAME
        if not snapshots or not path.exists():
            return set()
        try:
            agent_db = connect(path, readonly=True)
        except (DatabaseError, OSError):
            return set(snapshots)
        try:
            return self._snapshots_named(agent_db, snapshots)
        finally:
            agent_db.close()

    @staticmethod
    def _snapshots_named(agent_db: Database, snapshots: set[str]) -> set[str]:
        """Those of ``snapshots`` that the agent checkpoints in ``agent_db``
        name; all of them if it cannot be read."""
        if not snapshots:
            return set()
        try:
            found = set()
            for chunk in chunks(sorted(snapshots)):
                found |= {r[0] for r in agent_db.execute(
                    "SELECT DISTINCT disk_snapshot FROM checkpoints "
                    f"WHERE disk_snapshot IN ({marks(chunk)})", chunk)}
            return found
        except (DatabaseError, OSError):
            return set(snapshots)

    @contextlib.contextmanager
    def _removal_store(self):
        if self.store is not None:
            yield self.store
        else:
            with Store(self.root, freeing=True) as store:
                yield store
