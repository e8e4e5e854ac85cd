"""The one module that talks to the compiled core (``blockdiff._native``).

Everything above this module sees plain Python values and numpy arrays, never
cffi objects. Every failure is an ``OSError`` carrying errno and the path it
concerns.
"""

from __future__ import annotations

import errno
import os

import numpy as np

from blockdiff._native import ffi, lib
from blockdiff.progress import NO_PROGRESS, Progress

# Extent flags, from <linux/fiemap.h> through the compiler.
EXTENT_LAST = lib.FIEMAP_EXTENT_LAST
EXTENT_UNKNOWN = lib.FIEMAP_EXTENT_UNKNOWN
EXTENT_DELALLOC = lib.FIEMAP_EXTENT_DELALLOC
EXTENT_ENCODED = lib.FIEMAP_EXTENT_ENCODED
EXTENT_DATA_ENCRYPTED = lib.FIEMAP_EXTENT_DATA_ENCRYPTED
EXTENT_NOT_ALIGNED = lib.FIEMAP_EXTENT_NOT_ALIGNED
EXTENT_DATA_INLINE = lib.FIEMAP_EXTENT_DATA_INLINE
EXTENT_DATA_TAIL = lib.FIEMAP_EXTENT_DATA_TAIL
EXTENT_UNWRITTEN = lib.FIEMAP_EXTENT_UNWRITTEN
EXTENT_MERGED = lib.FIEMAP_EXTENT_MERGED
EXTENT_SHARED = lib.FIEMAP_EXTENT_SHARED

EXTENT_FLAG_NAMES = {
    EXTENT_LAST: "last",
    EXTENT_UNKNOWN: "unknown",
    EXTENT_DELALLOC: "delalloc",
    EXTENT_ENCODED: "encoded",
    EXTENT_DATA_ENCRYPTED: "encrypted",
    EXTENT_NOT_ALIGNED: "not_aligned",
    EXTENT_DATA_INLINE: "inline",
    EXTENT_DATA_TAIL: "tail",
    EXTENT_UNWRITTEN: "unwritten",
    EXTENT_MERGED: "merged",
    EXTENT_SHARED: "shared",
}

# statfs f_type values, from <linux/magic.h>.
XFS_MAGIC = lib.XFS_SUPER_MAGIC
BTRFS_MAGIC = lib.BTRFS_SUPER_MAGIC
EXT4_MAGIC = lib.EXT4_SUPER_MAGIC
TMPFS_MAGIC = lib.TMPFS_MAGIC
FS_NAMES = {XFS_MAGIC: "xfs", BTRFS_MAGIC: "btrfs", EXT4_MAGIC: "ext4", TMPFS_MAGIC: "tmpfs"}

_U64 = np.uint64
_FIRST_FIEMAP_CAPACITY = 4096
# The bytes one native call handles between two reports to a progress: a
# tenth of a second of reading or so, so that a bar moves. It is the C core's
# prefetch window (PREFETCH_WINDOW): a call starts by prefetching, so smaller
# batches would wait for the disk more often (measured: 32 MiB cost up to 10%
# on a cold cache, 64 MiB within noise).
PROGRESS_BATCH = 64 << 20


def _check(rc: int, path: str | os.PathLike) -> None:
    if rc < 0:
        errno = -rc
        raise OSError(errno, os.strerror(errno), os.fspath(path))


def _u64(array: np.ndarray):
    return ffi.from_buffer("uint64_t[]", array)


def fiemap(fd: int, end: int, path: str | os.PathLike, *, sync: bool = True):
    """The extent map of ``[0, end)`` of an open file as four arrays.

    Returns ``(logical, physical, length, flags)``: uint64, uint64, uint64,
    uint32. ``sync`` asks the kernel to flush dirty data first, so extents in
    the copy-on-write fork show their final location.
    Errors: EOPNOTSUPP/ENOTTY (no FIEMAP on this filesystem), EBADF.
    """
    capacity = _FIRST_FIEMAP_CAPACITY
    parts: list[tuple[np.ndarray, ...]] = []
    start = 0
    count = ffi.new("size_t *")
    next_start = ffi.new("uint64_t *")
    first = True
    while True:
        logical = np.empty(capacity, _U64)
        physical = np.empty(capacity, _U64)
        length = np.empty(capacity, _U64)
        flags = np.empty(capacity, np.uint32)
        rc = lib.bd_fiemap(fd, start, end, int(sync and first),
                           _u64(logical), _u64(physical), _u64(length),
                           ffi.from_buffer("uint32_t[]", flags),
                           capacity, count, next_start)
        _check(rc, path)
        n = count[0]
        parts.append((logical[:n], physical[:n], length[:n], flags[:n]))
        if next_start[0] == 0xFFFFFFFFFFFFFFFF:
            break
        start = next_start[0]
        first = False
        # Grow geometrically so a million-extent map takes a handful of calls.
        capacity = min(capacity * 8, 1 << 20)
    if len(parts) == 1:
        return parts[0]
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))


def fiemap_ranges(fd: int, starts: np.ndarray, ends: np.ndarray, path: str | os.PathLike):
    """The extent maps of sorted, disjoint intervals ``[starts, ends)`` of an
    open file (not flushed first), each clipped to its interval, as one set of
    four arrays sorted by offset. The cost follows the extents inside the
    intervals, not the file's."""
    starts = np.ascontiguousarray(starts, _U64)
    ends = np.ascontiguousarray(ends, _U64)
    count = ffi.new("size_t *")
    capacity = 4 * len(starts) + 64
    while True:
        logical = np.empty(capacity, _U64)
        physical = np.empty(capacity, _U64)
        length = np.empty(capacity, _U64)
        flags = np.empty(capacity, np.uint32)
        rc = lib.bd_fiemap_ranges(fd, _u64(starts), _u64(ends), len(starts), _u64(logical),
                                  _u64(physical), _u64(length),
                                  ffi.from_buffer("uint32_t[]", flags), capacity, count)
        if rc != -errno.ENOSPC:
            break
        capacity *= 8
    _check(rc, path)
    keep = length[:count[0]] > 0
    return logical[:count[0]][keep], physical[:count[0]][keep], length[:count[0]][keep], \
        flags[:count[0]][keep]


def clone_file(dst_fd: int, src_fd: int, path: str | os.PathLike) -> None:
    """Reflink a whole file (FICLONE).

    Errors: EXDEV (other filesystem), EOPNOTSUPP (no reflink), EINVAL.
    """
    _check(lib.bd_clone_file(dst_fd, src_fd), path)


def _batches(length: np.ndarray) -> list[tuple[int, int]]:
    """``(first, end)`` index slices of consecutive ranges holding at least
    PROGRESS_BATCH bytes each (the last one maybe fewer), covering all of them."""
    batch = PROGRESS_BATCH
    n = len(length)
    ends = np.cumsum(length, dtype=_U64)
    total = int(ends[-1]) if n else 0
    cuts = np.searchsorted(ends, np.arange(batch, total, batch, dtype=_U64), side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.minimum(cuts, n), [n]))).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _split(offset: np.ndarray, length: np.ndarray, most: int):
    """Ranges cut into pieces of at most ``most`` bytes, each cut ``most``
    bytes after the last: ``(offset, length)`` of the pieces, in order."""
    count = np.maximum((length + _U64(most - 1)) // _U64(most), 1).astype(np.int64)
    first = np.cumsum(count) - count
    step = (np.arange(int(count.sum()), dtype=np.int64) - np.repeat(first, count)).astype(_U64)
    index = np.repeat(np.arange(len(length)), count)
    cut = step * _U64(most)
    return offset[index] + cut, np.minimum(_U64(most), length[index] - cut)


def transfer_ranges(src_fd: int, dst_fd: int, src_off: np.ndarray,
                    dst_off: np.ndarray | None, length: np.ndarray,
                    path: str | os.PathLike, *, reflink: bool = True,
                    checksums: bool = False, progress: Progress | None = None):
    """Move many ranges from one file to another in one native call.

    Reflinks where the kernel allows (an unaligned range is copied instead,
    and a filesystem boundary switches to copying for the rest). With
    ``dst_fd < 0`` nothing is written and only checksums are computed.
    With ``progress``, the ranges go in batches of about PROGRESS_BATCH
    bytes (whole ranges: a range's checksum is of all of it), each advancing
    it by its bytes.
    Returns ``(crc32c array or None, number of ranges reflinked)``.
    Errors: ENODATA (source shorter than a range), ENOSPC, EIO.
    """
    if progress is not None and progress is not NO_PROGRESS:   # nobody to report to: one call
        return _transfer_in_batches(src_fd, dst_fd, src_off, dst_off, length, path,
                                    reflink=reflink, checksums=checksums, progress=progress)
    n = len(length)
    src_off = np.ascontiguousarray(src_off, _U64)
    length = np.ascontiguousarray(length, _U64)
    dst = ffi.NULL if dst_off is None else _u64(np.ascontiguousarray(dst_off, _U64))
    crcs = np.zeros(n, np.uint32) if checksums else None
    done = ffi.new("size_t *")
    cloned = ffi.new("size_t *")
    rc = lib.bd_transfer_ranges(src_fd, dst_fd, _u64(src_off), dst, _u64(length), n,
                                0 if reflink else 1,
                                ffi.NULL if crcs is None else ffi.from_buffer("uint32_t[]", crcs),
                                done, cloned)
    _check(rc, path)
    return crcs, int(cloned[0])


def _transfer_in_batches(src_fd, dst_fd, src_off, dst_off, length, path, *, reflink,
                         checksums, progress: Progress):
    """:func:`transfer_ranges` a batch at a time, reporting each to ``progress``."""
    length = np.ascontiguousarray(length, _U64)
    crcs = np.zeros(len(length), np.uint32) if checksums else None
    cloned = 0
    for first, end in _batches(length):
        part, reflinked = transfer_ranges(
            src_fd, dst_fd, src_off[first:end], None if dst_off is None else dst_off[first:end],
            length[first:end], path, reflink=reflink, checksums=checksums)
        if crcs is not None:
            crcs[first:end] = part
        cloned += reflinked
        progress.advance(int(length[first:end].sum()))
    return crcs, cloned


# The largest chunk bd_chunk_crcs takes; a chunk must divide it (its buffer).
CHUNK_CRC_MAX = 1 << 20


def chunk_crcs(fd: int, offset: np.ndarray, length: np.ndarray, chunk: int,
               path: str | os.PathLike, *, progress: Progress | None = None) -> np.ndarray:
    """The CRC32C of every ``chunk``-byte chunk of the ranges (a range's last
    chunk may be shorter), range by range, read a buffer at a time; ``chunk``
    must divide CHUNK_CRC_MAX. With ``progress``, the ranges go in batches of
    about PROGRESS_BATCH bytes (a long range cut at a chunk boundary), each
    advancing it by its bytes.
    Errors: ENODATA (the file is shorter than a range), EIO."""
    offset = np.ascontiguousarray(offset, _U64)
    length = np.ascontiguousarray(length, _U64)
    if progress is not None and progress is not NO_PROGRESS:   # nobody to report to: one call
        # PROGRESS_BATCH is a multiple of CHUNK_CRC_MAX, so of every chunk:
        # the pieces have the same chunks as their ranges.
        offset, length = _split(offset, length, PROGRESS_BATCH)
        per_piece = (length + _U64(chunk - 1)) // _U64(chunk)
        before = np.concatenate(([0], np.cumsum(per_piece))).astype(np.int64)
        crcs = np.zeros(int(before[-1]), np.uint32)
        for first, end in _batches(length):
            crcs[before[first]:before[end]] = chunk_crcs(fd, offset[first:end],
                                                         length[first:end], chunk, path)
            progress.advance(int(length[first:end].sum()))
        return crcs
    count = int(((length + _U64(chunk - 1)) // _U64(chunk)).sum()) if len(length) else 0
    crcs = np.zeros(count, np.uint32)
    _check(lib.bd_chunk_crcs(fd, _u64(offset), _u64(length), len(offset), chunk,
                             ffi.from_buffer("uint32_t[]", crcs)), path)
    return crcs


def zero_ranges(fd: int, offset: np.ndarray, length: np.ndarray, path: str | os.PathLike) -> None:
    """Make ranges read as zeros, by punching holes where possible."""
    offset = np.ascontiguousarray(offset, _U64)
    length = np.ascontiguousarray(length, _U64)
    _check(lib.bd_zero_ranges(fd, _u64(offset), _u64(length), len(offset)), path)


def copy_sparse(src_fd: int, dst_fd: int, size: int, path: str | os.PathLike) -> None:
    """Copy a file's data segments only, keeping its holes, and set the size."""
    _check(lib.bd_copy_sparse(src_fd, dst_fd, size), path)


def compare_blocks(target_fd: int, target_size: int, base_fd: int, base_size: int,
                   block: int, path: str | os.PathLike) -> np.ndarray:
    """Classify each block of the target by content: 0 same, 1 data, 2 zeros."""
    nblocks = -(-target_size // block)
    classes = np.empty(nblocks, np.uint8)
    rc = lib.bd_compare_blocks(target_fd, target_size, base_fd, base_size, block,
                               ffi.from_buffer("uint8_t[]", classes), nblocks)
    _check(rc, path)
    return classes


def read_blocks(fd: int, offsets: np.ndarray, block: int, path: str | os.PathLike) -> bytes:
    """Read ``block`` bytes at each offset, zero-filled past EOF."""
    offsets = np.ascontiguousarray(offsets, _U64)
    out = bytearray(len(offsets) * block)
    _check(lib.bd_read_blocks(fd, _u64(offsets), len(offsets), block,
                              ffi.from_buffer("uint8_t[]", out)), path)
    return bytes(out)


def dedupe_ranges(src_fd: int, dst_fd: int, src_off: np.ndarray, dst_off: np.ndarray,
                  length: np.ndarray, path: str | os.PathLike) -> np.ndarray:
    """Make each range of ``dst_fd`` share the blocks of ``src_fd``'s range
    where, under the kernel's locks, their bytes are equal (FIDEDUPERANGE;
    block-aligned ranges). Returns, per range, whether it now shares them."""
    n = len(length)
    src_off = np.ascontiguousarray(src_off, _U64)
    dst_off = np.ascontiguousarray(dst_off, _U64)
    length = np.ascontiguousarray(length, _U64)
    same = np.zeros(n, np.uint8)
    _check(lib.bd_dedupe_ranges(src_fd, dst_fd, _u64(src_off), _u64(dst_off), _u64(length), n,
                                ffi.from_buffer("uint8_t[]", same)), path)
    return same.astype(bool)


def fsync(fd: int, path: str | os.PathLike) -> None:
    """fsync, with the path in the error."""
    _check(lib.bd_fsync(fd), path)


FALLOC_FL_UNSHARE_RANGE = 0x40   # <linux/falloc.h>
_libc = None


def unshare_range(fd: int, offset: int, length: int, path: str | os.PathLike) -> None:
    """Give a file blocks of its own over a range: blocks it shares (reflinked)
    copied, holes allocated (``fallocate(FALLOC_FL_UNSHARE_RANGE)``), so that
    no later write there needs free space. ``OSError``: ENOSPC when the
    filesystem has not the room, EOPNOTSUPP where it has no reflink."""
    global _libc
    if _libc is None:
        import ctypes  # the C core has no fallocate with modes; glibc has
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                    ctypes.c_int64)
    if _libc.fallocate(fd, FALLOC_FL_UNSHARE_RANGE, offset, length) != 0:
        import ctypes
        number = ctypes.get_errno()
        raise OSError(number, os.strerror(number), os.fspath(path))


def write_out(fd: int, path: str | os.PathLike, offset: int = 0, length: int = 0) -> None:
    """Write a file's dirty pages out and wait until they are: on XFS its
    extent map is then final (a copy-on-write is remapped before the page
    counts as written), without fsync's log force. Not durable by itself.
    ``offset``, ``length``: only that range (a length of 0: to the end)."""
    _check(lib.bd_write_out(fd, offset, length), path)


def truncate(fd: int, size: int, path: str | os.PathLike) -> None:
    """ftruncate, with the path in the error."""
    _check(lib.bd_truncate(fd, size), path)


def fs_info(fd: int, path: str | os.PathLike) -> tuple[int, int, int]:
    """``(statfs f_type, block size, st_dev)`` of an open file."""
    fs_type = ffi.new("int64_t *")
    block = ffi.new("uint64_t *")
    dev = ffi.new("uint64_t *")
    _check(lib.bd_fs_info(fd, fs_type, block, dev), path)
    return int(fs_type[0]), int(block[0]), int(dev[0])


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of a buffer, continuing from ``crc``."""
    buf = ffi.from_buffer("uint8_t[]", data)
    return int(lib.bd_crc32c(crc, buf, len(buf)))


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (files named after it are in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
