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
resumed. So while a VM runs, its memory image holds blocks of its own for
every byte (``own_blocks``: shared blocks copied, holes allocated, by
``fallocate(FALLOC_FL_UNSHARE_RANGE)``), which the guest then writes in
place whatever else fills the filesystem: that space, the RAM's size, is
the VM's reserve. Its disk is given the same where the filesystem stays
half free (``own_disk``): a sandbox disk is mostly never written, and its
whole size is a lot to hold for it.

- A boot gives the memory image its blocks before QEMU starts (a new one
  is a hole: allocating it is metadata only), and is refused if the room
  is not there.
- A checkpoint first makes sure of the room (``make_room``: the RAM's
  size and ``DISK_HEADROOM`` free, and the memory image's own blocks),
  and is refused with ``NoSpace`` before anything changed if it is short:
  the guest runs on. What it then stores shares its blocks with its
  layers: once committed (the guest's processes and filesystem still
  frozen) those blocks are copied back, a few MiB for a small step. The
  next checkpoint finds those pages at other blocks than its parent's; the
  memory's compares their bytes (``only_changed_pages``), the disk's
  knows what the guest wrote from QEMU's dirty bitmap, so neither stores
  more than before.
- A restore or a fork needs the same room first (``ensure_room``), and
  resumes the guest on images that share all their blocks: they are copied
  in the background while the guest runs (0.3-0.6 s for 256 MiB of RAM on
  this machine), the memory image first, until the VM's next operation.

What is left: another process filling the filesystem within the moments
between a check and the copy can take room the guest needed (the next
checkpoint then finds the memory image short, and is refused); a disk
without its own blocks (a filesystem more than half full) stops the VM on a write that
finds the filesystem full (QEMU's ``werror=enospc``) rather than kill it;
and a guest that discards disk blocks (TRIM) gives their room back to the
filesystem.
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
PIECE = 16 * MiB   # copied at a time (see _not_owned)
WHAT_TO_DO = ("free some space (blockdiff gc or blockdiff rm, or other files on that "
              "filesystem) and retry")


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still allocate on ``path``'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def ensure_room(path: Path, ram_bytes: int, doing: str) -> None:
    """``NoSpace`` unless the filesystem of ``path`` (a VM's directory) has
    the room a VM with ``ram_bytes`` of RAM needs to run on after ``doing``
    (its RAM and ``DISK_HEADROOM``). The copy of that VM's files in the
    background, if one is under way, is stopped first: ``doing`` is about
    to change them."""
    _stop_owning(path)
    needed = ram_bytes + DISK_HEADROOM
    free = free_bytes(path)
    if free < needed:
        raise NoSpace(f"no space left on {path} for {doing}: {free // MiB} MiB free, "
                      f"{-(-needed // MiB)} MiB needed (the VM's RAM and a disk headroom); "
                      f"nothing was changed and a running VM runs on; {WHAT_TO_DO}")


def make_room(image: Path, ram_bytes: int, doing: str) -> None:
    """Before a checkpoint of a running VM whose memory image is ``image``:
    the room it needs (``ensure_room``), and the image's own blocks (those
    a restore's or a checkpoint's copy could not give it); ``NoSpace``
    before anything changed if either is short."""
    ensure_room(image.parent, ram_bytes, doing)
    own_blocks((image,), doing)


def own_vm_files(image: Path, disk: Path, stop: threading.Event | None = None) -> None:
    """Give a running VM's memory image, then its disk, blocks of their own
    for every byte, leaving what they could not be given (see
    ``own_blocks``; the disk as ``own_disk``)."""
    own_blocks((image,), None, stop)
    own_disk(image, disk, stop)


def own_disk(image: Path, disk: Path, stop: threading.Event | None = None) -> None:
    """Give the disk of the VM whose memory image is ``image`` blocks of its
    own for every byte, where that leaves the room its next checkpoint
    needs (``ensure_room``) and, unless the disk holds its own blocks but
    for what a checkpoint shared (less than ``DISK_HEADROOM``), half the
    filesystem free: a sandbox disk is mostly never written, and holding
    its whole size for every VM would fill the store."""
    try:
        fd = os.open(disk, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        wanted = sum(length for _, length in _not_owned(fd, disk))
    finally:
        os.close(fd)
    st = os.statvfs(disk.parent)
    spare = free_bytes(disk.parent) - wanted
    half = st.f_blocks * st.f_frsize // 2 if wanted >= DISK_HEADROOM else 0
    if spare >= max(_size(image) + DISK_HEADROOM, half):
        own_blocks((disk,), None, stop)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def own_blocks(paths, doing: str | None, stop: threading.Event | None = None) -> None:
    """Give each file in ``paths`` (a VM's memory image, its disk) blocks of
    its own for every byte (see the module's docstring); ``NoSpace`` if the
    filesystem has not the room for ``doing``, or with ``doing`` None, the
    files left sharing what they could not be given (the next ``make_room``
    asks again). ``stop``: set, it stops between two pieces (a file renamed
    away, by a restore's swap, is left at once). A filesystem without
    reflink shares no blocks, and is left as it is."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue    # a VM whose RAM is not a file
        try:
            inode = os.fstat(fd).st_ino
            for offset, length in _not_owned(fd, path):
                if stop is not None and (stop.is_set() or os.stat(path).st_ino != inode):
                    return
                native.unshare_range(fd, offset, length, path)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOENT):
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
    blocks or hold none, in pieces of at most ``PIECE`` bytes: XFS reserves
    room for a whole range given at once, allocated or not, and holds the
    file's locks while it copies one."""
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
    return [(at, min(PIECE, offset + length - at)) for offset, length in merged
            for at in range(offset, offset + length, PIECE)]


# The copy in the background of each VM's files (by its directory), which
# the next operation on the VM stops before it changes them.
_owning: dict[str, tuple[threading.Event, threading.Thread]] = {}
_owning_lock = threading.Lock()


def own_in_background(image: Path, disk: Path) -> None:
    """``own_vm_files`` in a thread of its own, while the files' guest runs
    (after a restore or a fork), until the VM's next operation (see
    ``ensure_room``). Not a daemon: a process that exits waits for it."""
    directory = os.path.abspath(image.parent)
    _stop_owning(directory)
    stop = threading.Event()

    def run() -> None:
        with contextlib.suppress(Exception):   # a thread must not print
            own_vm_files(image, disk, stop)

    thread = threading.Thread(target=run, name="own blocks")
    with _owning_lock:
        _owning[directory] = stop, thread
    thread.start()


def _stop_owning(directory) -> None:
    with _owning_lock:
        owner = _owning.pop(os.path.abspath(directory), None)
    if owner is not None:
        owner[0].set()
        owner[1].join()


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
