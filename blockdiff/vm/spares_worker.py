"""The process that prepares the spares of this host's VMs (see
blockdiff.vm.standby) for the process that runs them, at the lowest
priority while they wait for a fork that may not come, and while a fork
resumes.

A thread of the VM's own process at that priority would stall the others:
whenever the scheduler leaves it waiting, for tens of milliseconds on two
busy cores, with the interpreter's lock in hand, every other thread waits
too (a fork's critical path among them; profiled: 5-56 ms lost after a
fork's guest answered). A process of its own holds no lock of theirs.

One request a line on standard input, JSON, each answered by one line on
standard output (``{"failure": null}`` or a message), after a first line
``ready`` once it may be stopped; the spares of the
VM in ``directory`` of the store at ``store``:
- ``{"op": "prepare", "store", "directory", "memory", "disk",
  "missing_only"}``: see ``Standby.prepare_spares_here``;
- ``{"op": "warm", "store", "directory"}``: the memory spares' page cache
  filled (``Standby.warm_spares``).
The store is opened for each request and closed after it, so that the
worker, idle, holds no file of any filesystem (its directory is /). Each
statement and transaction of its catalog holds the stop lock (a file
named by its one argument) shared, which the process that started it
holds exclusively to stop it. It exits at the end of its input: when
the process that started it does.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import sys
from pathlib import Path

from blockdiff.store.store import Store
from blockdiff.vm.standby import WORKER_READY, Standby

PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


class HeldAgainstStops:
    """A catalog's lock (a reentrant one, held by every statement and
    transaction) that also holds the stop lock shared, outermost: the
    process that started the worker takes that lock exclusively before it
    stops the worker (see ``SparesWorker.stopped``), which so never
    stops with the catalog's write lock in hand."""

    def __init__(self, lock, stop_lock: str):
        self._lock = lock
        self._stop_lock = stop_lock
        self._fd: int | None = None
        self._depth = 0

    def __enter__(self):
        self._lock.acquire()
        if not self._depth:
            try:
                self._fd = os.open(self._stop_lock, os.O_RDWR | os.O_CLOEXEC)
                fcntl.flock(self._fd, fcntl.LOCK_SH)
            except OSError:
                self._lock.release()
                raise
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if not self._depth:
            os.close(self._fd)
        self._lock.release()


def serve(request: dict, stop_lock: str) -> str | None:
    """Carry out one request: None, or why it failed."""
    try:
        with Store(request["store"]) as store:
            store.wrap_catalog_lock(lambda lock: HeldAgainstStops(lock, stop_lock))
            standby = Standby(store, Path(request["directory"]))
            if request["op"] == "prepare":
                standby.prepare_spares_here(request["memory"], request["disk"],
                                            request["missing_only"])
            else:
                standby.warm_spares()
    except Exception as e:   # noqa: BLE001 - reported to the VM's process
        return f"{type(e).__name__}: {e}"
    return None


def main(stop_lock: str, parent: int) -> None:
    # Stopped while a fork resumes (Standby.yielding): should the process
    # that started it die meanwhile, the kernel lets it go on (its
    # parent-death signal, which follows the thread that started it: one
    # that lives as long as its process), and it finishes its request
    # before it sees the end of its input. Only a worker that said it is
    # ready, the signal set, is ever stopped; a parent gone before that
    # would never send it.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGCONT)
    if os.getppid() != parent:
        return
    sys.stdout.write(WORKER_READY + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        sys.stdout.write(json.dumps({"failure": serve(json.loads(line), stop_lock)}) + "\n")
        sys.stdout.flush()
