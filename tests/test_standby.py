"""The standby memory image and the spares (blockdiff.vm.standby) on a real
XFS store: what a restore or a fork takes is, once brought to its snapshot,
that snapshot byte for byte, whatever came before; what it cannot trust it
does not take."""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import budget
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockdiff.store.lineage import forget_lineage
from blockdiff.store.retention import Policy
from blockdiff.store.store import Store
from blockdiff.vm import standby as standby_module
from blockdiff.vm.spares_worker import HeldAgainstStops
from blockdiff.vm.standby import (
    SPARES_WORKER,
    STANDBY_LOCK,
    STOP_WAIT,
    WORKER_READY,
    Standby,
    locked,
    may_raise_priority,
)

PAGE = 4096
PAGES = 96
SIZE = PAGES * PAGE


@pytest.fixture
def store(xfs):
    with Store.init(xfs / "store") as st:
        yield st


def digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def scribble(path, rnd: random.Random, pages: int) -> None:
    """Write random bytes over some pages of ``path`` (a guest writing RAM)."""
    fd = os.open(path, os.O_RDWR)
    try:
        for page in rnd.sample(range(PAGES), pages):
            os.pwrite(fd, rnd.randbytes(PAGE if rnd.random() < 0.8 else 100), page * PAGE)
    finally:
        os.close(fd)


def empty(path, size: int = SIZE):
    """A fork's new memory image: empty, at its size, 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


def snapshots(store: Store, work, rnd: random.Random, count: int) -> list:
    """``count`` snapshots of one image, each a few pages on from the last:
    ``(snapshot, sha256 of its bytes)``."""
    image = work / "committed.img"
    with open(image, "wb") as f:
        f.truncate(SIZE)
    taken = []
    for _ in range(count):
        scribble(image, rnd, rnd.randint(1, 12))
        taken.append((store.commit(image), digest(image)))
    return taken


def prepared_at_first(store: Store, xfs, rnd: random.Random, count: int):
    """A VM's standby and spares prepared at the first of ``count`` new
    snapshots (see ``snapshots``): ``(standby, snapshots)``."""
    taken = snapshots(store, xfs, rnd, count)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    standby.prepare(taken[0][0].id, taken[0][0].id)
    standby.wait()
    return standby, taken


def spares(standby: Standby):
    """Every spare of ``standby``, pair by pair, memory then disk."""
    return [spare for pair in standby.pairs for spare in (pair.memory, pair.disk)]


def test_a_standby_is_built_moved_taken_and_prepared_again(store, xfs):
    rnd = random.Random(7)
    (a, a_hash), (b, b_hash), (c, c_hash) = snapshots(store, xfs, rnd, 3)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    image = vm / "memory.img"

    standby.prepare(a.id)        # built from the layers
    standby.wait()
    assert standby.failure is None
    assert digest(standby.path) == a_hash and store.lineage(standby.path) == (a.id, "clean")
    assert stat.S_IMODE(os.stat(standby.path).st_mode) == 0o600   # guest RAM
    standby.prepare(c.id)        # moved in place
    standby.wait()
    assert digest(standby.path) == c_hash and store.lineage(standby.path) == (c.id, "clean")

    # A fork's image: a copy, the standby staying as it was.
    fork = empty(vm / "fork.img")
    other = xfs / "other.img"           # a snapshot sharing nothing with c
    other.write_bytes(rnd.randbytes(SIZE))
    assert not standby.copy_to(fork, SIZE, store.commit(other).id)   # filling costs less
    assert store.lineage(fork) == (None, "")
    assert standby.copy_to(fork, SIZE, c.id)
    assert digest(fork) == c_hash and store.lineage(fork) == (c.id, "clean")
    assert stat.S_IMODE(os.stat(fork).st_mode) == 0o600
    assert store.restore(a.id, fork).bytes < SIZE      # only where it differs
    assert digest(fork) == a_hash and digest(standby.path) == c_hash
    fork.unlink()
    small = empty(vm / "small.img", SIZE - PAGE)
    assert not standby.copy_to(small, SIZE - PAGE, c.id) and not standby.copy_to(small, SIZE, c.id)
    assert store.lineage(small) == (None, "")
    small.unlink()

    # A dead VM's image: its snapshot's, then written by its guest.
    store.restore(b.id, image)
    scribble(image, rnd, 20)
    dead = digest(image)
    assert standby.take(image, SIZE)
    assert digest(image) == c_hash and store.lineage(image) == (c.id, "clean")
    # The old image is the standby now, trusted by nobody until prepared.
    assert digest(standby.path) == dead and store.lineage(standby.path) == (None, "")
    assert not standby.take(vm / "other.img", SIZE)
    # What a restore then does: only where its extents and b's differ is
    # rewritten.
    result = store.restore(b.id, image)
    assert result.bytes < SIZE and digest(image) == b_hash

    standby.prepare(a.id)        # the old image compared whole
    standby.wait()
    assert standby.failure is None
    assert digest(standby.path) == a_hash and store.lineage(standby.path) == (a.id, "clean")
    assert sorted(p.name for p in vm.iterdir()) == [
        "memory.img", "memory.spare", "memory.spare-2", "memory.spare-2.lock",
        "memory.spare.lock", "memory.standby", STANDBY_LOCK]


def test_forks_take_the_spares_which_are_then_made_anew(store, xfs):
    rnd = random.Random(9)
    (a, a_hash), (b, b_hash), (c, c_hash) = snapshots(store, xfs, rnd, 3)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    memory, disk = standby.pairs[0].memory, standby.pairs[0].disk

    standby.prepare(a.id, b.id)          # built: a clone of the standby, from the layers
    standby.wait()
    assert standby.failure is None and standby.spares_failure is None
    assert digest(memory.path) == a_hash and store.lineage(memory.path) == (a.id, "clean")
    assert digest(disk.path) == b_hash and store.lineage(disk.path) == (b.id, "clean")
    assert stat.S_IMODE(os.stat(memory.path).st_mode) == 0o600        # guest RAM
    standby.prepare(c.id, c.id)          # both moved in place
    standby.wait()
    assert digest(memory.path) == c_hash and digest(disk.path) == c_hash

    fork = xfs / "fork"
    fork.mkdir()
    assert not memory.give(fork / "memory.img", SIZE + PAGE)          # another size
    lock = os.open(memory.lock_path, os.O_RDWR)                       # being moved elsewhere
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert not memory.give(fork / "memory.img", SIZE)
    finally:
        os.close(lock)
    assert not list(fork.iterdir())
    assert memory.give(fork / "memory.img", SIZE)
    assert disk.give(empty(fork / "disk.img"), SIZE)                  # over the empty disk
    assert not memory.path.exists() and not disk.path.exists()
    assert not memory.give(fork / "other.img", SIZE)                  # none left
    for image in ("memory.img", "disk.img"):
        assert store.lineage(fork / image) == (c.id, "clean")
        assert store.restore(a.id, fork / image).bytes < SIZE
        assert digest(fork / image) == a_hash
    assert digest(standby.path) == c_hash                            # the standby stays

    standby.prepare_spares(b.id, a.id)   # anew: the standby cloned, the layers
    standby.wait()
    assert standby.spares_failure is None
    assert digest(memory.path) == b_hash and store.lineage(memory.path) == (b.id, "clean")
    assert digest(disk.path) == a_hash and store.lineage(disk.path) == (a.id, "clean")
    forget_lineage(disk.path)            # a move cut short: replaced, not trusted
    assert not disk.give(fork / "disk2.img", SIZE)
    standby.prepare(c.id, b.id)
    standby.wait()
    assert digest(disk.path) == b_hash and store.lineage(disk.path) == (b.id, "clean")
    # Once a fork took it, the memory spare by default a clone of the standby.
    assert memory.give(fork / "memory2.img", SIZE)
    standby.prepare_spares(None)
    standby.wait()
    assert standby.spares_failure is None
    assert digest(memory.path) == c_hash and store.lineage(memory.path) == (c.id, "clean")
    assert not [p.name for p in vm.iterdir() if p.name.startswith(".")]


def test_forks_in_a_row_take_a_pair_each_and_only_the_pairs_taken_are_made_anew(store, xfs):
    rnd = random.Random(12)
    (a, a_hash), (b, b_hash), (c, c_hash) = snapshots(store, xfs, rnd, 3)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    first, second = standby.pairs
    standby.prepare(c.id, c.id)
    standby.wait()
    assert standby.spares_failure is None
    assert all(store.lineage(spare.path) == (c.id, "clean") for spare in spares(standby))

    fork = xfs / "fork"
    fork.mkdir()
    # The first pair is being made anew (its memory spare's lock held):
    # the next fork takes the second pair, both of its spares.
    lock = os.open(first.memory.lock_path, os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert standby.give_spares(fork / "m1", SIZE, empty(fork / "d1"), SIZE) == (True, True)
    finally:
        os.close(lock)
    assert not second.memory.path.exists() and not second.disk.path.exists()
    assert first.memory.ready() and first.disk.ready()
    # Only the pair taken is made anew (the memory spare a clone of the
    # standby, the disk at the fork's snapshot); the other stays at c.
    standby.prepare_spares(None, a.id, missing_only=True)
    standby.wait()
    assert standby.spares_failure is None
    assert store.lineage(second.memory.path) == (c.id, "clean")
    assert digest(second.memory.path) == c_hash
    assert store.lineage(second.disk.path) == (a.id, "clean")
    assert digest(second.disk.path) == a_hash
    assert all(store.lineage(spare.path) == (c.id, "clean") for spare in (first.memory, first.disk))

    # Two forks take both pairs; a third finds none, and nothing changed.
    assert standby.give_spares(fork / "m2", SIZE, empty(fork / "d2"), SIZE) == (True, True)
    assert standby.give_spares(fork / "m3", SIZE, empty(fork / "d3"), SIZE) == (True, True)
    assert standby.give_spares(fork / "m4", SIZE, empty(fork / "d4"), SIZE) == (False, False)
    assert (fork / "d4").read_bytes() == bytes(SIZE) and not (fork / "m4").exists()
    # A disk spare without its memory spare is still given.
    standby.prepare_spares(None, b.id, missing_only=True)
    standby.wait()
    assert first.memory.give(fork / "m5", SIZE)
    assert standby.give_spares(fork / "m6", SIZE, empty(fork / "d6"), SIZE) == (True, True)
    assert standby.give_spares(fork / "m7", SIZE, empty(fork / "d7"), SIZE) == (False, True)
    # Each one given restores to any snapshot, rewriting only what differs.
    for name in ("m1", "d1", "m2", "d2", "m3", "d3", "m6", "d6", "d7"):
        assert store.lineage(fork / name)[1] == "clean"
        assert store.restore(b.id, fork / name).bytes < SIZE
        assert digest(fork / name) == b_hash
    assert not [p.name for p in vm.iterdir() if p.name.startswith(".")]


def test_spares_asked_for_in_a_row_end_where_the_last_asked(store, xfs):
    """Checkpoints faster than the spares move: one thread at a time, which
    skips to the last snapshot asked for instead of a backlog of moves."""
    standby, taken = prepared_at_first(store, xfs, random.Random(11), 6)
    threads = threading.active_count()
    for snap, _ in taken[1:]:
        standby.prepare_spares(snap.id, snap.id, idle=True)
        assert threading.active_count() <= threads + 1
    standby.wait()
    assert standby.spares_failure is None and threading.active_count() == threads
    last, last_hash = taken[-1]
    for spare in spares(standby):
        assert digest(spare.path) == last_hash and store.lineage(spare.path) == (last.id, "clean")


def test_spares_moved_beside_a_removal_never_give_wrong_bytes(store, xfs):
    """Snapshots removed (and the store's gc run) while the spares are moved
    from one to the next: a spare given is either trusted and right, or not
    trusted (a restore then compares it whole) and still right."""
    standby, taken = prepared_at_first(store, xfs, random.Random(10), 8)
    keep = taken[-1]
    failed = []

    def remove() -> None:
        try:
            for snap, _ in taken[1:-1]:
                store.rm(snap.id)
                store.gc(Policy(keep_within=3600))   # keeps the rest, sweeps files
        except Exception as e:   # noqa: BLE001 - reported by the test
            failed.append(e)

    removing = threading.Thread(target=remove)
    removing.start()
    for snap, _ in taken[1:-1]:
        standby.prepare(snap.id, snap.id)    # fails quietly once snap is gone
    removing.join()
    standby.wait()
    assert not failed
    for n, spare in enumerate(spares(standby)):
        image = xfs / f"fork{n}.img"
        if not spare.give(image, SIZE):
            empty(image)
        store.restore(keep[0].id, image)
        assert digest(image) == keep[1]
    assert store.verify() == {}


def test_bytes_written_to_the_standby_or_a_spare_are_never_handed_back(store, xfs):
    """A disk error, another process or an operator writes the standby and
    the spares behind their lineage's back: a restore's ``bring`` and a
    fork's restore of a spare rewrite what their extents say was written,
    from the layers, and give the snapshot byte for byte."""
    rnd = random.Random(21)
    standby, ((a, _), (b, b_hash)) = prepared_at_first(store, xfs, rnd, 2)
    copies = [standby.path] + [spare.path for spare in spares(standby)]
    for path in copies:
        fd = os.open(path, os.O_RDWR)
        try:
            for page in (0, PAGES // 2, PAGES - 1):       # in data and in holes
                at = page * PAGE + rnd.randrange(PAGE)
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x10]), at)
        finally:
            os.close(fd)
        assert store.lineage(path) == (a.id, "clean")     # which vouches for nothing
        assert store.unlike(a.id, path) >= 3 * PAGE

    image = standby.path.with_name("memory.img")
    assert standby.bring(b.id)
    assert standby.take(image, SIZE) and digest(image) == b_hash
    fork = xfs / "fork"
    fork.mkdir()
    for n, spare in enumerate(spares(standby)):
        assert spare.give(fork / f"{n}.img", SIZE)
        store.restore(b.id, fork / f"{n}.img")
        assert digest(fork / f"{n}.img") == b_hash
        assert store.unlike(b.id, fork / f"{n}.img") == 0


def test_a_standby_brought_stays_locked_until_taken_or_released(store, xfs):
    """Between a restore's ``bring`` and its ``take`` the spares' thread,
    which clones the standby under a shared hold, would make the take
    fail, and the restore do without the standby."""
    rnd = random.Random(13)
    (a, _), (b, b_hash) = snapshots(store, xfs, rnd, 2)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    standby.prepare(a.id)
    standby.wait()
    image = vm / "memory.img"
    store.restore(a.id, image)
    assert standby.bring(b.id)
    with locked(vm / STANDBY_LOCK, wait=False, shared=True) as had:
        assert not had
    assert standby.take(image, SIZE)
    assert digest(image) == b_hash and store.lineage(image) == (b.id, "clean")
    with locked(vm / STANDBY_LOCK, wait=False) as had:
        assert had
    # Brought, then not taken (the restore failed in between): let go.
    standby.prepare(a.id)
    standby.wait()
    assert standby.bring(b.id)
    standby.release()
    with locked(vm / STANDBY_LOCK, wait=False) as had:
        assert had


def worker_state(pid: int) -> str:
    """Process ``pid``'s state, once it is not running (a signal takes effect
    when it next leaves the kernel)."""
    for _ in range(200):
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        if state != "R":
            return state
        time.sleep(0.01)
    return state


def test_a_fork_stops_the_spares_worker_meanwhile(store, xfs):
    standby, taken = prepared_at_first(store, xfs, random.Random(14), 2)
    later = taken[1][0].id
    lock = os.open(standby.pairs[0].memory.lock_path, os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)       # the worker waits for it, alive
        standby.prepare_spares(later, later)
        time.sleep(0.3)
        worker = SPARES_WORKER.pid
        assert worker is not None and worker != os.getpid()
        with standby.yielding():
            assert worker_state(worker) == "T"
            with standby.yielding():           # two forks at once
                pass
            assert worker_state(worker) == "T"
        assert worker_state(worker) != "T"
    finally:
        os.close(lock)
    standby.wait()
    assert standby.spares_failure is None
    assert all(store.lineage(spare.path) == (later, "clean") for spare in spares(standby))
    # Idle, it holds no file of the store's filesystem.
    held = [os.readlink(f) for f in Path(f"/proc/{worker}/fd").iterdir()]
    assert not [path for path in held if path.startswith(str(xfs))]
    assert os.readlink(f"/proc/{worker}/cwd") == "/"


def test_gc_waits_for_a_worker_stopped_with_the_store_lock_while_a_fork_goes_on(store, xfs):
    # A spare's move holds the store's lock shared while it reflinks: two
    # thousand scattered pages keep it there long enough to be stopped in it.
    size, pages = 32 << 20, 2000
    image = xfs / "big.img"
    with open(image, "wb") as f:
        f.write(random.Random(21).randbytes(size))
    first = store.commit(image)
    rnd = random.Random(22)
    fd = os.open(image, os.O_RDWR)
    for page in rnd.sample(range(size // PAGE), pages):
        os.pwrite(fd, rnd.randbytes(PAGE), page * PAGE)
    os.close(fd)
    second, second_hash = store.commit(image), digest(image)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    standby.prepare(first.id, first.id)
    standby.wait()

    def store_lock_held() -> bool:
        with locked(store.lock.path, wait=False) as had:
            return not had

    removed = []

    def collect() -> None:
        with Store(store.root) as other:
            removed.append(other.gc(Policy(keep_last=100)))

    gc = threading.Thread(target=collect)
    try:
        standby.prepare_spares(second.id)
        deadline = time.monotonic() + 30
        while not store_lock_held():
            assert time.monotonic() < deadline, "the worker never took the store's lock"
            time.sleep(0.0002)
        with standby.yielding():
            assert worker_state(SPARES_WORKER.pid) == "T" and store_lock_held()
            gc.start()                  # waits for the stopped worker
            time.sleep(0.3)
            assert gc.is_alive()
            # A fork's own work needs the lock only shared: granted beside
            # the waiting gc, as the catalog's write lock is.
            store.restore(second.id, xfs / "fork.img")
            assert digest(xfs / "fork.img") == second_hash
            forked = store.commit(xfs / "fork.img")
            assert gc.is_alive()
        gc.join(30)
        assert not gc.is_alive() and removed[0].removed == []
    finally:
        if gc.ident is not None:
            gc.join(30)
    standby.wait()
    assert standby.spares_failure is None
    for pair in standby.pairs:
        assert store.lineage(pair.memory.path) == (second.id, "clean")
        assert digest(pair.memory.path) == second_hash
    assert store.get(forked.id) is not None and store.verify() == {}


def test_the_spares_worker_is_not_stopped_inside_a_catalog_transaction(store, xfs):
    standby, taken = prepared_at_first(store, xfs, random.Random(17), 2)
    later = taken[1][0].id
    lock = os.open(standby.pairs[0].memory.lock_path, os.O_RDWR)
    stop_lock = None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)       # the worker waits for it, alive
        standby.prepare_spares(later, later)
        time.sleep(0.3)
        worker = SPARES_WORKER.pid
        # As the worker holds it in a statement or a transaction.
        stop_lock = os.open(SPARES_WORKER._stop_lock_path, os.O_RDWR)
        fcntl.flock(stop_lock, fcntl.LOCK_SH)
        began = time.monotonic()
        with standby.yielding():
            assert time.monotonic() - began >= STOP_WAIT
            assert worker_state(worker) != "T"
        os.close(stop_lock)
        stop_lock = None
        with standby.yielding():
            assert worker_state(worker) == "T"
        assert worker_state(worker) != "T"
    finally:
        for fd in (lock, stop_lock):
            if fd is not None:
                os.close(fd)
    standby.wait()
    assert standby.spares_failure is None


ORPHAN = """
import sys, time
from pathlib import Path
from blockdiff.store.store import Store
from blockdiff.vm.standby import SPARES_WORKER, Standby
standby = Standby(Store(sys.argv[1]), Path(sys.argv[2]))
standby.prepare_spares(sys.argv[3], sys.argv[3])
while SPARES_WORKER.pid is None:   # until it may be stopped
    time.sleep(0.01)
time.sleep(0.2)                    # at the spare's lock, likely
with standby.yielding():
    print(SPARES_WORKER.pid, flush=True)
    time.sleep(600)
"""


def test_a_worker_stopped_when_its_process_dies_finishes_and_exits(store, xfs):
    standby, taken = prepared_at_first(store, xfs, random.Random(20), 2)
    later = taken[1][0].id
    lock = os.open(standby.pairs[0].memory.lock_path, os.O_RDWR)
    parent = worker = None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)       # the worker waits for it, alive
        parent = subprocess.Popen([sys.executable, "-c", ORPHAN, str(store.root),
                                   str(standby.path.parent), later], stdout=subprocess.PIPE,
                                  text=True)
        worker = int(parent.stdout.readline())
        assert worker_state(worker) == "T"
        parent.kill()                          # dies with its worker stopped
        parent.wait()
        # Let go on by its parent-death signal, it still waits for the lock.
        assert worker_state(worker) != "T"
        fcntl.flock(lock, fcntl.LOCK_UN)
        for _ in range(1000):                  # its request done, it sees the end of its input
            if not Path(f"/proc/{worker}").exists():
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the worker did not exit")
    finally:
        os.close(lock)
        if parent is not None and parent.poll() is None:
            parent.kill()
            parent.wait()
        if worker is not None and Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)   # a failure's: not left stopped
    assert all(store.lineage(spare.path) == (later, "clean") for spare in spares(standby))


def test_a_worker_whose_parent_is_gone_before_it_is_ready_exits_unready(tmp_path):
    # Its parent-death signal set too late to come, it would otherwise wait on
    # a pipe nobody writes, or stay stopped; pid 1 stands for a parent gone.
    lock = tmp_path / "stop.lock"
    lock.touch()
    worker = subprocess.run(
        [sys.executable, "-c", "import sys; from blockdiff.vm.spares_worker import main; "
         "main(sys.argv[1], 1)", str(lock)],
        input="", capture_output=True, text=True, timeout=60)
    assert (worker.returncode, worker.stdout) == (0, "")
    ready = subprocess.run(
        [sys.executable, "-c", "import os, sys; from blockdiff.vm.spares_worker import main; "
         "main(sys.argv[1], os.getppid())", str(lock)],
        input="", capture_output=True, text=True, timeout=60)
    assert (ready.returncode, ready.stdout) == (0, WORKER_READY + "\n")


def test_the_workers_catalog_lock_holds_the_stop_lock_outermost(tmp_path):
    path = tmp_path / "stop.lock"
    path.touch()
    inner = threading.RLock()
    held = HeldAgainstStops(inner, str(path))

    def free() -> bool:
        with locked(path, wait=False) as had:
            return had

    assert free()
    with held:
        assert not free()
        with held:                         # a statement in a transaction
            assert not free()
        assert not free()
    assert free()
    # Another thread waits for the catalog's lock first, as before.
    with held:
        entered = threading.Event()
        thread = threading.Thread(target=lambda: (held.__enter__(), entered.set(),
                                                  held.__exit__(None, None, None)))
        thread.start()
        assert not entered.wait(0.1)
    thread.join(5)
    assert entered.is_set() and free()


def test_spares_of_a_store_opened_by_a_relative_path(store, xfs, monkeypatch):
    # The worker runs in /: what it is asked names the store and the VM
    # absolutely.
    taken = snapshots(store, xfs, random.Random(18), 1)
    monkeypatch.chdir(xfs)
    (xfs / "vm").mkdir()
    with Store("store") as relative:
        standby = Standby(relative, Path("vm"))
        standby.prepare(taken[0][0].id, taken[0][0].id)
        standby.wait()
        assert standby.failure is None and standby.spares_failure is None
    assert all(store.lineage(xfs / spare.path) == (taken[0][0].id, "clean")
               for spare in spares(standby))


def test_a_child_forked_after_the_worker_started_starts_its_own(store, xfs):
    prepared_at_first(store, xfs, random.Random(19), 1)
    worker = SPARES_WORKER.pid
    assert worker is not None
    child = os.fork()
    if child == 0:
        os._exit(0 if SPARES_WORKER.pid is None and SPARES_WORKER._stop_lock is None else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert SPARES_WORKER.pid == worker


def test_idle_spares_are_prepared_at_the_lowest_priority(store, xfs):
    if not may_raise_priority():
        pytest.skip("needs CAP_SYS_NICE to give the worker its priority back")
    standby, taken = prepared_at_first(store, xfs, random.Random(16), 3)
    lock = os.open(standby.pairs[0].memory.lock_path, os.O_RDWR)
    try:
        for snapshot, idle in ((taken[1][0].id, True), (taken[2][0].id, False)):
            fcntl.flock(lock, fcntl.LOCK_EX)   # the worker waits for it, alive
            standby.prepare_spares(snapshot, snapshot, idle=idle)
            time.sleep(0.3)
            nice = os.getpriority(os.PRIO_PROCESS, SPARES_WORKER.pid)
            assert nice == 19 if idle else nice < 19
            fcntl.flock(lock, fcntl.LOCK_UN)
            standby.wait()
            assert standby.spares_failure is None
    finally:
        os.close(lock)
    # The process's own threads keep their priority.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19


def test_a_worker_left_idle_is_replaced_where_its_priority_cannot_be_given_back(
        store, xfs, monkeypatch):
    standby, taken = prepared_at_first(store, xfs, random.Random(23), 3)
    monkeypatch.setattr(standby_module, "may_raise_priority", lambda: False)
    standby.prepare_spares(taken[1][0].id, taken[1][0].id, idle=True)
    standby.wait()
    idle = SPARES_WORKER.pid
    assert os.getpriority(os.PRIO_PROCESS, idle) == 19
    standby.prepare_spares(taken[2][0].id, taken[2][0].id)
    standby.wait()
    assert standby.spares_failure is None
    assert SPARES_WORKER.pid not in (None, idle) and not Path(f"/proc/{idle}").exists()
    assert os.getpriority(os.PRIO_PROCESS, SPARES_WORKER.pid) < 19
    assert all(store.lineage(spare.path) == (taken[2][0].id, "clean")
               for spare in spares(standby))


def test_the_spawner_thread_hands_back_any_error_and_spawns_on():
    # Its error raised where the worker was asked for, not lost with the
    # thread (which would leave the asking thread waiting for good).
    with pytest.raises(TypeError):
        SPARES_WORKER._spawn(["true"], no_such_argument=1)
    process = SPARES_WORKER._spawn(["true"])
    assert process.wait(30) == 0


def test_a_worker_that_never_says_it_is_ready_is_killed_and_reported(tmp_path, monkeypatch):
    # One hung before its first line would otherwise hold up the spares'
    # thread, and this process's exit, for good.
    SPARES_WORKER.close()
    hanging = tmp_path / "python"
    hanging.write_text("#!/bin/sh\nexec sleep 600\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(hanging))
    monkeypatch.setattr(standby_module, "READY_WAIT", 0.5)
    spawned = []
    spawn = SPARES_WORKER._spawn

    def spawn_and_keep(*args, **kwargs):
        spawned.append(spawn(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(SPARES_WORKER, "_spawn", spawn_and_keep)
    began = time.monotonic()
    failure = SPARES_WORKER.run({}, idle=False)
    assert "did not say it was ready within 0.5 s" in str(failure)
    assert time.monotonic() - began < 5
    (process,) = spawned
    assert process.returncode == -signal.SIGKILL      # killed and reaped
    assert not Path(f"/proc/{process.pid}").exists()
    assert SPARES_WORKER.pid is None


def test_a_worker_let_go_while_a_fork_has_it_stopped_exits_at_once(store, xfs):
    prepared_at_first(store, xfs, random.Random(24), 1)
    worker = SPARES_WORKER.pid
    with SPARES_WORKER.stopped():
        assert worker_state(worker) == "T"
        began = time.monotonic()
        SPARES_WORKER.close()
        assert time.monotonic() - began < 5 and not Path(f"/proc/{worker}").exists()
    assert SPARES_WORKER.pid is None


def test_the_spares_worker_reports_a_failure_and_is_started_anew_if_it_dies(store, xfs):
    standby, taken = prepared_at_first(store, xfs, random.Random(15), 2)
    later = taken[1][0].id
    standby.prepare_spares("no-such-snapshot", None)
    standby.wait()
    assert "preparing the spares" in str(standby.spares_failure)
    # Killed during a request (waiting for a spare's lock): reported.
    lock = os.open(standby.pairs[0].memory.lock_path, os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        standby.prepare_spares(later, later)
        time.sleep(0.3)
        worker = SPARES_WORKER.pid
        os.kill(worker, signal.SIGKILL)
        standby.wait()
    finally:
        os.close(lock)
    assert "worker process failed" in str(standby.spares_failure)
    standby.prepare_spares(later, later)        # a new worker
    standby.wait()
    assert SPARES_WORKER.pid not in (None, worker)
    assert standby.spares_failure is None
    assert all(store.lineage(spare.path) == (later, "clean") for spare in spares(standby))


def test_a_standby_that_cannot_be_trusted_is_not_taken(store, xfs):
    rnd = random.Random(8)
    (a, a_hash), (b, _) = snapshots(store, xfs, rnd, 2)
    vm = xfs / "vm"
    vm.mkdir()
    standby = Standby(store, vm)
    image = vm / "memory.img"
    store.restore(b.id, image)
    before = digest(image)

    assert not standby.take(image, SIZE)                  # none yet
    standby.prepare(a.id)
    standby.wait()
    assert not standby.take(image, SIZE + PAGE)           # another machine's size
    lock = os.open(vm / STANDBY_LOCK, os.O_RDWR)          # being prepared elsewhere
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert not standby.take(image, SIZE)
        fork = empty(vm / "fork.img")
        assert not standby.copy_to(fork, SIZE, a.id)
        assert store.lineage(fork) == (None, "") and open(fork, "rb").read() == bytes(SIZE)
        fork.unlink()
    finally:
        os.close(lock)
    forget_lineage(standby.path)                          # a preparation cut short
    assert not standby.take(image, SIZE)
    standby.prepare(a.id)
    standby.wait()
    store.rm(a.id)                                        # its snapshot removed
    assert not standby.take(image, SIZE)
    assert digest(image) == before

    standby.prepare("no-such-snapshot")                   # fails quietly, leaves nothing
    standby.wait()
    assert standby.failure is not None
    assert not any(p.name.startswith(".") for p in vm.iterdir())
    standby.prepare(b.id)                                 # and the next one builds again
    standby.wait()
    assert standby.failure is None and standby.take(image, SIZE)


@settings(max_examples=budget.examples(20), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1),
       steps=st.lists(st.tuples(st.sampled_from(["prepare", "restore", "checkpoint", "fork",
                                                 "spares", "damage"]),
                                st.integers(0, 5)), min_size=1, max_size=12))
def test_restores_through_the_standby_always_give_the_snapshot(store, xfs, seed, steps):
    """Random checkpoints, restores, forks and preparations of a VM's memory
    image, the guest writing it between them, as a sandbox does, and bytes
    of the standby or a spare written behind their backs (a disk error,
    another process): every restore through the standby, and every fork
    through a spare or a copy of the standby, gives its snapshot byte for
    byte."""
    rnd = random.Random(seed)
    vm = Path(tempfile.mkdtemp(dir=xfs))
    standby = Standby(store, vm)
    image = vm / "memory.img"
    with open(image, "wb") as f:
        f.truncate(SIZE)
    taken = [(store.commit(image), digest(image))]
    for op, k in steps:
        snap, want = taken[k % len(taken)]
        if op in ("prepare", "spares"):
            other = taken[rnd.randrange(len(taken))][0]     # the disk's snapshot
            if op == "prepare":
                standby.prepare(snap.id, other.id)
            else:
                standby.prepare_spares(snap.id, other.id)
            standby.wait()
            assert standby.failure is None and standby.spares_failure is None
        elif op == "checkpoint":
            scribble(image, rnd, rnd.randint(1, 10))
            taken.append((store.commit(image), digest(image)))
        elif op == "damage":
            there = [p for p in [standby.path] + [x.path for x in spares(standby)] if p.exists()]
            if there:
                fd = os.open(rnd.choice(there), os.O_RDWR)
                try:
                    at = rnd.randrange(SIZE)
                    os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1 << rnd.randrange(8)]), at)
                finally:
                    os.close(fd)
        elif op == "fork":
            fork, disk = vm / "fork.img", empty(vm / "disk.img")
            memory_given, _ = standby.give_spares(fork, SIZE, disk, SIZE)
            if not memory_given:
                empty(fork)
                standby.copy_to(fork, SIZE, snap.id)
            store.restore(snap.id, fork)
            store.restore(snap.id, disk)
            assert digest(fork) == want and digest(disk) == want
            fork.unlink()
            disk.unlink()
            if k % 2:           # the pair taken made anew, as after a sandbox's fork
                standby.prepare_spares(None, snap.id, missing_only=True)
                standby.wait()
                assert standby.spares_failure is None
        else:
            # As a sandbox's restore does: the standby brought while QEMU
            # stops, taken, and the image restored unless it was brought.
            standby.bring(snap.id)
            try:
                if (not standby.take(image, SIZE)
                        or store.lineage(image) != (snap.id, "clean")):
                    store.restore(snap.id, image)
            finally:
                standby.release()
            assert digest(image) == want
            scribble(image, rnd, rnd.randint(0, 10))   # the guest runs on
