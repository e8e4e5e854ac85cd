"""The QEMU process of one sandbox VM, and the hypervisor's side of a checkpoint.

In the spirit of qemu's ``python/qemu/machine``: a :class:`Machine` launches
QEMU (daemonized, so that the VM outlives the process that started it) and
waits for the guest daemon to answer; it shuts the guest down softly, with a
hard kill as the fallback, and removes its runtime files once QEMU is gone.
Used as a context manager, it shuts the VM down at the end of the block.

It is also the one place that knows how the hypervisor pauses the VM and
tracks what the guest writes to its disk. The checkpoint protocol
(:mod:`blockdiff.vm.sandbox`) sees :meth:`Machine.pause`,
:meth:`Machine.resume`, :meth:`Machine.paused` (a pause that says which
blocks the guest wrote since the previous one) and :meth:`Machine.disk_writes`,
never a QMP command. A checkpoint of the VM's memory and devices belongs
here too (see docs/vm.md, "Where a memory checkpoint goes").

Dirty tracking: QEMU marks every block the guest writes or discards in a
dirty bitmap. While the VM is paused, a new bitmap takes over and the old
one, now frozen, is read through QEMU's NBD server (block status of the
context ``qemu:dirty-bitmap:NAME``) on a unix socket in the VM's directory,
which blockdiff binds and hands to QEMU: no path limit applies, and only
users who can enter the directory reach it. Which bitmap is current, and
whether it is to be trusted, is recorded by :mod:`blockdiff.vm.tracking`.

Files in the VM's directory while QEMU runs::

    qmp.sock, guestd.sock, nbd.sock   QMP, the guest daemon, the dirty bitmaps
    qemu.pid                          QEMU's pid
    dirty-tracking.json               the current dirty bitmap
    accel, console.log                kvm or tcg, the guest's console (both kept)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from blockdiff.errors import BlockdiffError, GuestTimeout, VMError
from blockdiff.progress import NO_PROGRESS, Progress, Steps
from blockdiff.vm.guestlink import GuestLink, connect_unix
from blockdiff.vm.nbd import dirty_ranges
from blockdiff.vm.qemu import (
    CONSOLE_LOG,
    DISK_NODE,
    GUEST_SOCKET,
    PID_FILE,
    QMP,
    QMP_SOCKET,
    Launch,
    choose_accel,
)
from blockdiff.vm.registry import KERNEL_FILES, VMEntry
from blockdiff.vm.tracking import TRACKING, DirtyTracking, Generation

DEFAULT_BOOT_TIMEOUT = 120.0
NBD_SOCKET = "nbd.sock"
ACCEL_FILE = "accel"
BITMAP_PREFIX = "blockdiff-"
RUNTIME_FILES = (QMP_SOCKET, GUEST_SOCKET, PID_FILE, NBD_SOCKET, TRACKING)
# ``(offsets, lengths)`` of the byte ranges the guest wrote, as the store takes them.
Written = tuple[np.ndarray, np.ndarray]


@dataclass
class Pause:
    """One pause of the VM (see :meth:`Machine.paused`)."""

    written: Written | None = None   # the guest's writes since the previous pause
    mark: str | None = None          # set by the caller: the disk's lineage mark on resuming
    seconds: float = 0.0             # how long the VM was stopped, once it runs again


class Machine:
    """The QEMU process of one VM, whether it runs or not (it outlives this
    object). As a context manager, the VM is shut down at the end of the block."""

    def __init__(self, vm: VMEntry):
        self.vm = vm
        self.directory = vm.directory
        self.tracking = DirtyTracking(vm.directory)
        self._qmp: QMP | None = None   # the connection of the outermost open qmp() block

    def __enter__(self) -> "Machine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------ process

    @property
    def pid(self) -> int | None:
        """QEMU's pid while this VM's QEMU runs (checked against its command
        line, so a reused pid is never taken for the VM)."""
        try:
            pid = int((self.directory / PID_FILE).read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        if f"blockdiff-{self.vm.name}".encode() in cmdline and any(
                arg.startswith(b"file=" + bytes(self.vm.disk)) for arg in cmdline):
            return pid
        return None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def accel(self) -> str | None:
        """The accelerator of the last launch: ``kvm`` or ``tcg``."""
        try:
            return (self.directory / ACCEL_FILE).read_text().strip()
        except OSError:
            return None

    def launch(self, timeout: float = DEFAULT_BOOT_TIMEOUT,
               progress: Progress = NO_PROGRESS) -> None:
        """Start QEMU, wait until the guest daemon answers, and start tracking
        the guest's disk writes, each a phase of ``progress``. If the guest
        does not come up in time, or QEMU exits, QEMU is killed and the
        VMError quotes the guest's console."""
        name = self.vm.name
        if self.running:
            raise VMError(f"VM {name} is already running")
        kernel_dir = self.vm.kernel_dir
        if not all((kernel_dir / f).is_file() for f in KERNEL_FILES):
            raise VMError(f"the kernel of VM {name} is missing from {kernel_dir}; "
                          f"recreate the VM with --kernel DIR")
        kernel, initrd = kernel_dir / "vmlinuz", kernel_dir / "initrd.img"
        steps = Steps(progress, 2)
        steps.begin("starting QEMU")
        accel, _ = choose_accel(kernel, initrd)
        (self.directory / CONSOLE_LOG).unlink(missing_ok=True)
        Launch(name, self.directory, kernel, initrd, self.vm.disk, self.vm.memory_mb,
               self.vm.cpus, accel).start()
        (self.directory / ACCEL_FILE).write_text(accel + "\n")
        deadline = time.monotonic() + timeout
        steps.begin(f"booting: waiting for the guest daemon ({accel})")
        try:
            with self.guest() as link:
                link.ping(timeout=max(deadline - time.monotonic(), 0.1))
        except GuestTimeout:
            self.kill()
            raise VMError(f"VM {name} did not come up within {timeout:.0f} s ({accel}); "
                          f"its console: {self._console_tail()}") from None
        except VMError:
            self.kill()
            raise VMError(f"VM {name} stopped while booting; its console: "
                          f"{self._console_tail()}") from None
        steps.end()
        # Without tracking (a QEMU that refuses it), every snapshot maps the
        # whole disk: slower, never wrong.
        with contextlib.suppress(VMError, OSError), self.qmp() as q, self._dir_fd() as fd:
            self.tracking.write(Generation(self.pid, start_dirty_tracking(q, fd)))

    def shutdown(self, timeout: float = 20.0) -> None:
        """Power the guest off cleanly (its disk unmounted); QEMU is killed if
        it has not exited within ``timeout`` seconds."""
        pid = self.pid
        if pid is None:
            return
        with contextlib.suppress(VMError):
            with self.guest() as link:
                link.shutdown(timeout=min(timeout, 5.0))
            if _wait_exit(pid, timeout):
                return self._cleanup()
        self.kill()

    def kill(self) -> None:
        """Kill QEMU at once (the disk holds what the guest had written, as
        after a power cut) and remove the runtime files."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 10.0)
        self._cleanup()

    def _cleanup(self) -> None:
        for f in RUNTIME_FILES:
            (self.directory / f).unlink(missing_ok=True)

    def _console_tail(self, lines: int = 3) -> str:
        try:
            text = (self.directory / CONSOLE_LOG).read_text(errors="replace")
        except OSError:
            return "no console output"
        kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(kept) if kept else "no console output"

    # -------------------------------------------------------- connections

    @contextlib.contextmanager
    def _dir_fd(self):
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def guest(self):
        """A connection to the guest daemon (VMError if the VM is not running)."""
        if not self.running:
            raise VMError(f"VM {self.vm.name} is not running; start it with: "
                          f"blockdiff vm start {self.vm.name}")
        with self._dir_fd() as fd, GuestLink(GUEST_SOCKET, dir_fd=fd) as link:
            yield link

    @contextlib.contextmanager
    def qmp(self):
        """A QMP connection to QEMU. Until the block ends, every call of this
        machine uses it (a nested ``qmp()`` yields the same connection), so
        that a pause never waits for a connection to be made."""
        if self._qmp is not None:
            yield self._qmp
            return
        with self._dir_fd() as fd, QMP(QMP_SOCKET, dir_fd=fd) as q:
            self._qmp = q
            try:
                yield q
            finally:
                self._qmp = None

    # ------------------------------------- the hypervisor's side of a checkpoint

    def pause(self) -> None:
        """Stop the guest's CPUs; QEMU first drains every in-flight write to
        the disk, so the image then holds everything the guest wrote."""
        with self.qmp() as q:
            q.command("stop")

    def resume(self) -> None:
        """Let the guest run again."""
        with self.qmp() as q:
            q.command("cont")

    @contextlib.contextmanager
    def paused(self, mark: str | None):
        """The VM paused for the block, and resumed at its end whatever happens.

        Yields a :class:`Pause`. Its ``written`` holds the byte ranges the
        guest wrote or discarded on its disk since the previous pause, when
        the disk's lineage mark ``mark`` is the one that pause was given back
        in ``pause.mark`` (no commit or restore came between); else None, as
        without tracking. Set ``pause.mark`` within the block to the disk's
        lineage mark once it is committed or restored, so that the next pause
        can trust what this one starts to track. ``seconds`` is set once the
        VM runs again.
        """
        with self.qmp():
            self.pause()
            stopped = time.monotonic()
            pause = Pause()
            try:
                generation, pause.written = self._next_generation(mark)
                yield pause
                if generation is not None and pause.mark is not None:
                    # The new bitmap started with the disk being what the mark names.
                    self.tracking.write(replace(generation, mark=pause.mark))
            finally:
                self.resume()
                pause.seconds = time.monotonic() - stopped
            if generation is not None:
                with contextlib.suppress(VMError), self.qmp() as q:
                    drop_dirty_bitmaps(q, keep=generation.bitmap)

    def _next_generation(self, mark: str | None) -> tuple[Generation | None, Written | None]:
        """With the VM paused: a new bitmap takes over. Returns its generation
        (None without tracking) and what the old bitmap says was written, if
        it started when the disk's lineage mark was ``mark``."""
        pid = self.pid
        old = self.tracking.current(pid)
        if old is None:
            return None, None
        if old.mark is not None:
            # Not trusted from here until the new bitmap's mark is recorded:
            # should this process die after the swap, the next pause must not
            # read the old bitmap, which no longer records.
            self.tracking.write(old.untrusted())
        with self.qmp() as q:
            try:
                new = Generation(pid, replace_dirty_bitmap(q, old.bitmap))
            except VMError:
                self.tracking.clear()   # state unknown: no tracking until QEMU starts again
                return None, None
            self.tracking.write(new)
            if old.mark is None or old.mark != mark:
                return new, None
            with contextlib.suppress(OSError, BlockdiffError), self._dir_fd() as fd:
                return new, read_dirty_bitmap(q, fd, old.bitmap)
        return new, None

    def disk_writes(self) -> int:
        """Write, write-zeroes and discard requests QEMU has served on the
        disk since it started (-1 if it does not say)."""
        with self.qmp() as q:
            devices = q.command("query-blockstats")
        for device in devices:
            if device.get("device") == "disk0" or device.get("qdev", "").startswith("disk0"):
                st = device["stats"]
                return st.get("wr_operations", 0) + st.get("unmap_operations", 0)
        return -1


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------- dirty bitmaps


def _bitmap_name() -> str:
    return f"{BITMAP_PREFIX}{os.urandom(6).hex()}"


def start_dirty_tracking(q: QMP, dir_fd: int) -> str:
    """Start the NBD server and a dirty bitmap of 4 KiB granularity; returns
    the bitmap's name."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(NBD_SOCKET, dir_fd=dir_fd)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(f"/proc/self/fd/{dir_fd}/{NBD_SOCKET}")
        listener.listen(4)
        q.pass_fd("nbd", listener.fileno())
    finally:
        listener.close()
    q.command("nbd-server-start", addr={"type": "fd", "data": {"str": "nbd"}})
    bitmap = _bitmap_name()
    q.command("block-dirty-bitmap-add", node=DISK_NODE, name=bitmap, granularity=4096)
    return bitmap


def replace_dirty_bitmap(q: QMP, bitmap: str) -> str:
    """Atomically start a new bitmap and freeze ``bitmap``; returns the new
    one's name. With the VM paused, the old one then says what was written
    up to now and the new one what is written from now on."""
    new = _bitmap_name()
    q.command("transaction", actions=[
        {"type": "block-dirty-bitmap-add",
         "data": {"node": DISK_NODE, "name": new, "granularity": 4096}},
        {"type": "block-dirty-bitmap-disable", "data": {"node": DISK_NODE, "name": bitmap}}])
    return new


def read_dirty_bitmap(q: QMP, dir_fd: int, bitmap: str, *, timeout: float = 10.0) -> Written:
    """``(offsets, lengths)`` of the blocks a frozen bitmap marks, read over a
    read-only NBD export made for the purpose (and left for
    ``drop_dirty_bitmaps``, which need not run while the VM is paused)."""
    q.command("block-export-add", type="nbd", id=bitmap, name=bitmap, writable=False,
              bitmaps=[bitmap], **{"node-name": DISK_NODE})
    return dirty_ranges(connect_unix(NBD_SOCKET, dir_fd), bitmap, bitmap, timeout=timeout)


def drop_dirty_bitmaps(q: QMP, keep: str) -> None:
    """Remove blockdiff's bitmaps other than ``keep``, and their exports. QEMU
    lets go of an export in the background, so a bitmap that is still
    exported stays until the next call."""
    for node in q.command("query-named-block-nodes", flat=True):
        if node.get("node-name") != DISK_NODE:
            continue
        for bitmap in node.get("dirty-bitmaps", []):
            name = bitmap.get("name", "")
            if name.startswith(BITMAP_PREFIX) and name != keep:
                with contextlib.suppress(VMError):
                    q.command("block-export-del", id=name, mode="hard")
                with contextlib.suppress(VMError):
                    q.command("block-dirty-bitmap-remove", node=DISK_NODE, name=name)
