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
disk snapshot names (see :class:`~blockdiff.vm.checkpoint.VMCheckpoint`). The
VM is paused only to capture what RAM changed since a capture taken just
before. :meth:`Sandbox.restore` and :meth:`Sandbox.fork` of such a
checkpoint then bring the VM back running,
its processes where they were, without a boot (``disk_only`` keeps the disk
swap). The memory snapshot records the machine it can be resumed on
(``vm.machine``); any other is refused.

``Sandbox`` is the front door: it holds what the operations share (the
store, the registry entry, the machine, the standby, the lock) and hands
each operation to the module that holds it:

    checkpoint   checkpoint, the checkpoint type (disk and memory snapshots)
    restore      restore, fork and from_checkpoint, resuming a checkpoint's memory
    recovery     finishing or undoing an interrupted operation, and status

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
import os
from pathlib import Path

from blockdiff.engine.files import copy_file
from blockdiff.errors import UsageError
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.store import Store, as_store
from blockdiff.vm import checkpoint as vm_checkpoint
from blockdiff.vm import intents, recovery, reserve
from blockdiff.vm import restore as vm_restore
from blockdiff.vm.checkpoint import LAST_CHECKPOINT, RAN, CheckpointTiming
from blockdiff.vm.checkpoint import MEMORY_KEY as MEMORY_KEY  # re-exported for callers
from blockdiff.vm.guestlink import ExecResult
from blockdiff.vm.intents import FORK, START
from blockdiff.vm.machine import DEFAULT_BOOT_TIMEOUT, Machine, fork_waiting
from blockdiff.vm.recovery import VMStatus
from blockdiff.vm.registry import Registry, check_name
from blockdiff.vm.restore import RESUME_FROM, ForkResult, RestoreTiming, empty_file
from blockdiff.vm.standby import Standby

LOCK = intents.LOCK


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
        self.last_fork: ForkResult | None = None   # of a VM made from a checkpoint
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
                empty_file(disk, snap.size, 0o666)   # as a fork's, less the umask
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
        return recovery.status(self)

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
                                        hot=vm_restore.hot_memory(self, marker.read_text().strip()))
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
            vm_checkpoint.commit_memory_base(self)



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
        """Snapshot the disk into the store, and with ``memory`` (default: the
        VM's ``memory_checkpoints``) the VM's RAM and device state as its
        memory snapshot; returns the disk snapshot's id. With
        ``skip_unchanged``, an unchanged VM gives its last snapshot's id. See
        :func:`blockdiff.vm.checkpoint.checkpoint`; ``last_checkpoint`` says
        how it went."""
        return vm_checkpoint.checkpoint(self, message, meta, ttl, skip_unchanged, memory)

    def restore(self, snapshot_id: str, *, timeout: float = DEFAULT_BOOT_TIMEOUT,
                disk_only: bool = False) -> RestoreTiming:
        """Put the VM back to a checkpoint: one with memory (unless
        ``disk_only``) brings it back running, its processes where they were;
        otherwise its disk is made the snapshot's, under a running guest (or
        with a reboot), and a stopped VM stays stopped. See
        :func:`blockdiff.vm.restore.restore`; also ``last_restore``."""
        return vm_restore.restore(self, snapshot_id, timeout=timeout, disk_only=disk_only)

    def fork(self, snapshot_id: str, new_name: str, *, start: bool = True,
             timeout: float = DEFAULT_BOOT_TIMEOUT, disk_only: bool = False,
             progress: Progress = NO_PROGRESS) -> "Sandbox":
        """A new VM, like this one, whose disk is a fork of ``snapshot_id``
        (the fork's check and the boot go to ``progress``). From a checkpoint
        with memory (unless ``disk_only``), it takes that checkpoint's memory
        size and CPUs and resumes from its memory instead of booting, its
        processes running on independently of this VM's, with a clock and a
        random-number state of its own; stopped (``start`` False), it resumes
        when started. The new VM's ``last_fork`` says how it was made."""
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
        if need be); ``memory_mb`` and ``cpus`` unless the checkpoint's
        memory says. See :func:`blockdiff.vm.restore.from_checkpoint`."""
        return vm_restore.from_checkpoint(cls, store, snapshot_id, name, start=start,
                                          timeout=timeout, disk_only=disk_only, kernel=kernel,
                                          memory_mb=memory_mb, cpus=cpus, memory=memory,
                                          progress=progress, _standby=_standby)
