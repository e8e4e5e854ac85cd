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
recorded result without running; a call that was in flight (its process
died, or lost its lease and may still be running on another host) is
settled under that same request id before the step goes on: looked up,
retried under it, or refused as in doubt (:mod:`blockdiff.agent.calls`).

Commands that act on the sandbox disk need no journal: the disk goes back
with the state, so running them again is correct. Tools with effects outside
(a payment, an email) are what the journal is for, and those that cannot be
undone by restoring a disk register a compensation, run newest first when
the thread is rewound past them or its run fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable

from blockdiff.agent.calls import (
    NOT_APPLIED,
    Fence,
    FencedOff,
    NotApplied,
    Tool,
    ToolCalls,
    request_id,
)
from blockdiff.agent.diff import Change, environment_changes
from blockdiff.agent.disks import Disk, bound_disk, disk_binding, fork_disk
from blockdiff.agent.model import (
    REFUSED_CHANGES,
    AgentDB,
    Approval,
    Checkpoint,
    CheckpointResult,
    Compensation,
    Environment,
    process_owner,
)
from blockdiff.agent.sealing import Codec
from blockdiff.errors import (
    AgentError,
    AmbiguousCheckpoint,
    EnvironmentChanged,
    InDoubt,
    RemoteError,
    StoreError,
    ThreadBusy,
    ThreadFailed,
    ToolFailed,
    UnknownCheckpoint,
    UnknownThread,
    UsageError,
)
from blockdiff.store.retention import check_duration
from blockdiff.store.store import Store, as_store

# What callers import from here, the errors the agent raises included.
__all__ = [
    "DEFAULT_LEASE", "NOT_APPLIED", "TRACE_POINTS", "Agent", "AgentDB", "AgentError",
    "AmbiguousCheckpoint", "Approval", "ApprovalPending", "Checkpoint", "CheckpointResult",
    "Compensation", "Environment", "EnvironmentChanged", "Fence", "FencedOff", "InDoubt",
    "NotApplied", "Step",
    "ThreadBusy", "ThreadFailed", "Tool", "ToolFailed", "UnknownCheckpoint", "UnknownThread",
    "bound_disk", "disk_binding", "fork_thread", "request_id", "rewind_thread",
]

DEFAULT_LEASE = 300.0
# How long an external call waits for its checkpoint to reach the object store,
# and closing an agent for what it checkpointed.
DURABLE_WAIT = 120.0
CLOSE_PUSH_WAIT = 30.0
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
def _new_id() -> str:
    return os.urandom(8).hex()


class ApprovalPending(Exception):
    """Raised to stop a run that waits for a human: not a failure, so not a
    :class:`~blockdiff.errors.BlockdiffError`; the caller ends the run and
    resumes it once the approval is decided."""

    def __init__(self, thread: str, approval_id: str, action):
        super().__init__(f"thread {thread} waits for approval of {json.dumps(action)}; "
                         f"approve or reject it with: blockdiff agent approve|reject {thread}")
        self.thread, self.approval_id, self.action = thread, approval_id, action


def _disk_snapshot(disk: Disk | None, thread_id: str, reason: str,
                   parent: Checkpoint | None, memory: bool | None = None) -> str | None:
    """The disk snapshot of a new agent checkpoint of ``thread_id``: the disk
    committed (a new snapshot only if it changed), with the sandbox's
    processes if ``memory`` (None: as the disk does by default), or without
    a disk the parent's."""
    if disk is None:
        return parent.disk_snapshot if parent else None
    # No TTL on the disk snapshot: the store's gc does not know which one a
    # thread's head needs; AgentDB.gc removes them.
    # Only a disk that can hold processes (a sandbox VM) is told whether to:
    # a disk of the caller's own need not know the option.
    choice = {"memory": memory} if memory is not None and hasattr(
        disk, "memory_checkpoints") else {}
    return disk.checkpoint(f"agent {thread_id}: {reason}", {"agent.thread": thread_id},
                           skip_unchanged=True, **choice)


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

    ``environment`` (an :class:`~blockdiff.agent.model.Environment` or a
    dict of its fields) is what the run depends on besides: the model, the
    system prompt, the tools (the agent's own ``tools`` added, with their
    versions) and environment variables. Each checkpoint records it,
    redacted and sealed like the state; without one, checkpoints keep the
    head's. Resuming under another model or system prompt than the head's
    raises :class:`EnvironmentChanged` unless ``allow_environment_change``;
    other differences are listed in :attr:`environment_changes`.
    """

    def __init__(self, store: Store | str | os.PathLike, thread_id: str, *,
                 disk: Disk | None = None, tools: Iterable[Tool] = (),
                 key: bytes | str | None = None, secrets: Iterable[str] = (),
                 redactor: Callable | None = None, ttl: float | None = None,
                 lease: float = DEFAULT_LEASE, create: bool = True,
                 reopen_failed: bool = False, trace: Callable[[str], None] | None = None,
                 environment: Environment | dict | None = None,
                 allow_environment_change: bool = False):
        if not thread_id or "/" in thread_id:
            raise UsageError(f"bad thread id {thread_id!r}")
        if ttl is not None:
            ttl = check_duration(ttl, "ttl")
        self.store = as_store(store)
        self.codec = Codec(key, secrets=secrets, redactor=redactor)
        self.db = AgentDB(self.store, self.codec)
        self._closed = False
        self.thread_id = thread_id
        self.disk = disk
        self.tools = {t.name: t for t in tools}
        self.environment = self._full_environment(environment)
        self.environment_changes: list[Change] = []
        self.ttl = ttl
        self.lease = lease
        self.owner = process_owner(self.db.here)
        self.trace = trace or (lambda point: None)
        self._step: Step | None = None
        self._approvals_asked: tuple[str | None, int] = (None, -1)
        try:
            # From here on the owner value carries the lease's fencing token.
            status_at_open, self.owner = self.db.acquire(thread_id, self.owner, lease,
                                                         binding=disk_binding(disk),
                                                         create=create)
        except BaseException:
            self.db.close()
            raise
        self.calls = ToolCalls(self.db, self.codec, thread_id, self.owner, tools=self.tools,
                               lease=lease, trace=self.trace,
                               before_external=self._make_durable)
        try:
            self._disk_stores = self._shared_disk_stores()
            for disk_store in self._disk_stores:
                disk_store.push_in_background()
            info = self.db.thread(thread_id)
            self.head: str | None = info.head
            self.state: dict = {}
            self.messages: list = []
            head = None
            if info.head is not None:
                head = self._restorable_head(self.db.checkpoint(info.head))
                self.head = None if head is None else head.id
            self.resumed = head is not None
            if head is not None:
                self._check_environment(head, allow_environment_change)
                self._load(head.id)
                if self.disk is not None and head.disk_snapshot:
                    self.disk.restore(head.disk_snapshot)
            report = self.run_pending_compensations()
            if status_at_open in ("failing", "failed") and not reopen_failed:
                if status_at_open == "failing" and not report.pending:
                    self.close("failed")
                else:
                    self.close(status_at_open)
                raise ThreadFailed(f"thread {thread_id} failed and its effects were compensated"
                                   + (f" ({len(report.pending)} compensations still need the "
                                      f"agent's tools)" if report.pending else "")
                                   + "; rewind it to a checkpoint or fork it to go on")
        except BaseException:
            self.close()
            raise

    def _shared_disk_stores(self) -> list:
        """The shared stores the disk's snapshots go to (none for a store of one host)."""
        disk_store = getattr(self.disk, "store", None)
        return [disk_store] if getattr(disk_store, "shared", None) is not None else []

    def _restorable_head(self, head: Checkpoint) -> Checkpoint | None:
        """The checkpoint to resume from: the head, or in a shared store, if
        its disk snapshot never reached the object store from the host that
        took it (which died, say) and is not here, the newest ancestor whose
        disk snapshot did (None: none did, the thread starts over). No
        external call was made from a checkpoint after that one (see
        :meth:`_make_durable`), so resuming from it repeats none; the head
        moves back to it."""
        if not self._disk_stores:
            return head
        disk_store = self._disk_stores[0]
        found = None
        for checkpoint in self.db.ancestry(head.id):
            snapshot = checkpoint.disk_snapshot
            if snapshot is None:
                continue
            place = disk_store.placement_of(snapshot)
            if place.here or place.durable:
                found = checkpoint
                break
        if found is None or found.id != head.id:
            self.db.move_head(self.thread_id, self.owner, None if found is None else found.id,
                              self.lease)
        return found

    def _make_durable(self, base: str) -> None:
        """Before an external call from checkpoint ``base``: its disk
        snapshot must be in the object store, so that any host resuming the
        thread resumes from ``base`` or later and finds the call in the
        journal instead of making it again."""
        if not self._disk_stores:
            return
        snapshot = self.db.checkpoint(base).disk_snapshot
        if snapshot is None:
            return
        disk_store = self._disk_stores[0]
        deadline = time.monotonic() + DURABLE_WAIT
        failure = None
        while not disk_store.durable(snapshot):
            left = deadline - time.monotonic()
            if left <= 0:
                why = failure or "still uploading"
                raise AgentError(f"checkpoint {base} of thread {self.thread_id} is not in the "
                                 f"object store after {DURABLE_WAIT:g} s ({why}), so no "
                                 f"external call is made from it; check the object store, "
                                 f"then resume")
            try:
                disk_store.wait_pushed(min(left, 1.0))
            except RemoteError as e:       # the pusher retries; so does this wait
                failure = e
                time.sleep(min(0.5, max(0.0, left)))

    def durability(self, checkpoint_id: str | None = None) -> str:
        """``"durable"`` once a checkpoint (by default the head) can be
        resumed on any host of a shared store, ``"local"`` before (and
        always, in a store of one host)."""
        checkpoint_id = checkpoint_id or self.head
        if self.store.shared is None or checkpoint_id is None:
            return "local"
        snapshot = self.db.checkpoint(checkpoint_id).disk_snapshot
        if snapshot is None or not self._disk_stores:
            return "durable"       # all of it is in the shared database
        return "durable" if self._disk_stores[0].durable(snapshot) else "local"

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until the head is durable (False on timeout)."""
        for disk_store in self._disk_stores:
            if not disk_store.wait_pushed(timeout):
                return False
        return self.durability() == "durable"

    def wait_for_decision(self, approval_id: str, *, timeout: float | None = None,
                          poll: float = 0.25) -> Approval | None:
        """Wait for an approval to be decided, from any process or host
        (polling the shared records every ``poll`` seconds); the approval,
        or None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            asked = self.db.approval(approval_id, codec=self.codec)
            if asked is None:
                raise AgentError(f"no approval {approval_id} in {self.store.root}")
            if asked.decision is not None:
                return asked
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(poll if deadline is None else
                       max(0.0, min(poll, deadline - time.monotonic())))

    def _full_environment(self, given: Environment | dict | None) -> Environment | None:
        """``given`` with the agent's own tools (and their versions) in its
        tool set; the caller's names win."""
        if given is None:
            return None
        given = Environment.of(given)
        own = {name: tool.version for name, tool in self.tools.items()}
        return dataclasses.replace(given, tools=own | dict(given.tools))

    def _check_environment(self, head: Checkpoint, allow_change: bool) -> None:
        """Compare the environment given with the head's, as written (a
        redacted secret is no change), and refuse a changed model or prompt."""
        if self.environment is None or head.environment_id is None:
            return
        changes = environment_changes(self.db.environment(head.environment_id),
                                      self.db.as_written(self.environment))
        refused = [c for c in changes if c.path in REFUSED_CHANGES]
        if refused and not allow_change:
            what = ", ".join("the system prompt" if c.path == "system_prompt"
                             else f"{c.path} {c.before!r} (now {c.after!r})" for c in refused)
            raise EnvironmentChanged(
                f"thread {self.thread_id} is resumed under another environment than its head "
                f"checkpoint's: {what} changed; replaying its journal under another model or "
                f"prompt can diverge from what it did. Pass allow_environment_change=True to "
                f"go on (the next checkpoint records the new environment), or fork the thread")
        self.environment_changes = changes

    def close(self, status: str | None = None) -> None:
        """Let go of the thread (its lease ends; ``status``, default idle) and the database."""
        if self._closed:
            return
        self._closed = True
        # What was checkpointed goes up before the thread is let go (best
        # effort: what stays pending is pushed by the next process).
        for disk_store in getattr(self, "_disk_stores", ()):
            with contextlib.suppress(RemoteError, StoreError, OSError):
                disk_store.wait_pushed(CLOSE_PUSH_WAIT)
        self.db.release(self.thread_id, self.owner, status)
        self.db.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, ApprovalPending):
            self.close("waiting_approval")
        else:
            self.close()

    # ------------------------------------------------------------- state

    def _load(self, checkpoint_id: str) -> None:
        self.state, self.messages = self.db.load(checkpoint_id)

    def checkpoint(self, reason: str = "manual", meta: dict | None = None, *,
                   memory: bool | None = None) -> CheckpointResult:
        """Record the state, the messages and the disk as a new node after the
        head; skipped (the head's id returned) when none of them changed.
        ``memory``: a sandbox VM's running processes too (True), its disk
        only (False), or as the sandbox does by default (None)."""
        if self._step is not None:
            raise AgentError("checkpoints are taken between steps; this one is inside a step")
        return self._checkpoint(reason, meta or {}, memory=memory)

    def _checkpoint(self, reason: str, meta: dict, *, force: bool = False,
                    memory: bool | None = None) -> CheckpointResult:
        start = time.monotonic()
        head = self.db.checkpoint(self.head) if self.head else None
        disk_started = time.monotonic()
        disk_snapshot = _disk_snapshot(self.disk, self.thread_id, reason, head, memory)
        disk_seconds = 0.0
        if self.disk is not None:
            disk_seconds = time.monotonic() - disk_started
            self.trace("checkpoint.disk")
        # Compared as written: redacted, and keyed when sealed, so that the
        # hash confirms no guess at a secret or a sealed value.
        written = self.codec.serialise(self.state), self.codec.serialise(self.messages)
        content = self.codec.content_hash(*written)
        environment = self._environment_reference(head)
        if (head is not None and not force and head.content_hash == content
                and head.disk_snapshot == disk_snapshot
                and head.environment_id == self._environment_id(environment)):
            self.db.renew(self.thread_id, self.owner, self.lease)
            return CheckpointResult(head.id, True, time.monotonic() - start, disk_seconds)
        checkpoint_id = _new_id()
        self.db.record_checkpoint(checkpoint_id, self.thread_id, self.owner, parent=head,
                                  reason=reason, written=written, content_hash=content,
                                  disk_snapshot=disk_snapshot, meta=meta, ttl=self.ttl,
                                  lease=self.lease, environment=environment)
        self.head = checkpoint_id
        self.trace("checkpoint.recorded")
        return CheckpointResult(checkpoint_id, False, time.monotonic() - start, disk_seconds)

    def _environment_reference(self, head: Checkpoint | None) -> Environment | str | None:
        """What a new checkpoint records as its environment: the agent's,
        or without one the head's (its id)."""
        if self.environment is not None:
            return self.environment
        return head.environment_id if head is not None else None

    def _environment_id(self, environment: Environment | str | None) -> str | None:
        if isinstance(environment, Environment):
            return self.db.environment_id(environment)
        return environment

    # ------------------------------------------------------------- steps

    def step(self, name: str = "", meta: dict | None = None, *,
             memory: bool | None = None) -> "Step":
        """A unit of work: ``with agent.step("fetch page 2") as s: ...``. On a
        clean exit the thread is checkpointed; on an exception nothing is, and
        the in-memory state goes back to the head. ``memory`` is the
        checkpoint's (see :meth:`checkpoint`): False for a step that only
        reads, whose sandbox processes need not come back; a step that made
        an external call (an irreversible action) checkpoints the processes
        anyway, so that a resume carries on exactly after it."""
        if self._step is not None:
            raise AgentError("steps do not nest")
        return Step(self, name, meta or {}, memory)

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
        if self.head is None or self.db.approval(
                request_id(self.head, again, "approval")) is None:
            # The whole sandbox: the run stops here until a human decides.
            self._checkpoint("approval", {"approval": True}, memory=True)
        # Several approvals asked at one head (nothing changed in between) are
        # told apart by their order, which a replay repeats.
        seen_head, count = self._approvals_asked
        count = count + 1 if seen_head == self.head else 0
        self._approvals_asked = (self.head, count)
        approval_id = request_id(self.head, count, "approval")
        asked = self.db.approval(approval_id)
        if asked is None:
            self.db.ask_approval(approval_id, self.thread_id, self.head, action, ttl)
            self._approvals_asked = (self.head, count - 1)  # asking again means this one
            raise ApprovalPending(self.thread_id, approval_id, action)
        if asked.decision is None:
            if asked.expires is not None and asked.expires <= time.time():
                self.db.expire_approval(approval_id)
            else:
                self._approvals_asked = (self.head, count - 1)
                raise ApprovalPending(self.thread_id, approval_id, action)
        return self.db.approval(approval_id, codec=self.codec)

    # --------------------------------------------------------- the journal

    @property
    def fence(self) -> Fence:
        """The lease this agent holds the thread under, as a fenced tool passes it on."""
        return self.calls.fence

    def run_pending_compensations(self) -> Compensation:
        """Run the compensations a rewind or a failure left pending (see
        :meth:`ToolCalls.compensate_pending`)."""
        return self.calls.compensate_pending()

    # ------------------------------------------------------- time travel

    def rewind(self, checkpoint_id: str) -> Compensation:
        """Put the thread back to ``checkpoint_id``: compensate, newest first,
        the effects of every call made since; restore its state and disk; and
        continue from a new node that copies it (so calls made from here on
        get request ids of their own, not those of the undone ones)."""
        if self._step is not None:
            raise AgentError("rewind between steps, not inside one")
        target = self.db.checkpoint_of_thread(checkpoint_id, self.thread_id)
        checkpoint_id = target.id   # a prefix resolved
        # One transaction marks what to undo and makes the rewound node the
        # head: a process dying anywhere after it resumes at the rewound state
        # (the disk follows the head on open) and finishes the compensations.
        rids = self.db.effects_since(self.thread_id, self.head, checkpoint_id)
        self._load(checkpoint_id)
        written = self.codec.serialise(self.state), self.codec.serialise(self.messages)
        rewound = _new_id()
        self.db.record_checkpoint(rewound, self.thread_id, self.owner, parent=target,
                                  reason=f"rewind to {checkpoint_id}", written=written,
                                  content_hash=target.content_hash,
                                  disk_snapshot=target.disk_snapshot,
                                  meta={"rewound_from": self.head}, ttl=self.ttl,
                                  lease=self.lease, undo=rids, environment=target.environment_id)
        self.head = rewound
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
        self.db.mark_failing(self.thread_id, self.owner,
                             self.db.effects_since(self.thread_id, self.head, target))
        self.trace("rewind.marked")
        report = self.run_pending_compensations()
        self.close("failed")
        return report

    def history(self) -> list[Checkpoint]:
        """The thread's checkpoints from the head back, newest first."""
        return self.db.history(self.thread_id)


class Step:
    """The body of ``with agent.step(...)``: see :meth:`Agent.step`."""

    def __init__(self, agent: Agent, name: str, meta: dict, memory: bool | None = None):
        self.agent = agent
        self.name = name
        self.meta = meta
        self.memory = memory
        self.base: str | None = None
        self.calls = 0
        self.external_calls = 0
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
        if definition is not None and definition.external:
            self.external_calls += 1
        return self.agent.calls.call(self.base, position, tool, args or {})

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
        memory = True if self.external_calls else self.memory
        self.result = agent._checkpoint(reason, {"step": self.name, "calls": self.calls}
                                        | self.meta, memory=memory)


# ------------------------------------------------------- other processes


def fork_thread(store: Store, thread_id: str, checkpoint_id: str, new_thread: str, *,
                key=None) -> str:
    """A new thread starting from ``checkpoint_id`` of ``thread_id``, with a
    disk of its own forked from that checkpoint's disk snapshot. Returns the
    new thread's first checkpoint."""
    codec = Codec(key)
    with AgentDB(store, codec) as db:
        source = db.thread(thread_id)
        target = db.checkpoint_of_thread(checkpoint_id, thread_id)
        # Before the disk is forked: a fork's disk is named after the thread.
        db.require_new_thread(new_thread)
        state, messages = db.load(target.id)
        disk = fork_disk(store, source.disk, target.disk_snapshot, new_thread)
        owner = db.create_thread(new_thread, process_owner(db.here), DEFAULT_LEASE,
                                 binding=disk_binding(disk),
                                 forked_from=target.id)
        try:
            reason = f"fork of {thread_id} at {target.id}"
            written = codec.serialise(state), codec.serialise(messages)
            head = _new_id()
            db.record_checkpoint(head, new_thread, owner, parent=target, reason=reason,
                                 written=written, content_hash=codec.content_hash(*written),
                                 disk_snapshot=_disk_snapshot(disk, new_thread, reason, target),
                                 meta={"forked_from": target.id}, ttl=None,
                                 lease=DEFAULT_LEASE, environment=target.environment_id)
        finally:
            db.release(new_thread, owner)
    return head


def rewind_thread(store: Store, thread_id: str, checkpoint_id: str, *, key=None) -> Compensation:
    """:meth:`Agent.rewind` from a process without the agent's tools: the
    state and disk go back now; compensations that need the tools are left
    pending and run when the agent next opens the thread."""
    with AgentDB(store) as db:
        binding = db.thread(thread_id).disk
    disk = bound_disk(store, binding)
    with Agent(store, thread_id, disk=disk, key=key, create=False, reopen_failed=True) as agent:
        return agent.rewind(checkpoint_id)
