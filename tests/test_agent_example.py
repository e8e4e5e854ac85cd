"""The example agent (examples/agent_example.py) against the example payment
service (examples/charge_service.py), both as real processes, with a store
and a sandbox disk image on real XFS: approvals across processes, a SIGKILL
at every point of the step protocol, rewind with refunds, a second runner
refused, and a failed run refunded.

The expected disk bytes are written out (tests/agentrun.py) from the
example's documented layout, not taken from the example's code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from agentrun import (
    AMOUNTS,
    CRASHES,
    DISK_SIZE,
    ENV,
    PASSES,
    ROOT,
    THREAD,
    Env,
    MiB,
    Service,
    _wait_for_line,
    check_consistent,
    describe,
    expected_disk,
)

from blockdiff.agent.agent import TRACE_POINTS, Agent, rewind_thread
from blockdiff.agent.disks import ImageDisk
from blockdiff.store.store import Store
from examples.agent_example import EXAMPLE_POINTS, charge_tool

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop mounts")]


def test_plan_is_what_the_tests_assume():
    # Order 3 is the large one that waits for approval; the others do not.
    assert AMOUNTS[3] > 10_000 and all(AMOUNTS[n] < 10_000 for n in (1, 2, 4))
    assert all(a > 0 for a in AMOUNTS.values())


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
