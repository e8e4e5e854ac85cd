"""What every operation of an open store shares, in one place: its root and
catalog, the settings read from the catalog, the store lock, its object
files, and its maps and layers (each with the cache of what was decoded).

``Store`` is a ``StoreState`` that opens itself; the operation modules
(images, transfer, compaction, removal, verify) take one.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from blockdiff.errors import StoreError
from blockdiff.store.catalog import Catalog, Snapshot
from blockdiff.store.ids import find_snapshot
from blockdiff.store.lineage import lineage_record
from blockdiff.store.objects import ObjectFiles, StoreLock
from blockdiff.store.shared import REMOTE_SETTING, Fetcher, SharedConfig, open_remote

if TYPE_CHECKING:
    from blockdiff.store.layers import Layers
    from blockdiff.store.maps import Maps, SnapshotMap

# A preallocated file the store deletes to make room when the disk is full,
# so that rm and gc can still open the catalog and free space.
RESERVE = 4 << 20


class StoreState:
    """An open store's shared state, over its opened ``catalog``."""

    def __init__(self, root: Path, catalog: Catalog, shared: SharedConfig | None = None):
        self.root = root
        self.catalog = catalog
        # A store shared by several hosts: where the shared parts are
        # (blockdiff.store.shared); None for a store of one host.
        self.shared = shared
        self._remote = None
        self._remote_lock = threading.Lock()
        self.id = catalog.setting("store_id")
        # Without reflink the store copies data and compares contents.
        self.copy_mode = catalog.setting("mode") == "copy"
        group = catalog.setting("group")
        self.group = None if group is None else int(group)
        # Files readable by their owner only, or by the store's group too.
        self.file_mode = 0o600 if self.group is None else 0o640
        self.object_mode = self.file_mode & 0o444
        self.lock = StoreLock(root / "lock", self.file_mode)
        self.object_files = ObjectFiles(root, self.object_mode)
        self.objects, self.staging = self.object_files.objects, self.object_files.staging
        # The maps and the layers are made when first used: their modules load
        # numpy and the native core, which what reads only the catalog (log,
        # and so every one-host command's start-up) does without.
        self._maps: Maps | None = None
        self._layers: Layers | None = None
        self._parts_lock = threading.Lock()
        # In a shared store, what brings the maps and layers this host lacks.
        self._fetcher = None
        if shared is not None:
            catalog.host = shared.host
            self._fetcher = Fetcher(catalog, self.object_files, self.lock,
                                    lambda: self.remote, shared.host)

    @property
    def maps(self) -> Maps:
        """The snapshots' map files, read through their chains and a cache."""
        if self._maps is None:
            with self._parts_lock:
                if self._maps is None:
                    from blockdiff.store.maps import Maps

                    maps = Maps(self.catalog, self.object_files)
                    maps.fetcher = self._fetcher
                    self._maps = maps
        return self._maps

    @property
    def layers(self) -> Layers:
        """The layers' data files and their checked records."""
        if self._layers is None:
            with self._parts_lock:
                if self._layers is None:
                    from blockdiff.store.layers import Layers

                    layers = Layers(self.catalog, self.object_files)
                    layers.fetcher = self._fetcher
                    self._layers = layers
        return self._layers

    @property
    def remote(self):
        """The object store of a shared store (made when first needed: its
        client library is imported only then)."""
        if self.shared is None:
            return None
        with self._remote_lock:
            if self._remote is None:
                url = self.catalog.setting(REMOTE_SETTING)
                if not url:
                    raise StoreError(f"the shared catalog of {self.root} names no object "
                                     f"store; join it again with blockdiff init --remote")
                self._remote = open_remote(url)
            return self._remote

    def get(self, snapshot_id: str) -> Snapshot:
        """The catalog entry of a snapshot, given by its id or by a unique
        prefix of it (at least ``PREFIX_MIN``, 4, hex digits, as git takes);
        ``UnknownSnapshot`` if none, ``AmbiguousId`` if the prefix begins
        more than one id. The entry holds the full id: use ``snap.id``, not
        what was given, from then on."""
        return find_snapshot(self.catalog, self.root, snapshot_id)

    def map_path(self, snap: Snapshot) -> Path:
        """Where a snapshot's map is: named by its digest, so a rewritten map
        (compaction) never replaces the old one under the same name."""
        return self.maps.path(snap)

    def layer_path(self, layer: int) -> Path:
        """Where a layer's data file is."""
        return self.object_files.layer_path(layer)

    def load_map(self, snap: Snapshot, *, cached: bool = True,
                 refetch: bool = True) -> SnapshotMap:
        """A snapshot's map, checked against the digest the catalog recorded
        (when it is read: ``cached=False`` reads it even if it was read before)
        and against the catalog's size; in a shared store, a damaged local
        copy is replaced by the object store's, unless not ``refetch``."""
        return self.maps.load(snap, cached=cached, refetch=refetch)

    def lineage(self, image: str | os.PathLike) -> tuple[str | None, str]:
        """``(snapshot id, state)`` an image records for this store, else ``(None, "")``."""
        record = lineage_record(image, self.id, self.catalog)
        if record is None:
            return None, ""
        return record["snapshot"], record.get("state", "")

    def lineage_mark(self, image: str | os.PathLike) -> str | None:
        """A token that changes with every commit or restore of the image
        (None if it has no lineage here): a dirty-block tracker reset right
        after one of them can tell that no other came between."""
        record = lineage_record(image, self.id, self.catalog)
        return None if record is None else record.get("mark")

    def keep_reserve(self) -> None:
        """Make sure the store's reserve file is there, if there is room for it."""
        path = self.root / "reserve"
        if path.exists():
            return
        temp = self.root / f".reserve.{os.getpid()}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, RESERVE)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, path)
        except OSError:
            with contextlib.suppress(OSError):
                temp.unlink()
