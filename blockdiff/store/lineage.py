"""An image's side of the store: the lineage it records, and the lock a
commit or restore holds on it.

The extended attribute ``user.blockdiff.lineage`` names the store and the
snapshot the image was last committed as or restored from, whether a
restore into it was interrupted, and a random mark that changes with every
commit or restore. Correctness never depends on it (see docs/store.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat as stat_mode

from blockdiff.errors import ImageBusy, UsageError
from blockdiff.store.catalog import Catalog

LINEAGE_XATTR = "user.blockdiff.lineage"


def lineage_record(image: str | os.PathLike, store_id: str, catalog: Catalog) -> dict | None:
    """The lineage an image records for the store ``store_id``, if it names a
    snapshot the catalog has; None for an image without one, another store's
    image, or a foreign one."""
    try:
        raw = os.getxattr(image, LINEAGE_XATTR)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
            return None
        raise
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if record.get("store") != store_id or catalog.get(record.get("snapshot", "")) is None:
        return None
    return record


def set_lineage(fd: int, store_id: str, snapshot_id: str, state: str) -> None:
    """Record in an open image that it is ``snapshot_id`` of the store, in
    ``state`` ("clean", or "restoring" while a restore writes it)."""
    os.setxattr(fd, LINEAGE_XATTR, json.dumps(
        {"store": store_id, "snapshot": snapshot_id, "state": state,
         "mark": os.urandom(8).hex()}).encode())


def forget_lineage(path: str | os.PathLike) -> None:
    """Remove the lineage an image records: it no longer vouches for what the
    image holds (a restore into it then compares it whole)."""
    try:
        os.removexattr(path, LINEAGE_XATTR)
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.ENOTSUP):
            raise


@contextlib.contextmanager
def image_locked(path: str, flags: int):
    """An open descriptor of the image at ``path``, locked against other
    commits and restores (``ImageBusy`` if one holds it). Opened read-write
    (``os.O_RDWR`` in ``flags``), it must be a regular file with one name."""
    # A restore never goes through a symbolic link: it would write into
    # whatever the link points at (as root: anything, this store included).
    nofollow = os.O_NOFOLLOW if flags & os.O_RDWR else 0
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | nofollow)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{path} is a symbolic link; give the image's own path "
                             f"({os.path.realpath(path)})") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat_mode.S_ISREG(st.st_mode):
            raise UsageError(f"{path} is not a regular file")
        if flags & os.O_RDWR and st.st_nlink > 1:
            raise UsageError(f"{path} has {st.st_nlink} hard links; a restore would change "
                             f"the other names too (it could be a store's own file), so "
                             f"restore into a new path instead")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ImageBusy(f"{path} is being committed or restored by another process; "
                            f"wait for it and retry") from None
        yield fd
    finally:
        os.close(fd)
