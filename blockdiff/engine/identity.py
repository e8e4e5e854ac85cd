"""Identity of a base image: a content fingerprint and, when known, a snapshot id.

A v2 diff names the base it was made against so that applying it to another
file is refused instead of silently producing garbage. Two checks:

- the *fingerprint*: BLAKE2b over the size and a fixed sample of blocks spread
  evenly over the file. Cheap (a few MiB read however large the image) and it
  catches a different image of the same size; it cannot promise to catch two
  versions of one image that differ only in blocks it did not sample.
- the *snapshot id*: 16 bytes naming an exact snapshot. ``apply`` tags the file
  it writes with the diff's target id (an xattr that also records the file's
  size and mtime, so any later write invalidates it); a diff made against a
  tagged base records that id and refuses any other.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct

import numpy as np

from blockdiff import native

FINGERPRINT_SAMPLES = 256
FINGERPRINT_BLOCK = 4096
SNAPSHOT_XATTR = "user.blockdiff.snapshot"
_TAG = struct.Struct("<16sQq")


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a whole file, in hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(fd: int, size: int, path: str | os.PathLike,
                samples: int = FINGERPRINT_SAMPLES) -> bytes:
    """16-byte fingerprint of a file's size and ``samples`` evenly spread blocks."""
    nblocks = -(-size // FINGERPRINT_BLOCK)
    h = hashlib.blake2b(struct.pack("<Q", size), digest_size=16, person=b"blockdiff-base")
    if nblocks and samples:
        count = min(samples, nblocks)
        index = np.unique(np.append(np.arange(count, dtype=np.uint64) * np.uint64(nblocks)
                                    // np.uint64(count), np.uint64(nblocks - 1)))
        h.update(native.read_blocks(fd, index * np.uint64(FINGERPRINT_BLOCK),
                                    FINGERPRINT_BLOCK, path))
    return h.digest()


def read_snapshot_id(fd: int) -> bytes | None:
    """The snapshot id a file is tagged with, if the tag is still valid."""
    try:
        raw = os.getxattr(fd, SNAPSHOT_XATTR)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
    if len(raw) != _TAG.size:
        return None
    snapshot_id, size, mtime_ns = _TAG.unpack(raw)
    st = os.fstat(fd)
    if st.st_size != size or st.st_mtime_ns != mtime_ns:
        return None  # written since it was tagged: no longer that snapshot
    return snapshot_id


def tag_snapshot_id(fd: int, snapshot_id: bytes) -> bool:
    """Tag a file with a snapshot id; False where the filesystem has no xattrs."""
    st = os.fstat(fd)
    try:
        os.setxattr(fd, SNAPSHOT_XATTR, _TAG.pack(snapshot_id, st.st_size, st.st_mtime_ns))
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return False
        raise
    return True
