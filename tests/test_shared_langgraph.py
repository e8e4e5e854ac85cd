"""The LangGraph checkpointer on a store shared by two hosts: a graph run by a
process on host A stops at an interrupt; a process on host B, with its own
store directory on another XFS filesystem, its own disk and saver, finds the
checkpoint in the shared catalog, brings the disk back from the object store
and finishes the run. The disk is compared byte for byte at every step."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest

from blockdiff.store.store import Store

pytestmark = [pytest.mark.services]

BLOCK = 4096
SIZE = 16 * BLOCK

SCRIPT = textwrap.dedent('''
    import operator, sys
    from typing import Annotated, TypedDict
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Command, interrupt
    from blockdiff.agent.disks import ImageDisk
    from blockdiff.agent.langgraph import BlockdiffSaver
    from blockdiff.store.store import Store

    BLOCK = 4096
    role, store_dir, image = sys.argv[1:4]

    class State(TypedDict, total=False):
        log: Annotated[list[str], operator.add]

    store = Store(store_dir)
    saver = BlockdiffSaver(store, ImageDisk(store, image))

    def writer(name, block):
        def node(state, config):
            saver.wait_for_disk(config)
            with open(image, "r+b") as f:
                f.seek(block * BLOCK)
                f.write(name.encode().ljust(16, b".") * (BLOCK // 16))
            return {"log": [name]}
        return node

    def approve(state):
        return {"log": ["approve:" + interrupt("ship it?")]}

    graph = StateGraph(State)
    graph.add_node("fetch", writer("fetch", 1))
    graph.add_node("approve", approve)
    graph.add_node("report", writer("report", 5))
    graph.add_edge(START, "fetch")
    graph.add_edge("fetch", "approve")
    graph.add_edge("approve", "report")
    graph.add_edge("report", END)
    app = graph.compile(checkpointer=saver)
    config = {"configurable": {"thread_id": "review"}}
    if role == "A":
        out = app.invoke({"log": []}, config)
        print("interrupted:", [i.value for i in out["__interrupt__"]])
    else:
        print("restored", saver.restore_disk(config))
        out = app.invoke(Command(resume="yes"), config)
        print("log:", out["log"])
        for h in app.get_state_history(config):
            print("step", h.metadata["step"], h.metadata.get("disk_snapshot"))
    saver.close()
    store.close()
''')


def pattern(name: str) -> bytes:
    return name.encode().ljust(16, b".") * (BLOCK // 16)


def run(*args) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_graph_interrupted_on_one_host_finishes_on_another(xfs, second_xfs,
                                                              catalog, s3_env):
    remote = f"s3://{s3_env.bucket}/{uuid.uuid4().hex}"
    b_root = second_xfs / f"lg-{uuid.uuid4().hex[:8]}"
    b_root.mkdir()
    Store.init(xfs / "store", catalog=catalog, remote=remote).close()
    Store.init(b_root / "store", catalog=catalog).close()
    image_a, image_b = xfs / "disk.img", b_root / "disk.img"
    for image in (image_a, image_b):
        with open(image, "wb") as f:
            f.truncate(SIZE)

    assert "interrupted: ['ship it?']" in run("A", xfs / "store", image_a)
    out = run("B", b_root / "store", image_b)
    assert "log: ['fetch', 'approve:yes', 'report']" in out
    expected = bytearray(SIZE)
    expected[BLOCK:2 * BLOCK] = pattern("fetch")
    expected[5 * BLOCK:6 * BLOCK] = pattern("report")
    assert image_b.read_bytes() == bytes(expected)
    # Every step's disk snapshot, wherever it was taken, from either host.
    steps = {int(line.split()[1]): line.split()[2] for line in out.splitlines()
             if line.startswith("step ") and line.split()[2] != "None"}
    with Store(xfs / "store") as a, Store(b_root / "store") as b:
        for step, snapshot in steps.items():
            for store, root in ((a, xfs), (b, b_root)):
                fork = root / f"step-{step}.img"
                store.restore(snapshot, fork)
                want = bytearray(SIZE)
                if step >= 1:
                    want[BLOCK:2 * BLOCK] = pattern("fetch")
                if step >= 3:
                    want[5 * BLOCK:6 * BLOCK] = pattern("report")
                assert fork.read_bytes() == bytes(want), (step, root)


@pytest.fixture(autouse=True)
def _langgraph_installed():
    pytest.importorskip("langgraph")
