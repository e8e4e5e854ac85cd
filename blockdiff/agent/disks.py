"""Sandbox disks for the layers above the store, and the registry of their kinds.

A disk is anything with ``checkpoint(message, meta, ttl, skip_unchanged)``,
which takes a snapshot of it into the store and returns the disk snapshot's
id, and ``restore(disk snapshot id)``. A :class:`blockdiff.vm.sandbox.Sandbox`
(a VM) is one; :class:`ImageDisk` is the other: a plain image file committed
to a store, for agents whose sandbox is not a VM (a container's disk, a test).

A thread records its disk as a *binding*, ``KIND:WHERE`` (``vm:NAME``,
``image:PATH``), so that another process (the CLI rewinding or forking the
thread) can reopen it. Each kind of disk is one :class:`DiskKind` registered
here: the class it binds, what its binding names, how a binding is reopened
and how a disk snapshot is forked into a disk of its own. A new kind (a VM
whose checkpoints hold its memory too) is one :func:`register` call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from blockdiff.errors import AgentError, UnknownSnapshot
from blockdiff.store.store import Store, as_store
from blockdiff.vm.checkpoint import memory_of
from blockdiff.vm.sandbox import Sandbox


class Disk(Protocol):
    """What the agent layer needs of a sandbox disk."""

    def checkpoint(self, message: str = "", meta: dict | None = None, ttl: float | None = None,
                   skip_unchanged: bool = False, memory: bool | None = None) -> str:
        """Take a disk snapshot into the store; its id. ``memory``: whether
        a sandbox that can also checkpoint its running processes does (None:
        as it does by default; a disk without processes ignores it)."""

    def restore(self, snapshot_id: str):
        """Put the disk back to the disk snapshot ``snapshot_id``."""


class ImageDisk:
    """A disk image file on the store's filesystem."""

    def __init__(self, store: Store | str | os.PathLike, path: str | os.PathLike):
        self.store = as_store(store)
        self.path = os.fspath(path)

    def checkpoint(self, message: str = "", meta: dict | None = None, ttl: float | None = None,
                   skip_unchanged: bool = False, memory: bool | None = None) -> str:
        """Commit the image to the store; the disk snapshot's id (an image
        has no processes: ``memory`` changes nothing)."""
        return self.store.commit(self.path, message=message, meta=meta, ttl=ttl,
                                 skip_unchanged=skip_unchanged).id

    def restore(self, snapshot_id: str) -> None:
        """Restore the image to the disk snapshot ``snapshot_id``."""
        self.store.restore(snapshot_id, self.path)


@dataclass(frozen=True)
class DiskKind:
    """One kind of disk: ``name`` is its bindings' prefix; ``disk_class``
    the class whose instances it binds; ``where(disk)`` what the binding
    names after the prefix; ``reopen(store, where)`` the disk a binding
    names; ``fork(store, where, snapshot_id, new_name)`` a new disk of the
    same kind, named after ``new_name``, holding the disk snapshot."""

    name: str
    disk_class: type
    where: Callable[[Disk], str]
    reopen: Callable[[Store, str], Disk]
    fork: Callable[[Store, str, str, str], Disk]


_KINDS: dict[str, DiskKind] = {}


def register(kind: DiskKind) -> None:
    """Add ``kind`` to the kinds threads can bind (a name once only)."""
    if ":" in kind.name:
        raise ValueError(f"disk kind {kind.name!r}: a binding's kind cannot hold ':'")
    if kind.name in _KINDS:
        raise ValueError(f"disk kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind


def disk_binding(disk: Disk | None) -> str | None:
    """How a thread remembers ``disk``, so that other processes can reopen
    it: ``KIND:WHERE``; None for no disk, or one of no registered kind
    (which other processes then cannot restore)."""
    if disk is None:
        return None
    for kind in _KINDS.values():
        if isinstance(disk, kind.disk_class):
            return f"{kind.name}:{kind.where(disk)}"
    return None


def _kind_of(binding: str) -> tuple[DiskKind, str]:
    name, _, where = binding.partition(":")
    kind = _KINDS.get(name)
    if kind is None:
        raise AgentError(f"a thread's disk is bound as {binding!r}, a kind of disk this "
                         f"blockdiff does not know ({', '.join(sorted(_KINDS))}); use the "
                         f"blockdiff that made it")
    return kind, where


def bound_disk(store: Store, binding: str | None) -> Disk | None:
    """The disk a thread's ``binding`` names (None: the thread has none)."""
    if not binding:
        return None
    kind, where = _kind_of(binding)
    return kind.reopen(store, where)


def fork_disk(store: Store, binding: str | None, snapshot_id: str | None,
              new_name: str) -> Disk | None:
    """A disk of its own for a forked thread ``new_name``, of the kind of
    ``binding``, holding the disk snapshot ``snapshot_id`` (None when the
    thread forked from has no disk or no disk snapshot)."""
    if not binding or not snapshot_id:
        return None
    kind, where = _kind_of(binding)
    return kind.fork(store, where, snapshot_id, new_name)


def remove_disk_snapshot(store: Store, snapshot_id: str) -> None:
    """Remove a disk snapshot no checkpoint needs any more, with what belongs
    to it: a whole-VM checkpoint's memory snapshot, which nothing else
    names. ``UnknownSnapshot`` if the disk snapshot is gone already."""
    snap = store.get(snapshot_id)
    store.rm(snap.id)   # with its parts: the memory snapshot is one
    memory = memory_of(snap.meta)
    if memory:
        # A memory snapshot committed before they were parts is not one.
        with contextlib.suppress(UnknownSnapshot):
            store.rm(memory)


def _fork_image(store: Store, path: str, snapshot_id: str, new_name: str) -> ImageDisk:
    # Beside the image, named after the new thread: disk.img -> disk.NEW.img.
    image = Path(path)
    fork = image.with_name(f"{image.stem}.{new_name}{image.suffix}")
    store.restore(snapshot_id, fork)
    return ImageDisk(store, fork)


register(DiskKind(
    "image", ImageDisk,
    where=lambda disk: os.path.abspath(disk.path),
    reopen=ImageDisk,
    fork=_fork_image))
register(DiskKind(
    "vm", Sandbox,
    where=lambda sandbox: sandbox.name,
    reopen=Sandbox,
    # Made, not started: forking a thread does not run it.
    fork=lambda store, name, snapshot_id, new_name: Sandbox(store, name).fork(
        snapshot_id, new_name, start=False)))
