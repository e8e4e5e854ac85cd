"""The example agent (examples/agent_example.py) against the example payment
service (examples/charge_service.py), both as real processes, with a store
and a sandbox disk image on real XFS: approvals across processes, a SIGKILL
at every point of the step protocol, rewind with refunds, a second runner
refused, and a failed run refunded.

The expected disk bytes are written out here from the example's documented
layout, not taken from the example's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from blockdiff.agent.agent import TRACE_POINTS, Agent, AgentDB, rewind_thread
from blockdiff.agent.disks import ImageDisk
from blockdiff.store.store import Store

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.agent_example import EXAMPLE_POINTS, amount_of, charge_tool  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop mounts")]

ORDERS = 4
MiB = 1 << 20
DISK_SIZE = 8 * MiB
THREAD = "t1"
AMOUNTS = {n: amount_of(n) for n in range(1, ORDERS + 1)}
ENV = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKDIFF_AGENT_KEY")}


# ------------------------------------------------------------ helpers


def test_plan_is_what_the_tests_assume():
    # Order 3 is the large one that waits for approval; the others do not.
    assert AMOUNTS[3] > 10_000 and all(AMOUNTS[n] < 10_000 for n in (1, 2, 4))
    assert all(a > 0 for a in AMOUNTS.values())


class Service:
    """The charge service as a separate process."""

    def __init__(self, directory: Path, *flags: str):
        self.db = directory / "charges.sqlite"
        self.log = directory / "service.log"
        port_file = directory / "service.port"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "examples.charge_service", "--db", str(self.db),
                 "--port", "0", "--port-file", str(port_file), *flags],
                cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"service died: {self.log.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("service did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def _json(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def stats(self) -> dict:
        return self._json("GET", "/stats")

    def control(self, **faults) -> dict:
        return self._json("POST", "/control", faults)

    def charges(self) -> list[tuple[str, int, int, bool]]:
        """(request id, order, amount, refunded) of every charge, oldest first,
        read from the service's database file."""
        db = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return [(r, o, a, bool(f)) for r, o, a, f in db.execute(
                "SELECT request_id, order_no, amount, refunded_by IS NOT NULL FROM charges "
                "ORDER BY rowid")]
        finally:
            db.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Env:
    def __init__(self, root: Path, service: Service, orders: int = ORDERS):
        self.root = root
        self.store_dir = root / "store"
        self.disk = root / "disk.img"
        self.service = service
        self.orders = orders

    def command(self, *extra: str, thread: str = THREAD) -> list[str]:
        return [sys.executable, "-m", "examples.agent_example", "--store", str(self.store_dir),
                "--disk", str(self.disk), "--service", self.service.url, "--thread", thread,
                "--orders", str(self.orders), *extra]

    def agent(self, *extra: str, thread: str = THREAD) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*extra, thread=thread), cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=120)

    def decide(self, decision: str = "approved", thread: str = THREAD) -> None:
        with Store(self.store_dir) as store:
            db = AgentDB(store)
            try:
                db.decide(thread, decision, by="test")
            finally:
                db.close()

    def run_to_end(self, decision: str = "approved", thread: str = THREAD,
                   max_runs: int = 4) -> list[subprocess.CompletedProcess]:
        """Run the agent (approving or rejecting whenever it asks) until done."""
        runs = []
        for _ in range(max_runs):
            p = self.agent(thread=thread)
            runs.append(p)
            if p.returncode == 0:
                return runs
            assert p.returncode == 3, describe(p)
            assert "waiting for approval" in p.stdout
            self.decide(decision, thread)
        pytest.fail(f"not done after {max_runs} runs: " + describe(runs[-1]))

    def db(self):
        store = Store(self.store_dir)
        return store, AgentDB(store)

    def head_contents(self, thread: str = THREAD) -> tuple[dict, list]:
        """The head checkpoint's state and messages (stored as plain JSON)."""
        store, db = self.db()
        try:
            blobs = db.contents(db.thread(thread).head)
        finally:
            db.close()
            store.close()
        assert all(blob[:1] == b"J" for blob in blobs)
        state, messages = (json.loads(blob[1:]) for blob in blobs)
        return state, messages

    def head_state(self, thread: str = THREAD) -> dict:
        return self.head_contents(thread)[0]


def describe(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"


@pytest.fixture
def env(xfs):
    Store.init(xfs / "store").close()
    with open(xfs / "disk.img", "wb") as f:
        f.truncate(DISK_SIZE)
    service = Service(xfs)
    try:
        yield Env(xfs, service)
    finally:
        service.stop()


def expected_disk(steps: list[tuple[int, str]]) -> bytes:
    """The image after ``steps`` — (order, "charged" | "rejected" | "expired")
    in the order they were done — from the layout in the example's docstring:
    a log header ``log %08d\\n`` at 0, 128-byte log lines from 4096, and each
    charged order's 64 KiB record at ``order`` MiB."""
    image = bytearray(DISK_SIZE)
    total, charged = 0, 0
    for index, (order, what) in enumerate(steps):
        amount = AMOUNTS[order]
        if what == "charged":
            head = (f"order {order}\namount {amount}\nseq {charged}\n"
                    f"total_before {total}\n").encode()
            fill = hashlib.sha256(f"order {order}".encode()).digest() * 2048
            image[order * MiB:order * MiB + 65536] = head + fill[len(head):]
            line = f"{index:04d} order {order} amount {amount}\n"
            charged += 1
            total += amount
        else:
            line = f"{index:04d} skip order {order} ({what})\n"
        image[4096 + index * 128:4096 + (index + 1) * 128] = line.encode().ljust(128)
    header = f"log {len(steps):08d}\n".encode()
    image[:len(header)] = header
    return bytes(image)


ALL_CHARGED = [(n, "charged") for n in range(1, ORDERS + 1)]


def check_consistent(env: Env, steps=ALL_CHARGED, *, exact_posts: bool = True) -> None:
    """After a finished run: one live charge per charged order, under the
    request id the journal holds; the disk, the head's disk snapshot and the
    state all as ``steps`` say; no call left in doubt; a healthy store."""
    charged = [n for n, what in steps if what == "charged"]
    live = [c for c in env.service.charges() if not c[3]]
    assert sorted(order for _, order, _, _ in live) == charged, env.service.charges()
    assert all(amount == AMOUNTS[order] for _, order, amount, _ in live)
    stats = env.service.stats()
    assert stats["net"] == sum(AMOUNTS[n] for n in charged)
    if exact_posts:
        # The service's idempotency was never needed: no request was sent twice.
        assert stats["posts"] == stats["charges"], stats
    expected = expected_disk(steps)
    assert env.disk.read_bytes() == expected
    store, db = env.db()
    try:
        journal = db.journal(THREAD)
        assert [e for e in journal if e.status in ("intent", "compensating")] == []
        done = [e.request_id for e in journal if e.status == "done"]
        assert sorted(done) == sorted(rid for rid, *_ in live)
        head = db.checkpoint(db.thread(THREAD).head)
        store.restore(head.disk_snapshot, env.root / "head.img")
        assert (env.root / "head.img").read_bytes() == expected
        assert store.verify() == {}
    finally:
        db.close()
        store.close()
    state, messages = env.head_contents()
    assert [m["content"].split(" (")[0] for m in messages] == [
        f"charged order {n}: {AMOUNTS[n]} cents" if what == "charged" else f"skipped order {n}"
        for n, what in steps]
    assert state["cursor"] == len(steps)
    assert [d["order"] for d in state["done"]] == charged
    assert state["total"] == sum(AMOUNTS[n] for n in charged)
    assert state["awaiting_approval"] is None


# ----------------------------------------------------------- end to end


def test_end_to_end_with_approval(env):
    first = env.agent()
    assert first.returncode == 3, describe(first)
    assert [line for line in first.stdout.splitlines() if "waiting for approval" in line] == [
        f"waiting for approval of order 3 ({AMOUNTS[3]} cents) on thread {THREAD}"]
    # Orders 1 and 2 are charged and on disk; the large one waits.
    assert sorted(o for _, o, _, _ in env.service.charges()) == [1, 2]
    state = env.head_state()
    assert state["awaiting_approval"] == 3 and state["cursor"] == 2
    store, db = env.db()
    try:
        assert db.thread(THREAD).status == "waiting_approval"
        (pending,) = db.approvals(THREAD, pending_only=True)
        assert pending.checkpoint == db.thread(THREAD).head
    finally:
        db.close()
        store.close()

    # Still undecided: the run asks again and stops again, charging nothing.
    again = env.agent()
    assert again.returncode == 3, describe(again)
    assert env.service.stats()["posts"] == 2

    # Another process (the CLI's way) approves.
    approve = subprocess.run(
        [sys.executable, "-c", "import sys; from blockdiff.store.store import Store; "
         "from blockdiff.agent.agent import AgentDB; "
         "print(AgentDB(Store(sys.argv[1])).decide(sys.argv[2], 'approved').decision)",
         str(env.store_dir), THREAD], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert approve.stdout.strip() == "approved", approve.stderr
    done = env.agent()
    assert done.returncode == 0, describe(done)
    assert "order 3: approved" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == (
        f"done: 4 order(s) charged, 0 skipped, total {sum(AMOUNTS.values())} cents")
    stats = env.service.stats()
    assert stats == {"charges": 4, "total": sum(AMOUNTS.values()), "refunded": 0,
                     "net": sum(AMOUNTS.values()), "posts": 4, "refunds": 0}
    check_consistent(env)

    # Done is done: another run changes nothing.
    rerun = env.agent()
    assert rerun.returncode == 0, describe(rerun)
    assert env.service.stats() == stats
    check_consistent(env)


def test_rejected_order_is_skipped(env):
    env.run_to_end("rejected")
    steps = [(1, "charged"), (2, "charged"), (3, "rejected"), (4, "charged")]
    check_consistent(env, steps)
    assert env.head_state()["skipped"] == [3]
    assert env.head_state()["decisions"] == {"3": "rejected"}


def test_expired_approval_is_skipped(env):
    first = env.agent("--approval-ttl", "0.5")
    assert first.returncode == 3, describe(first)
    time.sleep(0.6)
    done = env.agent()
    assert done.returncode == 0, describe(done)
    assert "order 3: expired" in done.stdout
    check_consistent(env, [(1, "charged"), (2, "charged"), (3, "expired"), (4, "charged")])


# ------------------------------------------------------- fault injection

# How often a normal run passes each point: the first run (from a new thread
# to the approval of order 3) and the run after the approval (orders 3, 4).
# checkpoint.*: the start node, orders 1 and 2, the approval's node; after the
# approval, the resumed run finds its approval at the head without a new
# checkpoint, and checkpoint.disk is passed by orders 3 and 4 only.
PASSES = {
    "first": {"call.intent": 2, "call.ran": 2, "call.recorded": 2, "checkpoint.disk": 4,
              "checkpoint.recorded": 4, "sandbox.partial": 2, "sandbox.written": 2},
    "after_approval": {"call.intent": 2, "call.ran": 2, "call.recorded": 2,
                       "checkpoint.disk": 2, "checkpoint.recorded": 2, "sandbox.partial": 2,
                       "sandbox.written": 2},
}
CRASHES = [("first", point, n) for point in PASSES["first"] for n in (1, 2)]
CRASHES += [("first", "checkpoint.disk", 4), ("first", "checkpoint.recorded", 4)]
CRASHES += [("after_approval", point, 2) for point in PASSES["after_approval"]]
CRASHES += [("after_approval", "checkpoint.disk", 1), ("after_approval", "call.ran", 1)]


def _passes(output: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in output.splitlines():
        if line.startswith("trace "):
            point, count = line.split()[1], int(line.split()[2].lstrip("#"))
            counts[point] = max(counts.get(point, 0), count)
    return counts


def test_crash_matrix_covers_every_point_a_run_reaches(env):
    """The points a normal run passes, and how often, are the ones the crash
    cases below are chosen from: a new protocol point fails this test."""
    first = env.agent("--verbose")
    assert first.returncode == 3, describe(first)
    env.decide()
    second = env.agent("--verbose")
    assert second.returncode == 0, describe(second)
    assert _passes(first.stdout) == PASSES["first"]
    assert _passes(second.stdout) == PASSES["after_approval"]
    reached = set(PASSES["first"]) | set(PASSES["after_approval"])
    # The rest of the protocol is passed by rewinds and failures (tested below).
    assert reached == set(TRACE_POINTS[:5]) | set(EXAMPLE_POINTS)
    assert {point for _, point, _ in CRASHES} == reached
    check_consistent(env)


@pytest.mark.parametrize("phase,point,n", CRASHES, ids=[f"{p}-{pt}:{n}" for p, pt, n in CRASHES])
def test_sigkill_at_every_protocol_point(env, phase, point, n):
    crash = ("--crash-at", f"{point}:{n}")
    if phase == "after_approval":
        first = env.agent()
        assert first.returncode == 3, describe(first)
        env.decide()
    killed = env.agent(*crash)
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    assert f"crash at {point}:{n}" in killed.stdout
    env.run_to_end()
    check_consistent(env)


# ------------------------------------------------------------- rewind


def _after_order(env: Env, order: int) -> str:
    store, db = env.db()
    try:
        (cp,) = [c for c in db.history(THREAD)
                 if c.meta.get("order") == order and c.meta.get("step") == f"order {order}"]
        return cp.id
    finally:
        db.close()
        store.close()


@pytest.mark.parametrize("how", ["agent", "cli", "rewind_thread"])
def test_rewind_refunds_and_recharges_under_new_ids(env, how):
    env.run_to_end()
    check_consistent(env)
    old = {order: rid for rid, order, _, _ in env.service.charges()}
    target = _after_order(env, 1)
    if how == "agent":
        with Store(env.store_dir) as store:
            with Agent(store, THREAD, disk=ImageDisk(store, env.disk),
                       tools=[charge_tool(env.service.url)]) as agent:
                report = agent.rewind(target)
        assert len(report.compensated) == 3 and report.pending == []
    elif how == "cli":
        p = env.agent("--rewind-to", "order:1")
        assert p.returncode == 0, describe(p)
        assert "refunded 3 charge(s)" in p.stdout
    else:
        with Store(env.store_dir) as store:
            report = rewind_thread(store, THREAD, target)
            # Without the tools the refunds wait for a process that has them.
            assert len(report.pending) == 3 and report.compensated == []
            assert env.service.stats()["refunded"] == 0
            Agent(store, THREAD, disk=ImageDisk(store, env.disk),
                  tools=[charge_tool(env.service.url)]).close()

    stats = env.service.stats()
    assert stats["refunded"] == 3 and stats["refunds"] == 3
    assert stats["net"] == AMOUNTS[1]
    assert [o for _, o, _, refunded in env.service.charges() if not refunded] == [1]
    assert env.disk.read_bytes() == expected_disk([(1, "charged")])
    state = env.head_state()
    assert state["cursor"] == 1 and [d["order"] for d in state["done"]] == [1]
    store, db = env.db()
    try:
        statuses = {e.request_id: e.status for e in db.journal(THREAD)}
        assert statuses == {old[1]: "done", old[2]: "compensated", old[3]: "compensated",
                            old[4]: "compensated"}
        assert db.checkpoint(db.thread(THREAD).head).parent == target
    finally:
        db.close()
        store.close()

    # Going on charges orders 2-4 again, under new request ids (order 3 asks
    # again: the approval was for the undone branch).
    runs = env.run_to_end()
    assert [p.returncode for p in runs] == [3, 0]
    charges = env.service.charges()
    assert len(charges) == 7
    new = {order: rid for rid, order, _, refunded in charges if not refunded}
    assert sorted(new) == [1, 2, 3, 4] and new[1] == old[1]
    assert all(new[n] != old[n] for n in (2, 3, 4))
    check_consistent(env, exact_posts=False)
    assert env.service.stats()["posts"] == 7


# ------------------------------------------------------ service errors


@pytest.mark.parametrize("fault", ["fail", "hang"])
def test_service_error_stops_the_step_and_a_retry_charges_once(env, fault):
    """A 500, or no answer in time (the request goes through late): the step
    fails with a one-line error and is not recorded; run again, it charges
    order 2 once, under the same request id."""
    env.service.control(**{fault: [2]})
    p = env.agent("--timeout", "1")
    assert p.returncode == 1, describe(p)
    assert len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: charge failed")
    assert [o for _, o, _, _ in env.service.charges()] == [1]
    state = env.head_state()
    assert state["cursor"] == 1
    env.service.control(**{fault: []})
    if fault == "hang":
        # The held request goes through now, after its client gave up.
        deadline = time.monotonic() + 10
        while len(env.service.charges()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [o for _, o, _, _ in env.service.charges()] == [1, 2]
    env.run_to_end()
    check_consistent(env, exact_posts=fault == "fail")
    assert env.service.stats()["charges"] == 4


# ------------------------------------------------------ one runner only


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 60) -> str:
    """Read the process's stdout (raw, so nothing waits in a buffer) until a
    line holds ``text``."""
    seen, deadline = b"", time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while time.monotonic() < deadline:
        if text.encode() in seen:
            return seen.decode()
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no {text!r} from the agent; got {seen!r}, exit {proc.poll()}")


def test_second_runner_of_a_thread_is_refused(env):
    first = subprocess.Popen(env.command("--pause-at", "sandbox.written:2"), cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        _wait_for_line(first, "pause at sandbox.written:2")
        assert env.service.stats()["posts"] == 1
        # The paused runner has written order 2's record, not yet committed.
        order2 = expected_disk([(1, "charged"), (2, "charged")])[2 * MiB:2 * MiB + 65536]
        assert env.disk.read_bytes()[2 * MiB:2 * MiB + 65536] == order2

        second = env.agent()
        assert second.returncode == 4, describe(second)
        assert len(second.stderr.strip().splitlines()) == 1
        assert "is being run by" in second.stderr and second.stderr.startswith("error: ")
        # It charged nothing and did not touch the disk under the first runner.
        assert env.service.stats()["posts"] == 1
        assert env.disk.read_bytes()[2 * MiB:2 * MiB + 65536] == order2
        assert first.poll() is None
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    env.run_to_end()
    check_consistent(env)


# ------------------------------------------------------------ failure


@pytest.mark.parametrize("crash", [None, "compensation.intent:1", "compensation.ran:2"])
def test_declined_payment_fails_the_run_and_refunds_everything(xfs, crash):
    Store.init(xfs / "store").close()
    service = Service(xfs, "--decline-order", "4")
    try:
        env = Env(xfs, service)
        first = env.agent()
        assert first.returncode == 3, describe(first)
        env.decide()
        args = ("--crash-at", crash) if crash else ()
        p = env.agent(*args)
        if crash:
            assert p.returncode == -signal.SIGKILL, describe(p)
            # Opened again, the thread that was failing finishes its refunds
            # and stays failed.
            p = env.agent()
            assert p.returncode == 5 and "run failed: refunds finished" in p.stdout, describe(p)
        else:
            assert p.returncode == 5, describe(p)
            assert "payment declined" in p.stdout and "run failed: refunded" in p.stdout
        stats = service.stats()
        assert stats == {"charges": 3, "total": AMOUNTS[1] + AMOUNTS[2] + AMOUNTS[3],
                         "refunded": 3, "net": 0, "posts": 3, "refunds": 3}
        store, db = env.db()
        try:
            assert db.thread(THREAD).status == "failed"
            assert [e.status for e in db.journal(THREAD)] == ["compensated"] * 3
            assert store.verify() == {}
        finally:
            db.close()
            store.close()
        # A failed thread is not run again.
        again = env.agent()
        assert again.returncode == 1 and "failed" in again.stderr, describe(again)
        assert service.stats() == stats
    finally:
        service.stop()


@pytest.mark.parametrize("crash", [None, "compensation.intent:1", "compensation.ran:3",
                                   "rewind.marked:1"])
def test_fail_on_request_refunds_once(env, crash):
    env.run_to_end()
    if crash:
        if crash.startswith("rewind"):
            p = env.agent("--rewind-to", "order:2", "--crash-at", crash)
        else:
            p = env.agent("--fail", "--crash-at", crash)
        assert p.returncode == -signal.SIGKILL, describe(p)
    p = env.agent("--fail")
    assert p.returncode == 0, describe(p)
    stats = env.service.stats()
    assert stats["refunded"] == 4 and stats["refunds"] == 4 and stats["net"] == 0
    assert stats["charges"] == 4 and stats["posts"] == 4
    store, db = env.db()
    try:
        assert db.thread(THREAD).status == "failed"
        assert [e.status for e in db.journal(THREAD)] == ["compensated"] * 4
        assert store.verify() == {}
    finally:
        db.close()
        store.close()


# ------------------------- interrupted rewinds and failures; in-flight calls undone


@pytest.mark.parametrize("interrupted", ["rewind:rewind.marked:1", "fail:compensation.ran:1"])
def test_interrupted_rewind_or_fail_then_a_plain_resume(env, interrupted):
    env.run_to_end()
    action, crash = interrupted.split(":", 1)
    first = ("--rewind-to", "order:1") if action == "rewind" else ("--fail",)
    p = env.agent(*first, "--crash-at", crash)
    assert p.returncode == -signal.SIGKILL, describe(p)
    # A plain resume, not the rewind or fail again.
    for _ in range(3):
        p = env.agent()
        if p.returncode != 3:
            break
        env.decide()
    stats = env.service.stats()
    state = env.head_state()
    store, db = env.db()
    try:
        status = db.thread(THREAD).status
    finally:
        db.close()
        store.close()
    charged_in_state = sum(d["amount"] for d in state["done"])
    # What the state says was charged is what the service holds, or the
    # thread says it failed.
    assert charged_in_state == stats["net"] or status == "failed", (state, stats, status)


CHILD = """
import os, signal, sys, dataclasses
sys.path.insert(0, sys.argv[4])
from blockdiff.agent.agent import Agent
from blockdiff.store.store import Store
from examples.agent_example import charge_tool
store = Store(sys.argv[1])
tool = dataclasses.replace(charge_tool(sys.argv[2]), idempotent=True)
def trace(point):
    if point == "call.ran" and sys.argv[3] == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
agent = Agent(store, "idem", tools=[tool], trace=trace)
if sys.argv[3] == "crash":
    with agent.step("pay") as s:
        s.call("charge", {"amount": 100, "order": 1})
else:
    agent.fail()
"""


def test_idempotent_tool_in_flight_is_compensated_by_fail(env):
    """A call of an idempotent tool whose process died after it ran, then
    fail(): the charge must be refunded."""
    for mode in ("crash", "fail"):
        p = subprocess.run([sys.executable, "-c", CHILD, str(env.store_dir), env.service.url,
                            mode, str(ROOT)], cwd=ROOT, env=ENV, capture_output=True, text=True)
        assert p.returncode == (-signal.SIGKILL if mode == "crash" else 0), describe(p)
    assert env.service.stats()["charges"] == 1
    assert env.service.stats()["net"] == 0
