"""What /proc says of a process: its command line, the files it holds open,
its CPU time, whether it has exited. QEMU's processes are told apart by
these (a pid file alone may name a pid the kernel handed out again)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def wait_exit(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` exited within ``timeout`` seconds: gone, or a
    zombie with no thread left. Its main thread is a zombie as soon as it
    exited, but its files (and QEMU's locks on the disk) are let go only
    once its last thread did, which for a QEMU tearing down guest RAM can
    be later: a new QEMU would find the disk still locked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            if zombie and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
                return True
        except OSError:
            return True
        time.sleep(0.002)
    return False


def usage(pid: int | None) -> tuple[float, float, int] | None:
    """CPU seconds process ``pid`` and the whole host (every core, less idle
    and I/O wait) have run so far, and the major page faults (those that
    read from the disk) of ``pid``, from /proc; None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        with open("/proc/stat") as stat:
            host = [int(n) for n in stat.readline().split()[1:]]
    except (OSError, ValueError, TypeError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return ((int(fields[11]) + int(fields[12])) / tick,   # utime + stime
            (sum(host) - host[3] - host[4]) / tick,       # less idle, iowait
            int(fields[9]))                               # majflt


def command_line(pid: int) -> list[str]:
    """The command line of process ``pid`` (OSError if there is none)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def memory_path(cmdline: list[str]) -> Path | None:
    """The file a QEMU command line keeps guest RAM in, if any."""
    for arg in cmdline:
        if arg.startswith("memory-backend-file,"):
            for option in arg.split(","):
                if option.startswith("mem-path="):
                    return Path(option[len("mem-path="):])
    return None


def holds(pid: int, *paths: Path) -> bool:
    """Whether process ``pid`` has the files now at ``paths`` open (QEMU
    keeps its disk and its memory image open: they stay its files when
    renamed, and another file renamed to a path is not)."""
    try:
        wanted = {(st.st_dev, st.st_ino) for st in map(os.stat, paths)}
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            wanted.discard((st.st_dev, st.st_ino))
    return not wanted


def is_qemu(cmdline: list[str]) -> bool:
    return bool(cmdline) and os.path.basename(cmdline[0]).startswith("qemu-system")


def arg_after(cmdline: list[str], option: str) -> str:
    """The argument after ``option`` (ValueError if there is none)."""
    at = cmdline.index(option) + 1
    if at >= len(cmdline):
        raise ValueError(option)
    return cmdline[at]
