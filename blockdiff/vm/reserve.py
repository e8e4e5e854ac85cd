"""Room for a running VM on the store's filesystem, so that a full
filesystem refuses what the store would write there, and never kills or
stops the guest.

A VM's memory image and disk live on the store's filesystem and share
blocks with the layers of their checkpoints: that is how a checkpoint finds
what changed (by extent), and how a restore brings a VM back in
milliseconds (by reflink). A page the guest dirties in a shared block, or
in a hole, needs a new block. QEMU maps the memory image, so where the
filesystem has none the write faults and QEMU dies of SIGBUS; a disk write
that finds none stops the VM (QEMU's ``werror=enospc``) until it is
resumed. So while a VM runs, its memory image and its disk hold blocks of
their own for every byte (``own_blocks``: shared blocks copied, holes
allocated, by ``fallocate(FALLOC_FL_UNSHARE_RANGE)``), which the guest then
writes in place whatever else fills the filesystem: that space is the
VM's reserve (its RAM and its disk's size).

- A boot gives both their blocks before QEMU starts (a new memory image
  is a hole: allocating it is metadata only), and is refused if the room
  is not there.
- A checkpoint first makes sure of the room (``make_room``: the RAM's
  size and ``DISK_HEADROOM`` free, and the files' own blocks), and is
  refused with ``NoSpace`` before anything changed if it is short: the
  guest runs on. What it then stores shares its blocks with its layers:
  once committed (the guest's processes and filesystem still frozen)
  those blocks are copied back, a few MiB for a small step. The next
  checkpoint finds those pages at other blocks than its parent's; the
  memory's compares their bytes (``only_changed_pages``), the disk's
  knows what the guest wrote from QEMU's dirty bitmap, so neither stores
  more than before.
- A restore or a fork needs the same room first (``ensure_room``), and
  resumes the guest on images that share all their blocks: they are copied
  in the background while the guest runs (0.3-0.6 s for 256 MiB of RAM on
  this machine).

What is left: another process filling the filesystem within the moments
between a check and the copy can take room the guest needed (the next
checkpoint then finds the files short, and is refused); and a guest that
discards disk blocks (TRIM) gives their room back to the filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path

import numpy as np

from blockdiff import native
from blockdiff.engine.extents import ExtentMap
from blockdiff.errors import NoSpace

MiB = 1 << 20
# Room kept for what a running guest writes to its disk beyond its RAM.
DISK_HEADROOM = 64 * MiB
WHAT_TO_DO = ("free some space (blockdiff gc or blockdiff rm, or other files on that "
              "filesystem) and retry")


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still allocate on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ensure_room(path: Path, ram_bytes: int, doing: str) -> None:
    """``NoSpace`` unless ``path``'s filesystem has the room a VM with
    ``ram_bytes`` of RAM needs to run on after ``doing`` (its RAM and
    ``DISK_HEADROOM``)."""
    needed = ram_bytes + DISK_HEADROOM
    free = free_bytes(path)
    if free < needed:
        raise NoSpace(f"no space left on {path} for {doing}: {free // MiB} MiB free, "
                      f"{-(-needed // MiB)} MiB needed (the VM's RAM and a disk headroom); "
                      f"nothing was changed and a running VM runs on; {WHAT_TO_DO}")


def make_room(paths, ram_bytes: int, doing: str) -> None:
    """Before a checkpoint of a running VM whose files are ``paths``: the
    room it needs (``ensure_room``), and the files' own blocks (those a
    restore's or a checkpoint's copy in the background could not give
    them); ``NoSpace`` before anything changed if either is short."""
    ensure_room(Path(paths[0]).parent, ram_bytes, doing)
    own_blocks(paths, doing)


def own_blocks(paths, doing: str | None) -> None:
    """Give each file in ``paths`` (a VM's memory image, its disk) blocks of
    its own for every byte (see the module's docstring); ``NoSpace`` if the
    filesystem has not the room for ``doing``, or with ``doing`` None, the
    files left sharing what they could not be given (the next ``make_room``
    asks again). A filesystem without reflink shares no blocks, and is left
    as it is."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue    # a VM whose RAM is not a file
        try:
            for offset, length in _not_owned(fd, path):
                native.unshare_range(fd, offset, length, path)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                continue
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                if doing is None:
                    continue
                raise NoSpace(f"no space left on {Path(path).parent} for {doing}: "
                              f"{Path(path).name} needs blocks of its own; "
                              f"{WHAT_TO_DO}") from None
            raise
        finally:
            os.close(fd)


def _not_owned(fd: int, path) -> list[tuple[int, int]]:
    """``(offset, length)`` of the ranges of an open file that share their
    blocks or hold none: each is given its own separately, as XFS reserves
    room for a whole range given at once, allocated or not."""
    emap = ExtentMap.of_file(fd, path)   # after a sync: what writeback left
    size = emap.size
    start = emap.logical.astype(np.int64)
    end = np.minimum(start + emap.length.astype(np.int64), size)
    shared = (emap.flags & native.EXTENT_SHARED) != 0
    ranges = [(int(a), int(b - a)) for a, b in zip(start[shared], end[shared])]
    # The holes: before each extent, and after the last.
    edges = np.concatenate(([0], end))
    starts = np.concatenate((start, [size]))
    ranges += [(int(a), int(b - a)) for a, b in zip(edges, starts) if b > a]
    merged: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):      # one call for ranges that touch
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        else:
            merged.append((offset, length))
    return merged


def own_in_background(paths) -> threading.Thread:
    """``own_blocks`` (leaving what it could not give) in a thread of its
    own, while the files' guest runs (after a restore or a fork). Not a
    daemon: a process that exits waits for it."""
    def run() -> None:
        with contextlib.suppress(OSError):   # a thread must not print
            own_blocks(paths, None)

    thread = threading.Thread(target=run, name="own blocks")
    thread.start()
    return thread


def note_ran(marker: Path, checkpoint_note: Path) -> None:
    """Record that a command ran in the guest (``marker`` touched), which
    ``skip_unchanged`` must see: where the filesystem has no room for the
    marker, the note of the last checkpoint goes instead (removing a file
    needs none), which that also sees. A command runs either way."""
    try:
        marker.touch()
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        checkpoint_note.unlink(missing_ok=True)
