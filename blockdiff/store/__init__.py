"""The snapshot store: a tree of snapshots of disk images, each a map of
pieces into reflinked layer files, kept in a catalog beside them.

``Store`` (store.py) is the facade; the docstring of store.py says which
module holds what."""

from blockdiff.errors import AmbiguousId, Damaged, ImageBusy, StoreError, UnknownSnapshot
from blockdiff.store.store import Store, as_store, open_store

__all__ = ["AmbiguousId", "Damaged", "ImageBusy", "Store", "StoreError", "UnknownSnapshot",
           "as_store", "open_store"]
