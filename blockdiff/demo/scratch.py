"""Scratch filesystems: XFS/btrfs/ext4 on sparse files with loop mounts, and tmpfs.

The demo, the benchmarks and the tests run on real filesystems made here and
always torn down again: unmounted, loop device detached, files removed, even
when making them fails halfway. Everything here needs root and Linux;
`filesystem_unavailable_reason` says why a kind cannot be used, so callers can
explain instead of failing obscurely.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from blockdiff.errors import FilesystemError
from blockdiff.native import process_alive  # noqa: F401  (also used by the benchmarks)

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


def default_tmp_dir() -> Path:
    """Directory that holds backing files and mount points by default.

    Deliberately not pytest's basetemp: pytest prunes old basetemp trees with
    rmtree, which must never walk into a mount that is still attached.
    """
    return Path(tempfile.gettempdir()) / "blockdiff-scratch"


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
    kind: str, size: int | None = None, tmp_dir: str | os.PathLike | None = None,
    *, direct_io: bool = False, options: str = ""
) -> Iterator[Path]:
    """Create and mount a fresh, empty filesystem; yield its mount point.

    `kind` is one of KINDS.  Block filesystems are made on a sparse backing
    file of `size` bytes attached to its own loop device; tmpfs uses `size`
    as its size limit.  Mount point and backing file live in a new directory
    under `tmp_dir` (default: `default_tmp_dir()`).  On exit - including when
    mkfs or mount fails halfway - the filesystem is unmounted, the loop device
    detached and the directory removed; problems doing so raise FilesystemError.
    `direct_io` attaches the loop device with direct I/O (benchmarks: data is
    then cached once, as on a real disk); `options` are mount options.
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
            _run(["mount", "-t", "tmpfs", "-o", f"size={size}", "blockdiff-scratch",
                  str(mountpoint)])
        else:
            backing = work / "backing.img"
            with open(backing, "wb") as f:
                f.truncate(size)
            # Direct I/O keeps the backing file out of the page cache, so data is
            # cached once (in the filesystem on the loop device), as on a disk.
            device = _run(["losetup", "--find", "--show",
                           *(["--direct-io=on"] if direct_io else []), str(backing)]).strip()
            _run([*MKFS[kind], device])
            _run(["mount", "-t", kind, *(["-o", options] if options else []), device,
                  str(mountpoint)])
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
        if not match or process_alive(int(match.group(1))):
            continue
        _teardown(work)
        cleaned.append(work)
    return cleaned


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
        from blockdiff import native

        with open(src, "rb") as s, open(mnt / "probe-clone", "wb") as d:
            try:
                native.clone_file(d.fileno(), s.fileno(), d.name)
            except OSError as exc:
                raise OSError(exc.errno, f"reflink (FICLONE) not supported: {exc.strerror}")
