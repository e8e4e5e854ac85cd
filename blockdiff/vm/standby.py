"""A VM's standby memory image: a second memory image, kept clean at one of
its memory snapshots, that restores and forks start from.

A restore with memory could rewrite the dead VM's own memory image in place,
but only after writing back, and mapping, all the RAM its guest dirtied since
its last checkpoint: bytes the restore then throws away, at about a
millisecond per dirty MiB, scattered (some 40 ms after a small step, far more
after a large one). The standby is never mapped by QEMU, so nothing writes
it: its extent map is its snapshot's, and bringing it to another snapshot
rewrites only where the two snapshots' extent maps differ, with nothing to
write back or map first.

- A restore swaps it with the dead VM's memory image (``take``) and brings
  it to the checkpoint while QEMU starts. The dead image, its lineage
  removed, is the next standby: its page cache is mostly what that needs.
- A fork makes its new memory image a reflink copy of it (``copy_to``); the
  standby stays.
- It is prepared in a thread of its own while the guest runs (``prepare``):
  moved to each new memory checkpoint; after a restore, the old image
  restored in place (written back and mapped, off the restore's path); built
  from the layers where there is none. Its page cache is then warmed in
  4 KiB folios (see ``blockdiff.vm.machine.warm_page_cache``), so that a
  guest resumed on it neither faults it in nor dirties it in large folios.

Whoever prepares, takes or copies it holds the standby's lock; a restore or
fork that finds it locked by another process, or missing, or not clean at a
snapshot the store still has, does without. The thread is not a daemon: a
process that exits waits for it, so that it leaves no half-built file.

The standby shares every block with the layers of its snapshot: it costs
the store no space while that snapshot stays, and at most one memory
image's worth once it is removed, until the next checkpoint or restore moves
the standby on.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

import numpy as np

from blockdiff.engine.extents import pieces_within
from blockdiff.engine.files import clone_or_copy
from blockdiff.store.lineage import forget_lineage, set_lineage
from blockdiff.store.store import Store
from blockdiff.vm.machine import warm_page_cache

STANDBY = "memory.standby"
STANDBY_LOCK = "memory.standby.lock"
# Nothing written since its snapshot: the in-place restore compares maps only.
NOTHING_WRITTEN = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))


class Standby:
    """The standby memory image of the VM whose directory is ``directory``."""

    def __init__(self, store: Store, directory: Path):
        self.store = store
        self.path = directory / STANDBY
        self._building = directory / f".{STANDBY}.new"
        self._swapping = directory / f".{STANDBY}.swap"
        self._lock_path = directory / STANDBY_LOCK
        self._thread: threading.Thread | None = None
        # Why the last preparation (or copy) failed (None if it did not): a
        # thread must not print, and a standby only ever makes a restore or
        # a fork faster.
        self.failure: Exception | None = None

    def prepare(self, memory_snapshot_id: str) -> None:
        """Start bringing the standby to a memory snapshot, in the background
        (after the preparation under way, if any)."""
        self.wait()
        self._thread = threading.Thread(target=self._prepare, args=(memory_snapshot_id,),
                                        name=f"standby {self.path.parent.name}")
        self._thread.start()

    def wait(self) -> None:
        """Until this process's preparation of the standby, if any, is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, image: Path, size: int) -> bool:
        """Swap the standby with ``image`` (a memory image no QEMU runs on) if
        it is clean at a snapshot of ``size`` bytes the store has (its lineage
        then says which); False, and nothing changed, if there is none to
        take. The old image is the next standby, once prepared: its page
        cache is mostly what the next one needs."""
        self.wait()
        with self._locked(wait=False) as locked:
            if not locked or not self._clean(size):
                return False
            if not os.path.lexists(image):
                os.rename(self.path, image)
                return True
            # Its guest wrote it since the snapshot its lineage names.
            forget_lineage(image)
            os.rename(self.path, self._swapping)
            os.rename(image, self.path)
            os.rename(self._swapping, image)
            return True

    def copy_to(self, image: Path, size: int, target: str) -> bool:
        """Make ``image``, a new memory image of ``size`` bytes that no guest
        ran on (a fork's, which QEMU may have mapped but not read), a
        reflink copy of the standby (which stays), if it is clean at a
        snapshot of that size the store has, and if the copy and then the
        restore to memory snapshot ``target`` cost less than filling the
        image from the layers (see ``_worth_copying``); its lineage then
        says which. False if not, or if this process or another is
        preparing it (a fork does not wait for it), or if the copy failed:
        ``image`` then has no lineage, and a restore compares it whole."""
        with self._locked(wait=False) as locked:
            if not locked or not self._clean(size):
                return False
            known, _ = self.store.lineage(self.path)
            if not self._worth_copying(known, target):
                return False
            try:
                with open(self.path, "rb") as src, open(image, "r+b") as dst:
                    if os.fstat(dst.fileno()).st_size != size:
                        return False
                    clone_or_copy(src.fileno(), dst.fileno(), size, str(image))
                    set_lineage(dst.fileno(), self.store.id, known, "clean")
            except OSError as e:
                self.failure = e
                return False
            return True

    def _worth_copying(self, known: str, target: str) -> bool:
        """Whether a copy of the standby (at snapshot ``known``) brought to
        ``target`` costs less than filling a new image with ``target``'s
        pieces. Reflinks cost about the same per extent, a whole-file
        clone about half as much (profiled: 19 µs an extent in one
        ``FICLONE``; 30–60 µs a piece, one ``FICLONERANGE`` each): copying
        is worth it while fewer than half the target's pieces differ from
        the standby's snapshot."""
        if self.store.copy_mode:
            return False    # a copy through memory, not a clone
        target_snap = self.store.get(target)
        wanted = self.store.load_map(target_snap).pieces
        differ = self.store.differences(self.store.get(known), target_snap)
        rewritten, _ = pieces_within(wanted, differ.offset, differ.offset + differ.length)
        return 2 * len(rewritten) < len(wanted)

    def _holds(self, size: int) -> bool:
        try:
            return os.lstat(self.path).st_size == size
        except FileNotFoundError:
            return False

    def _clean(self, size: int) -> bool:
        if not self._holds(size):
            return False
        known, state = self.store.lineage(self.path)
        return known is not None and state == "clean"

    def _prepare(self, memory_snapshot_id: str) -> None:
        self.failure = None
        try:
            with self._locked(wait=True):
                self._swapping.unlink(missing_ok=True)   # left by a swap cut short
                size = self.store.get(memory_snapshot_id).size
                if self._clean(size):
                    self.store.restore(memory_snapshot_id, self.path, written=NOTHING_WRITTEN)
                elif self._holds(size):
                    # An old memory image: compared whole (written back, mapped).
                    self.store.restore(memory_snapshot_id, self.path)
                else:
                    self._build(memory_snapshot_id, size)
                self._warm()
        except Exception as e:   # noqa: BLE001 - see failure
            # A standby left half-moved is marked "restoring" by its lineage:
            # nothing takes it, and the next preparation compares it whole.
            self.failure = e

    def _build(self, memory_snapshot_id: str, size: int) -> None:
        """A new standby of the snapshot, from its layers, renamed into place
        once whole (0600: it is guest RAM)."""
        self._building.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        try:
            fd = os.open(self._building, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                         0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            self.store.restore(memory_snapshot_id, self._building)
            os.rename(self._building, self.path)
        finally:
            self._building.unlink(missing_ok=True)

    def _warm(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            warm_page_cache(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _locked(self, *, wait: bool):
        """The standby's lock (yields whether it was had: without ``wait``,
        not while another holds it)."""
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)
