"""Putting a sandbox back to a checkpoint, and starting a new one from a
checkpoint: :meth:`Sandbox.restore`, :meth:`Sandbox.fork` and
:meth:`Sandbox.from_checkpoint`, on the sandbox (or the sandbox class) they
are given, whose lock, machine and standby they use; as ``box``, without
importing the class, which is the layer above this one.

A checkpoint with memory (see blockdiff.vm.checkpoint) is resumed: its disk
and memory image put in place, by restoring them or by taking the standby or
spares already brought to it (blockdiff.vm.standby), and a QEMU (started
ahead, or now) loads the device state and runs the guest on.

Files of the protocol in the VM's directory::

    resume-from   a stopped fork's memory snapshot, resumed by start()
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from blockdiff.errors import DiskUsedEarly, GuestError, StoreError, VMError
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Snapshot
from blockdiff.store.store import Store, as_store
from blockdiff.vm import intents, reserve
from blockdiff.vm.checkpoint import VMCheckpoint, memory_snapshot, recorded_machine
from blockdiff.vm.intents import RESTORE, crash_point
from blockdiff.vm.machine import DEFAULT_BOOT_TIMEOUT, Machine
from blockdiff.vm.standby import Standby

RESUME_FROM = "resume-from"
# The memory writes of how many checkpoints, and at most how many bytes, are
# warmed before a resumed guest runs (a boot's own memory is 100 MiB or more).
HOT_CHECKPOINTS = 4
HOT_BYTES = 32 << 20


@dataclass(frozen=True)
class RestoreTiming:
    """How the last restore went."""

    seconds: float   # from the call until the VM runs commands again
    rebooted: bool   # False when the disk was swapped under the running guest
    tracked: bool = False   # QEMU's dirty bitmap said what was written
    memory: bool = False    # the VM resumed from the checkpoint's memory, processes and all
    standby: bool = False   # its memory image was the standby (blockdiff.vm.standby)
    prestarted: bool = False   # its QEMU had been started ahead (Machine.start_waiting)


@dataclass(frozen=True)
class ForkResult:
    """How a VM was made from a checkpoint (``Sandbox.last_fork`` of the new VM)."""

    checkpoint: str   # the disk snapshot it was made from
    memory: bool      # it resumes from the checkpoint's memory (when started), processes and all
    # Where its memory image and its disk came from (see Sandbox.memory_source):
    # "spare", "standby copy", or "" (filled from the layers, or booted).
    memory_source: str = ""
    disk_source: str = ""
    prestarted: bool = False   # its QEMU had been started ahead (Machine.start_waiting)


def restore(box, snapshot_id: str, *, timeout: float = DEFAULT_BOOT_TIMEOUT,
            disk_only: bool = False) -> RestoreTiming:
    """Put the VM back to a checkpoint.

    A checkpoint with memory brings the VM back running, running or not
    before: QEMU is killed, disk and memory image restored, and a new
    QEMU resumes from them, its processes where they were, its clock set
    and its RNG reseeded. Otherwise, or with ``disk_only``, the disk is
    made byte-identical to the snapshot: a running VM runs on, its
    processes ended and its disk swapped under it (or, when that cannot
    be done, it is rebooted); a stopped VM stays stopped."""
    snap = box.store.get(snapshot_id)
    memory_snap = None if disk_only else memory_to_resume(box, snap, box.machine)
    # Synced (a host crash may leave the disk half restored); the next
    # command finishes an interrupted restore (see blockdiff.vm.recovery).
    with box._lock(intents.REPLACE), intents.pending(
            box.directory, RESTORE, snapshot=snap.id, disk_only=memory_snap is None):
        start = time.monotonic()
        rebooted = tracked = False
        box.memory_source = ""
        if memory_snap is not None:
            reserve.ensure_room(box.directory, memory_snap.size, f"restoring VM {box.name}")
            written = None
            box.standby.last_bring = {}
            with ThreadPoolExecutor(2) as pool, contextlib.ExitStack() as finally_:
                # The standby brought to the checkpoint while QEMU stops
                # (and left locked until taken).
                ahead = pool.submit(box.standby.bring, memory_snap.id)
                finally_.callback(box.standby.release)
                finally_.callback(ahead.exception)   # run first: bring done
                if box.machine.running:
                    # What the guest wrote since the last checkpoint, from the
                    # dirty bitmap, so that the disk's restore need not map it.
                    with contextlib.suppress(VMError):
                        written = box.machine.stop_for_good(
                            box.store.lineage_mark(box.disk))
                crash_point("restore.stopped")
                box._kill(keep_waiting=True)    # for the launch to take over
                crash_point("restore.killed")
                killed = time.monotonic()
                # Then the disk, in place, beside the standby's move and
                # the resume: the guest uses it only once resumed.
                disk_ahead = (pool.submit(restore_disk_in_place, box, snap, written)
                              if holds_size(box.disk, snap.size) else None)
                ahead.result()
                brought = time.monotonic()
                (box.directory / RESUME_FROM).unlink(missing_ok=True)
                if box.standby.take(box.machine.memory_image, memory_snap.size):
                    box.memory_source = "standby"
                crash_point("restore.taken")
                resume(box, snap, memory_snap, timeout, written=written,
                       disk_ahead=disk_ahead)
            tracked = written is not None
            box.last_restore_phases = ({"stop": killed - start, "standby": brought - start}
                                       | box.standby.last_bring
                                       | box.last_restore_phases)
        elif not box.machine.running:
            box.store.restore(snap.id, box.disk)
        else:
            swapped = _swap_disk(box, snap)
            if swapped is None:
                box._kill()
                box.store.restore(snap.id, box.disk)
                box._boot(timeout)
                rebooted = True
            else:
                tracked = swapped
        box.last_restore = RestoreTiming(time.monotonic() - start, rebooted, tracked,
                                         memory_snap is not None,
                                         box.memory_source == "standby",
                                         memory_snap is not None
                                         and box.machine.took_waiting)
        return box.last_restore


def restore_disk_in_place(box, snap: Snapshot, written) -> tuple[str | None, float]:
    """The disk restored in place (``written`` as for ``Store.restore``):
    its lineage mark then, and the seconds it took."""
    began = time.monotonic()
    box.store.restore(snap.id, box.disk, written=written)
    return box.store.lineage_mark(box.disk), time.monotonic() - began


def resume(box, snap: Snapshot, memory_snap: Snapshot, timeout: float, *,
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
    ``disk_ahead``: the future of ``restore_disk_in_place``, restoring the disk
    already (taken instead, unless the disk is to be restored again).
    ``last_restore_phases`` says how long each took."""
    phases = box.last_restore_phases = {}
    image = box.machine.memory_image

    # A standby or a spare is rewritten only where its extent map differs
    # from the checkpoint's, with no dirty RAM of a dead guest to write
    # back first; its lineage alone is never trusted (see
    # blockdiff.vm.integrity). ``again``: QEMU ran on the image meanwhile.
    def restore_memory(again: bool = False) -> None:
        began = time.monotonic()
        # A standby this restore brought to the checkpoint (Standby.bring)
        # is there already, compared.
        if (box.memory_source != "standby" or again
            or box.store.lineage(image) != (memory_snap.id, "clean")):
            box.store.restore(memory_snap.id, image)
        phases["memory"] = time.monotonic() - began

    def restore_disk(written, again: bool = False) -> str:
        if disk_ahead is not None:
            mark, phases["disk"] = disk_ahead.result()
            if not again:
                return mark
        began = time.monotonic()
        if disk:
            box.store.restore(snap.id, box.disk, written=written, progress=progress)
        phases["disk"] = time.monotonic() - began
        return box.store.lineage_mark(box.disk)

    def restore(written=written, again: bool = False) -> str:
        mark = restore_disk(written, again)
        restore_memory(again)
        return mark

    if not start:
        restore()
        (box.directory / RESUME_FROM).write_text(memory_snap.id + "\n")
        return
    in_place = (holds_size(box.disk, snap.size)
                and holds_size(box.machine.memory_image, memory_snap.size))
    if in_place:
        # The memory image while QEMU starts, the disk while it loads the
        # device state and starts the guest's CPUs (the guest uses its
        # disk only once resumed).
        hot = hot_memory(box, memory_snap.id) if fresh else None
        try:
            box.machine.launch(timeout, incoming=True, meanwhile=restore_memory,
                               disk_meanwhile=lambda: restore_disk(written), hot=hot)
        except DiskUsedEarly:
            # Both again, first; what the guest wrote meanwhile is in no
            # bitmap, so both are mapped whole.
            box.machine.launch(timeout, incoming=True, hot=hot,
                               meanwhile=lambda: restore(written=None, again=True))
    else:
        box.machine.launch(timeout, incoming=True, hot=hot_memory(box, memory_snap.id),
                           mark=restore())
    reserve.own_in_background(image, box.disk)
    if not fresh:
        # For the next restore or fork, while the guest runs.
        box.standby.prepare(memory_snap.id, snap.id, then=box._start_waiting)


def hot_memory(box, memory_snapshot_id: str):
    """The parts of the memory image that the last few checkpoints up to
    this one wrote, which the guest likely writes again: their page cache
    is warmed in 4 KiB folios before it runs (see Machine.launch)."""
    with contextlib.suppress(StoreError):   # only slower checkpoints
        return box.store.recently_written(memory_snapshot_id, HOT_CHECKPOINTS,
                                          HOT_BYTES)
    return None


def memory_to_resume(box, snap: Snapshot, machine: Machine) -> Snapshot | None:
    """The memory snapshot of checkpoint ``snap`` (None for a disk-only
    one), if ``machine`` can resume it; VMError saying what to do if not."""
    memory_snap = memory_snapshot(box.store, snap, "restore its disk only")
    if memory_snap is not None:
        check_machine(box, snap, memory_snap, machine)
    return memory_snap


def check_machine(box, snap: Snapshot, memory_snap: Snapshot,
                  machine: Machine) -> None:
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
               f"fork {box.name} {snap.id} NEW), or restore its disk only (--disk-only)")
    else:
        fix = ("resume it on the machine it was taken on, or restore its disk only "
               "(--disk-only; its processes are not brought back)")
    differ = "; ".join(f"{key} {recorded.get(key)!r} (this VM: {current.get(key)!r})"
                       for key in keys)
    raise VMError(f"checkpoint {snap.id} holds the memory of another machine: {differ}; "
                  f"{fix}")


def _swap_disk(box, snap: Snapshot) -> bool | None:
    """Restore under the running guest; None if that cannot be done here
    (another size, a copy-mode store that replaces files, a mute guest),
    else whether the dirty bitmap said what to rewrite."""
    if box.store.copy_mode or os.path.getsize(box.disk) != snap.size:
        return None
    try:
        with box.machine.guest() as link:
            link.detach(timeout=box.guest_timeout)
            crash_point("restore.detached")
            with box.machine.paused(box.store.lineage_mark(box.disk)) as pause:
                crash_point("restore.swap-paused")
                box.store.restore(snap.id, box.disk, written=pause.written)
            # The bitmap that started in the pause started with the disk
            # being the snapshot (the guest wrote nothing: detached).
            box.machine.trust_tracking(pause, box.store.lineage_mark(box.disk))
            link.attach(timeout=box.guest_timeout)
    except GuestError:
        return None
    return pause.written is not None


def from_checkpoint(sandbox_class: type, store: Store | str | os.PathLike,
                    snapshot_id: str, name: str, *, start: bool = True,
                    timeout: float = DEFAULT_BOOT_TIMEOUT, disk_only: bool = False,
                    kernel: str | os.PathLike | None = None, memory_mb: int = 256,
                    cpus: int = 1, memory: bool | None = None,
                    progress: Progress = NO_PROGRESS,
                    _standby: Standby | None = None):
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
    checkpoint = (VMCheckpoint(snap, None) if disk_only
                  else VMCheckpoint.load(store, snap, "start from its disk only"))
    memory_snap = checkpoint.memory
    memory_mb = checkpoint.machine.get("memory_mb", memory_mb)
    cpus = checkpoint.machine.get("cpus", cpus)
    # With memory, the disk and the memory image are made empty at their
    # sizes, and filled in place as a restore fills them: the memory
    # image while QEMU starts, the disk while it loads the device state.
    # Registered with an intent record: the next command on a fork
    # interrupted makes it again (see blockdiff.vm.recovery).
    other = sandbox_class.create(store, name, snapshot=snap.id, kernel=kernel,
                                 memory_mb=memory_mb, cpus=cpus, memory=memory,
                                 progress=progress, _disk_later=memory_snap is not None,
                                 _intent=intents.fork_intent(snap, memory_snap, start, _standby))
    crash_point("fork.registered")
    if memory_snap is not None:
        yielding = _standby.yielding() if _standby is not None else contextlib.nullcontext()
        try:
            with yielding:
                _resume_fork(other, snap, memory_snap, _standby, start, timeout, progress)
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
    resumed = memory_snap is not None
    other.last_fork = ForkResult(snap.id, resumed, other.memory_source, other.disk_source,
                                 resumed and start and other.machine.took_waiting)
    return other


def _resume_fork(box, snap: Snapshot, memory_snap: Snapshot, standby: Standby | None,
                 start: bool, timeout: float, progress: Progress) -> None:
    """This new VM's images made from ``standby``'s spares (or a copy of
    its standby, or empty) and resumed from checkpoint ``snap`` with
    memory ``memory_snap`` (see ``from_checkpoint``)."""
    check_machine(box, snap, memory_snap, box.machine)
    reserve.ensure_room(box.directory, memory_snap.size, f"a fork of VM {box.name}")
    given = (False, False)
    if standby is not None:
        # A pair a QEMU waits on first: one just made anew may have
        # none yet.
        given = standby.give_spares(
            box.machine.memory_image, memory_snap.size, box.disk, snap.size,
            first=box.machine.forks_waiting(standby.path.parent))
    box.memory_source = _new_memory_image(box, memory_snap, standby, given[0])
    if given[1]:
        box.disk_source = "spare"
    crash_point("fork.images")
    if (box.memory_source == box.disk_source == "spare"
        and box.machine.hand_over_waiting(standby.path.parent)
        and not start):
        # The QEMU waiting on both is the launch's to take over: none
        # for a fork left stopped.
        box.machine.kill_waiting()
    with box._lock(), ThreadPoolExecutor(1) as pool:
        # A disk spare brought to the checkpoint at once, beside the
        # memory image's move and QEMU's start: the guest uses its disk
        # only once resumed.
        disk_ahead = (pool.submit(restore_disk_in_place, box, snap, None)
                      if start and box.disk_source else None)
        resume(box, snap, memory_snap, timeout, start=start, fresh=True,
               progress=progress, disk_ahead=disk_ahead)


def _new_memory_image(box, memory_snap: Snapshot, standby: Standby | None,
                      spare: bool) -> str:
    """This new VM's memory image, at the size of ``memory_snap``: a
    memory spare of ``standby`` given already (``spare``: "spare"), or
    else a copy of the standby ("standby copy"), or else empty ("").
    See blockdiff.vm.standby."""
    image, size = box.machine.memory_image, memory_snap.size
    if spare:
        return "spare"
    empty_file(image, size, 0o600)   # guest RAM
    # Before QEMU starts: a clone beside its start slowed both (in four
    # benchmark runs each way, QEMU's start and the memory's restore took
    # 100-117 ms against 169-216, medians).
    if standby is not None and standby.copy_to(image, size, memory_snap.id):
        return "standby copy"
    return ""


def holds_size(path: Path, size: int) -> bool:
    """Whether ``path`` is there, ``size`` bytes long."""
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def empty_file(path: Path, size: int, mode: int) -> None:
    """A new file of ``size`` bytes that holds none (sparse)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
