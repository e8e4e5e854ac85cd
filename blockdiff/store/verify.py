"""Verify: everything the store can check about itself, reported by the
snapshots each problem affects."""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

from blockdiff.engine.extents import subtract, union
from blockdiff.errors import Damaged, StoreError
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Snapshot
from blockdiff.store.layers import NO_CHUNKS, Layers, by_layer
from blockdiff.store.objects import layer_name
from blockdiff.store.state import StoreState


@dataclass
class Repair:
    """What ``verify --repair`` did: the object files it fetched again from
    the object store (this host's copies were damaged), and the problems
    that remain, as ``Store.verify`` gives them."""

    fetched_again: list[str] = field(default_factory=list)
    problems: dict[str, list[str]] = field(default_factory=dict)


def verify(store: StoreState, snapshot_id: str | None = None,
           progress: Progress = NO_PROGRESS) -> dict[str, list[str]]:
    """See ``Store.verify``."""
    return _verify(store, snapshot_id, progress)[0]


def repair(store: StoreState, snapshot_id: str | None = None,
           progress: Progress = NO_PROGRESS) -> Repair:
    """See ``Store.repair``."""
    done = Repair()
    tried: set[str] = set()
    while True:
        # A map fetched again lets the layers it names be checked: another round.
        done.problems, maps, layers = _verify(store, snapshot_id, progress)
        if store.shared is None:
            return done
        names = ([(store.map_path(s).name, s) for s in maps]
                 + [(layer_name(x), x) for x in sorted(layers)])
        todo = [(name, what) for name, what in names if name not in tried]
        if not todo:
            return done
        with store.lock.shared():
            for name, what in todo:
                tried.add(name)
                with contextlib.suppress(Damaged, StoreError):   # reported by the next round
                    if isinstance(what, Snapshot):
                        if not store.maps.fetcher.uploaded_map(what):
                            continue
                        store.maps.fetcher.map(what, replace=True)
                    elif not store.layers.fetch_again(what):
                        continue
                    done.fetched_again.append(name)


def _verify(store: StoreState, snapshot_id: str | None, progress: Progress
            ) -> tuple[dict[str, list[str]], list[Snapshot], set[int]]:
    """The problems found, and the snapshots whose map and the layers whose
    chunks this host holds damaged."""
    problems: dict[str, list[str]] = {}
    damaged_maps: list[Snapshot] = []
    catalog = store.catalog.integrity_problems()
    lost = store.catalog.lost_references()
    catalog += [f"snapshot {sid}: its layer references are not all there" for sid in lost]
    if catalog:
        problems["catalog"] = catalog
    with store.lock.shared():
        snaps = [store.get(snapshot_id)] if snapshot_id else store.catalog.all()
        maps = {}
        for snap in snaps:
            if (store.shared is not None and not store.map_path(snap).exists()
                    and store.catalog.map_upload(snap)[1] is None):
                continue      # pending on the host that wrote it: that host checks it
            try:
                maps[snap.id] = store.load_map(snap, cached=False, refetch=False)
            except (OSError, StoreError, Damaged, ValueError) as e:
                problems[snap.id] = [f"map: {getattr(e, 'strerror', None) or e}"]
                if store.shared is not None:
                    damaged_maps += [s for s in _damaged_copies(store, snap)
                                     if s.id not in {d.id for d in damaged_maps}]
        # Every layer is read once, however many snapshots use it.
        every_layer = {int(layer) for smap in maps.values()
                       for layer in np.unique(smap.pieces.layer)}
        progress.start(store.layers.whole_bytes(every_layer), "B", "checking layers")
        checked: dict[int, tuple[list[str], tuple]] = {}
        for snap in snaps:
            if snap.id not in maps:
                continue
            smap = maps[snap.id]
            found: list[str] = []
            path = store.map_path(snap)
            if os.stat(path).st_mode & 0o222:
                found.append(f"{path.name} is writable")
            used = {int(layer) for layer in np.unique(smap.pieces.layer)}
            refs = store.catalog.layers_of(snap)
            if used - refs:
                found.append(f"the catalog does not record its use of "
                             f"{', '.join(layer_name(x) for x in sorted(used - refs))}")
            for layer, sel in by_layer(smap.pieces):
                if layer not in checked:
                    if store.shared is not None and not store.layer_path(layer).exists():
                        checked[layer] = _check_object(store, layer), NO_CHUNKS
                    else:
                        checked[layer] = _check_layer(store.layers, layer, progress)
                layer_problems, bad = checked[layer]
                found += layer_problems
                if len(bad[0]):
                    hit = _overlapping(smap.pieces.pos[sel], smap.pieces.length[sel], *bad)
                    if hit:
                        found.append(f"{layer_name(layer)}: {hit} of its bytes are in "
                                     f"chunks that fail their checksum")
            if found:
                problems[snap.id] = sorted(set(found))
    damaged_layers = {layer for layer, (_, bad) in checked.items() if len(bad[0])}
    return problems, damaged_maps, damaged_layers


def _damaged_copies(store: StoreState, snap: Snapshot) -> list[Snapshot]:
    """The snapshots, of ``snap`` and the chain of maps it is a delta on,
    whose map file this host holds with another digest than the catalog's."""
    found = []
    while True:
        with contextlib.suppress(OSError):
            if hashlib.sha256(store.map_path(snap).read_bytes()).hexdigest() \
                    != snap.map_sha256:
                found.append(snap)
        if snap.map_base is None:
            return found
        try:
            snap = store.get(snap.map_base)
        except StoreError:
            return found


def _check_layer(layers: Layers, layer: int, progress: Progress) -> tuple[list[str], tuple]:
    """A layer's problems and its bad chunks; vouches for it if it has none.
    The bytes read advance ``progress``."""
    path = layers.files.layer_path(layer)
    if not path.exists():
        return [f"layer {path.name} is missing"], NO_CHUNKS
    problems = [f"{path.name} is writable"] if os.stat(path).st_mode & 0o222 else []
    try:
        bad, _, problem = layers.check_whole(layer, progress)
    except Damaged as e:
        return problems + [str(e).split(";")[0]], NO_CHUNKS
    return problems + ([problem] if problem else []), bad


def _check_object(store: StoreState, layer: int) -> list[str]:
    """In a shared store, of a layer this host does not hold: whether the
    object store has it, of the size recorded (its bytes are checked when a
    host fetches it). A layer not uploaded yet is another host's to check."""
    from blockdiff.store.remote import layer_key
    size, uploaded = store.catalog.uploads([layer]).get(layer, (None, None))
    if uploaded is None:
        return []
    name = layer_name(layer)
    info = store.remote.stat(layer_key(name))
    if info is None:
        return [f"layer {name} is missing from the object store"]
    if info.size != size:
        return [f"layer {name} is {info.size} bytes in the object store, not {size}"]
    return []


def _overlapping(pos, length, bad_pos, bad_length) -> int:
    """Bytes of the runs ``pos``/``length`` inside the bad chunks."""
    starts, ends = union(pos, pos + length)
    outside_s, outside_e = subtract(starts, ends, bad_pos, bad_pos + bad_length)
    return int((ends - starts).sum() - (outside_e - outside_s).sum())
