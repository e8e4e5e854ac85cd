"""Conversations with QEMU over QMP that no one machine's state is part of:
migration capabilities and waits, and the dirty bitmaps of the disk read
through QEMU's NBD server (see blockdiff.vm.machine for the protocol)."""

from __future__ import annotations

import contextlib
import os
import socket
import time

import numpy as np

from blockdiff.errors import VMError
from blockdiff.vm.guestlink import connect_unix
from blockdiff.vm.nbd import dirty_ranges
from blockdiff.vm.qemu import DISK_NODE, QMP

NBD_SOCKET = "nbd.sock"
BITMAP_PREFIX = "blockdiff-"
# ``(offsets, lengths)`` of the byte ranges the guest wrote, as the store takes them.
Written = tuple[np.ndarray, np.ndarray]


def set_ignore_shared(q: QMP) -> None:
    """Keep shared RAM (the memory image) out of migration streams: they hold
    only the device state, and the RAM stays in the file."""
    q.command("migrate-set-capabilities",
              capabilities=[{"capability": "x-ignore-shared", "state": True}])


def wait_for_migration(q: QMP, timeout: float, what: str) -> None:
    """Until the migration QEMU runs (either way) completes; VMError saying
    why if it fails."""
    # Polled, not awaited as an event: a query costs about 0.2 ms, and the
    # device state takes a few milliseconds, all of them inside the pause.
    deadline = time.monotonic() + timeout
    while True:
        info = q.command("query-migrate")
        status = info.get("status")
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise VMError(f"QEMU failed {what}: {info.get('error-desc', status)}")
        if time.monotonic() > deadline:
            raise VMError(f"QEMU did not finish {what} within {timeout:.0f} s")
        time.sleep(0.0003)


def wait_while_run_state(q: QMP, state: str, timeout: float, what: str) -> None:
    """Until QEMU's run state (``query-status``) is no longer ``state``;
    VMError if it still is after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while q.command("query-status").get("status") == state:
        if time.monotonic() > deadline:
            raise VMError(f"QEMU did not finish {what} within {timeout:.0f} s")
        time.sleep(0.0003)


# ---------------------------------------------------------- dirty bitmaps


def _bitmap_name() -> str:
    return f"{BITMAP_PREFIX}{os.urandom(6).hex()}"


def start_dirty_tracking(q: QMP, dir_fd: int) -> str:
    """Start the NBD server and a dirty bitmap of 4 KiB granularity; returns
    the bitmap's name."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(NBD_SOCKET, dir_fd=dir_fd)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"/proc/self/fd/{dir_fd}/{NBD_SOCKET}")
        listener.listen(4)
        q.pass_fd("nbd", listener.fileno())
    finally:
        listener.close()
    q.command("nbd-server-start", addr={"type": "fd", "data": {"str": "nbd"}})
    bitmap = _bitmap_name()
    q.command("block-dirty-bitmap-add", node=DISK_NODE, name=bitmap, granularity=4096)
    return bitmap


def replace_dirty_bitmap(q: QMP, bitmap: str) -> str:
    """Atomically start a new bitmap and freeze ``bitmap``; returns the new
    one's name. With the VM paused, the old one then says what was written
    up to now and the new one what is written from now on."""
    new = _bitmap_name()
    q.command("transaction", actions=[
        {"type": "block-dirty-bitmap-add",
         "data": {"node": DISK_NODE, "name": new, "granularity": 4096}},
        {"type": "block-dirty-bitmap-disable", "data": {"node": DISK_NODE, "name": bitmap}}])
    return new


def read_dirty_bitmap(q: QMP, dir_fd: int, bitmap: str, *, timeout: float = 10.0) -> Written:
    """``(offsets, lengths)`` of the blocks a frozen bitmap marks, read over a
    read-only NBD export made for the purpose (and left for
    ``drop_dirty_bitmaps``, which need not run while the VM is paused)."""
    q.command("block-export-add", type="nbd", id=bitmap, name=bitmap, writable=False,
              bitmaps=[bitmap], **{"node-name": DISK_NODE})
    return dirty_ranges(connect_unix(NBD_SOCKET, dir_fd), bitmap, bitmap, timeout=timeout)


def drop_dirty_bitmaps(q: QMP, keep: str) -> None:
    """Remove blockdiff's bitmaps other than ``keep``, and their exports. QEMU
    lets go of an export in the background, so a bitmap that is still
    exported stays until the next call."""
    for node in q.command("query-named-block-nodes", flat=True):
        if node.get("node-name") != DISK_NODE:
            continue
        for bitmap in node.get("dirty-bitmaps", []):
            name = bitmap.get("name", "")
            if name.startswith(BITMAP_PREFIX) and name != keep:
                with contextlib.suppress(VMError):
                    q.command("block-export-del", id=name, mode="hard")
                with contextlib.suppress(VMError):
                    q.command("block-dirty-bitmap-remove", node=DISK_NODE, name=name)
