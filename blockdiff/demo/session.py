"""The main job, end to end, on an embedded default: commit a VM disk image to
a snapshot store after every agent step, then restore a step in place, fork
two branches from another, and carry snapshots to a second store on another
filesystem as a new host would. Then the same with a real sandbox VM: an
agent's commands run in a QEMU guest, the VM is checkpointed after each step,
put back to an earlier step while it runs, and forked.

Runs on a scratch XFS made on a loop device (or in a directory you give on a
reflink filesystem). Every snapshot is restored (as a fork, and the one put
back in place) and checked byte for byte against a SHA-256 taken of the live
disk when it was committed, and so are the branches and the import. In the VM
part the guest's files are checked after each restore and fork, and the VM's
last snapshot byte for byte against its disk. A check that fails raises
``DemoCheckFailed`` (exit status 7 from ``blockdiff demo``), whatever Python's
``-O``. Progress is reported through a callback; this module never prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from blockdiff import native
from blockdiff.demo import scratch
from blockdiff.engine.identity import sha256_file
from blockdiff.errors import DemoCheckFailed

MiB = 1 << 20
# What the sandbox VM and its fork hold on the scratch filesystem while they
# run (each one's RAM and disk holding blocks of their own, the room a
# checkpoint keeps free: blockdiff.vm.reserve) beside their checkpoints. The
# backing file is sparse: only what is written takes space.
VM_ROOM = 2048 * MiB
BLOCK = 4096


def check(condition: bool, message: str) -> None:
    """A real check (not an ``assert``, which ``python3 -O`` drops)."""
    if not condition:
        raise DemoCheckFailed(f"demo check failed: {message}")


@dataclass
class Event:
    """One line of the demo's report."""

    what: str
    seconds: float = 0.0
    detail: str = ""


def _random_data(rng: random.Random, n: int) -> bytes:
    return hashlib.shake_128(rng.getrandbits(128).to_bytes(16, "little")).digest(n)


# Agent steps as a VM sees them: what the guest does to its disk.

def _install_packages(fd: int, size: int, rng: random.Random) -> str:
    offset = rng.randrange(size // 4, size // 2) // BLOCK * BLOCK
    os.pwrite(fd, _random_data(rng, 24 * MiB), offset)
    return "pip install: 24 MiB written sequentially"


def _edit_files(fd: int, size: int, rng: random.Random) -> str:
    for _ in range(300):
        os.pwrite(fd, _random_data(rng, BLOCK), rng.randrange(size // BLOCK) * BLOCK)
    return "edit sources: 300 scattered 4 KiB writes"


def _delete_build(fd: int, size: int, rng: random.Random) -> str:
    offset = rng.randrange(size // 2) // BLOCK * BLOCK
    native.zero_ranges(fd, [offset], [16 * MiB], "disk")
    return "rm -rf build/ + fstrim: 16 MiB discarded (holes)"


def _append_logs(fd: int, size: int, rng: random.Random) -> str:
    grow = rng.randrange(1, 64) * BLOCK + rng.randrange(1, BLOCK)
    os.pwrite(fd, _random_data(rng, grow), size)
    return f"run tests: logs grow the disk by {grow} bytes"


def _database(fd: int, size: int, rng: random.Random) -> str:
    for _ in range(2000):
        os.pwrite(fd, _random_data(rng, 512), rng.randrange(size // 512) * 512)
    return "database: 2000 random 512-byte writes"


STEPS: list[Callable[[int, int, random.Random], str]] = [
    _install_packages, _edit_files, _append_logs, _delete_build, _database, _edit_files,
]


def _make_disk(path: Path, size: int, rng: random.Random) -> None:
    """A freshly installed system: most of the disk written, some of it never."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset in range(0, size, 4 * MiB):
            if rng.random() < 0.75:
                f.seek(offset)
                f.write(_random_data(rng, min(4 * MiB, size - offset)))
        f.flush()
        os.fsync(f.fileno())


def run(workdir: str | os.PathLike | None = None, *, size: int = 512 * MiB, steps: int = 6,
        seed: int = 1, vm: bool = True, vm_image: str | os.PathLike | None = None,
        report: Callable[[Event], None] = lambda e: None) -> list[Event]:
    """Run the demo; returns (and reports as they happen) its events.

    Without ``workdir`` it makes a scratch XFS on a loop device (needs root).
    With ``vm``, a sandbox VM built into ``vm_image`` (default: a cache
    directory) runs agent steps too. Raises ``DemoCheckFailed`` if anything
    restored differs from what was snapshotted.
    """
    from blockdiff.engine.view import render_tree
    from blockdiff.store.store import Store

    events: list[Event] = []

    def emit(what: str, seconds: float = 0.0, detail: str = "") -> None:
        events.append(Event(what, seconds, detail))
        report(events[-1])

    def timed(fn):
        start = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - start

    with contextlib.ExitStack() as stack:
        if workdir is None:
            root = stack.enter_context(
                scratch.mounted_filesystem("xfs", size=4 * size + 512 * MiB
                                           + (VM_ROOM if vm else 0)))
            emit("scratch XFS (reflink=1) on a loop device", detail=str(root))
        else:
            root = Path(workdir)
        rng = random.Random(seed)
        store = stack.enter_context(Store.init(root / "store"))
        disk = root / "disk.img"
        _make_disk(disk, size, rng)
        snap, seconds = timed(lambda: store.commit(disk, message="boot"))
        emit(f"step 0: commit of the freshly installed {size // MiB} MiB disk", seconds)
        snaps, digests = [snap], {snap.id: sha256_file(disk)}

        for step in range(1, steps + 1):
            with open(disk, "r+b") as f:
                what = STEPS[(step - 1) % len(STEPS)](f.fileno(), os.fstat(f.fileno()).st_size, rng)
                os.fsync(f.fileno())
            snap, seconds = timed(lambda: store.commit(disk, message=what))
            digests[snap.id] = sha256_file(disk)
            snaps.append(snap)
            emit(f"step {step}: {what}", seconds,
                 f"commit {snap.id}: {snap.ranges} ranges, {snap.changed_bytes // 1024} KiB")

        # Every step, restored into a new file, is the disk as it was committed.
        probe = root / "step-check.img"
        start = time.perf_counter()
        for step, snap in enumerate(snaps):
            store.restore(snap.id, probe)
            check(sha256_file(probe) == digests[snap.id],
                  f"step {step} ({snap.id}) restored differs from the disk it was committed from")
        probe.unlink()
        emit(f"restore every step 0-{steps} into a new file", time.perf_counter() - start,
             "each compared byte for byte (SHA-256) with the disk as it was committed")

        # Time travel: put the live disk back to an earlier step, in place.
        back = snaps[max(1, steps // 2)]
        result, seconds = timed(lambda: store.restore(back.id, disk))
        check(sha256_file(disk) == digests[back.id],
              f"the live disk restored in place to {back.id} differs from that step")
        emit(f"restore {back.id} ({back.message}) into the live disk", seconds,
             f"{result.ranges} ranges rewritten; verified byte for byte")

        # Fork: branches from one step, each changing and committing on its own.
        base = snaps[max(1, steps // 3)]
        for branch in ("a", "b"):
            live = root / f"fork-{branch}.img"
            result, seconds = timed(lambda: store.restore(base.id, live))
            with open(live, "r+b") as f:
                what = _edit_files(f.fileno(), os.fstat(f.fileno()).st_size, rng)
                os.fsync(f.fileno())
            expected = sha256_file(live)
            tip = store.commit(live, message=f"branch {branch}: {what}")
            digests[tip.id] = expected
            probe = root / f"check-{branch}.img"
            store.restore(tip.id, probe)
            check(sha256_file(probe) == expected, f"fork {branch} ({tip.id}) restored differs")
            emit(f"fork {branch} from {base.id}", seconds,
                 f"then {what}; committed as {tip.id} and verified")
        emit("the snapshot tree", detail=render_tree(store.log()).replace("\n", "\n" + " " * 13))

        # Another host: a second store on btrfs receives the last step, whole,
        # then the steps after a fork point as an incremental export.
        other_fs = stack.enter_context(
            scratch.mounted_filesystem("btrfs", size=2 * size + 512 * MiB))
        other = stack.enter_context(Store.init(other_fs / "store"))
        first, last = snaps[1], snaps[-1]
        start = time.perf_counter()
        store.export(first.id, root / "first.bdx")
        store.export(last.id, root / "last.bdx", since=first.id)
        for name in ("first.bdx", "last.bdx"):
            with open(root / name, "rb") as s, open(other_fs / name, "wb") as d:
                native.copy_sparse(s.fileno(), d.fileno(), os.fstat(s.fileno()).st_size, d.name)
        other.import_(other_fs / "first.bdx")
        other.import_(other_fs / "last.bdx")
        other.restore(last.id, other_fs / "disk.img")
        seconds = time.perf_counter() - start
        check(sha256_file(other_fs / "disk.img") == digests[last.id],
              f"the imported snapshot {last.id}, restored on btrfs, differs")
        emit(f"export step 1 whole and steps 2-{steps} as one increment, import on btrfs",
             seconds, f"{os.path.getsize(root / 'last.bdx') // 1024} KiB increment; "
             f"restored there and verified")
        problems = store.verify()
        check(not problems, f"verify found damage: {problems}")
        emit("verify: catalog and every checksum consistent")

        # For scale: what one full copy of the disk costs.
        start = time.perf_counter()
        subprocess.run(["cp", "--reflink=never", str(disk), str(root / "full-copy.img")],
                       check=True)
        with open(root / "full-copy.img", "rb") as f:
            os.fsync(f.fileno())
        emit("for comparison: one full copy of the disk", time.perf_counter() - start)
        ran_vm = vm and _sandbox_steps(store, root, vm_image, emit, timed)
        emit("all snapshots, restores and forks verified byte for byte"
             + ("; the VM's restores and fork by the guest's files" if ran_vm else ""))
    return events


# What an agent does in its sandbox, step by step: a shell command each.
GUEST_STEPS = [
    ("write a project", "mkdir -p /work && cd /work && "
                        "printf 'print(\"hello\")\\n' > app.py && echo v1 > VERSION"),
    # The step starts a dev server: a process, alive only in the guest's memory.
    ("install dependencies and start the dev server",
     "mkdir -p /work/deps && head -c 8388608 /dev/urandom > /work/deps/lib.so && "
     "echo v2 > /work/VERSION && ifconfig lo 127.0.0.1 up && httpd -p 127.0.0.1:8080 -h /work"),
    ("a bad refactor that kills the server", "rm -rf /work/deps && echo broken > /work/app.py "
                                             "&& echo v3 > /work/VERSION && killall httpd"),
]
GUEST_STATE = "cd /work && find . -type f | sort | xargs md5sum"
# What the dev server answers (nothing once it is gone).
GUEST_SERVER = "wget -qO- http://127.0.0.1:8080/VERSION"


def _sandbox_steps(store, root: Path, image_dir, emit, timed) -> bool:
    """Agent steps in a real QEMU guest, checkpointed, restored and forked;
    False when QEMU is missing and they were skipped."""
    import shutil

    from blockdiff.vm.image import build_image
    from blockdiff.vm.qemu import QEMU
    from blockdiff.vm.sandbox import Sandbox

    if shutil.which(QEMU) is None:
        emit(f"sandbox VM: skipped, {QEMU} is not installed (bash .ci/setup installs it)")
        return False
    image_dir = Path(image_dir) if image_dir else (
        Path.home() / ".cache" / "blockdiff" / "vm-image")
    image, seconds = timed(lambda: build_image(image_dir))
    emit("sandbox VM image " + ("(cached)" if image.cached else "built from Debian packages"),
         seconds, f"{image_dir}: kernel {image.manifest['kernel']['release']}, busybox, "
                  f"guest daemon")
    with contextlib.ExitStack() as stack:
        box = stack.enter_context(Sandbox.create(store, "agent", image=image.rootfs))
        _, seconds = timed(box.start)
        emit(f"boot the sandbox VM ({box.status().accel})", seconds)
        ids, states = [], []
        for what, command in GUEST_STEPS:
            result = box.exec(command)
            check(result.status == 0, f"guest step {what!r} exited {result.status}: "
                                      f"{result.stderr.decode(errors='replace').strip()}")
            snapshot_id = box.checkpoint(what)
            states.append(box.exec(GUEST_STATE).stdout)
            ids.append(snapshot_id)
            t = box.last_checkpoint
            emit(f"guest step: {what}", t.total,
                 f"checkpoint {snapshot_id}: VM paused {t.paused * 1000:.1f} ms")
        check(box.exec(GUEST_SERVER).status != 0, "the dev server outlived its last step")
        timing = box.restore(ids[1])
        check(box.exec(GUEST_STATE).stdout == states[1],
              f"the guest's files after the restore to {ids[1]} differ from that step's")
        check(box.exec(GUEST_SERVER).stdout == b"v2\n",
              f"the dev server started at {ids[1]} does not answer after the restore")
        how = ("resumed from the checkpoint's memory: the dev server started in that step "
               "answers again" if timing.memory else "no reboot: the disk was swapped")
        emit(f"restore the running VM to '{GUEST_STEPS[1][0]}'", timing.seconds,
             f"{how}; its files verified")
        branch, seconds = timed(lambda: box.fork(ids[1], "branch"))
        stack.callback(branch.destroy)
        check(branch.exec(GUEST_STATE).stdout == states[1],
              f"the forked VM's files differ from those of {ids[1]}")
        check(not box.memory_checkpoints or branch.exec(GUEST_SERVER).stdout == b"v2\n",
              "the dev server does not answer in the fork")
        check(branch.exec("echo other > /work/VERSION").status == 0,
              "the forked VM could not write its disk")
        check(box.exec("cat /work/VERSION").stdout == b"v2\n", "the fork changed its parent")
        emit(f"fork a second VM from '{GUEST_STEPS[1][0]}'", seconds,
             ("no boot: it resumed from the checkpoint's memory, its dev server answering; "
              if box.memory_checkpoints else "booted; ")
             + "the two VMs change independently")
        box.stop()
        probe = root / "vm-check.img"
        store.restore(ids[2], box.disk)
        store.restore(ids[2], probe)
        check(sha256_file(probe) == sha256_file(box.disk),
              f"the VM's disk restored in place to {ids[2]} differs from a fork of it")
        emit("VM stopped; its disk, restored in place to the last step, matches a fresh fork "
             "of that step byte for byte")
    return True
