"""The snapshot store: a tree of disk-image snapshots, each committed in time
proportional to what the step changed and restorable in time proportional to
what differs. See docs/store.md for the layout and the reasoning.

Each snapshot is a *layer*: a read-only data file holding the blocks its step
changed (reflinked from the image, so no data is copied) and a read-only map
file with (a) its piece table, saying for every byte of the image which
layer's data file holds it, and (b) the image's extent map at commit time,
whose physical addresses stay meaningful because the layers keep every block
they name alive. Committing compares the image's extent map with the
parent's; restoring compares it with the target snapshot's and clones only
the ranges that differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import os
import sqlite3
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockdiff import engine, native
from blockdiff import format as fmt
from blockdiff.catalog import Catalog, Snapshot
from blockdiff.errors import BlockdiffError, InvalidDiff, Unsupported, UsageError
from blockdiff.extents import (
    DATA,
    ZERO,
    ExtentMap,
    PieceTable,
    changed_ranges,
    coalesce,
    normalize_ranges,
    overlay,
    partition,
    pieces_within,
    remap,
    splice_pieces,
    union,
)
from blockdiff.scratch import process_alive

BLOCK = 4096
LINEAGE_XATTR = "user.blockdiff.lineage"
EXPORT_MAGIC = b"BDEXPRT1"
STORE_ENV = "BLOCKDIFF_STORE"
MAP_CACHE = 4   # decoded maps kept per Store: the last commit's is the next one's parent
# A commit stores its map as a delta on its parent's, whole at least every
# MAP_CHAIN commits down a line: maps then take space in proportion to the
# steps, not to the image's extents times the steps, and reading one reads
# at most MAP_CHAIN files.
MAP_CHAIN = 8


class StoreError(BlockdiffError):
    """A store operation that cannot be done as asked."""

    exit_code = 6


class UnknownSnapshot(StoreError):
    """No snapshot with that id in this store."""


class ImageBusy(StoreError):
    """Another process is committing or restoring this image."""


@dataclass
class SnapshotMap:
    """What a snapshot's map file holds."""

    pieces: PieceTable
    extents: ExtentMap        # the image's extent map when it was committed
    own_pos: np.ndarray       # this layer's DATA ranges: where in its data file,
    own_length: np.ndarray    # how long,
    own_crc: np.ndarray       # and their CRC32C
    own_layer: int = 0        # the layer those ranges are in (the snapshot's own, or
                              # the one compaction wrote)
    chain: int = 0            # maps between this one and one stored whole (0: whole)


@dataclass(frozen=True)
class MapDelta:
    """A map stored as a delta: inside the intervals ``[starts, ends)`` its
    pieces and extents are its own, outside them those of ``base``'s map."""

    base: str                 # the snapshot whose map this one builds on
    starts: np.ndarray
    ends: np.ndarray


@dataclass
class RestoreResult:
    """What ``Store.restore`` did."""

    snapshot: str
    image: str
    ranges: int          # ranges of the image rewritten
    bytes: int
    forked: bool         # a new image rather than one restored in place
    tracked: bool = False  # the differences came from written ranges, not an extent map


# ``(offsets, lengths)`` of the byte ranges written to an image.
Written = tuple[np.ndarray, np.ndarray]


def _layer_number(snapshot_id: str) -> int:
    return int(snapshot_id, 16)


def _new_id() -> str:
    # 63 random bits: a positive int64 names the layer inside piece tables.
    return f"{int.from_bytes(os.urandom(8), 'big') >> 1:016x}"


def _encode_map(m: SnapshotMap, delta: MapDelta | None = None) -> bytes:
    """A map file: the whole map, or with ``delta`` only its parts inside the
    delta's intervals."""
    pieces, extents, extra = m.pieces, m.extents, {}
    if delta is not None:
        pieces, _ = pieces_within(m.pieces, delta.starts, delta.ends)
        inside, _ = partition(m.extents, delta.starts, delta.ends)
        extents = ExtentMap(*inside, size=m.extents.size)
        extra = {"base": np.array(delta.base), "d_start": delta.starts, "d_end": delta.ends}
    buf = io.BytesIO()
    np.savez(buf, size=np.uint64(pieces.size), p_offset=pieces.offset,
             p_length=pieces.length, p_layer=pieces.layer, p_pos=pieces.pos,
             e_logical=extents.logical, e_physical=extents.physical,
             e_length=extents.length, e_flags=extents.flags, e_size=np.uint64(extents.size),
             own_pos=m.own_pos, own_length=m.own_length, own_crc=m.own_crc,
             own_layer=np.int64(m.own_layer), chain=np.int64(m.chain), **extra)
    return buf.getvalue()


def _decode_map(raw: bytes) -> tuple[SnapshotMap, MapDelta | None]:
    """A map file's contents: for a delta, only its own parts, and the delta."""
    z = np.load(io.BytesIO(raw))
    pieces = PieceTable(z["p_offset"], z["p_length"], z["p_layer"], z["p_pos"], int(z["size"]))
    extents = ExtentMap(z["e_logical"], z["e_physical"], z["e_length"], z["e_flags"],
                        int(z["e_size"]))
    chain = int(z["chain"]) if "chain" in z.files else 0   # maps before deltas: whole
    smap = SnapshotMap(pieces, extents, z["own_pos"], z["own_length"], z["own_crc"],
                       int(z["own_layer"]), chain)
    delta = None
    if "base" in z.files:
        delta = MapDelta(str(z["base"]), z["d_start"], z["d_end"])
    return smap, delta


def _delta_on(parent: str, parent_map: SnapshotMap, changes, size: int) -> MapDelta:
    """Where a child's map differs from its parent's: the changed ranges,
    and the bytes between the two sizes. Elsewhere the pieces are the
    parent's, and so are the extents, as far as comparing them goes (the same
    addresses where there is data)."""
    starts, ends = changes.offset, changes.offset + changes.length
    psize = parent_map.pieces.size
    if psize != size:
        starts = np.append(starts, np.uint64(min(psize, size)))
        ends = np.append(ends, np.uint64(max(psize, size)))
    return MapDelta(parent, *union(starts, ends))


def _compare_with_file(fd: int, path: str, base: Path | None):
    """Ranges where an open file differs from the file ``base`` (None: from
    nothing), found by reading both."""
    if base is None:
        return engine.compare_contents(fd, path, None)
    with open(base, "rb") as b:
        return engine.compare_contents(fd, path, b.fileno())


def _write_readonly(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Removal:
    """What ``Store.rm`` or ``Store.gc`` removed."""

    removed: list[str]
    bytes_freed: int     # allocated in the removed files; blocks shared with a
                         # live image are not freed on disk until it lets go
    reasons: dict


def _allocated(path: Path) -> int:
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _unlink(path: Path) -> int:
    """Remove a file; the bytes it held (shared blocks count in full)."""
    size = _allocated(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
        return size
    return 0


class Store:
    """A snapshot store in a directory on a reflink filesystem."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if not (self.root / "catalog.sqlite").exists():
            raise StoreError(f"{self.root} is not a blockdiff store; "
                             f"make one with: blockdiff init {self.root}")
        self.objects = self.root / "objects"
        self.staging = self.root / "staging"
        self.catalog = Catalog(str(self.root / "catalog.sqlite"))
        self.id = self.catalog.setting("store_id")
        # Without reflink the store copies data and compares contents.
        self.copy_mode = self.catalog.setting("mode") == "copy"
        # Maps are named by their digest and never change, so a decoded map
        # can be reused for as long as the store is open.
        self._maps: dict[str, SnapshotMap] = {}
        self._maps_lock = threading.Lock()

    @classmethod
    def init(cls, root: str | os.PathLike, *, allow_copy: bool = False) -> "Store":
        """Make a new, empty store in ``root`` (created if missing).

        On a filesystem without reflink it refuses unless ``allow_copy``: then
        snapshots copy their data and commits compare contents, correct but
        slow (every commit reads the image and its parent in full)."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        if (root / "catalog.sqlite").exists():
            raise StoreError(f"{root} is already a blockdiff store")
        probe = root / f".probe-{os.getpid()}"
        mode = "reflink"
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
            mode = "copy"
        finally:
            for p in (probe, Path(str(probe) + ".clone")):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        (root / "objects").mkdir(exist_ok=True)
        (root / "staging").mkdir(exist_ok=True)
        catalog = Catalog(str(root / "catalog.sqlite"))
        catalog.set_setting("store_id", os.urandom(8).hex())
        catalog.set_setting("mode", mode)
        catalog.close()
        _fsync_dir(root)
        return cls(root)

    def close(self) -> None:
        self.catalog.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------- reading

    def get(self, snapshot_id: str) -> Snapshot:
        """The catalog entry of a snapshot; ``UnknownSnapshot`` if none."""
        snap = self.catalog.get(snapshot_id)
        if snap is None:
            raise UnknownSnapshot(f"no snapshot {snapshot_id!r} in the store {self.root}; "
                                  f"list them with: blockdiff log --store {self.root}")
        return snap

    def map_path(self, snap: Snapshot) -> Path:
        """Where a snapshot's map is: named by its digest, so a rewritten map
        (compaction) never replaces the old one under the same name."""
        return self.objects / f"{snap.id}.{snap.map_sha256[:16]}.map"

    def load_map(self, snap: Snapshot, *, cached: bool = True) -> SnapshotMap:
        """A snapshot's map, checked against the digest the catalog recorded
        (when it is read: ``cached=False`` reads it even if it was read before)."""
        if cached:
            with self._maps_lock:
                known = self._maps.get(snap.map_sha256)
            if known is not None:
                return known
        damaged = StoreError(f"the map of snapshot {snap.id} is damaged; "
                             f"run: blockdiff verify --store {self.root}")
        raw = self.map_path(snap).read_bytes()
        if hashlib.sha256(raw).hexdigest() != snap.map_sha256:
            raise damaged
        smap, delta = _decode_map(raw)
        if delta is not None:
            if delta.base != snap.map_base:
                raise damaged
            base = self.load_map(self.get(delta.base), cached=cached)
            own = smap
            extents, _ = remap(base.extents, delta.starts, delta.ends,
                               (own.extents.logical, own.extents.physical, own.extents.length,
                                own.extents.flags), size=own.extents.size)
            smap = dataclasses.replace(
                own, pieces=splice_pieces(base.pieces, delta.starts, delta.ends, own.pieces),
                extents=extents)
        self._remember_map(snap.map_sha256, smap)
        return smap

    def _remember_map(self, digest: str, smap: SnapshotMap) -> None:
        with self._maps_lock:
            self._maps[digest] = smap
            while len(self._maps) > MAP_CACHE:
                del self._maps[next(iter(self._maps))]

    def log(self, snapshot_id: str | None = None) -> list[Snapshot]:
        """The ancestry of a snapshot (or every snapshot), newest first."""
        if snapshot_id is None:
            return self.catalog.all()
        self.get(snapshot_id)
        return self.catalog.ancestry(snapshot_id)

    def _lineage_record(self, image: str | os.PathLike) -> dict | None:
        try:
            raw = os.getxattr(image, LINEAGE_XATTR)
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.ENOENT):
                return None
            raise
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        if record.get("store") != self.id or self.catalog.get(record.get("snapshot", "")) is None:
            return None   # another store's image, or a foreign one
        return record

    def lineage(self, image: str | os.PathLike) -> tuple[str | None, str]:
        """``(snapshot id, state)`` an image records for this store, else ``(None, "")``."""
        record = self._lineage_record(image)
        if record is None:
            return None, ""
        return record["snapshot"], record.get("state", "")

    def lineage_mark(self, image: str | os.PathLike) -> str | None:
        """A token that changes with every commit or restore of the image
        (None if it has no lineage here): a dirty-block tracker reset right
        after one of them can tell that no other came between."""
        record = self._lineage_record(image)
        return None if record is None else record.get("mark")

    def _set_lineage(self, fd: int, snapshot_id: str, state: str) -> None:
        os.setxattr(fd, LINEAGE_XATTR, json.dumps(
            {"store": self.id, "snapshot": snapshot_id, "state": state,
             "mark": os.urandom(8).hex()}).encode())

    # ------------------------------------------------------------- commit

    @contextlib.contextmanager
    def _locked(self, path: str, flags: int):
        fd = os.open(path, flags | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ImageBusy(f"{path} is being committed or restored by another process; "
                                f"wait for it and retry") from None
            yield fd
        finally:
            os.close(fd)

    def commit(self, image: str | os.PathLike, *, parent: str | None = None, message: str = "",
               meta: dict | None = None, ttl: float | None = None,
               skip_unchanged: bool = False, written: Written | None = None,
               _imported: Snapshot | None = None) -> Snapshot:
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
        changed."""
        image = os.fspath(image)
        with self._locked(image, os.O_RDONLY) as fd:
            known, state = self.lineage(image)
            if state == "restoring":
                raise StoreError(f"{image} was being restored when that was interrupted; "
                                 f"finish with: blockdiff restore --store {self.root} {known} "
                                 f"{image}")
            parent = parent if parent is not None else known
            parent_snap = None if parent is None else self.get(parent)
            parent_map = None if parent_snap is None else self.load_map(parent_snap)

            native.fsync(fd, image)
            size = os.fstat(fd).st_size
            if self.copy_mode:
                emap = ExtentMap.from_arrays([], [], [], [], size)
                with self._materialized(parent_snap) as parent_copy:
                    changes = _compare_with_file(fd, image, parent_copy)
            else:
                if native.fs_info(fd, image)[2] != os.stat(self.objects).st_dev:
                    raise Unsupported(f"{image} is not on the store's filesystem; keep images "
                                      f"beside the store ({self.root}) so snapshots are "
                                      f"reflinks")
                if (written is not None and parent_snap is not None and parent == known
                        and state == "clean" and size == parent_snap.size):
                    starts, ends = normalize_ranges(*written, size, BLOCK)
                    fresh = native.fiemap_ranges(fd, starts, ends, image)  # fsynced above
                    emap, (now, before) = remap(parent_map.extents, starts, ends, fresh)
                    now.check_supported(image)
                    changes = changed_ranges(now, before, BLOCK)
                else:
                    emap = ExtentMap.of_file(fd, image, sync=False)  # fsynced above
                    emap.check_supported(image)
                    changes = changed_ranges(
                        emap, None if parent_map is None else parent_map.extents, BLOCK)
            if (skip_unchanged and parent_snap is not None and len(changes) == 0
                    and emap.size == parent_snap.size):
                return parent_snap

            snap_id = _imported.id if _imported else _new_id()
            data_pos = fmt.layout_data(changes, version=2)
            is_data = changes.kind == DATA
            layer_tmp = self.staging / f"{snap_id}.{os.getpid()}.layer"
            map_tmp = self.staging / f"{snap_id}.{os.getpid()}.map"
            try:
                out = os.open(layer_tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
                try:
                    crcs, _ = native.transfer_ranges(
                        fd, out, changes.offset[is_data], data_pos[is_data],
                        changes.length[is_data], layer_tmp, checksums=True)
                    native.fsync(out, layer_tmp)
                finally:
                    os.close(out)
                pieces = overlay(None if parent_map is None else parent_map.pieces, changes,
                                 data_pos, _layer_number(snap_id), emap.size)
                smap = SnapshotMap(pieces, emap, data_pos[is_data], changes.length[is_data],
                                   crcs, _layer_number(snap_id))
                delta = None
                if parent_map is not None and parent_map.chain + 1 < MAP_CHAIN:
                    delta = _delta_on(parent, parent_map, changes, emap.size)
                    smap.chain = parent_map.chain + 1
                raw = _encode_map(smap, delta)
                _write_readonly(map_tmp, raw)
                digest = hashlib.sha256(raw).hexdigest()
                os.rename(layer_tmp, self.objects / f"{snap_id}.layer")
                os.rename(map_tmp, self.objects / f"{snap_id}.{digest[:16]}.map")
                _fsync_dir(self.objects)
                snap = Snapshot(0, snap_id, parent, time.time(), message, meta or {},
                                emap.size, changes.bytes_of(DATA) + changes.bytes_of(ZERO),
                                len(changes), None if ttl is None else time.time() + ttl,
                                digest, None if delta is None else parent)
                if _imported:
                    snap.created, snap.message = _imported.created, _imported.message
                    snap.meta, snap.expires = _imported.meta, _imported.expires
                try:
                    with self.catalog.transaction() as db:
                        snap.seq = self.catalog.add(db, snap, np.unique(pieces.layer))
                except sqlite3.IntegrityError as e:   # the parent was removed meanwhile
                    raise StoreError(f"cannot commit {image}: {e}; commit it again") from None
            except BaseException:
                for p in (layer_tmp, map_tmp):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                raise
            self._set_lineage(fd, snap_id, "clean")
            self._remember_map(digest, smap)
            return snap

    # ------------------------------------------------------------ restore

    def _fill(self, out_fd: int, out_path: str, pieces: PieceTable, *, copy: bool = False) -> None:
        """Write pieces into a file at their offsets, one native call per layer:
        reflinked, or with ``copy`` copied through memory (checksumming forces
        that; copy_file_range would reflink within one filesystem)."""
        # Grouped by one stable sort, not one mask per layer: a deep line has
        # thousands of layers and a fragmented image many pieces.
        if len(pieces) == 0:
            return
        order = np.argsort(pieces.layer, kind="stable")
        layers = pieces.layer[order]
        starts = np.flatnonzero(np.concatenate(([True], layers[1:] != layers[:-1])))
        for first, last in zip(starts, np.append(starts[1:], len(order))):
            sel = order[first:last]
            with open(self.objects / f"{int(layers[first]):016x}.layer", "rb") as f:
                native.transfer_ranges(f.fileno(), out_fd, pieces.pos[sel], pieces.offset[sel],
                                       pieces.length[sel], out_path, reflink=not copy,
                                       checksums=copy)

    def restore(self, snapshot_id: str, image: str | os.PathLike, *,
                written: Written | None = None) -> RestoreResult:
        """Make ``image`` byte-identical to a snapshot.

        An existing image is patched in place: only the ranges where it differs
        from the snapshot are rewritten. A new path becomes a fork, built from
        the snapshot's layers.

        ``written`` is as for :meth:`commit`: every range written to the image
        since it was last committed or restored. With it, what differs is
        those ranges plus what differs between the two snapshots' maps, and
        the image is not mapped at all.
        """
        image = os.fspath(image)
        snap = self.get(snapshot_id)
        smap = self.load_map(snap)
        # Physical addresses compare only within one filesystem (and mean
        # nothing without reflink): such an image is rebuilt whole and renamed
        # over, never patched.
        elsewhere = os.path.exists(image) and (
            self.copy_mode or os.stat(image).st_dev != os.stat(self.objects).st_dev)
        if not os.path.exists(image) or elsewhere:
            with engine.atomic_output(image) as (fd, temp):
                native.truncate(fd, snap.size, temp)
                self._fill(fd, temp, smap.pieces)
                self._set_lineage(fd, snap.id, "clean")
            return RestoreResult(snap.id, image, len(smap.pieces),
                                 int(smap.pieces.length.sum()), forked=True)
        with self._locked(image, os.O_RDWR) as fd:
            known, state = self.lineage(image)
            size = os.fstat(fd).st_size
            from_snap = self.get(known) if known is not None else None
            tracked = (written is not None and from_snap is not None and state == "clean"
                       and from_snap.size == size == snap.size)
            # Marked first: a crash half-way leaves an image commit refuses.
            self._set_lineage(fd, snap.id, "restoring")
            if tracked:
                # The image is its lineage snapshot except where it was written.
                between = changed_ranges(smap.extents, self.load_map(from_snap).extents, BLOCK)
                starts, ends = normalize_ranges(*written, size, BLOCK)
                starts, ends = union(np.concatenate((between.offset, starts)),
                                     np.concatenate((between.offset + between.length, ends)))
                ends = np.minimum(ends, np.uint64(size))   # never past the end of the file
            else:
                native.fsync(fd, image)
                current = ExtentMap.of_file(fd, image, sync=False)  # fsynced above
                differ = changed_ranges(smap.extents, current, BLOCK)
                native.truncate(fd, snap.size, image)
                starts, ends = differ.offset, differ.offset + differ.length
            # Within the ranges that differ, the snapshot's pieces are cloned
            # in and the rest, its zeros, punched.
            pieces, (hole_start, hole_end) = pieces_within(smap.pieces, starts, ends)
            self._fill(fd, image, pieces)
            native.zero_ranges(fd, hole_start, hole_end - hole_start, image)
            native.fsync(fd, image)
            self._set_lineage(fd, snap.id, "clean")
        return RestoreResult(snap.id, image, len(starts), int((ends - starts).sum()),
                             forked=False, tracked=tracked)

    @contextlib.contextmanager
    def _materialized(self, snap: Snapshot | None):
        """A temporary full image of a snapshot in the staging area (None: no file)."""
        if snap is None:
            yield None
            return
        path = self.staging / f"{snap.id}.{os.getpid()}.{os.urandom(4).hex()}.img"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                native.truncate(fd, snap.size, path)
                self._fill(fd, str(path), self.load_map(snap).pieces)
            finally:
                os.close(fd)
            yield path
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def export(self, snapshot_id: str, out: str | os.PathLike,
               since: str | None = None) -> engine.CreateResult:
        """Write one portable file from which another store recreates a snapshot:
        on its own, or on top of ``since``, an ancestor the other store has."""
        snap = self.get(snapshot_id)
        base = None
        if since is not None:
            base = self.get(since)
            if since not in {s.id for s in self.catalog.ancestry(snapshot_id)}:
                raise UsageError(f"{since} is not an ancestor of {snapshot_id}; "
                                 f"see: blockdiff log --store {self.root} {snapshot_id}")
        record = {"format": "blockdiff-export", "version": 1, "store": self.id,
                  "base": since, "snapshot": {"id": snap.id, "created": snap.created,
                                              "message": snap.message, "meta": snap.meta,
                                              "expires": snap.expires}}
        trailer = json.dumps(record, sort_keys=True).encode()
        trailer += struct.pack("<Q", len(trailer)) + EXPORT_MAGIC
        out = os.fspath(out)
        # The diff is written to a temporary name beside OUT and renamed only
        # once the record is on it: OUT is a whole export or nothing.
        temp = os.path.join(os.path.dirname(os.path.abspath(out)),
                            f".{os.path.basename(out)}.{os.urandom(6).hex()}.partial")
        with self._materialized(snap) as target, self._materialized(base) as base_path:
            try:
                result = engine.create_diff(temp, target, base_path,
                                            target_id=bytes.fromhex(snap.id) + bytes(8))
                with open(temp, "ab") as f:
                    f.write(trailer)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(temp, out)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise
        return result

    def import_(self, path: str | os.PathLike) -> list[str]:
        """Recreate the snapshot an export file holds; returns its id."""
        path = os.fspath(path)
        record = read_export_record(path)
        info = record["snapshot"]
        if self.catalog.get(info["id"]) is not None:
            return [info["id"]]       # already here: importing twice changes nothing
        base = None
        if record["base"] is not None:
            base = self.catalog.get(record["base"])
            if base is None:
                raise StoreError(f"{path} builds on snapshot {record['base']}, which this "
                                 f"store does not have; import that first")
        imported = Snapshot(0, info["id"], None, info.get("created") or time.time(),
                            info.get("message") or "", info.get("meta") or {},
                            expires=info.get("expires"))
        target = self.staging / f"{info['id']}.{os.getpid()}.import.img"
        with self._materialized(base) as base_path:
            try:
                engine.apply_diff(path, target, base_path)
                snap = self.commit(target, parent=None if base is None else base.id,
                                   _imported=imported)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    target.unlink()
        return [snap.id]

    def compact(self, snapshot_id: str) -> Snapshot:
        """Rewrite a snapshot's data into one new, physically contiguous layer.

        Its content and id stay the same; its piece table shrinks to one piece
        per data extent, so forks of it take a few clones instead of one per
        fragment. Images restored from it before compaction no longer share its
        blocks: their next commit stores them whole, so restore them from the
        snapshot again (see docs/store.md).
        """
        snap = self.get(snapshot_id)
        smap = self.load_map(snap)
        layer = int(_new_id(), 16)
        layer_path = self.objects / f"{layer:016x}.layer"
        staged = self.staging / f"{layer:016x}.{os.getpid()}.layer"
        map_tmp = self.staging / f"{snap.id}.{os.getpid()}.compact.map"
        new_map_path = None
        try:
            fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
            try:
                # The layer is the image itself (position = offset), its data
                # copied, not reflinked, so the filesystem lays it out afresh.
                native.truncate(fd, snap.size, staged)
                pieces = smap.pieces
                self._fill(fd, str(staged), pieces, copy=True)
                native.fsync(fd, staged)
                compacted = PieceTable(*coalesce(pieces.offset, pieces.length,
                                                 np.full(len(pieces), layer, np.int64),
                                                 pieces.offset.copy()), size=snap.size)
                crc, _ = native.transfer_ranges(fd, -1, compacted.pos, None, compacted.length,
                                                staged, checksums=True)
                extents = ExtentMap.of_file(fd, staged, sync=False)  # fsynced above
            finally:
                os.close(fd)
            raw = _encode_map(SnapshotMap(compacted, extents, compacted.pos, compacted.length,
                                          crc, layer))
            digest = hashlib.sha256(raw).hexdigest()
            _write_readonly(map_tmp, raw)
            os.rename(staged, layer_path)
            new_map_path = self.objects / f"{snap.id}.{digest[:16]}.map"
            os.rename(map_tmp, new_map_path)
            _fsync_dir(self.objects)
            old_map = self.map_path(snap)
            # Maps that are deltas on the old one are written whole first.
            dependents, digests = self._whole_maps_of_dependents(snap)
            with self.catalog.transaction() as db:
                self._point_dependents_at_whole_maps(db, snap, digests)
                unused = self.catalog.replace_map(db, snap, digest, [layer])
        except BaseException:
            for p in (staged, map_tmp, layer_path, new_map_path):
                if p is not None:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
            raise
        _unlink(old_map)
        for dep in dependents:
            _unlink(self.map_path(dep))
        for old in unused:
            _unlink(self.objects / f"{old:016x}.layer")
        return self.get(snapshot_id)

    def rm(self, snapshot_id: str) -> Removal:
        """Delete one snapshot; its descendants stay restorable byte for byte."""
        return self._remove([self.get(snapshot_id)], {snapshot_id: "asked"})

    def _whole_maps_of_dependents(self, snap: Snapshot) -> tuple[list[Snapshot], dict[int, str]]:
        """Before ``snap``'s map goes or changes: the maps that are deltas on
        it, written whole (not yet in the catalog). Returns those snapshots
        and, by seq, the digests of their new maps."""
        dependents = self.catalog.map_dependents(snap.id)
        digests = {}
        for dep in dependents:
            smap = dataclasses.replace(self.load_map(dep), chain=0)
            raw = _encode_map(smap)
            digest = hashlib.sha256(raw).hexdigest()
            staged = self.staging / f"{dep.id}.{os.getpid()}.whole.map"
            try:
                _write_readonly(staged, raw)
                os.rename(staged, self.objects / f"{dep.id}.{digest[:16]}.map")
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    staged.unlink()
                raise
            digests[dep.seq] = digest
            self._remember_map(digest, smap)
        if digests:
            _fsync_dir(self.objects)
        return dependents, digests

    def _point_dependents_at_whole_maps(self, db, snap: Snapshot, digests: dict[int, str]):
        """Inside the transaction that removes or rewrites ``snap``'s map."""
        now = {dep.seq for dep in self.catalog.map_dependents(snap.id, db)}
        if now != set(digests):
            raise StoreError(f"a snapshot was committed on {snap.id} meanwhile; try again")
        self.catalog.set_full_maps(db, digests)

    def _remove(self, snaps, reasons) -> Removal:
        freed = 0
        for snap in snaps:
            dependents, digests = self._whole_maps_of_dependents(snap)
            with self.catalog.transaction() as db:
                self._point_dependents_at_whole_maps(db, snap, digests)
                unused = self.catalog.remove(db, snap)
            # Files go after the catalog commit: a crash in between leaves
            # only unreferenced files, which gc sweeps.
            for dep in dependents:
                freed += _unlink(self.map_path(dep))
            freed += _unlink(self.map_path(snap))
            # Its own layer may hold no piece at all (a step that changed nothing).
            in_use = self.catalog.layers_in_use()
            for layer in set(unused) | {_layer_number(snap.id)}:
                if layer not in in_use:
                    freed += _unlink(self.objects / f"{layer:016x}.layer")
        return Removal([s.id for s in snaps], freed, reasons)

    def gc(self, policy, *, now: float | None = None, dry_run: bool = False) -> Removal:
        """Remove expired snapshots and those the policy does not keep, then
        sweep files no snapshot uses (left by interrupted operations)."""
        from blockdiff.retention import apply_policy

        _, remove, reasons = apply_policy(self.catalog.all(), policy,
                                          time.time() if now is None else now)
        reasons = {s.id: reasons[s.id] for s in remove}
        if dry_run:
            return Removal([s.id for s in remove], 0, reasons)
        result = self._remove(remove, reasons)
        result.bytes_freed += self._sweep()
        return result

    def _sweep(self) -> int:
        maps = {self.map_path(s).name for s in self.catalog.all()}
        layers = {f"{layer:016x}.layer" for layer in self.catalog.layers_in_use()}
        freed = 0
        for path in self.objects.iterdir():
            if path.name not in maps and path.name not in layers:
                freed += _unlink(path)
        for path in self.staging.iterdir():
            pid = path.name.split(".")[1] if path.name.count(".") >= 2 else ""
            if pid.isdigit() and not process_alive(int(pid)):
                freed += _unlink(path)
        return freed

    def verify(self, snapshot_id: str | None = None) -> dict[str, list[str]]:
        """Problems found, by snapshot id ("catalog" for the catalog itself).

        Checks the catalog's integrity, every map against its digest, that
        snapshot files are read-only, that every layer a snapshot uses exists,
        and every stored range against its CRC32C.
        """
        problems: dict[str, list[str]] = {}
        catalog = self.catalog.integrity_problems()
        if catalog:
            problems["catalog"] = catalog
        snaps = [self.get(snapshot_id)] if snapshot_id else self.catalog.all()
        checked_layers: dict[int, list[str]] = {}
        for snap in snaps:
            found: list[str] = []
            path = self.map_path(snap)
            try:
                smap = self.load_map(snap, cached=False)
            except (OSError, StoreError, ValueError) as e:
                problems[snap.id] = [f"map: {getattr(e, 'strerror', None) or e}"]
                continue
            for layer in np.unique(smap.pieces.layer):
                if int(layer) not in checked_layers:
                    checked_layers[int(layer)] = self._check_layer(int(layer))
                found += checked_layers[int(layer)]
            if os.stat(path).st_mode & 0o222:
                found.append(f"{path.name} is writable")
            own = self.objects / f"{smap.own_layer:016x}.layer"
            if own.exists():
                found += self._check_own_ranges(own, smap)
            if found:
                problems[snap.id] = sorted(set(found))
        return problems

    def _check_layer(self, layer: int) -> list[str]:
        path = self.objects / f"{layer:016x}.layer"
        if not path.exists():
            return [f"layer {path.name} is missing"]
        if os.stat(path).st_mode & 0o222:
            return [f"{path.name} is writable"]
        return []

    def _check_own_ranges(self, path: Path, smap: SnapshotMap) -> list[str]:
        with open(path, "rb") as f:
            try:
                crcs, _ = native.transfer_ranges(f.fileno(), -1, smap.own_pos, None,
                                                 smap.own_length, path, checksums=True)
            except OSError as e:
                return [f"{path.name}: {e.strerror}"]
        bad = int((crcs != smap.own_crc).sum())
        return [f"{path.name}: {bad} range(s) fail their checksum"] if bad else []

    def diff(self, a: str, b: str):
        """The ranges where snapshot ``b`` differs from snapshot ``a``."""
        snap_a, snap_b = self.get(a), self.get(b)
        if self.copy_mode:
            with self._materialized(snap_b) as path_b, self._materialized(snap_a) as path_a:
                with open(path_b, "rb") as f:
                    return _compare_with_file(f.fileno(), str(path_b), path_a)
        map_a, map_b = self.load_map(snap_a), self.load_map(snap_b)
        return changed_ranges(map_b.extents, map_a.extents, BLOCK)


def read_export_record(path: str) -> dict:
    """The record at the end of an export file, checked for shape."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        if end < 16:
            raise InvalidDiff(f"{path} is not a blockdiff export (too short)")
        f.seek(end - 16)
        length, magic = struct.unpack("<Q8s", f.read(16))
        if magic != EXPORT_MAGIC or length > end - 16:
            raise InvalidDiff(f"{path} is not a blockdiff export; make one with: "
                              f"blockdiff export --store S ID OUT")
        f.seek(end - 16 - length)
        try:
            record = json.loads(f.read(length))
            snapshot_id = record["snapshot"]["id"]
            well_formed = (record.get("format") == "blockdiff-export" and "base" in record
                           and isinstance(snapshot_id, str) and len(snapshot_id) == 16
                           and all(c in "0123456789abcdef" for c in snapshot_id))
        except (ValueError, KeyError, TypeError, AttributeError):
            well_formed = False
    if not well_formed:
        raise InvalidDiff(f"{path} has a damaged export record; export it again")
    return record


def open_store(path: str | os.PathLike | None) -> Store:
    """The store at ``path``, or at $BLOCKDIFF_STORE."""
    path = path or os.environ.get(STORE_ENV)
    if not path:
        raise UsageError(f"no store given; pass --store DIR or set {STORE_ENV}")
    return Store(path)
