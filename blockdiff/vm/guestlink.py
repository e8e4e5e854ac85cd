"""The host side of the guest daemon's protocol (``guest/guestd.c``).

Frames in both directions: ``"BDA1" | u8 type | u8 0 | u16 0 | u32 id | u32 length``
(little-endian), then ``length`` bytes of payload. A reply has the request's
id and type | 0x80; an error reply has type 0xff and a message. Replies to
other ids are stale answers to a client that gave up, and are skipped.

Payloads:

- PING → the daemon's version string.
- EXEC ``u32 timeout_ms | u32 argc | u32 stdin_len | u32 0 | argv\\0… | cwd\\0 | stdin``
  → ``i32 status | u32 flags | u32 stdout_len | u32 stderr_len | stdout | stderr``;
  status is the exit code, or 128 + signal; flags: 1 timed out, 2 output truncated.
- FREEZE ``u32 auto_thaw_ms | u32 flags``, THAW, SYNC, SHUTDOWN → ``u32 errno``;
  flags: 1 also freeze every process the daemon started (a cgroup v2 freeze),
  which THAW lets go again.
- RESUME ``u64 realtime_ns | u32 entropy_len | u32 0 | entropy`` → ``u32 errno``:
  the VM runs again from a memory checkpoint; the daemon sets the wall clock,
  mixes the bytes into the kernel's entropy pool and reseeds it, then thaws
  the disk and the processes, which therefore never run with the old clock
  or the random-number state another VM resumed from the same checkpoint has.
- DETACH (end every guest process, unmount the disk) and ATTACH (drop the
  guest's cached blocks of the disk, mount it again) → ``u32 errno``: the
  host rewrites the disk image between the two.
"""

from __future__ import annotations

import errno as errno_mod
import itertools
import os
import random
import socket
import struct
import time
from dataclasses import dataclass

from blockdiff.errors import GuestError, GuestTimeout

MAGIC = b"BDA1"
HEADER = struct.Struct("<4sBBHII")
PING, EXEC, FREEZE, THAW, SYNC, SHUTDOWN, DETACH, ATTACH, RESUME = 1, 2, 3, 4, 5, 6, 7, 8, 9
REPLY, ERROR = 0x80, 0xFF
TIMED_OUT, TRUNCATED = 1, 2
FREEZE_PROCESSES = 1
RESEED_BYTES = 64
# The first daemon version that knows RESUME and FREEZE_PROCESSES.
MEMORY_CHECKPOINT_VERSION = 2
# How long past a command's own timeout the host waits for the guest's answer.
ANSWER_GRACE = 5.0
# How long the host waits for the daemon to answer a ping before a command of
# no timeout of its own, which may then run as long as it takes: a guest that
# is paused, hung or not resumed does not answer, and is not waited on for
# ever. A ping is answered in milliseconds by a daemon that runs.
ANSWER_WAIT = 30.0


@dataclass(frozen=True)
class ExecResult:
    status: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.status == 0 and not self.timed_out


def connect_unix(socket_path: str, dir_fd: int | None = None) -> socket.socket:
    """A connected unix stream socket; ``socket_path`` relative to ``dir_fd``
    when given, through /proc so that the 108-byte address limit never bites."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(f"/proc/self/fd/{dir_fd}/{socket_path}" if dir_fd is not None
                     else socket_path)
    except OSError:
        sock.close()
        raise
    return sock


class GuestLink:
    """One connection to the guest daemon's virtio-serial socket.

    ``socket_path`` is reached through ``dir_fd`` when given, so that long
    store paths do not hit the 108-byte limit of a unix socket address.
    """

    _ids = itertools.count(random.randrange(1 << 31))

    def __init__(self, socket_path: str, *, dir_fd: int | None = None):
        try:
            self.sock = connect_unix(socket_path, dir_fd)
        except OSError as e:
            raise GuestError(f"cannot reach the guest daemon ({e.strerror}); "
                             f"is the VM running? start it with: blockdiff vm start") from None
        self._pending = b""

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "GuestLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------- frames

    def _recv_exact(self, n: int, deadline: float, what: str) -> bytes:
        while len(self._pending) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GuestTimeout(f"the guest did not answer {what} within the timeout; "
                                   f"it may be hung or still booting (see its console.log)")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(max(1 << 16, n - len(self._pending)))
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                raise GuestError(f"the VM closed the guest daemon's channel during {what}; "
                                 f"did QEMU exit? (see its console.log)")
            self._pending += chunk
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def send(self, kind: int, payload: bytes = b"") -> int:
        """Send a request without waiting for its answer; returns its id."""
        request_id = next(self._ids) & 0xFFFFFFFF
        try:
            self.sock.sendall(HEADER.pack(MAGIC, kind, 0, 0, request_id, len(payload)) + payload)
        except TimeoutError:
            raise GuestTimeout("the guest daemon is not reading its channel; "
                               "it may be hung (see its console.log)") from None
        except OSError as e:
            raise GuestError(f"the VM closed the guest daemon's channel ({e.strerror}); "
                             f"did QEMU exit? (see its console.log)") from None
        return request_id

    def request(self, kind: int, payload: bytes, timeout: float, what: str) -> bytes:
        """Send a request and return its reply's payload; ``what`` names it in errors."""
        self.sock.settimeout(timeout)
        request_id = self.send(kind, payload)
        deadline = time.monotonic() + timeout
        while True:
            magic, rtype, _, _, rid, length = HEADER.unpack(
                self._recv_exact(HEADER.size, deadline, what))
            if magic != MAGIC:
                raise GuestError(f"the guest daemon sent a malformed frame during {what}")
            body = self._recv_exact(length, deadline, what)
            if rid != request_id:
                continue
            if rtype == ERROR:
                raise GuestError(f"the guest daemon refused {what}: "
                                 f"{body.decode(errors='replace')}")
            if rtype != kind | REPLY:
                raise GuestError(f"the guest daemon answered {what} with frame type {rtype:#x}")
            return body

    def _status(self, kind: int, payload: bytes, timeout: float, what: str) -> None:
        err, = struct.unpack("<I", self.request(kind, payload, timeout, what)[:4])
        if err:
            raise GuestError(f"{what} failed in the guest: {os.strerror(err)} "
                             f"({errno_mod.errorcode.get(err, err)})")

    # ----------------------------------------------------------- requests

    def ping(self, timeout: float = 5.0) -> str:
        """The guest daemon's version, once it answers."""
        return self.request(PING, b"", timeout, "a ping").decode(errors="replace")

    def exec(self, argv: list[str], *, timeout: float | None = None, stdin: bytes = b"",
             cwd: str = "/", answer_within: float | None = None) -> ExecResult:
        """Run ``argv`` in the guest (chrooted into its disk). ``timeout`` kills
        the command in the guest; the host waits a little longer for the reply.
        Without one, the daemon must first answer a ping within
        ``answer_within`` seconds (``ANSWER_WAIT`` by default; GuestTimeout if not)."""
        if not argv:
            raise GuestError("nothing to run: give a command")
        if not timeout:
            answer_within = ANSWER_WAIT if answer_within is None else answer_within
            try:
                self.ping(timeout=answer_within)
            except GuestTimeout:
                raise GuestTimeout(f"the guest daemon did not answer within "
                                   f"{answer_within:g} s, so {argv[0]!r} was not run; the VM "
                                   f"may be paused or hung (see blockdiff vm ls and its "
                                   f"console.log)") from None
        strings = b"".join(a.encode() + b"\0" for a in argv) + cwd.encode() + b"\0"
        timeout_ms = int(timeout * 1000) if timeout else 0
        payload = struct.pack("<IIII", timeout_ms, len(argv), len(stdin), 0) + strings + stdin
        wait = (timeout + ANSWER_GRACE) if timeout else 365 * 86400.0
        body = self.request(EXEC, payload, wait, f"the command {argv[0]!r}")
        status, flags, n_out, n_err = struct.unpack_from("<iIII", body)
        out = body[16:16 + n_out]
        err = body[16 + n_out:16 + n_out + n_err]
        return ExecResult(status, out, err, bool(flags & TIMED_OUT), bool(flags & TRUNCATED))

    def freeze(self, auto_thaw: float = 30.0, timeout: float = 30.0, *,
               processes: bool = False) -> None:
        """Flush and freeze the guest's disk filesystem (and, with
        ``processes``, every process the daemon started); it all thaws by
        itself after ``auto_thaw`` seconds if :meth:`thaw` never comes."""
        flags = FREEZE_PROCESSES if processes else 0
        self._status(FREEZE, struct.pack("<II", int(auto_thaw * 1000), flags), timeout,
                     "freezing the disk")

    def thaw(self, timeout: float = 30.0) -> None:
        """Thaw the guest's disk filesystem and its processes."""
        self._status(THAW, b"", timeout, "thawing the disk")

    def resume(self, timeout: float = 30.0) -> None:
        """After the VM was started from a memory checkpoint: set the guest's
        wall clock to the host's, reseed its random-number generator with
        fresh host bytes, and let its disk and processes go."""
        entropy = os.urandom(RESEED_BYTES)
        payload = struct.pack("<QII", time.time_ns(), len(entropy), 0) + entropy
        self._status(RESUME, payload, timeout, "resuming from the checkpoint")

    def sync(self, timeout: float = 60.0) -> None:
        """Have the guest write its dirty page cache of the disk out (``syncfs``)."""
        self._status(SYNC, b"", timeout, "syncing the disk")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Have the guest end its processes, unmount the disk and power off."""
        self._status(SHUTDOWN, b"", timeout, "the shutdown")

    def detach(self, timeout: float = 30.0) -> None:
        """End every process in the guest and unmount its disk."""
        self._status(DETACH, b"", timeout, "detaching the disk")

    def attach(self, timeout: float = 30.0) -> None:
        """Mount the (rewritten) disk again, with nothing of its old contents cached."""
        self._status(ATTACH, b"", timeout, "attaching the disk")
