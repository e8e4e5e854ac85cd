"""The example agent (examples/agent_example.py) and the example payment
service (examples/charge_service.py) as real processes, for the tests that
drive them (test_agent_example on one host, test_shared_agent on two): the
service, an agent run's environment, the disk a run must leave and the
check that a finished run is consistent, and the protocol points a run
passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from blockdiff.agent.agent import AgentDB
from blockdiff.store.store import Store

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.agent_example import amount_of  # noqa: E402

ORDERS = 4
MiB = 1 << 20
DISK_SIZE = 8 * MiB
THREAD = "t1"
AMOUNTS = {n: amount_of(n) for n in range(1, ORDERS + 1)}
ENV = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKDIFF_AGENT_KEY")}


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
