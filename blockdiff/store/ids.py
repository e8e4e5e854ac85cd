"""Snapshot ids: making one, telling one from anything else, the layer it
names, and finding a snapshot by its id or a unique prefix of it."""

from __future__ import annotations

import os
from pathlib import Path

from blockdiff.errors import AmbiguousId, UnknownSnapshot
from blockdiff.store.catalog import Catalog, Snapshot, candidates, id_prefix


def new_id() -> str:
    """A fresh snapshot (or layer) id: 16 hex digits."""
    # 63 random bits: a positive int64 names the layer inside piece tables.
    return f"{int.from_bytes(os.urandom(8), 'big') >> 1:016x}"


def is_id(value) -> bool:
    """Whether ``value`` is a snapshot id as :func:`new_id` makes them."""
    return (isinstance(value, str) and len(value) == 16
            and all(c in "0123456789abcdef" for c in value) and value[0] in "01234567")


def layer_number(snapshot_id: str) -> int:
    """The layer a snapshot's commit wrote, as piece tables name it."""
    return int(snapshot_id, 16)


def find_snapshot(catalog: Catalog, root: Path, snapshot_id: str) -> Snapshot:
    """The catalog entry of a snapshot given by its id or a unique prefix of
    it (see ``Store.get``); ``root`` is the store named in the errors."""
    snap = catalog.get(snapshot_id)
    if snap is None and (prefix := id_prefix(snapshot_id)) is not None:
        ids, total = catalog.ids_with_prefix(prefix)
        if total > 1:
            raise AmbiguousId(f"snapshot id {snapshot_id!r} is ambiguous: {total} snapshots "
                              f"in the store {root} begin with it "
                              f"({candidates(ids, total)}); give more of its digits")
        snap = catalog.get(ids[0]) if ids else None
    if snap is None:
        short = (isinstance(snapshot_id, str) and 0 < len(snapshot_id) < 4
                 and all(c in "0123456789abcdefABCDEF" for c in snapshot_id))
        raise UnknownSnapshot(f"no snapshot {snapshot_id!r} in the store {root}"
                              + (" (an id prefix needs at least 4 hex digits)"
                                 if short else "")
                              + f"; list them with: blockdiff log --store {root}")
    return snap
