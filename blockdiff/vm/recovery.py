"""The next command on a VM finishes, or undoes, what an interrupted one left.

Every operation that leaves a VM in between states records its intent
first (:mod:`blockdiff.vm.intents`). Each command that takes the VM's lock
(:meth:`Sandbox._lock`) calls :func:`recover` before it does anything else;
under the lock no other operation of the VM is under way, so a record there
is of one that was killed (or failed) half-way:

- **checkpoint**: the VM may be paused and its guest frozen: it is resumed
  and thawed (the guest also thaws by itself after 60 s).
- **restore**: every QEMU of the VM is killed (one paused for the restore,
  one started for it and never resumed, one waiting in ``inmigrate``), and
  the restore is done again from the store, where all of the checkpoint is:
  rolled forward. A command that replaces the VM's state (another restore)
  or removes it only kills; ``stop`` leaves it stopped at the checkpoint,
  to be resumed by ``start``.
- **fork**: the new VM's images may be empty, or spares half-moved, and its
  QEMU may wait in ``inmigrate`` forever: every QEMU of it is killed, and
  the fork made again from the checkpoint (rolled forward), resumed if it
  was to be. If the checkpoint is gone from the store, it cannot be: the VM
  is reported incomplete, and ``vm rm`` removes it.
- **start**: a QEMU booting or resuming for a start that is gone is killed;
  the VM is stopped, as before the start (a stopped fork still resumes from
  its checkpoint when started again).

:func:`state` says what a VM is, for ``vm ls``: from the record and from
QEMU itself (``query-status``, bounded), never from a pid file alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from dataclasses import dataclass

from blockdiff.errors import StoreError, UnknownSnapshot, UnknownVM, VMError
from blockdiff.vm import intents, restore
from blockdiff.vm.checkpoint import memory_of
from blockdiff.vm.intents import (
    CHECKPOINT,
    CREATE,
    FORK,
    REMOVE,
    REPLACE,
    RESTORE,
    START,
    STOP,
    USE,
    Intent,
)
from blockdiff.vm.machine import DEFAULT_BOOT_TIMEOUT, WAITING_FORK, Machine
from blockdiff.vm.qemu import QMP, QMP_SOCKET
from blockdiff.vm.registry import Registry

# Seconds QEMU has to answer ``query-status`` for ``vm ls``.
STATUS_TIMEOUT = 5.0
# What ``vm ls`` says of an operation whose writer runs, and of one whose
# writer is gone (the next command on the VM finishes or undoes it).
UNDER_WAY = {CHECKPOINT: "checkpointing", RESTORE: "restoring", FORK: "forking",
             START: "starting", CREATE: "being created"}
INTERRUPTED = {CHECKPOINT: "checkpoint interrupted", RESTORE: "restore interrupted",
               FORK: "fork incomplete", START: "start interrupted",
               CREATE: "creation interrupted"}


@dataclass(frozen=True)
class VMStatus:
    """What ``vm ls`` shows of a VM."""

    name: str
    running: bool                   # the guest runs (``state`` is "running")
    pid: int | None
    snapshot: str | None
    accel: str | None
    memory: bool = False            # the VM's checkpoints hold its memory
    snapshot_memory: bool = False   # the snapshot it descends from holds memory
    state: str = "stopped"          # see state()
    qemu: str | None = None         # QEMU's own run state


def recover(box, purpose: str = USE) -> None:
    """Finish or undo the operation an earlier command left on VM ``box``
    (a :class:`~blockdiff.vm.sandbox.Sandbox`, its lock held), as the
    module's docstring says; ``purpose`` is what the caller does next."""
    intent = intents.read(box.directory)
    if intent is None:
        return
    # Any other operation wrote its record under the lock, so it is over
    # (killed, or failed, in this process or another); a fork takes the
    # new VM's lock only once it is registered.
    if intent.op == FORK and intent.mine():
        return
    if intent.op == FORK and intent.writer_alive() and purpose != REMOVE:
        raise VMError(f"VM {box.name} is being forked by process {intent.pid}; wait for it "
                      f"to finish (or remove the VM: blockdiff vm rm {box.name})")
    if intent.op == CHECKPOINT:
        _finish_checkpoint(box, purpose)
    elif intent.op == RESTORE:
        _finish_restore(box, intent, purpose)
    elif intent.op == FORK:
        _finish_fork(box, intent, purpose)
    else:
        # A start (or an operation not ours): stopped is what it was before.
        if intent.op != CREATE:
            box._kill()
        intents.clear(box.directory)


def _finish_checkpoint(box, purpose: str) -> None:
    """A checkpoint whose process died may have left the VM paused and its
    filesystem frozen; the store's commit is atomic, so nothing else is
    half done."""
    if purpose not in (STOP, REMOVE) and box.machine.running:
        with contextlib.suppress(VMError):
            box.machine.resume()
        with contextlib.suppress(VMError), box.machine.guest() as link:
            link.thaw(timeout=box.guest_timeout)
    intents.clear(box.directory, durable=False)


def _finish_restore(box, intent: Intent, purpose: str) -> None:
    """Kill what the restore left running, then (unless the VM is to be
    replaced or removed) restore it again: running (``USE``), or stopped at
    the checkpoint for ``start`` to resume (``STOP``)."""
    box._kill()
    if purpose in (REPLACE, REMOVE):
        intents.clear(box.directory)
        return
    snapshot = intent.args.get("snapshot")
    disk_only = bool(intent.args.get("disk_only"))
    try:
        if purpose == STOP and not disk_only:
            snap = box.store.get(snapshot)
            with intents.pending(box.directory, RESTORE, **intent.args):
                box.memory_source = ""
                restore.resume(box, snap, restore.memory_to_resume(box, snap, box.machine),
                               DEFAULT_BOOT_TIMEOUT, start=False)
        else:
            # A disk-only restore leaves the VM stopped at the snapshot's disk
            # (it was killed with the guest detached); one with memory
            # brings it back running, processes and all.
            box.restore(snapshot, disk_only=disk_only)
    except (StoreError, VMError, OSError) as e:
        raise VMError(f"VM {box.name}'s {intent.describe()} was interrupted and cannot be "
                      f"finished ({_one_line(e)}); restore another checkpoint (blockdiff vm "
                      f"restore {box.name} ID) or remove the VM (blockdiff vm rm "
                      f"{box.name})") from None


def _finish_fork(box, intent: Intent, purpose: str) -> None:
    """Kill any QEMU of the half-made fork (its own, and one of the VM it was
    forked from still waiting on the spares it took), then make it again from
    the checkpoint: resumed if it was to start and the caller uses it."""
    box._kill()
    source = intent.args.get("source")
    if source:
        with contextlib.suppress(UnknownVM, OSError):
            origin = Machine(Registry(box.store).entry(source))
            origin.kill_waiting((WAITING_FORK,), holding=box.disk)
    if purpose in (REPLACE, REMOVE):
        intents.clear(box.directory)
        return
    try:
        snap = box.store.get(intent.args["snapshot"])
        memory_snap = box.store.get(intent.args["memory"])
    except (UnknownSnapshot, KeyError):
        raise VMError(f"VM {box.name} is an incomplete fork whose checkpoint "
                      f"{intent.args.get('snapshot')} is no longer in the store; remove it "
                      f"(blockdiff vm rm {box.name})") from None
    start = purpose == USE and bool(intent.args.get("start"))
    box.memory_source = box.disk_source = ""   # neither file is trusted
    try:
        with intents.pending(box.directory, FORK, **intent.args):
            restore.resume(box, snap, memory_snap, DEFAULT_BOOT_TIMEOUT, start=start, fresh=True)
    except (StoreError, VMError, OSError) as e:
        raise VMError(f"VM {box.name} is an incomplete fork of {snap.id} that cannot be "
                      f"finished ({_one_line(e)}); remove it (blockdiff vm rm "
                      f"{box.name})") from None


def _one_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text.splitlines()[0] if text else text


# ------------------------------------------------------------ what it is


def _locked(directory) -> bool:
    """Whether a command holds the VM's lock now (probed, not waited for)."""
    try:
        fd = os.open(directory / intents.LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)   # which lets go of the probe's own hold
    return False


def qemu_run_state(directory) -> str | None:
    """QEMU's run state (``query-status``: ``running``, ``paused``,
    ``inmigrate``...), or ``unresponsive`` if it does not answer within
    ``STATUS_TIMEOUT`` seconds."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return "unresponsive"
    try:
        with QMP(QMP_SOCKET, dir_fd=fd, timeout=STATUS_TIMEOUT) as q:
            return str(q.command("query-status").get("status"))
    except (VMError, OSError, ValueError):
        return "unresponsive"
    finally:
        os.close(fd)


def status(box) -> VMStatus:
    """VM ``box``'s status: what it is, and the snapshot its disk descends
    from (and whether that one is a checkpoint with memory)."""
    snapshot, _ = box.store.lineage(box.disk)
    with_memory = False
    if snapshot is not None:
        with contextlib.suppress(UnknownSnapshot):
            with_memory = memory_of(box.store.get(snapshot).meta) is not None
    what, run_state = state(box)
    return VMStatus(box.name, what == "running", box.machine.pid, snapshot, box.machine.accel,
                    box.memory_checkpoints, with_memory, what, run_state)


def state(box) -> tuple[str, str | None]:
    """What VM ``box`` is, in a word or two, and QEMU's own run state (None
    when no QEMU of it runs): ``running``, ``stopped``, ``paused``,
    ``waiting`` (a QEMU waiting for a device state that nothing will load),
    ``unresponsive``, an operation under way (``restoring``) or interrupted,
    to be finished by the next command on the VM (``restore interrupted``,
    ``fork incomplete``)."""
    pid = box.machine.pid
    run_state = qemu_run_state(box.directory) if pid is not None else None
    intent = intents.read(box.directory)
    if intent is not None:
        # Under way while its writer holds the lock (a fork: while it runs).
        if intent.writer_alive() if intent.op == FORK else _locked(box.directory):
            return UNDER_WAY.get(intent.op, intent.op), run_state
        return INTERRUPTED.get(intent.op, "interrupted"), run_state
    if run_state is None:
        return "stopped", None
    if run_state in ("inmigrate", "prelaunch"):
        return "waiting", run_state
    if run_state in ("running", "paused", "unresponsive"):
        return run_state, run_state
    return "paused", run_state   # suspended, postmigrate, finish-migrate...

