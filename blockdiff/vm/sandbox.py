"""Sandbox VMs whose disks live in a snapshot store.

A sandbox is a QEMU VM with a raw disk image in ``<store>/vms/<name>/``. After
each agent step, :meth:`Sandbox.checkpoint` freezes the guest's filesystem,
pauses the VM, commits the disk to the store (a metadata operation on a
reflink filesystem) and resumes: the VM is paused only for the commit.
:meth:`Sandbox.restore` puts a running VM's disk back to any snapshot without
rebooting it: the guest agent ends every process and unmounts the disk, the
store patches the image in place, and the agent mounts it again with nothing
of the old contents cached. :meth:`Sandbox.fork` starts a new VM from any
snapshot.

Layout of ``<store>/vms/``::

    .kernels/<key>/{vmlinuz,initrd.img}   kernels, shared by the VMs using them
    <name>/vm.json                        configuration
    <name>/disk.img                       the disk (reflinked from the store)
    <name>/console.log                    the guest's serial console
    <name>/{qmp,agent}.sock, qemu.pid     while QEMU runs
    <name>/lock                           serialises operations on the VM
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from blockdiff.engine.files import copy_file
from blockdiff.engine.identity import sha256_file
from blockdiff.errors import BlockdiffError, UnknownVM, UsageError
from blockdiff.store.store import Store, open_store
from blockdiff.vm.guestlink import THAW, AgentLink, ExecResult, GuestError, GuestTimeout
from blockdiff.vm.qemu import (
    NBD_SOCKET,
    QMP,
    Launch,
    VMError,
    choose_accel,
    drop_dirty_bitmaps,
    read_dirty_bitmap,
    replace_dirty_bitmap,
    start_dirty_tracking,
)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
KERNEL_FILES = ("vmlinuz", "initrd.img")
DEFAULT_BOOT_TIMEOUT = 120.0
TRACKING = "dirty-tracking.json"


@dataclass(frozen=True)
class CheckpointTiming:
    """Seconds spent in each phase of the last checkpoint."""

    freeze: float    # the guest flushing and freezing its filesystem
    paused: float    # the VM stopped: the dirty bitmap read, the commit
    total: float
    tracked: bool = False   # QEMU's dirty bitmap said what to map


@dataclass
class Pause:
    """One pause of the VM for its disk (see ``Sandbox._paused``)."""

    written: tuple | None = None   # the guest's writes since the lineage snapshot
    seconds: float = 0.0


@dataclass(frozen=True)
class RestoreTiming:
    seconds: float   # from the call until the VM runs commands again
    rebooted: bool   # False when the disk was swapped under the running guest
    tracked: bool = False   # QEMU's dirty bitmap said what was written


@dataclass(frozen=True)
class VMStatus:
    name: str
    running: bool
    pid: int | None
    snapshot: str | None
    accel: str | None


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no console output"
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept) if kept else "no console output"


class Sandbox:
    """One sandbox VM. Use it as a context manager: the VM is stopped on exit
    (and its directory removed if it was created ``ephemeral``)."""

    def __init__(self, store: Store | str | os.PathLike, name: str):
        self.store = store if isinstance(store, Store) else open_store(store)
        if not NAME.fullmatch(name or ""):
            raise UsageError(f"bad VM name {name!r}: use letters, digits, '.', '_' and '-'")
        self.name = name
        # Absolute, whatever the store was opened as: QEMU starts in the VM's
        # directory and daemonizes, so it must be given no path relative to
        # this process's working directory (a relative --store).
        self.root = Path(os.path.abspath(self.store.root))
        self.directory = self.root / "vms" / name
        if not (self.directory / "vm.json").is_file():
            raise UnknownVM(f"no VM named {name} in {self.store.root}; list them with: "
                            f"blockdiff vm ls")
        self.config = json.loads((self.directory / "vm.json").read_text())
        self.disk = self.directory / "disk.img"
        self.ephemeral = False
        # Seconds to wait for the guest agent's answer to a freeze, a thaw or
        # a detach before treating the guest as unresponsive.
        self.guest_timeout = 30.0
        self.last_checkpoint: CheckpointTiming | None = None
        self.last_restore: RestoreTiming | None = None

    # ----------------------------------------------------------- creation

    @classmethod
    def create(cls, store: Store | str | os.PathLike, name: str, *,
               image: str | os.PathLike | None = None, snapshot: str | None = None,
               kernel: str | os.PathLike | None = None, memory_mb: int = 256, cpus: int = 1,
               ephemeral: bool = False) -> "Sandbox":
        """A new, stopped VM whose disk is a copy of ``image`` (reflinked when
        it is on the store's filesystem; committed as the VM's root snapshot)
        or a fork of store snapshot ``snapshot``.
        ``kernel`` is a directory holding ``vmlinuz`` and ``initrd.img`` (made by
        ``blockdiff vm build-image``); by default the image's own directory, or
        the kernel the snapshot was taken with."""
        store = store if isinstance(store, Store) else open_store(store)
        if not NAME.fullmatch(name or ""):
            raise UsageError(f"bad VM name {name!r}: use letters, digits, '.', '_' and '-'")
        if (image is None) == (snapshot is None):
            raise UsageError("give exactly one of an image (--image) or a snapshot (--from)")
        if memory_mb < 64 or cpus < 1:
            raise UsageError("a VM needs at least 64 MiB of memory and one CPU")
        if image is not None and not Path(image).is_file():
            raise UsageError(f"no disk image at {image}")
        snap = store.get(snapshot) if snapshot is not None else None
        kernel_key = _install_kernel(store, _kernel_source(store, kernel, image, snap))

        vms = store.root / "vms"
        vms.mkdir(exist_ok=True)
        directory = vms / name
        staging = vms / f".{name}.creating"
        try:
            directory.mkdir()
        except FileExistsError:
            raise VMError(f"a VM named {name} already exists; remove it with: "
                          f"blockdiff vm rm {name}") from None
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            if snap is not None:
                store.restore(snap.id, staging / "disk.img")
            else:
                copy_file(Path(image), staging / "disk.img")
            source = {"snapshot": snap.id} if snap else {"image": os.path.abspath(image)}
            config = {"name": name, "kernel": kernel_key, "memory_mb": memory_mb, "cpus": cpus,
                      "created": time.time(), "source": source}
            (staging / "vm.json").write_text(json.dumps(config, indent=2) + "\n")
            for entry in staging.iterdir():
                os.replace(entry, directory / entry.name)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        sandbox = cls(store, name)
        sandbox.ephemeral = ephemeral
        if snap is None:
            # The image as given becomes the root snapshot now, while nothing
            # runs: the first checkpoint then pauses the VM only for what the
            # first step changed, not for the whole disk.
            try:
                store.commit(sandbox.disk, message=f"VM {name} created from {Path(image).name}",
                             meta={"vm": name, "vm.kernel": kernel_key})
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                raise
        return sandbox

    @staticmethod
    def list(store: Store | str | os.PathLike) -> list["Sandbox"]:
        store = store if isinstance(store, Store) else open_store(store)
        vms = store.root / "vms"
        if not vms.is_dir():
            return []
        return [Sandbox(store, d.name) for d in sorted(vms.iterdir())
                if not d.name.startswith(".") and (d / "vm.json").is_file()]

    # ------------------------------------------------------------- state

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        if self.ephemeral:
            self.destroy()
        else:
            self.stop()

    @property
    def pid(self) -> int | None:
        """QEMU's pid while this VM's QEMU runs (checked against its command
        line, so a reused pid is never taken for the VM)."""
        try:
            pid = int((self.directory / "qemu.pid").read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        if f"blockdiff-{self.name}".encode() in cmdline and any(
                arg.startswith(b"file=" + bytes(self.disk)) for arg in cmdline):
            return pid
        return None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def status(self) -> VMStatus:
        snapshot, _ = self.store.lineage(self.disk)
        accel = None
        with contextlib.suppress(OSError):
            accel = (self.directory / "accel").read_text().strip()
        return VMStatus(self.name, self.running, self.pid, snapshot, accel)

    @contextlib.contextmanager
    def _lock(self):
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._recover_checkpoint()
            yield
        finally:
            os.close(fd)

    def _recover_checkpoint(self) -> None:
        """A checkpoint whose process died may have left the VM paused and its
        filesystem frozen; under the lock, nothing else can be checkpointing."""
        marker = self.directory / "checkpointing"
        if not marker.exists():
            return
        if self.running:
            with contextlib.suppress(VMError), self.qmp() as q:
                q.command("cont")
            with contextlib.suppress(GuestError), self._dir_fd() as fd, \
                    AgentLink("agent.sock", dir_fd=fd) as link:
                link.thaw(timeout=self.guest_timeout)
        marker.unlink()

    @contextlib.contextmanager
    def _dir_fd(self):
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def agent(self):
        """A connection to the guest agent."""
        if not self.running:
            raise VMError(f"VM {self.name} is not running; start it with: "
                          f"blockdiff vm start {self.name}")
        with self._dir_fd() as fd, AgentLink("agent.sock", dir_fd=fd) as link:
            yield link

    @contextlib.contextmanager
    def qmp(self):
        with self._dir_fd() as fd, QMP("qmp.sock", dir_fd=fd) as q:
            yield q

    # ---------------------------------------------------------- lifecycle

    def start(self, *, timeout: float = DEFAULT_BOOT_TIMEOUT) -> None:
        """Boot the VM (in the background) and wait until its agent answers."""
        with self._lock():
            if not self.running:
                self._boot(timeout)

    def _boot(self, timeout: float) -> None:
        kernel_dir = self.root / "vms" / ".kernels" / self.config["kernel"]
        if not all((kernel_dir / f).is_file() for f in KERNEL_FILES):
            raise VMError(f"the kernel of VM {self.name} is missing from {kernel_dir}; "
                          f"recreate the VM with --kernel DIR")
        kernel, initrd = kernel_dir / "vmlinuz", kernel_dir / "initrd.img"
        accel, _ = choose_accel(kernel, initrd)
        (self.directory / "console.log").unlink(missing_ok=True)
        Launch(self.name, self.directory, kernel, initrd, self.disk,
               self.config["memory_mb"], self.config["cpus"], accel).start()
        (self.directory / "accel").write_text(accel + "\n")
        deadline = time.monotonic() + timeout
        try:
            with self.agent() as link:
                link.ping(timeout=max(deadline - time.monotonic(), 0.1))
        except GuestTimeout:
            self._kill()
            raise VMError(f"VM {self.name} did not come up within {timeout:.0f} s "
                          f"({accel}); its console: {_tail(self.directory / 'console.log')}"
                          ) from None
        except (GuestError, VMError):
            self._kill()
            raise VMError(f"VM {self.name} stopped while booting; its console: "
                          f"{_tail(self.directory / 'console.log')}") from None
        # Without tracking (a QEMU that refuses it), every snapshot maps the
        # whole disk: slower, never wrong.
        with contextlib.suppress(VMError, OSError), self.qmp() as q, self._dir_fd() as fd:
            bitmap = start_dirty_tracking(q, fd)
            self._write_tracking({"pid": self.pid, "bitmap": bitmap, "mark": None})

    def stop(self, *, timeout: float = 20.0) -> None:
        """Shut the guest down cleanly (its disk unmounted); QEMU is killed if
        the guest does not power off in time."""
        with self._lock():
            pid = self.pid
            if pid is None:
                return
            with contextlib.suppress(GuestError, VMError):
                with self.agent() as link:
                    link.shutdown(timeout=min(timeout, 5.0))
                if _wait_exit(pid, timeout):
                    return self._clean_runtime()
            self._kill()

    def _kill(self) -> None:
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 10.0)
        self._clean_runtime()

    def _clean_runtime(self) -> None:
        for f in ("qmp.sock", "agent.sock", "qemu.pid", "checkpointing", "last-checkpoint.json",
                  NBD_SOCKET, TRACKING):
            (self.directory / f).unlink(missing_ok=True)

    def destroy(self) -> None:
        """Stop the VM and delete its directory. Snapshots of it stay in the store."""
        with self._lock():
            self._kill()
        shutil.rmtree(self.directory)

    # --------------------------------------------------------------- work

    def exec(self, command: str | list[str], *, timeout: float | None = None,
             input: bytes = b"", cwd: str = "/") -> ExecResult:
        """Run a command in the guest: a string through ``/bin/sh -c``, a list
        as it is. ``timeout`` kills it in the guest (the result says so)."""
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        with self._lock(), self.agent() as link:
            return link.exec(argv, timeout=timeout, stdin=input, cwd=cwd)

    def checkpoint(self, message: str = "", meta: dict | None = None,
                   ttl: float | None = None, skip_unchanged: bool = False) -> str:
        """Snapshot the disk into the store; returns the snapshot id.

        A running guest flushes and freezes its filesystem, then the VM is
        paused (QMP ``stop`` drains every write), the image committed and the
        VM resumed and thawed. A guest whose agent does not answer is
        snapshotted as it is on disk (crash-consistent), and the snapshot's
        ``vm.flush`` says so. With ``skip_unchanged``, a disk with no change
        since its last snapshot gives that snapshot's id and adds no node."""
        meta = {"vm": self.name, "vm.kernel": self.config["kernel"]} | (meta or {})
        with self._lock():
            if not self.running:
                snap = self.store.commit(self.disk, message=message, meta=meta, ttl=ttl,
                                         skip_unchanged=skip_unchanged)
                return snap.id
            start = time.monotonic()
            if skip_unchanged:
                unchanged = self._unchanged_since_checkpoint()
                if unchanged is not None:
                    self.last_checkpoint = CheckpointTiming(0.0, 0.0, time.monotonic() - start)
                    return unchanged
            marker = self.directory / "checkpointing"
            marker.touch()
            with self._dir_fd() as fd, AgentLink("agent.sock", dir_fd=fd) as link, \
                    self.qmp() as q:
                try:
                    link.freeze(auto_thaw=60.0, timeout=self.guest_timeout)
                    meta["vm.flush"] = "fsfreeze"
                except GuestError:
                    meta["vm.flush"] = "none: the guest agent did not answer"
                    # Should the freeze still arrive, the thaw queued behind it
                    # undoes it.
                    with contextlib.suppress(GuestError):
                        link.send(THAW)
                frozen = time.monotonic()
                snap = None
                try:
                    with self._paused(q) as pause:
                        snap = self.store.commit(self.disk, message=message, meta=meta,
                                                 ttl=ttl, skip_unchanged=skip_unchanged,
                                                 written=pause.written)
                finally:
                    if meta["vm.flush"] == "fsfreeze":
                        frozen_writes = _disk_writes(q)  # nothing writes while frozen
                        link.thaw(timeout=self.guest_timeout)
                        thawed_writes = _disk_writes(q)
                        # The thaw writes the superblock once; more means the
                        # guest wrote too, and the next check must not skip.
                        if snap is not None and thawed_writes - frozen_writes <= 1:
                            self._note_checkpoint(snap.id, thawed_writes)
            marker.unlink()
            self.last_checkpoint = CheckpointTiming(frozen - start, pause.seconds,
                                                    time.monotonic() - start,
                                                    pause.written is not None)
            return snap.id

    # Dirty tracking. The record in TRACKING names QEMU's current bitmap and
    # the image's lineage mark when that bitmap was started: while the mark
    # still holds (no commit or restore since), the bitmap has every write
    # since the image was its lineage snapshot.

    def _write_tracking(self, record: dict) -> None:
        tmp = self.directory / f"{TRACKING}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.directory / TRACKING)

    def _tracking(self) -> dict | None:
        try:
            record = json.loads((self.directory / TRACKING).read_text())
        except (OSError, ValueError):
            return None
        return record if record.get("pid") == self.pid else None

    @contextlib.contextmanager
    def _paused(self, q: QMP):
        """The VM paused (QMP ``stop`` drains every write) for a commit or a
        restore of its disk. Yields a ``Pause`` whose ``written`` says what the
        guest wrote since the disk was its lineage snapshot (None: unknown);
        its ``seconds`` are set once the VM runs again."""
        q.command("stop")
        paused = time.monotonic()
        pause = Pause()
        try:
            record, pause.written = self._next_dirty_generation(q)
            yield pause
            if record is not None:
                # The new bitmap started with the disk being what it now records.
                self._write_tracking(record | {"mark": self.store.lineage_mark(self.disk)})
        finally:
            q.command("cont")
            pause.seconds = time.monotonic() - paused
        if record is not None:
            with contextlib.suppress(VMError):
                drop_dirty_bitmaps(q, keep=record["bitmap"])

    def _next_dirty_generation(self, q: QMP):
        """With the VM paused: start a new bitmap. Returns the record naming
        it (None without tracking) and what the old one says was written since
        the disk was its lineage snapshot (None when that is not known)."""
        record = self._tracking()
        if record is None:
            return None, None
        known = record["mark"] is not None and record["mark"] == self.store.lineage_mark(self.disk)
        # Not trusted from here until the new bitmap's baseline is recorded:
        # should this process die after the swap, the next checkpoint must
        # not read the old bitmap, which no longer records.
        self._write_tracking(record | {"mark": None})
        try:
            new = replace_dirty_bitmap(q, record["bitmap"])
        except VMError:
            (self.directory / TRACKING).unlink()   # state unknown: no tracking until a reboot
            return None, None
        current = record | {"bitmap": new, "mark": None}
        self._write_tracking(current)
        if not known:
            return current, None
        with contextlib.suppress(OSError, BlockdiffError), self._dir_fd() as fd:
            return current, read_dirty_bitmap(q, fd, record["bitmap"],
                                              timeout=self.guest_timeout)
        return current, None

    # A freeze and a thaw write to the guest's filesystem, so a running VM's
    # disk always differs after a checkpoint. Whether the guest wrote since is
    # told instead by QEMU's count of the disk's writes, noted right after the
    # thaw and compared after the guest has flushed its page cache.

    def _note_checkpoint(self, snapshot_id: str, writes: int) -> None:
        note = {"snapshot": snapshot_id, "writes": writes, "pid": self.pid}
        (self.directory / "last-checkpoint.json").write_text(json.dumps(note))

    def _unchanged_since_checkpoint(self) -> str | None:
        try:
            note = json.loads((self.directory / "last-checkpoint.json").read_text())
        except (OSError, ValueError):
            return None
        if note.get("pid") != self.pid or self.store.lineage(self.disk)[0] != note["snapshot"]:
            return None
        with contextlib.suppress(VMError, GuestError), self._dir_fd() as fd, \
                AgentLink("agent.sock", dir_fd=fd) as link, self.qmp() as q:
            link.sync(timeout=self.guest_timeout)  # dirty pages become writes QEMU counts
            if _disk_writes(q) == note["writes"]:
                return note["snapshot"]
        return None

    def restore(self, snapshot_id: str, *, timeout: float = DEFAULT_BOOT_TIMEOUT) -> RestoreTiming:
        """Make the disk byte-identical to a snapshot. A running VM runs on:
        its processes end and its disk is swapped under it (or, when that
        cannot be done, it is rebooted); a stopped VM stays stopped."""
        snap = self.store.get(snapshot_id)
        with self._lock():
            start = time.monotonic()
            rebooted = tracked = False
            if not self.running:
                self.store.restore(snap.id, self.disk)
            else:
                swapped = self._swap_disk(snap)
                if swapped is None:
                    self._kill()
                    self.store.restore(snap.id, self.disk)
                    self._boot(timeout)
                    rebooted = True
                else:
                    tracked = swapped
            self.last_restore = RestoreTiming(time.monotonic() - start, rebooted, tracked)
            return self.last_restore

    def _swap_disk(self, snap) -> bool | None:
        """Restore under the running guest; None if that cannot be done here
        (another size, a copy-mode store that replaces files, a mute guest),
        else whether the dirty bitmap said what to rewrite."""
        if self.store.copy_mode or os.path.getsize(self.disk) != snap.size:
            return None
        try:
            with self._dir_fd() as fd, AgentLink("agent.sock", dir_fd=fd) as link:
                link.detach(timeout=self.guest_timeout)
                with self.qmp() as q, self._paused(q) as pause:
                    self.store.restore(snap.id, self.disk, written=pause.written)
                link.attach(timeout=self.guest_timeout)
        except GuestError:
            return None
        return pause.written is not None

    def fork(self, snapshot_id: str, new_name: str, *, start: bool = True,
             timeout: float = DEFAULT_BOOT_TIMEOUT) -> "Sandbox":
        """A new VM, like this one, whose disk is a fork of ``snapshot_id``."""
        other = Sandbox.create(self.store, new_name, snapshot=snapshot_id,
                               kernel=self.root / "vms" / ".kernels" / self.config["kernel"],
                               memory_mb=self.config["memory_mb"], cpus=self.config["cpus"])
        if start:
            other.start(timeout=timeout)
        return other


def _disk_writes(q: QMP) -> int:
    """Write, flush-free, and discard requests QEMU has served on the disk."""
    for device in q.command("query-blockstats"):
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


# -------------------------------------------------------------- kernels


def _kernel_source(store: Store, kernel, image, snap) -> Path:
    if kernel is not None:
        source = Path(kernel)
        missing = [f for f in KERNEL_FILES if not (source / f).is_file()]
        if missing:
            raise UsageError(f"{source} has no {' or '.join(missing)}; give a directory made by: "
                             f"blockdiff vm build-image DIR")
        return source
    if image is not None and all((Path(image).parent / f).is_file() for f in KERNEL_FILES):
        return Path(image).parent
    if snap is not None and snap.meta.get("vm.kernel"):
        installed = store.root / "vms" / ".kernels" / snap.meta["vm.kernel"]
        if all((installed / f).is_file() for f in KERNEL_FILES):
            return installed
    raise UsageError("no kernel for the VM: pass --kernel DIR, a directory made by: "
                     "blockdiff vm build-image DIR")


def _install_kernel(store: Store, source: Path) -> str:
    """Keep the kernel and initramfs under the store, named by their content,
    so a VM still boots after the build directory is gone."""
    key = hashlib.sha256("".join(sha256_file(source / f) for f in KERNEL_FILES)
                         .encode()).hexdigest()[:16]
    target = store.root / "vms" / ".kernels" / key
    if not all((target / f).is_file() for f in KERNEL_FILES):
        target.mkdir(parents=True, exist_ok=True)
        for f in KERNEL_FILES:
            copy_file(source / f, target / f)
    return key
