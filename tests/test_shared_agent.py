"""Threads that move between hosts: the example agent (examples/agent_example.py)
against the example payment service, on two hosts of one shared store (two
store directories on two XFS filesystems, separate processes, one shared
catalog, one bucket of a real SeaweedFS S3 server). A run killed on host A
at every point of the step protocol is finished on host B with exactly one
charge per order and the disk byte for byte; a run merely paused on A while
B takes the thread over is refused its next write by the fencing token; and
a run stopped (SIGSTOP) on A at every point of the step protocol while B
takes the thread over, with and without a rewind, then continued, leaves
exactly one charge per order at the service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import budget
import pytest
from agentrun import (
    AMOUNTS,
    CRASHES,
    DISK_SIZE,
    ENV,
    ROOT,
    THREAD,
    Env,
    Service,
    _wait_for_line,
    check_consistent,
    describe,
)

from blockdiff.agent.agent import Agent, AgentDB, ApprovalPending
from blockdiff.agent.disks import ImageDisk
from blockdiff.errors import ThreadBusy
from blockdiff.store.store import Store

pytestmark = [pytest.mark.services,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop mounts")]


@pytest.fixture
def two_hosts(xfs, host_b_dir, catalog, s3_env):
    """Host A's and host B's example environments, one charge service."""
    remote = f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"
    b_root = host_b_dir
    Store.init(xfs / "store", catalog=catalog, remote=remote).close()
    Store.init(b_root / "store", catalog=catalog).close()
    # Each host's disk starts blank, as the example's first run expects.
    for root in (xfs, b_root):
        with open(root / "disk.img", "wb") as f:
            f.truncate(DISK_SIZE)
    service = Service(xfs)
    try:
        yield Env(xfs, service), Env(b_root, service)
    finally:
        service.stop()


def agent_env():
    # The object store's endpoint and keys, as the test set them, for the agents.
    return ENV | {k: v for k, v in os.environ.items() if k.startswith("AWS_")}


def run(env: Env, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(env.command(*extra), cwd=ROOT, env=agent_env(),
                          capture_output=True, text=True, timeout=180)


def run_to_end(env: Env, max_runs: int = 4):
    for _ in range(max_runs):
        p = run(env)
        if p.returncode == 0:
            return p
        assert p.returncode == 3, describe(p)
        env.decide()
    pytest.fail("not done after several runs")


@pytest.mark.parametrize("catalog", ["postgresql"], indirect=True)
@pytest.mark.parametrize("phase,point,n", CRASHES, ids=[f"{p}-{pt}:{n}" for p, pt, n in CRASHES])
def test_killed_on_one_host_finished_on_another(two_hosts, phase, point, n):
    a, b = two_hosts
    if phase == "after_approval":
        first = run(a)
        assert first.returncode == 3, describe(first)
        b.decide()               # decided on the other host
    killed = run(a, "--crash-at", f"{point}:{n}", "--lease", "1")
    assert killed.returncode == -signal.SIGKILL, describe(killed)
    # Host A is gone for good. From another host it cannot be seen dead:
    # B takes the thread over once A's lease has lapsed.
    time.sleep(1.1)
    finished = run_to_end(b)
    assert "resumed" in finished.stdout or "new" in finished.stdout
    check_consistent(b)


def test_a_paused_host_is_fenced_off_when_another_took_over(two_hosts):
    a, b = two_hosts
    paused = subprocess.Popen(a.command("--pause-at", "checkpoint.disk:2", "--pause-seconds",
                                        "1", "--lease", "2"),
                              cwd=ROOT, env=agent_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        _wait_for_line(paused, "pause at checkpoint.disk:2")
        os.kill(paused.pid, signal.SIGSTOP)
        time.sleep(2.5)          # A's lease lapses while it cannot run
        finished = run_to_end(b)
        assert finished.returncode == 0, describe(finished)
        os.kill(paused.pid, signal.SIGCONT)
        out, err = paused.communicate(timeout=120)
    finally:
        if paused.poll() is None:
            paused.kill()
            paused.communicate()
    # A's next write, the checkpoint it was taking, is refused: it stops.
    assert paused.returncode == 4, (paused.returncode, out, err)
    assert "fencing token" in err.decode() and "Traceback" not in err.decode()
    check_consistent(b)


def test_an_approval_decided_on_another_host_wakes_the_waiting_agent(xfs, host_b_dir,
                                                                     catalog, s3_env):
    remote = f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"
    b_root = host_b_dir
    store_a = Store.init(xfs / "store", catalog=catalog, remote=remote)
    Store.init(b_root / "store", catalog=catalog).close()
    image = xfs / "disk.img"
    with open(image, "wb") as f:
        f.truncate(1 << 20)
    agent = Agent(store_a, "t", disk=ImageDisk(store_a, image))
    try:
        agent.checkpoint("start")
        with pytest.raises(ApprovalPending) as asked:
            agent.approval({"do": "deploy"})
        approval_id = asked.value.approval_id
        decider = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; time.sleep(0.5); "
             "from blockdiff.store import Store; from blockdiff.agent import AgentDB; "
             "s = Store(sys.argv[1]); db = AgentDB(s); "
             "db.decide('t', 'approved', by='b', comment='from host B'); "
             "db.close(); s.close()", str(b_root / "store")],
            env=agent_env(), cwd=ROOT)
        started = time.monotonic()
        decided = agent.wait_for_decision(approval_id, timeout=30, poll=0.1)
        waited = time.monotonic() - started
        assert decider.wait(30) == 0
        assert decided is not None and decided.decision == "approved"
        assert decided.comment == "from host B"
        assert waited < 5
        assert agent.approval({"do": "deploy"}).decision == "approved"
        agent.checkpoint("deployed")
        assert agent.wait_durable(30) and agent.durability() == "durable"
    finally:
        agent.close()
        store_a.close()


def test_a_thread_held_on_one_host_is_refused_on_another_until_its_lease_ends(two_hosts):
    a, b = two_hosts
    with Store(a.store_dir) as store_a, Store(b.store_dir) as store_b:
        holder = Agent(store_a, "held", lease=1.5)
        try:
            with pytest.raises(ThreadBusy, match="is being run by"):
                Agent(store_b, "held")
            holder.checkpoint("one")
            time.sleep(1.6)
            taker = Agent(store_b, "held")
            try:
                holder.state["x"] = 1
                with pytest.raises(ThreadBusy, match="fencing token"):
                    holder.checkpoint("two")
                db = AgentDB(store_b)
                try:
                    assert db.db.execute("SELECT lease_token FROM threads WHERE id = 'held'"
                                         ).fetchone()[0] == 2
                finally:
                    db.close()
            finally:
                taker.close()
        finally:
            holder.close()     # its lease is gone: releasing it changes nothing


# ------------------------------------------ a host paused while another takes over

# Each point of the step protocol a run of two orders passes, and which pass
# stops host A: by default the one in order 2's step (order 1 charged
# before it); BLOCKDIFF_TEST_BUDGET=full stops at every pass (order 1's, and
# the thread's first checkpoint) as well.
STOP_ORDERS = 2
STOP_PASSES = {"sandbox.partial": (1, 2), "sandbox.written": (1, 2), "call.intent": (1, 2),
               "call.ran": (1, 2), "call.recorded": (1, 2), "checkpoint.disk": (1, 2, 3),
               "checkpoint.recorded": (1, 2, 3)}
STOPS = [(point, n, rewind) for point, passes in STOP_PASSES.items()
         for n in (passes if budget.FULL else passes[-1:]) for rewind in (False, True)
         # Stopped before its first checkpoint, the thread has nothing to rewind.
         if not (rewind and point.startswith("checkpoint.") and n == 1)]


def _wait_stopped(proc: subprocess.Popen, log, timeout: float = 120) -> None:
    """Wait until ``proc`` has stopped itself (its state in /proc is T)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"host A exited ({proc.returncode}) before it stopped: "
                        f"{log.read_text()}")
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    pytest.fail(f"host A did not stop: {log.read_text()}")


def _wait_lease_lapsed(env: Env, timeout: float = 60) -> None:
    """Wait until the thread's lease, as the shared records have it, has
    lapsed: what another host's acquisition compares."""
    with Store(env.store_dir) as store, AgentDB(store) as db:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            until = db.db.execute("SELECT lease_until FROM threads WHERE id = ?",
                                  (THREAD,)).fetchone()[0]
            if until is None or until < time.time():
                return
            time.sleep(0.05)
    pytest.fail("host A's lease did not lapse")


@pytest.mark.parametrize("catalog", ["postgresql"], indirect=True)
@pytest.mark.parametrize("point,n,rewind", STOPS,
                         ids=[f"{p}:{n}-{'rewind' if r else 'resume'}" for p, n, r in STOPS])
def test_a_host_stopped_at_every_point_charges_nothing_twice(two_hosts, point, n, rewind):
    """Host A stops (SIGSTOP) at a point of the step protocol; its lease
    lapses; host B takes the thread over, rewinds it to where it resumes or
    not, and finishes it; then A is continued. Whatever A had under way
    (an intent journalled, a charge made and not recorded, a checkpoint not
    recorded), the service holds exactly one live charge per order: B settles
    A's call under its request id, the service refuses A's older fencing
    token, and the journal refuses A's writes: A stops with exit 4 at its
    next write."""
    a, b = two_hosts
    a.orders = b.orders = STOP_ORDERS
    log = a.root / "host-a.log"
    with open(log, "wb") as out:
        paused = subprocess.Popen(a.command("--stop-at", f"{point}:{n}", "--lease", "1"),
                                  cwd=ROOT, env=agent_env(), stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        _wait_stopped(paused, log)
        _wait_lease_lapsed(b)
        if rewind:
            rewound = run(b, "--rewind-to", "head")
            assert rewound.returncode == 0, describe(rewound)
        finished = run(b)
        assert finished.returncode == 0, describe(finished)
        os.kill(paused.pid, signal.SIGCONT)
        paused.wait(timeout=180)
    finally:
        if paused.poll() is None:
            paused.kill()
            paused.wait()
    said = log.read_text()
    assert "Traceback" not in said, said
    if point == "checkpoint.recorded" and n == STOP_PASSES[point][-1]:
        # Stopped after its last checkpoint, A has nothing left to write:
        # it says it is done and lets go of a thread it no longer holds.
        assert paused.returncode == 0, said
    else:
        assert paused.returncode == 4 and "fencing token" in said, said
    # The service's own records: one live charge per order, of its amount.
    orders = range(1, STOP_ORDERS + 1)
    live = [c for c in a.service.charges() if not c[3]]
    assert sorted(order for _, order, _, _ in live) == list(orders), a.service.charges()
    assert a.service.stats()["net"] == sum(AMOUNTS[o] for o in orders)
    check_consistent(b, [(o, "charged") for o in orders], exact_posts=False)
    with Store(b.store_dir) as store, AgentDB(store) as db:
        journal = db.journal(THREAD)
    if point in ("call.intent", "call.ran"):
        # B found A's call in doubt and says how it settled it.
        (settled,) = [e for e in journal if e.settled]
        assert settled.owner.endswith("/1") and settled.settled.startswith("looked up by ")
        assert ("took effect" in settled.settled) == (point == "call.ran"), settled
        if not rewind:
            assert settled.status == "done"
