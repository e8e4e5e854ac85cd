"""What a host of a shared store does with the object store: push what it
wrote, pull what it lacks, say where each snapshot is, evict layer copies
beyond its cache size, and sweep objects no snapshot uses.

Order. Every object is uploaded after the catalog rows that name it are
committed, so an object without a row is one whose rows were removed (or
an upload that failed half-way, which leaves no object: a multipart upload
that never completes stores nothing). The one exception is what a removal
or a compaction rewrites for a durable snapshot (its maps, a compaction's
layer): it is uploaded before the switch, so the snapshot stays durable
(:func:`upload_rewritten`), and the sweep keeps every map object of a
snapshot whose map is a delta. An upload whose rows went meanwhile deletes
the object it just stored. Pushes
of one host run one at a time (``STORE/push.lock``); a layer is pushed only
by a host that holds it, and only while it is not uploaded, so two hosts
never upload one key.

Durability. A snapshot is durable once its map and every layer it uses are
in the object store, and the map it is a delta on (if any) is durable too:
from then on any host can restore it.

Eviction keeps the bytes of this host's layer copies under a limit, least
recently used first, and only copies that are uploaded. A copy's row goes
before its file (under the exclusive store lock), so the extent maps that
relied on the copy stop holding at once (blockdiff.store.views).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from blockdiff.errors import RemoteError, StoreError
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import LayerRecord, Snapshot
from blockdiff.store.layers import DecodedLayer
from blockdiff.store.objects import allocated, layer_name, map_name, unlink
from blockdiff.store.state import StoreState

# Objects no catalog row names are deleted by the sweep, and multipart
# uploads never completed are aborted, only once they are this old by the
# object store's own clock (see sweep_remote).
SWEEP_GRACE = 3600.0


@dataclass
class PushResult:
    """What a push uploaded."""

    layers: int = 0
    maps: int = 0
    bytes: int = 0
    snapshots: list[str] = field(default_factory=list)   # durable after it


@dataclass
class Placement:
    """Where a snapshot is, seen from this host."""

    snapshot: str
    host: str | None          # the name of the host that committed it
    here: bool                # this host holds its map and every layer it uses
    durable: bool             # all of those are in the object store

    @property
    def state(self) -> str:
        """'local' (here, not all uploaded), 'durable', or 'pending' (on
        another host only, not all uploaded)."""
        if self.durable:
            return "durable"
        return "local" if self.here else "pending"


def _require_shared(store: StoreState) -> None:
    if store.shared is None:
        raise StoreError(f"{store.root} is a store of one host: push, pull and the object "
                         f"store are for a store made with blockdiff init --catalog ... "
                         f"--remote ...")


@contextlib.contextmanager
def _push_lock(store: StoreState):
    fd = os.open(store.root / "push.lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def push(store: StoreState, snapshot_id: str | None = None,
         progress: Progress = NO_PROGRESS) -> PushResult:
    """Upload what this host holds that the object store lacks: everything,
    or what one snapshot needs (its layers and its chain of maps). Layers go
    before maps, older before newer, so a snapshot becomes durable no
    sooner than everything it needs. ``progress`` hears of the bytes sent."""
    from blockdiff.store.remote import layer_key, map_key
    _require_shared(store)
    catalog, remote = store.catalog, store.remote
    result = PushResult()
    with _push_lock(store), store.lock.shared():
        layers = catalog.pending_layers()
        maps = [s for s in catalog.pending_maps() if store.map_path(s).exists()]
        if snapshot_id is not None:
            wanted = _needed(store, store.get(snapshot_id))
            layers = [x for x in layers if x in wanted[0]]
            maps = [s for s in maps if s.id in wanted[1]]
        paths = [store.layer_path(x) for x in layers] + [store.map_path(s) for s in maps]
        progress.start(sum(_size(p) for p in paths), "B", "uploading")
        for layer in layers:
            path = store.layer_path(layer)
            size = _size(path)
            remote.put_file(layer_key(path.name), path, _checksums(store.layers.decoded(layer)))
            if not catalog.mark_layer_uploaded(layer, size):
                remote.delete([layer_key(path.name)])   # removed meanwhile
                continue
            result.layers += 1
            result.bytes += size
            progress.advance(size)
        for snap in maps:
            path = store.map_path(snap)
            size = _size(path)
            remote.put_file(map_key(path.name), path)
            if not catalog.mark_map_uploaded(snap, size):
                # Removed, or given another map meanwhile: this one is unused.
                remote.delete([map_key(path.name)])
                continue
            result.maps += 1
            result.bytes += size
            progress.advance(size)
    durable = {p.snapshot for p in placement(store) if p.durable}
    result.snapshots = sorted({s.id for s in maps} & durable)
    return result


def _needed(store: StoreState, snap: Snapshot) -> tuple[set[int], set[str]]:
    """The layers a snapshot uses and the snapshots whose maps reading its
    map reads (itself and its chain of delta bases)."""
    layers = store.catalog.layers_of(snap)
    maps = {snap.id}
    while snap.map_base is not None:
        snap = store.get(snap.map_base)
        maps.add(snap.id)
    return layers, maps


def pull(store: StoreState, snapshot_id: str) -> int:
    """Bring everything a snapshot needs onto this host (its maps and the
    layers it uses), checked; the bytes downloaded."""
    _require_shared(store)
    with store.lock.shared():
        snap = store.get(snapshot_id)
        smap = store.load_map(snap)          # fetches the chain of maps
        return store.layers.ensure_local(np.unique(smap.pieces.layer))


def placement(store: StoreState) -> list[Placement]:
    """Where every snapshot is, newest first (see :class:`Placement`)."""
    catalog = store.catalog
    # One state of the catalog: a snapshot committed or removed between two
    # of these reads (by a push beside it, another host) would be in one and
    # not the other.
    with catalog.db.reading():
        names = catalog.host_names()
        snaps = catalog.all()
        placed = catalog.placement()
        here_layers = set(catalog.copies_here()) if store.shared is not None else None
    by_id = {s.id: s for s in snaps}
    durable: dict[str, bool] = {}

    def is_durable(sid: str) -> bool:
        if sid not in durable:
            _, map_up, missing = placed[sid]
            base = by_id[sid].map_base
            durable[sid] = map_up and not missing and (base is None or is_durable(base))
        return durable[sid]

    found = []
    for snap in snaps:
        if here_layers is None:
            here = True
        else:
            here = (store.map_path(snap).exists()
                    and catalog.layers_of(snap) <= here_layers)
        found.append(Placement(snap.id, names.get(snap.host), here,
                               store.shared is not None and is_durable(snap.id)))
    return found


def placement_of(store: StoreState, snap: Snapshot) -> Placement:
    """Where one snapshot is (what :func:`placement` says of it, for the
    cost of a few queries)."""
    catalog = store.catalog
    if store.shared is None:
        return Placement(snap.id, None, True, False)
    here = store.map_path(snap).exists() and catalog.copies_cover(snap)
    durable = catalog.not_uploaded(snap) == 0
    cursor = snap
    while durable:
        durable = catalog.map_upload(cursor)[1] is not None
        if cursor.map_base is None:
            break
        cursor = store.get(cursor.map_base)
    return Placement(snap.id, catalog.host_names().get(snap.host), here, durable)


def evict(store: StoreState, limit: int) -> tuple[list[int], int]:
    """Remove this host's least recently used layer copies that are in the
    object store until its copies take at most ``limit`` bytes; the layers
    evicted and the bytes freed. Copies not uploaded yet are never evicted."""
    _require_shared(store)
    catalog = store.catalog
    copies = catalog.copies_here()
    sizes = {layer: allocated(store.layer_path(layer)) for layer in copies}
    total = sum(sizes.values())
    if total <= limit:
        return [], 0
    uploads = catalog.uploads(copies)
    candidates = sorted((used, layer) for layer, used in copies.items()
                        if uploads.get(layer, (None, None))[1] is not None)
    chosen = []
    for _, layer in candidates:
        if total <= limit:
            break
        chosen.append(layer)
        total -= sizes[layer]
    freed = 0
    with store.lock.exclusive():
        # The rows first: extent maps relying on these copies stop holding
        # before the files go (a crash in between leaves files the sweep
        # removes as copies nobody records).
        with catalog.transaction() as db:
            catalog.drop_copies(db, chosen)
        for layer in chosen:
            freed += unlink(store.layer_path(layer))
            store.layers.forget(layer)
    return chosen, freed


def sweep_remote(store: StoreState, grace: float = SWEEP_GRACE) -> int:
    """Delete the objects no catalog row names, and abort the multipart
    uploads never completed (a push killed half-way leaves its parts stored,
    and billed, for good otherwise), of those at least ``grace`` seconds
    old; how many objects and uploads went.

    Ages are read from the object store's clock alone (what it says an
    object or upload was written at, against the time it gives in the
    answer listing it), so no host's clock, stepped or not, shortens the
    grace. Nor does correctness rest on it: an upload aborted while its
    push is still at it fails that push (a layer or map is recorded as
    uploaded only after its upload completes), which uploads it again next
    time; the grace spares that work, and the uploads in flight of rows
    being removed the chance to delete their own objects."""
    from blockdiff.store.remote import layer_key, map_key
    _require_shared(store)
    remote = store.remote

    def old(age: float | None) -> bool:
        return age is not None and age >= grace

    aborted = 0
    for upload in list(remote.uploads("")):
        if old(upload.age) and upload.key.startswith(("layers/", "maps/")):
            remote.abort(upload)
            aborted += 1
    listed = [info for info in remote.list("") if old(info.age)]
    # Read after the listing: a row committed before an object was listed
    # is seen here.
    snaps = store.catalog.all()
    keep = {layer_key(layer_name(x)) for x in store.catalog.layer_ids()}
    keep |= {map_key(map_name(s.id, s.map_sha256)) for s in snaps}
    # A removal or compaction uploads the map it rewrites whole for a
    # snapshot whose map is a delta before the row naming it commits
    # (upload_rewritten): every map object of such a snapshot is kept.
    rewritable = {s.id for s in snaps if s.map_base is not None}
    doomed = [info.key for info in listed if info.key not in keep and (
        info.key.startswith("layers/")
        or (info.key.startswith("maps/")
            and info.key[len("maps/"):].split(".", 1)[0] not in rewritable))]
    if doomed:
        remote.delete(doomed)
    return len(doomed) + aborted


@dataclass
class Uploaded:
    """What :func:`upload_rewritten` put in the object store, for the
    catalog switch to record."""

    maps: dict[int, int] = field(default_factory=dict)     # sizes, by snapshot seq
    layers: dict[int, int] = field(default_factory=dict)   # sizes, by layer


def upload_rewritten(store: StoreState, snaps: list[Snapshot], digests: dict[int, str],
                     layers: tuple[LayerRecord, ...] = ()) -> Uploaded:
    """Before the catalog switches ``snaps`` to maps rewritten for them
    (``digests`` by seq; a removal's dependents written whole, a compacted
    snapshot and its dependents): upload the new map of each one whose map is
    in the object store now, and with them the new layers those maps use
    (``layers``, records not in the catalog yet), so that none stops being
    durable at the switch. Nothing is uploaded in a store of one host.
    Raises ``RemoteError`` if the object store fails."""
    from blockdiff.store.remote import layer_key, map_key
    uploaded = Uploaded()
    if store.shared is None:
        return uploaded
    # Not durable before: it waits for a push, as it did.
    durable = [s for s in snaps if store.catalog.map_upload(s)[1] is not None]
    # Uploaded before any row names them (the other way round from a push):
    # sweep_remote keeps every map object of a snapshot whose map is a delta,
    # and deletes other objects no row names only after SWEEP_GRACE.
    for record in layers if durable else ():
        path = store.layer_path(record.layer)
        store.remote.put_file(layer_key(path.name), path, _checksums(DecodedLayer(record)))
        uploaded.layers[record.layer] = _size(path)
    for snap in durable:
        path = store.object_files.map_path(snap.id, digests[snap.seq])
        store.remote.put_file(map_key(path.name), path)
        uploaded.maps[snap.seq] = _size(path)
    return uploaded


def record_uploaded(store: StoreState, db, snaps: list[Snapshot], digests: dict[int, str],
                    uploaded: Uploaded) -> None:
    """Inside the switch that points ``snaps`` at their new maps: record what
    :func:`upload_rewritten` uploaded (after the rows naming it are in)."""
    for layer, size in uploaded.layers.items():
        store.catalog.mark_layer_uploaded(layer, size, db)
    for snap in snaps:
        if snap.seq in uploaded.maps:
            store.catalog.mark_map_uploaded(
                dataclasses.replace(snap, map_sha256=digests[snap.seq]),
                uploaded.maps[snap.seq], db)


def _checksums(table):
    from blockdiff.store.remote import ChunkChecksums
    return ChunkChecksums(table.run_pos, table.run_length, table.record.chunk, table.crc)


def forget_objects(store: StoreState, layers, maps: list[Snapshot]) -> None:
    """After their rows were removed: delete the objects of ``layers`` and of
    the maps ``maps`` named (best effort: what stays is swept later)."""
    from blockdiff.store.remote import layer_key, map_key
    keys = [layer_key(layer_name(x)) for x in layers]
    keys += [map_key(map_name(s.id, s.map_sha256)) for s in maps]
    if keys:
        # RemoteError too: the removal is done, and the exit status must say
        # so even when the object store cannot be reached.
        with contextlib.suppress(StoreError, RemoteError, OSError):
            store.remote.delete(keys)


class BackgroundPush:
    """Pushes in a thread of its own, for long-lived processes (a sandbox, an
    agent, the LangGraph saver), so that a checkpoint returns once it is
    committed locally and becomes durable a moment later. ``wait()`` blocks
    until what was asked for is pushed; the last failure is kept and raised
    by ``wait()``, and the next request retries."""

    def __init__(self, store: StoreState, retry: float = 1.0):
        self.store = store
        self.retry = retry
        self._wanted = 0
        self._done = 0
        self._failure: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="blockdiff-push", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Push soon (everything pending)."""
        with self._cond:
            self._wanted += 1
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every request made so far is pushed; False on timeout.
        Raises the failure of the last attempt if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._wanted
            while self._done < target:
                if self._failure is not None:
                    raise self._failure
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float = 30.0) -> None:
        """Finish what was asked (for up to ``timeout`` seconds) and stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._done >= self._wanted and not self._closed:
                    self._cond.wait()
                if self._done >= self._wanted and self._closed:
                    return
                target = self._wanted
            try:
                push(self.store)
            except BaseException as e:   # kept for wait(); retried on the next request
                with self._cond:
                    self._failure = e
                    self._cond.notify_all()
                    if self._closed:
                        return
                    self._cond.wait(self.retry)
                continue
            with self._cond:
                self._done = target
                self._failure = None
                self._cond.notify_all()


def _size(path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
