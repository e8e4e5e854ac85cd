"""Sandbox disks for the layers above the store: anything with
``checkpoint(message, meta, ttl, skip_unchanged) -> snapshot id`` and
``restore(snapshot id)``. A :class:`blockdiff.vm.sandbox.Sandbox` (a VM) is one;
:class:`ImageDisk` is the other: a plain image file committed to a store,
for agents whose sandbox is not a VM (a container's disk, a test)."""

from __future__ import annotations

import os
from typing import Protocol

from blockdiff.store.store import Store, as_store


class Disk(Protocol):
    def checkpoint(self, message: str = "", meta: dict | None = None, ttl: float | None = None,
                   skip_unchanged: bool = False) -> str: ...

    def restore(self, snapshot_id: str): ...


class ImageDisk:
    """A disk image file on the store's filesystem."""

    def __init__(self, store: Store | str | os.PathLike, path: str | os.PathLike):
        self.store = as_store(store)
        self.path = os.fspath(path)

    def checkpoint(self, message: str = "", meta: dict | None = None, ttl: float | None = None,
                   skip_unchanged: bool = False) -> str:
        return self.store.commit(self.path, message=message, meta=meta, ttl=ttl,
                                 skip_unchanged=skip_unchanged).id

    def restore(self, snapshot_id: str) -> None:
        self.store.restore(snapshot_id, self.path)
