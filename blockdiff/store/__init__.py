"""The snapshot store: a tree of snapshots of disk images, each a map of
pieces into reflinked layer files, kept in a catalog beside them."""

from blockdiff.errors import AmbiguousId, Damaged, ImageBusy, StoreError, UnknownSnapshot
from blockdiff.store.store import Store, open_store

__all__ = ["AmbiguousId", "Damaged", "ImageBusy", "Store", "StoreError", "UnknownSnapshot",
           "open_store"]
