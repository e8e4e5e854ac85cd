"""The main job, end to end, on an embedded default: snapshot a VM disk image
after every agent step, then restore a step, fork two branches from another,
and move the whole chain to a second filesystem as a new host would.

Runs on a scratch XFS made on a loop device (or in a directory you give on a
reflink filesystem). Every snapshot, restore and fork is checked byte for byte
against a SHA-256 taken of the live disk at that step. Progress is reported
through a callback; this module never prints.
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

from blockdiff import engine, native, scratch

MiB = 1 << 20
BLOCK = 4096


@dataclass
class Event:
    """One line of the demo's report."""

    what: str
    seconds: float = 0.0
    detail: str = ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            h.update(chunk)
    return h.hexdigest()


def _clone(src: Path, dst: Path) -> None:
    with open(src, "rb") as s, open(dst, "wb") as d:
        native.clone_file(d.fileno(), s.fileno(), dst)


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
        seed: int = 1, report: Callable[[Event], None] = lambda e: None) -> list[Event]:
    """Run the demo; returns (and reports as they happen) its events.

    Without ``workdir`` it makes a scratch XFS on a loop device (needs root).
    Raises ``AssertionError`` if any restore differs from what was snapshotted.
    """
    events: list[Event] = []

    def emit(what: str, seconds: float = 0.0, detail: str = "") -> None:
        events.append(Event(what, seconds, detail))
        report(events[-1])

    with contextlib.ExitStack() as stack:
        if workdir is None:
            root = stack.enter_context(
                scratch.mounted_filesystem("xfs", size=4 * size + 512 * MiB))
            emit("scratch XFS (reflink=1) on a loop device", detail=str(root))
        else:
            root = Path(workdir)
        rng = random.Random(seed)
        disk, snaps = root / "disk.img", root / "snapshots"
        snaps.mkdir()
        _make_disk(disk, size, rng)
        t = time.perf_counter()
        _clone(disk, snaps / "step0.img")
        emit("step 0: boot image snapshotted", time.perf_counter() - t, f"{size // MiB} MiB disk")
        digests = {0: _sha256(disk)}

        for step in range(1, steps + 1):
            with open(disk, "r+b") as f:
                what = STEPS[(step - 1) % len(STEPS)](f.fileno(), os.fstat(f.fileno()).st_size, rng)
                os.fsync(f.fileno())
            digests[step] = _sha256(disk)
            t = time.perf_counter()
            created = engine.create_diff(snaps / f"step{step}.bdiff", disk,
                                         snaps / f"step{step - 1}.img")
            t_create = time.perf_counter() - t
            t = time.perf_counter()
            engine.apply_diff(snaps / f"step{step}.bdiff", snaps / f"step{step}.img",
                              snaps / f"step{step - 1}.img")
            t_apply = time.perf_counter() - t
            assert _sha256(snaps / f"step{step}.img") == digests[step], f"step {step} differs"
            emit(f"step {step}: {what}", t_create + t_apply,
                 f"diff {created.ranges} ranges, {created.data_bytes // 1024} KiB data, "
                 f"{created.zero_bytes // 1024} KiB zeros; create {t_create * 1000:.0f} ms, "
                 f"snapshot {t_apply * 1000:.0f} ms")

        # Time travel: put the live disk back to an earlier step.
        back = max(1, steps // 2)
        t = time.perf_counter()
        _clone(snaps / f"step{back}.img", disk)
        emit(f"restore step {back} into the live disk", time.perf_counter() - t)
        assert _sha256(disk) == digests[back], "restore differs"

        # Fork: two branches from one step, each snapshotted independently.
        fork_from = max(1, steps // 3)
        for branch in ("a", "b"):
            live = root / f"fork-{branch}.img"
            t = time.perf_counter()
            _clone(snaps / f"step{fork_from}.img", live)
            t_fork = time.perf_counter() - t
            with open(live, "r+b") as f:
                what = _edit_files(f.fileno(), os.fstat(f.fileno()).st_size, rng)
                os.fsync(f.fileno())
            expected = _sha256(live)
            diff = snaps / f"fork-{branch}.bdiff"
            engine.create_diff(diff, live, snaps / f"step{fork_from}.img")
            engine.apply_diff(diff, snaps / f"fork-{branch}.img", snaps / f"step{fork_from}.img")
            assert _sha256(snaps / f"fork-{branch}.img") == expected, f"fork {branch} differs"
            emit(f"fork {branch} from step {fork_from}", t_fork, f"then {what}; snapshot verified")

        # Another host: carry the boot image and the diffs to a second
        # filesystem (btrfs) and replay the chain there.
        other = stack.enter_context(scratch.mounted_filesystem("btrfs", size=4 * size + 512 * MiB))
        t = time.perf_counter()
        for name in ["step0.img"] + [f"step{step}.bdiff" for step in range(1, steps + 1)]:
            with open(snaps / name, "rb") as s, open(other / name, "wb") as d:
                native.copy_sparse(s.fileno(), d.fileno(), os.fstat(s.fileno()).st_size, d.name)
                os.fsync(d.fileno())
        emit(f"carry step 0 and {steps} diffs to another host's btrfs", time.perf_counter() - t)
        t = time.perf_counter()
        current = other / "step0.img"
        for step in range(1, steps + 1):
            engine.apply_diff(other / f"step{step}.bdiff", other / f"step{step}.img", current)
            current = other / f"step{step}.img"
        emit(f"replay steps 1-{steps} there", time.perf_counter() - t)
        assert _sha256(current) == digests[steps], "replayed chain differs"

        # For scale: what one full copy of the disk costs.
        t = time.perf_counter()
        subprocess.run(["cp", "--reflink=never", str(disk), str(root / "full-copy.img")],
                       check=True)
        with open(root / "full-copy.img", "rb") as f:
            os.fsync(f.fileno())
        emit("for comparison: one full copy of the disk", time.perf_counter() - t)
        emit("all snapshots, restores and forks verified byte for byte")
    return events
