"""Deterministic disk-image scenarios built with real syscalls.

A scenario starts from a base image, makes the target a reflink clone of it
(a copy where the filesystem has no reflink) and then changes the target the
way a VM would: scattered block writes, sequential writes, discards (punched
holes), preallocation, zeroing, growing and shrinking.  All randomness comes
from the seed, so a failing case can be rebuilt exactly.  Every modifier
fsyncs, so extent maps are stable afterwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import os
import random
import shutil
from typing import Callable

from filesystems import FICLONE

BLOCK = 4096

# From <linux/falloc.h>.
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int

_WRITE_CHUNK = 8 << 20


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    # os.posix_fallocate has no mode argument, hence libc directly.
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(mode={mode:#x}, offset={offset}, length={length}): "
                           f"{os.strerror(err)}")


def random_bytes(rng: random.Random, n: int) -> bytes:
    """`n` pseudo-random bytes determined by `rng`'s state.

    Draws one 128-bit seed from `rng` and expands it with SHAKE-128, which is
    several times faster than `Random.randbytes` and stable across Python versions.
    """
    return hashlib.shake_128(rng.getrandbits(128).to_bytes(16, "little")).digest(n)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _write_random(fd: int, rng: random.Random, offset: int, length: int) -> None:
    while length > 0:
        n = min(length, _WRITE_CHUNK)
        _pwrite_all(fd, random_bytes(rng, n), offset)
        offset += n
        length -= n


def _modify(path: str | os.PathLike, action: Callable[[int], None]) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        action(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def clone_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make `dst` a reflink clone of `src` (FICLONE), replacing its contents.

    Raises OSError (EOPNOTSUPP/EXDEV/EINVAL) where reflinks are impossible;
    there is deliberately no copying fallback.
    """
    with open(src, "rb") as s, open(dst, "wb") as d:
        fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        os.fsync(d.fileno())


def random_block_writes(path: str | os.PathLike, count: int, seed: int,
                        block: int = BLOCK) -> None:
    """Overwrite `count` randomly chosen `block`-aligned blocks with random bytes.

    Blocks are chosen within the current size (repeats allowed) and the file
    size never changes; a final partial block is only written up to EOF.
    """
    rng = random.Random(seed)
    size = os.path.getsize(path)
    if size == 0:
        return
    nblocks = -(-size // block)

    def action(fd: int) -> None:
        for _ in range(count):
            offset = rng.randrange(nblocks) * block
            _pwrite_all(fd, random_bytes(rng, min(block, size - offset)), offset)

    _modify(path, action)


def sequential_write(path: str | os.PathLike, offset: int, length: int, seed: int) -> None:
    """Write `length` random bytes starting at `offset` (may extend the file)."""
    rng = random.Random(seed)
    _modify(path, lambda fd: _write_random(fd, rng, offset, length))


def punch_hole(path: str | os.PathLike, offset: int, length: int) -> None:
    """Deallocate a range (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE); it then reads as zeros.

    Unaligned edges are zeroed in place by the kernel, leaving partial blocks
    allocated; only whole blocks inside the range become a hole.
    """
    _modify(path, lambda fd: _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                        offset, length))


def preallocate_unwritten(path: str | os.PathLike, offset: int, length: int) -> None:
    """Make a range read as zeros backed by allocated but unwritten extents.

    fallocate(mode=0) only preallocates over holes and keeps existing data,
    so any existing part of the range is punched out first.  Extends the file
    if the range goes past EOF (no KEEP_SIZE).
    """
    def action(fd: int) -> None:
        size = os.fstat(fd).st_size
        if offset < size:
            _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                       offset, min(length, size - offset))
        _fallocate(fd, 0, offset, length)

    _modify(path, action)


def zero_range(path: str | os.PathLike, offset: int, length: int) -> None:
    """Zero a range with FALLOC_FL_ZERO_RANGE (may extend the file).

    How the range is represented is up to the filesystem (XFS and ext4 use
    unwritten extents).  Where the filesystem cannot (tmpfs), zeros are
    written instead, as a guest zeroing its disk would.
    """
    def action(fd: int) -> None:
        try:
            _fallocate(fd, FALLOC_FL_ZERO_RANGE, offset, length)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                raise
            _pwrite_all(fd, bytes(length), offset)

    _modify(path, action)


def grow(path: str | os.PathLike, new_size: int, write_tail: bool = True,
         seed: int = 0) -> None:
    """Extend the file to `new_size` bytes.

    The new space is a hole; with `write_tail` the last (up to 8 KiB) bytes
    of it are then filled with random data so the grown part ends in data.
    """
    old_size = os.path.getsize(path)
    if new_size < old_size:
        raise ValueError(f"grow: new size {new_size} < current size {old_size}")
    rng = random.Random(seed)

    def action(fd: int) -> None:
        os.ftruncate(fd, new_size)
        if write_tail and new_size > old_size:
            tail = min(new_size - old_size, 2 * BLOCK)
            _pwrite_all(fd, random_bytes(rng, tail), new_size - tail)

    _modify(path, action)


def shrink(path: str | os.PathLike, new_size: int) -> None:
    """Truncate the file down to `new_size` bytes."""
    old_size = os.path.getsize(path)
    if new_size > old_size:
        raise ValueError(f"shrink: new size {new_size} > current size {old_size}")
    _modify(path, lambda fd: os.ftruncate(fd, new_size))


def make_base_image(path: str | os.PathLike, size: int, seed: int,
                    sparse_fraction: float = 0.5, zero_fraction: float = 0.1) -> None:
    """Create a sparse image of exactly `size` bytes: random data runs and holes.

    The file is cut into block-aligned runs of 1-16 blocks and occasional
    longer ones.  A run is left as a hole with probability `sparse_fraction`;
    a data run is written as literal zero bytes (allocated, but all zeros,
    like a guest that zeroed its disk) with probability `zero_fraction`,
    otherwise with random bytes.  `size` need not be a multiple of the block.
    """
    rng = random.Random(seed)
    long_run = max(16, size // BLOCK // 64)
    with open(path, "wb") as f:
        fd = f.fileno()
        os.ftruncate(fd, size)
        pos = 0
        while pos < size:
            blocks = rng.randint(1, 16) if rng.random() < 0.8 else rng.randint(16, long_run)
            n = min(blocks * BLOCK, size - pos)
            if rng.random() >= sparse_fraction:
                if rng.random() < zero_fraction:
                    _pwrite_all(fd, bytes(n), pos)
                else:
                    _write_random(fd, rng, pos, n)
            pos += n
        os.fsync(fd)


def _random_range(rng: random.Random, size: int, max_blocks: int) -> tuple[int, int]:
    """A block-aligned (offset, length) starting inside a file of `size` bytes."""
    nblocks = max(1, -(-size // BLOCK))
    start = rng.randrange(nblocks)
    count = rng.randint(1, max(1, min(max_blocks, nblocks - start)))
    return start * BLOCK, count * BLOCK


def _scale(size: int) -> int:
    """Range length limit in blocks: about 1/16 of the image, 1..256 blocks."""
    return max(1, min(256, size // BLOCK // 16))


def start_target(base: str | os.PathLike, target: str | os.PathLike) -> None:
    """Make `target` a reflink clone of `base`, or a plain copy where the
    filesystem has no reflink (ext4, tmpfs): what a sandbox manager does."""
    try:
        clone_file(base, target)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY):
            raise
        shutil.copyfile(base, target)


# Scenario builders.  Each clones base -> target and modifies the target;
# only "empty_base" also changes the base.

def _random_4k_writes(base, target, seed):
    start_target(base, target)
    size = os.path.getsize(target)
    random_block_writes(target, count=max(1, size // BLOCK // 20), seed=seed)


def _sequential_writes(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    for _ in range(3):
        offset, length = _random_range(rng, size, 4 * _scale(size))
        sequential_write(target, offset, min(length, max(size - offset, BLOCK)),
                         rng.getrandbits(32))


def _punched_holes(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    for _ in range(4):
        punch_hole(target, *_random_range(rng, size, _scale(size)))
    # An unaligned punch leaves zeroed partial blocks as data at both edges.
    if size > 3 * BLOCK:
        punch_hole(target, BLOCK + 100, BLOCK + 200)


def _unwritten_extents(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    for _ in range(3):
        preallocate_unwritten(target, *_random_range(rng, size, _scale(size)))
    # Past EOF: the file grows and the new tail reads as zeros.
    preallocate_unwritten(target, size, 8 * BLOCK + 123)


def _zero_ranges(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    for _ in range(3):
        zero_range(target, *_random_range(rng, size, _scale(size)))
    if size > 2 * BLOCK:
        zero_range(target, 777, BLOCK)  # unaligned


def _grow(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    grow(target, size + rng.randint(1, 64) * BLOCK + rng.randint(1, BLOCK - 1), seed=seed)


def _shrink_unaligned(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    new_size = rng.randint(0, max(0, size - 1))
    if new_size % BLOCK == 0:
        new_size = max(1, new_size - 1)  # keep the new EOF inside a block
    shrink(target, min(new_size, size))


def _empty_target(base, target, seed):
    start_target(base, target)
    shrink(target, 0)


def _empty_base(base, target, seed):
    # The target keeps the former base content (now unshared); the base
    # becomes a zero-length file.
    start_target(base, target)
    shrink(base, 0)


def _mixed(base, target, seed):
    start_target(base, target)
    rng = random.Random(seed)
    size = os.path.getsize(target)
    random_block_writes(target, count=max(1, size // BLOCK // 50), seed=rng.getrandbits(32))
    offset, length = _random_range(rng, size, 2 * _scale(size))
    sequential_write(target, offset, length, rng.getrandbits(32))
    punch_hole(target, *_random_range(rng, size, _scale(size)))
    preallocate_unwritten(target, *_random_range(rng, size, _scale(size)))
    zero_range(target, *_random_range(rng, size, _scale(size)))
    random_block_writes(target, count=8, seed=rng.getrandbits(32))
    new_size = os.path.getsize(target)
    if rng.random() < 0.5:
        grow(target, new_size + rng.randint(1, 16 * BLOCK), seed=rng.getrandbits(32))
    else:
        shrink(target, rng.randint(new_size // 2, new_size))


SCENARIOS: dict[str, Callable[[str | os.PathLike, str | os.PathLike, int], None]] = {
    "random_4k_writes": _random_4k_writes,
    "sequential_writes": _sequential_writes,
    "punched_holes": _punched_holes,
    "unwritten_extents": _unwritten_extents,
    "zero_ranges": _zero_ranges,
    "grow": _grow,
    "shrink_unaligned": _shrink_unaligned,
    "empty_target": _empty_target,
    "empty_base": _empty_base,
    "mixed": _mixed,
}


def assert_same_bytes(a: str | os.PathLike, b: str | os.PathLike,
                      chunk_size: int = 1 << 20) -> None:
    """Assert two files have identical size and content.

    Reads both in chunks; the failure message names the first differing
    offset and both sizes.
    """
    size_a, size_b = os.path.getsize(a), os.path.getsize(b)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        offset = 0
        while True:
            xa, xb = fa.read(chunk_size), fb.read(chunk_size)
            if xa != xb:
                n = min(len(xa), len(xb))
                first = next((i for i in range(n) if xa[i] != xb[i]), n)
                raise AssertionError(
                    f"{a} ({size_a} bytes) and {b} ({size_b} bytes) differ; "
                    f"first difference at offset {offset + first}")
            if not xa:
                return
            offset += len(xa)
