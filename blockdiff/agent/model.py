"""The agent's records and the database that holds them: threads, agent
checkpoints, the tool-call journal and approvals, in ``<store>/agent.sqlite``
beside the store's catalog. :mod:`blockdiff.agent.agent` builds the
``Agent``/``Step`` API on top."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from blockdiff.agent.sealing import PLAIN, Codec, SealingError, content_hash, create_private
from blockdiff.errors import AgentError, AmbiguousCheckpoint, UnknownCheckpoint, UnknownThread
from blockdiff.store.catalog import candidates, id_prefix, immediate_transaction, prefix_matches
from blockdiff.store.store import Store

DB_NAME = "agent.sqlite"
# 2: meta is redacted and sealed like the state; the content hash is taken
# over what is written, keyed when sealed (sealing.Codec.content_hash).
FORMAT_VERSION = 2


_LEGACY_HASH = "instr(content_hash, ':') = 0"
MIGRATIONS = [
    """
    CREATE TABLE threads (
        id TEXT PRIMARY KEY,
        created REAL NOT NULL,
        head TEXT,
        status TEXT NOT NULL DEFAULT 'idle',
        owner TEXT,
        lease_until REAL,
        disk TEXT,
        forked_from TEXT,
        meta TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE checkpoints (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        thread TEXT NOT NULL REFERENCES threads(id),
        parent TEXT,
        step INTEGER NOT NULL,
        version INTEGER NOT NULL,
        created REAL NOT NULL,
        expires REAL,
        reason TEXT NOT NULL,
        state BLOB NOT NULL,
        messages BLOB NOT NULL,
        content_hash TEXT NOT NULL,
        disk_snapshot TEXT,
        meta TEXT NOT NULL DEFAULT '{}'
    );
    CREATE INDEX checkpoints_thread ON checkpoints(thread, seq);
    CREATE TABLE journal (
        seq INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL UNIQUE,
        thread TEXT NOT NULL,
        base TEXT NOT NULL,
        position INTEGER NOT NULL,
        tool TEXT NOT NULL,
        args BLOB NOT NULL,
        status TEXT NOT NULL,
        result BLOB,
        error TEXT,
        started REAL NOT NULL,
        finished REAL,
        compensable INTEGER NOT NULL,
        external INTEGER NOT NULL,
        undo TEXT
    );
    CREATE INDEX journal_thread ON journal(thread, seq);
    CREATE TABLE approvals (
        id TEXT PRIMARY KEY,
        thread TEXT NOT NULL,
        checkpoint TEXT NOT NULL,
        action BLOB NOT NULL,
        created REAL NOT NULL,
        expires REAL,
        decision TEXT,
        decided REAL,
        decided_by TEXT,
        comment TEXT
    );
    CREATE INDEX approvals_thread ON approvals(thread);
    """,
    # Checkpoints whose content hash is a plain SHA-256 of the state before
    # redaction, as written before hashes were keyed: AgentDB rehashes them.
    f"""
    CREATE INDEX checkpoints_legacy_hash ON checkpoints(seq) WHERE {_LEGACY_HASH};
    """,
]


def _unknown_thread(thread_id: str, root) -> UnknownThread:
    """The one error every command given a thread that is not there raises."""
    return UnknownThread(f"no thread {thread_id!r} in {root}; list them with: "
                         f"blockdiff agent threads --store {root}")


def _unknown_checkpoint(checkpoint_id: str, where: str,
                        thread_id: str | None = None) -> UnknownCheckpoint:
    listing = (f"blockdiff agent history {thread_id}" if thread_id
               else "blockdiff agent history THREAD (threads: blockdiff agent threads)")
    return UnknownCheckpoint(f"no checkpoint {checkpoint_id!r} {where}; see a thread's with: "
                             f"{listing}")


@dataclass(frozen=True)
class Checkpoint:
    id: str
    thread: str
    parent: str | None
    step: int
    version: int
    created: float
    expires: float | None
    reason: str
    disk_snapshot: str | None
    meta: dict | None    # None: sealed, and read without the key
    content_hash: str


@dataclass(frozen=True)
class CheckpointResult:
    id: str
    skipped: bool        # nothing changed: no new node, ``id`` is the head
    seconds: float
    disk_seconds: float


@dataclass(frozen=True)
class JournalEntry:
    request_id: str
    thread: str
    base: str
    position: int
    tool: str
    status: str          # intent, done, failed, compensating, compensated, uncompensable
    started: float
    finished: float | None
    compensable: bool
    external: bool
    error: str | None


@dataclass(frozen=True)
class ThreadInfo:
    id: str
    created: float
    head: str | None
    status: str
    owner: str | None
    disk: str | None
    forked_from: str | None


@dataclass(frozen=True)
class Approval:
    id: str
    thread: str
    checkpoint: str
    action: object
    created: float
    expires: float | None
    decision: str | None   # approved, rejected, expired; None while pending
    comment: str | None

    @property
    def approved(self) -> bool:
        return self.decision == "approved"

    def __bool__(self) -> bool:
        return self.approved


@dataclass
class Compensation:
    """What a rewind or a failed run undid, and what it could not."""

    compensated: list[str] = field(default_factory=list)
    uncompensable: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)   # left for a process that has the tools



def _owner() -> str:
    try:
        with open(f"/proc/{os.getpid()}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        start = "0"
    return f"{socket.gethostname()}:{os.getpid()}:{start}"


def _owner_alive(owner: str) -> bool:
    host, pid, start = owner.rsplit(":", 2)
    if host != socket.gethostname():
        return True  # another host: only its lease can tell
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19] == start
    except (OSError, IndexError):
        return False



class AgentDB:
    """The agent tables, in ``<store>/agent.sqlite`` beside the store's catalog.

    ``codec`` (with the key, when sealed) reads checkpoints' meta; without
    it a sealed checkpoint's meta reads as None."""

    def __init__(self, store: Store, codec: Codec | None = None):
        self.store = store
        self.codec = codec
        path = store.root / DB_NAME
        create_private(path, getattr(store, "file_mode", 0o600))
        self.db = sqlite3.connect(path, timeout=60, isolation_level=None,
                                  check_same_thread=False)
        # What a rewrite or a delete leaves behind is zeroed, not left in free space.
        self.db.execute("PRAGMA secure_delete=ON")
        self.db.execute("PRAGMA journal_mode=WAL")
        # FULL: a journal intent must be on disk before the tool runs.
        self.db.execute("PRAGMA synchronous=FULL")
        with self.transaction() as db:
            # Read under the write lock: two processes opening a new store at
            # once migrate it once.
            version = db.execute("PRAGMA user_version").fetchone()[0]
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in filter(str.strip, script.split(";")):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version={number}")
        self._rehash_legacy()

    def _rehash_legacy(self) -> None:
        """Replace content hashes written before they were keyed (a plain
        SHA-256 of the state before redaction, which confirms a guess at a
        redacted or sealed value) by what :meth:`Codec.content_hash` gives.
        Sealed checkpoints need the key: without it they wait for a process
        that has it. The partial index makes this free once none are left."""
        rows = self.db.execute("SELECT id, state, messages, content_hash FROM checkpoints "
                               f"WHERE {_LEGACY_HASH}").fetchall()
        updates = []
        for checkpoint_id, state, messages, old in rows:
            if self.codec is not None:
                try:
                    parts = (self.codec.data(state, f"checkpoint {checkpoint_id} state"),
                             self.codec.data(messages, f"checkpoint {checkpoint_id} messages"))
                except SealingError:
                    continue
                new = self.codec.content_hash(*parts)
            elif state[:1] == PLAIN and messages[:1] == PLAIN:
                new = content_hash((state[1:], messages[1:]))
            else:
                continue
            updates.append((new, checkpoint_id, old))
        if updates:
            with self.transaction() as db:
                db.executemany("UPDATE checkpoints SET content_hash = ? "
                               "WHERE id = ? AND content_hash = ?", updates)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "AgentDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def transaction(self):
        return immediate_transaction(self.db)

    # threads
    def thread(self, thread_id: str) -> ThreadInfo:
        row = self.db.execute("SELECT id, created, head, status, owner, disk, forked_from "
                              "FROM threads WHERE id = ?", (thread_id,)).fetchone()
        if row is None:
            raise _unknown_thread(thread_id, self.store.root)
        return ThreadInfo(*row)

    def threads(self) -> list[ThreadInfo]:
        return [ThreadInfo(*r) for r in self.db.execute(
            "SELECT id, created, head, status, owner, disk, forked_from FROM threads "
            "ORDER BY created")]

    # checkpoints
    _CP = ("SELECT id, thread, parent, step, version, created, expires, reason, disk_snapshot, "
           "meta, content_hash FROM checkpoints")

    def _checkpoint(self, row) -> Checkpoint:
        return Checkpoint(*row[:9], self._meta(row[0], row[9]), row[10])

    def _meta(self, checkpoint_id: str, stored) -> dict | None:
        if isinstance(stored, str):          # in the clear
            return json.loads(stored)
        if self.codec is None or not self.codec.sealing:
            return json.loads(stored[1:]) if stored[:1] == PLAIN else None
        return self.codec.decode(stored, f"checkpoint {checkpoint_id} meta")

    def checkpoint(self, checkpoint_id: str, thread_id: str | None = None) -> Checkpoint:
        """The checkpoint ``checkpoint_id``, an id or a unique prefix of at
        least 4 hex digits (``AmbiguousCheckpoint`` if it begins several);
        the result's ``id`` is the full id. ``thread_id``, if given, only
        names the thread whose history the error points to."""
        row = self.db.execute(self._CP + " WHERE id = ?", (checkpoint_id,)).fetchone()
        if row is None and (prefix := id_prefix(checkpoint_id)) is not None:
            ids, total = prefix_matches(self.db, "checkpoints", prefix)
            if total > 1:
                raise AmbiguousCheckpoint(
                    f"checkpoint id {checkpoint_id!r} is ambiguous: {total} checkpoints in "
                    f"{self.store.root} begin with it ({candidates(ids, total)}); give more "
                    f"of its digits")
            if ids:
                row = self.db.execute(self._CP + " WHERE id = ?", (ids[0],)).fetchone()
        if row is None:
            raise _unknown_checkpoint(checkpoint_id, f"in {self.store.root}", thread_id)
        return self._checkpoint(row)

    def resolve_checkpoint(self, checkpoint_id: str) -> str:
        """The full id of the checkpoint ``checkpoint_id`` names: an id, or a
        unique prefix of one (as for :meth:`checkpoint`)."""
        return self.checkpoint(checkpoint_id).id

    def contents(self, checkpoint_id: str) -> tuple[bytes, bytes]:
        return self.db.execute("SELECT state, messages FROM checkpoints WHERE id = ?",
                               (checkpoint_id,)).fetchone()

    def history(self, thread_id: str) -> list[Checkpoint]:
        """The head's ancestry, newest first (crossing into the thread forked from)."""
        out, cursor = [], self.thread(thread_id).head
        while cursor:
            row = self.db.execute(self._CP + " WHERE id = ?", (cursor,)).fetchone()
            if row is None:
                break  # older checkpoints expired and were collected
            out.append(self._checkpoint(row))
            cursor = out[-1].parent
        return out

    def gc(self, *, now: float | None = None, dry_run: bool = False) -> list[Checkpoint]:
        """Remove checkpoints past their expiry, except a thread's head and
        one a pending approval waits at, and the disk snapshots that only
        they used (``Store.rm`` keeps every other snapshot restorable)."""
        now = time.time() if now is None else now
        with self.transaction() as db:
            keep = {r[0] for r in db.execute("SELECT head FROM threads WHERE head IS NOT NULL")}
            keep |= {r[0] for r in db.execute("SELECT checkpoint FROM approvals "
                                              "WHERE decision IS NULL")}
            expired = [self._checkpoint(r) for r in db.execute(
                self._CP + " WHERE expires IS NOT NULL AND expires <= ? ORDER BY seq", (now,))
                if r[0] not in keep]
            if dry_run or not expired:
                return expired
            db.executemany("DELETE FROM checkpoints WHERE id = ?", [(c.id,) for c in expired])
            still_used = {r[0] for r in db.execute(
                "SELECT DISTINCT disk_snapshot FROM checkpoints WHERE disk_snapshot IS NOT NULL")}
        from blockdiff.store.store import UnknownSnapshot

        for snapshot in {c.disk_snapshot for c in expired if c.disk_snapshot} - still_used:
            with contextlib.suppress(UnknownSnapshot):
                self.store.rm(snapshot)
        return expired

    def tree(self, label: Callable[[str], str] = str) -> str:
        """Every thread's checkpoints as one tree: forks and rewinds branch.
        ``label`` is applied to each node's text (thread, step and reason):
        the command line escapes what a terminal would act on."""
        from types import SimpleNamespace

        from blockdiff.engine.view import render_tree

        nodes = [SimpleNamespace(seq=r[0], id=r[1], parent=r[2],
                                 message=label(f"[{r[3]}] step {r[4]}: {r[5]}"))
                 for r in self.db.execute("SELECT seq, id, parent, thread, step, reason "
                                          "FROM checkpoints")]
        return render_tree(nodes)

    def all_checkpoints(self, thread_id: str) -> list[Checkpoint]:
        self.thread(thread_id)
        return [self._checkpoint(r) for r in self.db.execute(
            self._CP + " WHERE thread = ? ORDER BY seq", (thread_id,))]

    # journal
    _J = ("SELECT request_id, thread, base, position, tool, status, started, finished, "
          "compensable, external, error FROM journal")

    def journal(self, thread_id: str) -> list[JournalEntry]:
        self.thread(thread_id)
        return [JournalEntry(*r[:8], bool(r[8]), bool(r[9]), r[10]) for r in self.db.execute(
            self._J + " WHERE thread = ? ORDER BY seq", (thread_id,))]

    def entry(self, rid: str):
        return self.db.execute("SELECT status, args, result, tool FROM journal "
                               "WHERE request_id = ?", (rid,)).fetchone()

    # approvals
    def _approval(self, row, codec: Codec | None) -> Approval:
        action = None
        if codec is not None:
            action = codec.decode(row[3], f"approval {row[0]}")
        return Approval(row[0], row[1], row[2], action, *row[4:])

    def approvals(self, thread_id: str | None = None, *, pending_only: bool = False,
                  codec: Codec | None = None) -> list[Approval]:
        query = ("SELECT id, thread, checkpoint, action, created, expires, decision, comment "
                 "FROM approvals")
        where, args = [], []
        if thread_id is not None:
            self.thread(thread_id)
            where.append("thread = ?")
            args.append(thread_id)
        if pending_only:
            where.append("decision IS NULL AND (expires IS NULL OR expires > ?)")
            args.append(time.time())
        if where:
            query += " WHERE " + " AND ".join(where)
        return [self._approval(r, codec) for r in self.db.execute(query + " ORDER BY created",
                                                                   args)]

    def decide(self, thread_id: str, decision: str, *, by: str = "", comment: str = "") -> Approval:
        self.thread(thread_id)
        with self.transaction() as db:
            row = db.execute("SELECT id, expires FROM approvals WHERE thread = ? AND decision IS "
                             "NULL ORDER BY created DESC LIMIT 1", (thread_id,)).fetchone()
            if row is None:
                raise AgentError(f"thread {thread_id} has no pending approval; list them with: "
                                 f"blockdiff agent pending")
            if row[1] is not None and row[1] <= time.time():
                db.execute("UPDATE approvals SET decision = 'expired', decided = ? WHERE id = ?",
                           (time.time(), row[0]))
                decision_made = "expired"
            else:
                db.execute("UPDATE approvals SET decision = ?, decided = ?, decided_by = ?, "
                           "comment = ? WHERE id = ?",
                           (decision, time.time(), by or _owner(), comment, row[0]))
                decision_made = decision
        if decision_made == "expired":
            raise AgentError(f"the approval thread {thread_id} waited for expired before it was "
                             f"decided; the run will treat it as rejected")
        return self.approvals(thread_id)[-1]
