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
here too: guest RAM as a file beside the disk (``memory.img``), the
device state migrated into the same file behind the RAM while the VM is
paused, and a launch that resumes from such a file instead of booting.

Dirty tracking: QEMU marks every block the guest writes or discards in a
dirty bitmap. While the VM is paused, a new bitmap takes over and the old
one, now frozen, is read through QEMU's NBD server (block status of the
context ``qemu:dirty-bitmap:NAME``) on a unix socket in the VM's directory,
which blockdiff binds and hands to QEMU: no path limit applies, and only
users who can enter the directory reach it. Which bitmap is current, and
whether it is to be trusted, is recorded by :mod:`blockdiff.vm.tracking`.

``Machine`` holds the process's lifecycle, the pauses and the dirty
tracking; the modules below it hold the rest: :mod:`blockdiff.vm.waiting`
(QEMUs started ahead for the next restore or fork), :mod:`blockdiff.vm.device_state`
(the memory image's layout, saving and loading the device state),
:mod:`blockdiff.vm.qmp_talk` (QMP conversations of no one machine: migration
waits, dirty bitmaps) and :mod:`blockdiff.vm.procs` (what /proc says of a
process).

Files in the VM's directory while QEMU runs::

    qmp.sock, guestd.sock, nbd.sock   QMP, the guest daemon, the dirty bitmaps
    qemu.pid                          QEMU's pid
    dirty-tracking.json               the current dirty bitmap
    accel, console.log                kvm or tcg, the guest's console (both kept)
    memory.img                        guest RAM, then the device state (kept)
    waiting.TOKEN.*                   a QEMU waiting for the next restore (and
    waiting-fork.TOKEN.*              one for the next fork): its qmp.sock,
                                      guestd.sock, qemu.pid and console.log

The memory image: its first ``memory_mb`` MiB are the guest's RAM, mapped
shared by QEMU; the ``DEVICE_STATE_AREA`` after them holds the device state
of the last checkpoint (QEMU's migration stream without RAM, about 400 KB),
written by :meth:`Machine.paused` and read back by a launch with
``incoming``. One file, so that one store snapshot holds both.

The page cache must hold the RAM in 4 KiB folios: QEMU advises
``MADV_HUGEPAGE`` on guest RAM, and a file mapped with that advice is read
in 2 MiB folios, which are written back whole, so that a guest write of a
few bytes would change 2 MiB of the file. Before QEMU maps the file, the
launch has the kernel read it ahead (``POSIX_FADV_WILLNEED``), which fills
the page cache with 4 KiB folios; QEMU's faults then find them there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from blockdiff.errors import BlockdiffError, DiskUsedEarly, GuestTimeout, VMError
from blockdiff.progress import NO_PROGRESS, Progress, Steps
from blockdiff.vm import device_state, waiting
from blockdiff.vm.device_state import DEVICE_STATE_AREA, MEMORY_IMAGE, MiB
from blockdiff.vm.guestlink import MEMORY_CHECKPOINT_VERSION, GuestLink
from blockdiff.vm.intents import crash_point
from blockdiff.vm.procs import command_line, holds, is_qemu, usage, wait_exit
from blockdiff.vm.qemu import (
    CONSOLE_LOG,
    GUEST_SOCKET,
    PID_FILE,
    QMP,
    QMP_SOCKET,
    Launch,
    choose_accel,
)
from blockdiff.vm.qmp_talk import (
    NBD_SOCKET,
    Written,
    drop_dirty_bitmaps,
    read_dirty_bitmap,
    replace_dirty_bitmap,
    set_ignore_shared,
    start_dirty_tracking,
)
from blockdiff.vm.registry import KERNEL_FILES, VMEntry
from blockdiff.vm.reserve import own_blocks, own_disk
from blockdiff.vm.tracking import TRACKING, DirtyTracking, Generation
from blockdiff.vm.waiting import WAITING, WAITING_FORK, WAITING_KINDS, fork_waiting

DEFAULT_BOOT_TIMEOUT = 120.0
ACCEL_FILE = "accel"
GUESTD_VERSION = "guestd-version"   # what the guest daemon answered at boot
RUNTIME_FILES = (QMP_SOCKET, GUEST_SOCKET, PID_FILE, NBD_SOCKET, TRACKING, GUESTD_VERSION)
# One POSIX_FADV_WILLNEED reads ahead at most the device's readahead window
# (128 KiB by default), so the memory image is warmed in steps of that.
WARM_STEP = 128 << 10
# What callers import from here, some of it from the modules below.
__all__ = ["DEFAULT_BOOT_TIMEOUT", "DEVICE_STATE_AREA", "WAITING", "WAITING_FORK",
           "WAITING_KINDS", "Machine", "Pause", "Written", "console_tail", "fork_waiting",
           "warm_page_cache", "warm_page_cache_ranges"]


@dataclass
class Pause:
    """One pause of the VM (see :meth:`Machine.paused`)."""

    written: Written | None = None   # the guest's writes since the previous pause
    seconds: float = 0.0             # how long the VM was stopped, once it runs again
    memory: Path | None = None       # with memory=True: the memory image, device state saved
    device_state: int = 0            # bytes of device state behind the RAM
    generation: Generation | None = None   # the dirty bitmap that started in the pause
    frozen: str | None = None   # the bitmap it froze, until read (if it is to be trusted)
    disk_writes: int = -1       # with read_later: QEMU's count of disk writes before the stop

class Machine:
    """The QEMU process of one VM, whether it runs or not (it outlives this
    object). As a context manager, the VM is shut down at the end of the block."""

    def __init__(self, vm: VMEntry):
        self.vm = vm
        self.directory = vm.directory
        self.tracking = DirtyTracking(vm.directory)
        self.memory_image = vm.directory / MEMORY_IMAGE
        self._qmp: QMP | None = None   # the connection of the outermost open qmp() block
        self.last_launch: dict[str, float] = {}   # seconds per phase of the last launch
        self._warming: threading.Event | None = None   # set to stop the warm-up
        self.took_waiting = False   # whether the last launch took over a waiting QEMU

    def __enter__(self) -> "Machine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------ process

    @property
    def pid(self) -> int | None:
        """QEMU's pid while this VM's QEMU runs (checked against its command
        line, so a reused pid is never taken for the VM)."""
        return self._qemu_of(self.directory / PID_FILE)

    def _qemu_of(self, pid_file: Path) -> int | None:
        """The pid in ``pid_file`` if it is a QEMU that holds this VM's disk
        open (by the file, not a path on its command line: a QEMU started
        ahead was given its files by descriptor)."""
        try:
            pid = int(pid_file.read_text())
            if is_qemu(command_line(pid)) and holds(pid, self.vm.disk):
                return pid
        except (OSError, ValueError):
            pass
        return None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def ram_bytes(self) -> int:
        return self.vm.memory_mb * MiB

    @property
    def memory_backed(self) -> bool:
        """Whether the running QEMU keeps guest RAM in the memory image (and so
        can take a memory checkpoint)."""
        pid = self.pid
        return pid is not None and holds(pid, self.memory_image)

    def guest_knows_memory_checkpoints(self) -> bool:
        """Whether the running guest's daemon can hold its processes during a
        memory checkpoint and fix its clock and RNG after one (an initramfs
        built before it could cannot)."""
        try:
            version = (self.directory / GUESTD_VERSION).read_text().split()
            return int(version[-1]) >= MEMORY_CHECKPOINT_VERSION
        except (OSError, ValueError, IndexError):
            return False

    def signature(self) -> dict:
        """The machine configuration a memory checkpoint of this VM records,
        and must find again to be resumed (see :meth:`Launch.signature`): that
        of the running QEMU, or of the one a launch would start."""
        accel = self.accel if self.running else None
        if accel is None:
            kernel_dir = self.vm.kernel_dir
            accel, _ = choose_accel(kernel_dir / "vmlinuz", kernel_dir / "initrd.img")
        return self._launch(accel).signature()

    def _launch(self, accel: str, *, memory: bool = False, incoming: bool = False,
                memory_image: Path | None = None, runtime_prefix: str = "") -> Launch:
        kernel_dir = self.vm.kernel_dir
        if memory or incoming:
            memory_image = memory_image or self.memory_image
        return Launch(self.vm.name, self.directory, kernel_dir / "vmlinuz",
                      kernel_dir / "initrd.img", self.vm.disk, self.vm.memory_mb, self.vm.cpus,
                      accel, memory_image, incoming, runtime_prefix)

    @property
    def accel(self) -> str | None:
        """The accelerator of the last launch: ``kvm`` or ``tcg``."""
        try:
            return (self.directory / ACCEL_FILE).read_text().strip()
        except OSError:
            return None

    def launch(self, timeout: float = DEFAULT_BOOT_TIMEOUT,
               progress: Progress = NO_PROGRESS, *, memory: bool = False,
               incoming: bool = False, mark: str | None = None,
               meanwhile=None, disk_meanwhile=None, hot=None) -> None:
        """Start QEMU, wait until the guest daemon answers, and start tracking
        the guest's disk writes, each a phase of ``progress``. If the guest
        does not come up in time, or QEMU exits, QEMU is killed and the
        VMError quotes the guest's console.

        ``memory``: guest RAM is the memory image, so that checkpoints can
        hold it. ``incoming`` (implies ``memory``): no boot; the guest resumes
        from the RAM and device state in the memory image (its disk must be
        the disk of the same checkpoint), its clock set and its random-number
        generator reseeded before any of its processes runs again. ``mark``,
        the disk's lineage mark, lets the first checkpoint after such a
        launch trust the dirty bitmap, which then starts with the disk being
        that snapshot.

        ``meanwhile`` (with ``incoming``): called while QEMU starts, before
        it loads anything, to put the disk and the memory image in place in
        the files that exist already (an in-place restore, neither file's
        size changed), and returning the disk's lineage mark then (taken
        for ``mark``): QEMU opens the files, but reads neither until the
        device state is loaded, as in a migration over shared storage.
        Should it raise, QEMU is killed.

        ``disk_meanwhile`` (with ``meanwhile``, which then puts only the
        memory image in place): called in a thread of its own once
        ``meanwhile`` returned, while the device state loads and the guest's
        CPUs start, to put the disk in place and return its lineage mark.
        The guest is resumed (its filesystem and processes, frozen since the
        checkpoint, let go) only once it returned; until then it does not
        use its disk, which QEMU's count of the disk's requests (none since
        it started) confirms, else :class:`DiskUsedEarly` once QEMU is
        killed. Should it raise, QEMU is killed.

        ``hot`` (with ``incoming``): ``(offsets, lengths)`` of the memory
        image that the guest is likely to write soon, whose page cache is
        warmed before the guest runs; the rest of that new file is warmed
        while it runs. Without it, an image restored in place is warmed
        whole before (its page cache is mostly there)."""
        name = self.vm.name
        if self.running:
            raise VMError(f"VM {name} is already running")
        kernel_dir = self.vm.kernel_dir
        if not all((kernel_dir / f).is_file() for f in KERNEL_FILES):
            raise VMError(f"the kernel of VM {name} is missing from {kernel_dir}; "
                          f"recreate the VM with --kernel DIR")
        kernel, initrd = kernel_dir / "vmlinuz", kernel_dir / "initrd.img"
        memory = memory or incoming
        steps = Steps(progress, 2)
        steps.begin("starting QEMU")
        began = time.monotonic()
        accel, _ = choose_accel(kernel, initrd)
        if memory:
            # The memory image must be at its size before QEMU maps it. A
            # boot warms its page cache before QEMU runs the guest; a resume
            # once the guest runs (see _resume_incoming).
            fd = device_state.open_memory_image(self.vm, fresh=not incoming)
            try:
                if not incoming:
                    own_blocks((self.memory_image,), f"booting VM {name}")   # vm.reserve
                    own_disk(self.memory_image, self.vm.disk)
                    with contextlib.suppress(OSError):   # only slower checkpoints
                        warm_page_cache(fd, self.ram_bytes)
            finally:
                os.close(fd)
        (self.directory / CONSOLE_LOG).unlink(missing_ok=True)
        warming = disk = None
        self.took_waiting = False
        with ThreadPoolExecutor(2) as pool:
            if meanwhile is None:
                waiting.start_or_take(self, self._launch(accel, memory=memory, incoming=incoming))
            else:
                mark, disk = self._start_meanwhile(
                    self._launch(accel, memory=True, incoming=True), meanwhile,
                    disk_meanwhile, pool)
                if hot is None:
                    # Restored in place, the image kept its page cache but where
                    # the restore rewrote: warmed whole (quickly) while the
                    # device state loads, before the guest runs.
                    warming = _warm_in_background(
                        device_state.open_memory_image(self.vm, fresh=False), self.ram_bytes)
            (self.directory / ACCEL_FILE).write_text(accel + "\n")
            self.last_launch = {"qemu": time.monotonic() - began}
            if incoming:
                steps.begin("resuming from the checkpoint")
                self._resume_incoming(timeout, mark, hot, warming, disk)
                return steps.end()
        deadline = time.monotonic() + timeout
        steps.begin(f"booting: waiting for the guest daemon ({accel})")
        try:
            with self.guest() as link:
                version = link.ping(timeout=max(deadline - time.monotonic(), 0.1))
            (self.directory / GUESTD_VERSION).write_text(version + "\n")
        except GuestTimeout:
            self.kill()
            raise VMError(f"VM {name} did not come up within {timeout:.0f} s ({accel}); "
                          f"its console: {console_tail(self.directory)}") from None
        except VMError:
            self.kill()
            raise VMError(f"VM {name} stopped while booting; its console: "
                          f"{console_tail(self.directory)}") from None
        steps.end()
        # Without tracking (a QEMU that refuses it), every snapshot maps the
        # whole disk: slower, never wrong.
        with contextlib.suppress(VMError, OSError), self.qmp() as q, self._dir_fd() as fd:
            if memory:
                set_ignore_shared(q)
            self.tracking.write(Generation(self.pid, start_dirty_tracking(q, fd)))

    def _start_meanwhile(self, launch: Launch, meanwhile, disk_meanwhile,
                         pool: ThreadPoolExecutor):
        """Start QEMU in a thread of ``pool`` while ``meanwhile()`` runs in
        this one, then ``disk_meanwhile`` (if given) in another; returns
        what ``meanwhile`` returns and the future of ``disk_meanwhile``."""
        started = pool.submit(waiting.start_or_take, self, launch)
        disk = None
        try:
            result = meanwhile()
            if disk_meanwhile is not None:
                disk = pool.submit(disk_meanwhile)
            started.result()
        except BaseException:
            for future in (started, disk):
                if future is not None:
                    with contextlib.suppress(Exception):
                        future.result()
            self.kill()
            raise
        return result, disk

    # ----------------------------------------------------- waiting QEMUs
    # QEMUs started ahead for the next restore or fork to take over: see
    # blockdiff.vm.waiting.

    def start_waiting(self, memory_image: Path, disk: Path | None = None, *,
                      kind: str = WAITING) -> None:
        """Have a QEMU wait with ``-incoming defer`` on ``memory_image`` and
        ``disk`` (the VM's own by default) for the next incoming launch to take
        over; ``kind`` WAITING or ``fork_waiting(N)``. See
        :func:`blockdiff.vm.waiting.start_waiting`."""
        waiting.start_waiting(self, memory_image, disk, kind=kind)

    def kill_waiting(self, kinds=WAITING_KINDS, *, holding: Path | None = None) -> None:
        """Kill every QEMU of these kinds waiting in this VM's directory (with
        ``holding``, only those that hold that file), and remove their files."""
        waiting.kill_waiting(self, kinds, holding=holding)

    def forks_waiting(self, source: Path) -> list[int]:
        """The numbers of the pairs of spares in directory ``source`` (another
        VM's) that a fork's QEMU waits on."""
        return waiting.forks_waiting(self, source)

    def hand_over_waiting(self, source: Path) -> bool:
        """Take over into this VM's directory the fork's QEMU waiting in
        ``source`` if it holds this VM's files now; whether there was one."""
        return waiting.hand_over_waiting(self, source)

    def _resume_incoming(self, timeout: float, mark: str | None, hot,
                         warming: threading.Thread | None, disk=None) -> None:
        """QEMU started with ``-incoming defer``: load the device state from
        the memory image, start dirty tracking, run the guest and have its
        daemon fix the clock and the RNG and let its processes go; with
        ``disk`` (the future of ``disk_meanwhile``, see :meth:`launch`), not
        before the disk is in place and QEMU counts no request on it."""
        name = self.vm.name
        began = time.monotonic()
        try:
            # Connected before the guest runs, the guest daemon's port stays
            # open across the checkpoint: the daemon reads the request at once
            # instead of first waiting out a closed port.
            with self.guest() as link, self.qmp() as q, self._dir_fd() as dir_fd:
                set_ignore_shared(q)
                crash_point("resume.started")
                device_state.load(q, self.memory_image, self.ram_bytes, timeout)
                crash_point("resume.loaded")
                loaded = time.monotonic()
                bitmap = None
                with contextlib.suppress(VMError, OSError):
                    bitmap = start_dirty_tracking(q, dir_fd)
                tracked = time.monotonic()
                if warming is not None:
                    warming.join()
                elif hot is not None:
                    warm_fd = os.open(self.memory_image, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        with contextlib.suppress(OSError):   # only slower checkpoints
                            warm_page_cache_ranges(warm_fd, *hot)
                    finally:
                        os.close(warm_fd)
                warmed = time.monotonic()
                q.command("cont")
                running = time.monotonic()
                if disk is not None:
                    mark = self._disk_in_place(disk)
                placed = time.monotonic()
                if bitmap is not None:
                    # Trusted from the disk's mark on: the guest writes only
                    # once resumed, and the host's restore is not in the bitmap.
                    with contextlib.suppress(OSError):
                        self.tracking.write(Generation(self.pid, bitmap, mark))
                answering = usage(self.pid)
                crash_point("resume.running")
                link.resume(timeout=timeout)
                answered = usage(self.pid)
            if warming is None:
                # A new file (a fork's): the rest is warmed while the guest
                # runs, not before, since reading all of it would slow QEMU's
                # start on these cores more than it saves. What the guest
                # faults in first is cached in large folios, which are
                # written back whole if dirtied, but stored no larger (only
                # the pages whose bytes changed are). The warm-up stops when
                # QEMU does: reading a dead VM's image slows the next one.
                self._warming = threading.Event()
                _warm_in_background(device_state.open_memory_image(self.vm, fresh=False),
                                    self.ram_bytes, self._warming)
            # A daemon that resumed knows memory checkpoints.
            (self.directory / GUESTD_VERSION).write_text(
                f"blockdiff-guestd {MEMORY_CHECKPOINT_VERSION}\n")
        except BaseException as e:
            if warming is not None:
                warming.join()
            self.kill()
            if isinstance(e, VMError) and not isinstance(e, DiskUsedEarly):
                raise VMError(f"VM {name} did not resume from its checkpoint: {e}") from None
            raise   # the disk's own error (its restore failed), or DiskUsedEarly
        finally:
            if disk is not None:
                with contextlib.suppress(Exception):
                    disk.result()   # done before its files are touched again
        self.last_launch |= {"incoming": loaded - began, "tracking": tracked - loaded,
                             "warm": warmed - tracked, "cont": running - warmed,
                             "disk-wait": placed - running,
                             "guest": time.monotonic() - placed}
        # Whether a slow answer was the guest's own work, a wait for the
        # host's cores, or a wait for the disk: what QEMU and the host ran
        # meanwhile, and how often QEMU's faults on guest RAM read the disk.
        if None not in (answering, answered):
            self.last_launch |= {"guest-qemu-cpu": answered[0] - answering[0],
                                 "guest-host-cpu": answered[1] - answering[1],
                                 "guest-major-faults": answered[2] - answering[2]}

    def _disk_in_place(self, disk) -> str | None:
        """The disk's lineage mark once ``disk`` (see :meth:`launch`) put it
        in place; :class:`DiskUsedEarly` if QEMU counts a request on the
        disk by then (every request since it started: none is expected), or
        does not say."""
        mark = disk.result()
        stats = self._disk_stats()
        used = sum(stats.get(k, 0) for k in ("rd_operations", "wr_operations",
                                             "flush_operations", "unmap_operations"))
        if used or not stats:
            raise DiskUsedEarly(f"the guest of VM {self.vm.name} may have used its disk "
                                f"({used if stats else 'uncounted'} requests) before it "
                                f"was restored")
        return mark

    def shutdown(self, timeout: float = 20.0) -> None:
        """Power the guest off cleanly (its disk unmounted); QEMU is killed if
        it has not exited within ``timeout`` seconds. Any QEMU waiting
        for the next restore is killed."""
        self.kill_waiting()
        pid = self.pid
        if pid is None:
            return
        with contextlib.suppress(VMError):
            with self.guest() as link:
                link.shutdown(timeout=min(timeout, 5.0))
            if wait_exit(pid, timeout):
                return self._cleanup()
        self.kill()

    def kill(self, *, keep_waiting: bool = False) -> None:
        """Kill QEMU at once (the disk holds what the guest had written, as
        after a power cut) and remove the runtime files; also any QEMU
        waiting for the next restore, unless ``keep_waiting`` (a restore's
        own kill)."""
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_exit(pid, 10.0)
        self._cleanup()
        if not keep_waiting:
            self.kill_waiting()

    def _cleanup(self) -> None:
        if self._warming is not None:
            self._warming.set()
            self._warming = None
        for f in RUNTIME_FILES:
            (self.directory / f).unlink(missing_ok=True)

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
    def paused(self, mark: str | None, *, memory: bool = False, read_later: bool = False):
        """The VM paused for the block, and resumed at its end whatever happens.

        Yields a :class:`Pause`. Its ``written`` holds the byte ranges the
        guest wrote or discarded on its disk since the previous pause, when
        the disk's lineage mark ``mark`` is the one :meth:`trust_tracking`
        was given after that pause (no commit or restore came between); else None, as
        without tracking. Once the disk is committed or restored, call
        :meth:`trust_tracking` with its new lineage mark, so that the next
        pause can trust what this one starts to track. ``seconds`` is set
        once the VM runs again.

        ``read_later`` (for a guest that is not to write its disk, its
        filesystem frozen): the old bitmap is frozen just before the stop,
        and ``written`` is read by :meth:`read_written` once the VM runs
        again; ``disk_writes`` is QEMU's count of the disk's writes taken
        before that, by which the caller tells whether the disk still holds
        what the bitmap says: a write after the count moves it.

        With ``memory`` (a QEMU whose RAM is the memory image), QEMU saves
        the device state while the block runs, in a thread of its own (it
        leaves the RAM as it is: ``tests/test_vm_memory.py`` checks), and
        ``pause.memory`` names the image. Its RAM captured within the
        block, and its device-state area (:attr:`device_state_area`, written
        once the VM runs again, after the block) captured then, with the
        disk, it is a checkpoint of the whole VM.
        """
        with self.qmp() as q:
            pause = Pause()
            if read_later:
                # The caller compares the count with its own after the pause
                # anyway, so count and swap need not be in it: a write from
                # here to the stop moves the count.
                pause.disk_writes = self.disk_writes()
                pause.generation, pause.frozen = self._next_generation(mark)
            self.pause()
            stopped = time.monotonic()
            saving = state = None
            try:
                if not read_later:
                    pause.generation, pause.frozen = self._next_generation(mark)
                    self.read_written(pause, drop=False)
                if memory:
                    saving = device_state.start_saving(q)
                    pause.memory = self.memory_image
                yield pause
                if saving is not None:
                    fd, saving = saving, None
                    state = device_state.saved(q, fd, self.vm.name)
                    pause.device_state = len(state)
            finally:
                if saving is not None:   # the block failed; QEMU is to be done before cont
                    with contextlib.suppress(VMError):
                        device_state.saved(q, saving, self.vm.name)
                self.resume()
                pause.seconds = time.monotonic() - stopped
            if state is not None:
                device_state.write(self.memory_image, self.ram_bytes, state)
            if not read_later:
                self._drop_old_bitmaps(pause)

    def read_written(self, pause: Pause, *, drop: bool = True) -> Written | None:
        """``pause.written``: what the bitmap that pause froze says the guest
        wrote (None if it is not to be trusted or cannot be read); ``drop``:
        the old bitmaps are then dropped (after a ``read_later`` pause)."""
        if pause.frozen is not None:
            with contextlib.suppress(OSError, BlockdiffError), self.qmp() as q, \
                    self._dir_fd() as fd:
                pause.written = read_dirty_bitmap(q, fd, pause.frozen)
            pause.frozen = None
        if drop:
            self._drop_old_bitmaps(pause)
        return pause.written

    def _drop_old_bitmaps(self, pause: Pause) -> None:
        if pause.generation is not None:
            with contextlib.suppress(VMError), self.qmp() as q:
                drop_dirty_bitmaps(q, keep=pause.generation.bitmap)

    def trust_tracking(self, pause: Pause, mark: str) -> None:
        """After :meth:`paused`: the dirty bitmap that started in that pause
        started with the disk being what lineage mark ``mark`` names (the
        snapshot the disk was captured as, or restored to, in the pause or
        with the guest unable to write)."""
        if pause.generation is not None:
            self.tracking.write(replace(pause.generation, mark=mark))

    def stop_for_good(self, mark: str | None) -> Written | None:
        """Stop the guest's CPUs for a QEMU about to be killed, and return what
        the guest wrote to its disk since the disk's lineage mark was
        ``mark`` (as :meth:`paused` would; None if that is not known), so
        that restoring the disk afterwards need not map it whole."""
        with self.qmp():
            self.pause()
            pause = Pause()
            pause.generation, pause.frozen = self._next_generation(mark)
            return self.read_written(pause, drop=False)

    def _next_generation(self, mark: str | None) -> tuple[Generation | None, str | None]:
        """With the VM paused: a new bitmap takes over. Returns its generation
        (None without tracking) and the name of the old, now frozen, bitmap
        if it started when the disk's lineage mark was ``mark`` (else None:
        what it says is not to be trusted)."""
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
        return new, old.bitmap

    @property
    def device_state_area(self) -> Written:
        """``(offsets, lengths)`` of the memory image's device-state area."""
        return device_state.area(self.ram_bytes)


    def disk_writes(self) -> int:
        """Write, write-zeroes and discard requests QEMU has served on the
        disk since it started (-1 if it does not say)."""
        stats = self._disk_stats()
        if not stats:
            return -1
        return stats.get("wr_operations", 0) + stats.get("unmap_operations", 0)

    def _disk_stats(self) -> dict:
        """QEMU's counts of the requests it served on the disk since it
        started (``query-blockstats``; empty if it does not say)."""
        with self.qmp() as q:
            devices = q.command("query-blockstats")
        for device in devices:
            if device.get("device") == "disk0" or device.get("qdev", "").startswith("disk0"):
                return device["stats"]
        return {}


# How much of the end of a console log a message quotes from.
CONSOLE_TAIL = 64 * 1024


def console_tail(directory: Path, lines: int = 3) -> str:
    """The last ``lines`` non-empty lines of a VM's console log, for
    messages. The guest writes that log: only its last CONSOLE_TAIL bytes
    are read, whatever its size."""
    try:
        with open(directory / CONSOLE_LOG, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - CONSOLE_TAIL))
            text = f.read(CONSOLE_TAIL).decode(errors="replace")
    except OSError:
        return "no console output"
    kept = [line.strip()[:200] for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "no console output"




# ------------------------------------------------------------------ memory


def _warm_in_background(fd: int, length: int,
                        stop: threading.Event | None = None) -> threading.Thread:
    """:func:`warm_page_cache` of an open descriptor in a thread of its own
    (the kernel reads ahead without the GIL), which closes it once done."""

    def run() -> None:
        try:
            with contextlib.suppress(OSError):   # only slower checkpoints: never fatal
                warm_page_cache(fd, length, stop)
        finally:
            os.close(fd)

    thread = threading.Thread(target=run, name="warm-memory-image", daemon=True)
    thread.start()
    return thread


def warm_page_cache(fd: int, length: int, stop: threading.Event | None = None) -> None:
    """Have the kernel read the first ``length`` bytes of a file ahead into the
    page cache. Readahead asked for this way fills it with 4 KiB folios,
    which the large folios a ``MADV_HUGEPAGE`` mapping would fault in then
    cannot replace; pages already cached are skipped. Ends early once
    ``stop`` is set."""
    warm_page_cache_ranges(fd, [0], [length], stop)


def warm_page_cache_ranges(fd: int, offsets, lengths,
                           stop: threading.Event | None = None) -> None:
    """:func:`warm_page_cache` of some ranges of a file only."""
    for offset, length in zip(np.asarray(offsets).tolist(), np.asarray(lengths).tolist()):
        for at in range(offset, offset + length, WARM_STEP):
            if stop is not None and stop.is_set():
                return
            os.posix_fadvise(fd, at, min(WARM_STEP, offset + length - at),
                             os.POSIX_FADV_WILLNEED)
