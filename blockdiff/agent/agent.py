"""Agent checkpoints: an agent's execution state and its sandbox disk, under
one id, in one tree; exactly-once tool calls, approval pauses, compensation
and time travel. See docs/agent.md.

The unit of work and of recovery is a *step*. A step begins at the thread's
head checkpoint and ends with a new checkpoint of the state, the message log
and the sandbox disk (skipped, and said so, when none of them changed). A
process that dies inside a step resumes at the head: the state and the disk
go back to the head, the step runs again, and its tool calls are matched
with the journal by *request id* — ``hash(head checkpoint, position of the
call in the step)``, never the call's arguments, which a model may phrase
differently the second time. A call the journal records as done returns its
recorded result without running; a call that was in flight is settled by
asking the tool whether that request id took effect before it is retried.

Commands that act on the sandbox disk need no journal: the disk goes back
with the state, so running them again is correct. Tools with effects outside
(a payment, an email) are what the journal is for, and those that cannot be
undone by restoring a disk register a compensation, run newest first when
the thread is rewound past them or its run fails.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from blockdiff.agent.disks import Disk, ImageDisk
from blockdiff.agent.model import (
    FORMAT_VERSION,
    AgentDB,
    Approval,
    Checkpoint,
    CheckpointResult,
    Compensation,
    _owner,
    _owner_alive,
    _unknown_checkpoint,
    _unknown_thread,
)
from blockdiff.agent.sealing import Codec
from blockdiff.errors import (
    AgentError,
    AmbiguousCheckpoint,
    InDoubt,
    ThreadBusy,
    ThreadFailed,
    ToolFailed,
    UnknownCheckpoint,
    UnknownThread,
    UsageError,
)
from blockdiff.store.retention import check_duration
from blockdiff.store.store import Store, open_store

# What callers import from here, the errors the agent raises included.
__all__ = [
    "DEFAULT_LEASE", "NOT_APPLIED", "TRACE_POINTS", "Agent", "AgentDB", "AgentError",
    "AmbiguousCheckpoint", "Approval", "ApprovalPending", "Checkpoint", "CheckpointResult",
    "Compensation", "InDoubt", "NotApplied", "Step", "ThreadBusy", "ThreadFailed", "Tool",
    "ToolFailed", "UnknownCheckpoint", "UnknownThread", "bound_disk", "disk_binding",
    "fork_thread", "request_id", "rewind_thread",
]

DEFAULT_LEASE = 300.0
# The points of the step protocol an Agent's ``trace`` is told about, in order.
TRACE_POINTS = (
    "call.intent",          # the journal holds the call's intent; the tool has not run
    "call.ran",             # the tool ran; its result is not yet in the journal
    "call.recorded",        # the journal holds the result
    "checkpoint.disk",      # the disk is committed; the checkpoint is not yet recorded
    "checkpoint.recorded",  # the checkpoint is the thread's head
    "rewind.marked",        # effects to undo are marked; none undone yet
    "compensation.intent",  # a compensation is journalled; it has not run
    "compensation.ran",     # it ran; the journal does not say so yet
)
NOT_APPLIED = object()  # a tool's check: "that request never took effect"



class NotApplied(Exception):
    """Raised by a tool whose call failed without taking effect (a declined
    payment, a rejected request). Any other exception leaves the call in
    doubt, to be settled before it is retried."""


class ApprovalPending(Exception):
    """Raised to stop a run that waits for a human: not a failure, so not a
    :class:`~blockdiff.errors.BlockdiffError`; the caller ends the run and
    resumes it once the approval is decided."""

    def __init__(self, thread: str, approval_id: str, action):
        super().__init__(f"thread {thread} waits for approval of {json.dumps(action)}; "
                         f"approve or reject it with: blockdiff agent approve|reject {thread}")
        self.thread, self.approval_id, self.action = thread, approval_id, action


# ------------------------------------------------------------------ model


@dataclass(frozen=True)
class Tool:
    """Something an agent calls with effects the journal must account for.

    ``run(args, request_id)`` does it and returns a JSON-serialisable result,
    or raises :class:`NotApplied` when it failed without taking effect;
    passing ``request_id`` on as an idempotency key is what makes retries safe.
    ``check(request_id)`` tells whether a request took effect: its result, or
    :data:`NOT_APPLIED`. ``compensate(args, result, request_id)`` undoes it.
    ``external``: effects outside the sandbox (False: a disk restore undoes
    them, and the call is simply run again on replay). ``idempotent``: running
    a request id twice has the effect of once. ``high_risk``: only as the
    first action of a step, so that the step's start is the checkpoint right
    before it."""

    name: str
    run: Callable
    check: Callable | None = None
    compensate: Callable | None = None
    external: bool = True
    idempotent: bool = False
    high_risk: bool = False



def _new_id() -> str:
    return os.urandom(8).hex()


def request_id(base: str, position: int, kind: str = "call") -> str:
    """The id of the ``position``-th call of the step that began at ``base``."""
    return hashlib.sha256(f"{base}/{kind}/{position}".encode()).hexdigest()[:32]



# --------------------------------------------------------------- database



# ------------------------------------------------------------------ agent


def disk_binding(disk) -> str | None:
    """How a thread remembers its disk, so that other processes (the CLI) can
    restore it: ``vm:NAME`` or ``image:PATH``."""
    from blockdiff.vm.sandbox import Sandbox

    if disk is None:
        return None
    if isinstance(disk, Sandbox):
        return f"vm:{disk.name}"
    if isinstance(disk, ImageDisk):
        return f"image:{os.path.abspath(disk.path)}"
    return None


def bound_disk(store: Store, binding: str | None) -> Disk | None:
    from blockdiff.vm.sandbox import Sandbox

    if not binding:
        return None
    kind, _, where = binding.partition(":")
    return Sandbox(store, where) if kind == "vm" else ImageDisk(store, where)


def _canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


class Agent:
    """One thread of an agent, opened by one process at a time.

    ``state`` (a JSON-serialisable dict: plan, variables, cursors, pending
    actions) and ``messages`` (the message log) are the execution state;
    ``disk`` is the sandbox (a :class:`~blockdiff.vm.sandbox.Sandbox`, an
    :class:`~blockdiff.agent.disks.ImageDisk`, or None). Opening a thread that
    exists resumes it at its head: state, messages and disk as checkpointed.

    ``trace`` is called with the name of each point of the step protocol as
    it is passed (see :data:`TRACE_POINTS`): for logging, and for tests that
    kill the process at each of them.
    """

    def __init__(self, store: Store | str | os.PathLike, thread_id: str, *,
                 disk: Disk | None = None, tools: Iterable[Tool] = (),
                 key: bytes | str | None = None, secrets: Iterable[str] = (),
                 redactor: Callable | None = None, ttl: float | None = None,
                 lease: float = DEFAULT_LEASE, create: bool = True,
                 reopen_failed: bool = False, trace: Callable[[str], None] | None = None):
        if not thread_id or "/" in thread_id:
            raise UsageError(f"bad thread id {thread_id!r}")
        if ttl is not None:
            ttl = check_duration(ttl, "ttl")
        self.store = store if isinstance(store, Store) else open_store(store)
        self.codec = Codec(key, secrets=secrets, redactor=redactor)
        self.db = AgentDB(self.store, self.codec)
        self._closed = False
        self.thread_id = thread_id
        self.disk = disk
        self.tools = {t.name: t for t in tools}
        self.ttl = ttl
        self.lease = lease
        self.owner = _owner()
        self.trace = trace or (lambda point: None)
        self._step: Step | None = None
        self._approvals_asked: tuple[str | None, int] = (None, -1)
        try:
            self._acquire(create)
        except BaseException:
            self.db.close()
            raise
        try:
            info = self.db.thread(thread_id)
            self.head: str | None = info.head
            self.state: dict = {}
            self.messages: list = []
            self.resumed = info.head is not None
            if info.head is not None:
                self._load(info.head)
                if self.disk is not None:
                    head = self.db.checkpoint(info.head)
                    if head.disk_snapshot:
                        self.disk.restore(head.disk_snapshot)
            report = self.run_pending_compensations()
            if self._status_at_open in ("failing", "failed") and not reopen_failed:
                if self._status_at_open == "failing" and not report.pending:
                    self.close("failed")
                else:
                    self.close(self._status_at_open)
                raise ThreadFailed(f"thread {thread_id} failed and its effects were compensated"
                                   + (f" ({len(report.pending)} compensations still need the "
                                      f"agent's tools)" if report.pending else "")
                                   + "; rewind it to a checkpoint or fork it to go on")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------- lease

    def _acquire(self, create: bool) -> None:
        now = time.time()
        with self.db.transaction() as db:
            row = db.execute("SELECT owner, lease_until FROM threads WHERE id = ?",
                             (self.thread_id,)).fetchone()
            if row is None:
                if not create:
                    raise _unknown_thread(self.thread_id, self.store.root)
                self._status_at_open = "new"
                db.execute("INSERT INTO threads (id, created, status, owner, lease_until, disk) "
                           "VALUES (?, ?, 'running', ?, ?, ?)",
                           (self.thread_id, now, self.owner, now + self.lease,
                            disk_binding(self.disk)))
                return
            owner, until = row
            self._status_at_open = db.execute("SELECT status FROM threads WHERE id = ?",
                                              (self.thread_id,)).fetchone()[0]
            # A live owner on this host keeps the thread however long its step
            # takes; one on another host cannot be seen, so its lease decides.
            local = owner is not None and owner.rsplit(":", 2)[0] == socket.gethostname()
            if owner and owner != self.owner and _owner_alive(owner) and (
                    local or (until or 0) > now):
                raise ThreadBusy(f"thread {self.thread_id} is being run by {owner}; refusing to "
                                 f"run it twice (wait for it, or for its lease to end)")
            binding = disk_binding(self.disk)
            db.execute("UPDATE threads SET owner = ?, lease_until = ?, status = 'running', "
                       "disk = COALESCE(?, disk) WHERE id = ?",
                       (self.owner, now + self.lease, binding, self.thread_id))

    def _release(self, status: str | None = None) -> None:
        with contextlib.suppress(sqlite3.Error):
            with self.db.transaction() as db:
                db.execute("UPDATE threads SET owner = NULL, lease_until = NULL, "
                           "status = COALESCE(?, CASE status WHEN 'running' THEN 'idle' "
                           "ELSE status END) WHERE id = ? AND owner = ?",
                           (status, self.thread_id, self.owner))

    def close(self, status: str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._release(status)
        self.db.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, ApprovalPending):
            self.close("waiting_approval")
        else:
            self.close()

    # ------------------------------------------------------------- state

    def _context(self, checkpoint_id: str, what: str) -> str:
        return f"checkpoint {checkpoint_id} {what}"

    def _load(self, checkpoint_id: str) -> None:
        state, messages = self.db.contents(checkpoint_id)
        self.state = self.codec.decode(state, self._context(checkpoint_id, "state"))
        self.messages = self.codec.decode(messages, self._context(checkpoint_id, "messages"))

    def checkpoint(self, reason: str = "manual", meta: dict | None = None) -> CheckpointResult:
        """Record the state, the messages and the disk as a new node after the
        head; skipped (the head's id returned) when none of them changed."""
        if self._step is not None:
            raise AgentError("checkpoints are taken between steps; this one is inside a step")
        return self._checkpoint(reason, meta or {})

    def _checkpoint(self, reason: str, meta: dict, *, parent: str | None = None,
                    thread: str | None = None, force: bool = False) -> CheckpointResult:
        start = time.monotonic()
        parent = self.head if parent is None else parent
        thread = thread or self.thread_id
        head = self.db.checkpoint(parent) if parent else None
        disk_snapshot, disk_seconds = None, 0.0
        if self.disk is not None:
            t = time.monotonic()
            disk_snapshot = self.disk.checkpoint(
                # No TTL on the disk snapshot: the store's gc does not know
                # which one a thread's head needs; AgentDB.gc removes them.
                f"agent {thread}: {reason}", {"agent.thread": thread},
                skip_unchanged=True)
            disk_seconds = time.monotonic() - t
            self.trace("checkpoint.disk")
        elif head is not None:
            disk_snapshot = head.disk_snapshot
        # Compared as written: redacted, and keyed when sealed, so that the
        # hash confirms no guess at a secret or a sealed value.
        written = self.codec.serialise(self.state), self.codec.serialise(self.messages)
        content = self.codec.content_hash(*written)
        if (head is not None and not force and head.content_hash == content
                and head.disk_snapshot == disk_snapshot):
            self._renew()
            return CheckpointResult(head.id, True, time.monotonic() - start, disk_seconds)
        with self.db.transaction() as db:
            checkpoint_id = self._insert_head(db, thread, parent, (head.step + 1) if head else 0,
                                              reason, content, disk_snapshot, meta, written)
        if thread == self.thread_id:
            self.head = checkpoint_id
        self.trace("checkpoint.recorded")
        return CheckpointResult(checkpoint_id, False, time.monotonic() - start, disk_seconds)

    def _insert_head(self, db, thread: str, parent: str | None, step: int, reason: str,
                     content_hash: str, disk_snapshot: str | None, meta: dict,
                     written: tuple[bytes, bytes] | None = None) -> str:
        """Record the in-memory state and messages (``written``: as already
        serialised) as ``thread``'s new head, inside the caller's
        transaction; returns its id."""
        self._check_owner(db)
        checkpoint_id, now = _new_id(), time.time()
        codec = self.codec
        state, messages = written or (codec.serialise(self.state),
                                      codec.serialise(self.messages))
        meta_data = codec.serialise(meta)
        db.execute(
            "INSERT INTO checkpoints (id, thread, parent, step, version, created, expires, "
            "reason, state, messages, content_hash, disk_snapshot, meta) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (checkpoint_id, thread, parent, step, FORMAT_VERSION, now,
             now + self.ttl if self.ttl else None, reason,
             codec.seal(state, self._context(checkpoint_id, "state")),
             codec.seal(messages, self._context(checkpoint_id, "messages")),
             content_hash, disk_snapshot,
             # In the clear as JSON text, as before, when nothing is sealed.
             codec.seal(meta_data, self._context(checkpoint_id, "meta")) if codec.sealing
             else meta_data.decode()))
        db.execute("UPDATE threads SET head = ?, lease_until = ? WHERE id = ?",
                   (checkpoint_id, now + self.lease, thread))
        return checkpoint_id

    def _check_owner(self, db) -> None:
        owner = db.execute("SELECT owner FROM threads WHERE id = ?",
                           (self.thread_id,)).fetchone()[0]
        if owner != self.owner:
            raise ThreadBusy(f"thread {self.thread_id} was taken over by {owner} (this process's "
                             f"lease ended); stopping rather than running it twice")

    def _renew(self) -> None:
        with self.db.transaction() as db:
            self._check_owner(db)
            db.execute("UPDATE threads SET lease_until = ? WHERE id = ?",
                       (time.time() + self.lease, self.thread_id))

    # ------------------------------------------------------------- steps

    def step(self, name: str = "", meta: dict | None = None) -> "Step":
        """A unit of work: ``with agent.step("fetch page 2") as s: ...``. On a
        clean exit the thread is checkpointed; on an exception nothing is, and
        the in-memory state goes back to the head."""
        if self._step is not None:
            raise AgentError("steps do not nest")
        return Step(self, name, meta or {})

    def approval(self, action, *, ttl: float | None = 3600.0) -> Approval:
        """Ask a human to approve ``action`` (anything JSON-serialisable).

        The first time: a checkpoint, a persisted pending approval, and
        :class:`ApprovalPending` raised to stop the run. Once decided, the
        resumed run gets the decision (truthy when approved); an approval
        left undecided past ``ttl`` seconds comes back as ``expired``."""
        if self._step is not None:
            raise AgentError("ask for approval between steps, where the thread is checkpointed")
        # A run resumed at the checkpoint where it asked finds its approval
        # there: it is not checkpointed again first, since a running VM's disk
        # changes between the two (a filesystem freeze writes), and a new
        # checkpoint would mean a new approval.
        seen_head, count = self._approvals_asked
        again = count + 1 if seen_head == self.head else 0
        if self.head is None or self.db.db.execute(
                "SELECT 1 FROM approvals WHERE id = ?",
                (request_id(self.head, again, "approval"),)).fetchone() is None:
            self._checkpoint("approval", {"approval": True})
        # Several approvals asked at one head (nothing changed in between) are
        # told apart by their order, which a replay repeats.
        seen_head, count = self._approvals_asked
        count = count + 1 if seen_head == self.head else 0
        self._approvals_asked = (self.head, count)
        approval_id = request_id(self.head, count, "approval")
        row = self.db.db.execute("SELECT decision, expires FROM approvals WHERE id = ?",
                                 (approval_id,)).fetchone()
        if row is None:
            now = time.time()
            with self.db.transaction() as db:
                db.execute("INSERT INTO approvals (id, thread, checkpoint, action, created, "
                           "expires) VALUES (?, ?, ?, ?, ?, ?)",
                           (approval_id, self.thread_id, self.head,
                            self.codec.encode(action, f"approval {approval_id}"), now,
                            now + ttl if ttl else None))
            self._approvals_asked = (self.head, count - 1)  # asking again means this one
            raise ApprovalPending(self.thread_id, approval_id, action)
        decision, expires = row
        if decision is None:
            if expires is not None and expires <= time.time():
                with self.db.transaction() as db:
                    db.execute("UPDATE approvals SET decision = 'expired', decided = ? "
                               "WHERE id = ? AND decision IS NULL", (time.time(), approval_id))
            else:
                self._approvals_asked = (self.head, count - 1)
                raise ApprovalPending(self.thread_id, approval_id, action)
        return next(a for a in self.db.approvals(self.thread_id, codec=self.codec)
                    if a.id == approval_id)

    # --------------------------------------------------------- the journal

    def _call(self, base: str, position: int, tool_name: str, args: dict):
        tool = self.tools.get(tool_name)
        if tool is None:
            raise UsageError(f"no tool named {tool_name!r} was given to this agent")
        rid = request_id(base, position)
        context = f"journal {rid}"
        row = self.db.entry(rid)
        if row is not None:
            status, _, result_blob, recorded_tool = row
            if recorded_tool != tool_name:
                raise AgentError(f"the step's call #{position} was {recorded_tool} and is now "
                                 f"{tool_name}: the step is not deterministic, so its journal "
                                 f"cannot be replayed")
            if status == "done":
                return self.codec.decode(result_blob, context)
            if status in ("compensating", "compensated", "uncompensable"):
                raise AgentError(f"call {rid} ({tool_name}) was compensated; rewind the thread "
                                 f"to continue")
            if status == "intent":
                settled = self._settle(tool, rid, args)
                if settled is not NOT_APPLIED:
                    return settled
        else:
            with self.db.transaction() as db:
                self._check_owner(db)
                db.execute(
                    "INSERT INTO journal (request_id, thread, base, position, tool, args, "
                    "status, started, compensable, external) "
                    "VALUES (?, ?, ?, ?, ?, ?, 'intent', ?, ?, ?)",
                    (rid, self.thread_id, base, position, tool_name,
                     self.codec.encode(args, context + " args"), time.time(),
                     int(tool.compensate is not None), int(tool.external)))
            self.trace("call.intent")
        return self._run(tool, rid, args)

    def _settle(self, tool: Tool, rid: str, args: dict):
        """A call in flight when its process died: find out before retrying."""
        if not tool.external or tool.idempotent:
            return NOT_APPLIED
        if tool.check is None:
            raise InDoubt(f"{tool.name} request {rid} was in flight when its process died and "
                          f"the tool cannot say whether it took effect; give the tool a check "
                          f"or make it idempotent")
        result = tool.check(rid)
        if result is NOT_APPLIED:
            return NOT_APPLIED
        self._record(rid, "done", result)
        return result

    def _run(self, tool: Tool, rid: str, args: dict):
        try:
            result = tool.run(args, rid)
        except NotApplied as e:
            # The tool says it did nothing: the call is as if never made.
            with self.db.transaction() as db:
                db.execute("DELETE FROM journal WHERE request_id = ? AND status = 'intent'",
                           (rid,))
            raise ToolFailed(f"{tool.name} failed: {e}") from e
        except Exception as e:
            # Any other failure (a timeout, a lost answer) may have taken
            # effect: the intent stays, and the step's next run settles it
            # (check, idempotent retry, or InDoubt) before calling again.
            raise ToolFailed(f"{tool.name} failed: {e}") from e
        self.trace("call.ran")
        self._record(rid, "done", result)
        self.trace("call.recorded")
        return result

    def _record(self, rid: str, status: str, result) -> None:
        with self.db.transaction() as db:
            db.execute("UPDATE journal SET status = ?, result = ?, finished = ? "
                       "WHERE request_id = ?",
                       (status, self.codec.encode(result, f"journal {rid}"), time.time(), rid))

    # ------------------------------------------------------ compensation

    def _effects_after(self, checkpoint_id: str) -> list[str]:
        """Request ids of this thread's calls made at or after ``checkpoint_id``
        on the way to the head, newest first."""
        path, cursor = [], self.head
        while cursor and cursor != checkpoint_id:
            path.append(cursor)
            cursor = self.db.checkpoint(cursor).parent
        if cursor != checkpoint_id:
            raise _unknown_checkpoint(checkpoint_id, f"among the ancestors of thread "
                                      f"{self.thread_id!r}'s head", self.thread_id)
        bases = path + [checkpoint_id]
        marks = ",".join("?" * len(bases))
        return [r[0] for r in self.db.db.execute(
            f"SELECT request_id FROM journal WHERE thread = ? AND base IN ({marks}) "
            f"AND status IN ('done', 'intent', 'compensating') ORDER BY seq DESC",
            (self.thread_id, *bases))]

    def run_pending_compensations(self) -> Compensation:
        """Run the compensations a rewind or a failure left pending (newest
        first); each is journalled and passes the tool the same undo id every
        time, so one interrupted and run again takes effect once."""
        report = Compensation()
        rows = self.db.db.execute(
            "SELECT request_id, tool, args, result, status, external, compensable FROM journal "
            "WHERE thread = ? AND undo = 'pending' ORDER BY seq DESC",
            (self.thread_id,)).fetchall()
        for rid, tool_name, args_blob, result_blob, status, external, compensable in rows:
            tool = self.tools.get(tool_name)
            context = f"journal {rid}"
            if not external:
                self._set_undo(rid, "restored with the disk")
                continue
            if not compensable:
                self._set_status(rid, "uncompensable")
                report.uncompensable.append(f"{tool_name} {rid}")
                continue
            if tool is None:
                report.pending.append(f"{tool_name} {rid}")
                continue
            args = self.codec.decode(args_blob, context + " args")
            result = self.codec.decode(result_blob, context) if result_blob else None
            if status == "intent":
                settled = self._settle_for_undo(tool, rid, args)
                if settled is None:
                    self._set_status(rid, "uncompensable")
                    report.uncompensable.append(f"{tool_name} {rid} (in doubt: the tool "
                                                f"cannot say whether it took effect)")
                    continue
                if settled is NOT_APPLIED:
                    self._set_undo(rid, "never took effect")
                    self._set_status(rid, "compensated")
                    continue
                result = settled
            self._set_status(rid, "compensating")
            self.trace("compensation.intent")
            tool.compensate(args, result, rid + ":undo")
            self.trace("compensation.ran")
            self._set_status(rid, "compensated")
            self._set_undo(rid, "done")
            report.compensated.append(f"{tool_name} {rid}")
        return report

    def _settle_for_undo(self, tool: Tool, rid: str, args: dict):
        """A call in flight when its process died, about to be undone: its
        result if it took effect, NOT_APPLIED if not, None if nobody can say.
        An idempotent tool without a check is run again under the same id,
        which takes effect once, to learn the result to compensate."""
        if tool.check is not None:
            result = tool.check(rid)
        elif tool.idempotent:
            result = tool.run(args, rid)
        else:
            return None
        if result is not NOT_APPLIED:
            self._record(rid, "done", result)
        return result

    def _set_status(self, rid: str, status: str) -> None:
        with self.db.transaction() as db:
            db.execute("UPDATE journal SET status = ? WHERE request_id = ?", (status, rid))

    def _set_undo(self, rid: str, undo: str) -> None:
        with self.db.transaction() as db:
            db.execute("UPDATE journal SET undo = ? WHERE request_id = ?", (undo, rid))

    # ------------------------------------------------------- time travel

    def rewind(self, checkpoint_id: str) -> Compensation:
        """Put the thread back to ``checkpoint_id``: compensate, newest first,
        the effects of every call made since; restore its state and disk; and
        continue from a new node that copies it (so calls made from here on
        get request ids of their own, not those of the undone ones)."""
        if self._step is not None:
            raise AgentError("rewind between steps, not inside one")
        target = self.db.checkpoint(checkpoint_id, self.thread_id)
        checkpoint_id = target.id   # a prefix resolved
        if target.thread != self.thread_id and checkpoint_id not in {
                c.id for c in self.db.history(self.thread_id)}:
            raise _unknown_checkpoint(checkpoint_id, f"in thread {self.thread_id!r}'s history",
                                      self.thread_id)
        # One transaction marks what to undo and makes the rewound node the
        # head: a process dying anywhere after it resumes at the rewound state
        # (the disk follows the head on open) and finishes the compensations.
        rids = self._effects_after(checkpoint_id)
        self._load(checkpoint_id)
        with self.db.transaction() as db:
            for rid in rids:
                db.execute("UPDATE journal SET undo = 'pending' WHERE request_id = ?", (rid,))
            self.head = self._insert_head(db, self.thread_id, checkpoint_id, target.step + 1,
                                          f"rewind to {checkpoint_id}", target.content_hash,
                                          target.disk_snapshot, {"rewound_from": self.head})
        self.trace("rewind.marked")
        if self.disk is not None and target.disk_snapshot:
            self.disk.restore(target.disk_snapshot)
        return self.run_pending_compensations()

    def fail(self, to: str | None = None) -> Compensation:
        """End a failed run: compensate every effect since ``to`` (default:
        the thread's first checkpoint, i.e. the whole run) and mark it failed."""
        history = self.db.history(self.thread_id)
        if not history:
            return Compensation()
        target = to or history[-1].id
        rids = self._effects_after(target)
        # 'failing' first, with what to undo, in one transaction: a process
        # dying during the compensations leaves a thread that, opened again,
        # finishes them and ends failed instead of carrying on.
        with self.db.transaction() as db:
            for rid in rids:
                db.execute("UPDATE journal SET undo = 'pending' WHERE request_id = ?", (rid,))
            db.execute("UPDATE threads SET status = 'failing' WHERE id = ?", (self.thread_id,))
        self.trace("rewind.marked")
        report = self.run_pending_compensations()
        self.close("failed")
        return report

    def history(self) -> list[Checkpoint]:
        return self.db.history(self.thread_id)


class Step:
    """The body of ``with agent.step(...)``: see :meth:`Agent.step`."""

    def __init__(self, agent: Agent, name: str, meta: dict):
        self.agent = agent
        self.name = name
        self.meta = meta
        self.base: str | None = None
        self.calls = 0
        self.result: CheckpointResult | None = None

    @property
    def state(self) -> dict:
        return self.agent.state

    @property
    def messages(self) -> list:
        return self.agent.messages

    def __enter__(self) -> "Step":
        agent = self.agent
        if agent.head is None:
            # The thread's first node: its start, for request ids to hang from.
            agent._checkpoint("start", {}, force=True)
        self.base = agent.head
        agent._step = self
        self._clean = (_canonical(agent.state), _canonical(agent.messages))
        return self

    def call(self, tool: str, args: dict | None = None):
        """Call a tool exactly once for this step, whatever crashes and replays."""
        definition = self.agent.tools.get(tool)
        if definition is not None and definition.high_risk and (
                self.calls or (_canonical(self.agent.state), _canonical(self.agent.messages))
                != self._clean):
            raise AgentError(f"{tool} is high-risk: call it as the first action of a step, so "
                             f"that the step's start is the checkpoint right before it")
        position = self.calls
        self.calls += 1
        return self.agent._call(self.base, position, tool, args or {})

    def __exit__(self, exc_type, exc, tb) -> None:
        agent = self.agent
        agent._step = None
        if exc_type is not None:
            # The step did not happen: state and disk as at its start.
            agent._load(agent.head)
            head = agent.db.checkpoint(agent.head)
            if agent.disk is not None and head.disk_snapshot:
                agent.disk.restore(head.disk_snapshot)
            return
        reason = "tool_call" if self.calls else "step"
        self.result = agent._checkpoint(reason, {"step": self.name, "calls": self.calls}
                                        | self.meta)


# ------------------------------------------------------- other processes


def fork_thread(store: Store, thread_id: str, checkpoint_id: str, new_thread: str, *,
                key=None) -> str:
    """A new thread starting from ``checkpoint_id`` of ``thread_id``, with a
    disk of its own forked from that checkpoint's disk snapshot. Returns the
    new thread's first checkpoint."""
    db = AgentDB(store)
    try:
        source = db.thread(thread_id)
        target = db.checkpoint(checkpoint_id, thread_id)
        checkpoint_id = target.id   # a prefix resolved
        if checkpoint_id not in {c.id for c in db.history(thread_id)} and (
                target.thread != thread_id):
            raise _unknown_checkpoint(checkpoint_id, f"in thread {thread_id!r}", thread_id)
        with contextlib.suppress(UnknownThread):
            db.thread(new_thread)
            raise AgentError(f"thread {new_thread} already exists")
        state_blob, messages_blob = db.contents(checkpoint_id)
    finally:
        db.close()
    disk = _fork_disk(store, source.disk, target.disk_snapshot, new_thread)
    with Agent(store, new_thread, disk=disk, key=key) as agent:
        agent.state = agent.codec.decode(state_blob, f"checkpoint {checkpoint_id} state")
        agent.messages = agent.codec.decode(messages_blob, f"checkpoint {checkpoint_id} messages")
        with agent.db.transaction() as tx:
            tx.execute("UPDATE threads SET forked_from = ? WHERE id = ?",
                       (checkpoint_id, new_thread))
        return agent._checkpoint(f"fork of {thread_id} at {checkpoint_id}",
                                 {"forked_from": checkpoint_id}, parent=checkpoint_id,
                                 force=True).id


def _fork_disk(store: Store, binding: str | None, snapshot: str | None, new_thread: str):
    if not binding or not snapshot:
        return None
    from blockdiff.vm.sandbox import Sandbox

    kind, _, where = binding.partition(":")
    if kind == "vm":
        return Sandbox(store, where).fork(snapshot, new_thread, start=False)
    path = Path(where)
    fork = path.with_name(f"{path.stem}.{new_thread}{path.suffix}")
    store.restore(snapshot, fork)
    return ImageDisk(store, fork)


def rewind_thread(store: Store, thread_id: str, checkpoint_id: str, *, key=None) -> Compensation:
    """:meth:`Agent.rewind` from a process without the agent's tools: the
    state and disk go back now; compensations that need the tools are left
    pending and run when the agent next opens the thread."""
    info = AgentDB(store)
    try:
        binding = info.thread(thread_id).disk
    finally:
        info.close()
    disk = bound_disk(store, binding)
    with Agent(store, thread_id, disk=disk, key=key, create=False, reopen_failed=True) as agent:
        return agent.rewind(checkpoint_id)
