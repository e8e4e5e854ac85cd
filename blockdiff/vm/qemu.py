"""QEMU for sandboxes: the command line, a QMP client, and the KVM probe.

QEMU runs daemonized (``-daemonize``): a sandbox outlives the process that
started it. Its sockets live in the VM's directory under the store and are
reached through ``/proc/self/fd/N/NAME``, so deep store paths never hit the
108-byte limit of a unix socket address. What blockdiff asks of QEMU over
QMP (pausing, dirty bitmaps) is in :class:`blockdiff.vm.machine.Machine` and
:mod:`blockdiff.vm.qmp_talk`.
"""

from __future__ import annotations

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

QEMU = "qemu-system-x86_64"
GUEST_PORT = "org.blockdiff.guestd"   # the guest daemon's virtio-serial port
# In the VM's directory, where QEMU runs.
QMP_SOCKET = "qmp.sock"
GUEST_SOCKET = "guestd.sock"
PID_FILE = "qemu.pid"
CONSOLE_LOG = "console.log"   # the guest's serial console
DISK_NODE = "disk0-raw"   # the disk's block node, where its dirty bitmap lives
ACCEL_ENV = "BLOCKDIFF_VM_ACCEL"
PROBE_TIMEOUT = 10.0
RAM_BACKEND = "ram0"
MACHINE_TYPE = "q35"


def runtime_names(prefix: str = "") -> tuple[str, str, str, str]:
    """A QEMU's QMP socket, guest daemon socket, pid file and console log,
    relative to the VM's directory, each name after ``prefix``."""
    return tuple(prefix + name for name in (QMP_SOCKET, GUEST_SOCKET, PID_FILE, CONSOLE_LOG))


def find_qemu() -> str:
    """The QEMU binary's path; VMError saying how to install it if there is none."""
    path = shutil.which(QEMU)
    if path is None:
        raise VMError(f"{QEMU} is not installed; install it (Debian: apt-get install "
                      f"qemu-system-x86)")
    return path


_versions: dict[tuple, str] = {}


def qemu_version(qemu: str | None = None) -> str:
    """The version of the QEMU binary (``7.2.22``), asked once per binary and
    process: a memory checkpoint only resumes in the QEMU that took it."""
    qemu = qemu or find_qemu()
    st = os.stat(qemu)
    key = (qemu, st.st_size, st.st_mtime_ns)
    if key not in _versions:
        done = subprocess.run([qemu, "--version"], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        words = done.stdout.split()
        _versions[key] = words[3] if len(words) > 3 and words[2] == "version" else "unknown"
    return _versions[key]


@dataclass(frozen=True)
class Launch:
    """What one QEMU process of a sandbox is made of.

    With ``memory_image``, guest RAM is that file (shared, on the store's
    filesystem) instead of anonymous memory, so that a checkpoint can commit
    it like a disk; with ``incoming`` too, QEMU starts paused, waiting for the
    device state of a checkpoint (``migrate-incoming``) instead of booting.
    """

    name: str
    directory: Path
    kernel: Path
    initrd: Path
    disk: Path
    memory_mb: int = 256
    cpus: int = 1
    accel: str = "tcg"
    memory_image: Path | None = None
    incoming: bool = False
    # Before the names of its sockets, pid file and console log: a QEMU
    # waiting for the next restore (see Machine.start_waiting) has its own.
    runtime_prefix: str = ""

    def runtime_names(self) -> tuple[str, str, str, str]:
        return runtime_names(self.runtime_prefix)

    def devices(self) -> list[str]:
        """The devices of the command line (each ``-device``'s driver): the
        part of the machine a checkpoint's device state must match."""
        argv = self.argv(QEMU)
        return [argv[i + 1].split(",")[0] for i, arg in enumerate(argv) if arg == "-device"]

    def signature(self) -> dict:
        """What a memory checkpoint of this machine can only be resumed on:
        the same QEMU, machine type, accelerator, memory, CPUs and devices."""
        return {"qemu": qemu_version(), "machine": MACHINE_TYPE, "accel": self.accel,
                "memory_mb": self.memory_mb, "cpus": self.cpus,
                "devices": ",".join(self.devices())}

    def _memory_args(self) -> list[str]:
        if self.memory_image is None:
            return ["-machine", MACHINE_TYPE]
        # share=on: the guest's writes go to the file (its page cache), which
        # is what the store commits; x-ignore-shared then keeps RAM out of
        # the migration stream, which holds only the device state.
        return ["-object", f"memory-backend-file,id={RAM_BACKEND},size={self.memory_mb}M,"
                           f"mem-path={self.memory_image},share=on",
                "-machine", f"{MACHINE_TYPE},memory-backend={RAM_BACKEND}"]

    def argv(self, qemu: str) -> list[str]:
        """The command line, for the binary ``qemu``."""
        qmp_socket, guest_socket, pid_file, console_log = self.runtime_names()
        # Relative socket and log paths: QEMU starts in the VM's directory.
        return [
            qemu, "-name", f"blockdiff-{self.name}",
            "-nodefaults", "-no-user-config", "-display", "none",
            *self._memory_args(), "-accel", self.accel,
            *(["-cpu", "host"] if self.accel == "kvm" else []),
            "-m", str(self.memory_mb), "-smp", str(self.cpus),
            "-kernel", str(self.kernel), "-initrd", str(self.initrd),
            "-append", "console=ttyS0 panic=-1 quiet",
            "-no-reboot",
            "-serial", f"file:{console_log}",
            # writeback: the guest's flushes become fdatasync on the image, and
            # QMP stop drains every write before a snapshot.
            "-drive", f"file={self.disk},format=raw,if=none,id=disk0,node-name={DISK_NODE},"
                      f"cache=writeback,discard=unmap,detect-zeroes=unmap",
            "-device", "virtio-blk-pci,drive=disk0",
            "-device", "virtio-serial-pci",
            "-chardev", f"socket,id=guestd,path={guest_socket},server=on,wait=off",
            "-device", f"virtserialport,chardev=guestd,name={GUEST_PORT}",
            "-qmp", f"unix:{qmp_socket},server=on,wait=off",
            # Paused until the checkpoint's device state is in and the guest
            # told it resumes (-S: no start on its own once migrated).
            *(["-incoming", "defer", "-S"] if self.incoming else []),
            "-daemonize", "-pidfile", pid_file,
        ]

    def start(self, pass_fds=()) -> None:
        """Start QEMU, daemonized, in the VM's directory (stale sockets and pid file
        removed first), with descriptors ``pass_fds`` (for paths such as
        ``/dev/fd/N``); returns once it forked into the background."""
        qemu = find_qemu()
        for stale in self.runtime_names()[:3]:
            (self.directory / stale).unlink(missing_ok=True)
        done = subprocess.run(self.argv(qemu), cwd=self.directory, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, pass_fds=pass_fds)
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
            except OSError:
                chunk = b""
            if not chunk:
                raise VMError("QEMU closed its control socket")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def pass_fd(self, fdname: str, fd: int) -> None:
        """Hand QEMU a file descriptor (``getfd``), to be named ``fdname`` in
        later commands."""
        message = json.dumps({"execute": "getfd", "arguments": {"fdname": fdname}})
        try:
            socket.send_fds(self.sock, [message.encode() + b"\n"], [fd])
        except OSError:
            raise VMError("QEMU closed its control socket") from None
        self._reply("getfd")

    def command(self, name: str, /, **arguments) -> dict:
        """Run one command; returns what QEMU returned (VMError if it refused)."""
        # Positional-only: QMP arguments may themselves be called "name".
        message = {"execute": name} | ({"arguments": arguments} if arguments else {})
        try:
            self.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:   # QEMU gone (a broken pipe, a reset connection)
            raise VMError("QEMU closed its control socket") from None
        return self._reply(name)

    def _reply(self, name: str) -> dict:
        while True:
            reply = self._read()
            if "event" in reply:
                continue
            if "error" in reply:
                raise VMError(f"QEMU refused {name}: {reply['error'].get('desc', reply)}")
            return reply.get("return", {})


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
