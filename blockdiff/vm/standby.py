"""A VM's standby memory image: a second memory image, kept clean at one of
its memory snapshots, that restores start from; and its spares, a memory
image and a disk kept clean the same way, that forks take.

A restore with memory could rewrite the dead VM's own memory image in place,
but only after writing back, and mapping, all the RAM its guest dirtied since
its last checkpoint: bytes the restore then throws away, at about a
millisecond per dirty MiB, scattered (some 40 ms after a small step, far more
after a large one). No guest runs on the standby, so nothing writes it: its
extent map is its snapshot's, and bringing it to another snapshot rewrites
only where its extent map differs from the other snapshot's, with nothing
to write back first. Its lineage is not trusted for what it holds: the
comparison of extent maps also finds what another process wrote to it,
which is rewritten from the layers too (see blockdiff.vm.integrity). (The
QEMUs that map it and the spares, started ahead for the next restore or
fork, wait for a device state, and neither read nor write guest RAM
before they have one: see ``Machine.start_waiting``.)

- A restore brings it to the checkpoint (``bring``) while the dead VM's
  QEMU is stopped, then swaps it with the dead VM's memory image
  (``take``). The dead image, its lineage removed, is the next standby:
  its page cache is mostly what that needs.
- A fork takes a pair of spares: a memory image and a disk kept clean
  beside them, each at a snapshot (``Spare.give``: a rename), and brings
  each to its checkpoint. Anything else costs the fork per extent: a
  whole-file clone about 19 µs (120-220 ms profiled for the memory image
  after 20 benchmark steps: many small steps leave thousands of extents),
  filling an empty image 30-60 µs a piece. There are two pairs
  (``SparePair``): forks often come in a row, and a pair takes several
  hundred milliseconds to make anew. Where no memory spare is there, the
  fork copies the standby (``copy_to``), or fills its image from the
  layers.
- They are prepared in a thread of their own while the guest runs
  (``prepare``): the standby moved to each new memory checkpoint; after a
  restore, the old image restored in place (written back and mapped, off
  the restore's path); built from the layers where there is none. Its page
  cache is then warmed in 4 KiB folios (see
  ``blockdiff.vm.machine.warm_page_cache``), so that a guest resumed on it
  neither faults it in nor dirties it in large folios. Then, which restores
  do not wait for, each memory spare is moved to the same snapshot (made a
  clone of the standby where there is none), and each disk spare to the
  checkpoint's disk (filled from the layers where there is none), by the
  spares' worker, a process of its own at the lowest priority (see
  blockdiff.vm.spares_worker); the memory spares are warmed the same way
  last, once a fork's QEMU waits on them. After a fork took a pair, that
  pair is made anew at once (``prepare_spares``), at the usual priority
  but while a fork resumes.

Whoever prepares, takes or swaps the standby holds its lock exclusively;
whoever copies it, the memory spare's clone included, shares it. Each spare
has a lock of its own, taken after the standby's. A restore or fork that
finds one locked by another, or missing, or not clean at a snapshot the
store still has, does without. The threads are not daemons: a process that
exits waits for them, and they for the spares' worker, so that it leaves no
half-built file.

All three share every block with the layers of their snapshots: they cost
the store no space while those snapshots stay, and at most an image's worth
each once they are removed, until the next checkpoint or restore moves them
on.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from blockdiff.engine.extents import pieces_within
from blockdiff.engine.files import clone_or_copy
from blockdiff.errors import VMError
from blockdiff.store.lineage import forget_lineage, set_lineage
from blockdiff.store.store import Store
from blockdiff.vm.machine import warm_page_cache

STANDBY = "memory.standby"
STANDBY_LOCK = "memory.standby.lock"
MEMORY_SPARE = "memory.spare"
DISK_SPARE = "disk.spare"
# Forks often come in a row (best-of-N from one step): each takes a pair
# while the pair the one before took is made anew (a clone of the standby,
# a disk from the layers, a QEMU started: several hundred ms on two busy
# cores, where a fork that finds no pair copies the standby and starts its
# own QEMU under that contention).
SPARE_PAIRS = 2
# How long a restore waits for another's hold on the standby before it does
# without: a clone of it for the memory spare takes tens of milliseconds.
BRING_WAIT = 0.25
CAP_SYS_NICE = 23   # its bit in /proc/PID/status's capability sets
# How long a fork waits (seconds) for the spares' worker to leave its
# catalog's statement or transaction before it lets it run on.
STOP_WAIT = 0.2
# The spares' worker's first line, once it may be stopped (its parent-death
# signal set), and how long (seconds) it may take to say it: its interpreter
# and imports took 0.6-0.7 s on two idle cores, and a minute leaves room for
# a loaded machine.
WORKER_READY = "ready"
READY_WAIT = 60.0


class Spare:
    """An image kept clean at a snapshot, beside a VM's own, for a fork to
    take by rename (``give``); ``move`` brings it to another snapshot. Its
    lock is ``NAME.lock`` beside it; new ones are built as ``.NAME.new``."""

    def __init__(self, store: Store, path: Path, mode: int):
        self.store = store
        self.path = path
        self.mode = mode
        self.lock_path = path.with_name(f"{path.name}.lock")
        self._building = path.with_name(f".{path.name}.new")

    def give(self, image: Path, size: int) -> bool:
        """Rename the spare to ``image`` (which then replaces any file there)
        if it is clean at a snapshot of ``size`` bytes the store has (its
        lineage then says which); False, and nothing changed, if there is
        none to take, or if another is moving it. Bringing it to any
        snapshot then costs no more than filling an empty image: both
        reflink the pieces that differ, and only those."""
        with locked(self.lock_path, wait=False) as had:
            if not had or not clean(self.store, self.path, size):
                return False
            try:
                os.rename(self.path, image)
            except OSError:
                return False    # nothing renamed: the fork fills its own
            return True

    def ready(self) -> bool:
        """Whether the spare is there, clean at a snapshot the store has."""
        if not os.path.lexists(self.path):
            return False
        known, state = self.store.lineage(self.path)
        return known is not None and state == "clean"

    def move(self, snapshot_id: str, clone_of: Path | None = None) -> None:
        """Bring the spare to ``snapshot_id``: in place where it is clean,
        else built anew, as a reflink copy of ``clone_of`` (an image clean at
        a snapshot of the same size, which the caller keeps from changing)
        brought there, or else from the layers."""
        if self.store.copy_mode:
            return      # a copy through memory, not a clone
        with locked(self.lock_path, wait=True):
            size = self.store.get(snapshot_id).size
            if not clean(self.store, self.path, size):
                self._build(snapshot_id, size, clone_of)
            if self.store.lineage(self.path)[0] != snapshot_id:
                # Its extent map compared, not its lineage trusted (see
                # blockdiff.vm.integrity).
                self.store.restore(snapshot_id, self.path)

    def _build(self, snapshot_id: str, size: int, clone_of: Path | None) -> None:
        """A new spare, renamed into place once whole: a clone of
        ``clone_of`` where it is clean at a snapshot of ``size`` bytes (its
        lineage then says which), else ``snapshot_id`` from the layers."""
        build(self.store, self._building, self.path, size, self.mode, lambda fd: (
            clone_clean(self.store, clone_of, fd, size, str(self._building))
            or self.store.restore(snapshot_id, self._building)))


class SparePair:
    """A memory spare and a disk spare (``memory.spare``, ``disk.spare``;
    ``memory.spare-2``, ``disk.spare-2`` for the second pair) that one fork
    takes together, with the QEMU waiting on both."""

    def __init__(self, store: Store, directory: Path, number: int):
        suffix = f"-{number + 1}" if number else ""
        self.number = number
        self.memory = Spare(store, directory / f"{MEMORY_SPARE}{suffix}", 0o600)   # guest RAM
        self.disk = Spare(store, directory / f"{DISK_SPARE}{suffix}", 0o666)   # a fork's disk


class Standby:
    """The standby memory image of the VM whose directory is ``directory``,
    and the pairs of spares its forks take."""

    def __init__(self, store: Store, directory: Path, *, spares_ready=None):
        """``spares_ready()``: called in the spares' thread each time the
        spares were prepared (its error, if any, is ``spares_failure``)."""
        self.store = store
        self.spares_ready = spares_ready
        self.path = directory / STANDBY
        self._building = directory / f".{STANDBY}.new"
        self._swapping = directory / f".{STANDBY}.swap"
        self._lock_path = directory / STANDBY_LOCK
        self.pairs = tuple(SparePair(store, directory, n) for n in range(SPARE_PAIRS))
        self._thread: threading.Thread | None = None          # the standby's
        self._spares_thread: threading.Thread | None = None   # the spares'
        self._spares_wanted: tuple | None = None   # what it is to do next
        self._chaining = threading.Lock()          # guards both
        # Why the last preparation of the standby (or a copy of it), or of the
        # spares, failed (None if it did not): a thread must not print, and
        # these only ever make a restore or a fork faster.
        self.failure: Exception | None = None
        self.spares_failure: Exception | None = None
        # Seconds per phase of the last ``bring``.
        self.last_bring: dict[str, float] = {}
        self._held: int | None = None   # the lock's descriptor ``bring`` left held

    def prepare(self, memory_snapshot_id: str, disk_snapshot_id: str | None = None, *,
                then=None) -> None:
        """Start bringing the standby to a memory snapshot, in the background
        (after the preparation of the standby under way, if any), then call
        ``then()`` (if given, and if that went well; its error, if any, is
        ``failure``); then the memory spare to the same snapshot and the
        disk spare to ``disk_snapshot_id`` (if given), which restores do
        not wait for."""
        self.wait_standby()

        def run() -> None:
            # Where the standby is there to stay (the usual case, moved in
            # place), ``then`` runs beside its preparation.
            follow = None
            if then is not None and holds(self.path, self.store.get(memory_snapshot_id).size):
                follow = threading.Thread(target=lambda: self._then(then),
                                          name=f"then {self.path.parent.name}")
                follow.start()
            self._prepare_standby(memory_snapshot_id)
            if follow is not None:
                follow.join()
            elif then is not None and self.failure is None:
                self._then(then)
            # Moved a step on, for a fork that may not come: never at the
            # cost of a restore, a fork or a guest.
            self.prepare_spares(memory_snapshot_id, disk_snapshot_id, idle=True)

        self._thread = threading.Thread(target=run, name=f"standby {self.path.parent.name}")
        self._thread.start()

    def _then(self, then) -> None:
        try:
            then()
        except Exception as e:   # noqa: BLE001 - see failure
            self.failure = e

    def prepare_spares(self, memory_snapshot_id: str | None,
                       disk_snapshot_id: str | None = None, *, idle: bool = False,
                       missing_only: bool = False) -> None:
        """Start bringing the spares to these snapshots (the memory spares by
        default where the standby is), in the background, without waiting
        for the spares' preparation under way, if any: after it, and in its
        place if it has not begun (only the last one asked for is made).
        ``missing_only``: only the spares that are not there, clean, are
        made (a fork took them; the other pair stays where it is, for the
        next fork). ``idle``: at the lowest priority (nice 19, the spares'
        worker only), which still moves on when every core is busy, as
        ``SCHED_IDLE`` would not: a command's process waits for its threads
        to exit, and they for the worker."""
        with self._chaining:
            self._spares_wanted = (memory_snapshot_id, disk_snapshot_id, idle, missing_only)
            if self._spares_thread is None:
                self._spares_thread = threading.Thread(
                    target=self._prepare_spares_wanted, name=f"spares {self.path.parent.name}")
                self._spares_thread.start()

    def give_spares(self, image: Path, size: int, disk: Path, disk_size: int, *,
                    first=()) -> tuple[bool, bool]:
        """Rename a memory spare to ``image`` and a disk spare to ``disk``
        (see ``Spare.give``), both of one pair where it can (the QEMU
        waiting on that pair holds both), the pairs numbered in ``first``
        tried first: whether each was given."""
        pairs = sorted(self.pairs, key=lambda pair: pair.number not in first)
        memory = next((pair for pair in pairs if pair.memory.give(image, size)), None)
        ordered = sorted(pairs, key=lambda pair: pair is not memory)
        return memory is not None, any(pair.disk.give(disk, disk_size) for pair in ordered)

    def wait(self) -> None:
        """Until this process's preparations of the standby and the spares,
        if any, are done."""
        self.wait_standby()      # which may ask for the spares' first
        while True:
            with self._chaining:
                thread = self._spares_thread
            if thread is None:
                return
            thread.join()

    def wait_standby(self) -> None:
        """Until this process's preparation of the standby, if any, is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def bring(self, memory_snapshot_id: str) -> bool:
        """Bring the standby to ``memory_snapshot_id`` now, in place, if it is
        clean at a snapshot of that size (a restore does, while the dead
        VM's QEMU is stopped, before ``take``: the standby is no file of
        that QEMU's); False if not, if another process holds it, or if the
        move failed (``failure`` says why; its lineage then says
        "restoring", and nothing takes it). Brought, it stays locked for
        ``take`` (or ``release``): the spares' thread would clone it in
        between, and the restore then do without."""
        began = time.monotonic()
        self.wait_standby()
        waited = time.monotonic()
        # The spares' thread may be cloning it (a shared hold, tens of ms).
        fd = acquire(self._lock_path, wait=BRING_WAIT)
        locked_at = time.monotonic()
        self.last_bring = {"standby-wait": waited - began, "standby-lock": locked_at - waited}
        if fd is None:
            return False
        try:
            if not clean(self.store, self.path, self.store.get(memory_snapshot_id).size):
                return False
            # Not warmed here: the resume warms it beside QEMU's loading.
            # Its extent map compared with its snapshot's (about a
            # millisecond): what another process wrote to it since it was
            # prepared is rewritten too (see blockdiff.vm.integrity).
            try:
                self.store.restore(memory_snapshot_id, self.path)
            except Exception as e:   # noqa: BLE001 - see failure
                self.failure = e
                return False
            self.last_bring["standby-move"] = time.monotonic() - locked_at
            self._held, fd = fd, None
            return True
        finally:
            if fd is not None:
                os.close(fd)

    def release(self) -> None:
        """The standby's lock let go, if ``bring`` left it held."""
        fd, self._held = self._held, None
        if fd is not None:
            os.close(fd)

    def take(self, image: Path, size: int) -> bool:
        """Swap the standby with ``image`` (a memory image no QEMU runs on) if
        it is clean at a snapshot of ``size`` bytes the store has (its lineage
        then says which); False, and nothing changed, if there is none to
        take. The old image is the next standby, once prepared: its page
        cache is mostly what the next one needs."""
        self.wait_standby()
        fd, self._held = self._held, None
        if fd is None:
            fd = acquire(self._lock_path, wait=False)
        if fd is None:
            return False
        try:
            if not clean(self.store, self.path, size):
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
        finally:
            os.close(fd)

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
        with locked(self._lock_path, wait=False, shared=True) as had:
            if not had or not clean(self.store, self.path, size):
                return False
            known, _ = self.store.lineage(self.path)
            if not self._worth_copying(known, target):
                return False
            try:
                with open(image, "r+b") as dst:
                    if os.fstat(dst.fileno()).st_size != size:
                        return False
                    clone_clean(self.store, self.path, dst.fileno(), size, str(image))
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

    def _prepare_standby(self, memory_snapshot_id: str) -> None:
        self.failure = None
        try:
            with locked(self._lock_path, wait=True):
                self._swapping.unlink(missing_ok=True)   # left by a swap cut short
                size = self.store.get(memory_snapshot_id).size
                if holds(self.path, size):
                    # Compared whole (an old memory image: written back,
                    # mapped; a clean one: mapped, see blockdiff.vm.integrity).
                    self.store.restore(memory_snapshot_id, self.path)
                else:
                    self.path.unlink(missing_ok=True)
                    build(self.store, self._building, self.path, size, 0o600,
                          lambda fd: self.store.restore(memory_snapshot_id, self._building))
                warm_whole(self.path)
        except Exception as e:   # noqa: BLE001 - see failure
            # A standby left half-moved is marked "restoring" by its lineage:
            # nothing takes it, and the next preparation compares it whole.
            self.failure = e

    @contextlib.contextmanager
    def yielding(self):
        """The spares' worker (see blockdiff.vm.spares_worker), if there is
        one, stopped meanwhile, then let go on: a fork's critical path,
        beside which it would spend CPU (0.2-0.3 s to make anew the pair
        the fork before took) and reflink on the same filesystem. Stopped,
        it holds what locks it held: the standby's (shared, while it
        clones it) among them, which a restore waits for. A restore does
        not stop it: in two benchmark runs that did, the next restores
        waited longer for the standby's preparation, beside which the
        moves held back then ran."""
        with SPARES_WORKER.stopped():
            yield

    def _prepare_spares_wanted(self) -> None:
        """The spares' thread: what was asked for last, until nothing is,
        carried out by the spares' worker."""
        # Absolute: the worker runs in /.
        request = {"store": str(self.store.root.absolute()),
                   "directory": str(self.path.parent.absolute())}
        while True:
            with self._chaining:
                wanted, self._spares_wanted = self._spares_wanted, None
                if wanted is None:
                    self._spares_thread = None
                    return
            memory_snapshot_id, disk_snapshot_id, idle, missing_only = wanted
            self.spares_failure = SPARES_WORKER.run(
                request | {"op": "prepare", "memory": memory_snapshot_id,
                           "disk": disk_snapshot_id, "missing_only": missing_only},
                idle=idle)
            if self.spares_ready is not None and self.spares_failure is None:
                try:
                    self.spares_ready()
                except Exception as e:   # noqa: BLE001 - see spares_failure
                    self.spares_failure = e
            # Warmed last, once a fork's QEMU waits on them: a pair made anew
            # after a fork spent 0.2-0.4 s warming its memory spare before
            # that QEMU started, and a fork that takes a spare not warmed
            # warms what its guest writes first itself (see blockdiff.vm.restore.resume).
            SPARES_WORKER.run(request | {"op": "warm"}, idle=idle)

    def prepare_spares_here(self, memory_snapshot_id: str | None,
                            disk_snapshot_id: str | None, missing_only: bool) -> None:
        """What ``prepare_spares`` asks for, done in this thread (the spares'
        worker's). A spare left half-moved by an error is marked
        "restoring" by its lineage: nothing takes it, and the next
        preparation replaces it."""
        for pair in self.pairs:
            if not (missing_only and pair.memory.ready()):
                self._prepare_memory_spare(pair.memory, memory_snapshot_id)
            if disk_snapshot_id is not None and not (missing_only and pair.disk.ready()):
                pair.disk.move(disk_snapshot_id)

    def warm_spares(self) -> None:
        """The memory spares' page cache filled in 4 KiB folios."""
        for pair in self.pairs:
            with contextlib.suppress(OSError):
                warm_whole(pair.memory.path)

    def _prepare_memory_spare(self, spare: Spare, memory_snapshot_id: str | None) -> None:
        if memory_snapshot_id is not None and clean(
                self.store, spare.path, self.store.get(memory_snapshot_id).size):
            spare.move(memory_snapshot_id)
            return
        # Cloned from the standby, which stays as it is meanwhile.
        with locked(self._lock_path, wait=True, shared=True):
            known, state = self.store.lineage(self.path)
            target = memory_snapshot_id or (known if state == "clean" else None)
            if target is not None:
                spare.move(target, clone_of=self.path)


class SparesWorker:
    """This process's spares' worker (see blockdiff.vm.spares_worker),
    started at its first request, which carries out one request at a
    time: at nice 19 where the request is idle, else at the priority it
    started with; stopped while a fork resumes (``stopped``)."""

    def __init__(self):
        self._forget()

    def _forget(self) -> None:
        """No worker yet (also in a child this process forks: the worker,
        its pipes and its stop lock are this process's, not the child's)."""
        self._process: subprocess.Popen | None = None
        self._spawns: queue.SimpleQueue = queue.SimpleQueue()
        self._spawner: threading.Thread | None = None
        self._requests = threading.Lock()   # one request at a time
        self._priority = threading.Lock()   # guards the four below
        self._usual = 0          # the worker's priority when it started
        self._idle = False       # the request under way is idle
        self._stopped = 0        # stopped() under way
        self._holding = False    # the stop lock held, the worker stopped
        # Held shared by the worker in each statement or transaction of its
        # catalog, exclusively by this process to stop it (a file of its
        # own, outside any store: see ``stopped``).
        self._stop_lock: int | None = None
        self._stop_lock_path: str | None = None

    @property
    def pid(self) -> int | None:
        """The worker's pid while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def run(self, request: dict, *, idle: bool) -> VMError | None:
        """Carry out ``request`` (at nice 19 if ``idle``): None, or why it
        failed (the worker, if it failed itself, is started anew next
        time)."""
        with self._requests:
            try:
                if not idle and self._niced() and not may_raise_priority():
                    # Left at nice 19 by an idle request, it cannot be given
                    # its priority back (no CAP_SYS_NICE): a new one can.
                    self.close()
                process = self._running()
                with self._priority:
                    self._idle = idle
                    self._apply()
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                answer = process.stdout.readline()
                if not answer:
                    raise OSError(f"it exited ({process.wait()})")
                failure = json.loads(answer)["failure"]
            except (OSError, ValueError) as e:
                self.close()
                return VMError(f"the spares' worker process failed: {e}")
        return None if failure is None else VMError(f"preparing the spares: {failure}")

    @contextlib.contextmanager
    def stopped(self):
        """The worker stopped meanwhile (SIGSTOP, then SIGCONT; see
        ``Standby.yielding``), once outside its catalog's statements and
        transactions: stopped inside one, it would hold up every writer of
        the catalog, this process's among them. Not stopped if it does not
        leave one within ``STOP_WAIT`` seconds."""
        with self._priority:
            self._stopped += 1
            if self._stopped == 1 and self.pid is not None and self._hold_stop_lock():
                self._holding = True
                self._signal(signal.SIGSTOP)
        try:
            yield
        finally:
            with self._priority:
                self._stopped -= 1
                if not self._stopped and self._holding:
                    self._holding = False
                    self._signal(signal.SIGCONT)
                    fcntl.flock(self._stop_lock, fcntl.LOCK_UN)

    def _hold_stop_lock(self) -> bool:
        deadline = time.monotonic() + STOP_WAIT
        while True:
            try:
                fcntl.flock(self._stop_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.001)

    def _signal(self, number: int) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, number)

    def _niced(self) -> bool:
        """Whether the worker runs below the priority it started with."""
        pid = self.pid
        try:
            return pid is not None and os.getpriority(os.PRIO_PROCESS, pid) > self._usual
        except OSError:
            return False

    def _apply(self) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, pid, 19 if self._idle else self._usual)

    def _running(self) -> subprocess.Popen:
        if self.pid is None:
            if self._stop_lock is None:
                self._stop_lock, self._stop_lock_path = tempfile.mkstemp(
                    prefix="blockdiff-spares-", suffix=".lock")
                os.set_inheritable(self._stop_lock, False)
            # The blockdiff this process runs, wherever it was imported from.
            where = str(Path(__file__).resolve().parents[2])
            # Started by a thread that lives as long as this process: the
            # worker's parent-death signal follows the thread that started it.
            process = self._spawn(
                [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                 "from blockdiff.vm.spares_worker import main; "
                 "main(sys.argv[2], int(sys.argv[3]))", where,
                 self._stop_lock_path, str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                cwd="/", text=True, start_new_session=True)
            # Not ours to stop (see ``pid``) until it says it may be: one
            # stopped before it set its parent-death signal would stay
            # stopped should this process die.
            # Its line comes in one write: a readable pipe has it whole, or
            # its end.
            readable, _, _ = select.select([process.stdout], [], [], READY_WAIT)
            if not readable or process.stdout.readline() != WORKER_READY + "\n":
                if not readable:    # hung: its requests would hang too
                    process.kill()
                self._let_go(process)
                raise OSError(f"it exited before it was ready ({process.returncode})"
                              if readable else
                              f"it did not say it was ready within {READY_WAIT:g} s")
            with contextlib.suppress(OSError):
                self._usual = os.getpriority(os.PRIO_PROCESS, process.pid)
            self._process = process
        return self._process

    def _spawn(self, *args, **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(*args, **kwargs)`` in the spawner thread, a
        daemon that lives until the process exits (an executor's thread
        ends, and refuses work, once the interpreter starts to shut down,
        while a command's spares' thread may still start the worker)."""
        if self._spawner is None:
            self._spawner = threading.Thread(target=self._spawning, name="spares-spawner",
                                             daemon=True)
            self._spawner.start()
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._spawns.put((args, kwargs, done))
        result = done.get()
        if isinstance(result, Exception):
            raise result
        return result

    def _spawning(self) -> None:
        while True:
            args, kwargs, done = self._spawns.get()
            try:
                done.put(subprocess.Popen(*args, **kwargs))
            except Exception as e:   # noqa: BLE001 - raised in the asking thread
                done.put(e)

    def close(self) -> None:
        """Let the worker go: it exits once its request, if any, is done
        (killed after 10 s)."""
        process, self._process = self._process, None
        if process is not None:
            self._let_go(process)

    @staticmethod
    def _let_go(process: subprocess.Popen) -> None:
        """Close the pipes of worker ``process`` and wait for it to exit
        (killed after 10 s)."""
        with contextlib.suppress(OSError):
            process.stdin.close()
        # Stopped by a fork (``stopped``), which no longer knows it to let
        # it go: let go now, to see the end of its input.
        with contextlib.suppress(OSError):
            process.send_signal(signal.SIGCONT)   # never a reaped pid's
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()

    def at_exit(self) -> None:
        """The worker let go, and the stop lock's file removed."""
        self.close()
        if self._stop_lock_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._stop_lock_path)


SPARES_WORKER = SparesWorker()
atexit.register(SPARES_WORKER.at_exit)
os.register_at_fork(after_in_child=SPARES_WORKER._forget)


def may_raise_priority() -> bool:
    """Whether this process may give a process a higher priority than it has
    (CAP_SYS_NICE): without it, one put at nice 19 stays there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def warm_whole(path: Path) -> None:
    """The page cache of the image at ``path`` filled in 4 KiB folios."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        warm_page_cache(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def holds(path: Path, size: int) -> bool:
    try:
        return os.lstat(path).st_size == size
    except FileNotFoundError:
        return False


def clean(store: Store, path: Path, size: int) -> bool:
    """Whether the image at ``path`` holds ``size`` bytes and is, by its
    lineage, a snapshot the store has."""
    if not holds(path, size):
        return False
    known, state = store.lineage(path)
    return known is not None and state == "clean"


def clone_clean(store: Store, source: Path | None, fd: int, size: int, name: str) -> bool:
    """Make ``fd``, the open image ``name``, a reflink copy of ``source``,
    with its lineage, if that is clean at a snapshot of ``size`` bytes;
    False if not."""
    if source is None or not clean(store, source, size):
        return False
    known, _ = store.lineage(source)
    with open(source, "rb") as src:
        clone_or_copy(src.fileno(), fd, size, name)
    set_lineage(fd, store.id, known, "clean")
    return True


def build(store: Store, building: Path, final: Path, size: int, mode: int, fill) -> None:
    """A new image of ``size`` bytes (``mode``) at ``building``, filled by
    ``fill(fd)``, then renamed to ``final``; ``building`` never left."""
    building.unlink(missing_ok=True)
    try:
        fd = os.open(building, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.ftruncate(fd, size)
            fill(fd)
        finally:
            os.close(fd)
        os.rename(building, final)
    finally:
        building.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(path: Path, *, wait: bool | float, shared: bool = False):
    """The lock file ``path`` held (yields whether it was had: see
    ``acquire``)."""
    fd = acquire(path, wait=wait, shared=shared)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def acquire(path: Path, *, wait: bool | float, shared: bool = False) -> int | None:
    """The lock file ``path`` held: its descriptor, which closing lets go;
    None if it was not had (without ``wait``, while another holds it
    against this; with ``wait`` a number, if another still holds it after
    that many seconds)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    deadline = time.monotonic() + (wait if wait is not True else 0)
    try:
        while True:
            try:
                fcntl.flock(fd, mode | (0 if wait is True else fcntl.LOCK_NB))
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return None
                time.sleep(0.002)
    except BaseException:
        os.close(fd)
        raise
