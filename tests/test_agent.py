"""Agent checkpoints on a real store on XFS: steps, the exactly-once journal,
approvals, leases, compensation, rewind and fork, sealing and redaction."""

from __future__ import annotations

import gc
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from blockdiff.agent import agent as agent_module
from blockdiff.agent import disks, model
from blockdiff.agent.agent import (
    NOT_APPLIED,
    Agent,
    AgentDB,
    ApprovalPending,
    Tool,
    fork_thread,
    rewind_thread,
)
from blockdiff.agent.disks import DiskKind, ImageDisk
from blockdiff.agent.sealing import new_key
from blockdiff.errors import (
    AgentError,
    InDoubt,
    SchemaTooNew,
    SealingError,
    ThreadBusy,
    ThreadFailed,
    UnknownCheckpoint,
    UnknownThread,
)
from blockdiff.store.store import Store

MiB = 1 << 20


class Bank:
    """An external service with real side effects, in memory."""

    def __init__(self):
        self.charges: dict[str, int] = {}
        self.runs = 0
        self.undone: list[str] = []

    def charge(self, args, rid):
        self.runs += 1
        self.charges.setdefault(rid, args["amount"])
        return {"charge": rid, "amount": args["amount"]}

    def check(self, rid):
        if rid in self.charges:
            return {"charge": rid, "amount": self.charges[rid]}
        return NOT_APPLIED

    def refund(self, args, result, undo_id):
        self.undone.append(result["charge"])
        self.charges.pop(result["charge"], None)

    def tools(self, **overrides):
        spec = {"run": self.charge, "check": self.check, "compensate": self.refund} | overrides
        return [Tool("charge", **spec), Tool("email", lambda a, r: {"sent": a["to"]}),
                Tool("exec", lambda a, r: {"ok": True}, external=False)]


@pytest.fixture
def setup(xfs):
    store = Store.init(xfs / "store")
    image = xfs / "disk.img"
    with open(image, "wb") as f:
        f.truncate(16 * MiB)
    yield store, ImageDisk(store, image), image
    store.close()
    gc.collect()  # catalog connections of AgentDBs the tests dropped: the mount must unmount


def write(image, offset: int, data: bytes) -> None:
    fd = os.open(image, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def order_step(a: Agent, image, amount: int):
    i = a.state.get("i", 0)
    with a.step(f"order {i}") as s:
        write(image, i * MiB, f"order {i}".encode() * 100)
        result = s.call("charge", {"amount": amount})
        s.state["i"] = i + 1
        s.state.setdefault("paid", []).append(result["charge"])
        s.messages.append({"role": "tool", "content": f"charged {amount}"})
    return s.result


def test_steps_checkpoint_state_and_disk_and_skip_when_unchanged(setup):
    store, disk, image = setup
    bank = Bank()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        first = order_step(a, image, 10)
        second = order_step(a, image, 20)
        assert not first.skipped and not second.skipped
        nodes = len(store.log())
        again = a.checkpoint("nothing happened")
        assert again.skipped and again.id == a.head
        assert len(store.log()) == nodes  # no disk snapshot either
        history = a.history()
    assert [c.reason for c in history] == ["tool_call", "tool_call", "start"]
    assert history[0].disk_snapshot != history[1].disk_snapshot
    assert [c.step for c in history] == [2, 1, 0]
    # Resumed in a new Agent: state, messages and disk as at the head.
    write(image, 5 * MiB, b"uncommitted junk")
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        assert a.resumed and a.state["i"] == 2 and len(a.messages) == 2
    with open(image, "rb") as f:
        f.seek(5 * MiB)
        assert f.read(16) == b"\0" * 16


def test_a_failed_step_leaves_state_and_disk_at_its_start_and_replays_its_calls(setup):
    store, disk, image = setup
    bank = Bank()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        order_step(a, image, 10)
        with pytest.raises(RuntimeError):
            with a.step("boom") as s:
                write(image, 0, b"half-done work")
                s.call("charge", {"amount": 99})
                s.state["i"] = 42
                raise RuntimeError("the model crashed")
        assert a.state["i"] == 1
        with open(image, "rb") as f:
            assert f.read(7) == b"order 0"
        # The retried step makes the same call: it is answered from the journal.
        order_step(a, image, 99)
    assert bank.runs == 2 and sorted(bank.charges.values()) == [10, 99]


@pytest.mark.parametrize("tool_state", ["applied", "not applied", "idempotent", "no check"])
def test_a_call_in_flight_at_a_crash_is_settled_before_any_retry(setup, tool_state):
    store, disk, image = setup
    bank = Bank()

    def crash_after_run(point):
        if point == ("call.ran" if tool_state in ("applied", "idempotent") else "call.intent"):
            raise KeyboardInterrupt  # the process "dies" there

    with pytest.raises(KeyboardInterrupt):
        with Agent(store, "t", disk=disk, tools=bank.tools(), trace=crash_after_run) as a:
            order_step(a, image, 10)
    [entry] = AgentDB(store).journal("t")
    assert entry.status == "intent"
    overrides = {"no check": {"check": None}, "idempotent": {"check": None, "idempotent": True}}
    tools = bank.tools(**overrides.get(tool_state, {}))
    with Agent(store, "t", disk=disk, tools=tools) as a:
        if tool_state == "no check":
            with pytest.raises(InDoubt, match="cannot say whether it took effect"):
                order_step(a, image, 10)
            return
        order_step(a, image, 10)
    assert list(bank.charges.values()) == [10]
    # Applied: the check finds it, no second run. Idempotent: run again with the
    # same request id, which the service takes once.
    assert bank.runs == (2 if tool_state == "idempotent" else 1)
    assert [e.status for e in AgentDB(store).journal("t")] == ["done"]


def test_a_step_that_calls_differently_on_replay_is_refused(setup):
    store, disk, image = setup
    bank = Bank()
    with pytest.raises(KeyboardInterrupt):
        with Agent(store, "t", disk=disk, tools=bank.tools(),
                   trace=lambda p: p == "call.recorded" and (_ for _ in ()).throw(
                       KeyboardInterrupt)) as a:
            order_step(a, image, 10)
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        with pytest.raises(AgentError, match="not deterministic"):
            with a.step() as s:
                s.call("email", {"to": "x"})


def test_high_risk_calls_begin_their_step(setup):
    store, disk, _ = setup
    bank = Bank()
    tools = bank.tools(high_risk=True)
    with Agent(store, "t", disk=disk, tools=tools) as a:
        with pytest.raises(AgentError, match="high-risk"):
            with a.step() as s:
                s.state["x"] = 1
                s.call("charge", {"amount": 1})
        with a.step() as s:
            s.call("charge", {"amount": 1})
    assert bank.runs == 1


def test_approval_pauses_persists_and_resumes_in_another_agent(setup):
    store, disk, _ = setup

    def run(a):
        if a.state.get("approved") is None:
            decision = a.approval({"pay": 500})
            with a.step("decided"):
                a.state["approved"] = decision.decision
        return a.state["approved"]

    with pytest.raises(ApprovalPending) as pending:
        with Agent(store, "t", disk=disk) as a:
            run(a)
    assert pending.value.action == {"pay": 500}
    db = AgentDB(store)
    assert db.thread("t").status == "waiting_approval"
    [waiting] = db.approvals(pending_only=True)
    assert waiting.thread == "t"
    with pytest.raises(ApprovalPending):  # still undecided
        with Agent(store, "t", disk=disk) as a:
            run(a)
    db.decide("t", "approved", comment="fine")
    with Agent(store, "t", disk=disk) as a:
        assert run(a) == "approved"
    assert db.approvals(pending_only=True) == []
    with pytest.raises(AgentError, match="no pending approval"):
        db.decide("t", "rejected")


def test_approvals_expire(setup):
    store, disk, _ = setup
    with pytest.raises(ApprovalPending):
        with Agent(store, "t", disk=disk) as a:
            a.approval("deploy", ttl=0.2)
    time.sleep(0.3)
    assert AgentDB(store).approvals(pending_only=True) == []
    with Agent(store, "t", disk=disk) as a:
        decision = a.approval("deploy", ttl=0.2)
    assert decision.decision == "expired" and not decision


def _open_in_child(store, thread, *, hold=False):
    code = (
        "import sys, time\n"
        "from blockdiff.agent.agent import Agent, ThreadBusy\n"
        f"try:\n    a = Agent({str(store.root)!r}, {thread!r})\n"
        "except ThreadBusy as e:\n    print(e); sys.exit(7)\n"
        + ("print('holding', flush=True)\ntime.sleep(60)\n" if hold else "a.close()\n"))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_thread_runs_in_one_process_at_a_time(setup):
    store, disk, _ = setup
    Agent(store, "t").close()
    holder = _open_in_child(store, "t", hold=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(ThreadBusy, match="refusing to run it twice"):
            Agent(store, "t")
        second = _open_in_child(store, "t")
        assert second.wait(30) == 7
    finally:
        holder.kill()
        holder.wait()
    # The holder died without letting go: its lease is taken over.
    Agent(store, "t").close()


def test_rewind_compensates_newest_first_and_calls_get_new_ids(setup):
    store, disk, image = setup
    bank = Bank()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        order_step(a, image, 10)
        target = a.head
        with open(image, "rb") as f:
            expected = f.read()
        order_step(a, image, 20)
        order_step(a, image, 30)
        with a.step("mail and exec") as s:
            s.call("email", {"to": "boss"})
            s.call("exec", {"cmd": "make"})
            s.state["mailed"] = True
        paid = list(a.state["paid"])
        report = a.rewind(target)
        assert bank.undone == [paid[2], paid[1]]            # newest first
        assert report.uncompensable == [f"email {e.request_id}" for e in
                                        AgentDB(store).journal("t") if e.tool == "email"]
        assert a.state == {"i": 1, "paid": paid[:1]}
        with open(image, "rb") as f:
            assert f.read() == expected
        order_step(a, image, 20)
        assert a.state["paid"][1] not in paid                # a new request id
    assert sorted(bank.charges.values()) == [10, 20]
    statuses = {e.tool: e.status for e in AgentDB(store).journal("t") if e.tool != "charge"}
    assert statuses == {"email": "uncompensable", "exec": "done"}
    tree = AgentDB(store).tree()
    assert "rewind to" in tree and "├─" in tree


def test_rewind_from_another_process_leaves_compensations_for_the_agent(setup):
    store, disk, image = setup
    bank = Bank()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        order_step(a, image, 10)
        target = a.head
        order_step(a, image, 20)
    report = rewind_thread(store, "t", target)
    assert len(report.pending) == 1 and bank.undone == []
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        assert len(bank.undone) == 1 and a.state["i"] == 1
    assert list(bank.charges.values()) == [10]


def test_failed_run_compensates_everything(setup):
    store, disk, image = setup
    bank = Bank()
    a = Agent(store, "t", disk=disk, tools=bank.tools())
    order_step(a, image, 10)
    order_step(a, image, 20)
    start = a.history()[-1].id
    report = a.fail()
    assert len(report.compensated) == 2 and bank.charges == {}
    assert AgentDB(store).thread("t").status == "failed"
    with pytest.raises(ThreadFailed, match="rewind it to a checkpoint or fork it"):
        Agent(store, "t", disk=disk, tools=bank.tools())
    # Rewound to its start, a failed thread runs again, under new request ids.
    rewind_thread(store, "t", start)
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        assert a.state == {}
        order_step(a, image, 30)
    assert sorted(bank.charges.values()) == [30]


def test_fork_gets_its_own_disk_and_changes_independently(setup):
    store, disk, image = setup
    bank = Bank()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        order_step(a, image, 10)
        point = a.head
        order_step(a, image, 20)
    head = fork_thread(store, "t", point, "t2")
    forked_image = image.with_name("disk.t2.img")
    with Agent(store, "t2", disk=ImageDisk(store, forked_image), tools=bank.tools()) as b:
        assert b.head == head and b.state["i"] == 1
        order_step(b, forked_image, 77)
        assert [c.id for c in b.history()][2] == point   # the fork point is an ancestor
    with open(image, "rb") as f, open(forked_image, "rb") as g:
        f.seek(MiB)
        g.seek(MiB)
        assert f.read(7) == b"order 1" and g.read(7) == b"order 1"
    assert sorted(bank.charges.values()) == [10, 20, 77]
    threads = {t.id: t for t in AgentDB(store).threads()}
    assert threads["t2"].forked_from == point
    with pytest.raises(AgentError, match="already exists"):
        fork_thread(store, "t", point, "t2")


class LabelledImage:
    """A disk of a kind of its own: an image file found by its label."""

    def __init__(self, store, directory, label):
        self.label = label
        self.image = ImageDisk(store, directory / f"{label}.img")

    def checkpoint(self, *args, **kwargs):
        return self.image.checkpoint(*args, **kwargs)

    def restore(self, snapshot_id):
        self.image.restore(snapshot_id)


def test_a_disk_kind_is_one_registration(setup, monkeypatch):
    """Registered once, a kind of disk is bound to its thread, reopened by a
    process that has only the binding (a rewind) and forked with the thread;
    a binding of a kind this code does not know is refused, not guessed at."""
    store, _, image = setup
    directory = image.parent
    monkeypatch.setattr(disks, "_KINDS", dict(disks._KINDS))

    def fork(store, label, snapshot_id, new_label):
        store.restore(snapshot_id, directory / f"{new_label}.img")
        return LabelledImage(store, directory, new_label)

    disks.register(DiskKind("labelled", LabelledImage, where=lambda disk: disk.label,
                            reopen=lambda store, label: LabelledImage(store, directory, label),
                            fork=fork))
    with pytest.raises(ValueError, match="registered already"):
        disks.register(DiskKind("labelled", LabelledImage, where=None, reopen=None, fork=None))
    first = directory / "first.img"
    with open(first, "wb") as f:
        f.truncate(4 * MiB)
    with Agent(store, "t", disk=LabelledImage(store, directory, "first")) as a:
        with a.step("one"):
            write(first, 0, b"one")
            a.state["n"] = 1
        point = a.head
        with a.step("two"):
            write(first, 0, b"two")
            a.state["n"] = 2
    assert AgentDB(store).thread("t").disk == "labelled:first"
    rewind_thread(store, "t", point)
    with open(first, "rb") as f:
        assert f.read(3) == b"one"
    fork_thread(store, "t", point, "second")
    assert AgentDB(store).thread("second").disk == "labelled:second"
    with open(directory / "second.img", "rb") as f:
        assert f.read(3) == b"one"
    del disks._KINDS["labelled"]
    with pytest.raises(AgentError, match="'labelled:first', a kind of disk this blockdiff"):
        rewind_thread(store, "t", point)


def test_sealed_state_needs_its_key(setup, monkeypatch):
    store, disk, image = setup
    key = new_key()
    with Agent(store, "t", disk=disk, tools=Bank().tools(), key=key,
               secrets={"api_token"}) as a:
        a.state["api_token"] = "sk-live-123"
        a.state["note"] = "visible only with the key"
        order_step(a, image, 10)
        head = a.head
    raw = sqlite3.connect(store.root / model.DB_NAME)
    blobs = b"".join(r[0] + r[1] for r in raw.execute("SELECT state, messages FROM checkpoints"))
    blobs += b"".join(r[0] for r in raw.execute("SELECT args FROM journal"))
    assert b"visible only" not in blobs and b"amount" not in blobs
    with Agent(store, "t", key=key) as a:
        assert a.state["api_token"] == "[redacted]" and a.state["note"].startswith("visible")
    with pytest.raises(SealingError, match="key is wrong"):
        Agent(store, "t", key=new_key())
    monkeypatch.delenv("BLOCKDIFF_AGENT_KEY", raising=False)
    with pytest.raises(SealingError, match="is encrypted; set BLOCKDIFF_AGENT_KEY"):
        Agent(store, "t")
    env = dict(os.environ, BLOCKDIFF_AGENT_KEY=new_key())
    done = subprocess.run([sys.executable, "-m", "blockdiff", "agent", "show", "--store",
                           str(store.root), head], capture_output=True, text=True, env=env)
    assert done.returncode == SealingError.exit_code == 11 and done.stderr.count("\n") == 1
    assert "key is wrong" in done.stderr
    env["BLOCKDIFF_AGENT_KEY"] = key
    shown = subprocess.run([sys.executable, "-m", "blockdiff", "agent", "show", "--store",
                            str(store.root), head, "--json"], capture_output=True, text=True,
                           env=env)
    assert shown.returncode == 0 and "visible only with the key" in shown.stdout


def test_expired_checkpoints_are_collected_with_their_disk_snapshots(setup):
    store, disk, image = setup
    with Agent(store, "t", disk=disk, tools=Bank().tools(), ttl=3600) as a:
        for amount in (10, 20, 30):
            order_step(a, image, amount)
        head = AgentDB(store).checkpoint(a.head)
        with open(image, "rb") as f:
            expected = f.read()
    assert head.expires == pytest.approx(head.created + 3600, abs=5)
    with AgentDB(store) as db:
        assert db.gc() == []                                   # nothing expired yet
        later = time.time() + 7200
        doomed = db.gc(now=later, dry_run=True)
        assert len(doomed) == 3 and head.id not in {c.id for c in doomed}
        assert len(db.history("t")) == 4
        db.gc(now=later)
        assert [c.id for c in db.history("t")] == [head.id]
    used = {c.disk_snapshot for c in doomed} - {head.disk_snapshot}
    assert not used & {s.id for s in store.log()}               # their disk snapshots went
    assert store.verify() == {}
    write(image, 0, b"scribble")
    with Agent(store, "t", disk=disk, tools=Bank().tools()) as a:  # resumes from the head
        assert a.state["i"] == 3
    with open(image, "rb") as f:
        assert f.read() == expected


def test_unknown_threads_and_checkpoints(setup):
    store, _, _ = setup
    db = AgentDB(store)
    with pytest.raises(UnknownThread):
        db.history("nope")
    with pytest.raises(UnknownCheckpoint):
        db.checkpoint("0123456789abcdef")
    with pytest.raises(UnknownThread):
        Agent(store, "nope", create=False)
    Agent(store, "t").close()
    with pytest.raises(UnknownCheckpoint):
        rewind_thread(store, "t", "0123456789abcdef")
    for args, code in ((["history", "nope"], 10), (["rewind", "nope", "x"], 10),
                       (["approve", "t"], 10), (["show", "zzz"], 10)):
        done = subprocess.run([sys.executable, "-m", "blockdiff", "agent", *args, "--store",
                               str(store.root)], capture_output=True, text=True)
        assert done.returncode == code, done.stderr
        assert done.stderr.startswith("blockdiff: error: ") and done.stderr.count("\n") == 1


def test_cli_lists_approves_and_forks(setup):
    store, disk, image = setup
    with pytest.raises(ApprovalPending):
        with Agent(store, "t", disk=disk) as a:
            a.approval({"deploy": "prod"})
    env = dict(os.environ, BLOCKDIFF_STORE=str(store.root))

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "blockdiff", "agent", *args],
                              capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert '{"deploy": "prod"}' in cli("pending")
    assert "waiting_approval" in cli("threads")
    assert "rejected" in cli("reject", "t", "-m", "no")
    assert AgentDB(store).approvals("t")[0].decision == "rejected"
    head = AgentDB(store).thread("t").head
    assert "forked from" in cli("fork", "t", head, "t2")
    assert "t2" in cli("threads") and "[t2]" in cli("tree")
    assert head in cli("history", "t2")


def test_a_tool_that_fails_may_have_taken_effect_unless_it_says_not(setup):
    store, disk, image = setup
    bank = Bank()
    attempts = []

    def flaky(args, rid):
        attempts.append(rid)
        if len(attempts) == 1:
            bank.charge(args, rid)
            raise TimeoutError("the answer was lost")     # but the charge went through
        if len(attempts) == 2:
            raise agent_module.NotApplied("declined")      # clean: nothing happened
        return bank.charge(args, rid)

    with Agent(store, "t", disk=disk, tools=bank.tools(run=flaky)) as a:
        with pytest.raises(agent_module.ToolFailed, match="answer was lost"):
            order_step(a, image, 10)
        assert [e.status for e in AgentDB(store).journal("t")] == ["intent"]
        order_step(a, image, 10)                # settled by check: no second charge
        assert len(attempts) == 1 and list(bank.charges.values()) == [10]
        with pytest.raises(agent_module.ToolFailed, match="declined"):
            order_step(a, image, 20)
        assert [e.status for e in AgentDB(store).journal("t")] == ["done"]
        order_step(a, image, 20)
    assert len(attempts) == 3 and sorted(bank.charges.values()) == [10, 20]


class Ledger:
    """A payment service that keeps every charge, refunded or not, under its
    request id; ``dedup``: a request id charged already is not charged again.
    A request that carries a fence is refused (``FencedOff``) if its token is
    older than one seen for its scope."""

    def __init__(self, dedup: bool):
        self.dedup = dedup
        self.made: list[tuple[str, int]] = []    # every charge made, in order
        self.refunded: set[str] = set()
        self.tokens: dict[str, int] = {}

    def _admit(self, fence):
        if fence is None:
            return
        if fence.token < self.tokens.get(fence.scope, 0):
            raise agent_module.FencedOff(f"token {fence.token} is older than "
                                         f"{self.tokens[fence.scope]}")
        self.tokens[fence.scope] = fence.token

    def run(self, args, rid, fence=None):
        self._admit(fence)
        if not (self.dedup and any(r == rid for r, _ in self.made)):
            self.made.append((rid, args["amount"]))
        return {"charge": rid, "amount": args["amount"]}

    def check(self, rid, fence=None):
        self._admit(fence)
        found = [a for r, a in self.made if r == rid]
        return {"charge": rid, "amount": found[0]} if found else NOT_APPLIED

    def refund(self, args, result, undo_id, fence=None):
        self._admit(fence)
        self.refunded.add(result["charge"])

    def net(self) -> int:
        return sum(a for r, a in self.made if r not in self.refunded)


LEDGER_TOOLS = {
    # The service refuses older tokens: its lookup settles the call, even
    # for a tool that is not idempotent.
    "fenced": (False, {"fenced": True}),
    # Not fenced, but it deduplicates by request id: retried under it.
    "idempotent": (True, {"idempotent": True}),
    # Neither: nothing can settle a call another host may still be making.
    "check only": (False, {}),
}


@pytest.mark.parametrize("rewind", [False, True], ids=["resume", "rewind"])
@pytest.mark.parametrize("kind", list(LEDGER_TOOLS))
def test_a_call_left_in_flight_by_a_host_that_lost_its_lease(setup, monkeypatch, kind, rewind):
    """Host A journals a charge's intent and stops (paused) before making it;
    its lease lapses and this host takes the thread over, resumes or rewinds
    it to its head, and goes on; then A wakes and makes its charge. The
    service ends with the one charge ordered (net 10) for a fenced or an
    idempotent tool; a tool that is neither says it cannot settle the call."""
    import threading

    store, _, _ = setup
    dedup, options = LEDGER_TOOLS[kind]
    ledger = Ledger(dedup)

    def tools():
        return [Tool("charge", run=ledger.run, check=ledger.check, compensate=ledger.refund,
                     **options)]

    stopped, wake, outcome = threading.Event(), threading.Event(), {}

    def trace(point):
        if point == "call.intent" and not stopped.is_set():
            stopped.set()
            assert wake.wait(60)

    def host_a():
        a = Agent(store, "t", tools=tools(), trace=trace, lease=0.0)
        try:
            with a.step("pay") as s:
                s.call("charge", {"amount": 10})
        except BaseException as e:   # noqa: BLE001 - what A ran into is the outcome
            outcome["a"] = e
        finally:
            a.db.close()             # paused, then gone: it never lets go itself

    # Host A: an owner on another host, whose lease (0 s) lapses at once.
    monkeypatch.setattr(agent_module, "process_owner", lambda host=None: "host-a:1:1")
    a_thread = threading.Thread(target=host_a)
    a_thread.start()
    try:
        assert stopped.wait(60)
        monkeypatch.undo()
        b = Agent(store, "t", tools=tools())
        try:
            if rewind:
                report = b.rewind(b.head)
                if kind == "check only":
                    assert len(report.uncompensable) == 1
                    assert "in doubt" in report.uncompensable[0]
            if kind == "check only" and not rewind:
                with pytest.raises(InDoubt, match="may still be running"):
                    with b.step("pay") as s:
                        s.call("charge", {"amount": 10})
            else:
                with b.step("pay") as s:
                    s.call("charge", {"amount": 10})
        finally:
            b.close()
    finally:
        wake.set()
        a_thread.join(60)
    # A's next step after waking is refused: by the service (fenced) or by
    # the journal (its result is not recorded over what B settled).
    assert isinstance(outcome.get("a"), agent_module.ThreadBusy), outcome
    if kind != "check only":
        assert ledger.net() == 10, ledger.made
    journal = AgentDB(store).journal("t")
    a_call = journal[0]
    assert a_call.owner == "host-a:1:1/1"
    if kind == "check only":
        if rewind:
            # Reported, not hidden: A's charge came after a rewind that could
            # not know of it.
            assert a_call.status == "uncompensable" and ledger.net() == 20
        else:
            # A made it after all; the next holder's lookup finds it.
            with Agent(store, "t", tools=tools()) as c:
                with c.step("pay") as s:
                    s.call("charge", {"amount": 10})
            assert ledger.net() == 10 and len(ledger.made) == 1
        return
    if kind == "fenced":
        assert "older fencing token 1" in a_call.settled
        assert len(ledger.made) == 1     # A's request was refused, not deduplicated
    else:
        assert a_call.settled.startswith("retried under its request id")
    assert a_call.status == ("compensated" if rewind else "done")


def test_a_process_whose_lease_was_taken_over_records_no_result(setup):
    """The journal's writes after an intent are fenced like the intent."""
    store, _, _ = setup
    bank = Bank()
    a = Agent(store, "t", tools=bank.tools(), lease=0.0)
    try:
        a.checkpoint("start")
        rid = agent_module.request_id(a.head, 0)
        a.db.record_intent(rid, "t", a.owner, base=a.head, position=0, tool="charge",
                           args=a.codec.encode({}, f"journal {rid} args"), compensable=True,
                           external=True)
        with Agent(store, "t", tools=bank.tools()):
            for write in (lambda: a.calls._record(rid, "done", {"charge": rid}),
                          lambda: a.db.forget_intent(rid, owner=a.owner),
                          lambda: a.db.update_call(rid, status="compensated", owner=a.owner)):
                with pytest.raises(ThreadBusy, match="fencing token 1"):
                    write()
        assert [e.status for e in AgentDB(store).journal("t")] == ["intent"]
    finally:
        a.db.close()


@pytest.mark.parametrize("ttl", [-1, -0.001, float("nan"), float("inf"), "soon"])
def test_a_negative_or_endless_ttl_is_refused(setup, ttl):
    from blockdiff.errors import UsageError

    store, _, _ = setup
    with pytest.raises(UsageError, match="ttl"):
        Agent(store, "t", ttl=ttl)
    assert AgentDB(store).threads() == []   # refused before the thread was made


def test_every_command_given_an_unknown_thread_or_checkpoint_fails_alike(setup):
    store, _, _ = setup
    with Agent(store, "t") as a:
        a.checkpoint("first")
        head = a.head
    db = AgentDB(store)
    for call in (lambda: db.journal("nope"), lambda: db.history("nope"),
                 lambda: db.approvals("nope"), lambda: db.all_checkpoints("nope"),
                 lambda: db.decide("nope", "approved")):
        with pytest.raises(UnknownThread, match="no thread 'nope'.*blockdiff agent threads"):
            call()
    db.close()

    def agent_cli(*args):
        return subprocess.run([sys.executable, "-m", "blockdiff", "agent", *args, "--store",
                               str(store.root)], capture_output=True, text=True)

    for args in (["journal", "nope"], ["history", "nope"], ["approve", "nope"],
                 ["reject", "nope"], ["rewind", "nope", head], ["fork", "nope", head, "n"],
                 ["journal", "nope", "--json"], ["history", "nope", "--json"]):
        done = agent_cli(*args)
        assert done.returncode == UnknownThread.exit_code == 10, (args, done.stderr)
        assert done.stdout == ""
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("blockdiff: error: no thread 'nope'")
        assert "blockdiff agent threads" in lines[0], lines
    for args, names in ((["show", "0123456789abcdef"], "history THREAD"),
                        (["show", "0123456789abcdef", "--json"], "history THREAD"),
                        (["rewind", "t", "0123456789abcdef"], "history t"),
                        (["fork", "t", "0123456789abcdef", "n"], "history t")):
        done = agent_cli(*args)
        assert done.returncode == UnknownCheckpoint.exit_code == 10, (args, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("blockdiff: error: no checkpoint '0123456789abcdef'")
        assert f"blockdiff agent {names}" in lines[0], lines
    assert [t.id for t in AgentDB(store).threads()] == ["t"]   # nothing was made


def _umask(mask: int):
    import contextlib

    @contextlib.contextmanager
    def scope():
        old = os.umask(mask)
        try:
            yield
        finally:
            os.umask(old)
    return scope()


def test_a_new_agent_database_is_private(setup):
    store, _, _ = setup
    path = store.root / model.DB_NAME
    with _umask(0o022):
        with Agent(store, "t", key=new_key()) as a:
            a.state["x"] = 1
            a.checkpoint("one")
            files = [path] + [p for p in (path.with_name(path.name + "-wal"),
                                          path.with_name(path.name + "-shm")) if p.exists()]
            assert len(files) == 3       # open in WAL mode: its -wal and -shm exist now
            for p in files:
                assert os.stat(p).st_mode & 0o777 == 0o600, p
    # The store's file mode, when it has one, and a file that exists keeps its own.
    os.unlink(path)
    for p in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        p.unlink(missing_ok=True)
    with _umask(0o022):
        store.file_mode = 0o640
        try:
            AgentDB(store).close()
        finally:
            del store.file_mode
        assert os.stat(path).st_mode & 0o777 == 0o640
        os.chmod(path, 0o644)
        AgentDB(store).close()
        assert os.stat(path).st_mode & 0o777 == 0o644


def _agent_files(store) -> bytes:
    path = store.root / model.DB_NAME
    return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))


def _hashes(store) -> dict[str, str]:
    raw = sqlite3.connect(store.root / model.DB_NAME)
    try:
        return dict(raw.execute("SELECT id, content_hash FROM checkpoints"))
    finally:
        raw.close()


def test_sealed_checkpoints_confirm_no_guess_at_their_contents(setup, monkeypatch):
    import hashlib
    import json

    monkeypatch.delenv("BLOCKDIFF_AGENT_KEY", raising=False)
    store, disk, image = setup
    key = new_key()
    secret = "sk-live-4f1c9a7e"

    def canonical(value) -> bytes:
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()

    with Agent(store, "t", disk=disk, key=key, secrets={"api_token"}) as a:
        with a.step("login", meta={"api_token": secret, "ticket": "TICKET-7781"}) as s:
            s.state["api_token"] = secret
            s.state["plan"] = "deploy the fix"
            s.messages.append({"role": "user", "content": "go ahead"})
        guessed_state, messages = dict(a.state), list(a.messages)
        head = a.head
        assert a.checkpoint("again").skipped                  # unchanged: still skipped
    stored = _hashes(store)[head]
    # Old code: sha256(state before redaction, messages), to be matched by guessing.
    for state in (guessed_state, guessed_state | {"api_token": "[redacted]"}):
        guess = hashlib.sha256(canonical(state) + b"\0" + canonical(messages)).hexdigest()
        assert guess not in stored
    assert stored.startswith("hmac-sha256:") and len(stored) == len("hmac-sha256:") + 64
    assert all(h.startswith("hmac-sha256:") for h in _hashes(store).values())
    # Nothing written in the clear: not the secret, the state, nor the meta.
    files = _agent_files(store)
    for plain in (secret, "deploy the fix", "go ahead", "TICKET-7781", "ticket"):
        assert plain.encode() not in files, plain
    # Resumed (the secret now reads redacted), an unchanged thread is still
    # not checkpointed again: the hash is of what was written.
    with Agent(store, "t", disk=disk, key=key, secrets={"api_token"}) as a:
        assert a.state["api_token"] == "[redacted]"
        assert a.checkpoint("after resume").skipped
        meta = a.history()[0].meta
        assert meta["ticket"] == "TICKET-7781" and meta["api_token"] == "[redacted]"
        assert meta["step"] == "login"
    # Without the key, the meta is not there to read; with it, it is.
    with AgentDB(store) as db:
        assert db.checkpoint(head).meta is None
    env = dict(os.environ)

    def history_json(**extra):
        done = subprocess.run([sys.executable, "-m", "blockdiff", "agent", "history", "t",
                               "--json", "--store", str(store.root)], capture_output=True,
                              text=True, env=env | extra)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    assert history_json()[0]["meta"] is None
    assert history_json(BLOCKDIFF_AGENT_KEY=key)[0]["meta"]["ticket"] == "TICKET-7781"
    # Unsealed, a redacted secret is not in the hash either.
    with Agent(store, "plain", secrets={"api_token"}) as a:
        a.state["api_token"] = secret
        first = a.checkpoint("one")
        a.state["api_token"] = "another guess"
        assert a.checkpoint("two").skipped         # what would be written did not change
    stored = _hashes(store)[first.id]
    guess = hashlib.sha256(canonical({"api_token": secret}) + b"\0" + canonical([]))
    assert stored.startswith("sha256:") and guess.hexdigest() not in stored
    assert secret.encode() not in _agent_files(store)


def test_an_agent_database_made_before_the_db_layer_is_adopted_as_it_is(setup):
    """A database that counts its migrations in PRAGMA user_version (as
    blockdiff wrote it before schema_versions) keeps every record and goes
    on from its version; one from a newer blockdiff is refused."""
    store, disk, image = setup
    bank = Bank()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        order_step(a, image, 10)
        head, state = a.head, a.state
    # Back to version 1 as it was then: no version table, no later migration.
    raw = sqlite3.connect(store.root / model.DB_NAME, isolation_level=None)
    raw.execute("DROP TABLE schema_versions")
    raw.execute("DROP INDEX checkpoints_legacy_hash")
    raw.execute("DROP INDEX checkpoints_environment")
    raw.execute("ALTER TABLE checkpoints DROP COLUMN environment")
    raw.execute("DROP TABLE environments")
    raw.execute("ALTER TABLE threads DROP COLUMN lease_token")
    raw.execute("ALTER TABLE journal DROP COLUMN owner")
    raw.execute("ALTER TABLE journal DROP COLUMN settled")
    raw.execute("PRAGMA user_version = 1")
    raw.close()
    with Agent(store, "t", disk=disk, tools=bank.tools()) as a:
        assert a.head == head and a.state == state
        assert [e.status for e in a.db.journal("t")] == ["done"]
        order_step(a, image, 20)
    assert sorted(bank.charges.values()) == [10, 20]
    raw = sqlite3.connect(store.root / model.DB_NAME, isolation_level=None)
    try:
        assert raw.execute("SELECT version FROM schema_versions WHERE name = 'agent'"
                           ).fetchone()[0] == len(model.MIGRATIONS)
        # Kept in step: a blockdiff of before still knows what it opens.
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(model.MIGRATIONS)
        assert raw.execute("SELECT 1 FROM sqlite_master WHERE name = 'checkpoints_legacy_hash'"
                           ).fetchone()
        raw.execute("DROP TABLE schema_versions")
        raw.execute("PRAGMA user_version = 99")
    finally:
        raw.close()
    with pytest.raises(SchemaTooNew, match="newer blockdiff"):
        AgentDB(store)


def test_content_hashes_written_before_they_were_keyed_are_replaced(setup, monkeypatch):
    import hashlib
    import json

    monkeypatch.delenv("BLOCKDIFF_AGENT_KEY", raising=False)
    store, _, _ = setup
    key = new_key()
    with Agent(store, "sealed", key=key) as a:
        a.state["plan"] = "sealed plan"
        a.checkpoint("one")
    with Agent(store, "plain") as a:
        a.state["plan"] = "plain plan"
        a.checkpoint("one")
    # As blockdiff wrote them before: a plain SHA-256 of the state.
    raw = sqlite3.connect(store.root / model.DB_NAME, isolation_level=None)
    for thread, state in (("sealed", {"plan": "sealed plan"}), ("plain", {"plan": "plain plan"})):
        legacy = hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":"))
                                .encode() + b"\0[]").hexdigest()
        raw.execute("UPDATE checkpoints SET content_hash = ? WHERE thread = ?",
                    (legacy, thread))
    plan = " ".join(r[-1] for r in raw.execute(
        "EXPLAIN QUERY PLAN SELECT id, state, messages, content_hash FROM checkpoints "
        f"WHERE {model._LEGACY_HASH}"))
    assert "checkpoints_legacy_hash" in plan                # found without a scan
    raw.close()
    AgentDB(store).close()                 # no key: the plain ones are rehashed, sealed wait
    with AgentDB(store) as db:
        sealed = {c.id for c in db.all_checkpoints("sealed")}
    hashes = _hashes(store)
    assert all(":" not in h for i, h in hashes.items() if i in sealed)
    assert all(h.startswith("sha256:") for i, h in hashes.items() if i not in sealed)
    with Agent(store, "sealed", key=key) as a:             # the key: the sealed ones too
        assert a.checkpoint("unchanged").skipped
    hashes = _hashes(store)
    assert all(h.startswith("hmac-sha256:") for i, h in hashes.items() if i in sealed)
    with Agent(store, "plain") as a:
        assert a.checkpoint("unchanged").skipped
