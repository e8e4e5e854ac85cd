"""The snapshot store: a tree of disk-image snapshots, each committed in time
proportional to what the step changed and restorable in time proportional to
what differs. See docs/store.md for the layout and the reasoning, and its
"Guarantees" section for what is protected against whom.

Each snapshot is a *layer*: a read-only data file holding the blocks its step
changed (reflinked from the image, so no data is copied) and a read-only map
file with (a) its piece table, saying for every byte of the image which
layer's data file holds it, and (b) the image's extent map at commit time,
whose physical addresses stay meaningful because the layers keep every block
they name alive. The catalog keeps a record of every layer file: the CRC32C
of each chunk of its data, checked before a restore hands bytes back.

``Store`` is the facade: it opens the store and hands each operation to the
module that holds it; what the operations share (the catalog, the store
lock, the object files, the maps and layers read through them) is its
``StoreState``:

    state        the shared state, and looking snapshots, maps and lineage up
    ids          snapshot ids and finding a snapshot by a prefix
    objects      the files of objects/ and staging/, and the store lock
    maps         the map codec, deltas, and reading maps through their chains
    layers       layer records, chunk checksums, and filling files from layers
    lineage      the image's lineage attribute and the image lock
    images       commit, restore, temporary images, comparing snapshots
    transfer     export and import
    compaction   compact
    removal      rm, gc and the sweep
    verify       verify
    retention    the retention policy (a pure function)
    catalog      the SQLite catalog
"""

from __future__ import annotations

import contextlib
import errno
import grp
import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from blockdiff.db.conninfo import public_url
from blockdiff.errors import (
    Damaged,
    DatabaseDamaged,
    RemoteError,
    StoreError,
    Unsupported,
    UsageError,
)
from blockdiff.progress import NO_PROGRESS, Progress
from blockdiff.store.catalog import Catalog, Snapshot
from blockdiff.store.ids import layer_number
from blockdiff.store.lineage import LINEAGE_XATTR
from blockdiff.store.objects import fsync_dir, unlink
from blockdiff.store.shared import (
    PASSFILE,
    REMOTE_SETTING,
    SHARED_FILE,
    SharedConfig,
    catalog_target,
    new_host_name,
    open_catalog,
    open_remote,
    read_config,
    refuse_options,
    write_passfile,
)
from blockdiff.store.state import StoreState

if TYPE_CHECKING:
    import numpy as np

    from blockdiff.engine import diff as engine
    from blockdiff.engine.extents import RangeSet
    from blockdiff.store import replication, verify
    from blockdiff.store.images import RestoreResult, Written
    from blockdiff.store.maps import MAP_CHAIN, MAP_ERRORS, SnapshotMap
    from blockdiff.store.removal import Removal
    from blockdiff.store.transfer import EXPORT_MAGIC, ImportResult, read_export_record

# Names other packages import from here.
# Not its errors: those are imported from blockdiff.errors.
__all__ = ["EXPORT_MAGIC", "LINEAGE_XATTR", "MAP_CHAIN", "MAP_ERRORS", "STORE_ENV",
           "ImportResult", "Removal", "RestoreResult", "SnapshotMap", "Store", "Written",
           "as_store", "open_store", "read_export_record"]

# Those of them that the operation modules have, imported from there when
# first asked for, as each operation imports its module when it runs: they
# load numpy and the native core, which opening a store and reading its
# catalog (log, and so every one-host command's start-up) do without.
_OPERATION_NAMES = {"EXPORT_MAGIC": "transfer", "ImportResult": "transfer",
                    "read_export_record": "transfer", "MAP_CHAIN": "maps",
                    "MAP_ERRORS": "maps", "SnapshotMap": "maps", "Removal": "removal",
                    "RestoreResult": "images", "Written": "images"}


def __getattr__(name: str):
    if name not in _OPERATION_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"blockdiff.store.{_OPERATION_NAMES[name]}")
    return getattr(module, name)


STORE_ENV = "BLOCKDIFF_STORE"


class Store(StoreState):
    """A snapshot store in a directory on a reflink filesystem."""

    def __init__(self, root: str | os.PathLike, *, freeing: bool = False):
        """Open the store at ``root``. ``freeing``: the caller is about to free
        space (rm, gc), so on a full disk the store's reserve may be used."""
        self.root = Path(root)
        path = self.root / "catalog.sqlite"
        shared = read_config(self.root)
        if shared is not None:
            self._open_shared(shared)
            return
        if not path.exists():
            raise StoreError(f"{self.root} is not a blockdiff store; "
                             f"make one with: blockdiff init {self.root}")
        repair = ("nothing was changed. Put back a copy of it, or move the store away and "
                  "import its exports into a new one")
        try:
            try:
                self.catalog = Catalog(str(path))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if not (freeing and unlink(self.root / "reserve")):
                    raise OSError(errno.ENOSPC, "No space left on device (blockdiff rm and gc "
                                  "can still free space in the store)", str(path)) from None
                self.catalog = Catalog(str(path))
        except DatabaseDamaged as e:
            raise DatabaseDamaged(f"{e}; {repair}") from None
        problems = self.catalog.store_problems()
        if problems:
            self.catalog.close()
            raise Damaged(f"{path} is damaged ({'; '.join(problems)}); {repair}")
        super().__init__(self.root, self.catalog)
        unrecorded = self.catalog.unrecorded_layers()
        if unrecorded:   # asked first: the layers' module loads numpy
            self.layers.adopt_unrecorded(self.lock, unrecorded)
        if not freeing:
            self.keep_reserve()

    def _open_shared(self, shared: SharedConfig) -> None:
        """Open a host's store joined to a shared catalog and object store."""
        catalog = open_catalog(shared.catalog, self.root)
        problems = catalog.store_problems()
        if problems:
            catalog.close()
            raise Damaged(f"the shared catalog {public_url(shared.catalog)} is damaged "
                          f"({'; '.join(problems)})")
        self.catalog = catalog
        super().__init__(self.root, catalog, shared)
        self.keep_reserve()

    @classmethod
    def init(cls, root: str | os.PathLike, *, allow_copy: bool = False,
             group: str | int | None = None, catalog: str | None = None,
             remote: str | None = None, cache_size: int | None = None) -> "Store":
        """Make a new, empty store in ``root`` (created if missing).

        The store is private to its owner; with ``group`` (a name or gid) that
        group may read it too. On a filesystem without reflink it refuses
        unless ``allow_copy``: then snapshots copy their data and commits
        compare contents, correct but slow (every commit reads the image and
        its parent in full).

        With ``catalog`` (a ``postgresql://`` URL, or a SQLite file for stores
        on one machine) and ``remote`` (``s3://BUCKET/PREFIX``), the store is
        this host's part of a store shared by several (blockdiff.store.shared):
        the first host makes the shared catalog, later ones join it (and may
        leave ``remote`` out: the catalog knows it). ``cache_size``: the bytes
        of layer copies the host keeps, the least recently used uploaded ones
        evicted after a restore or pull brings it over (None: no limit)."""
        if catalog is not None:
            return cls._init_shared(Path(root), catalog, remote, allow_copy=allow_copy,
                                    group=group, cache_size=cache_size)
        if remote is not None or cache_size is not None:
            raise UsageError(f"--{'remote' if remote is not None else 'cache-size'} is for a "
                             f"store shared by several hosts: give --catalog too")
        root = Path(root)
        gid = None
        if group is not None:
            try:
                gid = int(group) if str(group).isdigit() else grp.getgrnam(str(group)).gr_gid
            except KeyError:
                raise UsageError(f"no group {group!r} on this host") from None
        if (root / "catalog.sqlite").exists() or (root / SHARED_FILE).exists():
            raise StoreError(f"{root} is already a blockdiff store")
        dir_mode = 0o700 if gid is None else 0o2750
        with _made_or_undone(root, ("catalog.sqlite", "catalog.sqlite-wal",
                                    "catalog.sqlite-shm", "lock", "reserve")):
            root.mkdir(parents=True, exist_ok=True)
            if gid is not None:
                os.chown(root, -1, gid)
            os.chmod(root, dir_mode)
            mode = cls._probe_reflink(root, allow_copy)
            os.close(os.open(root / "lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC,
                             0o600 if gid is None else 0o640))
            for name in ("objects", "staging"):
                (root / name).mkdir(exist_ok=True)
                os.chmod(root / name, dir_mode)
            catalog = Catalog(str(root / "catalog.sqlite"), create=True,
                              mode=0o600 if gid is None else 0o640)
            try:
                catalog.set_setting("store_id", os.urandom(8).hex())
                catalog.set_setting("mode", mode)
                if gid is not None:
                    catalog.set_setting("group", str(gid))
            finally:
                catalog.close()
            fsync_dir(root)
        return cls(root)

    @classmethod
    def _init_shared(cls, root: Path, target: str, remote: str | None, *, allow_copy: bool,
                     group, cache_size: int | None) -> "Store":
        """Make ``root`` a host's store of the shared catalog at ``target``."""
        from blockdiff.store.remote import normal_url
        refuse_options(allow_copy=allow_copy, group=group)
        if (root / "catalog.sqlite").exists() or (root / SHARED_FILE).exists():
            raise StoreError(f"{root} is already a blockdiff store")
        # Refused before anything is made: a catalog URL that is not one, an
        # object store's URL that is not one, a bucket that is not there,
        # credentials it does not take.
        public, password = catalog_target(target)
        if remote is not None:
            remote = normal_url(remote)
            open_remote(remote).stat("layers/0000000000000000.layer")
        with _made_or_undone(root, (SHARED_FILE, PASSFILE, "lock", "reserve")):
            root.mkdir(parents=True, exist_ok=True)
            os.chmod(root, 0o700)
            cls._probe_reflink(root, False)
            os.close(os.open(root / "lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
            for name in ("objects", "staging"):
                (root / name).mkdir(exist_ok=True)
                os.chmod(root / name, 0o700)
            if password is not None:
                write_passfile(root, public, password)
            shared = open_catalog(public, root, create=True)
            try:
                host, name = os.urandom(8).hex(), new_host_name(root)
                with shared.transaction() as db:
                    settings = dict(db.execute("SELECT key, value FROM store").fetchall())
                    if not settings:
                        if remote is None:
                            raise UsageError("the first host of a shared store names its "
                                             "object store: pass --remote s3://BUCKET/PREFIX")
                        for key, value in (("store_id", os.urandom(8).hex()),
                                           ("mode", "reflink"), (REMOTE_SETTING, remote)):
                            db.execute("INSERT INTO store (key, value) VALUES (?, ?)",
                                       (key, value))
                    elif REMOTE_SETTING not in settings or settings.get("mode") != "reflink":
                        raise StoreError(f"{public} is the catalog of a store of one host, "
                                         f"not of a shared store")
                    elif remote is not None and settings[REMOTE_SETTING] != remote:
                        raise UsageError(f"the shared catalog's object store is "
                                         f"{settings[REMOTE_SETTING]}, not {remote}; "
                                         f"leave --remote out to join it")
                shared.join(host, name)
            finally:
                shared.close()
            SharedConfig(public, host, name, cache_size).write(root)
            fsync_dir(root)
        return cls(root)

    @staticmethod
    def _probe_reflink(root: Path, allow_copy: bool) -> str:
        """"reflink", or "copy" on a filesystem without it if ``allow_copy``."""
        from blockdiff import native
        from blockdiff.store.images import BLOCK

        probe = root / f".probe-{os.getpid()}"
        try:
            with open(probe, "w+b") as a, open(str(probe) + ".clone", "wb") as b:
                a.write(b"\0" * BLOCK)
                a.flush()
                native.clone_file(b.fileno(), a.fileno(), b.name)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY):
                raise
            if not allow_copy:
                raise Unsupported(f"{root} is on a filesystem without reflink; make the store "
                                  f"on XFS (mkfs.xfs -m reflink=1) or btrfs, or pass "
                                  f"--allow-copy to copy data instead (slow)") from None
            return "copy"
        finally:
            for p in (probe, Path(str(probe) + ".clone")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        return "reflink"

    def close(self) -> None:
        """Close the catalog (after the background pushes, if any, finish);
        the store is not used after."""
        pusher, self._pusher = getattr(self, "_pusher", None), None
        if pusher is not None:
            pusher.close()
        self.catalog.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- reading

    def resolve(self, snapshot_id: str) -> str:
        """The full id of the snapshot ``snapshot_id`` names (an id or a
        unique prefix of one, as for :meth:`get`)."""
        return self.get(snapshot_id).id

    def log(self, snapshot_id: str | None = None) -> list[Snapshot]:
        """The ancestry of a snapshot (or every snapshot), newest first."""
        if snapshot_id is None:
            return self.catalog.all()
        return self.catalog.ancestry(self.get(snapshot_id).id)

    def differences(self, a: Snapshot, b: Snapshot) -> RangeSet:
        """The ranges where snapshot ``b`` holds other bytes than ``a``."""
        from blockdiff.store import images

        return images.differences(self, a, b)

    def diff(self, a: str, b: str) -> RangeSet:
        """The ranges where snapshot ``b`` differs from snapshot ``a``."""
        return self.differences(self.get(a), self.get(b))

    def recently_written(self, snapshot_id: str, depth: int,
                         limit: int) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets, lengths)``, sorted, of the bytes of a snapshot that it
        or one of its ``depth - 1`` nearest ancestors wrote (held in their own
        layers, not inherited from further back), as far back as they add up
        to at most ``limit`` bytes: where the image was written lately, and
        so is likely to be written again."""
        import numpy as np

        snap = self.get(snapshot_id)
        pieces = self.load_map(snap).pieces
        recent, total = [], 0
        for s in self.catalog.ancestry(snap.id)[:depth]:
            layer = layer_number(s.id)
            total += int(pieces.length[pieces.layer == layer].sum())
            if total > limit:
                break
            recent.append(layer)
        mine = np.isin(pieces.layer, recent)
        return pieces.offset[mine], pieces.length[mine]

    # ------------------------------------------------------ commit, restore

    def commit(self, image: str | os.PathLike, *, parent: str | None = None, message: str = "",
               meta: dict | None = None, ttl: float | None = None,
               skip_unchanged: bool = False, written: Written | None = None,
               _imported: Snapshot | None = None, push: bool = True,
               progress: Progress = NO_PROGRESS) -> Snapshot:
        """Snapshot an image; returns the new snapshot (or its parent, when
        ``skip_unchanged`` and nothing changed). The image must not be written
        meanwhile (pause the VM). ``_imported`` keeps another store's id,
        time, message and metadata (used by ``import_``).

        ``written`` is ``(offsets, lengths)`` of every byte range written to
        the image since it was last committed or restored: what a dirty-block
        tracker such as QEMU's dirty bitmap reports. Only those ranges are
        then mapped, instead of the whole image, so the cost follows the step
        and not the image's fragmentation. The store trusts the ranges: they
        must cover every write. It maps the whole image anyway when the
        ranges cannot describe the change: the image's lineage is not a
        clean snapshot of this store, another parent is given, or its size
        changed.

        In a shared store the snapshot is uploaded before this returns, unless
        ``push`` is false (it is then pending until :meth:`push`) or pushes run
        in the background (:meth:`push_in_background`).

        ``progress`` (see blockdiff.progress) hears of the bytes checksummed."""
        from blockdiff.store import images

        snap = images.commit(self, image, parent=parent, message=message, meta=meta, ttl=ttl,
                             skip_unchanged=skip_unchanged, written=written,
                             imported=_imported, progress=progress)
        if push:
            self._push_committed(snap)
        return snap

    @contextlib.contextmanager
    def capturing(self, image: str | os.PathLike, *, parent: str | None = None,
                  written: Written | None = None, only_changed_pages: bool = False):
        """A commit in two halves, for an image that may change again before
        the snapshot is in the catalog: on entering the block, the image's
        changes are cloned into a staged layer (the part that needs the
        image to hold still, such as a paused VM's memory); the yielded
        capture's ``finish(message=, meta=, ttl=)`` commits them as
        :meth:`commit` would and returns the snapshot, which is of the image
        as it was on entering. Its ``unchanged`` says whether the image was
        its parent. Unfinished when the block ends, nothing is committed.

        ``only_changed_pages``: store only the 4 KiB pages whose bytes differ
        from the parent's, found by reading both when finishing; for images
        such as a VM's memory, whose changed extents hold many pages written
        back unchanged."""
        from blockdiff.store import images

        with images.capturing(self, image, parent=parent, written=written,
                              only_changed_pages=only_changed_pages) as capture:
            capture.on_commit = self._push_committed
            yield capture

    def _push_committed(self, snap: Snapshot) -> None:
        if self.shared is None:
            return
        try:
            self._pushed_after(snap.id)
        except RemoteError as e:
            raise RemoteError(f"snapshot {snap.id} is committed on this host but not "
                              f"uploaded: {e}; upload it with: blockdiff push --store "
                              f"{self.root}") from e

    # -------------------------------------------------- a shared store

    def _pushed_after(self, snapshot_id: str | None) -> None:
        """After an operation that wrote objects: push them now, or ask the
        background pusher to."""
        from blockdiff.store import replication

        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.request()
        else:
            replication.push(self, snapshot_id)

    def push(self, snapshot_id: str | None = None, *,
             progress: Progress = NO_PROGRESS) -> replication.PushResult:
        """Upload what this host wrote that the object store lacks (all of
        it, or what one snapshot needs)."""
        from blockdiff.store import replication

        return replication.push(self, snapshot_id, progress)

    def push_in_background(self) -> replication.BackgroundPush:
        """From now on commits return once committed here and are uploaded by
        a thread of this store's (see ``BackgroundPush``); what is pending
        already is pushed at once."""
        from blockdiff.store import replication

        if self.shared is None:
            raise StoreError(f"{self.root} is a store of one host: nothing to push")
        if getattr(self, "_pusher", None) is None:
            self._pusher = replication.BackgroundPush(self)
            self._pusher.request()
        return self._pusher

    def wait_pushed(self, timeout: float | None = None) -> bool:
        """Wait for the background pushes asked for so far (False on timeout);
        raises what made the last attempt fail."""
        pusher = getattr(self, "_pusher", None)
        return True if pusher is None else pusher.wait(timeout)

    def pull(self, snapshot_id: str) -> int:
        """Fetch what a snapshot needs onto this host; the bytes downloaded."""
        from blockdiff.store import replication

        fetched = replication.pull(self, snapshot_id)
        if fetched:
            self._keep_cache()
        return fetched

    def _keep_cache(self) -> None:
        """After a fetch: evict down to the host's cache size, if it has one."""
        from blockdiff.store import replication

        if self.shared is not None and self.shared.cache_size is not None:
            replication.evict(self, self.shared.cache_size)

    def placement(self) -> list[replication.Placement]:
        """Where every snapshot is, newest first: here or not, durable or not."""
        from blockdiff.store import replication

        return replication.placement(self)

    def placement_of(self, snapshot_id: str) -> replication.Placement:
        """Where one snapshot is: here or not, durable or not."""
        from blockdiff.store import replication

        return replication.placement_of(self, self.get(snapshot_id))

    def durable(self, snapshot_id: str) -> bool:
        """Whether a snapshot can be restored by any host (in a store of one
        host: False, there being no object store)."""
        return self.placement_of(snapshot_id).durable

    def evict(self, cache_size: int) -> tuple[list[int], int]:
        """Drop this host's least recently used uploaded layer copies until
        they take at most ``cache_size`` bytes; the layers and bytes freed."""
        from blockdiff.store import replication

        return replication.evict(self, cache_size)

    def sweep_remote(self, grace: float | None = None) -> int:
        """Delete the objects no snapshot uses and abort the uploads never
        completed, of those ``grace`` seconds old (by the object store's
        clock; None: ``SWEEP_GRACE``, an hour); how many went."""
        from blockdiff.store import replication

        return replication.sweep_remote(
            self, replication.SWEEP_GRACE if grace is None else grace)

    def share_file(self, key: str, path: str | os.PathLike) -> bool:
        """Keep a file every host of a shared store may need beside its
        snapshots (a VM's kernel) in the object store under ``key``, once:
        an object already there is left as it is. False for a store of one
        host, which has no object store."""
        if self.shared is None:
            return False
        self.remote.put_file(key, path)
        return True

    def fetch_shared_file(self, key: str, path: str | os.PathLike) -> bool:
        """Bring the file :meth:`share_file` kept under ``key`` into a new file
        at ``path``; False if there is none (or no object store)."""
        if self.shared is None:
            return False
        info = self.remote.stat(key)
        if info is None:
            return False
        self.remote.get_file(key, path, info.size)
        return True

    def wrap_catalog_lock(self, wrap) -> None:
        """Have every statement and transaction on the catalog take the lock
        ``wrap(lock)`` returns instead of the catalog connection's own
        ``lock`` (the spares worker takes a flock with it, so that it is
        never stopped holding the catalog)."""
        self.catalog.db.lock = wrap(self.catalog.db.lock)

    def restore(self, snapshot_id: str, image: str | os.PathLike, *,
                written: Written | None = None,
                progress: Progress = NO_PROGRESS) -> RestoreResult:
        """Make ``image`` byte-identical to a snapshot.

        An existing image is patched in place: only the ranges where it differs
        from the snapshot are rewritten. A new path becomes a fork, built from
        the snapshot's layers. Either way the data handed back is checked
        against its checksums first (``Damaged``, and nothing written, if it
        fails): every layer it uses that is not vouched for (see
        ``VOUCH_SECONDS``), whole for a fork or an image of no snapshot, and
        in place only the chunks holding what is rewritten.

        ``written`` is as for :meth:`commit`: every range written to the image
        since it was last committed or restored. With it, what differs is
        those ranges plus what differs between the two snapshots' maps, and
        the image is not mapped at all.

        ``progress`` hears of the layer bytes a fork (or a restore into an
        image of no snapshot) checks; an in-place restore reads only the
        little it rewrites.
        """
        from blockdiff.store import images

        result = images.restore(self, snapshot_id, image, written=written, progress=progress)
        if result.fetched_bytes:
            self._keep_cache()
        return result

    def unlike(self, snapshot_id: str, image: str | os.PathLike) -> int | None:
        """Bytes of ``image``, a copy of the snapshot nothing should write,
        that are not the snapshot's by their extents (one FIEMAP, no data
        read); None where this host cannot tell (no extent map of the
        snapshot holds here)."""
        from blockdiff.store import images

        return images.unlike(self, snapshot_id, image)

    # ------------------------------------------------------------ transfer

    def export(self, snapshot_id: str, out: str | os.PathLike, since: str | None = None, *,
               progress: Progress = NO_PROGRESS) -> engine.CreateResult:
        """Write one portable file from which another store recreates a snapshot:
        on its own, or on top of ``since``, an ancestor the other store has.
        ``progress`` hears of the layer bytes checked and the data written."""
        from blockdiff.store import transfer

        return transfer.export(self, snapshot_id, out, since, progress)

    def import_(self, path: str | os.PathLike, *,
                progress: Progress = NO_PROGRESS) -> ImportResult:
        """Recreate the snapshot an export file holds. The file is read and
        checked whole either way; a snapshot the store has already is skipped
        (``skipped`` says so), and an id this store once had and removed, or
        one naming an object it holds, is refused. ``progress`` hears of the
        bytes checked and checksummed."""
        from blockdiff.store import transfer

        return transfer.import_(self, path, progress)

    # --------------------------------------------------------- maintenance

    def compact(self, snapshot_id: str, *, progress: Progress = NO_PROGRESS) -> Snapshot:
        """Rewrite a snapshot's data into one new, physically contiguous layer.

        Its content and id stay the same; its piece table shrinks to one piece
        per data extent, so forks of it take a few clones instead of one per
        fragment. Images restored from it before compaction no longer share its
        blocks: their next commit stores them whole, so restore them from the
        snapshot again (see docs/store.md). ``progress`` hears of the bytes
        checked, copied and checksummed. In a shared store a durable snapshot
        stays durable: if that needs the object store and it fails,
        ``RemoteError`` and nothing is compacted.
        """
        from blockdiff.store import compaction

        # The new layer and maps of a durable snapshot (and of those built on
        # it) are uploaded before the switch (blockdiff.store.compaction); a
        # snapshot not uploaded yet waits for a push, as it did. No push
        # here: its failure would raise RemoteError for a compaction that
        # is done, and RemoteError from compact means nothing changed.
        return compaction.compact(self, snapshot_id, progress)

    def rm(self, snapshot_id: str) -> Removal:
        """Delete one snapshot, and the snapshots that are parts of it (see
        ``blockdiff.store.retention``); its descendants stay restorable byte
        for byte. In a shared store those that are durable stay durable: if
        that needs the object store and it fails, ``RemoteError`` and the
        snapshot is not removed."""
        # The maps rewritten whole that must be durable are uploaded before
        # the switch (blockdiff.store.removal); the others wait for a push,
        # as they did before.
        from blockdiff.store import removal

        return removal.rm(self, snapshot_id)

    def gc(self, policy, *, now: float | None = None, dry_run: bool = False) -> Removal:
        """Remove expired snapshots and those the policy does not keep, then
        sweep files no snapshot uses (left by interrupted operations)."""
        from blockdiff.store import removal

        return removal.gc(self, policy, now=now, dry_run=dry_run)

    def verify(self, snapshot_id: str | None = None, *,
               progress: Progress = NO_PROGRESS) -> dict[str, list[str]]:
        """Problems found, by snapshot id ("catalog" for the catalog itself).

        Checks the catalog's integrity and that it accounts for every layer a
        snapshot uses; every map against its digest and the catalog's size;
        that snapshot files exist and are read-only; and every chunk of every
        layer a snapshot uses against its CRC32C. Damage in a layer is
        reported for every snapshot whose bytes it holds. Layers found whole
        are vouched for (see ``VOUCH_SECONDS``). ``progress`` hears of the
        layer bytes read.
        """
        from blockdiff.store import verify

        return verify.verify(self, snapshot_id, progress)

    def repair(self, snapshot_id: str | None = None, *,
               progress: Progress = NO_PROGRESS) -> verify.Repair:
        """Verify (see :meth:`verify`), and in a shared store replace each
        of this host's map and layer copies found damaged by the object
        store's, checked against the catalog first; then verify again what
        was replaced. Returns the files fetched again and the problems that
        remain."""
        from blockdiff.store import verify

        return verify.repair(self, snapshot_id, progress)


@contextlib.contextmanager
def _made_or_undone(root: Path, files: tuple[str, ...]):
    """Around making a store in ``root``: if the block fails, remove what it
    made (``files`` in root, its objects/ and staging/, and root and the
    parents that were not there), so a failed init leaves nothing behind."""
    made = [] if root.exists() else [root]
    for parent in list(root.parents):
        if parent.exists():
            break
        made.insert(0, parent)
    try:
        yield
    except BaseException:
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                (root / name).unlink()
        for name in ("objects", "staging"):
            with contextlib.suppress(OSError):
                (root / name).rmdir()
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise


def open_store(path: str | os.PathLike | None, *, freeing: bool = False) -> Store:
    """The store at ``path``, or at $BLOCKDIFF_STORE (``freeing``: see ``Store``)."""
    path = path or os.environ.get(STORE_ENV)
    if not path:
        raise UsageError(f"no store given; pass --store DIR or set {STORE_ENV}")
    return Store(path, freeing=freeing)


def as_store(store: Store | str | os.PathLike | None) -> Store:
    """``store`` itself if it is an open :class:`Store`, else the store at that
    path (or at $BLOCKDIFF_STORE), opened."""
    return store if isinstance(store, Store) else open_store(store)
