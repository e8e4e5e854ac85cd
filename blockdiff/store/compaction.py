"""Compaction: a snapshot's data rewritten into one new, physically
contiguous layer, so that forks of it take a few clones instead of one per
fragment (see docs/store.md, "Fragmented images and compaction").

In a store shared by several hosts a compaction never makes a durable
snapshot non-durable: the new layer, the snapshot's new map and the maps of
its dependents written whole are uploaded before the transaction that
switches their rows (which records them as uploaded), as a removal does
(blockdiff.store.removal); if the object store fails, nothing changes
(``RemoteError``). The switch checks that the rows it read are unchanged
(``Conflict`` otherwise)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import numpy as np

from blockdiff import native
from blockdiff.engine.extents import ExtentMap, PieceTable, coalesce
from blockdiff.errors import ObjectInTheWay, RemoteError
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Snapshot
from blockdiff.store.ids import new_id
from blockdiff.store.layers import chunk_record, file_identity
from blockdiff.store.maps import SnapshotMap, encode_map, pack_pieces
from blockdiff.store.objects import unlink
from blockdiff.store.removal import CONFLICT_RETRIES, refuse_lost_references, sweep_in_the_way
from blockdiff.store.replication import forget_objects, record_uploaded, upload_rewritten
from blockdiff.store.state import StoreState


def compact(store: StoreState, snapshot_id: str, progress: Progress = NO_PROGRESS) -> Snapshot:
    """See ``Store.compact``."""
    for _ in range(CONFLICT_RETRIES - 1):
        try:
            return _compact(store, snapshot_id, progress)
        except ObjectInTheWay:
            sweep_in_the_way(store)
    return _compact(store, snapshot_id, progress)


def _compact(store: StoreState, snapshot_id: str, progress: Progress) -> Snapshot:
    layer = int(new_id(), 16)
    layer_path = store.layer_path(layer)
    objects = store.object_files
    staged = objects.staged(f"{layer:016x}", "layer")
    map_tmp = objects.staged(snapshot_id, "compact.map")
    placed: list[Path] = []
    digest = ""
    with store.lock.shared():
        snap = store.get(snapshot_id)
        snapshot_id = snap.id   # a prefix resolved
        smap = store.load_map(snap)
        try:
            store.layers.ensure_local(np.unique(smap.pieces.layer))
            store.layers.check_pieces(snap, smap.pieces, whole=True, progress=progress)
            fd = objects.create(staged)
            try:
                # The layer is the image itself (position = offset), its
                # data copied, not reflinked, so the filesystem lays it
                # out afresh.
                native.truncate(fd, snap.size, staged)
                pieces = smap.pieces
                progress.start(int(pieces.length.sum()), "B", "copying")
                store.layers.fill(fd, str(staged), pieces, copy=True, progress=progress)
                native.fsync(fd, staged)
                compacted = PieceTable(*coalesce(pieces.offset, pieces.length,
                                                 np.full(len(pieces), layer, np.int64),
                                                 pieces.offset.copy()), size=snap.size)
                record = chunk_record(layer, fd, staged, compacted.pos, compacted.pos,
                                      compacted.length, progress=progress)
                extents = ExtentMap.of_file(fd, staged, sync=False)  # fsynced above
            finally:
                os.close(fd)
            # Where the bytes came from, so comparisons see the same runs.
            record.origin = pack_pieces(store.layers.canonical(pieces))
            raw = encode_map(SnapshotMap(compacted, extents, layer))
            digest = hashlib.sha256(raw).hexdigest()
            objects.write(map_tmp, raw)
            objects.place(staged, layer_path, placed)
            objects.place(map_tmp, objects.map_path(snap.id, digest), placed)
            objects.sync()
            record.stat = file_identity(layer_path)
            old_map = store.map_path(snap)
            # Maps that are deltas on the old one are written whole first.
            dependents, digests = store.maps.write_dependents_whole(snap, placed)
            rewritten, maps = [snap, *dependents], {**digests, snap.seq: digest}
            # Objects first, then rows: what was durable stays so at the switch.
            try:
                uploaded = upload_rewritten(store, rewritten, maps, (record,))
            except RemoteError as e:
                raise RemoteError(f"snapshot {snap.id} was not compacted: its new layer "
                                  f"and maps must be in the object store first ({e})") from e
            with store.catalog.transaction() as db:
                refuse_lost_references(store.catalog, store.root, db)
                store.maps.point_dependents_at_whole(db, snap, dependents, digests)
                store.catalog.add_layer(db, record)
                unused = store.catalog.replace_map(db, snap, digest, [layer])
                record_uploaded(store, db, rewritten, maps, uploaded)
        except BaseException:
            for p in (staged, map_tmp):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            objects.unplace(lambda: (store.catalog.get(snapshot_id) or snap).map_sha256
                            == digest, placed)
            raise
    with store.lock.exclusive():
        unlink(old_map)
        for dep in dependents:
            unlink(store.map_path(dep))
        for old in unused:
            unlink(store.layer_path(old))
            store.layers.forget(old)
    if store.shared is not None:
        # No row names the old objects any more; other hosts' copies go with
        # their next sweep.
        forget_objects(store, unused, rewritten)
    return store.get(snapshot_id)
