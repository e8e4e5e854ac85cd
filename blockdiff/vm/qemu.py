"""QEMU for sandboxes: the command line, QMP control, and the KVM probe.

QEMU runs daemonized (``-daemonize``): a sandbox outlives the process that
started it. Its sockets live in the VM's directory under the store and are
reached through ``/proc/self/fd/N/NAME``, so deep store paths never hit the
108-byte limit of a unix socket address.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from blockdiff.errors import VMError
from blockdiff.vm.guestlink import connect_unix
from blockdiff.vm.nbd import dirty_ranges

QEMU = "qemu-system-x86_64"
AGENT_PORT = "org.blockdiff.agent"
DISK_NODE = "disk0-raw"   # the disk's block node, where its dirty bitmap lives
ACCEL_ENV = "BLOCKDIFF_VM_ACCEL"
PROBE_TIMEOUT = 10.0


def find_qemu() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise VMError(f"{QEMU} is not installed; install it (Debian: apt-get install "
                      f"qemu-system-x86)")
    return path


@dataclass(frozen=True)
class Launch:
    """What one QEMU process of a sandbox is made of."""

    name: str
    directory: Path
    kernel: Path
    initrd: Path
    disk: Path
    memory_mb: int = 256
    cpus: int = 1
    accel: str = "tcg"

    def argv(self, qemu: str) -> list[str]:
        # Relative socket and log paths: QEMU starts in the VM's directory.
        return [
            qemu, "-name", f"blockdiff-{self.name}",
            "-nodefaults", "-no-user-config", "-display", "none",
            "-machine", "q35", "-accel", self.accel,
            *(["-cpu", "host"] if self.accel == "kvm" else []),
            "-m", str(self.memory_mb), "-smp", str(self.cpus),
            "-kernel", str(self.kernel), "-initrd", str(self.initrd),
            "-append", "console=ttyS0 panic=-1 quiet",
            "-no-reboot",
            "-serial", "file:console.log",
            # writeback: the guest's flushes become fdatasync on the image, and
            # QMP stop drains every write before a snapshot.
            "-drive", f"file={self.disk},format=raw,if=none,id=disk0,node-name={DISK_NODE},"
                      f"cache=writeback,discard=unmap,detect-zeroes=unmap",
            "-device", "virtio-blk-pci,drive=disk0",
            "-device", "virtio-serial-pci",
            "-chardev", "socket,id=agent,path=agent.sock,server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT}",
            "-qmp", "unix:qmp.sock,server=on,wait=off",
            "-daemonize", "-pidfile", "qemu.pid",
        ]

    def start(self) -> None:
        qemu = find_qemu()
        for stale in ("qmp.sock", "agent.sock", "qemu.pid"):
            (self.directory / stale).unlink(missing_ok=True)
        done = subprocess.run(self.argv(qemu), cwd=self.directory, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise VMError(f"QEMU did not start: {lines[-1] if lines else done.returncode}")


class QMP:
    """A synchronous QMP connection: one command at a time, events skipped."""

    def __init__(self, socket_path: str, *, dir_fd: int | None = None, timeout: float = 10.0):
        try:
            self.sock = connect_unix(socket_path, dir_fd)
        except OSError as e:
            raise VMError(f"cannot reach QEMU's control socket ({e.strerror}); is the VM "
                          f"running?") from None
        self.sock.settimeout(timeout)
        self._buf = b""
        self._read()  # greeting
        self.command("qmp_capabilities")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "QMP":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> dict:
        while b"\n" not in self._buf:
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise VMError("QEMU did not answer on its control socket") from None
            if not chunk:
                raise VMError("QEMU closed its control socket")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def pass_fd(self, fdname: str, fd: int) -> None:
        """Hand QEMU a file descriptor (``getfd``), to be named ``fdname`` in
        later commands."""
        message = json.dumps({"execute": "getfd", "arguments": {"fdname": fdname}})
        socket.send_fds(self.sock, [message.encode() + b"\n"], [fd])
        self._reply("getfd")

    def command(self, name: str, /, **arguments) -> dict:
        # Positional-only: QMP arguments may themselves be called "name".
        message = {"execute": name} | ({"arguments": arguments} if arguments else {})
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        return self._reply(name)

    def _reply(self, name: str) -> dict:
        while True:
            reply = self._read()
            if "event" in reply:
                continue
            if "error" in reply:
                raise VMError(f"QEMU refused {name}: {reply['error'].get('desc', reply)}")
            return reply.get("return", {})


# ------------------------------------------------------ dirty tracking
#
# QEMU marks every block the guest writes or discards in a dirty bitmap. While
# the VM is paused for a snapshot, a new bitmap takes over and the old one,
# now frozen, is read through QEMU's NBD server (block status of the context
# "qemu:dirty-bitmap:NAME") on a unix socket in the VM's directory, which
# blockdiff binds and hands to QEMU: no path limit applies, and only users who
# can enter the directory reach it.

NBD_SOCKET = "nbd.sock"


def _bitmap_name() -> str:
    return f"blockdiff-{os.urandom(6).hex()}"


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


def read_dirty_bitmap(q: QMP, dir_fd: int, bitmap: str, *, timeout: float = 10.0):
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
            if name.startswith("blockdiff-") and name != keep:
                with contextlib.suppress(VMError):
                    q.command("block-export-del", id=name, mode="hard")
                with contextlib.suppress(VMError):
                    q.command("block-dirty-bitmap-remove", node=DISK_NODE, name=name)


# ------------------------------------------------------------ KVM probe


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blockdiff" / "accel.json"


def _probe_key(qemu: str) -> str:
    st = os.stat(qemu)
    return f"{qemu}:{st.st_size}:{int(st.st_mtime)}:{platform.release()}"


def probe_kvm(kernel: Path, initrd: Path, timeout: float = PROBE_TIMEOUT) -> tuple[bool, str]:
    """Whether a guest really runs under KVM here: boot the kernel to its
    first user-space process (``rdinit=/bin/busybox``, which exits at once and
    so panics the kernel, which then exits QEMU) and see it finish in time.
    ``/dev/kvm`` existing is not enough: on some hosts guests hang under it."""
    if not os.path.exists("/dev/kvm"):
        return False, "/dev/kvm does not exist"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is not accessible to this user"
    qemu = find_qemu()
    with tempfile.TemporaryDirectory(prefix="blockdiff-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        argv = [qemu, "-nodefaults", "-no-user-config", "-display", "none", "-machine", "q35",
                "-accel", "kvm", "-cpu", "host", "-m", "128", "-kernel", str(kernel),
                "-initrd", str(initrd), "-append", "console=ttyS0 panic=-1 rdinit=/bin/busybox",
                "-no-reboot", "-serial", f"file:{console}"]
        start = time.monotonic()
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"a guest under KVM did not boot within {timeout:.0f} s"
        log = console.read_text(errors="replace") if console.exists() else ""
        if done.returncode != 0 or "Linux version" not in log:
            lines = done.stderr.strip().splitlines()
            return False, f"KVM failed: {lines[-1] if lines else 'no console output'}"
        return True, f"a guest booted under KVM in {time.monotonic() - start:.1f} s"


def choose_accel(kernel: Path, initrd: Path) -> tuple[str, str]:
    """``("kvm" | "tcg", why)``: from $BLOCKDIFF_VM_ACCEL if set, else from a
    probe whose result is cached per QEMU binary and host kernel."""
    forced = os.environ.get(ACCEL_ENV)
    if forced:
        if forced not in ("kvm", "tcg"):
            raise VMError(f"{ACCEL_ENV} must be kvm or tcg, not {forced!r}")
        return forced, f"set by {ACCEL_ENV}"
    key = _probe_key(find_qemu())
    cache = _cache_file()
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            return cached["accel"], cached["why"] + " (cached)"
    except (OSError, ValueError, KeyError):
        pass
    works, why = probe_kvm(kernel, initrd)
    accel = "kvm" if works else "tcg"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "accel": accel, "why": why}))
        os.replace(tmp, cache)
    except OSError:
        pass  # an unwritable cache only means probing again next time
    return accel, why
