"""A sandbox's checkpoint: its disk snapshot, and with memory the snapshot of
its RAM and device state taken in the same pause (see blockdiff.vm.sandbox).

:class:`VMCheckpoint` owns the pairing of the two: the disk snapshot's
metadata names its memory snapshot (``vm.memory``), and only this module
reads or writes that key. :func:`checkpoint` is :meth:`Sandbox.checkpoint`,
on the sandbox it is given (whose lock, machine and standby it uses). The
functions take that sandbox as ``box`` without importing its class: it is
the layer above this one.

Files of the protocol in the VM's directory::

    last-checkpoint.json   QEMU's count of the disk's writes after the last checkpoint
    ran                    a command ran since the last checkpoint
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

from blockdiff.errors import GuestError, UnknownSnapshot, VMError
from blockdiff.store.catalog import Snapshot
from blockdiff.store.retention import PART_OF
from blockdiff.store.store import Store
from blockdiff.vm import intents, reserve
from blockdiff.vm.guestlink import THAW, GuestLink
from blockdiff.vm.intents import CHECKPOINT, crash_point

LAST_CHECKPOINT = "last-checkpoint.json"
RAN = "ran"
FSFREEZE = "fsfreeze"
# Metadata keys: the disk snapshot names its memory snapshot; the memory
# snapshot says what it is, the machine it runs on and its device state's size.
MEMORY_KEY = "vm.memory"
PART_KEY = "vm.part"
MACHINE_KEY = "vm.machine"
DEVICE_STATE_KEY = "vm.device-state"

@dataclass(frozen=True)


class CheckpointTiming:
    """Seconds spent in each phase of the last checkpoint."""

    freeze: float    # the guest flushing and freezing its filesystem
    paused: float    # the VM stopped: the bitmap swap, the device state, the captures
    total: float
    tracked: bool = False   # QEMU's dirty bitmap said what to map
    memory: bool = False    # RAM and device state are in the checkpoint too
    memory_bytes: int = 0   # bytes of the memory image the memory snapshot stored
    memory_compared: int = 0   # bytes it compared with its parent's to keep only those
    memory_borrowed: int = 0   # bytes of it the disk snapshot's layer holds (page cache)


def memory_of(meta: Mapping[str, str] | None) -> str | None:
    """The id of the memory snapshot a disk snapshot's metadata names (None
    for a disk-only checkpoint, or a snapshot that is no checkpoint)."""
    return (meta or {}).get(MEMORY_KEY)

@dataclass(frozen=True)


class VMCheckpoint:
    """A checkpoint as the store holds it: its disk snapshot, and the memory
    snapshot of the same moment (None for a disk-only checkpoint)."""

    disk: Snapshot
    memory: Snapshot | None

    @classmethod
    def load(cls, store: Store, snap: Snapshot, fix: str) -> "VMCheckpoint":
        """Checkpoint ``snap`` with its memory snapshot; VMError ending in
        ``fix`` (what to do) if the memory it names is not in the store."""
        memory_id = memory_of(snap.meta)
        if memory_id is None:
            return cls(snap, None)
        try:
            return cls(snap, store.get(memory_id))
        except UnknownSnapshot:
            raise VMError(f"the memory of checkpoint {snap.id} (snapshot {memory_id}) is not "
                          f"in the store (removed, or its checkpoint was interrupted); {fix} "
                          f"(--disk-only)") from None

    @property
    def machine(self) -> dict:
        """The machine configuration its memory was taken on ({} if it does
        not say, or for a disk-only checkpoint)."""
        return {} if self.memory is None else recorded_machine(self.memory)


def memory_snapshot(store: Store, snap: Snapshot, fix: str) -> Snapshot | None:
    """The memory snapshot of checkpoint ``snap`` (None for a disk-only
    one); VMError ending in ``fix`` (what to do) if it is not in the store."""
    return VMCheckpoint.load(store, snap, fix).memory


def recorded_machine(memory_snap: Snapshot) -> dict:
    """The machine configuration a memory snapshot was taken on ({} if it
    does not say)."""
    try:
        recorded = json.loads(memory_snap.meta.get(MACHINE_KEY, ""))
    except ValueError:
        return {}
    return recorded if isinstance(recorded, dict) else {}


def commit_memory_base(box) -> None:
    """Commit the RAM a boot wrote (100 MiB or more), paused, as a
    snapshot no checkpoint is (it has no device state): the first
    checkpoint then stores, and pauses the VM for, only what its step
    changed, as the disk's root snapshot does for the disk."""
    with box.machine.qmp():
        box.machine.pause()
        try:
            # A part of the disk snapshot the VM booted from: gc keeps
            # it while that one stays, rm removes it with that one.
            booted_from = box.store.lineage(box.disk)[0]
            owner = {PART_OF: booted_from} if booted_from else {}
            box.store.commit(box.machine.memory_image,
                             message=f"memory of VM {box.name} after its boot",
                             meta={"vm": box.name, "vm.kernel": box.config["kernel"],
                                   PART_KEY: "memory-base"} | owner)
        finally:
            box.machine.resume()


def checkpoint(box, message: str = "", meta: dict | None = None,
               ttl: float | None = None, skip_unchanged: bool = False,
               memory: bool | None = None) -> str:
    """Snapshot the disk into the store; returns the snapshot id.

    A running guest flushes and freezes its filesystem, then the VM is
    paused (which drains every write) while the store captures what the
    image changed (see ``Store.capturing``), and resumed; the capture is
    committed and the guest thawed. A guest whose daemon does not answer is
    snapshotted as it is on disk (crash-consistent), and the snapshot's
    ``vm.flush`` says so. With ``skip_unchanged``, a disk with no change
    since its last snapshot gives that snapshot's id and adds no node
    (with memory: only if no command ran in the guest since either).

    ``memory`` (default: the VM's ``memory_checkpoints``): a whole-VM
    checkpoint. The guest's processes are frozen with its filesystem, and
    in the same pause as the disk the memory image (RAM, then the device
    state) is captured, then committed as a snapshot of its own, which the disk
    snapshot's ``vm.memory`` names. It is taken only from a running QEMU
    whose RAM is the memory image and whose guest daemon can resume; else
    the checkpoint is of the disk alone (``last_checkpoint.memory``)."""
    meta = {"vm": box.name, "vm.kernel": box.config["kernel"]} | (meta or {})
    if memory is None:
        memory = box.memory_checkpoints
    with box._lock():
        if not box.machine.running:
            snap = box.store.commit(box.disk, message=message, meta=meta, ttl=ttl,
                                    skip_unchanged=skip_unchanged)
            return snap.id
        start = time.monotonic()
        memory = (memory and box.machine.memory_backed
                  and box.machine.guest_knows_memory_checkpoints())
        reserve.make_room(box.machine.memory_image,
                          box.machine.ram_bytes * box.machine.memory_backed,
                          f"a checkpoint of VM {box.name}")
        if skip_unchanged:
            unchanged = _unchanged_since_checkpoint(box, memory)
            if unchanged is not None:
                box.last_checkpoint = CheckpointTiming(0.0, 0.0, time.monotonic() - start)
                return unchanged
        # Not synced: what it guards (a paused QEMU, a frozen guest) dies with the host.
        intents.write(box.directory, CHECKPOINT, durable=False)
        with box.machine.guest() as link, box.machine.qmp():
            meta["vm.flush"] = _freeze(box, link, processes=memory)
            crash_point("checkpoint.frozen")
            # A guest that did not freeze may not resume either: disk only.
            memory = memory and meta["vm.flush"] == FSFREEZE
            frozen = time.monotonic()
            snap = memory_snap = None
            try:
                snap, memory_snap, pause, memory_capture = _commit_paused(
                    box, memory, message, meta, ttl, skip_unchanged and not memory)
                # What it stored shares its blocks with the layers now.
                reserve.own_vm_files(box.machine.memory_image, box.disk)
            finally:
                if meta["vm.flush"] == FSFREEZE:
                    _thaw(box, link, snap, settle=skip_unchanged)
        (box.directory / RAN).unlink(missing_ok=True)
        intents.clear(box.directory, durable=False)
        if memory_snap is not None:
            box.standby.prepare(memory_snap.id, snap.id, then=box._start_waiting)
        box.last_checkpoint = CheckpointTiming(
            frozen - start, pause.seconds, time.monotonic() - start,
            pause.written is not None, memory,
            memory_snap.changed_bytes - memory_capture.borrowed if memory_snap else 0,
            memory_capture.compared if memory_snap else 0,
            memory_capture.borrowed if memory_snap else 0)
        return snap.id


def _commit_paused(box, memory: bool, message: str, meta: dict, ttl: float | None,
                   skip_unchanged: bool, *, disk_in_pause: bool | None = None):
    """The commit of a checkpoint: ``(disk snapshot, memory snapshot or
    None, pause, the memory's capture or None)``.
    The VM is paused only while the store captures what changed (see
    ``Store.capturing``), cloning it into staged layers;
    the captures are committed once it runs again.

    A whole-VM checkpoint captures the memory image first while the VM
    still runs, its processes frozen (which writes back the RAM the step
    dirtied), and in the pause only what the RAM changed since, while
    QEMU saves the device state; the device state goes into the memory
    image behind the RAM once the VM runs again, and is captured then.
    It captures the disk after the pause (unless ``disk_in_pause``): the
    guest's filesystem and processes are frozen, so its disk holds
    still, which QEMU's count of the disk's writes confirms. Should the
    count have moved, both are captured again, the disk in the pause.

    The disk snapshot is committed first, naming the memory snapshot to
    come, and the memory borrows from its layer the pages of the guest's
    page cache that hold blocks the step wrote. A failure (or a crash)
    between the two leaves a disk snapshot whose memory is not in the
    store, which a restore refuses unless it is of the disk only."""
    if disk_in_pause is None:
        disk_in_pause = not memory
    with contextlib.ExitStack() as captures:
        memory_capture = None
        if memory:
            # Much of what it writes back holds the bytes it held: RAM
            # goes in whole folios, the device state is written whole.
            memory_capture = captures.enter_context(box.store.capturing(
                box.machine.memory_image, only_changed_pages=True))
        with box.machine.paused(box.store.lineage_mark(box.disk), memory=memory,
                                read_later=not disk_in_pause) as pause:
            if memory:
                memory_capture.take_more()
            crash_point("checkpoint.paused")
            if disk_in_pause:
                disk_capture = captures.enter_context(
                    box.store.capturing(box.disk, written=pause.written))
        if memory:
            memory_capture.take_more(within=box.machine.device_state_area)
        if not disk_in_pause:
            disk_capture = captures.enter_context(box.store.capturing(
                box.disk, written=box.machine.read_written(pause)))
            if box.machine.disk_writes() != pause.disk_writes:
                captures.close()
                return _commit_paused(box, memory, message, meta, ttl, skip_unchanged,
                                      disk_in_pause=True)
        if memory_capture is not None:
            meta[MEMORY_KEY] = memory_capture.snap_id
        crash_point("checkpoint.captured")
        if skip_unchanged and disk_capture.unchanged:
            snap = disk_capture.parent
        else:
            snap = disk_capture.finish(message=message, meta=meta, ttl=ttl)
        memory_snap = None
        if memory_capture is not None:
            memory_snap = memory_capture.finish(
                message=f"memory: {message}" if message else "memory",
                meta=_memory_meta(box, pause, snap), ttl=ttl, borrow_from=snap)
    # The bitmap that started in the pause started with the disk being
    # this snapshot.
    box.machine.trust_tracking(pause, box.store.lineage_mark(box.disk))
    return snap, memory_snap, pause, memory_capture


def _memory_meta(box, pause, checkpoint: Snapshot) -> dict:
    """The metadata of a memory snapshot: what it is, the machine it can
    be resumed on, the size of the device state behind its RAM, and the
    checkpoint (disk snapshot) it is a part of."""
    return {"vm": box.name, "vm.kernel": box.config["kernel"], PART_KEY: "memory",
            MACHINE_KEY: json.dumps(box.machine.signature(), sort_keys=True),
            DEVICE_STATE_KEY: str(pause.device_state), PART_OF: checkpoint.id}


def _freeze(box, link: GuestLink, processes: bool = False) -> str:
    """Have the guest flush and freeze its filesystem (and its processes);
    returns what the snapshot's ``vm.flush`` is to say."""
    try:
        link.freeze(auto_thaw=60.0, timeout=box.guest_timeout, processes=processes)
        return FSFREEZE
    except GuestError:
        # Should the freeze still arrive, the thaw queued behind it undoes it.
        with contextlib.suppress(GuestError):
            link.send(THAW)
        return "none: the guest daemon did not answer"


# A freeze and a thaw write to the guest's filesystem, so a running VM's
# disk always differs after a checkpoint. Whether the guest wrote since is
# told instead by QEMU's count of the disk's writes, noted right after the
# thaw and compared after the guest has flushed its page cache.

def _thaw(box, link: GuestLink, snap: Snapshot | None, settle: bool = False) -> None:
    frozen_writes = box.machine.disk_writes()  # nothing writes while frozen
    link.thaw(timeout=box.guest_timeout)
    if settle:
        # The thaw's own write may still be under way; counted now, it
        # cannot make the next check (which syncs first) see a change.
        with contextlib.suppress(GuestError):
            link.sync(timeout=box.guest_timeout)
    thawed_writes = box.machine.disk_writes()
    # The thaw writes the superblock once; more means the guest wrote too,
    # and the next check must not skip.
    if snap is not None and thawed_writes - frozen_writes <= 1:
        note = {"snapshot": snap.id, "writes": thawed_writes, "pid": box.pid,
                "memory": memory_of(snap.meta) is not None}
        (box.directory / LAST_CHECKPOINT).write_text(json.dumps(note))


def _unchanged_since_checkpoint(box, memory: bool = False) -> str | None:
    try:
        note = json.loads((box.directory / LAST_CHECKPOINT).read_text())
    except (OSError, ValueError):
        return None
    if memory and ((box.directory / RAN).exists() or not note.get("memory")):
        return None
    if note.get("pid") != box.pid or box.store.lineage(box.disk)[0] != note["snapshot"]:
        return None
    with contextlib.suppress(VMError), box.machine.guest() as link, box.machine.qmp():
        link.sync(timeout=box.guest_timeout)  # dirty pages become writes QEMU counts
        if box.machine.disk_writes() == note["writes"]:
            return note["snapshot"]
    return None
