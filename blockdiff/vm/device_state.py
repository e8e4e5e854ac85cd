"""The memory image of a whole-VM checkpoint: the RAM, and the device state behind it.

The memory image's first bytes are the guest's RAM; the ``DEVICE_STATE_AREA``
after them holds QEMU's migration stream without RAM (``x-ignore-shared``,
about 400 KB) of the last checkpoint. It is saved while the VM is paused,
into a file in memory (on the memory image, its writeback would be in the
pause), and written into the area once the VM runs again (QEMU never maps
the area); a launch with ``incoming`` loads it back from there.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from blockdiff import native
from blockdiff.errors import VMError
from blockdiff.vm.qemu import QMP
from blockdiff.vm.qmp_talk import Written, wait_for_migration, wait_while_run_state
from blockdiff.vm.registry import VMEntry

MEMORY_IMAGE = "memory.img"
MiB = 1 << 20
# Behind the RAM in the memory image, for the device state (sparse: only
# what a checkpoint wrote takes space).
DEVICE_STATE_AREA = 16 * MiB
DEVICE_STATE_FD = "blockdiff-device-state"


def open_memory_image(vm: VMEntry, fresh: bool) -> int:
    """An open descriptor of VM ``vm``'s memory image, at its size (its RAM
    and the device-state area). A boot (``fresh``) keeps what an earlier run
    left in it: the guest overwrites what it uses, and the next checkpoint
    then stores only what differs from the image's last snapshot."""
    size = vm.memory_mb * MiB + DEVICE_STATE_AREA
    fd = os.open(vm.directory / MEMORY_IMAGE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        current = os.fstat(fd).st_size
        if current != size:
            if not fresh:
                raise VMError(f"the memory image of VM {vm.name} holds {current} "
                              f"bytes, not the {size} of its {vm.memory_mb} MiB; "
                              f"restore its checkpoint again")
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def area(ram_bytes: int) -> Written:
    """``(offsets, lengths)`` of the device-state area of a memory image
    behind ``ram_bytes`` of RAM."""
    return (np.array([ram_bytes], np.uint64), np.array([DEVICE_STATE_AREA], np.uint64))


def start_saving(q: QMP) -> int:
    """With the VM paused: have QEMU start to save its migration stream,
    which with ``x-ignore-shared`` holds no RAM, into a file in memory.
    Returns that file's descriptor, for :func:`saved`."""
    fd = os.memfd_create(DEVICE_STATE_FD, os.MFD_CLOEXEC)
    try:
        q.pass_fd(DEVICE_STATE_FD, fd)
        q.command("migrate", uri=f"fd:{DEVICE_STATE_FD}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def saved(q: QMP, fd: int, vm_name: str) -> bytes:
    """The device state :func:`start_saving` is saving into ``fd`` (of VM
    ``vm_name``), once QEMU is done; the descriptor is closed."""
    try:
        wait_for_migration(q, 60.0, "saving the device state")
        # QEMU says "completed" a moment before it leaves the
        # finish-migrate state, in which it refuses ``cont`` ("Migration
        # is not finalized yet"): seen on a busy host, the migration
        # thread waiting for the main loop's lock in between.
        wait_while_run_state(q, "finish-migrate", 10.0, "saving the device state")
        # QEMU wrote through a duplicate of this descriptor: one offset.
        length = os.lseek(fd, 0, os.SEEK_CUR)
        if length > DEVICE_STATE_AREA:
            raise VMError(f"the device state of VM {vm_name} ({length} bytes) does "
                          f"not fit the {DEVICE_STATE_AREA} bytes kept for it behind "
                          f"its RAM")
        return os.pread(fd, length, 0)
    finally:
        os.close(fd)


def write(memory_image: Path, ram_bytes: int, state: bytes) -> None:
    """The device state into the memory image's device-state area, the
    rest of the area cleared."""
    fd = os.open(memory_image, os.O_RDWR | os.O_CLOEXEC)
    try:
        native.zero_ranges(fd, *area(ram_bytes), memory_image)
        done = 0
        while done < len(state):
            done += os.pwrite(fd, state[done:], ram_bytes + done)
    finally:
        os.close(fd)


def load(q: QMP, memory_image: Path, ram_bytes: int, timeout: float) -> None:
    """Have a QEMU started with ``-incoming defer`` load the device state
    from the memory image's device-state area, and wait until it has."""
    fd = os.open(memory_image, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.lseek(fd, ram_bytes, os.SEEK_SET)
        q.pass_fd(DEVICE_STATE_FD, fd)
    finally:
        os.close(fd)
    q.command("migrate-incoming", uri=f"fd:{DEVICE_STATE_FD}")
    wait_for_migration(q, timeout, "loading the checkpoint's device state")
