"""Real filesystems for tests, plus read-only inspection helpers.

Making and tearing down filesystems lives in `blockdiff.demo.scratch` (the demo and
the benchmarks use it too). The helpers here (FIEMAP, SEEK_DATA/SEEK_HOLE,
mount table lookups) are written independently of the package under test so
that tests can check on-disk layout with their own eyes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
from typing import NamedTuple

from blockdiff.demo.scratch import (  # noqa: F401
    KINDS,
    MKFS,
    MOUNT_PREFIX,
    REFLINK_KINDS,
    SKIP_ENV,
    cleanup_stale_mounts,
    default_tmp_dir,
    filesystem_unavailable_reason,
    mounted_filesystem,
)

# ioctl numbers from <linux/fs.h>; identical on all Linux architectures we run on.
FICLONE = 0x40049409
FS_IOC_FIEMAP = 0xC020660B

FIEMAP_FLAG_SYNC = 0x1

FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_ENCODED = 0x8
FIEMAP_EXTENT_NOT_ALIGNED = 0x100
FIEMAP_EXTENT_DATA_INLINE = 0x200
FIEMAP_EXTENT_UNWRITTEN = 0x800
FIEMAP_EXTENT_SHARED = 0x2000


def mount_table() -> list[tuple[str, str, str]]:
    """(source, mount point, fs type) for every mount in this namespace."""
    def unescape(field: str) -> str:
        # /proc/self/mounts escapes space, tab, newline and backslash as \ooo.
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)

    with open("/proc/self/mounts") as f:
        return [tuple(unescape(x) for x in line.split()[:3]) for line in f]


def filesystem_type(path: str | os.PathLike) -> str:
    """Type of the filesystem holding `path` (e.g. "xfs"), from the mount table."""
    target = os.path.realpath(path)
    best, best_type = "", ""
    for _, mountpoint, fstype in mount_table():
        inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= len(best):
            best, best_type = mountpoint, fstype
    return best_type


class Extent(NamedTuple):
    """One FIEMAP extent; offsets and length in bytes."""

    logical: int
    physical: int
    length: int
    flags: int


_FIEMAP_HEADER = struct.Struct("=QQIIII")  # struct fiemap without the array
_FIEMAP_EXTENT = struct.Struct("=QQQ2QI3I")  # struct fiemap_extent


def fiemap(path: str | os.PathLike, sync: bool = True) -> list[Extent]:
    """The file's extent map via FS_IOC_FIEMAP.

    With `sync` the kernel flushes dirty data first (FIEMAP_FLAG_SYNC);
    without it, freshly written data on XFS/btrfs shows up as
    DELALLOC|UNKNOWN extents with physical 0.  Raises OSError (EOPNOTSUPP)
    on filesystems without FIEMAP, such as tmpfs.
    """
    batch = 256
    extents: list[Extent] = []
    start = 0
    with open(path, "rb") as f:
        while True:
            buf = bytearray(_FIEMAP_HEADER.size + batch * _FIEMAP_EXTENT.size)
            _FIEMAP_HEADER.pack_into(buf, 0, start, 0xFFFFFFFFFFFFFFFF - start,
                                     FIEMAP_FLAG_SYNC if sync else 0, 0, batch, 0)
            fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf, True)
            mapped = _FIEMAP_HEADER.unpack_from(buf, 0)[3]
            if mapped == 0:
                return extents
            for i in range(mapped):
                offset = _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size
                fields = _FIEMAP_EXTENT.unpack_from(buf, offset)
                extents.append(Extent(fields[0], fields[1], fields[2], fields[5]))
            last = extents[-1]
            if last.flags & FIEMAP_EXTENT_LAST:
                return extents
            start = last.logical + last.length


def data_ranges(path: str | os.PathLike) -> list[tuple[int, int]]:
    """Half-open (start, end) byte ranges that SEEK_DATA/SEEK_HOLE report as data.

    Unwritten (preallocated) extents count as holes on XFS, btrfs and ext4,
    except that XFS and ext4 report them as data once their pages are in the
    page cache (e.g. after the range has been read).  Use `fiemap` for an
    exact answer.
    """
    ranges = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after pos
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            ranges.append((start, end))
            pos = end
    finally:
        os.close(fd)
    return ranges


def fill(directory, name: str = "filler"):
    """Write a file in ``directory`` until its filesystem has no block left;
    returns the file's path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (1 << 20, 4096):       # big writes, then the last few blocks
            try:
                while True:
                    os.write(fd, b"\xff" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return path
