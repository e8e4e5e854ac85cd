"""Threads that move between hosts: the example agent (examples/agent_example.py)
against the example payment service, on two hosts of one shared store (two
store directories on two XFS filesystems, separate processes, one shared
catalog, one bucket of a real SeaweedFS S3 server). A run killed on host A
at every point of the step protocol is finished on host B with exactly one
charge per order and the disk byte for byte; a run merely paused on A while
B takes the thread over is refused its next write by the fencing token."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import objectstore
import pytest
from test_agent_example import (
    CRASHES,
    DISK_SIZE,
    ENV,
    ROOT,
    Env,
    Service,
    _wait_for_line,
    check_consistent,
    describe,
)
from test_shared import catalog, postgres_server, postgres_url, second_xfs  # noqa: F401

from blockdiff.agent.agent import Agent, AgentDB, ApprovalPending
from blockdiff.agent.disks import ImageDisk
from blockdiff.errors import ThreadBusy
from blockdiff.store.store import Store

seaweedfs, s3_env = objectstore.seaweedfs, objectstore.s3_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for loop mounts")


@pytest.fixture
def two_hosts(xfs, second_xfs, catalog, s3_env):  # noqa: F811
    """Host A's and host B's example environments, one charge service."""
    remote = f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"
    b_root = second_xfs / f"b-{uuid.uuid4().hex[:8]}"
    b_root.mkdir()
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


def test_an_approval_decided_on_another_host_wakes_the_waiting_agent(xfs, second_xfs,  # noqa: F811
                                                                     catalog, s3_env):  # noqa: F811
    remote = f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"
    b_root = second_xfs / f"b-{uuid.uuid4().hex[:8]}"
    b_root.mkdir()
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
