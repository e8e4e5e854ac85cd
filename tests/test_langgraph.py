"""The LangGraph checkpointer (blockdiff.agent.langgraph) with real graphs on a
real XFS store: each step's disk snapshot holds the bytes the disk had at that
step, interrupts resume in another saver, replays and forks take the disk back,
pending writes persist, listing and deletion, async graphs, and several
threads and processes sharing one store.

The nodes are deterministic; each writes its own pattern into the disk image
and records the image's bytes right after, keyed by the state's log at that
point. Those copies are the oracle every snapshot is checked against.
"""

from __future__ import annotations

import asyncio
import operator
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Annotated, TypedDict

import pytest
from langgraph.channels.delta import DeltaChannel
from langgraph.checkpoint.base import ERROR, empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from blockdiff.agent.disks import ImageDisk
from blockdiff.agent.langgraph import DB_NAME, BlockdiffSaver
from blockdiff.errors import (
    BlockdiffError,
    DiskWaitTimeout,
    MissingConfigKey,
    NoDiskSnapshot,
    SaverError,
    SchemaTooNew,
    SnapshotsNotRemoved,
    StoreError,
    ThreadNotEmpty,
    UnknownSaverCheckpoint,
    UnknownStrategy,
)
from blockdiff.store.store import Store

BLOCK = 4096
SIZE = 16 * BLOCK
# Where each node writes; "think" and "ponder" leave the disk alone.
OFFSET = {"fetch": 1, "build": 2, "check": 3, "approve": 4, "report": 5}
PIPELINE = ("fetch", "think", "build", "check")
WAIT = 30.0


class State(TypedDict, total=False):
    log: Annotated[list[str], operator.add]


def pattern(name: str) -> bytes:
    return name.encode().ljust(16, b".") * (BLOCK // 16)


def cfg(thread_id: str, **extra) -> dict:
    return {"configurable": {"thread_id": thread_id, **extra}}


def checkpoint_id(config: dict | None) -> str | None:
    return None if config is None else config["configurable"]["checkpoint_id"]


class Rig:
    """A store, one or more disk images in it, and the oracle of each image's bytes."""

    def __init__(self, root: Path):
        self.root = root
        self.store = Store.init(root / "store")
        self.closers = [self.store]
        self.images: dict[str, Path] = {}
        # image name -> state log after a node -> the image's bytes right then
        self.seen: dict[str, dict[tuple, bytes]] = {}

    def image(self, name: str = "disk") -> Path:
        if name not in self.images:
            path = self.root / f"{name}.img"
            with open(path, "wb") as f:
                f.truncate(SIZE)
            self.images[name] = path
            self.seen[name] = {(): path.read_bytes()}
        return self.images[name]

    def disk(self, name: str = "disk", cls=ImageDisk) -> ImageDisk:
        return cls(self.store, self.image(name))

    def saver(self, disk=None, store=None) -> BlockdiffSaver:
        saver = BlockdiffSaver(self.store if store is None else store, disk)
        self.closers.append(saver)
        return saver

    def write(self, image: str, name: str) -> None:
        fd = os.open(self.images[image], os.O_WRONLY)
        try:
            os.pwrite(fd, pattern(name), OFFSET[name] * BLOCK)
        finally:
            os.close(fd)

    def snapshot_bytes(self, snapshot_id: str) -> bytes:
        out = self.root / f"check-{snapshot_id}.img"
        self.store.restore(snapshot_id, out)
        try:
            return out.read_bytes()
        finally:
            out.unlink()

    def expected(self, image: str, values: dict) -> bytes:
        return self.seen[image][tuple(values.get("log", []))]

    def close(self) -> None:
        for c in reversed(self.closers):
            c.close()


@pytest.fixture
def rig(xfs):
    r = Rig(xfs)
    yield r
    r.close()


def _step(rig: Rig, name: str, image: str, state) -> dict:
    entry = name
    if name == "approve":
        entry = f"approve:{interrupt('approve the build?')}"
    if image in rig.images:
        if name in OFFSET:
            rig.write(image, name)
        rig.seen[image][tuple([*state.get("log", []), entry])] = rig.images[image].read_bytes()
    return {"log": [entry]}


def make_node(rig: Rig, saver: BlockdiffSaver, name: str, image: str = "disk"):
    def node(state, config):
        saver.wait_for_disk(config, timeout=WAIT)
        return _step(rig, name, image, state)
    return node


def make_async_node(rig: Rig, saver: BlockdiffSaver, name: str, image: str = "disk"):
    async def node(state, config):
        await saver.await_for_disk(config, timeout=WAIT)
        return _step(rig, name, image, state)
    return node


def build(rig: Rig, saver: BlockdiffSaver, names=PIPELINE, image: str = "disk",
          node=make_node):
    builder = StateGraph(State)
    previous = START
    for name in names:
        builder.add_node(name, node(rig, saver, name, image))
        builder.add_edge(previous, name)
        previous = name
    builder.add_edge(previous, END)
    return builder.compile(checkpointer=saver)


def assert_snapshots_match(rig: Rig, history, image: str = "disk") -> None:
    """Every checkpoint has a disk snapshot holding the bytes the disk had then."""
    for state in history:
        snap = state.metadata.get("disk_snapshot")
        assert snap, f"step {state.metadata['step']} has no disk snapshot"
        assert rig.snapshot_bytes(snap) == rig.expected(image, state.values), (
            f"the snapshot of step {state.metadata['step']} ({state.values}) holds other bytes")


# ---------------------------------------------------------------- a whole run


@pytest.mark.parametrize("durability", ["async", "sync"])
def test_each_step_has_the_disk_snapshot_of_that_step(rig, durability):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver)
    config = cfg("t1")

    out = graph.invoke({"log": []}, config, durability=durability)

    assert out == {"log": list(PIPELINE)}
    state = graph.get_state(config)
    assert state.values == out and state.next == ()
    history = list(graph.get_state_history(config))
    assert [h.metadata["step"] for h in history] == [4, 3, 2, 1, 0, -1]
    assert [h.next for h in history] == [(), ("check",), ("build",), ("think",), ("fetch",),
                                         ("__start__",)]
    assert_snapshots_match(rig, history)
    snaps = [h.metadata["disk_snapshot"] for h in history]
    assert [saver.disk_snapshot(h.config) for h in history] == snaps
    assert saver.disk_snapshot(config) == snaps[0]
    # The disk did not change before "fetch" nor in "think": those checkpoints
    # share a snapshot and the store holds one node per change, in a line.
    assert snaps[5] == snaps[4] and snaps[3] == snaps[2]
    assert len(set(snaps)) == 4 == len(rig.store.log())
    assert [s.id for s in rig.store.log(snaps[0])] == [snaps[0], snaps[1], snaps[3], snaps[4]]
    fetched = rig.store.get(snaps[3])
    assert fetched.message == "langgraph t1 step 1"
    assert fetched.meta == {"langgraph.thread": "t1",
                            "langgraph.checkpoint": checkpoint_id(history[3].config)}


def test_wait_for_disk_keeps_the_next_step_out_of_the_last_snapshot(rig):
    class SlowDisk(ImageDisk):
        """Snapshots start late, as a busy host's would: LangGraph has already
        started the next step, whose node writes at once."""

        def checkpoint(self, *args, **kwargs):
            time.sleep(0.3)
            return super().checkpoint(*args, **kwargs)

    saver = rig.saver(rig.disk(cls=SlowDisk))
    graph = build(rig, saver, names=("fetch", "build", "check"))
    graph.invoke({"log": []}, cfg("slow"))
    history = list(graph.get_state_history(cfg("slow")))
    assert len(history) == 5
    assert_snapshots_match(rig, history)


def test_unchanged_disk_reuses_its_snapshot_and_adds_no_store_node(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("think", "ponder"))
    graph.invoke({"log": []}, cfg("idle"))
    graph.invoke({"log": []}, cfg("idle"))
    history = list(graph.get_state_history(cfg("idle")))
    assert len(history) == 8
    assert len({h.metadata["disk_snapshot"] for h in history}) == 1
    assert len(rig.store.log()) == 1

    rig.write("disk", "fetch")     # changed outside the graph: the next run sees it
    graph.invoke({"log": []}, cfg("idle"))
    history = list(graph.get_state_history(cfg("idle")))
    assert len({h.metadata["disk_snapshot"] for h in history}) == 2
    assert len(rig.store.log()) == 2
    assert rig.snapshot_bytes(history[0].metadata["disk_snapshot"]) == rig.images[
        "disk"].read_bytes()


def test_exit_durability_snapshots_the_disk_once_at_the_end(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver)
    out = graph.invoke({"log": []}, cfg("exit"), durability="exit")
    assert out == {"log": list(PIPELINE)}
    history = list(graph.get_state_history(cfg("exit")))
    assert history[0].values == out
    assert_snapshots_match(rig, history)


# ----------------------------------------------------------- interrupt, resume


def test_interrupt_resumes_in_another_saver(rig):
    first = rig.saver(rig.disk())
    graph = build(rig, first, names=("fetch", "approve", "report"))
    config = cfg("review")

    out = graph.invoke({"log": []}, config)

    assert [i.value for i in out["__interrupt__"]] == ["approve the build?"]
    assert graph.get_state(config).next == ("approve",)
    first.close()

    # Another process: its own store handle, disk and saver, a fresh graph.
    store = Store(rig.store.root)
    rig.closers.append(store)
    second = rig.saver(ImageDisk(store, rig.images["disk"]), store=rig.store.root)
    waiting = second.get_tuple(config)
    assert waiting.metadata["step"] == 1
    assert [w[1] for w in waiting.pending_writes] == ["__interrupt__"]
    graph = build(rig, second, names=("fetch", "approve", "report"))

    out = graph.invoke(Command(resume="yes"), config)

    assert out == {"log": ["fetch", "approve:yes", "report"]}
    history = list(graph.get_state_history(config))
    assert [h.metadata["step"] for h in history] == [3, 2, 1, 0, -1]
    assert_snapshots_match(rig, history)
    assert rig.store.get(history[0].metadata["disk_snapshot"]).parent == history[
        1].metadata["disk_snapshot"]


# ------------------------------------------------------------- replay and fork


def _children(history, parent_id: str):
    return [h for h in history if checkpoint_id(h.parent_config) == parent_id]


def test_replay_from_an_earlier_step_with_the_disk_of_that_step(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver)
    config = cfg("t1")
    graph.invoke({"log": []}, config)
    history = list(graph.get_state_history(config))
    before_build = next(h for h in history if h.next == ("build",))
    old_build = next(h for h in history if h.next == ("check",)).metadata["disk_snapshot"]
    assert rig.images["disk"].read_bytes() != rig.seen["disk"][("fetch", "think")]

    snap = saver.restore_disk(before_build.config)

    assert snap == before_build.metadata["disk_snapshot"]
    assert rig.images["disk"].read_bytes() == rig.seen["disk"][("fetch", "think")]

    out = graph.invoke(None, before_build.config)

    assert out == {"log": list(PIPELINE)}
    after = list(graph.get_state_history(config))
    assert len(after) == len(history) + 3           # the fork, build, check
    branches = _children(after, checkpoint_id(before_build.config))
    assert sorted(b.metadata["source"] for b in branches) == ["fork", "loop"]
    fork = next(b for b in branches if b.metadata["source"] == "fork")
    assert fork.metadata["disk_snapshot"] == snap   # restored, so unchanged
    assert_snapshots_match(rig, after)
    # The store's tree branches the same way: the new build grew from the
    # restored snapshot, not from the old build.
    line = [s.id for s in rig.store.log(after[0].metadata["disk_snapshot"])]
    assert snap in line and old_build not in line


def test_fork_with_update_state_after_restoring_the_disk(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver)
    config = cfg("t1")
    graph.invoke({"log": []}, config)
    history = list(graph.get_state_history(config))
    before_build = next(h for h in history if h.next == ("build",))

    snap = saver.restore_disk(before_build.config)
    rig.seen["disk"][("fetch", "think", "edited")] = rig.images["disk"].read_bytes()
    forked = graph.update_state(before_build.config, {"log": ["edited"]})

    assert saver.disk_snapshot(forked) == snap
    out = graph.invoke(None, forked)

    assert out == {"log": ["fetch", "think", "edited", "build", "check"]}
    assert graph.get_state(config).values == out
    after = list(graph.get_state_history(config))
    assert len(_children(after, checkpoint_id(before_build.config))) == 2
    assert_snapshots_match(rig, after)


# ------------------------------------------------- the saver API on its own


def _drive(saver) -> list[dict]:
    """The same calls against any saver; the configs its puts returned."""
    c0 = empty_checkpoint()
    c0["channel_values"] = {"a": 1}
    c0["channel_versions"] = {"a": saver.get_next_version(None, None)}
    first = saver.put(cfg("w", checkpoint_ns=""), c0, {"source": "input", "step": -1},
                      dict(c0["channel_versions"]))
    # Ordered by task path, then task id: here the opposite ways.
    saver.put_writes(first, [("a", 2), ("b", "x")], task_id="task-2", task_path="~0")
    saver.put_writes(first, [("a", 1)], task_id="task-1", task_path="~1")
    saver.put_writes(first, [("a", 99)], task_id="task-1", task_path="~1")   # kept first
    saver.put_writes(first, [(ERROR, "boom")], task_id="task-1")
    saver.put_writes(first, [(ERROR, "boom again")], task_id="task-1")     # replaced

    c1 = empty_checkpoint()
    c1["channel_values"] = {"a": 1, "c": [1, 2]}
    c1["channel_versions"] = {"a": c0["channel_versions"]["a"],
                              "c": saver.get_next_version(None, None),
                              "gone": saver.get_next_version(None, None)}
    second = saver.put(first, c1, {"source": "loop", "step": 0, "note": "x"},
                       {"c": c1["channel_versions"]["c"], "gone": c1["channel_versions"]["gone"]})
    return [first, second]


def _comparable(t):
    return (t.checkpoint, t.metadata, t.parent_config, t.pending_writes,
            checkpoint_id(t.config))


def test_saver_api_matches_the_in_memory_saver_and_persists(rig):
    saver = rig.saver()
    configs = _drive(saver)
    memory = InMemorySaver()
    memory.get_next_version = saver.get_next_version
    mconfigs = _drive(memory)
    saver.close()

    reopened = rig.saver(store=rig.store.root)
    first = reopened.get_tuple(configs[0])
    assert first.pending_writes == [("task-1", ERROR, "boom again"), ("task-2", "a", 2),
                                    ("task-2", "b", "x"), ("task-1", "a", 1)]
    assert first.checkpoint["channel_values"] == {"a": 1}
    assert first.parent_config is None
    latest = reopened.get_tuple(cfg("w"))
    assert latest.config == configs[1]
    assert latest.checkpoint["channel_values"] == {"a": 1, "c": [1, 2]}
    assert latest.metadata == {"source": "loop", "step": 0, "note": "x"}
    assert latest.parent_config == configs[0]
    assert reopened.get_tuple(cfg("w", checkpoint_id="no-such-id")) is None
    assert reopened.get_tuple(cfg("nobody")) is None

    # The in-memory saver is LangGraph's reference; versions differ (random
    # fractions), so compare what they mean.
    for mine, theirs in zip(configs, mconfigs):
        a, b = reopened.get_tuple(mine), memory.get_tuple(theirs)
        a_cp = {k: v for k, v in a.checkpoint.items() if k not in ("id", "ts",
                                                                    "channel_versions")}
        b_cp = {k: v for k, v in b.checkpoint.items() if k not in ("id", "ts",
                                                                   "channel_versions")}
        assert a_cp == b_cp
        assert (a.metadata, a.pending_writes) == (b.metadata, b.pending_writes)
        assert (a.parent_config is None) == (b.parent_config is None)
    assert len(list(reopened.list(None))) == len(list(memory.list(None))) == 2


def _extend(state, writes):
    return [*(state or []), *(x for w in writes for x in (w if isinstance(w, list) else [w]))]


class DeltaState(TypedDict, total=False):
    # Kept as writes on each checkpoint and rebuilt from its ancestors'
    # (LangGraph's beta DeltaChannel): the test of pending writes and parents.
    items: Annotated[list, DeltaChannel(_extend, snapshot_frequency=3)]
    n: int


def _delta_graph(saver):
    builder = StateGraph(DeltaState)
    builder.add_node("a", lambda s: {"items": [f"a{s.get('n', 0)}"], "n": s.get("n", 0) + 1})
    builder.add_node("b", lambda s: {"items": [f"b{s['n']}"]})
    builder.add_edge(START, "a")
    builder.add_edge("a", "b")
    builder.add_edge("b", END)
    return builder.compile(checkpointer=saver)


def test_delta_channel_state_matches_the_in_memory_saver(rig):
    ours, reference = _delta_graph(rig.saver()), _delta_graph(InMemorySaver())
    for i in range(5):
        for graph in (ours, reference):
            graph.invoke({"items": [f"in{i}"]}, cfg("d"))
    expected = [s.values for s in reference.get_state_history(cfg("d"))]
    assert len(expected) == 20 and expected[0]["items"][-3:] == ["in4", "a4", "b5"]
    assert [s.values for s in ours.get_state_history(cfg("d"))] == expected
    reopened = _delta_graph(rig.saver(store=rig.store.root))
    assert [s.values for s in reopened.get_state_history(cfg("d"))] == expected


def test_list_filter_before_and_limit(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver)
    graph.invoke({"log": []}, cfg("t1"))
    graph.invoke({"log": []}, cfg("t2"))

    t1 = list(saver.list(cfg("t1")))
    assert [t.metadata["step"] for t in t1] == [4, 3, 2, 1, 0, -1]
    ids = [checkpoint_id(t.config) for t in t1]
    assert ids == sorted(ids, reverse=True)
    assert [t.metadata["step"] for t in saver.list(cfg("t1"), limit=2)] == [4, 3]
    assert [t.metadata["step"] for t in saver.list(cfg("t1"), filter={"source": "loop"})] == [
        4, 3, 2, 1, 0]
    only = list(saver.list(cfg("t1"), filter={"source": "loop", "step": 2}))
    assert [checkpoint_id(t.config) for t in only] == [ids[2]]
    assert list(saver.list(cfg("t1"), filter={"source": "nowhere"})) == []
    assert [t.metadata["step"] for t in saver.list(cfg("t1"), before=t1[2].config)] == [1, 0, -1]
    assert [t.metadata["step"] for t in saver.list(cfg("t1"), before=t1[2].config,
                                                   limit=1)] == [1]
    assert list(saver.list(cfg("t1"), limit=0)) == []
    assert [checkpoint_id(t.config) for t in saver.list(cfg("t1", checkpoint_id=ids[3]))] == [
        ids[3]]

    everything = list(saver.list(None))
    assert len(everything) == 12
    assert {t.config["configurable"]["thread_id"] for t in everything[:6]} == {"t2"}
    newest = list(saver.list(None, limit=3))
    assert newest == everything[:3]
    # t2 started on the disk t1 left: its first checkpoints share t1's last snapshot.
    shared = t1[0].metadata["disk_snapshot"]
    by_snapshot = list(saver.list(None, filter={"disk_snapshot": shared}))
    assert [(t.config["configurable"]["thread_id"], t.metadata["step"]) for t in by_snapshot] == [
        ("t2", 0), ("t2", -1), ("t1", 4)]


def test_list_pages_through_many_checkpoints(rig):
    saver = rig.saver()
    graph = build(rig, saver, names=("think",))
    for _ in range(40):      # 3 checkpoints a run: more than a page
        graph.invoke({"log": []}, cfg("long"))
    listed = list(saver.list(cfg("long")))
    assert len(listed) == 120
    ids = [checkpoint_id(t.config) for t in listed]
    assert ids == sorted(set(ids), reverse=True)
    inputs = list(saver.list(cfg("long"), filter={"source": "input"}))
    assert len(inputs) == 40
    assert len(list(saver.list(cfg("long"), filter={"source": "input"}, limit=33))) == 33
    assert len(list(saver.list(cfg("long"), before=listed[99].config))) == 20


def test_delete_thread_removes_its_checkpoints_and_writes_only(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch", "approve", "report"))
    graph.invoke({"log": []}, cfg("gone"))          # stops at the interrupt: has writes
    graph.invoke({"log": []}, cfg("kept"))
    snapshots = len(rig.store.log())
    db = sqlite3.connect(rig.store.root / DB_NAME)

    def rows(thread_id):
        return [db.execute(f"SELECT COUNT(*) FROM {t} WHERE thread_id = ?",
                           (thread_id,)).fetchone()[0] for t in ("checkpoints", "blobs", "writes")]

    try:
        assert all(rows("gone")) and all(rows("kept"))

        saver.delete_thread("gone")

        assert rows("gone") == [0, 0, 0]
        assert all(rows("kept"))
    finally:
        db.close()
    assert saver.get_tuple(cfg("gone")) is None
    assert list(saver.list(cfg("gone"))) == []
    assert graph.get_state(cfg("gone")).values == {}
    assert len(list(saver.list(cfg("kept")))) == 3
    assert graph.get_state(cfg("kept")).next == ("approve",)
    other = rig.saver(store=rig.store.root)
    assert other.get_tuple(cfg("gone")) is None
    assert len(rig.store.log()) == snapshots       # disk snapshots stay


# ------------------------------------------------------------------- async


def test_async_graph_and_api(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch", "approve", "report"), node=make_async_node)
    config = cfg("a1")

    async def main():
        out = await graph.ainvoke({"log": []}, config)
        assert "__interrupt__" in out
        out = await graph.ainvoke(Command(resume="ok"), config)
        assert out == {"log": ["fetch", "approve:ok", "report"]}
        state = await graph.aget_state(config)
        assert state.values == out and state.next == ()
        history = [s async for s in graph.aget_state_history(config)]
        listed = [t async for t in saver.alist(config, limit=2)]
        assert [checkpoint_id(t.config) for t in listed] == [
            checkpoint_id(h.config) for h in history[:2]]
        latest = await saver.aget_tuple(config)
        assert latest.checkpoint["channel_values"]["log"] == out["log"]
        await saver.adelete_thread("a1")
        assert await saver.aget_tuple(config) is None
        return history

    history = asyncio.run(main())
    assert [h.metadata["step"] for h in history] == [3, 2, 1, 0, -1]
    assert_snapshots_match(rig, history)


# ------------------------------------------------- threads, processes, stores


def test_two_threads_in_one_store_stay_separate(rig):
    one = rig.saver(rig.disk("one"))
    two = rig.saver(rig.disk("two"))
    g1 = build(rig, one, image="one")
    g2 = build(rig, two, names=("build", "check"), image="two")

    g1.invoke({"log": []}, cfg("t1"))
    rig.seen["two"][("seed",)] = rig.images["two"].read_bytes()
    g2.invoke({"log": ["seed"]}, cfg("t2"))

    assert g1.get_state(cfg("t1")).values == {"log": list(PIPELINE)}
    assert g2.get_state(cfg("t2")).values == {"log": ["seed", "build", "check"]}
    # Either saver reads both threads: one database.
    assert one.get_tuple(cfg("t2")).checkpoint["channel_values"]["log"] == [
        "seed", "build", "check"]
    h1 = list(g1.get_state_history(cfg("t1")))
    h2 = list(g2.get_state_history(cfg("t2")))
    assert {t.config["configurable"]["thread_id"] for t in one.list(cfg("t1"))} == {"t1"}
    assert len(h1) == 6 and len(h2) == 4
    assert_snapshots_match(rig, h1, "one")
    assert_snapshots_match(rig, h2, "two")
    assert not {h.metadata["disk_snapshot"] for h in h1} & {
        h.metadata["disk_snapshot"] for h in h2}
    for h, thread in [(h1[0], "t1"), (h2[0], "t2")]:
        assert rig.store.get(h.metadata["disk_snapshot"]).meta["langgraph.thread"] == thread

    # Restoring one thread's disk leaves the other's alone.
    two_bytes = rig.images["two"].read_bytes()
    one.restore_disk(h1[-1].config)
    assert rig.images["one"].read_bytes() == bytes(SIZE)
    assert rig.images["two"].read_bytes() == two_bytes


def test_concurrent_runs_in_worker_threads(rig):
    saver = rig.saver()
    graph = build(rig, saver, names=("think", "ponder", "think2"))
    configs = [cfg(f"b{i}") for i in range(8)]
    outs = graph.batch([{"log": [str(i)]} for i in range(8)], configs)
    assert outs == [{"log": [str(i), "think", "ponder", "think2"]} for i in range(8)]
    for i, config in enumerate(configs):
        assert [t.metadata["step"] for t in saver.list(config)] == [3, 2, 1, 0, -1]
        assert graph.get_state(config).values == outs[i]


PROCESS = textwrap.dedent("""
    import operator, os, sys
    from typing import Annotated, TypedDict
    from langgraph.graph import END, START, StateGraph
    from blockdiff.agent.disks import ImageDisk
    from blockdiff.agent.langgraph import BlockdiffSaver

    store, image, thread = sys.argv[1:4]

    class State(TypedDict, total=False):
        log: Annotated[list[str], operator.add]

    saver = BlockdiffSaver(store, ImageDisk(store, image))

    def step(n):
        def node(state, config):
            saver.wait_for_disk(config, timeout=60)
            fd = os.open(image, os.O_WRONLY)
            os.pwrite(fd, (f"{thread}-{n}".encode() * 512)[:4096], 4096 * n)
            os.close(fd)
            return {"log": [f"{thread}-{n}"]}
        return node

    builder = StateGraph(State)
    builder.add_node("one", step(1))
    builder.add_node("two", step(2))
    builder.add_edge(START, "one")
    builder.add_edge("one", "two")
    builder.add_edge("two", END)
    graph = builder.compile(checkpointer=saver)
    for _ in range(5):
        graph.invoke({"log": []}, {"configurable": {"thread_id": thread}})
    saver.close()
""")


@pytest.mark.slow
def test_several_processes_share_one_store(rig):
    names = [f"p{i}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(rig.store.root),
                               str(rig.image(name)), name],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name in names]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    saver = rig.saver(store=rig.store.root)
    for name in names:
        listed = list(saver.list(cfg(name)))
        assert len(listed) == 5 * 4                   # input, start, one, two; 5 runs
        assert listed[0].checkpoint["channel_values"]["log"] == [f"{name}-1", f"{name}-2"] * 5
        for t in listed:
            snapshot = rig.store.get(t.metadata["disk_snapshot"])
            assert snapshot.meta["langgraph.thread"] == name
        assert rig.snapshot_bytes(listed[0].metadata["disk_snapshot"]) == rig.images[
            name].read_bytes()


# ------------------------------------------------------------------ errors


def test_config_without_thread_id_is_refused(rig):
    saver = rig.saver(rig.disk())
    for call in (lambda: saver.get_tuple({"configurable": {}}),
                 lambda: saver.get_tuple({}),
                 lambda: saver.put({"configurable": {"checkpoint_ns": ""}}, empty_checkpoint(),
                                   {}, {}),
                 lambda: saver.put_writes({"configurable": {"checkpoint_id": "x"}},
                                          [("a", 1)], "task"),
                 lambda: saver.disk_snapshot({"configurable": {"checkpoint_id": "x"}}),
                 lambda: saver.restore_disk({})):
        with pytest.raises(ValueError, match="thread_id") as info:
            call()
        assert isinstance(info.value, MissingConfigKey) and isinstance(info.value,
                                                                       BlockdiffError)
    with pytest.raises(ValueError, match="checkpoint_id"):
        saver.put_writes(cfg("t"), [("a", 1)], "task")
    assert len(rig.store.log()) == 0      # the refused put took no snapshot


def test_restore_disk_errors_are_clear(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch",))
    graph.invoke({"log": []}, cfg("t1"))
    before = rig.images["disk"].read_bytes()

    with pytest.raises(UnknownSaverCheckpoint, match="'1f0-not-a-checkpoint'.*'t1'"):
        saver.restore_disk(cfg("t1", checkpoint_id="1f0-not-a-checkpoint"))
    with pytest.raises(UnknownSaverCheckpoint, match="'t1'"):
        saver.disk_snapshot(cfg("t1", checkpoint_id="1f0-not-a-checkpoint"))
    with pytest.raises(UnknownSaverCheckpoint, match="'nobody' has no checkpoint"):
        saver.restore_disk(cfg("nobody"))
    assert saver.disk_snapshot(cfg("nobody")) is None
    with pytest.raises(SaverError, match="no disk"):
        rig.saver().restore_disk(cfg("t1"))

    # Checkpoints saved by a saver without a disk have no snapshot to go back to.
    build(rig, rig.saver(), names=("think",)).invoke({"log": []}, cfg("diskless"))
    assert saver.disk_snapshot(cfg("diskless")) is None
    with pytest.raises(NoDiskSnapshot, match="'diskless'"):
        saver.restore_disk(cfg("diskless"))
    assert rig.images["disk"].read_bytes() == before


def test_a_failed_snapshot_fails_the_run_instead_of_hanging_it(rig):
    class BrokenDisk(ImageDisk):
        def checkpoint(self, *args, **kwargs):
            raise OSError(28, "No space left on device")

    saver = rig.saver(rig.disk(cls=BrokenDisk))
    graph = build(rig, saver, names=("fetch", "build"))
    start = time.monotonic()
    with pytest.raises(Exception, match="No space left"):
        graph.invoke({"log": []}, cfg("t1"))
    assert time.monotonic() - start < WAIT / 2
    assert saver.get_tuple(cfg("t1")) is None


def test_wait_for_disk_times_out_on_a_checkpoint_never_saved(rig):
    saver = rig.saver(rig.disk())
    node_config = cfg("t1", checkpoint_map={"": "1f0-never-saved"}, checkpoint_ns="x:1")
    with pytest.raises(DiskWaitTimeout, match="1f0-never-saved"):
        saver.wait_for_disk(node_config, timeout=0.2)
    with pytest.raises(MissingConfigKey, match="node"):
        saver.wait_for_disk(cfg("t1"))
    rig.saver().wait_for_disk(node_config)         # no disk: nothing to wait for


def test_store_path_and_schema(rig, xfs):
    saver = rig.saver(store=str(rig.store.root))
    assert saver.path == rig.store.root / "langgraph.sqlite" and saver.path.exists()
    assert saver.schema_version == 2
    db = sqlite3.connect(saver.path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        assert db.execute("SELECT version FROM schema_versions "
                          "WHERE name = 'langgraph'").fetchone()[0] == 2
        db.execute("PRAGMA user_version = 99")
    finally:
        db.close()
    with pytest.raises(SchemaTooNew, match="newer"):
        BlockdiffSaver(rig.store)
    with pytest.raises(StoreError, match="not a blockdiff store"):
        BlockdiffSaver(xfs / "elsewhere")


def test_a_new_checkpoint_database_is_private(rig):
    old = os.umask(0o022)
    try:
        saver = rig.saver(rig.disk())
        build(rig, saver).invoke({"log": []}, cfg("t1"))
        files = [saver.path.with_name(saver.path.name + suffix) for suffix in ("", "-wal",
                                                                              "-shm")]
        for path in files:
            assert path.exists() and os.stat(path).st_mode & 0o777 == 0o600, path
    finally:
        os.umask(old)


# ------------------------------------- copy_thread, prune, delete_for_runs


def _rows(rig: Rig, thread_id: str) -> list[int]:
    db = sqlite3.connect(rig.store.root / DB_NAME)
    try:
        return [db.execute(f"SELECT COUNT(*) FROM {t} WHERE thread_id = ?",
                           (thread_id,)).fetchone()[0] for t in ("checkpoints", "blobs", "writes")]
    finally:
        db.close()


def _snapshot_ids(rig: Rig) -> set[str]:
    return {s.id for s in rig.store.log()}


def _named(history) -> set[str]:
    return {h.metadata["disk_snapshot"] for h in history}


def test_copy_thread_copies_checkpoints_writes_and_disk_snapshots(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch", "approve", "report"))
    graph.invoke({"log": []}, cfg("src"))             # waits at the interrupt: has writes
    source = list(saver.list(cfg("src")))
    snapshots = _snapshot_ids(rig)

    saver.copy_thread("src", "dst")

    copied = list(saver.list(cfg("dst")))
    assert [checkpoint_id(t.config) for t in copied] == [checkpoint_id(t.config) for t in source]
    for a, b in zip(source, copied):
        assert b.config["configurable"]["thread_id"] == "dst"
        assert (a.checkpoint, a.metadata, a.pending_writes) == (
            b.checkpoint, b.metadata, b.pending_writes)
        assert checkpoint_id(a.parent_config) == checkpoint_id(b.parent_config)
        assert saver.disk_snapshot(a.config) == saver.disk_snapshot(b.config)
    assert _rows(rig, "dst") == _rows(rig, "src")
    assert _snapshot_ids(rig) == snapshots              # the same snapshots, named twice
    assert graph.get_state(cfg("dst")).next == ("approve",)

    # The copy resumes on its own; the source still waits.
    saver.restore_disk(cfg("dst"))
    out = graph.invoke(Command(resume="copy"), cfg("dst"))
    assert out == {"log": ["fetch", "approve:copy", "report"]}
    assert graph.get_state(cfg("src")).next == ("approve",)
    assert [checkpoint_id(t.config) for t in saver.list(cfg("src"))] == [
        checkpoint_id(t.config) for t in source]
    assert_snapshots_match(rig, graph.get_state_history(cfg("dst")))

    # Pruning one thread away keeps the snapshots the other still names.
    saver.prune(["src"], strategy="delete")
    assert saver.get_tuple(cfg("src")) is None and _rows(rig, "src") == [0, 0, 0]
    assert _named(graph.get_state_history(cfg("dst"))) <= _snapshot_ids(rig)
    assert snapshots <= _snapshot_ids(rig)
    assert_snapshots_match(rig, graph.get_state_history(cfg("dst")))


def test_copy_thread_refuses_a_target_with_checkpoints(rig):
    saver = rig.saver()
    graph = build(rig, saver, names=("think",))
    graph.invoke({"log": []}, cfg("a"))
    graph.invoke({"log": ["b"]}, cfg("b"))
    before = _rows(rig, "b")
    with pytest.raises(ThreadNotEmpty, match="'b' already has checkpoints"):
        saver.copy_thread("a", "b")
    with pytest.raises(ThreadNotEmpty):
        saver.copy_thread("a", "a")
    assert _rows(rig, "b") == before
    assert graph.get_state(cfg("b")).values == {"log": ["b", "think"]}
    saver.copy_thread("nothing", "c")                  # an empty source copies nothing
    assert saver.get_tuple(cfg("c")) is None and _rows(rig, "c") == [0, 0, 0]
    assert isinstance(ThreadNotEmpty("x"), SaverError)


def test_prune_keep_latest_keeps_the_head_and_removes_snapshots_only_it_left(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver)
    graph.invoke({"log": []}, cfg("t1"))
    rig.seen["disk"][("again",)] = rig.images["disk"].read_bytes()
    graph.invoke({"log": ["again"]}, cfg("t2"))        # starts on the disk t1 left
    h1 = list(graph.get_state_history(cfg("t1")))
    h2 = list(graph.get_state_history(cfg("t2")))
    shared = h1[0].metadata["disk_snapshot"]
    assert shared in _named(h2)
    assert len(_named(h1)) == 4 and len(_snapshot_ids(rig)) == 7
    t2_bytes = {snap: rig.snapshot_bytes(snap) for snap in _named(h2)}

    saver.prune(["t1"])

    kept = list(saver.list(cfg("t1")))
    assert [checkpoint_id(t.config) for t in kept] == [checkpoint_id(h1[0].config)]
    assert kept[0].checkpoint == saver.get_tuple(h1[0].config).checkpoint
    assert graph.get_state(cfg("t1")).values == {"log": list(PIPELINE)}
    blobs = _rows(rig, "t1")[1]
    assert blobs == len(kept[0].checkpoint["channel_versions"])
    # t1's first three snapshots went; its last (shared with t2) and t2's stay.
    assert _snapshot_ids(rig) == _named(h2) | {shared}
    assert_snapshots_match(rig, graph.get_state_history(cfg("t1")))
    assert {snap: rig.snapshot_bytes(snap) for snap in _named(h2)} == t2_bytes
    assert [checkpoint_id(t.config) for t in saver.list(cfg("t2"))] == [
        checkpoint_id(h.config) for h in h2]
    # The kept head goes on: a new run snapshots on from its disk.
    saver.restore_disk(cfg("t1"))
    graph.invoke({"log": []}, cfg("t1"))
    history = list(graph.get_state_history(cfg("t1")))
    assert len(history) == 7
    assert_snapshots_match(rig, history)

    saver.prune(["t1", "t2"], strategy="delete")
    assert list(saver.list(None)) == []
    assert [_rows(rig, t) for t in ("t1", "t2")] == [[0, 0, 0], [0, 0, 0]]
    assert _snapshot_ids(rig) == set()


def _nested_graph(rig: Rig, saver):
    inner = StateGraph(State)
    inner.add_node("approve", lambda s, config: _step(rig, "approve", "none", s))
    inner.add_edge(START, "approve")
    outer = StateGraph(State)
    outer.add_node("think", lambda s: {"log": ["think"]})
    outer.add_node("sub", inner.compile())
    outer.add_edge(START, "think")
    outer.add_edge("think", "sub")
    return outer.compile(checkpointer=saver)


def test_prune_keeps_each_namespace_head_and_its_pending_writes(rig):
    saver = rig.saver()
    graph, reference = _nested_graph(rig, saver), _nested_graph(rig, InMemorySaver())
    for g in (graph, reference):
        g.invoke({"log": []}, cfg("n"))                 # interrupted inside the subgraph
    namespaces = {t.config["configurable"]["checkpoint_ns"] for t in saver.list(cfg("n"))}
    assert len(namespaces) == 2
    assert graph.get_state(cfg("n"), subgraphs=True).next == ("sub",)

    saver.prune(["n"], strategy="keep_latest")

    listed = list(saver.list(cfg("n")))
    assert sorted(t.config["configurable"]["checkpoint_ns"] for t in listed) == sorted(
        namespaces)
    assert any(t.pending_writes for t in listed)
    state = graph.get_state(cfg("n"), subgraphs=True)
    assert state.next == ("sub",) and state.tasks[0].interrupts
    outs = [g.invoke(Command(resume="pruned"), cfg("n")) for g in (graph, reference)]
    assert outs[0] == outs[1] and outs[0]["log"][-1] == "approve:pruned"


def test_prune_keeps_what_a_delta_channel_is_rebuilt_from(rig):
    ours, reference = _delta_graph(rig.saver()), _delta_graph(InMemorySaver())
    for i in range(5):
        for graph in (ours, reference):
            graph.invoke({"items": [f"in{i}"]}, cfg("d"))
    for graph in (ours, reference):     # a head that is no full snapshot of "items"
        graph.update_state(cfg("d"), {"items": ["edit"]})
    saver = ours.checkpointer
    head = saver.get_tuple(cfg("d"))
    assert head.metadata["counters_since_delta_snapshot"]["items"][0] > 0

    saver.prune(["d"])

    kept = list(saver.list(cfg("d")))
    assert 1 < len(kept) < 21      # the head and its ancestors back to the last snapshot
    assert ours.get_state(cfg("d")).values["items"][-2:] == ["b5", "edit"]
    assert ours.get_state(cfg("d")).values == reference.get_state(cfg("d")).values
    for graph in (ours, reference):
        graph.invoke({"items": ["after"]}, cfg("d"))
    assert ours.get_state(cfg("d")).values == reference.get_state(cfg("d")).values
    assert ours.get_state(cfg("d")).values["items"][-4:] == ["edit", "after", "a5", "b6"]


def test_prune_leaves_snapshots_that_others_took_or_name(rig):
    image = rig.image()
    base = rig.store.commit(image, message="base image").id    # taken before the graph
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("think", "fetch"))
    graph.invoke({"log": []}, cfg("g"))
    history = list(graph.get_state_history(cfg("g")))
    assert history[-1].metadata["disk_snapshot"] == base      # an unchanged disk reused it
    last = history[0].metadata["disk_snapshot"]
    from blockdiff.agent.agent import Agent

    # An agent checkpoints the same, unchanged, disk: it names the graph's snapshot.
    with Agent(rig.store, "agent-1", disk=rig.disk()) as agent:
        agent.state["x"] = 1
        agent.checkpoint("manual")
        assert agent.db.history("agent-1")[0].disk_snapshot == last

    saver.prune(["g"], strategy="delete")

    assert saver.get_tuple(cfg("g")) is None
    assert _snapshot_ids(rig) == {base, last}
    rig.store.restore(last, rig.root / "check.img")
    assert (rig.root / "check.img").read_bytes() == rig.images["disk"].read_bytes()


def test_a_put_that_reused_a_pruned_snapshot_takes_the_disk_again(rig):
    old = rig.saver(rig.disk())
    build(rig, old, names=("fetch",)).invoke({"log": []}, cfg("old"))
    reused = old.get_tuple(cfg("old")).metadata["disk_snapshot"]
    calls = []

    class PruningDisk(ImageDisk):
        """Another process prunes the old thread right after the snapshot
        (an unchanged disk: the old thread's last) is taken."""

        def checkpoint(self, *args, **kwargs):
            snap = super().checkpoint(*args, **kwargs)
            calls.append(snap)
            if len(calls) == 1:
                other = rig.saver(store=rig.store.root)
                other.prune(["old"], strategy="delete")
            return snap

    saver = rig.saver(PruningDisk(rig.store, rig.images["disk"]))
    graph = build(rig, saver, names=("think",))
    graph.invoke({"log": []}, cfg("new"))

    assert calls[0] == reused and reused not in _snapshot_ids(rig)
    assert calls[1] != reused
    history = list(graph.get_state_history(cfg("new")))
    assert _named(history) == {calls[1]} <= _snapshot_ids(rig)
    assert rig.snapshot_bytes(calls[1]) == rig.images["disk"].read_bytes()


def test_prune_errors(rig):
    saver = rig.saver()
    with pytest.raises(UnknownStrategy, match="'keep_last'"):
        saver.prune(["t"], strategy="keep_last")
    assert isinstance(UnknownStrategy("x"), ValueError)
    saver.prune([])
    saver.prune(["missing"])


def test_snapshots_that_cannot_be_removed_are_reported_after_the_deletion(rig, monkeypatch):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch", "build"))
    graph.invoke({"log": []}, cfg("t"))
    named = _named(graph.get_state_history(cfg("t")))

    def refuse(snapshot_id):
        raise StoreError(f"cannot remove {snapshot_id}")

    monkeypatch.setattr(rig.store, "rm", refuse)
    with pytest.raises(SnapshotsNotRemoved, match="blockdiff rm") as caught:
        saver.prune(["t"])
    latest = saver.get_tuple(cfg("t")).metadata["disk_snapshot"]
    assert set(caught.value.snapshots) == named - {latest}
    assert len(list(saver.list(cfg("t")))) == 1         # the deletion stands
    assert _snapshot_ids(rig) >= named


def _run_config(thread_id: str, run_id: str) -> dict:
    return {"configurable": {"thread_id": thread_id}, "metadata": {"run_id": run_id}}


def test_delete_for_runs_deletes_those_runs_checkpoints_in_every_thread(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch", "think"))
    graph.invoke({"log": []}, _run_config("t1", "r1"))
    graph.invoke({"log": []}, _run_config("t1", "r2"))
    graph.invoke({"log": []}, _run_config("t2", "r1"))
    graph.invoke({"log": []}, cfg("t3"))                 # no run id
    by_run = {}
    for t in saver.list(None):
        by_run.setdefault(t.metadata.get("run_id"), []).append(t)
    assert sorted(len(v) for v in by_run.values()) == [4, 4, 8]
    kept_before = {checkpoint_id(t.config) for t in by_run["r2"] + by_run[None]}
    kept_bytes = {snap: rig.snapshot_bytes(snap) for snap in _named(by_run["r2"] + by_run[None])}

    saver.delete_for_runs(["r1", "unknown"])

    left = list(saver.list(None))
    assert {checkpoint_id(t.config) for t in left} == kept_before
    assert {t.metadata.get("run_id") for t in left} == {"r2", None}
    assert saver.get_tuple(cfg("t2")) is None and _rows(rig, "t2") == [0, 0, 0]
    assert graph.get_state(cfg("t1")).values == {"log": ["fetch", "think"] * 2}
    assert {snap: rig.snapshot_bytes(snap) for snap in _named(left)} == kept_bytes
    assert _snapshot_ids(rig) < _named(by_run["r1"]) | set(kept_bytes)
    saver.delete_for_runs([])
    assert len(list(saver.list(None))) == len(left)


def test_delete_for_runs_reads_the_run_of_checkpoints_saved_without_one(rig):
    saver = rig.saver()
    graph = build(rig, saver, names=("think",))
    graph.invoke({"log": []}, _run_config("t", "r1"))
    graph.invoke({"log": []}, _run_config("t", "r2"))
    saver.close()
    db = sqlite3.connect(rig.store.root / DB_NAME)
    try:       # the database as the first schema had it
        db.execute("DROP TABLE checkpoint_runs")
        db.execute("DROP TABLE schema_versions")
        db.execute("PRAGMA user_version = 1")
        db.commit()
    finally:
        db.close()

    saver = rig.saver(store=rig.store.root)
    assert saver.schema_version == 2
    graph = build(rig, saver, names=("think",))
    graph.invoke({"log": []}, _run_config("t", "r1"))
    db = sqlite3.connect(rig.store.root / DB_NAME)
    try:       # and as an earlier version's process, still running, saves them
        db.execute("DELETE FROM checkpoint_runs WHERE checkpoint_id IN (SELECT checkpoint_id "
                   "FROM checkpoint_runs ORDER BY checkpoint_id LIMIT 1)")
        db.commit()
    finally:
        db.close()
    saver.delete_for_runs(["r1"])

    assert {t.metadata["run_id"] for t in saver.list(cfg("t"))} == {"r2"}
    assert len(list(saver.list(cfg("t")))) == 3
    saver.delete_thread("t")
    assert _rows(rig, "t") == [0, 0, 0]
    db = sqlite3.connect(rig.store.root / DB_NAME)
    try:
        assert db.execute("SELECT COUNT(*) FROM checkpoint_runs").fetchone()[0] == 0
    finally:
        db.close()


def test_async_copy_prune_and_delete_for_runs(rig):
    saver = rig.saver(rig.disk())
    graph = build(rig, saver, names=("fetch", "build"), node=make_async_node)

    async def main():
        await graph.ainvoke({"log": []}, _run_config("a", "r1"))
        await saver.acopy_thread("a", "b")
        assert len([t async for t in saver.alist(cfg("b"))]) == 4
        await saver.aprune(["a"])
        assert len([t async for t in saver.alist(cfg("a"))]) == 1
        await saver.adelete_for_runs(["r1"])
        assert [t async for t in saver.alist(None)] == []

    asyncio.run(main())
    assert _snapshot_ids(rig) == set()
