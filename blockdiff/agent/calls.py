"""A thread's tool calls, made by the process that holds its lease: each
call journalled before it runs and recorded after, answered from the journal
when its step runs again, settled under its own request id when it was left
in doubt (its process died, or lost its lease and may still be running on
another host), and compensated, newest first, when a rewind or a failure
marked it. See docs/agent.md (Exactly-once tool calls, Fenced tools,
Compensation)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from blockdiff.agent.model import AgentDB, Compensation, JournalCall, lease_token, may_still_run
from blockdiff.agent.sealing import Codec
from blockdiff.errors import AgentError, InDoubt, ThreadBusy, ToolFailed, UsageError

NOT_APPLIED = object()  # a tool's check: "that request never took effect"


class NotApplied(Exception):
    """Raised by a tool whose call failed without taking effect (a declined
    payment, a rejected request). Any other exception leaves the call in
    doubt, to be settled before it is retried."""


class FencedOff(NotApplied):
    """Raised by a fenced tool whose service refused the request because its
    fencing token is older than one the service has seen for the thread:
    nothing took effect, and another process holds the thread now. The agent
    stops with :class:`~blockdiff.errors.ThreadBusy`."""


@dataclass(frozen=True)
class Fence:
    """The lease a call is made under, for the service to fence by: ``scope``
    is the thread, ``token`` its lease's fencing token, which grows with every
    acquisition. A service that refuses a request whose token is older than
    one it has seen for the scope refuses a process whose lease was taken
    over, however late that process wakes."""

    scope: str
    token: int


@dataclass(frozen=True)
class Tool:
    """Something an agent calls with effects the journal must account for.

    ``run(args, request_id)`` does it and returns a JSON-serialisable result,
    or raises :class:`NotApplied` when it failed without taking effect;
    passing ``request_id`` on as an idempotency key is what makes retries safe.
    ``check(request_id)`` looks a request up: its result if it took effect,
    else :data:`NOT_APPLIED`. ``compensate(args, result, undo_id)`` undoes it.
    ``external``: effects outside the sandbox (False: a disk restore undoes
    them, and the call is simply run again on replay). ``idempotent``: running
    a request id twice has the effect of once (the service deduplicates by
    it), so a call in doubt is settled by retrying it under its id.
    ``fenced``: ``run``, ``check`` and ``compensate`` take the lease's
    :class:`Fence` as a last argument and pass it to the service, which
    refuses (:class:`FencedOff`) a request whose token is older than one it
    has seen for the thread; a check that finds nothing then settles a call
    for good even while the process that made it may still be running (on
    another host, paused), since that process's request is refused from then
    on. ``high_risk``: only as the first action of a step, so that the
    step's start is the checkpoint right before it. ``version``: recorded in
    the environment of each checkpoint."""

    name: str
    run: Callable
    check: Callable | None = None
    compensate: Callable | None = None
    external: bool = True
    idempotent: bool = False
    high_risk: bool = False
    version: str | None = None
    fenced: bool = False


def request_id(base: str, position: int, kind: str = "call") -> str:
    """The id of the ``position``-th call of the step that began at ``base``."""
    return hashlib.sha256(f"{base}/{kind}/{position}".encode()).hexdigest()[:32]


class ToolCalls:
    """The calls of thread ``thread_id`` made under the lease ``owner``
    holds (its owner value, with the fencing token), with ``tools`` by name.
    ``before_external(base)`` runs before an external call from checkpoint
    ``base`` is journalled; ``trace`` is told the protocol's points."""

    def __init__(self, db: AgentDB, codec: Codec, thread_id: str, owner: str, *,
                 tools: dict[str, Tool], lease: float, trace: Callable[[str], None],
                 before_external: Callable[[str], None]):
        self.db, self.codec = db, codec
        self.thread_id, self.owner = thread_id, owner
        self.tools, self.lease, self.trace = tools, lease, trace
        self.before_external = before_external

    @property
    def fence(self) -> Fence:
        """The lease the calls are made under, as a fenced tool passes it on."""
        return Fence(self.thread_id, lease_token(self.owner))

    def _invoke(self, tool: Tool, function: Callable, *args):
        """Call one of ``tool``'s functions, with the fence if the tool is fenced."""
        try:
            return function(*args, self.fence) if tool.fenced else function(*args)
        except FencedOff as e:
            raise ThreadBusy(f"thread {self.thread_id} was taken over by another process: "
                             f"{tool.name}'s service refused this process's fencing token "
                             f"{self.fence.token} ({e}); stopping rather than acting twice"
                             ) from e

    def call(self, base: str, position: int, tool_name: str, args: dict):
        """Make the ``position``-th call of the step that began at ``base``
        exactly once: its journalled result if it has one, the call settled
        if it is in doubt, else journalled, made and recorded."""
        tool = self.tools.get(tool_name)
        if tool is None:
            raise UsageError(f"no tool named {tool_name!r} was given to this agent")
        rid = request_id(base, position)
        recorded = self.db.call(rid)
        if recorded is not None:
            if recorded.tool != tool_name:
                raise AgentError(f"the step's call #{position} was {recorded.tool} and is now "
                                 f"{tool_name}: the step is not deterministic, so its journal "
                                 f"cannot be replayed")
            if recorded.status == "done":
                return self.codec.decode(recorded.result, f"journal {rid}")
            if recorded.status in ("compensating", "compensated", "uncompensable"):
                raise AgentError(f"call {rid} ({tool_name}) was compensated; rewind the thread "
                                 f"to continue")
            if recorded.status == "intent":
                return self._settle(tool, recorded, args)
            return self._run(tool, rid, args)
        if tool.external:
            self.before_external(base)
        self.db.record_intent(rid, self.thread_id, self.owner, base=base, position=position,
                              tool=tool_name,
                              args=self.codec.encode(args, f"journal {rid} args"),
                              compensable=tool.compensate is not None,
                              external=tool.external)
        self.trace("call.intent")
        return self._run(tool, rid, args)

    def _look_up(self, tool: Tool, call: JournalCall) -> object:
        """What a call in doubt (its intent journalled, no outcome) came to,
        as far as the tool's check can tell for good: its result (journalled
        as done), :data:`NOT_APPLIED` if it never will take effect, or None
        if the check cannot say: there is none, or it found nothing while the
        process that journalled the call may still make it, and the tool is
        not fenced against that process. The journal says what was found."""
        if tool.check is None:
            return None
        rid = call.request_id
        found = self._invoke(tool, tool.check, rid)
        if found is not NOT_APPLIED:
            self._record(rid, "done", found, settled=f"looked up by {self.owner}: it took "
                                                     f"effect")
            return found
        final = self._nothing_can_still_make(tool, call)
        if final:
            self.db.update_call(rid, owner=self.owner,
                                settled=f"looked up by {self.owner}: no effect, and {final}")
            return NOT_APPLIED
        return None

    def _nothing_can_still_make(self, tool: Tool, call: JournalCall) -> str | None:
        """Why no request of ``call`` can take effect from now on, if none
        can, once a request of ours under its id found it not applied (None:
        the process that journalled it may still make it)."""
        if not may_still_run(call.owner, self.owner, self.db.here):
            return "the process that made it is not running it"
        if tool.fenced and lease_token(call.owner) < self.fence.token:
            return (f"the service refuses from now on the older fencing token "
                    f"{lease_token(call.owner)} it was made under")
        return None

    def _settle(self, tool: Tool, call: JournalCall, args: dict):
        """A call in flight when the process that made it stopped (it died,
        or lost its lease and may still be running): settle it under its
        request id before the step goes on, never under a new one."""
        rid = call.request_id
        # Only the holder settles: a process whose lease was taken over stops here.
        self.db.renew(self.thread_id, self.owner, self.lease)
        if not tool.external:
            return self._run(tool, rid, args)
        found = self._look_up(tool, call)
        if found is NOT_APPLIED:
            return self._run(tool, rid, args)
        if found is not None:
            return found
        holder = call.owner or "a process of an older blockdiff"
        if not tool.idempotent:
            if tool.check is None:
                raise InDoubt(f"{tool.name} request {rid} was left in flight by {holder} and "
                              f"the tool cannot say whether it took effect; give the tool a "
                              f"check or make it idempotent")
            raise InDoubt(f"{tool.name} request {rid} was left in flight by {holder}, which may "
                          f"still be running (a lapsed lease says it stopped renewing, not that "
                          f"it stopped): the tool's check finds no effect yet, so the tool "
                          f"cannot say whether it took effect; make the tool fenced, or "
                          f"idempotent so that it is retried under the same id")
        # Retried under its own id: whichever of the two requests reaches the
        # service first takes effect, the other is deduplicated.
        return self._run(tool, rid, args, settled=f"retried under its request id by "
                                                  f"{self.owner}")

    def _run(self, tool: Tool, rid: str, args: dict, settled: str | None = None):
        try:
            result = self._invoke(tool, tool.run, args, rid)
        except ThreadBusy:
            raise
        except NotApplied as e:
            # The tool says it did nothing: the call is as if never made.
            self.db.forget_intent(rid, owner=self.owner)
            raise ToolFailed(f"{tool.name} failed: {e}") from e
        except Exception as e:
            # Any other failure (a timeout, a lost answer) may have taken
            # effect: the intent stays, and the step's next run settles it
            # (check, idempotent retry, or InDoubt) before calling again.
            raise ToolFailed(f"{tool.name} failed: {e}") from e
        self.trace("call.ran")
        self._record(rid, "done", result, settled=settled)
        self.trace("call.recorded")
        return result

    def _record(self, rid: str, status: str, result, settled: str | None = None) -> None:
        self.db.record_result(rid, status, self.codec.encode(result, f"journal {rid}"),
                              owner=self.owner, settled=settled)

    # ------------------------------------------------------ compensation

    def compensate_pending(self) -> Compensation:
        """Run the compensations a rewind or a failure left pending (newest
        first); each is journalled and passes the tool the same undo id every
        time, so one interrupted and run again takes effect once. A call in
        doubt is settled first (:meth:`_settle_for_undo`): what is undone is
        what is known to have happened."""
        report = Compensation()
        owner = self.owner
        for call in self.db.pending_undo(self.thread_id):
            rid, tool_name = call.request_id, call.tool
            tool = self.tools.get(tool_name)
            context = f"journal {rid}"
            if not call.external:
                self.db.update_call(rid, undo="restored with the disk", owner=owner)
                continue
            if not call.compensable:
                self.db.update_call(rid, status="uncompensable", owner=owner)
                report.uncompensable.append(f"{tool_name} {rid}")
                continue
            if tool is None:
                report.pending.append(f"{tool_name} {rid}")
                continue
            args = self.codec.decode(call.args, context + " args")
            result = self.codec.decode(call.result, context) if call.result else None
            if call.status == "intent":
                settled = self._settle_for_undo(tool, call, args)
                if settled is None:
                    self.db.update_call(rid, status="uncompensable", owner=owner)
                    report.uncompensable.append(f"{tool_name} {rid} (in doubt: the tool "
                                                f"cannot say whether it took effect)")
                    continue
                if settled is NOT_APPLIED:
                    self.db.update_call(rid, status="compensated", undo="never took effect",
                                        owner=owner)
                    continue
                result = settled
            self.db.update_call(rid, status="compensating", owner=owner)
            self.trace("compensation.intent")
            self._invoke(tool, tool.compensate, args, result, rid + ":undo")
            self.trace("compensation.ran")
            self.db.update_call(rid, status="compensated", undo="done", owner=owner)
            report.compensated.append(f"{tool_name} {rid}")
        return report

    def _settle_for_undo(self, tool: Tool, call: JournalCall, args: dict):
        """A call in doubt, about to be undone: its result if it took effect,
        NOT_APPLIED if it never will, None if nobody can say. When a lookup
        cannot say for good (the process that made it may still make it), an
        idempotent tool is run again under the same id, which takes effect
        once whoever gets there first, to learn the result to compensate."""
        found = self._look_up(tool, call)
        if found is not None or not tool.idempotent:
            return found
        rid = call.request_id
        try:
            found = self._invoke(tool, tool.run, args, rid)
        except ThreadBusy:
            raise
        except NotApplied:
            # Refused under its id; final only if the first request cannot
            # still be made and taken.
            final = self._nothing_can_still_make(tool, call)
            said = f"retried under its request id by {self.owner}: refused, no effect"
            self.db.update_call(rid, owner=self.owner,
                                settled=f"{said}, and {final}" if final else said)
            return NOT_APPLIED if final else None
        self._record(rid, "done", found, settled=f"retried under its request id by "
                                                 f"{self.owner}, to undo it")
        return found
