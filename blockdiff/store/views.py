"""Which extent map of a snapshot holds on this host.

A commit finds what changed by comparing the image's extent map with its
parent's, and an in-place restore finds what to rewrite by comparing it
with the target's. Physical addresses mean something only on the
filesystem that recorded them, and only while the layer files sharing those
blocks stay: an image written in place over a block no layer holds keeps
the block's address while its content changes. A store of one host never
drops a layer file a snapshot uses, so there a snapshot's own extent map
(in its map file) always holds.

In a store shared by several hosts:

- a snapshot's own extent map holds on the host that committed it, while
  that host has held, since the commit, every layer the snapshot uses (a
  layer evicted and fetched again is another file with other blocks);
- on any host, an image restored from a snapshot shares the blocks of that
  host's layer copies, so its extent map right after the restore is the
  snapshot's *view* on the host (``STORE/views/ID.DIGEST.view``), which
  holds while the host keeps those copies;
- where neither holds, a commit compares contents with the parent instead,
  and an in-place restore rewrites the whole image from the layers (then
  records a view).

"Held since" is read from the catalog, never from a clock: the catalog
hands out generations, each larger than every one before it; a layer copy
gets one when its host places it, a snapshot when it is committed (its own
layer's copy the same). A snapshot's own extent map holds on the host that
committed it while every copy of the layers it uses has a generation no
larger than the snapshot's; a view records the latest generation of those
copies when it was made, and holds while none is larger. A copy evicted and
fetched again is placed at a new generation, whatever any clock says.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
from pathlib import Path

from blockdiff.engine.extents import ExtentMap
from blockdiff.store.catalog import Snapshot
from blockdiff.store.maps import MAP_ERRORS, SnapshotMap, decode_map, encode_map
from blockdiff.store.state import StoreState

VIEWS = "views"
# A view file: this magic, the generation it was made at (u64), then a map.
VIEW_MAGIC = b"BDVIEWG1"
_VIEW_HEAD = struct.Struct("<8sQ")


def view_path(store: StoreState, snap: Snapshot) -> Path:
    """Where this host keeps a snapshot's view."""
    return store.root / VIEWS / f"{snap.id}.{snap.map_sha256[:16]}.view"


def host_extents(store: StoreState, snap: Snapshot, smap: SnapshotMap | None = None
                 ) -> ExtentMap | None:
    """An extent map of the snapshot that holds on this host (see the
    module's docstring), or None if there is none."""
    host = store.catalog.host
    if host is None:
        return (smap or store.load_map(snap)).extents
    if _own_map_holds(store, snap):
        return (smap or store.load_map(snap)).extents
    path = view_path(store, snap)
    try:
        raw = path.read_bytes()
        magic, generation = _VIEW_HEAD.unpack_from(raw)
        # Made before views recorded a generation, or damaged: a cache that is lost.
        if magic != VIEW_MAGIC or not store.catalog.copies_cover(snap, generation):
            return None
        view, _ = decode_map(raw[_VIEW_HEAD.size:])
    except FileNotFoundError:
        return None
    except (*MAP_ERRORS, struct.error):
        return None    # a damaged view is only a cache that is lost
    if view.extents.size != snap.size:
        return None
    return view.extents


def record_view(store: StoreState, snap: Snapshot, smap: SnapshotMap, fd: int,
                path: str) -> None:
    """After ``fd`` (``path``) was made the snapshot whole from this
    host's layers: keep its extent map as the snapshot's view here, unless
    the snapshot's own holds. Best effort: without a view the next commit
    compares contents."""
    if store.catalog.host is None or _own_map_holds(store, snap):
        return
    # The copies the image was just made from (the store lock, held by the
    # caller, keeps any from being evicted and placed again meanwhile).
    generation = store.catalog.copies_generation(snap)
    if generation is None:
        return
    target = view_path(store, snap)
    temp = target.with_name(f".{target.name}.{os.getpid()}")
    with contextlib.suppress(OSError):
        target.parent.mkdir(mode=0o700, exist_ok=True)
        extents = ExtentMap.of_file(fd, path)
        raw = _VIEW_HEAD.pack(VIEW_MAGIC, generation) + encode_map(
            dataclasses.replace(smap, extents=extents, chain=0))
        try:
            with open(temp, "xb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()


def _own_map_holds(store: StoreState, snap: Snapshot) -> bool:
    """Whether the snapshot was committed on this host and every layer copy
    it uses here was placed no later than its commit (see the module's
    docstring)."""
    return (snap.host == store.catalog.host and snap.generation is not None
            and store.catalog.copies_cover(snap, snap.generation))


def sweep_views(store: StoreState, keep: set[str]) -> None:
    """Remove the views of snapshots (by ``ID.DIGEST16``) not in ``keep``."""
    directory = store.root / VIEWS
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.name.rsplit(".", 1)[0] not in keep:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
