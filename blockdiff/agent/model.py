"""The agent's records and all their SQL: threads and their leases, agent
checkpoints, the tool-call journal and approvals, in ``<store>/agent.sqlite``
beside the store's catalog. :mod:`blockdiff.agent.agent` builds the
``Agent``/``Step`` API on top, and :mod:`blockdiff.agent.calls` the journal
of its tool calls; neither executes SQL of its own.

Every method that changes records is one transaction. Those that write for
a thread a process holds (a checkpoint, a journal entry, a lease renewal)
take that process's ``owner`` and check it under the write lock: a process
whose lease was taken over stops instead of writing over the new holder."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from blockdiff.agent.sealing import PLAIN, Codec, content_hash
from blockdiff.db import Database, Migrations, connect, migrate
from blockdiff.errors import (
    AgentError,
    AmbiguousCheckpoint,
    DatabaseDamaged,
    DatabaseError,
    SealingError,
    ThreadBusy,
    UnknownCheckpoint,
    UnknownThread,
    UsageError,
)
from blockdiff.store.catalog import candidates, id_prefix, prefix_matches
from blockdiff.store.shared import open_shared_database
from blockdiff.store.store import Store

DB_NAME = "agent.sqlite"
# 2: meta is redacted and sealed like the state; the content hash is taken
# over what is written, keyed when sealed (sealing.Codec.content_hash).
FORMAT_VERSION = 2

# A content hash written before hashes were keyed has no "kind:" prefix.
# PostgreSQL has no instr(); SQLite's partial index needs its predicate as
# written in the migration, so each dialect keeps its own.
_LEGACY_HASH = "instr(content_hash, ':') = 0"
_LEGACY_HASHES = {"sqlite": _LEGACY_HASH, "postgresql": "strpos(content_hash, ':') = 0"}
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
    # The environment a checkpoint was taken under, stored once per content
    # (its hash, keyed when sealed) and referenced by every checkpoint that
    # shares it; older checkpoints have none.
    """
    CREATE TABLE environments (
        id TEXT PRIMARY KEY,
        body BLOB NOT NULL,
        created REAL NOT NULL
    );
    ALTER TABLE checkpoints ADD COLUMN environment TEXT;
    CREATE INDEX checkpoints_environment ON checkpoints(environment);
    """,
    # The fencing token of a thread's lease: it grows on every acquisition,
    # and the holder's owner value carries it, so a process whose lease was
    # taken over (paused, cut off, presumed dead) has its next write refused.
    """
    ALTER TABLE threads ADD COLUMN lease_token INTEGER NOT NULL DEFAULT 0;
    """,
    # Who journalled a call's intent (the lease's owner value, fencing token
    # included), so that a process settling the call knows whether the one
    # that made it may still be running; and how an in-doubt call was settled.
    """
    ALTER TABLE journal ADD COLUMN owner TEXT;
    ALTER TABLE journal ADD COLUMN settled TEXT;
    """,
]
# The same versions on PostgreSQL: BIGINT for INTEGER, DOUBLE PRECISION for
# times, BYTEA for BLOB, text compared byte by byte (COLLATE "C") as SQLite's
# is. A checkpoint's meta is BYTEA there: SQLite keeps JSON text in the clear
# and sealed bytes in one column, PostgreSQL keeps bytes (the codec's PLAIN
# prefix marks those in the clear; see AgentDB.record_checkpoint).
POSTGRESQL_MIGRATIONS = [
    """
    CREATE TABLE threads (
        id TEXT COLLATE "C" PRIMARY KEY,
        created DOUBLE PRECISION NOT NULL,
        head TEXT COLLATE "C",
        status TEXT COLLATE "C" NOT NULL DEFAULT 'idle',
        owner TEXT COLLATE "C",
        lease_until DOUBLE PRECISION,
        disk TEXT COLLATE "C",
        forked_from TEXT COLLATE "C",
        meta TEXT COLLATE "C" NOT NULL DEFAULT '{}'
    );
    CREATE TABLE checkpoints (
        seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        id TEXT COLLATE "C" NOT NULL UNIQUE,
        thread TEXT COLLATE "C" NOT NULL REFERENCES threads(id),
        parent TEXT COLLATE "C",
        step BIGINT NOT NULL,
        version BIGINT NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        expires DOUBLE PRECISION,
        reason TEXT COLLATE "C" NOT NULL,
        state BYTEA NOT NULL,
        messages BYTEA NOT NULL,
        content_hash TEXT COLLATE "C" NOT NULL,
        disk_snapshot TEXT COLLATE "C",
        meta BYTEA NOT NULL
    );
    CREATE INDEX checkpoints_thread ON checkpoints(thread, seq);
    CREATE TABLE journal (
        seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
        request_id TEXT COLLATE "C" NOT NULL UNIQUE,
        thread TEXT COLLATE "C" NOT NULL,
        base TEXT COLLATE "C" NOT NULL,
        position BIGINT NOT NULL,
        tool TEXT COLLATE "C" NOT NULL,
        args BYTEA NOT NULL,
        status TEXT COLLATE "C" NOT NULL,
        result BYTEA,
        error TEXT COLLATE "C",
        started DOUBLE PRECISION NOT NULL,
        finished DOUBLE PRECISION,
        compensable BIGINT NOT NULL,
        external BIGINT NOT NULL,
        undo TEXT COLLATE "C"
    );
    CREATE INDEX journal_thread ON journal(thread, seq);
    CREATE TABLE approvals (
        id TEXT COLLATE "C" PRIMARY KEY,
        thread TEXT COLLATE "C" NOT NULL,
        checkpoint TEXT COLLATE "C" NOT NULL,
        action BYTEA NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        expires DOUBLE PRECISION,
        decision TEXT COLLATE "C",
        decided DOUBLE PRECISION,
        decided_by TEXT COLLATE "C",
        comment TEXT COLLATE "C"
    );
    CREATE INDEX approvals_thread ON approvals(thread);
    """,
    f"""
    CREATE INDEX checkpoints_legacy_hash ON checkpoints(seq)
        WHERE {_LEGACY_HASHES['postgresql']};
    """,
    """
    CREATE TABLE environments (
        id TEXT COLLATE "C" PRIMARY KEY,
        body BYTEA NOT NULL,
        created DOUBLE PRECISION NOT NULL
    );
    ALTER TABLE checkpoints ADD COLUMN environment TEXT COLLATE "C";
    CREATE INDEX checkpoints_environment ON checkpoints(environment);
    """,
    """
    ALTER TABLE threads ADD COLUMN lease_token BIGINT NOT NULL DEFAULT 0;
    """,
    """
    ALTER TABLE journal ADD COLUMN owner TEXT COLLATE "C";
    ALTER TABLE journal ADD COLUMN settled TEXT COLLATE "C";
    """,
]
# Agent databases made before the db layer count their migrations in
# PRAGMA user_version: adopted at that version.
SCHEMA = Migrations("agent", MIGRATIONS, legacy="user_version",
                    postgresql=POSTGRESQL_MIGRATIONS)


def _unknown_thread(thread_id: str, root) -> UnknownThread:
    """The one error every command given a thread that is not there raises."""
    return UnknownThread(f"no thread {thread_id!r} in {root}; list them with: "
                         f"blockdiff agent threads --store {root}")


def unknown_checkpoint(checkpoint_id: str, where: str,
                       thread_id: str | None = None) -> UnknownCheckpoint:
    """The error for a checkpoint that is not ``where`` it was looked for,
    pointing to ``thread_id``'s history (or to how to find one)."""
    listing = (f"blockdiff agent history {thread_id}" if thread_id
               else "blockdiff agent history THREAD (threads: blockdiff agent threads)")
    return UnknownCheckpoint(f"no checkpoint {checkpoint_id!r} {where}; see a thread's with: "
                             f"{listing}")


def checkpoint_context(checkpoint_id: str, part: str) -> str:
    """What a part of an agent checkpoint (state, messages, meta) is sealed
    for: a value copied into another record does not decrypt."""
    return f"checkpoint {checkpoint_id} {part}"


def _approval_context(approval_id: str) -> str:
    return f"approval {approval_id}"


def _environment_context(environment_id: str) -> str:
    return f"environment {environment_id}"


# What a resumed run is refused over: replaying a journal under another model
# or prompt is how a replay starts to diverge (docs/agent.md).
REFUSED_CHANGES = ("model", "model_version", "system_prompt")


@dataclass(frozen=True)
class Environment:
    """What a run depends on besides its state, messages, journal and disk:
    the model and its version, the system prompt, the tools (name to
    version, None when unversioned) and the environment variables it was
    given. Stored with each checkpoint, redacted and sealed like the state."""

    model: str | None = None
    model_version: str | None = None
    system_prompt: str | None = None
    tools: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    @classmethod
    def of(cls, value: "Environment | dict") -> "Environment":
        """An environment from itself or a dict of its fields (``UsageError``
        for a field it does not have); ``tools`` may also be a list of
        names, of no version."""
        if not isinstance(value, Environment):
            unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
            if unknown:
                raise UsageError(f"an agent environment has no {', '.join(sorted(unknown))}; "
                                 f"it has model, model_version, system_prompt, tools, env")
            value = cls(**value)
        if not isinstance(value.tools, dict):
            value = dataclasses.replace(value, tools=dict.fromkeys(value.tools))
        return value

    def as_dict(self) -> dict:
        """Its fields, as written."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Checkpoint:
    """An agent checkpoint as recorded (its state and messages are read with
    :meth:`AgentDB.load`); ``disk_snapshot`` is the store's snapshot of the
    sandbox disk taken with it."""

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
    environment_id: str | None = None   # its Environment's; None before they were kept


@dataclass(frozen=True)
class CheckpointResult:
    """What taking an agent checkpoint did, and how long it and the disk
    snapshot in it took."""

    id: str
    skipped: bool        # nothing changed: no new node, ``id`` is the head
    seconds: float
    disk_seconds: float


@dataclass(frozen=True)
class JournalEntry:
    """A tool call as the journal lists it."""

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
    owner: str | None = None     # the lease that journalled the intent (None: not kept then)
    settled: str | None = None   # how a call in doubt was settled, and by whom


@dataclass(frozen=True)
class JournalCall:
    """What a replay or a compensation needs of a journalled call: its
    arguments and result as stored (sealed or not), decoded by the caller."""

    request_id: str
    tool: str
    status: str
    args: bytes
    result: bytes | None
    compensable: bool
    external: bool
    owner: str | None = None     # the lease that journalled the intent


@dataclass(frozen=True)
class ThreadInfo:
    """A thread: its head checkpoint, who runs it, and its disk binding
    (:mod:`blockdiff.agent.disks`)."""

    id: str
    created: float
    head: str | None
    status: str
    owner: str | None
    disk: str | None
    forked_from: str | None


@dataclass(frozen=True)
class Approval:
    """A human's approval asked at a checkpoint; truthy once approved."""

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


def _start_time(pid: int | str) -> str:
    """When process ``pid`` started (clock ticks after boot), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def process_owner(host: str | None = None) -> str:
    """Who this process is, as a thread's owner: host (by default this
    machine's name; in a shared store, the host's id in it), pid and the
    pid's start time (a pid reused by another process is not the owner)."""
    try:
        start = _start_time(os.getpid())
    except OSError:
        start = "0"
    return f"{host or socket.gethostname()}:{os.getpid()}:{start}"


def _process_of(holder: str) -> str:
    """The process part of an owner value, without its lease's token."""
    return holder.split("/", 1)[0]


def lease_token(holder: str | None) -> int:
    """The fencing token an owner value carries (0: none, as written before
    tokens were kept)."""
    token = (holder or "").partition("/")[2]
    return int(token) if token.isdigit() else 0


def may_still_run(holder: str | None, me: str, here: str) -> bool:
    """Whether the process ``holder`` (an owner value), which journalled a
    call, may still be making it while ``me`` settles it: it is not this
    process, and it is not known dead. A process on another host cannot be
    seen: a lapsed lease says it stopped renewing, not that it stopped (it
    may be paused, or cut off, and wake). A call journalled before owners
    were kept (None) may have been made by anyone."""
    if holder is None:
        return True
    if _process_of(holder) == _process_of(me):
        return False
    return _owner_alive(holder, here)


def _owner_alive(owner: str, here: str) -> bool:
    host, pid, start = _process_of(owner).rsplit(":", 2)
    if host != here:
        return True  # another host: only its lease can tell
    try:
        return _start_time(pid) == start
    except (OSError, IndexError):
        return False


class AgentDB:
    """The agent tables, in ``<store>/agent.sqlite`` beside the store's catalog,
    or in the Database given.

    ``codec`` (with the key, when sealed) seals what is written and reads
    checkpoints' meta; without it a sealed checkpoint's meta reads as None.
    ``db``: an open :class:`~blockdiff.db.Database` to keep them in instead
    (PostgreSQL's, shared by several hosts), which the AgentDB then owns and
    closes; its tables are made if it has none."""

    def __init__(self, store: Store, codec: Codec | None = None, *, db: Database | None = None):
        self.store = store
        self.codec = codec
        # secure_delete: what a rewrite or a delete leaves behind is zeroed,
        # not left in free space. The layer's synchronous=FULL is what makes
        # a journal intent be on disk before the tool runs.
        shared = getattr(store, "shared", None)
        # Where the owners of this store's threads say they run: this
        # machine, or this host of a shared store.
        self.here = socket.gethostname() if shared is None else shared.host
        if db is None and shared is not None:
            db = open_shared_database(shared, store.root, "agent", secure_delete=True)
        self.db = db if db is not None else connect(
            store.root / DB_NAME, mode=getattr(store, "file_mode", 0o600), secure_delete=True)
        try:
            migrate(self.db, SCHEMA)
            self._rehash_legacy()
        except BaseException:
            self.db.close()
            raise

    def _rehash_legacy(self) -> None:
        """Replace content hashes written before they were keyed (a plain
        SHA-256 of the state before redaction, which confirms a guess at a
        redacted or sealed value) by what :meth:`Codec.content_hash` gives.
        Sealed checkpoints need the key: without it they wait for a process
        that has it. The partial index makes this free once none are left."""
        rows = self.db.execute("SELECT id, state, messages, content_hash FROM checkpoints "
                               f"WHERE {_LEGACY_HASHES[self.db.dialect]}").fetchall()
        updates = []
        for checkpoint_id, state, messages, old in rows:
            if self.codec is not None:
                try:
                    parts = (self.codec.data(state, checkpoint_context(checkpoint_id, "state")),
                             self.codec.data(messages,
                                             checkpoint_context(checkpoint_id, "messages")))
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
        """Close the database."""
        self.db.close()

    def __enter__(self) -> "AgentDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def transaction(self):
        """One change to the agent tables, holding the write lock from its start."""
        return self.db.transaction()

    # ------------------------------------------------------------ threads

    _THREAD_COLUMNS = "id, created, head, status, owner, disk, forked_from"

    def thread(self, thread_id: str) -> ThreadInfo:
        """The thread ``thread_id`` (``UnknownThread`` if there is none)."""
        row = self.db.execute(f"SELECT {self._THREAD_COLUMNS} FROM threads WHERE id = ?",
                              (thread_id,)).fetchone()
        if row is None:
            raise _unknown_thread(thread_id, self.store.root)
        return ThreadInfo(*row)

    def threads(self) -> list[ThreadInfo]:
        """Every thread, oldest first."""
        return [ThreadInfo(*r) for r in self.db.execute(
            f"SELECT {self._THREAD_COLUMNS} FROM threads ORDER BY created")]

    def acquire(self, thread_id: str, owner: str, lease: float, *, binding: str | None,
                create: bool) -> tuple[str, str]:
        """Hold ``thread_id`` for the process ``owner`` (:func:`process_owner`)
        for ``lease`` seconds, making it (with the disk ``binding``) when there
        is none and ``create`` says so, else ``UnknownThread``. Returns the
        status it had ("new" when made) and the lease's owner value: ``owner``
        with the lease's fencing token, which every write for the thread
        passes back. ``ThreadBusy`` if another process runs it: a live owner
        on this host keeps it however long its step takes; one on another
        host cannot be seen, so its lease decides. A ``binding`` replaces the
        one recorded."""
        now = time.time()
        with self.transaction() as db:
            row = db.execute("SELECT owner, lease_until, status, lease_token FROM threads "
                             "WHERE id = ?", (thread_id,)).fetchone()
            if row is None:
                if not create:
                    raise _unknown_thread(thread_id, self.store.root)
                return "new", self._insert_thread(db, thread_id, owner, now + lease, binding)
            holder, until, status, token = row
            local = holder is not None and \
                _process_of(holder).rsplit(":", 2)[0] == self.here
            if holder and _process_of(holder) != owner and _owner_alive(holder, self.here) \
                    and (local or (until or 0) > now):
                raise ThreadBusy(f"thread {thread_id} is being run by {_process_of(holder)}; "
                                 f"refusing to run it twice (wait for it, or for its lease "
                                 f"to end)")
            held = f"{owner}/{token + 1}"
            db.execute("UPDATE threads SET owner = ?, lease_until = ?, status = 'running', "
                       "lease_token = ?, disk = COALESCE(?, disk) WHERE id = ?",
                       (held, now + lease, token + 1, binding, thread_id))
            return status, held

    def create_thread(self, thread_id: str, owner: str, lease: float, *, binding: str | None,
                      forked_from: str | None = None) -> str:
        """Make ``thread_id``, held by ``owner``; ``AgentError`` if it exists.
        Returns the lease's owner value (see :meth:`acquire`)."""
        with self.transaction() as db:
            self.require_new_thread(thread_id)
            return self._insert_thread(db, thread_id, owner, time.time() + lease, binding,
                                       forked_from)

    def require_new_thread(self, thread_id: str) -> None:
        """``AgentError`` if there is a thread ``thread_id``."""
        if self.db.execute("SELECT 1 FROM threads WHERE id = ?", (thread_id,)).fetchone():
            raise AgentError(f"thread {thread_id} already exists")

    @staticmethod
    def _insert_thread(db, thread_id: str, owner: str, lease_until: float,
                       binding: str | None, forked_from: str | None = None) -> str:
        held = f"{owner}/1"
        db.execute("INSERT INTO threads (id, created, status, owner, lease_until, disk, "
                   "forked_from, lease_token) VALUES (?, ?, 'running', ?, ?, ?, ?, 1)",
                   (thread_id, time.time(), held, lease_until, binding, forked_from))
        return held

    def release(self, thread_id: str, owner: str, status: str | None = None) -> None:
        """Let go of a thread ``owner`` holds, leaving it ``status`` (default:
        idle if it was running). Best effort: on a database error the lease
        ends by itself."""
        with contextlib.suppress(DatabaseError, DatabaseDamaged, OSError), \
                self.transaction() as db:
            db.execute("UPDATE threads SET owner = NULL, lease_until = NULL, "
                       "status = COALESCE(?, CASE status WHEN 'running' THEN 'idle' "
                       "ELSE status END) WHERE id = ? AND owner = ?",
                       (status, thread_id, owner))

    def renew(self, thread_id: str, owner: str, lease: float) -> None:
        """Extend ``owner``'s hold on ``thread_id`` by ``lease`` seconds from now."""
        with self.transaction() as db:
            self._check_owner(db, thread_id, owner)
            db.execute("UPDATE threads SET lease_until = ? WHERE id = ?",
                       (time.time() + lease, thread_id))

    @staticmethod
    def _check_owner(db, thread_id: str, owner: str) -> None:
        holder = db.execute("SELECT owner FROM threads WHERE id = ?",
                            (thread_id,)).fetchone()[0]
        if holder != owner:
            by = f"was taken over by {_process_of(holder)}" if holder else \
                "was let go by another process"
            raise ThreadBusy(f"thread {thread_id} {by} (this process's lease ended, and its "
                             f"fencing token {owner.partition('/')[2] or '0'} is no longer the "
                             f"thread's); stopping rather than running it twice")

    def mark_failing(self, thread_id: str, owner: str, request_ids: Iterable[str]) -> None:
        """Mark a failed run's calls to undo and the thread 'failing', in one
        transaction: a process dying during the compensations leaves a thread
        that, opened again, finishes them and ends failed."""
        with self.transaction() as db:
            self._check_owner(db, thread_id, owner)
            self._mark_undo(db, request_ids)
            db.execute("UPDATE threads SET status = 'failing' WHERE id = ?", (thread_id,))

    # -------------------------------------------------------- checkpoints

    _CHECKPOINT_SELECT = ("SELECT id, thread, parent, step, version, created, expires, reason, "
                          "disk_snapshot, meta, content_hash, environment FROM checkpoints")

    def _checkpoint_from_row(self, row) -> Checkpoint:
        return Checkpoint(*row[:9], self._meta(row[0], row[9]), *row[10:])

    def _meta(self, checkpoint_id: str, stored) -> dict | None:
        if isinstance(stored, str):          # in the clear
            return json.loads(stored)
        if self.codec is None or not self.codec.sealing:
            return json.loads(stored[1:]) if stored[:1] == PLAIN else None
        return self.codec.decode(stored, checkpoint_context(checkpoint_id, "meta"))

    def checkpoint(self, checkpoint_id: str, thread_id: str | None = None) -> Checkpoint:
        """The checkpoint ``checkpoint_id``, an id or a unique prefix of at
        least 4 hex digits (``AmbiguousCheckpoint`` if it begins several);
        the result's ``id`` is the full id. ``thread_id``, if given, only
        names the thread whose history the error points to."""
        row = self.db.execute(self._CHECKPOINT_SELECT + " WHERE id = ?",
                              (checkpoint_id,)).fetchone()
        if row is None and (prefix := id_prefix(checkpoint_id)) is not None:
            ids, total = prefix_matches(self.db, "checkpoints", prefix)
            if total > 1:
                raise AmbiguousCheckpoint(
                    f"checkpoint id {checkpoint_id!r} is ambiguous: {total} checkpoints in "
                    f"{self.store.root} begin with it ({candidates(ids, total)}); give more "
                    f"of its digits")
            if ids:
                row = self.db.execute(self._CHECKPOINT_SELECT + " WHERE id = ?",
                                      (ids[0],)).fetchone()
        if row is None:
            raise unknown_checkpoint(checkpoint_id, f"in {self.store.root}", thread_id)
        return self._checkpoint_from_row(row)

    def checkpoint_of_thread(self, checkpoint_id: str, thread_id: str) -> Checkpoint:
        """The checkpoint ``checkpoint_id`` names (a prefix resolved), which
        must be ``thread_id``'s own or in its history (a thread forked from
        another has the other's older checkpoints in it)."""
        found = self.checkpoint(checkpoint_id, thread_id)
        if found.thread != thread_id and found.id not in {
                c.id for c in self.history(thread_id)}:
            raise unknown_checkpoint(found.id, f"in thread {thread_id!r}'s history", thread_id)
        return found

    def resolve_checkpoint(self, checkpoint_id: str) -> str:
        """The full id of the checkpoint ``checkpoint_id`` names: an id, or a
        unique prefix of one (as for :meth:`checkpoint`)."""
        return self.checkpoint(checkpoint_id).id

    def contents(self, checkpoint_id: str) -> tuple[bytes, bytes]:
        """A checkpoint's state and messages as stored (sealed or not)."""
        return self.db.execute("SELECT state, messages FROM checkpoints WHERE id = ?",
                               (checkpoint_id,)).fetchone()

    def load(self, checkpoint_id: str) -> tuple[dict, list]:
        """A checkpoint's state and messages, read with :attr:`codec`."""
        state, messages = self.contents(checkpoint_id)
        return (self.codec.decode(state, checkpoint_context(checkpoint_id, "state")),
                self.codec.decode(messages, checkpoint_context(checkpoint_id, "messages")))

    def environment_id(self, environment: Environment) -> str:
        """The id ``environment`` is stored under: the content hash of what
        is written (redacted; keyed when sealed, so it confirms no guess)."""
        return self.codec.content_hash(self.codec.serialise(environment.as_dict()))

    def as_written(self, environment: Environment) -> Environment:
        """``environment`` as a checkpoint records it: secrets redacted."""
        return Environment(**json.loads(self.codec.serialise(environment.as_dict())))

    def environment(self, environment_id: str | None) -> Environment | None:
        """The environment stored under ``environment_id`` (None for none),
        read with :attr:`codec`."""
        if environment_id is None:
            return None
        row = self.db.execute("SELECT body FROM environments WHERE id = ?",
                              (environment_id,)).fetchone()
        if row is None:
            raise AgentError(f"environment {environment_id} is not in {self.store.root}: "
                             f"the agent database is incomplete")
        return Environment(**self.codec.decode(row[0], _environment_context(environment_id)))

    def _store_environment(self, db, environment: Environment) -> str:
        """The id of ``environment``, written first if no checkpoint has it yet."""
        environment_id = self.environment_id(environment)
        if db.execute("SELECT 1 FROM environments WHERE id = ?",
                      (environment_id,)).fetchone() is None:
            db.execute("INSERT INTO environments (id, body, created) VALUES (?, ?, ?)",
                       (environment_id, self.codec.encode(environment.as_dict(),
                                                          _environment_context(environment_id)),
                        time.time()))
        return environment_id

    def record_checkpoint(self, checkpoint_id: str, thread_id: str, owner: str, *,
                          parent: Checkpoint | None, reason: str, written: tuple[bytes, bytes],
                          content_hash: str, disk_snapshot: str | None, meta: dict,
                          ttl: float | None, lease: float, undo: Iterable[str] = (),
                          environment: Environment | str | None = None) -> None:
        """Write the agent checkpoint ``checkpoint_id`` after ``parent`` and
        make it ``thread_id``'s head, renewing ``owner``'s lease, if ``owner``
        still holds the thread. ``written``: the state and messages as
        serialised (:meth:`Codec.serialise`), sealed here for this record.
        ``undo``: request ids marked for compensation in the same
        transaction (a rewind: a process dying after it resumes at the
        rewound node and finishes the compensations). ``environment``: the
        one it was taken under (an ``Environment``, stored once, or the id of
        one stored already, as a rewind or a fork copies it)."""
        codec, now = self.codec, time.time()
        state, messages = written
        meta_data = codec.serialise(meta)
        with self.transaction() as db:
            self._check_owner(db, thread_id, owner)
            self._mark_undo(db, undo)
            if isinstance(environment, Environment):
                environment = self._store_environment(db, environment)
            db.execute(
                "INSERT INTO checkpoints (id, thread, parent, step, version, created, expires, "
                "reason, state, messages, content_hash, disk_snapshot, meta, environment) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (checkpoint_id, thread_id, parent.id if parent else None,
                 parent.step + 1 if parent else 0, FORMAT_VERSION, now,
                 now + ttl if ttl else None, reason,
                 codec.seal(state, checkpoint_context(checkpoint_id, "state")),
                 codec.seal(messages, checkpoint_context(checkpoint_id, "messages")),
                 content_hash, disk_snapshot,
                 # In the clear as JSON text, as before, when nothing is sealed
                 # (on SQLite; PostgreSQL's column holds bytes only).
                 codec.seal(meta_data, checkpoint_context(checkpoint_id, "meta"))
                 if codec.sealing or db.dialect != "sqlite" else meta_data.decode(),
                 environment))
            db.execute("UPDATE threads SET head = ?, lease_until = ? WHERE id = ?",
                       (checkpoint_id, now + lease, thread_id))

    def move_head(self, thread_id: str, owner: str, checkpoint_id: str | None,
                  lease: float) -> None:
        """Make an earlier checkpoint (None: none) the head of the thread
        ``owner`` holds (resuming from the last one another host can restore)."""
        with self.transaction() as db:
            self._check_owner(db, thread_id, owner)
            db.execute("UPDATE threads SET head = ?, lease_until = ? WHERE id = ?",
                       (checkpoint_id, time.time() + lease, thread_id))

    def history(self, thread_id: str) -> list[Checkpoint]:
        """The head's ancestry, newest first (crossing into the thread forked from)."""
        return self.ancestry(self.thread(thread_id).head)

    def ancestry(self, checkpoint_id: str | None) -> list[Checkpoint]:
        """``checkpoint_id`` and its ancestors, newest first, across threads
        (back to the oldest one kept)."""
        out, cursor = [], checkpoint_id
        while cursor:
            row = self.db.execute(self._CHECKPOINT_SELECT + " WHERE id = ?",
                                  (cursor,)).fetchone()
            if row is None:
                break  # older checkpoints expired and were collected
            out.append(self._checkpoint_from_row(row))
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
            expired = [self._checkpoint_from_row(r) for r in db.execute(
                self._CHECKPOINT_SELECT + " WHERE expires IS NOT NULL AND expires <= ? "
                "ORDER BY seq", (now,))
                if r[0] not in keep]
            if dry_run or not expired:
                return expired
            db.executemany("DELETE FROM checkpoints WHERE id = ?", [(c.id,) for c in expired])
            still_used = {r[0] for r in db.execute(
                "SELECT DISTINCT disk_snapshot FROM checkpoints WHERE disk_snapshot IS NOT NULL")}
            db.execute("DELETE FROM environments WHERE id NOT IN (SELECT environment "
                       "FROM checkpoints WHERE environment IS NOT NULL)")
        from blockdiff.agent.disks import remove_disk_snapshot
        from blockdiff.errors import UnknownSnapshot

        for snapshot in {c.disk_snapshot for c in expired if c.disk_snapshot} - still_used:
            with contextlib.suppress(UnknownSnapshot):
                remove_disk_snapshot(self.store, snapshot)
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
        """Every checkpoint recorded for ``thread_id``, oldest first (rewound ones too)."""
        self.thread(thread_id)
        return [self._checkpoint_from_row(r) for r in self.db.execute(
            self._CHECKPOINT_SELECT + " WHERE thread = ? ORDER BY seq", (thread_id,))]

    # ------------------------------------------------------------ journal

    _JOURNAL_SELECT = ("SELECT request_id, thread, base, position, tool, status, started, "
                       "finished, compensable, external, error, owner, settled FROM journal")
    _CALL_SELECT = ("SELECT request_id, tool, status, args, result, compensable, external, "
                    "owner FROM journal")

    def journal(self, thread_id: str) -> list[JournalEntry]:
        """Every call ``thread_id`` made, oldest first."""
        self.thread(thread_id)
        return [self._entry_from_row(r) for r in self.db.execute(
            self._JOURNAL_SELECT + " WHERE thread = ? ORDER BY seq", (thread_id,))]

    @staticmethod
    def _entry_from_row(row) -> JournalEntry:
        return JournalEntry(*row[:8], bool(row[8]), bool(row[9]), *row[10:])

    def calls_at(self, bases: Iterable[str]) -> list[JournalEntry]:
        """The calls made in the steps that began at ``bases`` (in any
        thread), oldest first."""
        bases = list(bases)
        if not bases:
            return []
        marks = ",".join("?" * len(bases))
        return [self._entry_from_row(r) for r in self.db.execute(
            self._JOURNAL_SELECT + f" WHERE base IN ({marks}) ORDER BY seq", bases)]

    @staticmethod
    def _call_from_row(row) -> JournalCall:
        return JournalCall(*row[:5], bool(row[5]), bool(row[6]), row[7])

    def call(self, request_id: str) -> JournalCall | None:
        """The journalled call ``request_id``, or None if it was never made."""
        row = self.db.execute(self._CALL_SELECT + " WHERE request_id = ?",
                              (request_id,)).fetchone()
        return None if row is None else self._call_from_row(row)

    def record_intent(self, request_id: str, thread_id: str, owner: str, *, base: str,
                      position: int, tool: str, args: bytes, compensable: bool,
                      external: bool) -> None:
        """Journal that ``owner`` is about to make a call (``args`` as
        encoded): committed, synchronously, before the tool runs."""
        with self.transaction() as db:
            self._check_owner(db, thread_id, owner)
            db.execute(
                "INSERT INTO journal (request_id, thread, base, position, tool, args, "
                "status, started, compensable, external, owner) "
                "VALUES (?, ?, ?, ?, ?, ?, 'intent', ?, ?, ?, ?)",
                (request_id, thread_id, base, position, tool, args, time.time(),
                 int(compensable), int(external), owner))

    # Every later write of a call is fenced like its intent: a process whose
    # lease was taken over while its tool ran (paused, say) must not record
    # over what the new holder settled.

    def _check_call_owner(self, db, request_id: str, owner: str) -> bool:
        """Check that ``owner`` holds the thread of call ``request_id``
        (``ThreadBusy`` if not); False if there is no such call."""
        row = db.execute("SELECT thread FROM journal WHERE request_id = ?",
                         (request_id,)).fetchone()
        if row is None:
            return False
        self._check_owner(db, row[0], owner)
        return True

    def forget_intent(self, request_id: str, *, owner: str) -> None:
        """Drop the intent of a call that failed without taking effect: as if never made."""
        with self.transaction() as db:
            if self._check_call_owner(db, request_id, owner):
                db.execute("DELETE FROM journal WHERE request_id = ? AND status = 'intent'",
                           (request_id,))

    def record_result(self, request_id: str, status: str, result: bytes, *, owner: str,
                      settled: str | None = None) -> None:
        """Journal a call's outcome (``result`` as encoded); ``settled``: how
        a call in doubt came to it (kept with any said before)."""
        with self.transaction() as db:
            if self._check_call_owner(db, request_id, owner):
                db.execute("UPDATE journal SET status = ?, result = ?, finished = ?, "
                           "settled = COALESCE(?, settled) WHERE request_id = ?",
                           (status, result, time.time(), settled, request_id))

    _CALL_FIELDS = ("status", "undo", "settled")

    def update_call(self, request_id: str, *, owner: str, **fields: str) -> None:
        """Set fields of call ``request_id``: ``status`` (where its
        compensation stands: compensating, compensated, uncompensable),
        ``undo`` (how a call marked for undoing was undone) or ``settled``
        (how a call in doubt was settled: a lookup's answer, before the call
        is retried or its undoing recorded)."""
        unknown = set(fields) - set(self._CALL_FIELDS)
        if unknown:
            raise ValueError(f"a journalled call has no field {', '.join(sorted(unknown))}")
        names = [name for name in self._CALL_FIELDS if name in fields]
        with self.transaction() as db:
            if names and self._check_call_owner(db, request_id, owner):
                db.execute(f"UPDATE journal SET {', '.join(f'{n} = ?' for n in names)} "
                           f"WHERE request_id = ?", (*(fields[n] for n in names), request_id))

    @staticmethod
    def _mark_undo(db, request_ids: Iterable[str]) -> None:
        db.executemany("UPDATE journal SET undo = 'pending' WHERE request_id = ?",
                       [(rid,) for rid in request_ids])

    def effects_since(self, thread_id: str, head: str | None, checkpoint_id: str) -> list[str]:
        """Request ids of ``thread_id``'s calls made at or after
        ``checkpoint_id`` on the way to ``head``, newest first: what going
        back to it undoes."""
        path, cursor = [], head
        while cursor and cursor != checkpoint_id:
            path.append(cursor)
            cursor = self.checkpoint(cursor).parent
        if cursor != checkpoint_id:
            raise unknown_checkpoint(checkpoint_id, f"among the ancestors of thread "
                                     f"{thread_id!r}'s head", thread_id)
        bases = path + [checkpoint_id]
        marks = ",".join("?" * len(bases))
        return [r[0] for r in self.db.execute(
            f"SELECT request_id FROM journal WHERE thread = ? AND base IN ({marks}) "
            f"AND status IN ('done', 'intent', 'compensating') ORDER BY seq DESC",
            (thread_id, *bases))]

    def pending_undo(self, thread_id: str) -> list[JournalCall]:
        """The calls of ``thread_id`` marked for undoing and not yet undone, newest first."""
        return [self._call_from_row(r) for r in self.db.execute(
            self._CALL_SELECT + " WHERE thread = ? AND undo = 'pending' ORDER BY seq DESC",
            (thread_id,))]

    # ---------------------------------------------------------- approvals

    _APPROVAL_SELECT = ("SELECT id, thread, checkpoint, action, created, expires, decision, "
                        "comment FROM approvals")

    def _approval_from_row(self, row, codec: Codec | None) -> Approval:
        action = None
        if codec is not None:
            action = codec.decode(row[3], _approval_context(row[0]))
        return Approval(row[0], row[1], row[2], action, *row[4:])

    def approval(self, approval_id: str, *, codec: Codec | None = None) -> Approval | None:
        """The approval ``approval_id`` (its action read with ``codec``), or None."""
        row = self.db.execute(self._APPROVAL_SELECT + " WHERE id = ?",
                              (approval_id,)).fetchone()
        return None if row is None else self._approval_from_row(row, codec)

    def approvals(self, thread_id: str | None = None, *, pending_only: bool = False,
                  codec: Codec | None = None) -> list[Approval]:
        """Approvals (of ``thread_id``; undecided and unexpired ones only),
        oldest first, their actions read with ``codec``."""
        query = self._APPROVAL_SELECT
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
        return [self._approval_from_row(r, codec)
                for r in self.db.execute(query + " ORDER BY created", args)]

    def ask_approval(self, approval_id: str, thread_id: str, checkpoint_id: str, action,
                     ttl: float | None) -> None:
        """Record a pending approval of ``action`` at a checkpoint, encoded
        with :attr:`codec`."""
        now = time.time()
        blob = self.codec.encode(action, _approval_context(approval_id))
        with self.transaction() as db:
            db.execute("INSERT INTO approvals (id, thread, checkpoint, action, created, "
                       "expires) VALUES (?, ?, ?, ?, ?, ?)",
                       (approval_id, thread_id, checkpoint_id, blob, now,
                        now + ttl if ttl else None))

    def expire_approval(self, approval_id: str) -> None:
        """Decide an approval left undecided past its expiry as 'expired'."""
        with self.transaction() as db:
            db.execute("UPDATE approvals SET decision = 'expired', decided = ? "
                       "WHERE id = ? AND decision IS NULL", (time.time(), approval_id))

    def decide(self, thread_id: str, decision: str, *, by: str = "", comment: str = "") -> Approval:
        """Approve or reject (``decision``) the thread's newest pending approval."""
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
                           (decision, time.time(), by or process_owner(), comment, row[0]))
                decision_made = decision
        if decision_made == "expired":
            raise AgentError(f"the approval thread {thread_id} waited for expired before it was "
                             f"decided; the run will treat it as rejected")
        return self.approvals(thread_id)[-1]
