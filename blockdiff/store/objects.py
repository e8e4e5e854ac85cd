"""The store's object files and the lock that orders them.

Layer data files and map files live in ``objects/`` under names that never
change meaning (a layer's number, a map's digest); they are written under
staging names in ``staging/``, fsynced, and linked into ``objects/``, never
over an existing file. The store lock (``STORE/lock``, flock) is what makes
that safe beside removals: files enter ``objects/`` only under the shared
lock, together with the catalog rows that name them, and leave it only under
the exclusive lock, after the rows are gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

from blockdiff.errors import ObjectInTheWay


def layer_name(layer: int) -> str:
    """The file name of a layer's data in ``objects/``."""
    return f"{int(layer):016x}.layer"


def map_name(snapshot_id: str, digest: str) -> str:
    """The file name of a snapshot's map: named by its digest, so a rewritten
    map (compaction) never replaces the old one under the same name."""
    return f"{snapshot_id}.{digest[:16]}.map"


def write_readonly(path: Path, data: bytes, mode: int) -> None:
    """Write a new file (never over one) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def allocated(path: Path) -> int:
    """Bytes allocated to a file (0 if it is gone)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def unlink(path: Path) -> int:
    """Remove a file; the bytes it held (shared blocks count in full)."""
    size = allocated(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        return size
    return 0


class DecodedCache:
    """What was decoded from objects, kept while the store is open: at most
    ``limit`` entries (and, with ``weigh``, at most ``budget`` of what it
    says they weigh), the least recently used going first; safe to share
    between threads."""

    def __init__(self, limit: int, *, weigh=None, budget: int = 0):
        self._entries: dict = {}
        self._weights: dict = {}
        self._limit = limit
        self._weigh = weigh
        self._budget = budget
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key):
        """The entry for ``key``, or None."""
        with self._lock:
            value = self._entries.pop(key, None)
            if value is not None:
                self._entries[key] = value     # the most recently used, last
            return value

    def put(self, key, value) -> None:
        """Keep ``value`` under ``key``."""
        weight = self._weigh(value) if self._weigh is not None else 0
        with self._lock:
            self._drop(key)
            self._entries[key] = value
            self._weights[key] = weight
            self._weight += weight
            while len(self._entries) > 1 and (
                    len(self._entries) > self._limit
                    or (self._weigh is not None and self._weight > self._budget)):
                self._drop(next(iter(self._entries)))

    def pop(self, key) -> None:
        """Forget the entry for ``key``, if any."""
        with self._lock:
            self._drop(key)

    def _drop(self, key) -> None:
        if self._entries.pop(key, None) is not None:
            self._weight -= self._weights.pop(key)


class ObjectFiles:
    """The files of a store's ``objects/`` and ``staging/`` directories.

    ``mode`` is the mode of object files: read-only, for their owner or the
    store's group too."""

    def __init__(self, root: Path, mode: int):
        self.root = root
        self.objects = root / "objects"
        self.staging = root / "staging"
        self.mode = mode

    def layer_path(self, layer: int) -> Path:
        """Where a layer's data file is."""
        return self.objects / layer_name(layer)

    def map_path(self, snapshot_id: str, digest: str) -> Path:
        """Where the map of that id and digest is (see :func:`map_name`)."""
        return self.objects / map_name(snapshot_id, digest)

    def staged(self, name: str, suffix: str) -> Path:
        """A staging path of this process, ``NAME.PID.SUFFIX``: the sweep
        removes those of processes that are gone."""
        return self.staging / f"{name}.{os.getpid()}.{suffix}"

    def create(self, path: Path) -> int:
        """Open a new object file (never an existing one) to write it."""
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)

    def write(self, path: Path, data: bytes) -> None:
        """Write a new object file whole and fsync it."""
        write_readonly(path, data, self.mode)

    def place(self, staged: Path, final: Path, placed: list[Path]) -> None:
        """Move a staged file into ``objects/``, never over an existing one."""
        try:
            os.link(staged, final)
        except FileExistsError:
            raise ObjectInTheWay(f"{final} already exists; the store will not replace an "
                               f"object (run: blockdiff verify --store {self.root})",
                               final) from None
        placed.append(final)
        os.unlink(staged)

    @staticmethod
    def unplace(committed, placed: list[Path]) -> None:
        """After a failure: remove the files placed for catalog rows that did
        not commit (``committed()`` says whether they did after all)."""
        with contextlib.suppress(Exception):
            if placed and not committed():
                for path in placed:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()

    def sync(self) -> None:
        """Make what was placed in ``objects/`` durable."""
        fsync_dir(self.objects)

    def sweep(self, keep: set[str]) -> int:
        """Remove the files of ``objects/`` not named in ``keep``, and staged
        files of processes that are gone; the bytes freed. Only under the
        exclusive store lock, with ``keep`` read under it."""
        from blockdiff import native  # here, not at the top: it loads numpy

        freed = 0
        for path in self.objects.iterdir():
            if path.name not in keep:
                freed += unlink(path)
        for path in self.staging.iterdir():
            pid = staged_owner(path.name)
            if pid is not None and not native.process_alive(pid):
                freed += unlink(path)
        return freed


# The most digits a pid has (a positive 32-bit number; Linux's are at most
# 2**22): a layer id, a digest's 16 hex digits or a temporary name's random
# 12 that happen to be all digits are never taken for one.
_PID_DIGITS = 10


def staged_owner(name: str) -> int | None:
    """The pid of the process a staging file belongs to, or None if its name
    is not one of ``ObjectFiles.staged`` (``NAME.PID.SUFFIX``), nor the
    temporary file beside one (``.NAME.PID.SUFFIX.RANDOM.partial``). NAME
    may hold dots itself (``ID.layer``, ``ID.DIGEST.map``): the pid is the
    first field after the first that is all digits and short enough."""
    fields = name.removeprefix(".").split(".")
    for field in fields[1:]:
        if field.isdigit() and len(field) <= _PID_DIGITS:
            return int(field)
    return None


class StoreLock:
    """The store lock, ``STORE/lock``: held shared by every operation that
    reads objects or adds them, exclusively while objects leave ``objects/``.
    ``mode`` is the mode the lock file gets if it has to be made."""

    def __init__(self, path: Path, mode: int):
        self.path = path
        self.mode = mode
        self._held = threading.local()

    @contextlib.contextmanager
    def _hold(self, kind: int):
        depth = getattr(self._held, "shared", 0)
        if kind == fcntl.LOCK_EX and depth:
            raise RuntimeError("the exclusive store lock was asked for under the shared one")
        # Read-only is enough for flock, and lets a group member take the lock.
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, self.mode)
        try:
            fcntl.flock(fd, kind)
            if kind == fcntl.LOCK_SH:
                self._held.shared = depth + 1
            try:
                yield
            finally:
                if kind == fcntl.LOCK_SH:
                    self._held.shared = depth
        finally:
            os.close(fd)

    def shared(self):
        """Held by every operation that reads objects or adds them."""
        return self._hold(fcntl.LOCK_SH)

    def exclusive(self):
        """Held while objects leave ``objects/``: no reader is between a
        catalog row and the files it names."""
        return self._hold(fcntl.LOCK_EX)
