"""Sandbox VMs whose disks live in a snapshot store: checkpoint, restore, fork.

A sandbox is a VM of the store's registry (:mod:`blockdiff.vm.registry`: its
name, directory, configuration and kernel), run by a
:class:`~blockdiff.vm.machine.Machine` (its QEMU process). This module is the
protocol over the two. After each agent step, :meth:`Sandbox.checkpoint` has
the guest freeze its filesystem, pauses the VM, commits the disk to the store
(a metadata operation on a reflink filesystem) and resumes: the VM is paused
only for the commit. :meth:`Sandbox.restore` puts a running VM's disk back to
any snapshot without rebooting it: the guest daemon ends every process and
unmounts the disk, the store patches the image in place, and the daemon
mounts it again with nothing of the old contents cached. :meth:`Sandbox.fork`
starts a new VM from any snapshot.

Whole-VM checkpoints: where the store is on a reflink filesystem (unless the
VM was created with ``memory=False``), guest RAM is a file beside the disk,
and a checkpoint commits it, with the device state behind it, as a second
snapshot of the same moment as the disk's: the *memory snapshot*, which the
disk snapshot's ``vm.memory`` names. The VM is paused only to capture what
RAM changed since a capture taken just before (see ``_commit_paused``). :meth:`Sandbox.restore` and
:meth:`Sandbox.fork` of such a checkpoint then bring the VM back running,
its processes where they were, without a boot (``disk_only`` keeps the disk
swap). The memory snapshot records the machine it can be resumed on
(``vm.machine``); any other is refused.

Files of the protocol in the VM's directory::

    lock                   serialises operations on the VM
    intent.json            the operation under way, for the next command to finish or
                           undo if it is interrupted (see blockdiff.vm.recovery)
    last-checkpoint.json   QEMU's count of the disk's writes after the last checkpoint
    ran                    a command ran since the last checkpoint
    resume-from            a stopped fork's memory snapshot, resumed by start()
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from blockdiff.engine.files import copy_file
from blockdiff.errors import (
    DiskUsedEarly,
    GuestError,
    StoreError,
    UnknownSnapshot,
    UsageError,
    VMError,
)
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Snapshot
from blockdiff.store.retention import PART_OF
from blockdiff.store.store import Store, as_store
from blockdiff.vm import intents, recovery, reserve
from blockdiff.vm.guestlink import THAW, ExecResult, GuestLink
from blockdiff.vm.intents import CHECKPOINT, FORK, RESTORE, START, crash_point
from blockdiff.vm.machine import DEFAULT_BOOT_TIMEOUT, Machine, fork_waiting
from blockdiff.vm.recovery import VMStatus
from blockdiff.vm.registry import Registry, check_name
from blockdiff.vm.standby import Standby

LOCK = intents.LOCK
LAST_CHECKPOINT = "last-checkpoint.json"
RAN = "ran"
RESUME_FROM = "resume-from"
# The memory writes of how many checkpoints, and at most how many bytes, are
# warmed before a resumed guest runs (a boot's own memory is 100 MiB or more).
HOT_CHECKPOINTS = 4
HOT_BYTES = 32 << 20
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


@dataclass(frozen=True)
class RestoreTiming:
    """How the last restore went."""

    seconds: float   # from the call until the VM runs commands again
    rebooted: bool   # False when the disk was swapped under the running guest
    tracked: bool = False   # QEMU's dirty bitmap said what was written
    memory: bool = False    # the VM resumed from the checkpoint's memory, processes and all
    standby: bool = False   # its memory image was the standby (blockdiff.vm.standby)
    prestarted: bool = False   # its QEMU had been started ahead (Machine.start_waiting)


class Sandbox:
    """One sandbox VM. Use it as a context manager: the VM is stopped on exit
    (and its directory removed if it was created ``ephemeral``)."""

    def __init__(self, store: Store | str | os.PathLike, name: str):
        self.store = as_store(store)
        self.registry = Registry(self.store)
        self.vm = self.registry.entry(name)
        self.machine = Machine(self.vm)
        self.name = name
        self.root = self.registry.root.parent   # the store's directory, absolute
        self.directory = self.vm.directory
        self.config = self.vm.config
        self.disk = self.vm.disk
        self.standby = Standby(self.store, self.directory,
                               spares_ready=self._start_waiting_for_a_fork)
        # Where the memory image of the last restore or fork with memory came
        # from (see blockdiff.vm.standby): "standby" (a restore swapped it
        # in), "spare" (a fork took it), "standby copy" (a fork cloned it),
        # "" (filled from the layers, or compared whole); of its disk, "spare"
        # (a fork took it) or "".
        self.memory_source = self.disk_source = ""
        self.ephemeral = False
        # Seconds to wait for the guest daemon's answer to a freeze, a thaw or
        # a detach before treating the guest as unresponsive.
        self.guest_timeout = 30.0
        self.last_checkpoint: CheckpointTiming | None = None
        self.last_restore: RestoreTiming | None = None
        # Seconds per phase of the last resume from a memory checkpoint
        # (the machine's own phases are in machine.last_launch).
        self.last_restore_phases: dict[str, float] = {}
        self._locked = False   # this object holds the VM's lock (recovery re-enters it)

    # ----------------------------------------------------------- creation

    @classmethod
    def create(cls, store: Store | str | os.PathLike, name: str, *,
               image: str | os.PathLike | None = None, snapshot: str | None = None,
               kernel: str | os.PathLike | None = None, memory_mb: int = 256, cpus: int = 1,
               ephemeral: bool = False, memory: bool | None = None,
               progress: Progress = NO_PROGRESS, _disk_later: bool = False,
               _intent: dict | None = None) -> "Sandbox":
        """A new, stopped VM whose disk is a copy of ``image`` (reflinked when
        it is on the store's filesystem; committed as the VM's root snapshot)
        or a fork of store snapshot ``snapshot``.
        ``kernel`` is a directory holding ``vmlinuz`` and ``initrd.img`` (made by
        ``blockdiff vm build-image``); by default the image's own directory, or
        the kernel the snapshot was taken with. ``memory``: checkpoints hold
        the VM's RAM and device state too (the default where the store is on
        a reflink filesystem). ``progress`` hears of the disk's bytes checked
        (a fork) or checksummed (its first commit). ``_disk_later``: the
        disk of a fork is left empty at the snapshot's size, for the caller
        to restore in place (a resume does, beside QEMU's start), and
        ``_intent`` the arguments of its fork's intent record, which the VM
        is registered with (see blockdiff.vm.intents)."""
        store = as_store(store)
        check_name(name)
        if memory is None:
            memory = not store.copy_mode
        elif memory and store.copy_mode:
            raise UsageError("memory checkpoints need a store on a reflink filesystem (a "
                             "copy-mode store would copy the whole RAM at every checkpoint); "
                             "create the VM with --no-memory")
        if (image is None) == (snapshot is None):
            raise UsageError("give exactly one of an image (--image) or a snapshot (--from)")
        if memory_mb < 64 or cpus < 1:
            raise UsageError("a VM needs at least 64 MiB of memory and one CPU")
        if image is not None and not Path(image).is_file():
            raise UsageError(f"no disk image at {image}")
        snap = store.get(snapshot) if snapshot is not None else None
        registry = Registry(store)
        kernel_key = registry.install_kernel(registry.kernel_source(kernel, image, snap))

        def write_disk(disk: Path) -> None:
            if snap is not None and _disk_later:
                _empty_file(disk, snap.size, 0o666)   # as a fork's, less the umask
            elif snap is not None:
                store.restore(snap.id, disk, progress=progress)
            else:
                copy_file(Path(image), disk)

        source = {"snapshot": snap.id} if snap else {"image": os.path.abspath(image)}
        registry.add(name, {"kernel": kernel_key, "memory_mb": memory_mb, "cpus": cpus,
                            "memory": memory, "source": source}, write_disk,
                     intent=None if _intent is None else (FORK, _intent))
        sandbox = cls(store, name)
        sandbox.ephemeral = ephemeral
        if snap is None:
            # The image as given becomes the root snapshot now, while nothing
            # runs: the first checkpoint then pauses the VM only for what the
            # first step changed, not for the whole disk.
            try:
                store.commit(sandbox.disk, message=f"VM {name} created from {Path(image).name}",
                             meta={"vm": name, "vm.kernel": kernel_key}, progress=progress)
            except BaseException:
                registry.remove(name)
                raise
        return sandbox

    @staticmethod
    def list(store: Store | str | os.PathLike) -> list["Sandbox"]:
        """Every VM of the store, by name."""
        store = as_store(store)
        return [Sandbox(store, name) for name in Registry(store).names()]

    # ------------------------------------------------------------- state

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        if self.ephemeral:
            self.destroy()
        else:
            self.stop()
            self.standby.wait()

    @property
    def pid(self) -> int | None:
        """QEMU's pid while the VM runs."""
        return self.machine.pid

    @property
    def running(self) -> bool:
        return self.machine.running

    @property
    def memory_checkpoints(self) -> bool:
        """Whether this VM's checkpoints hold its memory (``memory`` at creation)."""
        return bool(self.config.get("memory", not self.store.copy_mode))

    def status(self) -> VMStatus:
        """What the VM is (asking QEMU, bounded), and the snapshot its disk
        descends from."""
        return recovery.status(self, MEMORY_KEY)

    @contextlib.contextmanager
    def _lock(self, purpose: str = recovery.USE):
        """The VM's lock for the block, once what an interrupted operation
        left is finished or undone (see blockdiff.vm.recovery; ``purpose``:
        what the block does with the VM). Re-entered by that recovery."""
        if self._locked:
            yield
            return
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._locked = True
            recovery.recover(self, purpose)
            yield
        finally:
            self._locked = False
            os.close(fd)

    # ---------------------------------------------------------- lifecycle

    def start(self, *, timeout: float = DEFAULT_BOOT_TIMEOUT,
              progress: Progress = NO_PROGRESS) -> None:
        """Boot the VM (in the background) and wait until its guest daemon
        answers; the boot's phases go to ``progress``."""
        with self._lock():
            if self.machine.running:
                return
            marker = self.directory / RESUME_FROM
            # Only a crash leaves it (a launch that fails kills its QEMU).
            with intents.pending(self.directory, START, durable=False, failed=True):
                if marker.exists():
                    # A fork left stopped: it resumes from its checkpoint's memory.
                    self.machine.launch(timeout, progress, incoming=True,
                                        mark=self.store.lineage_mark(self.disk),
                                        hot=self._hot_memory(marker.read_text().strip()))
                    marker.unlink()
                else:
                    self._boot(timeout, progress)

    def _boot(self, timeout: float, progress: Progress = NO_PROGRESS) -> None:
        """Boot QEMU; with memory checkpoints, its RAM as the memory image,
        committed once booted as the base the first checkpoint's memory is
        a delta on."""
        memory = self.memory_checkpoints
        self.machine.launch(timeout, progress, memory=memory)
        if memory:
            self._commit_memory_base()

    def _commit_memory_base(self) -> None:
        """Commit the RAM a boot wrote (100 MiB or more), paused, as a
        snapshot no checkpoint is (it has no device state): the first
        checkpoint then stores, and pauses the VM for, only what its step
        changed, as the disk's root snapshot does for the disk."""
        with self.machine.qmp():
            self.machine.pause()
            try:
                # A part of the disk snapshot the VM booted from: gc keeps
                # it while that one stays, rm removes it with that one.
                booted_from = self.store.lineage(self.disk)[0]
                owner = {PART_OF: booted_from} if booted_from else {}
                self.store.commit(self.machine.memory_image,
                                  message=f"memory of VM {self.name} after its boot",
                                  meta={"vm": self.name, "vm.kernel": self.config["kernel"],
                                        PART_KEY: "memory-base"} | owner)
            finally:
                self.machine.resume()

    def stop(self, *, timeout: float = 20.0) -> None:
        """Shut the guest down cleanly (its disk unmounted); QEMU is killed if
        the guest does not power off in time."""
        with self._lock(recovery.STOP):
            self.standby.wait_standby()   # which may start a QEMU, killed here
            self.machine.shutdown(timeout)
            self._forget_checkpoints()

    def _kill(self, *, keep_waiting: bool = False) -> None:
        self.machine.kill(keep_waiting=keep_waiting)
        self._forget_checkpoints()

    def _start_waiting(self) -> None:
        """Start a QEMU on the standby for the next restore to take over
        (see Machine.start_waiting), if the VM runs with memory checkpoints;
        then one on each pair of spares that has none (the spares' thread,
        which starts them once it moved the spares, finds the VM stopped
        while a restore runs, and does not start them then)."""
        if self.machine.memory_backed:
            self.machine.start_waiting(self.standby.path)
            self._start_waiting_for_a_fork()

    def _start_waiting_for_a_fork(self) -> None:
        """Start a QEMU on each pair of spares for the next fork to take
        over, if the VM runs with memory checkpoints and both spares of the
        pair are there (a fork may take them meanwhile: then none is
        started on that pair)."""
        if self.machine.memory_backed:
            for pair in self.standby.pairs:
                with contextlib.suppress(FileNotFoundError):
                    self.machine.start_waiting(pair.memory.path, pair.disk.path,
                                               kind=fork_waiting(pair.number))

    def _forget_checkpoints(self) -> None:
        # What the protocol knew of a QEMU process that is gone.
        for f in (LAST_CHECKPOINT, RAN):
            (self.directory / f).unlink(missing_ok=True)

    def destroy(self) -> None:
        """Stop the VM and delete its directory. Snapshots of it stay in the store."""
        with self._lock(recovery.REMOVE):
            self.standby.wait()   # which may start a QEMU, killed here
            self._kill()
        self.registry.remove(self.name)

    # --------------------------------------------------------------- work

    def exec(self, command: str | list[str], *, timeout: float | None = None,
             input: bytes = b"", cwd: str = "/") -> ExecResult:
        """Run a command in the guest: a string through ``/bin/sh -c``, a list
        as it is. ``timeout`` kills it in the guest (the result says so)."""
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        with self._lock(), self.machine.guest() as link:
            # The guest's memory changes: skip_unchanged must not skip the next
            # memory checkpoint.
            reserve.note_ran(self.directory / RAN, self.directory / LAST_CHECKPOINT)
            return link.exec(argv, timeout=timeout, stdin=input, cwd=cwd)

    def checkpoint(self, message: str = "", meta: dict | None = None,
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
        meta = {"vm": self.name, "vm.kernel": self.config["kernel"]} | (meta or {})
        if memory is None:
            memory = self.memory_checkpoints
        with self._lock():
            if not self.machine.running:
                snap = self.store.commit(self.disk, message=message, meta=meta, ttl=ttl,
                                         skip_unchanged=skip_unchanged)
                return snap.id
            start = time.monotonic()
            memory = (memory and self.machine.memory_backed
                      and self.machine.guest_knows_memory_checkpoints())
            reserve.make_room(self.machine.memory_image,
                              self.machine.ram_bytes * self.machine.memory_backed,
                              f"a checkpoint of VM {self.name}")
            if skip_unchanged:
                unchanged = self._unchanged_since_checkpoint(memory)
                if unchanged is not None:
                    self.last_checkpoint = CheckpointTiming(0.0, 0.0, time.monotonic() - start)
                    return unchanged
            # Not synced: what it guards (a paused QEMU, a frozen guest) dies with the host.
            intents.write(self.directory, CHECKPOINT, durable=False)
            with self.machine.guest() as link, self.machine.qmp():
                meta["vm.flush"] = self._freeze(link, processes=memory)
                crash_point("checkpoint.frozen")
                # A guest that did not freeze may not resume either: disk only.
                memory = memory and meta["vm.flush"] == FSFREEZE
                frozen = time.monotonic()
                snap = memory_snap = None
                try:
                    snap, memory_snap, pause, memory_capture = self._commit_paused(
                        memory, message, meta, ttl, skip_unchanged and not memory)
                    # What it stored shares its blocks with the layers now.
                    reserve.own_vm_files(self.machine.memory_image, self.disk)
                finally:
                    if meta["vm.flush"] == FSFREEZE:
                        self._thaw(link, snap, settle=skip_unchanged)
            (self.directory / RAN).unlink(missing_ok=True)
            intents.clear(self.directory, durable=False)
            if memory_snap is not None:
                self.standby.prepare(memory_snap.id, snap.id, then=self._start_waiting)
            self.last_checkpoint = CheckpointTiming(
                frozen - start, pause.seconds, time.monotonic() - start,
                pause.written is not None, memory,
                memory_snap.changed_bytes - memory_capture.borrowed if memory_snap else 0,
                memory_capture.compared if memory_snap else 0,
                memory_capture.borrowed if memory_snap else 0)
            return snap.id

    def _commit_paused(self, memory: bool, message: str, meta: dict, ttl: float | None,
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
                memory_capture = captures.enter_context(self.store.capturing(
                    self.machine.memory_image, only_changed_pages=True))
            with self.machine.paused(self.store.lineage_mark(self.disk), memory=memory,
                                     read_later=not disk_in_pause) as pause:
                if memory:
                    memory_capture.take_more()
                crash_point("checkpoint.paused")
                if disk_in_pause:
                    disk_capture = captures.enter_context(
                        self.store.capturing(self.disk, written=pause.written))
            if memory:
                memory_capture.take_more(within=self.machine.device_state_area)
            if not disk_in_pause:
                disk_capture = captures.enter_context(self.store.capturing(
                    self.disk, written=self.machine.read_written(pause)))
                if self.machine.disk_writes() != pause.disk_writes:
                    captures.close()
                    return self._commit_paused(memory, message, meta, ttl, skip_unchanged,
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
                    meta=self._memory_meta(pause, snap), ttl=ttl, borrow_from=snap)
        # The bitmap that started in the pause started with the disk being
        # this snapshot.
        self.machine.trust_tracking(pause, self.store.lineage_mark(self.disk))
        return snap, memory_snap, pause, memory_capture

    def _memory_meta(self, pause, checkpoint: Snapshot) -> dict:
        """The metadata of a memory snapshot: what it is, the machine it can
        be resumed on, the size of the device state behind its RAM, and the
        checkpoint (disk snapshot) it is a part of."""
        return {"vm": self.name, "vm.kernel": self.config["kernel"], PART_KEY: "memory",
                MACHINE_KEY: json.dumps(self.machine.signature(), sort_keys=True),
                DEVICE_STATE_KEY: str(pause.device_state), PART_OF: checkpoint.id}

    def _freeze(self, link: GuestLink, processes: bool = False) -> str:
        """Have the guest flush and freeze its filesystem (and its processes);
        returns what the snapshot's ``vm.flush`` is to say."""
        try:
            link.freeze(auto_thaw=60.0, timeout=self.guest_timeout, processes=processes)
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

    def _thaw(self, link: GuestLink, snap: Snapshot | None, settle: bool = False) -> None:
        frozen_writes = self.machine.disk_writes()  # nothing writes while frozen
        link.thaw(timeout=self.guest_timeout)
        if settle:
            # The thaw's own write may still be under way; counted now, it
            # cannot make the next check (which syncs first) see a change.
            with contextlib.suppress(GuestError):
                link.sync(timeout=self.guest_timeout)
        thawed_writes = self.machine.disk_writes()
        # The thaw writes the superblock once; more means the guest wrote too,
        # and the next check must not skip.
        if snap is not None and thawed_writes - frozen_writes <= 1:
            note = {"snapshot": snap.id, "writes": thawed_writes, "pid": self.pid,
                    "memory": MEMORY_KEY in snap.meta}
            (self.directory / LAST_CHECKPOINT).write_text(json.dumps(note))

    def _unchanged_since_checkpoint(self, memory: bool = False) -> str | None:
        try:
            note = json.loads((self.directory / LAST_CHECKPOINT).read_text())
        except (OSError, ValueError):
            return None
        if memory and ((self.directory / RAN).exists() or not note.get("memory")):
            return None
        if note.get("pid") != self.pid or self.store.lineage(self.disk)[0] != note["snapshot"]:
            return None
        with contextlib.suppress(VMError), self.machine.guest() as link, self.machine.qmp():
            link.sync(timeout=self.guest_timeout)  # dirty pages become writes QEMU counts
            if self.machine.disk_writes() == note["writes"]:
                return note["snapshot"]
        return None

    def restore(self, snapshot_id: str, *, timeout: float = DEFAULT_BOOT_TIMEOUT,
                disk_only: bool = False) -> RestoreTiming:
        """Put the VM back to a checkpoint.

        A checkpoint with memory brings the VM back running, running or not
        before: QEMU is killed, disk and memory image restored, and a new
        QEMU resumes from them, its processes where they were, its clock set
        and its RNG reseeded. Otherwise, or with ``disk_only``, the disk is
        made byte-identical to the snapshot: a running VM runs on, its
        processes ended and its disk swapped under it (or, when that cannot
        be done, it is rebooted); a stopped VM stays stopped."""
        snap = self.store.get(snapshot_id)
        memory_snap = None if disk_only else self._memory_of(snap, self.machine)
        # Synced (a host crash may leave the disk half restored); the next
        # command finishes an interrupted restore (see blockdiff.vm.recovery).
        with self._lock(recovery.REPLACE), intents.pending(
                self.directory, RESTORE, snapshot=snap.id, disk_only=memory_snap is None):
            start = time.monotonic()
            rebooted = tracked = False
            self.memory_source = ""
            if memory_snap is not None:
                reserve.ensure_room(self.directory, memory_snap.size, f"restoring VM {self.name}")
                written = None
                self.standby.last_bring = {}
                with ThreadPoolExecutor(2) as pool, contextlib.ExitStack() as finally_:
                    # The standby brought to the checkpoint while QEMU stops
                    # (and left locked until taken).
                    ahead = pool.submit(self.standby.bring, memory_snap.id)
                    finally_.callback(self.standby.release)
                    finally_.callback(ahead.exception)   # run first: bring done
                    if self.machine.running:
                        # What the guest wrote since the last checkpoint, from the
                        # dirty bitmap, so that the disk's restore need not map it.
                        with contextlib.suppress(VMError):
                            written = self.machine.stop_for_good(
                                self.store.lineage_mark(self.disk))
                    crash_point("restore.stopped")
                    self._kill(keep_waiting=True)    # for the launch to take over
                    crash_point("restore.killed")
                    killed = time.monotonic()
                    # Then the disk, in place, beside the standby's move and
                    # the resume: the guest uses it only once resumed.
                    disk_ahead = (pool.submit(self._restore_disk, snap, written)
                                  if _holds_size(self.disk, snap.size) else None)
                    ahead.result()
                    brought = time.monotonic()
                    (self.directory / RESUME_FROM).unlink(missing_ok=True)
                    if self.standby.take(self.machine.memory_image, memory_snap.size):
                        self.memory_source = "standby"
                    crash_point("restore.taken")
                    self._resume(snap, memory_snap, timeout, written=written,
                                 disk_ahead=disk_ahead)
                tracked = written is not None
                self.last_restore_phases = ({"stop": killed - start, "standby": brought - start}
                                            | self.standby.last_bring
                                            | self.last_restore_phases)
            elif not self.machine.running:
                self.store.restore(snap.id, self.disk)
            else:
                swapped = self._swap_disk(snap)
                if swapped is None:
                    self._kill()
                    self.store.restore(snap.id, self.disk)
                    self._boot(timeout)
                    rebooted = True
                else:
                    tracked = swapped
            self.last_restore = RestoreTiming(time.monotonic() - start, rebooted, tracked,
                                              memory_snap is not None,
                                              self.memory_source == "standby",
                                              memory_snap is not None
                                              and self.machine.took_waiting)
            return self.last_restore

    def _restore_disk(self, snap: Snapshot, written) -> tuple[str | None, float]:
        """The disk restored in place (``written`` as for ``Store.restore``):
        its lineage mark then, and the seconds it took."""
        began = time.monotonic()
        self.store.restore(snap.id, self.disk, written=written)
        return self.store.lineage_mark(self.disk), time.monotonic() - began

    def _resume(self, snap: Snapshot, memory_snap: Snapshot, timeout: float, *,
                start: bool = True, disk: bool = True, written=None,
                fresh: bool = False, progress: Progress = NO_PROGRESS,
                disk_ahead=None) -> None:
        """With QEMU not running: the disk (unless it is the checkpoint's
        already: not ``disk``; ``written`` as for ``Store.restore``) and the
        memory image restored to the checkpoint, then (``start``) a QEMU
        resumed from them. Where both are restored in place at their sizes,
        QEMU starts meanwhile. ``fresh``: both files are a fork's new ones
        (empty, or spares), whose memory image's page cache is warmed where
        the guest likely writes before it runs, the rest after; the check of
        the disk's layers goes to ``progress``.
        ``memory_source`` says whether the memory image is a standby or a
        spare (see blockdiff.vm.standby) or a copy of one, clean at its
        snapshot.
        ``disk_ahead``: the future of ``_restore_disk``, restoring the disk
        already (taken instead, unless the disk is to be restored again).
        ``last_restore_phases`` says how long each took."""
        phases = self.last_restore_phases = {}
        image = self.machine.memory_image

        # A standby or a spare is rewritten only where its extent map differs
        # from the checkpoint's, with no dirty RAM of a dead guest to write
        # back first; its lineage alone is never trusted (see
        # blockdiff.vm.integrity). ``again``: QEMU ran on the image meanwhile.
        def restore_memory(again: bool = False) -> None:
            began = time.monotonic()
            # A standby this restore brought to the checkpoint (Standby.bring)
            # is there already, compared.
            if (self.memory_source != "standby" or again
                    or self.store.lineage(image) != (memory_snap.id, "clean")):
                self.store.restore(memory_snap.id, image)
            phases["memory"] = time.monotonic() - began

        def restore_disk(written, again: bool = False) -> str:
            if disk_ahead is not None:
                mark, phases["disk"] = disk_ahead.result()
                if not again:
                    return mark
            began = time.monotonic()
            if disk:
                self.store.restore(snap.id, self.disk, written=written, progress=progress)
            phases["disk"] = time.monotonic() - began
            return self.store.lineage_mark(self.disk)

        def restore(written=written, again: bool = False) -> str:
            mark = restore_disk(written, again)
            restore_memory(again)
            return mark

        if not start:
            restore()
            (self.directory / RESUME_FROM).write_text(memory_snap.id + "\n")
            return
        in_place = (_holds_size(self.disk, snap.size)
                    and _holds_size(self.machine.memory_image, memory_snap.size))
        if in_place:
            # The memory image while QEMU starts, the disk while it loads the
            # device state and starts the guest's CPUs (the guest uses its
            # disk only once resumed).
            hot = self._hot_memory(memory_snap.id) if fresh else None
            try:
                self.machine.launch(timeout, incoming=True, meanwhile=restore_memory,
                                    disk_meanwhile=lambda: restore_disk(written), hot=hot)
            except DiskUsedEarly:
                # Both again, first; what the guest wrote meanwhile is in no
                # bitmap, so both are mapped whole.
                self.machine.launch(timeout, incoming=True, hot=hot,
                                    meanwhile=lambda: restore(written=None, again=True))
        else:
            self.machine.launch(timeout, incoming=True, hot=self._hot_memory(memory_snap.id),
                                mark=restore())
        reserve.own_in_background(image, self.disk)
        if not fresh:
            # For the next restore or fork, while the guest runs.
            self.standby.prepare(memory_snap.id, snap.id, then=self._start_waiting)

    def _hot_memory(self, memory_snapshot_id: str):
        """The parts of the memory image that the last few checkpoints up to
        this one wrote, which the guest likely writes again: their page cache
        is warmed in 4 KiB folios before it runs (see Machine.launch)."""
        with contextlib.suppress(StoreError):   # only slower checkpoints
            return self.store.recently_written(memory_snapshot_id, HOT_CHECKPOINTS,
                                               HOT_BYTES)
        return None

    def _memory_of(self, snap: Snapshot, machine: Machine) -> Snapshot | None:
        """The memory snapshot of checkpoint ``snap`` (None for a disk-only
        one), if ``machine`` can resume it; VMError saying what to do if not."""
        memory_snap = memory_snapshot(self.store, snap, "restore its disk only")
        if memory_snap is not None:
            self._check_machine(snap, memory_snap, machine)
        return memory_snap

    def _check_machine(self, snap: Snapshot, memory_snap: Snapshot, machine: Machine) -> None:
        """VMError, saying what to do, unless ``machine`` is the machine the
        memory snapshot was taken on."""
        recorded = recorded_machine(memory_snap)
        current = machine.signature()
        keys = sorted(key for key in set(recorded) | set(current)
                      if recorded.get(key) != current.get(key))
        if not keys:
            return
        if set(keys) <= {"memory_mb", "cpus"}:
            fix = (f"fork it into a new VM, which takes its memory size and CPUs (blockdiff vm "
                   f"fork {self.name} {snap.id} NEW), or restore its disk only (--disk-only)")
        else:
            fix = ("resume it on the machine it was taken on, or restore its disk only "
                   "(--disk-only; its processes are not brought back)")
        differ = "; ".join(f"{key} {recorded.get(key)!r} (this VM: {current.get(key)!r})"
                           for key in keys)
        raise VMError(f"checkpoint {snap.id} holds the memory of another machine: {differ}; "
                      f"{fix}")

    def _swap_disk(self, snap: Snapshot) -> bool | None:
        """Restore under the running guest; None if that cannot be done here
        (another size, a copy-mode store that replaces files, a mute guest),
        else whether the dirty bitmap said what to rewrite."""
        if self.store.copy_mode or os.path.getsize(self.disk) != snap.size:
            return None
        try:
            with self.machine.guest() as link:
                link.detach(timeout=self.guest_timeout)
                crash_point("restore.detached")
                with self.machine.paused(self.store.lineage_mark(self.disk)) as pause:
                    crash_point("restore.swap-paused")
                    self.store.restore(snap.id, self.disk, written=pause.written)
                # The bitmap that started in the pause started with the disk
                # being the snapshot (the guest wrote nothing: detached).
                self.machine.trust_tracking(pause, self.store.lineage_mark(self.disk))
                link.attach(timeout=self.guest_timeout)
        except GuestError:
            return None
        return pause.written is not None

    def fork(self, snapshot_id: str, new_name: str, *, start: bool = True,
             timeout: float = DEFAULT_BOOT_TIMEOUT, disk_only: bool = False,
             progress: Progress = NO_PROGRESS) -> "Sandbox":
        """A new VM, like this one, whose disk is a fork of ``snapshot_id``
        (the fork's check and the boot go to ``progress``). From a checkpoint
        with memory (unless ``disk_only``), it takes that checkpoint's memory
        size and CPUs and resumes from its memory instead of booting, its
        processes running on independently of this VM's, with a clock and a
        random-number state of its own; stopped (``start`` False), it resumes
        when started."""
        return Sandbox.from_checkpoint(self.store, snapshot_id, new_name, start=start,
                                       timeout=timeout, disk_only=disk_only,
                                       kernel=self.vm.kernel_dir, memory_mb=self.vm.memory_mb,
                                       cpus=self.vm.cpus, memory=self.memory_checkpoints,
                                       progress=progress, _standby=self.standby)

    @classmethod
    def from_checkpoint(cls, store: Store | str | os.PathLike, snapshot_id: str, name: str, *,
                        start: bool = True, timeout: float = DEFAULT_BOOT_TIMEOUT,
                        disk_only: bool = False, kernel: str | os.PathLike | None = None,
                        memory_mb: int = 256, cpus: int = 1, memory: bool | None = None,
                        progress: Progress = NO_PROGRESS,
                        _standby: Standby | None = None) -> "Sandbox":
        """A new VM ``name`` from a checkpoint, with no VM of its own needed:
        what :meth:`fork` does, and what another host of a shared store does
        to take a sandbox over (its kernel comes from the snapshot, fetched
        if need be). From a checkpoint with memory (unless ``disk_only``) it
        takes the checkpoint's memory size and CPUs and resumes its processes
        instead of booting (when started, if ``start`` is False); otherwise
        ``memory_mb`` and ``cpus``, and a boot. ``_standby``: the standby
        of the VM forked, whose spares it takes, or else whose standby it
        copies, if there and not being prepared, instead of filling a new
        memory image and disk whole."""
        store = as_store(store)
        snap = store.get(snapshot_id)
        memory_snap = None if disk_only else memory_snapshot(store, snap,
                                                             "start from its disk only")
        if memory_snap is not None:
            recorded = recorded_machine(memory_snap)
            memory_mb = recorded.get("memory_mb", memory_mb)
            cpus = recorded.get("cpus", cpus)
        # With memory, the disk and the memory image are made empty at their
        # sizes, and filled in place as a restore fills them: the memory
        # image while QEMU starts, the disk while it loads the device state.
        # Registered with an intent record: the next command on a fork
        # interrupted makes it again (see blockdiff.vm.recovery).
        other = Sandbox.create(store, name, snapshot=snap.id, kernel=kernel,
                               memory_mb=memory_mb, cpus=cpus, memory=memory,
                               progress=progress, _disk_later=memory_snap is not None,
                               _intent=recovery.fork_intent(snap, memory_snap, start, _standby))
        crash_point("fork.registered")
        if memory_snap is not None:
            yielding = _standby.yielding() if _standby is not None else contextlib.nullcontext()
            try:
                with yielding:
                    other._resume_fork(snap, memory_snap, _standby, start, timeout, progress)
            except BaseException:
                other.destroy()
                raise
            intents.clear(other.directory)
            if "spare" in (other.memory_source, other.disk_source):
                # The spares taken made anew, while this fork runs: the
                # memory spare a clone of the standby as it is (a move costs
                # as much as the next fork saves, wherever it goes), the
                # disk this fork's; at once and at the usual priority, even
                # while a pair is left: forks often come in a row, and at
                # nice 19 a pair took longer to make than two forks.
                _standby.prepare_spares(None, snap.id, missing_only=True)
        elif start:
            other.start(timeout=timeout, progress=progress)
        return other

    def _resume_fork(self, snap: Snapshot, memory_snap: Snapshot, standby: Standby | None,
                     start: bool, timeout: float, progress: Progress) -> None:
        """This new VM's images made from ``standby``'s spares (or a copy of
        its standby, or empty) and resumed from checkpoint ``snap`` with
        memory ``memory_snap`` (see ``from_checkpoint``)."""
        self._check_machine(snap, memory_snap, self.machine)
        reserve.ensure_room(self.directory, memory_snap.size, f"a fork of VM {self.name}")
        given = (False, False)
        if standby is not None:
            # A pair a QEMU waits on first: one just made anew may have
            # none yet.
            given = standby.give_spares(
                self.machine.memory_image, memory_snap.size, self.disk, snap.size,
                first=self.machine.forks_waiting(standby.path.parent))
        self.memory_source = self._new_memory_image(memory_snap, standby, given[0])
        if given[1]:
            self.disk_source = "spare"
        crash_point("fork.images")
        if (self.memory_source == self.disk_source == "spare"
                and self.machine.hand_over_waiting(standby.path.parent)
                and not start):
            # The QEMU waiting on both is the launch's to take over: none
            # for a fork left stopped.
            self.machine.kill_waiting()
        with self._lock(), ThreadPoolExecutor(1) as pool:
            # A disk spare brought to the checkpoint at once, beside the
            # memory image's move and QEMU's start: the guest uses its disk
            # only once resumed.
            disk_ahead = (pool.submit(self._restore_disk, snap, None)
                          if start and self.disk_source else None)
            self._resume(snap, memory_snap, timeout, start=start, fresh=True,
                         progress=progress, disk_ahead=disk_ahead)

    def _new_memory_image(self, memory_snap: Snapshot, standby: Standby | None,
                          spare: bool) -> str:
        """This new VM's memory image, at the size of ``memory_snap``: a
        memory spare of ``standby`` given already (``spare``: "spare"), or
        else a copy of the standby ("standby copy"), or else empty ("").
        See blockdiff.vm.standby."""
        image, size = self.machine.memory_image, memory_snap.size
        if spare:
            return "spare"
        _empty_file(image, size, 0o600)   # guest RAM
        # Before QEMU starts: a clone beside its start slowed both (in four
        # benchmark runs each way, QEMU's start and the memory's restore took
        # 100-117 ms against 169-216, medians).
        if standby is not None and standby.copy_to(image, size, memory_snap.id):
            return "standby copy"
        return ""


def _holds_size(path: Path, size: int) -> bool:
    """Whether ``path`` is there, ``size`` bytes long."""
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def _empty_file(path: Path, size: int, mode: int) -> None:
    """A new file of ``size`` bytes that holds none (sparse)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def memory_snapshot(store: Store, snap: Snapshot, fix: str) -> Snapshot | None:
    """The memory snapshot of checkpoint ``snap`` (None for a disk-only
    one); VMError ending in ``fix`` (what to do) if it is not in the store."""
    memory_id = snap.meta.get(MEMORY_KEY)
    if memory_id is None:
        return None
    try:
        return store.get(memory_id)
    except UnknownSnapshot:
        raise VMError(f"the memory of checkpoint {snap.id} (snapshot {memory_id}) is not in "
                      f"the store (removed, or its checkpoint was interrupted); {fix} "
                      f"(--disk-only)") from None


def recorded_machine(memory_snap: Snapshot) -> dict:
    """The machine configuration a memory snapshot was taken on ({} if it
    does not say)."""
    try:
        recorded = json.loads(memory_snap.meta.get(MACHINE_KEY, ""))
    except ValueError:
        return {}
    return recorded if isinstance(recorded, dict) else {}
