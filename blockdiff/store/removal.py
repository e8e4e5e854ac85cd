"""Removing snapshots (rm, and gc by a retention policy) and sweeping the
files no snapshot uses.

The catalog rows go first, in one transaction, and the files after it,
under the exclusive store lock: a crash in between leaves only files no row
names, which the sweep removes. Descendants of a removed snapshot stay
restorable byte for byte, since their piece tables are complete.

In a store shared by several hosts a removal never makes a durable
snapshot non-durable: the maps that were deltas on the removed one's are
written whole and, where the old one was in the object store, uploaded
before the transaction that points their rows at them (which records them
as uploaded), as a commit puts objects before rows. If the object store
fails, nothing is removed (``RemoteError``). The removal's old objects are
deleted after the transaction; a reader on another host holding the old
rows reads the new ones then (blockdiff.store.maps). Two hosts removing
snapshots of one line at once: the transaction checks that the maps it
rewrote are still the rows' (``Conflict`` otherwise), and the removal starts
again on what the catalog says now, a few times at most.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from blockdiff.errors import Conflict, Damaged, ObjectInTheWay, RemoteError, UnknownSnapshot
from blockdiff.store.catalog import Catalog, Snapshot
from blockdiff.store.ids import layer_number
from blockdiff.store.objects import layer_name, unlink
from blockdiff.store.replication import forget_objects, record_uploaded, upload_rewritten
from blockdiff.store.retention import apply_policy, owner_of
from blockdiff.store.state import StoreState
from blockdiff.store.views import sweep_views

# How many times the removal of one snapshot starts again when the catalog
# changed under it (another host or process removing beside it).
CONFLICT_RETRIES = 8


@dataclass
class Removal:
    """What ``Store.rm`` or ``Store.gc`` removed."""

    removed: list[str]
    bytes_freed: int     # allocated in the removed files; blocks shared with a
                         # live image are not freed on disk until it lets go
    reasons: dict


def refuse_lost_references(catalog: Catalog, root: Path, db=None) -> None:
    """Before anything is deleted: the catalog must account for every layer
    a snapshot uses, or a layer still in use could go."""
    lost = catalog.lost_references(db)
    if lost:
        raise Damaged(f"the catalog has lost layer references of snapshot(s) "
                      f"{', '.join(lost[:5])}{' ...' if len(lost) > 5 else ''}; nothing "
                      f"was removed; run: blockdiff verify --store {root}")


def rm(store: StoreState, snapshot_id: str) -> Removal:
    """See ``Store.rm``."""
    snap = store.get(snapshot_id)
    # Its parts, and theirs, first (the deepest first): should this stop
    # half-way, what is left is the snapshot asked for and parts it still
    # owns, which the same rm removes. A part committed meanwhile is found
    # once it is gone; after that, none can be (Catalog.add refuses).
    parts = _parts_of(store.catalog.all(), {snap.id})
    result = remove(store, [*parts, snap],
                    {s.id: f"a part of {snap.id}" for s in parts} | {snap.id: "asked"})
    if snap.id not in result.removed:
        raise UnknownSnapshot(f"snapshot {snap.id} was removed by another process or host "
                              f"meanwhile")
    result = _with_late_parts(store, result, lambda part: f"a part of {snap.id}")
    store.keep_reserve()
    return result


def _with_late_parts(store: StoreState, result: Removal, reason) -> Removal:
    """``result`` and the removal of the parts of what it removed that were
    committed meanwhile (listed first); ``reason(part)`` says why each goes."""
    family = set(result.removed)
    while late := _parts_of(store.catalog.all(), family):
        more = remove(store, late, {s.id: reason(s) for s in late})
        family |= set(more.removed)
        result = Removal([*more.removed, *result.removed], result.bytes_freed
                         + more.bytes_freed, result.reasons | more.reasons)
    return result


def _parts_of(snaps: list[Snapshot], family: set[str]) -> list[Snapshot]:
    """The snapshots that are parts of those of ``family``, or parts of
    those, the deepest first."""
    family, parts = set(family), []
    while more := [s for s in snaps if owner_of(s) in family and s.id not in family]:
        family |= {s.id for s in more}
        parts = more + parts
    return parts


def remove(store: StoreState, snaps: list[Snapshot], reasons: dict) -> Removal:
    """Remove the snapshots ``snaps`` one by one: rows, then files. One
    another process or host removed meanwhile is left out of the result."""
    freed, removed = 0, []
    refuse_lost_references(store.catalog, store.root)
    for snap in snaps:
        for attempt in range(CONFLICT_RETRIES):
            current = store.catalog.get(snap.id)
            if current is None:
                break
            try:
                freed += _remove_one(store, current)
            except Conflict:
                if attempt == CONFLICT_RETRIES - 1:
                    raise
                continue
            except ObjectInTheWay:
                if attempt == CONFLICT_RETRIES - 1:
                    raise
                sweep_in_the_way(store)
                continue
            except RemoteError as e:
                done = (f"removed before it: {', '.join(removed)}" if removed
                        else "nothing was removed")
                raise RemoteError(f"{e}; {done}: try again when the object store is "
                                  f"back") from e
            removed.append(snap.id)
            break
    return Removal(removed, freed, {sid: reasons[sid] for sid in removed})


def _remove_one(store: StoreState, snap: Snapshot) -> int:
    """Remove one snapshot as the catalog has it now; the bytes freed."""
    placed: list[Path] = []
    dependents: list[Snapshot] = []
    digests: dict[int, str] = {}

    def committed() -> bool:
        # Whether a row names a map this removal wrote (its switch committed).
        return any((store.catalog.get(d.id) or d).map_sha256 == digests.get(d.seq)
                   for d in dependents)

    with store.lock.shared():
        try:
            dependents, digests = store.maps.write_dependents_whole(snap, placed)
            try:
                uploaded = upload_rewritten(store, dependents, digests)
            except RemoteError as e:
                raise RemoteError(f"snapshot {snap.id} was not removed: the maps of "
                                  f"the snapshots built on it must be in the object "
                                  f"store first ({e})") from e
            with store.catalog.transaction() as db:
                refuse_lost_references(store.catalog, store.root, db)
                store.maps.point_dependents_at_whole(db, snap, dependents, digests)
                record_uploaded(store, db, dependents, digests, uploaded)
                unused = store.catalog.remove(db, snap, layer_number(snap.id))
        except BaseException:
            # What was uploaded stays for the sweep (sweep_remote): another
            # host's removal may name the same map, written from the same one.
            store.object_files.unplace(committed, placed)
            raise
    freed = 0
    # Files go after the catalog commit, under the exclusive lock: a
    # crash in between leaves only unreferenced files, which gc sweeps.
    with store.lock.exclusive():
        for dep in dependents:
            freed += unlink(store.map_path(dep))
        freed += unlink(store.map_path(snap))
        for layer in unused:
            freed += unlink(store.layer_path(layer))
            store.layers.forget(layer)
    if store.shared is not None:
        # Their rows are gone on every host; other hosts' copies go
        # with their next sweep.
        forget_objects(store, unused, [snap] + dependents)
    return freed


def gc(store: StoreState, policy, *, now: float | None = None, dry_run: bool = False) -> Removal:
    """See ``Store.gc``."""
    _, doomed, reasons = apply_policy(store.catalog.all(), policy,
                                      time.time() if now is None else now)
    reasons = {s.id: reasons[s.id] for s in doomed}
    if dry_run:
        return Removal([s.id for s in doomed], 0, reasons)
    result = remove(store, doomed, reasons)
    result = _with_late_parts(store, result, lambda part: f"a part of {owner_of(part)}, "
                                                          f"which went")
    result.bytes_freed += sweep(store)
    store.keep_reserve()
    return result


def sweep_in_the_way(store: StoreState) -> None:
    """After an rm or compact found a file in ``objects/`` where it was
    placing the map it wrote whole for a snapshot built on the one it works
    on (:class:`ObjectInTheWay`), before it starts again: such a map has the
    same contents, and so name, whoever writes it from the same map. No row
    naming it, it was left by an operation on the same snapshot killed
    between placing its files and its switch, and the sweep removes it (with
    whatever else such operations left; under the exclusive lock, so not
    under the shared one, which the caller has let go). A row naming it, the
    catalog moved on since the operation read it (another host's switch
    pointed that snapshot at the map, and a restore here fetched it), and
    the operation, starting again, reads the rows as they are now."""
    sweep(store)


def sweep(store: StoreState) -> int:
    """Remove the files of ``objects/`` no catalog row names, and staged
    files of processes that are gone. Under the exclusive lock, so no
    operation is between placing files and committing their rows."""
    with store.lock.exclusive():
        catalog = store.catalog
        refuse_lost_references(catalog, store.root)
        snaps = catalog.all()
        maps = {store.map_path(s).name for s in snaps}
        layers = {layer_name(layer) for layer in catalog.layer_ids() | catalog.layers_in_use()}
        if store.shared is not None:
            # Keep only the copies this host's rows record: a file without
            # its row is an eviction or a fetch cut short.
            here = {layer_name(layer) for layer in catalog.copies_here()}
            layers &= here
            sweep_views(store, {f"{s.id}.{s.map_sha256[:16]}" for s in snaps})
        return store.object_files.sweep(maps | layers)
