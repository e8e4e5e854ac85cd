"""The snapshot store: a tree of snapshots of disk images, each a map of
pieces into reflinked layer files, kept in a catalog beside them.

``Store`` (store.py) is the facade; the docstring of store.py says which
module holds what."""

from blockdiff.store.store import Store, as_store, open_store

# Its errors are in blockdiff.errors, with every other (one path to import each).
__all__ = ["Store", "as_store", "open_store"]
