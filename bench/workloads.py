"""Benchmark workloads on a scratch XFS (reflink=1) loop mount.

A workload is a BASE image and a TARGET image made from it by a whole-file
reflink clone followed by random 4 KiB overwrites, so TARGET shares every
block with BASE except the overwritten ones:

  a  4 GiB image, 1 % of its 4 KiB blocks overwritten
  b  2 GiB image, about every other block overwritten at random positions, so
     the target has at least 200,000 extents (checked with FIEMAP)
  c  2 GiB image, 2 % of its blocks overwritten

With ``quick=True`` the same shapes are built at 512 / 256 / 256 MiB.

Every 4 KiB block written carries its block number and a generation tag in its
first 16 bytes, followed by bytes from a 1 MiB random pool, so blocks are
distinct and a range restored at the wrong offset is caught by ``cmp``.

The scratch filesystem comes from ``blockdiff.demo.scratch`` and extent counts from
blockdiff's FIEMAP (``blockdiff.engine.extents.ExtentMap``): the package must import.

Run as a script to build the workloads once and print their shape::

    python bench/workloads.py [--quick] [--only a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

try:
    from blockdiff import native
    from blockdiff.demo import scratch
    from blockdiff.engine.extents import ExtentMap
except ImportError as e:
    _msg = (f"the benchmarks need the blockdiff package, which cannot be imported ({e}); "
            f"install it with `bash .ci/setup` from the repository root")
    if __name__ == "__main__":
        sys.exit(_msg)
    raise ImportError(_msg) from e

import numpy as np

BLOCK = 4096
MiB = 1 << 20
GiB = 1 << 30

# Holds the scratch filesystem's backing file and mount point. Not /tmp, which
# may be tmpfs: the backing file would then take its size in memory.
DEFAULT_TMP_DIR = "/var/tmp/blockdiff-bench"


# --------------------------------------------------------------------------
# scratch filesystem


def thaw(mountpoint: str | os.PathLike) -> None:
    """Thaw a filesystem that may have been left frozen; harmless otherwise."""
    subprocess.run(["fsfreeze", "-u", os.fspath(mountpoint)], check=False, capture_output=True)


def _thaw_stale(tmp_dir: str) -> None:
    """Thaw mounts of dead benchmark processes, so they can be unmounted: a
    benchmark killed between freeze and thaw leaves its filesystem frozen."""
    pattern = re.compile(re.escape(scratch.MOUNT_PREFIX) + r"(\d+)-")
    with contextlib.suppress(FileNotFoundError):
        for work in sorted(Path(tmp_dir).iterdir()):
            m = pattern.match(work.name)
            if m and not scratch.process_alive(int(m.group(1))) and os.path.ismount(work / "mnt"):
                thaw(work / "mnt")


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into SystemExit, so clean-up code still runs."""
    old = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def scratch_xfs(size: int, tmp_dir: str | None = None) -> Iterator[str]:
    """A fresh XFS (reflink=1) mounted with noatime on a direct-I/O loop device
    over a sparse file in ``tmp_dir``; yields the mount point.

    First tears down what benchmark runs killed with SIGKILL left in
    ``tmp_dir``. Direct I/O keeps the backing file out of the page cache, so
    data is cached once, as on a real disk. On exit the filesystem is thawed
    (in case a run was interrupted while it was frozen), unmounted, the loop
    device detached and the files removed; failures raise
    ``blockdiff.demo.scratch.FilesystemError``.
    """
    tmp_dir = tmp_dir or DEFAULT_TMP_DIR
    _thaw_stale(tmp_dir)
    scratch.cleanup_stale_mounts(tmp_dir)
    with scratch.mounted_filesystem("xfs", size=size, tmp_dir=tmp_dir, direct_io=True,
                                    options="noatime") as mnt:
        try:
            yield str(mnt)
        finally:
            thaw(mnt)
            os.sync()


def mount_source(mountpoint: str) -> str:
    """The device mounted at ``mountpoint`` (from /proc/mounts), or "?"."""
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1] == mountpoint:
                return fields[0]
    return "?"


def trim(mountpoint: str) -> None:
    """Give freed blocks back to the sparse backing file."""
    subprocess.run(["fstrim", mountpoint], check=False, capture_output=True)


# --------------------------------------------------------------------------
# file helpers


def extent_map(path: str) -> ExtentMap:
    """The file's extents (FIEMAP through blockdiff's native core)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return ExtentMap.of_file(fd, path)
    finally:
        os.close(fd)


def extent_count(path: str) -> int:
    return len(extent_map(path))


def shared_extents(path: str) -> int:
    """Number of extents of ``path`` the kernel reports as shared (reflinked)."""
    return int(np.count_nonzero(extent_map(path).flags & native.EXTENT_SHARED))


def reflink(src: str, dst: str) -> None:
    """Whole-file clone of ``src`` to a new file ``dst`` (FICLONE), fsynced."""
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            native.clone_file(dfd, sfd, dst)
            os.fsync(dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _pool(seed: int) -> np.ndarray:
    """1 MiB of random bytes viewed as 256 blocks of 512 uint64."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**63, size=(MiB // BLOCK, BLOCK // 8), dtype=np.uint64)


def write_image(path: str, size: int, seed: int = 1, chunk: int = 64 * MiB) -> None:
    """Write ``size`` bytes of non-zero, per-block distinct data and fsync."""
    assert size % BLOCK == 0 and chunk % MiB == 0
    pool = _pool(seed)
    per_chunk = chunk // BLOCK
    buf = np.tile(pool, (chunk // MiB, 1))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        blk = 0
        nblocks = size // BLOCK
        while blk < nblocks:
            n = min(per_chunk, nblocks - blk)
            buf[:n, 0] = np.arange(blk, blk + n, dtype=np.uint64)
            buf[:n, 1] = 0x62646966_66000000 | seed  # generation tag
            mv = memoryview(buf[:n]).cast("B")
            off = 0
            while off < len(mv):
                off += os.pwrite(fd, mv[off:], blk * BLOCK + off)
            blk += n
        os.fsync(fd)
    finally:
        os.close(fd)


def overwrite_blocks(path: str, fraction: float, seed: int = 2) -> int:
    """Overwrite ``fraction`` of the 4 KiB blocks of ``path`` in random order
    with new distinct data (one pwrite per block), then fsync.  Returns the
    number of blocks written."""
    size = os.path.getsize(path)
    nblocks = size // BLOCK
    k = max(1, round(nblocks * fraction))
    rng = np.random.default_rng(seed)
    blocks = rng.choice(nblocks, size=k, replace=False)
    pool = _pool(seed + 1000)
    batch = 4096
    buf = np.tile(pool, (batch // pool.shape[0], 1))
    fd = os.open(path, os.O_WRONLY)
    try:
        for s in range(0, k, batch):
            sel = blocks[s : s + batch]
            buf[: len(sel), 0] = sel.astype(np.uint64)
            buf[: len(sel), 1] = 0x62646966_66000000 | seed
            for i, b in enumerate(sel.tolist()):
                os.pwrite(fd, buf[i], b * BLOCK)
        os.fsync(fd)
    finally:
        os.close(fd)
    return k


# --------------------------------------------------------------------------
# workloads


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    description: str
    size: int
    fraction: float
    min_extents: int = 0


@dataclasses.dataclass
class Workload:
    spec: Spec
    dir: str
    base: str
    target: str
    changed_blocks: int
    extents_base: int
    extents_target: int
    build_s: float

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["spec"] = dataclasses.asdict(self.spec)
        return d


def specs(quick: bool = False) -> list[Spec]:
    if quick:
        return [
            Spec("a", "512 MiB image, 1% of blocks overwritten", 512 * MiB, 0.01),
            Spec("b", "256 MiB image, ~50% of blocks overwritten (fragmented)", 256 * MiB, 0.5,
                 min_extents=25_000),
            Spec("c", "256 MiB image, 2% of blocks overwritten", 256 * MiB, 0.02),
        ]
    return [
        Spec("a", "4 GiB image, 1% of blocks overwritten", 4 * GiB, 0.01),
        Spec("b", "2 GiB image, ~50% of blocks overwritten (fragmented)", 2 * GiB, 0.5,
             min_extents=200_000),
        Spec("c", "2 GiB image, 2% of blocks overwritten", 2 * GiB, 0.02),
    ]


def mount_size(quick: bool = False) -> int:
    """Scratch filesystem size: room for the largest workload (base, target
    changes), one full copy of it, and slack.  The backing file is sparse."""
    largest = max(s.size for s in specs(quick))
    return 3 * largest + 2 * GiB


def build(spec: Spec, root: str, seed: int = 1) -> Workload:
    t0 = time.perf_counter()
    d = os.path.join(root, f"wl-{spec.name}")
    os.makedirs(d, exist_ok=True)
    base = os.path.join(d, "base.img")
    target = os.path.join(d, "target.img")
    write_image(base, spec.size, seed=seed)
    reflink(base, target)
    changed = overwrite_blocks(target, spec.fraction, seed=seed + 1)
    ext_t = extent_count(target)
    ext_b = extent_count(base)
    if ext_t < spec.min_extents:
        raise RuntimeError(
            f"workload {spec.name}: target has {ext_t} extents, wanted >= {spec.min_extents}"
        )
    return Workload(spec, d, base, target, changed, ext_b, ext_t, time.perf_counter() - t0)


def remove(wl: Workload) -> None:
    shutil.rmtree(wl.dir, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small images")
    ap.add_argument("--only", default="", help="comma separated workload names")
    ap.add_argument("--workdir", default=None,
                    help=f"directory for the scratch filesystem (default {DEFAULT_TMP_DIR})")
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    reason = scratch.filesystem_unavailable_reason("xfs")
    if reason:
        print(f"cannot make a scratch XFS filesystem: {reason}", file=sys.stderr)
        return 2
    with exit_on_signals(), scratch_xfs(mount_size(args.quick), args.workdir) as mnt:
        for spec in specs(args.quick):
            if only and spec.name not in only:
                continue
            wl = build(spec, mnt)
            print(json.dumps(wl.as_dict()), flush=True)
            remove(wl)
            trim(mnt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
