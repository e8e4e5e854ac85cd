"""What a VM operation has in progress: its intent record.

A VM operation changes several things that no one transaction covers: the
QEMU process, the disk and the memory image in the VM's directory, the
standby and spares, the guest's frozen filesystem. A command killed in the
middle (kill -9, a lost terminal, a host that lost power) would leave the
VM paused, half-resumed, or with a disk that is neither the old one nor
the checkpoint's. So each operation first records what it is doing, in
``intent.json`` in the VM's directory (written beside it, synced, renamed
over it), and removes the record once the VM is in a state that needs no
more work. The next command on the VM (:mod:`blockdiff.vm.recovery`) finds
a record whose writer is gone and finishes the operation, or undoes it.

A record names its writer by pid and the process's start time (from
``/proc/PID/stat``, in clock ticks since boot: an identity, not a clock
reading), so that a pid the kernel hands out again is never taken for it.

Fault injection: ``BLOCKDIFF_VM_CRASH_AT=POINT[:N]`` SIGKILLs the process the
N-th time (default the first) it passes :func:`crash_point` ``POINT``. The
VM kill sweep (tests/test_vm_crash.py) uses it to kill a command at named
moments of each operation.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

INTENT = "intent.json"
LOCK = "lock"   # the VM's lock, held by every operation but a fork's start
# A record is small; anything larger is not one of ours.
MAX_RECORD = 64 << 10
CRASH_ENV = "BLOCKDIFF_VM_CRASH_AT"
# The operations that write a record.
CREATE, CHECKPOINT, RESTORE, FORK, START = "create", "checkpoint", "restore", "fork", "start"
# What the command that recovers (blockdiff.vm.recovery) is about to do with the VM.
USE = "use"          # run in it, checkpoint it, start it
REPLACE = "replace"  # restore it: its state is replaced anyway
STOP = "stop"        # stop it
REMOVE = "remove"    # remove it

_passed: collections.Counter = collections.Counter()


@dataclass(frozen=True)
class Intent:
    """One VM operation in progress."""

    op: str
    pid: int
    started: int | None          # the writer's start time (see the module's docstring)
    args: dict = field(default_factory=dict)

    def writer_alive(self) -> bool:
        """Whether the process that wrote the record still runs."""
        return self.pid > 0 and self.started is not None and _start_time(self.pid) == self.started

    def mine(self) -> bool:
        """Whether this process wrote it."""
        return self.pid == os.getpid() and self.started == _start_time(os.getpid())

    def describe(self) -> str:
        """What the operation was, for messages: ``restore of 3f2a…``."""
        snapshot = self.args.get("snapshot")
        return f"{self.op} of {snapshot}" if snapshot else self.op


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields
    # are counted from its closing one.
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])   # field 22, starttime
    except (IndexError, ValueError):
        return None


def write(directory: Path, op: str, *, durable: bool = True, **args) -> Intent:
    """Record that ``op`` is under way on the VM in ``directory``.

    ``durable``: synced to disk (and the directory), so that it survives a
    host crash too; an operation whose half-done state dies with the host
    (a pause of a QEMU process, a frozen guest) needs no sync, only the
    rename that makes the record whole under its name."""
    pid = os.getpid()
    intent = Intent(op, pid, _start_time(pid), args)
    data = json.dumps({"op": op, "pid": pid, "started": intent.started, "args": args})
    temporary = directory / f".{INTENT}.{pid}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data.encode() + b"\n")
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, directory / INTENT)
    if durable:
        _sync_directory(directory)
    return intent


def read(directory: Path) -> Intent | None:
    """The record of the operation under way on the VM in ``directory``, if
    any. One that cannot be read (damaged, not ours) is an operation of
    unknown kind by a writer that is gone: the VM is then stopped rather
    than trusted."""
    try:
        fd = os.open(directory / INTENT, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return Intent("unknown", 0, None)
    try:
        data = os.read(fd, MAX_RECORD + 1)
    except OSError:
        data = b""
    finally:
        os.close(fd)
    try:
        record = json.loads(data.decode()) if len(data) <= MAX_RECORD else None
        intent = Intent(str(record["op"]), int(record["pid"]),
                        None if record["started"] is None else int(record["started"]),
                        dict(record["args"]))
    except (ValueError, TypeError, KeyError, AttributeError):
        return Intent("unknown", 0, None)
    return intent


def clear(directory: Path, *, durable: bool = True) -> None:
    """The operation is done: remove its record."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(directory / INTENT)
        if durable:
            _sync_directory(directory)


@contextlib.contextmanager
def pending(directory: Path, op: str, *, durable: bool = True, failed: bool = False,
            **args):
    """The record of ``op`` for the block, removed when the block succeeds
    (or, with ``failed``, raises). A block that raises leaves it otherwise:
    what the failure left half done is for the next command to finish or
    undo, as after a crash."""
    intent = write(directory, op, durable=durable, **args)
    try:
        yield intent
    except BaseException:
        if failed:
            clear(directory, durable=durable)
        raise
    clear(directory, durable=durable)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crash_point(point: str) -> None:
    """SIGKILL this process here if ``BLOCKDIFF_VM_CRASH_AT`` names ``point``
    (``POINT`` or ``POINT:N``, the N-th time it is passed)."""
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    name, _, count = wanted.partition(":")
    if name != point:
        return
    _passed[point] += 1
    if _passed[point] == (int(count) if count.isdigit() else 1):
        os.kill(os.getpid(), signal.SIGKILL)


def fork_intent(snap, memory_snap, start: bool, standby) -> dict | None:
    """The arguments of the intent record a fork from checkpoint ``snap``
    (with memory ``memory_snap``; None without: nothing is left half made)
    is registered with, taking the spares of ``standby`` if given."""
    if memory_snap is None:
        return None
    return {"snapshot": snap.id, "memory": memory_snap.id, "start": start,
            "source": standby.path.parent.name if standby is not None else None}
