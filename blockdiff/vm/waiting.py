"""QEMUs started ahead, waiting for the next restore or fork to take them over.

QEMU's start (60-100 ms here, a third of it loading its libraries, and
more on two cores where anything else runs) is most of a restore's or
a fork's critical path but for the memory image's own restore, which
runs beside it. A QEMU started ahead, with ``-incoming defer``, on the
images a restore or a fork will rename into place (the standby, or
the spares) takes that off the path: the launch takes it over instead
of starting one. Until a device state is loaded it neither reads nor
writes guest RAM, and its disk stays inactive, unlocked, while the
running QEMU has the same one.

Files in the VM's directory while one waits::

    waiting.TOKEN.*        a QEMU waiting for the next restore (and
    waiting-fork.TOKEN.*   one for the next fork): its qmp.sock,
                           guestd.sock, qemu.pid and console.log

The functions take the :class:`~blockdiff.vm.machine.Machine` they serve
as ``machine``, without importing it: it is the layer above.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from dataclasses import replace
from pathlib import Path

from blockdiff.vm.procs import arg_after, command_line, holds, is_qemu, memory_path, wait_exit
from blockdiff.vm.qemu import PID_FILE, Launch, choose_accel, find_qemu, runtime_names

# Before the runtime files of a QEMU waiting for the next restore, then a
# token of its own: its files are never those of another QEMU, which may
# remove its own when it exits.
WAITING = "waiting."            # on the standby, for a restore
WAITING_FORK = "waiting-fork"   # on a pair of spares, for a fork: see fork_waiting
WAITING_KINDS = (WAITING, WAITING_FORK)


def fork_waiting(pair: int) -> str:
    """The kind of the QEMU waiting on the VM's pair of spares number
    ``pair`` (see blockdiff.vm.standby), for a fork."""
    return f"{WAITING_FORK}{pair}."


def start_waiting(machine, memory_image: Path, disk: Path | None = None, *,
                  kind: str = WAITING) -> None:
    """Have a QEMU wait, paused, with ``-incoming defer``, on
    ``memory_image`` and ``disk`` (the VM's own by default), for the next
    incoming launch that finds them in place to take over: ``kind``
    ``WAITING`` for a restore (on the standby), ``fork_waiting(N)`` for
    a fork (on pair of spares N, handed over by ``hand_over_waiting``). Keeps
    the one of that kind waiting already if it holds those files; else
    kills it. Only while the VM runs: stopping it kills them all
    (``kill_waiting``). The files are opened first and QEMU given them
    as ``/dev/fd/N``, so that it holds these files even if they are
    renamed meanwhile (OSError, and nothing started, if they are gone)."""
    if not machine.running:
        return
    disk = disk or machine.vm.disk
    kernel_dir = machine.vm.kernel_dir
    accel, _ = choose_accel(kernel_dir / "vmlinuz", kernel_dir / "initrd.img")
    if find_waiting(machine, accel, memory_image, disk, (kind,)) is not None:
        return
    kill_waiting(machine, (kind,))
    fds = []
    prefix = f"{kind}{secrets.token_hex(4)}."
    try:
        for path in (memory_image, disk):
            fds.append(os.open(path, os.O_RDWR | os.O_CLOEXEC))
        launch = machine._launch(accel, incoming=True, memory_image=Path(f"/dev/fd/{fds[0]}"),
                                 runtime_prefix=prefix)
        replace(launch, disk=Path(f"/dev/fd/{fds[1]}")).start(pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    if not machine.running:
        # Stopped meanwhile (or being restored, by another thread or
        # process): this one is killed, any other left to its owner.
        kill_waiting(machine, (prefix,))


def waiting_qemus(machine, kinds=WAITING_KINDS, directory: Path | None = None):
    """``(pid, prefix)`` of each QEMU of these kinds (or with these
    prefixes) waiting in this VM's directory (or ``directory``), pid None
    where its process is gone: a QEMU whose command line names its pid
    file (with its token)."""
    for kind in kinds:
        for pid_file in (directory or machine.directory).glob(f"{kind}*{PID_FILE}"):
            pid = None
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text())
                cmdline = command_line(pid)
                if not (is_qemu(cmdline) and arg_after(cmdline, "-pidfile") == pid_file.name):
                    pid = None
            yield pid, pid_file.name[:-len(PID_FILE)]


def find_waiting(machine, accel: str, memory_image: Path, disk: Path,
                 kinds=WAITING_KINDS) -> tuple[int, str] | None:
    """The waiting QEMU of these kinds, if any, that holds the files now
    at ``memory_image`` and ``disk``, started as this machine's launch
    would be but for its name and the paths of those files."""
    qemu = find_qemu()
    for pid, prefix in waiting_qemus(machine, kinds):
        if pid is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            cmdline = command_line(pid)
            name = arg_after(cmdline, "-name").removeprefix("blockdiff-")
            drive = arg_after(cmdline, "-drive").removeprefix("file=").split(",format=")[0]
            mapped = memory_path(cmdline)
            launch = machine._launch(accel, incoming=True, memory_image=mapped,
                                     runtime_prefix=prefix)
            if (mapped is not None
                    and cmdline == replace(launch, name=name, disk=Path(drive)).argv(qemu)
                    and holds(pid, memory_image, disk)):
                return pid, prefix
    return None


def start_or_take(machine, launch: Launch) -> None:
    """Start ``launch`` (an incoming one), or take over the waiting QEMU
    that holds the memory image and disk as they are now, its runtime
    files renamed to the usual ones (``took_waiting`` then says so); any
    other waiting QEMU on this VM's disk is killed."""
    found = (find_waiting(machine, launch.accel, machine.memory_image, machine.vm.disk)
             if launch.incoming else None)
    if found is not None:
        pid, prefix = found
        try:
            for mine, usual in zip(runtime_names(prefix), launch.runtime_names()):
                os.rename(machine.directory / mine, machine.directory / usual)
            machine.took_waiting = True
        except OSError:    # gone meanwhile: started anew
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if launch.incoming:
        kill_waiting(machine, holding=machine.vm.disk)
    if not machine.took_waiting:
        launch.start()


def kill_waiting(machine, kinds=WAITING_KINDS, *, holding: Path | None = None) -> None:
    """Kill every QEMU of these kinds waiting in this VM's directory (with
    ``holding``, only those that hold that file), and remove their
    files."""
    for pid, prefix in waiting_qemus(machine, kinds):
        if pid is not None:
            if holding is not None and not holds(pid, holding):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_exit(pid, 10.0)
        for name in runtime_names(prefix):
            (machine.directory / name).unlink(missing_ok=True)


def forks_waiting(machine, source: Path) -> list[int]:
    """The numbers of the pairs of spares in directory ``source`` (another
    VM's) that a fork's QEMU waits on."""
    numbers = []
    for pid, prefix in waiting_qemus(machine, (WAITING_FORK,), source):
        number = prefix[len(WAITING_FORK):].partition(".")[0]   # see fork_waiting
        if pid is not None and number.isdigit():
            numbers.append(int(number))
    return numbers


def hand_over_waiting(machine, source: Path) -> bool:
    """Move the runtime files of the fork's QEMU waiting in directory
    ``source`` (another VM's, whose spares this new VM took) into this
    VM's directory, if it holds this VM's memory image and disk now, for
    the launch to take it over; whether there was one."""
    for pid, prefix in waiting_qemus(machine, (WAITING_FORK,), source):
        if pid is not None and holds(pid, machine.memory_image, machine.vm.disk):
            with contextlib.suppress(OSError):
                for name in runtime_names(prefix):
                    os.rename(source / name, machine.directory / name)
                return True
    return False
