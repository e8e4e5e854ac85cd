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

Run as a script to build the workloads once and print their shape::

    python bench/workloads.py [--quick] [--only a,b]
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from typing import Self

import numpy as np

BLOCK = 4096
MiB = 1 << 20
GiB = 1 << 30

FICLONE = 0x40049409
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNWRITTEN = 0x800
_FIEMAP_HDR = struct.Struct("=QQIIII")
_FIEMAP_EXT = struct.Struct("=QQQQQIIII")


# --------------------------------------------------------------------------
# scratch filesystem


def _run(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


class XfsMount:
    """A scratch XFS filesystem on a loop device over a sparse file.

    The backing file lives in a fresh temporary directory under ``workdir``
    (default /var/tmp, which must not be tmpfs).  The loop device is set up
    with direct I/O so data is cached once (in the XFS page cache) and not a
    second time in the page cache of the backing file.  ``__exit__`` always
    unmounts, detaches the loop device and removes the directory.
    """

    def __init__(self, size: int, workdir: str | None = None, direct_io: bool = True):
        self.size = size
        self.workdir = workdir or "/var/tmp"
        self.direct_io = direct_io
        self.tmp: str | None = None
        self.dev: str | None = None
        self.path: str | None = None
        self._mounted = False
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> Self:
        # SIGTERM/SIGHUP would otherwise skip the finally/__exit__ clean-up.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        try:
            self._setup()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _setup(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("the XFS loop mount needs root")
        for tool in ("mkfs.xfs", "losetup", "mount", "umount"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"{tool} not found (apt-get install -y xfsprogs)")
        cleanup_stale(self.workdir)
        self.tmp = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.workdir)
        backing = os.path.join(self.tmp, "xfs.img")
        with open(backing, "wb") as f:
            f.truncate(self.size)
        argv = ["losetup", "--find", "--show"]
        if self.direct_io:
            argv.append("--direct-io=on")
        self.dev = _run(argv + [backing]).stdout.strip()
        _run(["mkfs.xfs", "-q", "-f", "-m", "reflink=1", self.dev])
        self.path = os.path.join(self.tmp, "mnt")
        os.mkdir(self.path)
        _run(["mount", "-t", "xfs", "-o", "noatime", self.dev, self.path])
        self._mounted = True

    def trim(self) -> None:
        """Give freed blocks back to the sparse backing file."""
        subprocess.run(["fstrim", self.path], check=False, capture_output=True)

    def __exit__(self, *exc) -> None:
        try:
            if self._mounted:
                # in case we were interrupted while it was frozen
                subprocess.run(["fsfreeze", "-u", self.path], check=False, capture_output=True)
                os.sync()
                for attempt in range(10):
                    r = subprocess.run(["umount", self.path], check=False, capture_output=True, text=True)
                    if r.returncode == 0:
                        break
                    time.sleep(0.5)
                else:
                    subprocess.run(["umount", "-l", self.path], check=False, capture_output=True)
                self._mounted = False
            if self.dev:
                for attempt in range(10):
                    r = subprocess.run(["losetup", "-d", self.dev], check=False, capture_output=True)
                    if r.returncode == 0:
                        break
                    time.sleep(0.5)
                self.dev = None
            if self.tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
                self.tmp = None
        finally:
            for sig, h in self._old_handlers.items():
                signal.signal(sig, h)
            self._old_handlers.clear()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


PREFIX = "blockdiff-bench-"


def cleanup_stale(workdir: str = "/var/tmp") -> list[str]:
    """Tear down scratch mounts left by benchmark processes that no longer
    exist (killed with SIGKILL, so their clean-up never ran)."""
    pat = re.compile(re.escape(PREFIX) + r"(\d+)-")
    cleaned = []
    try:
        names = sorted(os.listdir(workdir))
    except FileNotFoundError:
        return cleaned
    for name in names:
        m = pat.match(name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        d = os.path.join(workdir, name)
        mnt = os.path.join(d, "mnt")
        if os.path.ismount(mnt):
            subprocess.run(["fsfreeze", "-u", mnt], check=False, capture_output=True)
            subprocess.run(["umount", mnt], check=False, capture_output=True)
        backing = os.path.join(d, "xfs.img")
        if os.path.exists(backing):
            r = subprocess.run(["losetup", "-j", backing], check=False, capture_output=True, text=True)
            for line in r.stdout.splitlines():
                dev = line.split(":", 1)[0]
                if dev:
                    subprocess.run(["losetup", "-d", dev], check=False, capture_output=True)
        if not os.path.ismount(mnt):
            shutil.rmtree(d, ignore_errors=True)
            cleaned.append(d)
    return cleaned


# --------------------------------------------------------------------------
# file helpers


def fiemap(path: str, batch: int = 65536) -> list[tuple[int, int, int, int]]:
    """(logical, physical, length, flags) for every extent of ``path``."""
    out: list[tuple[int, int, int, int]] = []
    buf = bytearray(_FIEMAP_HDR.size + batch * _FIEMAP_EXT.size)
    start = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            _FIEMAP_HDR.pack_into(buf, 0, start, (1 << 64) - 1 - start, 0, 0, batch, 0)
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
            mapped = _FIEMAP_HDR.unpack_from(buf, 0)[3]
            if mapped == 0:
                return out
            last = False
            for i in range(mapped):
                lo, ph, ln, _, _, fl, _, _, _ = _FIEMAP_EXT.unpack_from(
                    buf, _FIEMAP_HDR.size + i * _FIEMAP_EXT.size
                )
                out.append((lo, ph, ln, fl))
                last = bool(fl & FIEMAP_EXTENT_LAST)
                start = lo + ln
            if last:
                return out
    finally:
        os.close(fd)


def extent_count(path: str) -> int:
    return len(fiemap(path))


def reflink(src: str, dst: str) -> None:
    """Whole-file clone of ``src`` to a new file ``dst`` (FICLONE)."""
    sfd = os.open(src, os.O_RDONLY)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fcntl.ioctl(dfd, FICLONE, sfd)
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
    ap.add_argument("--workdir", default=None, help="parent of the scratch dir (default /var/tmp)")
    args = ap.parse_args(argv)
    only = {x for x in args.only.split(",") if x}
    with XfsMount(mount_size(args.quick), args.workdir) as m:
        for spec in specs(args.quick):
            if only and spec.name not in only:
                continue
            wl = build(spec, m.path)
            print(json.dumps(wl.as_dict()), flush=True)
            remove(wl)
            m.trim()
    return 0


if __name__ == "__main__":
    sys.exit(main())
