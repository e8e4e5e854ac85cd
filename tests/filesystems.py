"""Throwaway real filesystems for tests: loop-mounted XFS/btrfs/ext4 and tmpfs.

Everything here needs root and a Linux kernel; `filesystem_unavailable_reason`
tells callers (the pytest fixtures) why a kind cannot be used so they can skip
with an explanation instead of silently passing.

Also contains a few read-only inspection helpers (FIEMAP, SEEK_DATA/SEEK_HOLE,
mount table lookups) that tests use to check on-disk layout.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, NamedTuple

KINDS = ("xfs", "btrfs", "ext4", "tmpfs")
REFLINK_KINDS = ("xfs", "btrfs")

# Backing files are sparse, so a generous size costs nothing until written.
DEFAULT_SIZES = {
    "xfs": 4 << 30,
    "btrfs": 4 << 30,
    "ext4": 4 << 30,
    "tmpfs": 2 << 30,
}

MKFS = {
    "xfs": ["mkfs.xfs", "-q", "-m", "reflink=1", "-f"],
    "btrfs": ["mkfs.btrfs", "-q", "-f"],
    "ext4": ["mkfs.ext4", "-q", "-F"],
}

_PACKAGES = {"xfs": "xfsprogs", "btrfs": "btrfs-progs", "ext4": "e2fsprogs"}

# Comma-separated kinds to treat as unavailable, e.g. to skip a slow or broken
# filesystem on a particular machine without editing tests.
SKIP_ENV = "BLOCKDIFF_TEST_SKIP_FS"

# Every mount lives in "<tmp_dir>/<MOUNT_PREFIX><pid>-<kind>-XXXX/mnt" so that
# mounts left behind by a killed process can be recognised and swept later.
MOUNT_PREFIX = "blockdiff-fs-"

# ioctl numbers from <linux/fs.h>; identical on all Linux architectures we run on.
FICLONE = 0x40049409
FS_IOC_FIEMAP = 0xC020660B

FIEMAP_FLAG_SYNC = 0x1

FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_ENCODED = 0x8
FIEMAP_EXTENT_NOT_ALIGNED = 0x100
FIEMAP_EXTENT_DATA_INLINE = 0x200
FIEMAP_EXTENT_UNWRITTEN = 0x800
FIEMAP_EXTENT_SHARED = 0x2000


class FilesystemError(RuntimeError):
    """A mkfs/mount/umount/losetup step failed."""


def default_tmp_dir() -> Path:
    """Directory that holds backing files and mount points by default.

    Deliberately not pytest's basetemp: pytest prunes old basetemp trees with
    rmtree, which must never walk into a mount that is still attached.
    """
    return Path(tempfile.gettempdir()) / "blockdiff-test-mounts"


def _tool(name: str) -> str | None:
    # Non-login shells sometimes lack the sbin directories where mkfs lives.
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return shutil.which(name, path=search)


def _run(cmd: list[str]) -> str:
    exe = _tool(cmd[0])
    if exe is None:
        raise FilesystemError(f"{cmd[0]}: command not found")
    proc = subprocess.run(
        [exe, *cmd[1:]], stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise FilesystemError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {detail}")
    return proc.stdout


def _loop_devices_for(backing: Path) -> list[str]:
    """Loop devices currently attached to `backing`."""
    if not backing.exists():
        return []
    out = _run(["losetup", "--noheadings", "--list", "--output", "NAME",
                "--associated", str(backing)])
    return out.split()


def _unmount(mountpoint: Path) -> bool:
    """Unmount; return False if only a lazy unmount was possible."""
    for _ in range(10):
        try:
            _run(["umount", str(mountpoint)])
            return True
        except FilesystemError as exc:
            # Only "busy" is worth waiting for: a just-exited child process or
            # a closing file descriptor can hold the mount for a moment.
            if "busy" not in str(exc).lower():
                raise
        time.sleep(0.1)
    # Detach it from the namespace now; the kernel finishes when the last
    # user goes away.  Still reported, because it means something leaked.
    _run(["umount", "--lazy", str(mountpoint)])
    return False


def _teardown(work: Path) -> None:
    """Unmount, detach and delete everything under one mount's work dir.

    Tries every step even if an earlier one fails, then raises the first error.
    """
    mountpoint = work / "mnt"
    backing = work / "backing.img"
    errors: list[str] = []

    if os.path.ismount(mountpoint):
        try:
            if not _unmount(mountpoint):
                errors.append(f"{mountpoint} was busy and had to be unmounted lazily "
                              "(a file on it was probably left open)")
        except FilesystemError as exc:
            errors.append(str(exc))

    # Found via the backing file rather than remembered, so a device attached
    # just before an interrupt is still found.  Detaching a device that is
    # still in use (lazy unmount) only marks it autoclear, which is what we want.
    try:
        for device in _loop_devices_for(backing):
            try:
                _run(["losetup", "--detach", device])
            except FilesystemError as exc:
                errors.append(str(exc))
    except FilesystemError as exc:
        errors.append(str(exc))

    if os.path.ismount(mountpoint):
        errors.append(f"{mountpoint} is still mounted; leaving {work} in place")
    else:
        # Never rmtree here: if anything above misjudged the mount state,
        # rmdir fails harmlessly where rmtree would delete through the mount.
        with contextlib.suppress(FileNotFoundError):
            backing.unlink()
        for directory in (mountpoint, work):
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                errors.append(f"cannot remove {directory}: {exc}")

    if errors:
        raise FilesystemError("; ".join(errors))


@contextlib.contextmanager
def mounted_filesystem(
    kind: str, size: int | None = None, tmp_dir: str | os.PathLike | None = None
) -> Iterator[Path]:
    """Create and mount a fresh, empty filesystem; yield its mount point.

    `kind` is one of KINDS.  Block filesystems are made on a sparse backing
    file of `size` bytes attached to its own loop device; tmpfs uses `size`
    as its size limit.  Mount point and backing file live in a new directory
    under `tmp_dir` (default: `default_tmp_dir()`).  On exit - including when
    mkfs or mount fails halfway - the filesystem is unmounted, the loop device
    detached and the directory removed; problems doing so raise FilesystemError.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown filesystem kind {kind!r}; expected one of {KINDS}")
    size = DEFAULT_SIZES[kind] if size is None else int(size)
    root = Path(tmp_dir) if tmp_dir is not None else default_tmp_dir()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{MOUNT_PREFIX}{os.getpid()}-{kind}-", dir=root))
    try:
        mountpoint = work / "mnt"
        mountpoint.mkdir()
        if kind == "tmpfs":
            _run(["mount", "-t", "tmpfs", "-o", f"size={size}", "blockdiff-test",
                  str(mountpoint)])
        else:
            backing = work / "backing.img"
            with open(backing, "wb") as f:
                f.truncate(size)
            device = _run(["losetup", "--find", "--show", str(backing)]).strip()
            _run([*MKFS[kind], device])
            _run(["mount", "-t", kind, device, str(mountpoint)])
        yield mountpoint
    finally:
        _teardown(work)


def cleanup_stale_mounts(tmp_dir: str | os.PathLike | None = None) -> list[Path]:
    """Tear down mounts under `tmp_dir` whose creating process no longer exists.

    Covers processes that were SIGKILLed (or crashed) inside
    `mounted_filesystem`.  Returns the work directories that were cleaned.
    """
    root = Path(tmp_dir) if tmp_dir is not None else default_tmp_dir()
    if not root.is_dir():
        return []
    pattern = re.compile(re.escape(MOUNT_PREFIX) + r"(\d+)-")
    cleaned = []
    for work in sorted(root.iterdir()):
        match = pattern.match(work.name)
        if not match or _process_alive(int(match.group(1))):
            continue
        _teardown(work)
        cleaned.append(work)
    return cleaned


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kernel_filesystems() -> set[str]:
    """Filesystem types the running kernel currently knows (/proc/filesystems).

    Modular filesystems only appear after their module is loaded, so absence
    here is a hint, not proof; mounting is the real test.
    """
    try:
        with open("/proc/filesystems") as f:
            return {line.split()[-1] for line in f if line.strip()}
    except OSError:
        return set()


@functools.lru_cache(maxsize=None)
def filesystem_unavailable_reason(kind: str) -> str | None:
    """Why `kind` cannot be used here, or None if it can.

    Actually creates, mounts, writes to (and for XFS/btrfs reflinks a file on)
    a throwaway filesystem, so the answer reflects this machine and kernel.
    Cached for the life of the process.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown filesystem kind {kind!r}; expected one of {KINDS}")
    skipped = {k.strip() for k in os.environ.get(SKIP_ENV, "").split(",")}
    if kind in skipped:
        return f"disabled by {SKIP_ENV}"
    if not sys.platform.startswith("linux"):
        return f"needs Linux (running on {sys.platform})"
    if os.geteuid() != 0:
        return "mounting filesystems needs root"
    if _tool("mount") is None:
        return "mount(8) not found"
    if kind != "tmpfs":
        if not os.path.exists("/dev/loop-control"):
            return "no loop device support (/dev/loop-control missing)"
        if _tool("losetup") is None:
            return "losetup not found (install util-linux)"
        mkfs = MKFS[kind][0]
        if _tool(mkfs) is None:
            return f"{mkfs} not found (install {_PACKAGES[kind]})"
    try:
        with mounted_filesystem(kind) as mnt:
            _probe(kind, mnt)
    except (FilesystemError, OSError) as exc:
        if kind not in kernel_filesystems():
            return f"kernel does not support {kind} ({exc})"
        return f"{kind} probe failed: {exc}"
    return None


def _probe(kind: str, mnt: Path) -> None:
    src = mnt / "probe"
    src.write_bytes(b"\xa5" * 65536)
    if kind in REFLINK_KINDS:
        with open(src, "rb") as s, open(mnt / "probe-clone", "wb") as d:
            try:
                fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
            except OSError as exc:
                raise OSError(exc.errno, f"reflink (FICLONE) not supported: {exc.strerror}")


def mount_table() -> list[tuple[str, str, str]]:
    """(source, mount point, fs type) for every mount in this namespace."""
    def unescape(field: str) -> str:
        # /proc/self/mounts escapes space, tab, newline and backslash as \ooo.
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)

    with open("/proc/self/mounts") as f:
        return [tuple(unescape(x) for x in line.split()[:3]) for line in f]


def filesystem_type(path: str | os.PathLike) -> str:
    """Type of the filesystem holding `path` (e.g. "xfs"), from the mount table."""
    target = os.path.realpath(path)
    best, best_type = "", ""
    for _, mountpoint, fstype in mount_table():
        inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
        if inside and len(mountpoint) >= len(best):
            best, best_type = mountpoint, fstype
    return best_type


class Extent(NamedTuple):
    """One FIEMAP extent; offsets and length in bytes."""

    logical: int
    physical: int
    length: int
    flags: int


_FIEMAP_HEADER = struct.Struct("=QQIIII")  # struct fiemap without the array
_FIEMAP_EXTENT = struct.Struct("=QQQ2QI3I")  # struct fiemap_extent


def fiemap(path: str | os.PathLike, sync: bool = True) -> list[Extent]:
    """The file's extent map via FS_IOC_FIEMAP.

    With `sync` the kernel flushes dirty data first (FIEMAP_FLAG_SYNC);
    without it, freshly written data on XFS/btrfs shows up as
    DELALLOC|UNKNOWN extents with physical 0.  Raises OSError (EOPNOTSUPP)
    on filesystems without FIEMAP, such as tmpfs.
    """
    batch = 256
    extents: list[Extent] = []
    start = 0
    with open(path, "rb") as f:
        while True:
            buf = bytearray(_FIEMAP_HEADER.size + batch * _FIEMAP_EXTENT.size)
            _FIEMAP_HEADER.pack_into(buf, 0, start, 0xFFFFFFFFFFFFFFFF - start,
                                     FIEMAP_FLAG_SYNC if sync else 0, 0, batch, 0)
            fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf, True)
            mapped = _FIEMAP_HEADER.unpack_from(buf, 0)[3]
            if mapped == 0:
                return extents
            for i in range(mapped):
                fields = _FIEMAP_EXTENT.unpack_from(buf, _FIEMAP_HEADER.size + i * _FIEMAP_EXTENT.size)
                extents.append(Extent(fields[0], fields[1], fields[2], fields[5]))
            last = extents[-1]
            if last.flags & FIEMAP_EXTENT_LAST:
                return extents
            start = last.logical + last.length


def data_ranges(path: str | os.PathLike) -> list[tuple[int, int]]:
    """Half-open (start, end) byte ranges that SEEK_DATA/SEEK_HOLE report as data.

    Unwritten (preallocated) extents count as holes on XFS, btrfs and ext4,
    except that XFS and ext4 report them as data once their pages are in the
    page cache (e.g. after the range has been read).  Use `fiemap` for an
    exact answer.
    """
    ranges = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after pos
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            ranges.append((start, end))
            pos = end
    finally:
        os.close(fd)
    return ranges
